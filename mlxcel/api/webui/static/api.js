// Requests to the server that served this page: same origin, paths relative to the page (so an
// --api-prefix is kept), the API key from localStorage as a Bearer token, asked for once on a 401.

const KEY_ITEM = 'mlxcel.apiKey';
const BASE = new URL('.', location.href);
let pendingKey = null;

export const apiKey = {
  get: () => localStorage.getItem(KEY_ITEM) || '',
  set: (key) => (key ? localStorage.setItem(KEY_ITEM, key) : localStorage.removeItem(KEY_ITEM)),
};

export function url(path) {
  return new URL(path.replace(/^\//, ''), BASE);
}

// One dialog however many requests were refused at once.
function askKey() {
  if (pendingKey) return pendingKey;
  const dialog = document.getElementById('key-dialog');
  const input = document.getElementById('key-input');
  input.value = '';
  pendingKey = new Promise((resolve) => {
    dialog.addEventListener('close', () => {
      pendingKey = null;
      resolve(dialog.returnValue === 'ok' && input.value ? input.value : null);
    }, { once: true });
  });
  dialog.showModal();
  return pendingKey;
}

// fetch() against the server; `json` is sent as the body. A 401 asks for the key and retries once.
export async function request(path, { json, method, signal, retried } = {}) {
  const headers = {};
  const key = apiKey.get();
  if (key) headers.Authorization = `Bearer ${key}`;
  const init = { method: method || (json === undefined ? 'GET' : 'POST'), headers, signal };
  if (json !== undefined) {
    headers['Content-Type'] = 'application/json';
    init.body = JSON.stringify(json);
  }
  const response = await fetch(url(path), init);
  if (response.status === 401 && !retried) {
    const given = await askKey();
    if (given !== null) {
      apiKey.set(given);
      document.dispatchEvent(new Event('apikey'));
      return request(path, { json, method, signal, retried: true });
    }
  }
  return response;
}

// The JSON body of a request, or null when it failed.
export async function getJSON(path, options) {
  try {
    const r = await request(path, options);
    return r.ok ? await r.json() : null;
  } catch {
    return null;
  }
}

// The error message of a failed response, in whichever envelope the route uses.
export async function errorText(response) {
  const text = await response.text();
  try {
    const body = JSON.parse(text);
    const e = body.error;
    return `${response.status}: ${typeof e === 'string' ? e : e?.message || text}`;
  } catch {
    return `${response.status}: ${text}`;
  }
}

// The parsed `data:` events of a server-sent event stream, until [DONE].
export async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = '';
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.search(/\r?\n\r?\n/)) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut).replace(/^\r?\n\r?\n/, '');
      const data = block.split(/\r?\n/).filter((l) => l.startsWith('data:')).map((l) => l.slice(5).trimStart()).join('\n');
      if (!data) continue;
      if (data === '[DONE]') return;
      yield JSON.parse(data);
    }
  }
}
