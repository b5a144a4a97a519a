// The conversation view and one streamed answer: messages rendered as text or through md.js,
// the request built from the conversation's settings, the stream read with stop and regenerate.

import { errorText, events, request } from './api.js';
import { renderMarkdown } from './md.js';
import * as store from './store.js';
import * as steer from './steer.js';

export const state = { conv: null, ctrl: null, router: false, model: '', onChange: () => {} };

const $ = (id) => document.getElementById(id);

function el(tag, cls, text) {
  const node = document.createElement(tag);
  if (cls) node.className = cls;
  if (text !== undefined) node.textContent = text;
  return node;
}

export function showError(text) {
  $('error').hidden = !text;
  $('error').textContent = text || '';
}

function stats(msg) {
  const u = msg.usage;
  if (!u) return '';
  const t = msg.timings;
  const speed = t?.predicted_per_second ?? (msg.elapsed > 0 ? u.completion_tokens / msg.elapsed : null);
  const parts = [`${u.completion_tokens} tokens`, `prompt ${u.prompt_tokens}`];
  if (speed) parts.push(`${speed.toFixed(1)} tok/s`);
  if (msg.finish) parts.push(`finish: ${msg.finish}`);
  return parts.join(' · ');
}

function userBody(msg) {
  const body = el('div', 'body', msg.content);
  for (const a of msg.attachments || []) {
    if (a.kind === 'image' && a.url.startsWith('data:image/')) {
      const img = el('img', 'attachment');
      img.src = a.url;
      img.alt = a.name;
      body.append(img);
    } else body.append(el('div', 'status', `attached: ${a.name}`));
  }
  return body;
}

function toolCalls(msg) {
  const out = [];
  for (const call of msg.tool_calls || []) {
    const d = el('details', 'tool-call');
    d.open = true;
    d.append(el('summary', null, `Tool call: ${call.function?.name || '?'}`), el('pre', null, call.function?.arguments || ''));
    out.push(d);
  }
  return out;
}

export function messageView(msg, index, last) {
  const view = el('div', `msg ${msg.role}`);
  view.dataset.index = index;
  view.append(el('div', 'who', msg.role));
  if (msg.role === 'user') {
    view.append(userBody(msg));
    return view;
  }
  if (msg.reasoning) {
    const d = el('details', 'reasoning');
    d.append(el('summary', null, 'Reasoning'), el('pre', null, msg.reasoning));
    view.append(d);
  }
  const body = renderMarkdown(msg.content || '');
  body.classList.add('body');
  view.append(body, ...toolCalls(msg));
  if (msg.stopped) view.append(el('div', 'status', 'stopped'));
  if (msg.error) view.append(el('div', 'status error', msg.error));
  if (msg.usage) view.append(el('div', 'stats', stats(msg)));
  if (msg.activations && msg.tokens) view.append(steer.heatmap(msg));
  if (last && !state.ctrl) {
    const actions = el('div', 'actions');
    const regen = el('button', 'regenerate', 'Regenerate');
    regen.type = 'button';
    regen.addEventListener('click', regenerate);
    actions.append(regen);
    view.append(actions);
  }
  return view;
}

export function renderMessages() {
  const box = $('messages');
  const msgs = state.conv.messages;
  box.replaceChildren(...msgs.map((m, i) => messageView(m, i, i === msgs.length - 1)));
  box.scrollTop = box.scrollHeight;
}

let pending = false;
function updateLast() {
  if (pending) return;
  pending = true;
  requestAnimationFrame(() => {
    pending = false;
    const box = $('messages');
    const msgs = state.conv.messages;
    const view = messageView(msgs[msgs.length - 1], msgs.length - 1, true);
    box.lastElementChild ? box.lastElementChild.replaceWith(view) : box.append(view);
    box.scrollTop = box.scrollHeight;
  });
}

function apiMessage(m) {
  if (m.role === 'user' && m.attachments?.length) {
    const parts = m.content ? [{ type: 'text', text: m.content }] : [];
    for (const a of m.attachments) {
      if (a.kind === 'image') parts.push({ type: 'image_url', image_url: { url: a.url } });
      else parts.push({ type: 'input_audio', input_audio: { data: a.url.split(',', 2)[1], format: a.format } });
    }
    return { role: 'user', content: parts };
  }
  const out = { role: m.role, content: m.content };
  if (m.tool_calls?.length) out.tool_calls = m.tool_calls;
  return out;
}

function parseJSON(text, what) {
  try {
    return JSON.parse(text);
  } catch (e) {
    throw new Error(`${what} is not valid JSON: ${e.message}`);
  }
}

