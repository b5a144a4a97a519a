// Conversations kept in localStorage: one JSON array, the newest first.

const ITEM = 'mlxcel.conversations';
const CURRENT = 'mlxcel.current';

export const SETTING_FIELDS = ['temperature', 'top_p', 'top_k', 'min_p', 'max_tokens', 'seed'];

function load() {
  try {
    const list = JSON.parse(localStorage.getItem(ITEM) || '[]');
    return Array.isArray(list) ? list : [];
  } catch {
    return [];
  }
}

export const conversations = load();

export function save() {
  try {
    localStorage.setItem(ITEM, JSON.stringify(conversations));
  } catch (e) {
    // storage full (large image attachments): the conversation stays in this tab only
    console.warn('conversations not saved:', e);
  }
}

export function create() {
  const conv = {
    id: crypto.randomUUID ? crypto.randomUUID() : String(Date.now()) + Math.random(),
    title: 'New chat', created: Date.now(), system: '', settings: {}, grammar: '', json_schema: '', extra: '',
    steering: { profile: '', intensity: '', dials: {}, activations: true }, messages: [],
  };
  conversations.unshift(conv);
  save();
  return conv;
}

export function find(id) {
  return conversations.find((c) => c.id === id) || null;
}

export function remove(id) {
  const i = conversations.findIndex((c) => c.id === id);
  if (i >= 0) conversations.splice(i, 1);
  save();
}

export function current() {
  return find(localStorage.getItem(CURRENT)) || conversations[0] || create();
}

export function select(conv) {
  localStorage.setItem(CURRENT, conv.id);
}

// Downloads every conversation as one JSON file.
export function exportAll() {
  const blob = new Blob([JSON.stringify(conversations, null, 2)], { type: 'application/json' });
  const a = document.createElement('a');
  a.href = URL.createObjectURL(blob);
  a.download = `mlxcel-conversations-${new Date().toISOString().slice(0, 19).replace(/:/g, '')}.json`;
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(a.href), 1000);
}
