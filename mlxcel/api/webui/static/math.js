// TeX math as MathML (Chromium renders MathML Core). A small parser for the subset answers
// use: \frac, \sqrt, ^ and _, greek letters, common operators and relations, big operators
// with limits, \text, \mathbf / \mathrm / \mathbb, \left...\right and matrix environments.
// Nodes are built with createElementNS from a fixed set of MathML tags and filled with
// textContent only, so nothing in the source can become markup. Anything outside the subset
// throws, and renderMath returns null: the caller shows the source as code-styled text.

const NS = 'http://www.w3.org/1998/Math/MathML';
const TOKEN = /\\[A-Za-z]+|\\[^A-Za-z]|\d+(?:\.\d+)?|\s+|[\s\S]/gu;

const GREEK = Object.fromEntries(('alpha α beta β gamma γ delta δ epsilon ϵ varepsilon ε zeta ζ eta η theta θ ' +
  'vartheta ϑ iota ι kappa κ lambda λ mu μ nu ν xi ξ pi π varpi ϖ rho ρ varrho ϱ sigma σ varsigma ς tau τ ' +
  'upsilon υ phi ϕ varphi φ chi χ psi ψ omega ω Gamma Γ Delta Δ Theta Θ Lambda Λ Xi Ξ Pi Π Sigma Σ ' +
  'Upsilon Υ Phi Φ Psi Ψ Omega Ω infty ∞ partial ∂ nabla ∇ ell ℓ hbar ℏ emptyset ∅ aleph ℵ')
  .split(' ').reduce((acc, v, i, a) => (i % 2 ? acc : [...acc, [v, a[i + 1]]]), []));
const OPS = Object.fromEntries(('cdot ⋅ times × div ÷ pm ± mp ∓ le ≤ leq ≤ ge ≥ geq ≥ ne ≠ neq ≠ approx ≈ ' +
  'equiv ≡ sim ∼ simeq ≃ cong ≅ propto ∝ ll ≪ gg ≫ in ∈ notin ∉ ni ∋ subset ⊂ subseteq ⊆ supset ⊃ ' +
  'supseteq ⊇ cup ∪ cap ∩ setminus ∖ wedge ∧ vee ∨ land ∧ lor ∨ neg ¬ lnot ¬ forall ∀ exists ∃ ' +
  'to → rightarrow → leftarrow ← gets ← Rightarrow ⇒ Leftarrow ⇐ leftrightarrow ↔ Leftrightarrow ⇔ ' +
  'implies ⟹ iff ⟺ mapsto ↦ circ ∘ ast ∗ star ⋆ bullet ∙ oplus ⊕ otimes ⊗ perp ⊥ parallel ∥ mid ∣ ' +
  'ldots … cdots ⋯ vdots ⋮ ddots ⋱ dots … prime ′ langle ⟨ rangle ⟩ lfloor ⌊ rfloor ⌋ lceil ⌈ rceil ⌉ ' +
  'vert | Vert ‖ | ‖ { { } } colon :')
  .split(' ').reduce((acc, v, i, a) => (i % 2 ? acc : [...acc, [v, a[i + 1]]]), []));
const BIG = { sum: '∑', prod: '∏', coprod: '∐', int: '∫', iint: '∬', iiint: '∭', oint: '∮',
  bigcup: '⋃', bigcap: '⋂', bigoplus: '⨁', bigotimes: '⨂' };
const LIMITS = new Set(['lim', 'limsup', 'liminf', 'max', 'min', 'sup', 'inf', 'det', 'gcd', 'Pr', 'arg']);
const FUNCS = new Set([...LIMITS, 'sin', 'cos', 'tan', 'cot', 'sec', 'csc', 'sinh', 'cosh', 'tanh', 'arcsin',
  'arccos', 'arctan', 'log', 'ln', 'lg', 'exp', 'ker', 'dim', 'deg', 'hom', 'mod']);
const SPACES = { ',': '0.1667em', ':': '0.2222em', '>': '0.2222em', ';': '0.2778em', ' ': '0.25em',
  '!': '0', quad: '1em', qquad: '2em' };
const ACCENTS = { hat: '^', bar: '¯', overline: '¯', vec: '→', tilde: '~', dot: '˙', ddot: '¨' };
const MATRICES = { matrix: ['', ''], pmatrix: ['(', ')'], bmatrix: ['[', ']'], Bmatrix: ['{', '}'],
  vmatrix: ['|', '|'], Vmatrix: ['‖', '‖'], cases: ['{', ''], aligned: ['', ''] };
