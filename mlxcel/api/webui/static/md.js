// A small markdown renderer for model output. It builds DOM nodes and sets only textContent
// and safe attributes, so text from the model never becomes markup: a `<script>` or an
// `onerror` attribute in an answer is shown as the characters it is.
// Blocks: fenced code, headings, lists, quotes, $$ math $$ (shown as code-styled text),
// paragraphs. Inline: `code`, **bold**, *italic*, [links](with http, https or mailto only), $math$.

const SAFE_SCHEMES = new Set(['http:', 'https:', 'mailto:']);
const INLINE = /(`+)([\s\S]*?[^`])\1(?!`)|\*\*(?=\S)([\s\S]*?\S)\*\*|__(?=\S)([\s\S]*?\S)__|\*(?=\S)([^*]*?\S)\*|(?<![\w])_(?=\S)([^_]*?\S)_(?![\w])|\[([^\]\n]+)\]\(([^)\s]+)\)|\$(?=\S)([^$\n]*?\S)\$/g;

function el(tag, cls, text) {
  const node = document.createElement(tag);
  if (cls) node.className = cls;
  if (text !== undefined) node.textContent = text;
  return node;
}

export function safeHref(url) {
  try {
    const u = new URL(url, document.baseURI);
    return SAFE_SCHEMES.has(u.protocol) ? u.href : null;
  } catch {
    return null;
  }
}

function inline(parent, text) {
  let last = 0;
  for (const m of text.matchAll(INLINE)) {
    if (m.index > last) parent.append(text.slice(last, m.index));
    last = m.index + m[0].length;
    if (m[1]) parent.append(el('code', null, m[2]));
    else if (m[3] !== undefined || m[4] !== undefined) inline(parent.appendChild(el('strong')), m[3] ?? m[4]);
    else if (m[5] !== undefined || m[6] !== undefined) inline(parent.appendChild(el('em')), m[5] ?? m[6]);
    else if (m[7] !== undefined) {
      const href = safeHref(m[8]);
      if (href === null) { parent.append(m[0]); continue; }
      const a = el('a', null, m[7]);
      a.href = href;
      a.rel = 'noopener noreferrer nofollow';
      a.target = '_blank';
      parent.append(a);
    } else parent.append(el('code', 'math', m[9]));
  }
  if (last < text.length) parent.append(text.slice(last));
}

const KEYWORDS = new Set(('if else elif for while do return function def class import from export const let var new ' +
  'try catch except finally raise throw with as in of not and or is None null true false True False self this ' +
  'fn pub struct enum impl match use mut async await yield lambda break continue switch case default static void int').split(' '));
const TOKENS = /(\/\/[^\n]*|#[^\n]*|\/\*[\s\S]*?\*\/)|("(?:\\.|[^"\\\n])*"|'(?:\\.|[^'\\\n])*'|`(?:\\.|[^`\\])*`)|(\b\d[\d_.]*(?:e[+-]?\d+)?\b)|([A-Za-z_]\w*)/g;

// Colours comments, strings, numbers and keywords; every piece is text in a span.
export function highlight(code, lang) {
  const out = el('code', lang ? `lang-${lang}` : null);
  if (!lang) { out.textContent = code; return out; }
  let last = 0;
  for (const m of code.matchAll(TOKENS)) {
    const cls = m[1] ? 'tok-c' : m[2] ? 'tok-s' : m[3] ? 'tok-n' : KEYWORDS.has(m[4]) ? 'tok-k' : null;
    if (!cls) continue;
    if (m.index > last) out.append(code.slice(last, m.index));
    out.append(el('span', cls, m[0]));
    last = m.index + m[0].length;
  }
  if (last < code.length) out.append(code.slice(last));
  return out;
}

function listItem(line) {
  const m = /^(\s*)([-*+]|\d+[.)])\s+(.*)$/.exec(line);
  return m ? { indent: m[1].length, ordered: /\d/.test(m[2]), text: m[3] } : null;
}

// Renders `source` into a fresh <div> and returns it.
export function renderMarkdown(source) {
  const root = el('div', 'md');
  const lines = source.replace(/\r\n?/g, '\n').split('\n');
  let i = 0;
  let para = [];
  const flush = () => {
    if (para.length) inline(root.appendChild(el('p')), para.join('\n'));
    para = [];
  };
  while (i < lines.length) {
    const line = lines[i];
    const fence = /^\s*(```+|~~~+)\s*([\w+#.-]*)/.exec(line);
    if (fence) {
      flush();
      const body = [];
      for (i++; i < lines.length && !lines[i].trim().startsWith(fence[1]); i++) body.push(lines[i]);
      i++;
      root.appendChild(el('pre')).append(highlight(body.join('\n'), fence[2]));
      continue;
    }
    if (line.trim().startsWith('$$')) {
      flush();
      const body = [line.trim().slice(2)];
      if (!(body[0].endsWith('$$') && body[0].length >= 2)) {
        for (i++; i < lines.length && !lines[i].includes('$$'); i++) body.push(lines[i]);
        if (i < lines.length) body.push(lines[i].replace('$$', ''));
      } else body[0] = body[0].slice(0, -2);
      i++;
      root.appendChild(el('pre', 'math')).append(el('code', 'math', body.join('\n').trim()));
      continue;
    }
    const heading = /^(#{1,6})\s+(.*)$/.exec(line);
    if (heading) {
      flush();
      inline(root.appendChild(el(`h${Math.min(heading[1].length + 2, 6)}`)), heading[2]);
      i++;
      continue;
    }
    if (line.startsWith('>')) {
      flush();
      const body = [];
      for (; i < lines.length && lines[i].startsWith('>'); i++) body.push(lines[i].replace(/^>\s?/, ''));
      root.appendChild(el('blockquote')).append(renderMarkdown(body.join('\n')));
      continue;
    }
    if (listItem(line)) {
      flush();
      const first = listItem(line);
      const list = root.appendChild(el(first.ordered ? 'ol' : 'ul'));
      for (; i < lines.length && listItem(lines[i]); i++) inline(list.appendChild(el('li')), listItem(lines[i]).text);
      continue;
    }
    if (!line.trim()) flush();
    else para.push(line);
    i++;
  }
  flush();
  return root;
}
