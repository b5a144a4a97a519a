"""The checkpoint's tokenizer, its special tokens and its chat template.

Wraps the `tokenizers`-backed transformers tokenizer loaded from the checkpoint directory
(never from a hub). The end-of-generation set is the union of the tokenizer's EOS and the
ids `generation_config.json` lists, because chat checkpoints often end turns with a token
the tokenizer does not call EOS.
"""

from __future__ import annotations

import json
from functools import cached_property
from dataclasses import dataclass, field
from pathlib import Path

from transformers import AutoTokenizer


@dataclass
class GenerationDefaults:
    """Sampling defaults a checkpoint declares in generation_config.json."""

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    eos_token_ids: list[int] = field(default_factory=list)


def _read_generation_config(path: Path) -> GenerationDefaults:
    f = path / "generation_config.json"
    if not f.is_file():
        return GenerationDefaults()
    cfg = json.loads(f.read_text())
    eos = cfg.get("eos_token_id")
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    do_sample = cfg.get("do_sample", True)
    return GenerationDefaults(
        temperature=cfg.get("temperature") if do_sample else 0.0,
        top_k=cfg.get("top_k"),
        top_p=cfg.get("top_p"),
        min_p=cfg.get("min_p"),
        eos_token_ids=eos_ids,
    )


class Tokenizer:
    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        self.hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        self.generation_defaults = _read_generation_config(path)
        eos = set(self.generation_defaults.eos_token_ids)
        if self.hf.eos_token_id is not None:
            eos.add(self.hf.eos_token_id)
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        self.bos_token: str | None = self.hf.bos_token
        self.eos_token: str | None = self.hf.eos_token
        self.chat_template: str | None = getattr(self.hf, "chat_template", None) or None
        self.vocab_size = len(self.hf)

    def encode(self, text: str, add_special_tokens: bool = True, parse_special: bool = True) -> list[int]:
        """`parse_special=False` keeps every added token's spelling in `text` as plain text
        (llama.cpp treats FIM and turn markers as control tokens even where the checkpoint
        does not flag them special), so the text goes through normalizer, pre-tokenizer and
        model directly, bypassing the added vocabulary."""
        if parse_special:
            return self.hf.encode(text, add_special_tokens=add_special_tokens)
        bt = self.hf.backend_tokenizer
        if bt.normalizer is not None:
            text = bt.normalizer.normalize_str(text)
        parts = bt.pre_tokenizer.pre_tokenize_str(text) if bt.pre_tokenizer is not None else [(text, None)]
        ids = [t.id for part, _ in parts for t in bt.model.tokenize(part)]
        return (self.hf.encode("", add_special_tokens=True) if add_special_tokens else []) + ids

    @cached_property
    def adds_bos(self) -> bool:
        """Encoding with special tokens puts BOS first (llama.cpp's add-BOS vocabulary flag)."""
        bos = self.hf.bos_token_id
        return bos is not None and self.hf.encode("a", add_special_tokens=True)[:1] == [bos]

    @cached_property
    def pieces(self) -> list[bytes]:
        """Every token id's raw bytes (built on first use, once)."""
        from mlxcel.engine.token_pieces import vocabulary_pieces

        return vocabulary_pieces(self.hf)

    @cached_property
    def control_ids(self) -> frozenset[int]:
        """Added tokens llama.cpp treats as control tokens: the checkpoint's special ones plus
        those that look special (`<|...|>`, `<｜...｜>`, `<unused...>`, a few named ones), as its
        GGUF conversion marks them. Without --special their text is never output."""
        out = set(self.hf.all_special_ids)
        for tid, tok in getattr(self.hf, "added_tokens_decoder", {}).items():
            if getattr(tok, "special", False) or _looks_control(str(tok)):
                out.add(int(tid))
        return frozenset(out)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if skip_special_tokens:
            ctrl = self.control_ids
            ids = [i for i in ids if i not in ctrl]
        return self.hf.decode(
            ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )

    @cached_property
    def special_ids(self) -> frozenset[int]:
        """The ids a skip-special decode drops."""
        ids = set(self.hf.all_special_ids)
        ids.update(i for i, t in self.hf.added_tokens_decoder.items() if t.special)
        return frozenset(ids)

    def decoder(self, keep: frozenset[int] = frozenset()):
        """A decode function that drops special tokens except the `keep` ones, whose text stays
        (tool-call markers such as `<|python_tag|>` that the output parser must see)."""
        if not keep:
            return self.decode
        drop = self.special_ids - keep

        def decode(ids: list[int]) -> str:
            return self.decode([i for i in ids if i not in drop], skip_special_tokens=False)

        return decode

    def single_special(self, text: str) -> int | None:
        """The id of `text` when it is one special token of this vocabulary, else None."""
        ids = self.hf.encode(text, add_special_tokens=False)
        return ids[0] if len(ids) == 1 and ids[0] in self.special_ids else None

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for (for byte-level reports)."""
        return self.decode_bytes([token_id])

    def decode_bytes(self, ids: list[int]) -> bytes:
        return self.decode(ids, skip_special_tokens=False).encode("utf-8", "surrogatepass")


def _looks_control(text: str) -> bool:
    return (text in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
            or (text.startswith("<|") and text.endswith("|>"))
            or (text.startswith("<｜") and text.endswith("｜>"))
            or (text.startswith("<unused") and text.endswith(">")))
