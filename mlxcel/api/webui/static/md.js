// A small markdown renderer for model output. It builds DOM nodes and sets only textContent
// and safe attributes, so text from the model never becomes markup: a `<script>` or an
// `onerror` attribute in an answer is shown as the characters it is.
// Blocks: fenced code, headings, lists, quotes, pipe tables, display math ($$ $$ or \[ \]),
// paragraphs. Inline: `code`, **bold**, *italic*, [links](with http, https or mailto only),
// math ($ $, $$ $$ or \( \)). Math becomes MathML (math.js); TeX outside its subset is shown as
// code-styled text.

import { renderMath } from './math.js';

const SAFE_SCHEMES = new Set(['http:', 'https:', 'mailto:']);
// A closing `$` followed by a digit is a price, not math ("$5 and $10").
const INLINE = new RegExp([
  /(`+)([\s\S]*?[^`])\1(?!`)/, /\*\*(?=\S)([\s\S]*?\S)\*\*/, /__(?=\S)([\s\S]*?\S)__/, /\*(?=\S)([^*]*?\S)\*/,
  /(?<![\w])_(?=\S)([^_]*?\S)_(?![\w])/, /\[([^\]\n]+)\]\(([^)\s]+)\)/, /\$\$([^$]+?)\$\$/, /\\\(([\s\S]+?)\\\)/,
  /\$(?=\S)([^$\n]*?\S)\$(?!\d)/,
].map((r) => r.source).join('|'), 'g');
const TABLE_RULE = /^\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$/;
const MATH_BLOCKS = [['$$', '$$'], ['\\[', '\\]']];

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

// MathML for `tex`, or the source as code-styled text when it is outside the subset.
function math(tex, display) {
  const node = renderMath(tex, display);
  if (node) return node;
  if (!display) return el('code', 'math', tex);
  const pre = el('pre', 'math');
  pre.append(el('code', 'math', tex));
  return pre;
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
    } else if (m[9] !== undefined) parent.append(math(m[9], true));
    else parent.append(math(m[10] ?? m[11], false));
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

// Display math from lines[i] to the line holding the closing delimiter; returns the next index.
function mathBlock(root, lines, i, [open, close]) {
  let body = lines[i].trim().slice(open.length);
  let end = body.indexOf(close);
  while (end < 0 && ++i < lines.length) {
    body += '\n' + lines[i];
    end = body.indexOf(close, body.length - lines[i].length);
  }
  const tex = (end < 0 ? body : body.slice(0, end)).trim();
  const rest = end < 0 ? '' : body.slice(end + close.length).trim();
  const shown = math(tex, true);
  if (shown.localName === 'pre') root.append(shown);
  else root.appendChild(el('div', 'math-display')).append(shown);
  if (rest) inline(root.appendChild(el('p')), rest);
  return i + 1;
}

// The cells of one table row: outer pipes dropped, split on pipes that are not escaped.
function cells(line) {
  const text = line.trim().replace(/^\|/, '').replace(/(?<!\\)\|$/, '');
  return text.split(/(?<!\\)\|/).map((c) => c.trim().replace(/\\\|/g, '|'));
}

// A GFM pipe table from its header at lines[i]: the node and the index after its last row, or
// null when the header and the rule under it have different numbers of cells.
function pipeTable(lines, i) {
  const head = cells(lines[i]);
  const rule = cells(lines[i + 1]);
  if (head.length !== rule.length) return null;
  const align = rule.map((r) => (r.endsWith(':') ? (r.startsWith(':') ? 'center' : 'right') : r.startsWith(':') ? 'left' : ''));
  const table = el('table');
  const fill = (tr, tag, values) => align.forEach((a, k) => {
    const cell = tr.appendChild(el(tag, a ? `align-${a}` : null));
    inline(cell, values[k] ?? '');
  });
  fill(table.appendChild(el('thead')).appendChild(el('tr')), 'th', head);
  const body = table.appendChild(el('tbody'));
  let j = i + 2;
  for (; j < lines.length && lines[j].trim() && lines[j].includes('|'); j++) fill(body.appendChild(el('tr')), 'td', cells(lines[j]));
  const wrap = el('div', 'table-wrap');
  wrap.append(table);
  return { node: wrap, end: j };
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
    const mathOpen = MATH_BLOCKS.find(([open]) => line.trim().startsWith(open));
    if (mathOpen) {
      flush();
      i = mathBlock(root, lines, i, mathOpen);
      continue;
    }
    if (line.includes('|') && i + 1 < lines.length && TABLE_RULE.test(lines[i + 1])) {
      const table = pipeTable(lines, i);
      if (table) {
        flush();
        root.append(table.node);
        i = table.end;
        continue;
      }
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
