// The page's entry point: the conversation list, the settings panel, the model picker (router
// mode), attachments when the model takes images or audio, and the composer.

import { apiKey, getJSON } from './api.js';
import * as chat from './chat.js';
import * as steer from './steer.js';
import * as store from './store.js';

const $ = (id) => document.getElementById(id);
const MODEL_ITEM = 'mlxcel.model';
let attachments = [];
let modalities = { vision: false, audio: false };

function renderList() {
  const list = $('conversations');
  list.replaceChildren(...store.conversations.map((conv) => {
    const li = document.createElement('li');
    li.classList.toggle('active', conv === chat.state.conv);
    const title = document.createElement('button');
    Object.assign(title, { type: 'button', className: 'title', textContent: conv.title, title: conv.title });
    title.addEventListener('click', () => open(conv));
    const rename = document.createElement('button');
    Object.assign(rename, { type: 'button', className: 'rename', textContent: '✎', title: 'Rename' });
    rename.addEventListener('click', () => renameConv(conv));
    const del = document.createElement('button');
    Object.assign(del, { type: 'button', className: 'delete', textContent: '×', title: 'Delete' });
    del.addEventListener('click', () => deleteConv(conv));
    li.append(title, rename, del);
    return li;
  }));
  $('forget-key').hidden = !apiKey.get();
}

function renameConv(conv) {
  const dialog = $('rename-dialog');
  $('rename-input').value = conv.title;
  dialog.addEventListener('close', () => {
    const title = $('rename-input').value.trim();
    if (dialog.returnValue === 'ok' && title) {
      conv.title = title;
      store.save();
      renderList();
    }
  }, { once: true });
  dialog.showModal();
}

function deleteConv(conv) {
  if (chat.state.ctrl && conv === chat.state.conv) chat.stop();
  store.remove(conv.id);
  if (conv === chat.state.conv) open(store.conversations[0] || store.create());
  else renderList();
}

function fillSettings(conv) {
  $('s-system').value = conv.system;
  for (const f of store.SETTING_FIELDS) $(`s-${f}`).value = conv.settings[f] ?? '';
  for (const f of ['grammar', 'json_schema', 'extra']) $(`s-${f}`).value = conv[f];
}

function wireSettings() {
  $('s-system').addEventListener('input', () => { chat.state.conv.system = $('s-system').value; store.save(); });
  for (const f of store.SETTING_FIELDS) {
    $(`s-${f}`).addEventListener('input', () => { chat.state.conv.settings[f] = $(`s-${f}`).value; store.save(); });
  }
  for (const f of ['grammar', 'json_schema', 'extra']) {
    $(`s-${f}`).addEventListener('input', () => { chat.state.conv[f] = $(`s-${f}`).value; store.save(); });
  }
}

function open(conv) {
  if (chat.state.ctrl) chat.stop();
  chat.state.conv = conv;
  store.select(conv);
  fillSettings(conv);
  steer.bind(conv);
  chat.showError('');
  chat.renderMessages();
  renderList();
}

function renderAttachments() {
  $('attachments').replaceChildren(...attachments.map((a, i) => {
    const chip = document.createElement('button');
    Object.assign(chip, { type: 'button', className: 'chip', textContent: `${a.name} ×`, title: 'Remove' });
    chip.addEventListener('click', () => { attachments.splice(i, 1); renderAttachments(); });
    return chip;
  }));
}

function readFile(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

async function attach(files) {
  for (const file of files) {
    const kind = file.type.startsWith('image/') ? 'image' : file.type.startsWith('audio/') ? 'audio' : null;
    if (!kind || (kind === 'image' && !modalities.vision) || (kind === 'audio' && !modalities.audio)) {
      chat.showError(`${file.name}: this model does not take ${kind || file.type || 'this kind of file'}`);
      continue;
    }
    const format = /mpeg|mp3/.test(file.type) ? 'mp3' : 'wav';
    attachments.push({ kind, name: file.name, url: await readFile(file), format });
  }
  renderAttachments();
}

async function loadModel() {
  const model = chat.state.router ? chat.state.model : '';
  const props = await getJSON(model ? `props?model=${encodeURIComponent(model)}` : 'props');
  modalities = { vision: !!props?.modalities?.vision, audio: !!props?.modalities?.audio };
  $('attach-label').hidden = !(modalities.vision || modalities.audio);
  $('attach').accept = [modalities.vision && 'image/*', modalities.audio && 'audio/*'].filter(Boolean).join(',');
  if (!chat.state.router) $('model-name').textContent = props?.model_alias || '';
  await steer.load(() => (chat.state.router ? chat.state.model : ''));
  steer.bind(chat.state.conv);
}

// Router mode: /models lists every model with its load state; the pick names the model of
// each request.
async function loadModels() {
  const list = await getJSON('models');
  const entries = list?.data || [];
  chat.state.router = entries.some((m) => m.status && typeof m.status === 'object');
  const picker = $('model-picker');
  picker.hidden = !chat.state.router;
  if (chat.state.router) {
    const saved = localStorage.getItem(MODEL_ITEM);
    picker.replaceChildren(...entries.map((m) => {
      const o = document.createElement('option');
      o.value = m.id;
      o.textContent = `${m.id} (${m.status.value})`;
      return o;
    }));
    chat.state.model = entries.some((m) => m.id === saved) ? saved : entries[0]?.id || '';
    picker.value = chat.state.model;
  }
  await loadModel();
}

function wire() {
  $('new-chat').addEventListener('click', () => open(store.create()));
  $('export').addEventListener('click', store.exportAll);
  $('forget-key').addEventListener('click', () => { apiKey.set(''); renderList(); });
  $('toggle-settings').addEventListener('click', () => { $('settings').hidden = !$('settings').hidden; });
  $('toggle-steering').addEventListener('click', () => { $('steering').hidden = !$('steering').hidden; });
  $('stop').addEventListener('click', chat.stop);
  $('attach').addEventListener('change', () => { attach([...$('attach').files]); $('attach').value = ''; });
  $('model-picker').addEventListener('change', () => {
    chat.state.model = $('model-picker').value;
    localStorage.setItem(MODEL_ITEM, chat.state.model);
    loadModel();
  });
  $('composer').addEventListener('submit', (e) => {
    e.preventDefault();
    const text = $('prompt').value.trim();
    if (chat.state.ctrl || (!text && !attachments.length)) return;
    const sent = attachments;
    attachments = [];
    $('prompt').value = '';
    renderAttachments();
    chat.send(text, sent).then((ok) => {
      if (ok) return;
      $('prompt').value = text;  // kept for another try once the settings are fixed
      attachments = sent;
      renderAttachments();
    });
  });
  $('prompt').addEventListener('keydown', (e) => {
    if (e.key === 'Enter' && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      $('composer').requestSubmit();
    }
  });
  document.addEventListener('apikey', renderList);
  wireSettings();
  steer.wire();
  chat.state.onChange = renderList;
}

wire();
open(store.current());
loadModels().then(() => document.body.classList.add('ready'));