const BB = { R: 'ℝ', N: 'ℕ', Z: 'ℤ', Q: 'ℚ', C: 'ℂ', P: 'ℙ', H: 'ℍ' };
const OP_CHARS = '+-=<>()[]|/,;:!?.*\'';

function node(tag, children = [], attrs = {}) {
  const n = document.createElementNS(NS, tag);
  for (const [k, v] of Object.entries(attrs)) n.setAttribute(k, v);
  for (const c of children) n.append(c);
  return n;
}

function leaf(tag, text, attrs) {
  const n = node(tag, [], attrs);
  n.textContent = text;
  return n;
}

const row = (items) => (items.length === 1 ? items[0] : node('mrow', items));

// Mathematical Bold letters and digits (MathML Core styles letters through code points).
function bold(text) {
  return [...text].map((c) => {
    const code = c.codePointAt(0);
    if (c >= 'A' && c <= 'Z') return String.fromCodePoint(0x1d400 + code - 65);
    if (c >= 'a' && c <= 'z') return String.fromCodePoint(0x1d41a + code - 97);
    if (c >= '0' && c <= '9') return String.fromCodePoint(0x1d7ce + code - 48);
    return c;
  }).join('');
}

class Parser {
  constructor(source) {
    this.tokens = source.match(TOKEN) || [];
    this.pos = 0;
  }

  // Spaces separate tokens and are otherwise dropped, except inside \text.
  peek() {
    while (/^\s+$/.test(this.tokens[this.pos])) this.pos++;
    return this.tokens[this.pos];
  }

  next() {
    if (this.peek() === undefined) throw new Error('unexpected end');
    return this.tokens[this.pos++];
  }

  expect(token) {
    if (this.next() !== token) throw new Error(`expected ${token}`);
  }

  // The raw text of a {group}, for \text and \begin names.
  rawGroup() {
    this.expect('{');
    let depth = 1;
    let text = '';
    for (;;) {
      if (this.pos >= this.tokens.length) throw new Error('unbalanced braces');
      const t = this.tokens[this.pos++];
      if (t === '{') depth++;
      if (t === '}' && --depth === 0) return text;
      text += t;
    }
  }

  // A sequence of atoms with their scripts, up to one of `stops` (left unconsumed) or the end.
  list(stops) {
    const items = [];
    while (this.peek() !== undefined && !stops.includes(this.peek())) items.push(this.scripted());
    return items;
  }

  group() {
    if (this.peek() !== '{') return this.atom();
    this.next();
    const items = this.list(['}']);
    this.expect('}');
    return row(items);
  }

  scripted() {
    let [base, limits] = this.base();
    let sub = null;
    let sup = null;
    while (this.peek() === '^' || this.peek() === '_' || this.peek() === "'") {
      const t = this.next();
      if (t === "'") { sup = leaf('mo', '′'); continue; }
      if ((t === '^' ? sup : sub) !== null) throw new Error('double script');
      if (t === '^') sup = this.group(); else sub = this.group();
    }
    if (sub && sup) return node(limits ? 'munderover' : 'msubsup', [base, sub, sup]);
    if (sub) return node(limits ? 'munder' : 'msub', [base, sub]);
    if (sup) return node(limits ? 'mover' : 'msup', [base, sup]);
    return base;
  }

  // An atom and whether its scripts go under and over it.
  base() {
    const t = this.peek();
    if (t.startsWith('\\') && t.length > 2) {
      const name = t.slice(1);
      if (name in BIG) {
        this.next();
        return [leaf('mo', BIG[name], { largeop: 'true', movablelimits: name.includes('int') ? 'false' : 'true' }),
          !name.includes('int')];
      }
      if (LIMITS.has(name)) { this.next(); return [leaf('mi', name, { class: 'fn' }), true]; }
    }
    return [this.atom(), false];
  }

  atom() {
    const t = this.next();
    if (t === '{') { this.pos--; return this.group(); }
    if (/^\d/.test(t)) return leaf('mn', t);
    if (/^[A-Za-z]$/.test(t)) return leaf('mi', t);
    if (t.startsWith('\\')) return this.command(t.slice(1));
    if (t === '}' || t === '^' || t === '_' || t === '&' || t === '#' || t === '%' || t === '$' || t === '~') {
      throw new Error(`unexpected ${t}`);
    }
    if (OP_CHARS.includes(t)) return leaf('mo', t === '-' ? '−' : t === '*' ? '∗' : t);
    return leaf('mi', t);
  }

