"""Constrained generation: grammars compiled once per model, one matcher per batch row.

`GrammarCompiler` belongs to a served model's tokenizer. It turns a source (a JSON Schema,
GBNF, or Lark) into a `CompiledGrammar`, caching by source so that a schema sent with
every request compiles once. A `CompiledGrammar` is immutable and shared by every request
that uses it; the engine asks it for a fresh `GrammarMatcher` when a row is admitted, so
each row carries its own parse state through the batch.

The matcher's contract with the engine: `allowed_mask(n)` gives the tokens that keep the
output parsable (end-of-generation tokens only once the document may end; None: nothing is
masked yet, a lazy grammar waiting for its trigger, engine/lazy_grammar.py), `accept(t)`
advances it, `is_terminated()` says the document ended itself (nothing more can follow),
`is_accepting()` says it could end here. The implementation is llguidance's; a JSON
Schema's objects are first closed after their listed properties (engine/json_schema.py).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from mlxcel.chat.gbnf import GbnfError, gbnf_to_lark
from mlxcel.engine.json_schema import close_objects


class GrammarError(ValueError):
    """The grammar or schema cannot be compiled; the message says why."""


class GrammarMatcher(Protocol):
    def allowed_mask(self, n_vocab: int) -> np.ndarray | None: ...
    def accept(self, token: int) -> bool: ...
    def is_terminated(self) -> bool: ...
    def is_accepting(self) -> bool: ...
    def error(self) -> str: ...


# JSON layout the schema front end allows between tokens: nothing, one space, or a newline
# plus indentation (as upstream's converter allows); the bound keeps a sampling model from
# padding a document forever.
JSON_OPTIONS = {"whitespace_pattern": r"(?:[ ]|\n[ ]{0,16})?"}
CACHE_SIZE = 64


@dataclass(frozen=True)
class CompiledGrammar:
    """One validated grammar, ready to hand out matchers. `kind`: json_schema | gbnf | lark."""

    kind: str
    source: str
    _llg: str  # llguidance's grammar definition
    _compiler: "GrammarCompiler"

    def matcher(self) -> "LLGuidanceMatcher":
        return LLGuidanceMatcher(self._compiler._matcher(self._llg))


class LLGuidanceMatcher:
    """One row's parse state."""

    def __init__(self, matcher: Any) -> None:
        self._m = matcher

    def allowed_mask(self, n_vocab: int) -> np.ndarray:
        bits = np.frombuffer(self._m.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little").astype(bool)
        if allowed.shape[0] >= n_vocab:
            return allowed[:n_vocab]
        return np.concatenate([allowed, np.zeros(n_vocab - allowed.shape[0], dtype=bool)])

    def accept(self, token: int) -> bool:
        return bool(self._m.consume_token(token))

    def validate(self, tokens: list[int]) -> int:
        """How many of `tokens`, in order, the grammar would accept (nothing is consumed)."""
        return int(self._m.validate_tokens(tokens))

    def is_terminated(self) -> bool:
        return bool(self._m.is_stopped())

    def is_accepting(self) -> bool:
        return bool(self._m.is_accepting())

    def error(self) -> str:
        return self._m.get_error() if self._m.is_error() else ""


class GrammarCompiler:
    """Compiles grammars against one model's tokenizer. `hf_tokenizer` is the transformers
    fast tokenizer; `eos_token_ids` the ids that end generation (allowed only where the
    document may end); `encode_special` maps a `<text>` GBNF terminal to its ids."""

    def __init__(self, hf_tokenizer: Any, eos_token_ids: Iterable[int], n_vocab: int,
                 encode_special=None) -> None:
        self._hf = hf_tokenizer
        self._eos = sorted(eos_token_ids)
        self.n_vocab = n_vocab
        self._encode_special = encode_special
        self._tok = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], CompiledGrammar] = OrderedDict()

    def _tokenizer(self):
        """llguidance's view of the vocabulary: built once (about a second), on first use."""
        with self._lock:
            if self._tok is None:
                import llguidance.hf

                self._tok = llguidance.hf.from_tokenizer(self._hf, eos_token=self._eos or None)
            return self._tok

    def warm(self) -> None:
        self._tokenizer()

    def _matcher(self, llg_grammar: str):
        import llguidance

        m = llguidance.LLMatcher(self._tokenizer(), llg_grammar, log_level=0)
        if m.is_error():
            raise GrammarError(m.get_error())
        return m

    def _one_token(self, text: str) -> int | None:
        if self._encode_special is None:
            return None
        ids = self._encode_special(text)
        return ids[0] if len(ids) == 1 else None

    def compile(self, kind: str, source: str | dict) -> CompiledGrammar:
        """`kind`: "json_schema" (a dict or its JSON text), "gbnf" or "lark". Raises GrammarError."""
        import llguidance

        # the text as sent: a schema's property order is the order the document follows
        text = source if isinstance(source, str) else json.dumps(source)
        key = (kind, text)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        try:
            if kind == "json_schema":
                llg = llguidance.LLMatcher.grammar_from_json_schema(_closed_schema(source), defaults=JSON_OPTIONS)
            elif kind == "gbnf":
                llg = llguidance.LLMatcher.grammar_from_lark(gbnf_to_lark(text, self._one_token, self.n_vocab))
            elif kind == "lark":
                llg = llguidance.LLMatcher.grammar_from_lark(text)
            else:
                raise GrammarError(f"unknown grammar kind {kind!r}")
        except (GbnfError, ValueError) as e:
            raise GrammarError(str(e)) from None
        err = llguidance.LLMatcher.validate_grammar(llg, self._tokenizer())
        if err:
            raise GrammarError(err)
        compiled = CompiledGrammar(kind, text, llg, self)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled


def _closed_schema(source: str | dict) -> Any:
    """The schema as compiled: objects closed after their listed properties (engine/json_schema.py)."""
    return json.dumps(close_objects(_load(source) if isinstance(source, str) else source))


def _load(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise GrammarError(f"the schema is not valid JSON: {e}") from None
    except RecursionError:
        raise GrammarError("the schema nests too deeply") from None


def for_tokenizer(tokenizer: Any, n_vocab: int) -> GrammarCompiler:
    """The compiler for an `mlxcel.engine.tokenizer.Tokenizer`."""
    hf = tokenizer.hf
    return GrammarCompiler(hf, tokenizer.eos_token_ids, n_vocab,
                           encode_special=lambda s: hf.encode(s, add_special_tokens=False))


def check_json_schema_text(text: str) -> None:
    """Refuse a JSON Schema that is not JSON or that the schema front end cannot compile,
    before any model exists (no tokenizer needed). Raises GrammarError."""
    import llguidance

    schema = _load(text)
    try:
        llg = llguidance.LLMatcher.grammar_from_json_schema(close_objects(schema), defaults=JSON_OPTIONS)
    except ValueError as e:
        raise GrammarError(str(e)) from None
    err = llguidance.LLMatcher.validate_grammar(llg)
    if err:
        raise GrammarError(err)
