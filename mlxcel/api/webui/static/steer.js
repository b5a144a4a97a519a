// The steering panel: the attached SAEs (management API under api/), saved profiles, an
// intensity dial, per-feature dials for the next messages, and the heat map of a finished
// answer's top activated features per token.
//
// Per-request steering on /v1/chat/completions names a stored profile, so the dials are written
// to one profile of the page's own (DIAL_PROFILE) just before a message goes out, and the
// request names it: the server's live steering is never changed by the page.

import { getJSON, request } from './api.js';
import * as store from './store.js';

export const DIAL_PROFILE = 'webui-dials';
const TOP_K = 5;
const panel = { saes: [], profiles: [], conv: null, router: null, labels: new Map() };
const $ = (id) => document.getElementById(id);

function el(tag, cls, text) {
  const node = document.createElement(tag);
  if (cls) node.className = cls;
  if (text !== undefined) node.textContent = text;
  return node;
}

function withModel(path) {
  const model = panel.router?.();
  return model ? `${path}${path.includes('?') ? '&' : '?'}model=${encodeURIComponent(model)}` : path;
}

export async function load(routerModel) {
  panel.router = routerModel;
  const saes = await getJSON(withModel('api/saes'));
  panel.saes = saes?.success ? saes.data : [];
  const profiles = panel.saes.length ? await getJSON(withModel('api/profiles')) : null;
  panel.profiles = (profiles?.success ? profiles.data : []).filter((p) => p.name !== DIAL_PROFILE);
  $('toggle-steering').hidden = !panel.saes.length;
  if (!panel.saes.length) $('steering').hidden = true;
  renderPanel();
}

function sae() {
  return panel.saes[0] || null;
}

export function bind(conv) {
  panel.conv = conv;
  renderPanel();
}

function renderPanel() {
  const conv = panel.conv;
  if (!conv) return;
  const s = conv.steering;
  $('saes').replaceChildren(...panel.saes.map((a) => el('div', 'hint',
    `SAE ${a.sae_id}: layer ${a.layer}, ${a.d_sae} features${a.enabled ? '' : ' (disabled)'}`)));
  const select = $('profile');
  select.replaceChildren(el('option', null, '(none)'), ...panel.profiles.map((p) => el('option', null, p.name)));
  select.options[0].value = '';
  select.value = s.profile;
  $('intensity').value = s.intensity === '' ? 1 : s.intensity;
  $('intensity-out').textContent = s.intensity === '' ? 'default' : s.intensity;
  $('show-activations').checked = s.activations;
  renderDials();
}

function renderDials() {
  const dials = panel.conv.steering.dials;
  $('dials').replaceChildren(...Object.keys(dials).map((index) => {
    const li = el('li');
    li.dataset.feature = index;
    const range = el('input');
    Object.assign(range, { type: 'range', min: -100, max: 100, step: 1, value: dials[index] });
    const num = el('input', 'dial-value');
    Object.assign(num, { type: 'number', step: 'any', value: dials[index] });
    const set = (v) => {
      dials[index] = Number(v) || 0;
      range.value = num.value = dials[index];
      store.save();
    };
    range.addEventListener('input', () => set(range.value));
    num.addEventListener('change', () => set(num.value));
    const drop = el('button', null, '×');
    drop.type = 'button';
    drop.title = 'Remove dial';
    drop.addEventListener('click', () => { delete dials[index]; store.save(); renderDials(); });
    li.append(el('span', null, `#${index}${label(index)}`), range, num, drop);
    return li;
  }));
}

function label(index) {
  const l = panel.labels.get(Number(index));
  return l ? ` (${l})` : '';
}

export function addDial(index) {
  const dials = panel.conv.steering.dials;
  if (!(index in dials)) dials[index] = 0;
  store.save();
  renderDials();
  $('steering').hidden = false;
}

// Features matching the search: an index, or a label (the tokens a feature fired on most in
// this page's answers).
function search(text) {
  const a = sae();
  const out = [];
  const q = text.trim().toLowerCase();
  if (a && /^\d+$/.test(q) && Number(q) < a.d_sae) out.push(Number(q));
  if (q) for (const [index, l] of panel.labels) if (l.toLowerCase().includes(q) && !out.includes(index)) out.push(index);
  $('feature-results').replaceChildren(...out.slice(0, 20).map((index) => {
    const li = el('li');
    const add = el('button', null, 'Dial');
    add.type = 'button';
    add.addEventListener('click', () => addDial(index));
    li.append(el('span', null, `#${index}${label(index)}`), add);
    return li;
  }));
}