// The /v1/chat/completions body for the conversation so far (the answer slot excluded).
export async function buildBody(conv) {
  const history = conv.messages.filter((m) => m.role === 'user' || m.content || m.tool_calls?.length);
  const messages = conv.system ? [{ role: 'system', content: conv.system }] : [];
  const body = { messages: messages.concat(history.map(apiMessage)), stream: true,
    stream_options: { include_usage: true } };
  for (const f of store.SETTING_FIELDS) {
    const v = conv.settings[f];
    if (v !== undefined && v !== '') body[f] = Number(v);
  }
  if (conv.grammar.trim()) body.grammar = conv.grammar;
  // llama-server's json_schema field: it streams, where OpenAI's response_format is refused with stream
  if (conv.json_schema.trim()) body.json_schema = parseJSON(conv.json_schema, 'The JSON schema');
  if (conv.extra.trim()) {
    const extra = parseJSON(conv.extra, 'Extra request fields');
    if (typeof extra !== 'object' || Array.isArray(extra) || extra === null) throw new Error('Extra request fields must be a JSON object');
    Object.assign(body, extra);
  }
  if (state.router && state.model) body.model = state.model;
  Object.assign(body, await steer.requestFields(conv));
  return body;
}

function merge(msg, delta) {
  if (delta.content) msg.content += delta.content;
  if (delta.reasoning_content) msg.reasoning = (msg.reasoning || '') + delta.reasoning_content;
  for (const call of delta.tool_calls || []) {
    msg.tool_calls = msg.tool_calls || [];
    const slot = (msg.tool_calls[call.index ?? msg.tool_calls.length] ??= { id: '', type: 'function', function: { name: '', arguments: '' } });
    if (call.id) slot.id = call.id;
    if (call.function?.name) slot.function.name += call.function.name;
    if (call.function?.arguments) slot.function.arguments += call.function.arguments;
  }
}

function setBusy(busy) {
  $('send').hidden = busy;
  $('stop').hidden = !busy;
}

async function readStream(response, msg, started) {
  let first = null;
  for await (const chunk of events(response)) {
    if (chunk.error) {
      msg.error = chunk.error.message || JSON.stringify(chunk.error);
      break;
    }
    for (const choice of chunk.choices || []) {
      merge(msg, choice.delta || {});
      if (choice.finish_reason) msg.finish = choice.finish_reason;
    }
    if (first === null && (msg.content || msg.reasoning)) first = performance.now();
    if (chunk.usage) msg.usage = chunk.usage;
    if (chunk.timings) msg.timings = chunk.timings;
    if (chunk.millm?.sae_activations) msg.activations = chunk.millm.sae_activations;
    msg.elapsed = (performance.now() - (first ?? started)) / 1000;
    updateLast();
  }
}

// Streams one answer onto the end of the conversation; false when no request could be built.
export async function generate() {
  const conv = state.conv;
  showError('');
  let body;
  try {
    body = await buildBody(conv);
  } catch (e) {
    showError(e.message);
    return false;
  }
  const msg = { role: 'assistant', content: '' };
  conv.messages.push(msg);
  state.ctrl = new AbortController();
  setBusy(true);
  renderMessages();
  const started = performance.now();
  try {
    const response = await request('v1/chat/completions', { json: body, signal: state.ctrl.signal });
    if (!response.ok) msg.error = await errorText(response);
    else await readStream(response, msg, started);
  } catch (e) {
    if (e.name === 'AbortError') msg.stopped = true;
    else msg.error = String(e.message || e);
  }
  state.ctrl = null;
  setBusy(false);
  if (msg.activations) await steer.tokenTexts(msg);
  store.save();
  renderMessages();
  state.onChange();
  return true;
}

export function stop() {
  if (state.ctrl) state.ctrl.abort();
}

export async function regenerate() {
  const msgs = state.conv.messages;
  while (msgs.length && msgs[msgs.length - 1].role === 'assistant') msgs.pop();
  if (!msgs.length) return;
  await generate();
}

// Sends a user message; false (the message taken back) when the settings make no valid request.
export async function send(text, attachments) {
  const conv = state.conv;
  conv.messages.push({ role: 'user', content: text, attachments });
  if (await generate()) {
    if (conv.title === 'New chat') conv.title = (text || attachments[0]?.name || 'New chat').slice(0, 48);
    store.save();
    state.onChange();
    return true;
  }
  conv.messages.pop();
  return false;
}