  command(name) {
    if (name in GREEK) return leaf('mi', GREEK[name]);
    if (name in OPS) return leaf('mo', OPS[name]);
    if (name in SPACES) return node('mspace', [], { width: SPACES[name] });
    if (FUNCS.has(name)) return leaf('mi', name, { class: 'fn' });
    if (name in ACCENTS) return node('mover', [this.group(), leaf('mo', ACCENTS[name])], { accent: 'true' });
    switch (name) {
      case 'frac': case 'dfrac': case 'tfrac': return node('mfrac', [this.group(), this.group()]);
      case 'binom': return node('mrow', [leaf('mo', '('), node('mfrac', [this.group(), this.group()],
        { linethickness: '0' }), leaf('mo', ')')]);
      case 'sqrt': {
        if (this.peek() !== '[') return node('msqrt', [this.group()]);
        this.next();
        const index = row(this.list([']']));
        this.expect(']');
        return node('mroot', [this.group(), index]);
      }
      case 'text': case 'textrm': case 'mbox': case 'operatorname': {
        const text = this.rawGroup().replace(/\\([{}$%&#_ ])/g, '$1');
        if (/\\/.test(text)) throw new Error('command in text');
        // mtext trims its edges; the spaces around words in \text are meant
        return name === 'operatorname' ? leaf('mi', text, { class: 'fn' }) : leaf('mtext', text.replace(/^ | $/g, '\u00a0'));
      }
      case 'mathbf': case 'boldsymbol': case 'bf': return this.styled(bold);
      case 'mathrm': return this.styled((s) => s, { mathvariant: 'normal' });
      case 'mathbb': return this.styled((s) => [...s].map((c) => BB[c] || c).join(''));
      case 'left': return this.fenced();
      case 'begin': return this.environment();
      default: throw new Error(`unknown \\${name}`);
    }
  }

  // A group whose letters and digits are restyled; anything else inside it must be plain.
  styled(map, attrs) {
    const text = this.rawGroup().replace(/\s+/g, '');
    if (!/^[A-Za-z0-9]*$/.test(text)) throw new Error('styled group is not plain');
    return leaf(/^\d+$/.test(text) ? 'mn' : 'mi', map(text), attrs);
  }

  delimiter() {
    const t = this.next();
    if (t === '.') return null;
    const text = t.startsWith('\\') ? OPS[t.slice(1)] : t;
    if (!text || !'()[]|‖{}⟨⟩⌊⌋⌈⌉'.includes(text)) throw new Error('bad delimiter');
    return leaf('mo', text, { stretchy: 'true', fence: 'true' });
  }

  fenced() {
    const open = this.delimiter();
    const items = this.list(['\\right']);
    this.expect('\\right');
    const close = this.delimiter();
    return node('mrow', [open, ...items, close].filter(Boolean));
  }

  environment() {
    const name = this.rawGroup();
    if (!(name in MATRICES)) throw new Error(`unknown environment ${name}`);
    const rows = [];
    for (;;) {
      const cells = [node('mtd', [row(this.list(['&', '\\\\', '\\end']))])];
      while (this.peek() === '&') { this.next(); cells.push(node('mtd', [row(this.list(['&', '\\\\', '\\end']))])); }
      rows.push(node('mtr', cells));
      if (this.next() === '\\end') break;
    }
    if (this.rawGroup() !== name) throw new Error('mismatched \\end');
    const table = node('mtable', rows, name === 'cases' || name === 'aligned' ? { columnalign: 'left' } : {});
    const [open, close] = MATRICES[name];
    return node('mrow', [open && leaf('mo', open, { fence: 'true' }), table, close && leaf('mo', close, { fence: 'true' })]
      .filter(Boolean));
  }
}

// A <math> element for `tex` (display: a centred block), or null when it is outside the subset.
export function renderMath(tex, display) {
  try {
    const parser = new Parser(tex);
    const items = parser.list([]);
    if (!items.length) return null;
    const annotation = leaf('annotation', tex, { encoding: 'application/x-tex' });
    return node('math', [node('semantics', [row(items), annotation])], display ? { display: 'block' } : {});
  } catch {
    return null;
  }
}