export function wire() {
  $('profile').addEventListener('change', () => { panel.conv.steering.profile = $('profile').value; store.save(); });
  $('intensity').addEventListener('input', () => {
    panel.conv.steering.intensity = $('intensity').value;
    $('intensity-out').textContent = $('intensity').value;
    store.save();
  });
  $('intensity').addEventListener('dblclick', () => { panel.conv.steering.intensity = ''; store.save(); renderPanel(); });
  $('show-activations').addEventListener('change', () => {
    panel.conv.steering.activations = $('show-activations').checked;
    store.save();
  });
  $('feature-search').addEventListener('input', () => search($('feature-search').value));
  $('clear-dials').addEventListener('click', () => { panel.conv.steering.dials = {}; store.save(); renderDials(); });
}

async function writeDialProfile(a, values) {
  const body = { sae_id: a.sae_id, layer: a.layer, steering: values, description: 'dials of the mlxcel chat page' };
  const path = withModel(`api/profiles/${DIAL_PROFILE}`);
  let r = await request(path, { method: 'PUT', json: body });
  if (r.status === 404) r = await request(withModel('api/profiles'), { json: { name: DIAL_PROFILE, ...body } });
  if (!r.ok) throw new Error(`the steering dials could not be saved: ${r.status}`);
}

// The steering fields of the next request (profile, steering_intensity, return_sae_activations).
export async function requestFields(conv) {
  const a = sae();
  const s = conv.steering;
  const out = {};
  if (!a) return out;
  const dials = Object.fromEntries(Object.entries(s.dials).filter(([, v]) => Number(v) !== 0));
  if (Object.keys(dials).length) {
    const base = panel.profiles.find((p) => p.name === s.profile && p.sae_id === a.sae_id);
    await writeDialProfile(a, { ...(base?.steering || {}), ...dials });
    out.profile = DIAL_PROFILE;
  } else if (s.profile) out.profile = s.profile;
  if (s.intensity !== '') out.steering_intensity = Number(s.intensity);
  if (s.activations) out.return_sae_activations = { sae_id: a.sae_id, top_k: TOP_K, positions: 'completion' };
  return out;
}

// The text of each activation row's token, kept on the message.
export async function tokenTexts(msg) {
  const ids = [...new Set(msg.activations.positions.map((p) => p.token_id))];
  const model = panel.router?.();
  const texts = await Promise.all(ids.map(async (id) => {
    const body = await getJSON('detokenize', { json: model ? { tokens: [id], model } : { tokens: [id] } });
    return body?.content ?? `<${id}>`;
  }));
  const byId = new Map(ids.map((id, i) => [id, texts[i]]));
  msg.tokens = msg.activations.positions.map((p) => byId.get(p.token_id));
  learnLabels(msg);
}

function learnLabels(msg) {
  const best = new Map();
  msg.activations.positions.forEach((p, i) => {
    for (const f of p.features) {
      const prev = best.get(f.index);
      if (!prev || f.value > prev.value) best.set(f.index, { value: f.value, token: msg.tokens[i].trim() });
    }
  });
  for (const [index, b] of best) if (b.token) panel.labels.set(index, b.token);
}

function paint(spans, values) {
  const max = Math.max(...values, 1e-9);
  spans.forEach((span, i) => {
    const alpha = Math.max(values[i], 0) / max;
    span.style.backgroundColor = `rgba(255, 140, 0, ${(alpha * 0.75).toFixed(3)})`;
  });
}

// The per-token heat map of a finished answer: shaded by each token's strongest feature; a
// click on a token lists its features, a click on a feature shades every token by it.
export function heatmap(msg) {
  const box = el('div', 'heatmap');
  const acts = msg.activations;
  box.append(el('div', 'hint', `Top features per token (SAE ${acts.sae_id}, layer ${acts.layer}, ${acts.read_point})`));
  const line = el('div', 'tokens');
  const detail = el('ul', 'features');
  const spans = acts.positions.map((p, i) => {
    const span = el('span', 'tok', msg.tokens[i]);
    span.dataset.position = p.position;
    span.title = p.features.map((f) => `#${f.index} ${f.value.toFixed(2)}`).join('\n');
    span.addEventListener('click', () => {
      spans.forEach((s) => s.classList.remove('selected'));
      span.classList.add('selected');
      detail.replaceChildren(...p.features.map((f) => {
        const li = el('li');
        const show = el('button', 'feature', `#${f.index}`);
        show.type = 'button';
        show.title = 'Shade every token by this feature';
        show.addEventListener('click', () => paint(spans, acts.positions.map(
          (q) => q.features.find((g) => g.index === f.index)?.value ?? 0)));
        const dial = el('button', null, 'Dial');
        dial.type = 'button';
        dial.addEventListener('click', () => addDial(f.index));
        li.append(show, ` ${f.value.toFixed(3)} `, dial);
        return li;
      }));
    });
    return span;
  });
  line.append(...spans);
  paint(spans, acts.positions.map((p) => p.features[0]?.value ?? 0));
  box.append(line, detail);
  return box;
}
