"""Reading a GGUF file into a HuggingFace-layout checkpoint (config, tensors, tokenizer).

mlxcel never serves GGUF; this module exists only so `mlxcel convert` can turn one into a
SafeTensors checkpoint. It is torch-free: a quantized tensor MLX's affine format holds exactly
is repacked into it (store/gguf_quant.py), any other is dequantized with the `gguf` package in
numpy, renamed through the explicit per-architecture tables of store/gguf_layouts.py, and undone
where llama.cpp's converter changed them (the rotary permutation of a Llama's q/k, Gemma's
`1 + w` norm weights, stacked experts). An architecture missing from the tables is refused with
the list of those it has (models/gguf_archs.py), never guessed.
"""

from __future__ import annotations

import json
import logging
import re
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np

from mlxcel.models.gguf_archs import GGUF_ARCHITECTURES
from mlxcel.store.gguf_layouts import LAYOUTS as _COMMON_LAYOUTS
from mlxcel.store.gguf_layouts import GGUFUnsupported, Layout, Meta
from mlxcel.store.gguf_layouts_own import LAYOUTS_OWN
from mlxcel.store.gguf_quant import Packed, to_packed

__all__ = ["LAYOUTS", "GGUFUnsupported", "Meta", "gguf_to_hf"]

# every architecture models/gguf_archs.py lists -> how its tensors and metadata map
LAYOUTS: dict[str, Layout] = {**_COMMON_LAYOUTS, **LAYOUTS_OWN}

log = logging.getLogger("mlxcel.store")

# Pre-tokenizers the transformers GGUF tokenizer builder does not know. SmolLM splits every
# digit before the byte-level GPT-2 regex (its tokenizer.json does the same).
_PRE_TOKENIZERS: dict[str, Callable[[], object]] = {}


def _smollm_pre_tokenizer():
    from tokenizers import pre_tokenizers

    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )


_PRE_TOKENIZERS["smollm"] = _smollm_pre_tokenizer


def _meta(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def _unpermute_rotary(w, n_head: int):
    # llama.cpp interleaves each head's rotary halves; put them back in HF's half-split order.
    if isinstance(w, Packed):  # quantized along the inputs, so the rows move as they are
        return w.rows(lambda a: _unpermute_rotary(a, n_head))
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _fix_tensor(layout: Layout, stem: str, kind: str, w: np.ndarray, config: dict) -> np.ndarray:
    """Undo what llama.cpp's converter changed in one tensor."""
    if layout.rotary_interleaved and kind == "weight" and stem in ("attn_q", "attn_k"):
        heads = config["num_attention_heads" if stem == "attn_q" else "num_key_value_heads"]
        return _unpermute_rotary(w, heads)
    if layout.norm_plus_one and kind == "weight" and stem.endswith("norm"):
        return w - 1.0
    if stem == "shortconv.conv":
        return w[:, None, :]  # llama.cpp drops the convolution's channel axis, transformers keeps it
    if stem == "ffn_gate_inp_shexp":
        return w.reshape(1, -1)  # llama.cpp's shared-expert gate is a vector, transformers' a 1-row linear
    return w if layout.fix is None else layout.fix(stem, kind, w, config)


def _layer_tensors(layout: Layout, layer: str, stem: str, kind: str, w: np.ndarray, config: dict) -> dict:
    """The HF tensors one GGUF block tensor becomes."""
    prefix = f"{layout.block}.{layer}."
    if stem in layout.splits:  # a fused q/k/v, split by the head counts
        q = config["num_attention_heads"] * config["head_dim"]
        kv = config["num_key_value_heads"] * config["head_dim"]
        cut = [q, q + kv]
        parts = ([Packed(*ps, w.bits, w.group_size) for ps in zip(*(np.split(a, cut) for a in (w.weight, w.scales,
                                                                                             w.biases)))]
                 if isinstance(w, Packed) else np.split(w, cut, axis=0))
        return {f"{prefix}{hf}.{kind}": part for hf, part in zip(layout.splits[stem], parts)}
    hf = layout.layers[stem]
    w = _fix_tensor(layout, stem, kind, w, config)
    if "{e}" in hf:  # llama.cpp stacks the experts; transformers' layout has one tensor each
        return {f"{prefix}{hf.format(e=e)}.{kind}": w[e] for e in range(len(w))}
    return {f"{prefix}{hf}" + ("" if hf in layout.bare else f".{kind}"): w}


def _join(layout: Layout, tensors: dict, layers: int) -> None:
    for layer in range(layers):
        prefix = f"{layout.block}.{layer}."
        for name, parts in layout.joins.items():
            keys = [prefix + p for p in parts]
            if all(k in tensors for k in keys):
                ws = [tensors.pop(k) for k in keys]
                # packed parts of one form join as they are (fp16 scales widen to fp32 exactly)
                if all(isinstance(w, Packed) and w.bits == ws[0].bits for w in ws):
                    tensors[prefix + name] = Packed(*(np.concatenate([getattr(w, a) for w in ws], axis=1)
                                                      for a in ("weight", "scales", "biases")), ws[0].bits)
                else:
                    tensors[prefix + name] = np.concatenate([_dense(w) for w in ws], axis=1)


# a block tensor's kind is "" where llama.cpp names it without one (Mamba 2's ssm_a, ssm_d)
_BLOCK = re.compile(r"^blk\.(\d+)\.([\w.]+?)(?:\.(weight|bias))?$")
_GLOBAL = re.compile(r"^(\w+)\.(weight|bias)$")
def _dense(w) -> np.ndarray:
    if not isinstance(w, Packed):
        return w
    import mlx.core as mx

    return np.asarray(mx.dequantize(mx.array(w.weight), mx.array(w.scales.astype(np.float32)),
                                    mx.array(w.biases.astype(np.float32)), group_size=w.group_size, bits=w.bits))


def _row_only(layout: Layout, stem: str, kind: str) -> bool:
    """Whether every change `_fix_tensor` makes to this tensor moves whole rows (so a packed
    copy can take it); a norm or a reshaped vector is changed value by value."""
    return kind == "weight" and not stem.endswith("norm") and stem not in ("shortconv.conv", "ffn_gate_inp_shexp") \
        and layout.layers.get(stem) not in layout.bare and stem not in layout.dense


_FLOAT_TYPES = ("F32", "F16", "BF16", "F64")


def _read(t, keep: bool, row_only: bool, dense_why: dict) -> np.ndarray | Packed:
    """One GGUF tensor: packed where MLX's affine format holds it exactly and `keep`, else fp32."""
    import gguf

    kind = t.tensor_type.name
    if keep and kind not in _FLOAT_TYPES:
        packed = to_packed(np.asarray(t.data), kind) if row_only else "the conversion changes it value by value"
        if isinstance(packed, Packed):
            return packed
        dense_why.setdefault((kind, packed), []).append(t.name)
    return np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)


def read_tensors(reader, arch: str, config: dict, *, keep_quantized: bool = False,
                 dense_why: dict | None = None) -> dict[str, np.ndarray | Packed]:
    """HF name -> tensor. With `keep_quantized`, a quantized weight MLX's affine format represents
    exactly stays packed (store/gguf_quant.py); one that is dequantized instead is recorded in
    `dense_why` under (GGML type, reason)."""
    layout = LAYOUTS[arch]
    names = {"token_embd": layout.embed, "output": layout.head, "output_norm": layout.final_norm, **layout.top}
    out: dict[str, np.ndarray | Packed] = {}
    dense_why = {} if dense_why is None else dense_why
    for t in reader.tensors:
        block, top = _BLOCK.match(t.name), _GLOBAL.match(t.name)
        stem, kind = (block.group(2), block.group(3) or "") if block else top.groups() if top else (t.name, "")
        w = _read(t, keep_quantized, _row_only(layout, stem, kind), dense_why)
        if block and (stem in layout.layers or stem in layout.splits):
            out.update(_layer_tensors(layout, block.group(1), stem, kind, w, config))
        elif top and top.group(1) in names:
            stem, kind = top.groups()
            out[f"{names[stem]}.{kind}"] = _fix_tensor(layout, stem, kind, w, config)
        elif t.name in layout.config_tensors:
            continue  # read into the config's RoPE settings (store/gguf_layouts.py)
        else:
            raise GGUFUnsupported(f"GGUF tensor {t.name!r} has no mapping for architecture {arch!r}")
    _join(layout, out, 1 + max((int(b.group(1)) for t in reader.tensors if (b := _BLOCK.match(t.name))), default=-1))
    if layout.assemble is not None:
        layout.assemble(out, config)
    return out


def _tokenizer_dict(reader) -> dict:
    keys = {
        "tokenizer.ggml.model": "tokenizer_type",
        "tokenizer.ggml.pre": "pre_tokenizer_type",
        "tokenizer.ggml.tokens": "tokens",
        "tokenizer.ggml.scores": "scores",
        "tokenizer.ggml.token_type": "token_type",
        "tokenizer.ggml.merges": "merges",
        "tokenizer.ggml.add_space_prefix": "add_prefix_space",
    }
    return {name: _meta(reader, key) for key, name in keys.items() if key in reader.fields}


def write_tokenizer(reader, arch: str, out_dir: Path) -> dict:
    """Write tokenizer.json / tokenizer_config.json; returns the special token ids."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    tdict = _tokenizer_dict(reader)
    backend, _ = convert_gguf_tokenizer(arch, tdict)
    pre = _PRE_TOKENIZERS.get(tdict.get("pre_tokenizer_type"))
    if pre is not None:
        backend.pre_tokenizer = pre()
    tokens = tdict["tokens"]
    ids = {
        name: _meta(reader, f"tokenizer.ggml.{key}")
        for name, key in (
            ("bos", "bos_token_id"),
            ("eos", "eos_token_id"),
            ("unk", "unknown_token_id"),
            ("pad", "padding_token_id"),
        )
    }
    add_bos = bool(_meta(reader, "tokenizer.ggml.add_bos_token", tdict.get("tokenizer_type") == "llama"))
    if add_bos and ids["bos"] is not None:
        from tokenizers import processors

        bos = tokens[ids["bos"]]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, ids["bos"])]
        )
    elif tdict.get("tokenizer_type") != "gpt2":
        backend.post_processor = None
    special = {f"{k}_token": tokens[v] for k, v in ids.items() if v is not None}
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, **special)
    template = _meta(reader, "tokenizer.chat_template")
    if template:
        tok.chat_template = template
    tok.save_pretrained(str(out_dir))
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["add_bos_token"] = add_bos
    # Portable across transformers 4 and 5, and the template where every loader looks for it.
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg.pop("model_max_length", None)
    if template:
        cfg["chat_template"] = template
    cfg["add_eos_token"] = bool(_meta(reader, "tokenizer.ggml.add_eos_token", False))
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    return {k: v for k, v in ids.items() if v is not None}


def _report(reader, dense_why: dict) -> None:
    """One line per GGML type kept packed and per reason one was dequantized, with counts."""
    dense = {name for names in dense_why.values() for name in names}
    packed = Counter(t.tensor_type.name for t in reader.tensors
                     if t.tensor_type.name not in _FLOAT_TYPES and t.name not in dense)
    for kind, n in sorted(packed.items()):
        log.info("GGUF: kept %d %s tensor(s) quantized (exact in MLX's affine format)", n, kind)
    for (kind, why), names in sorted(dense_why.items()):
        shown = ", ".join(names[:4]) + (f", ... ({len(names) - 4} more)" if len(names) > 4 else "")
        log.warning("GGUF: dequantized %d %s tensor(s): %s (%s)", len(names), kind, why, shown)


def gguf_to_hf(gguf_path: Path, out_dir: Path, *, keep_quantized: bool = False) -> dict:
    """Write config.json, model.safetensors, tokenizer and generation config; return config.
    Weights are fp32, or with `keep_quantized` packed in MLX's affine format wherever that
    holds them exactly (config.json then has a `quantization` block)."""
    import gguf
    from safetensors.numpy import save_file

    reader = gguf.GGUFReader(str(gguf_path))
    arch = str(_meta(reader, "general.architecture"))
    if arch not in LAYOUTS:
        raise GGUFUnsupported(
            f"GGUF architecture {arch!r} cannot be converted; supported: {', '.join(sorted(GGUF_ARCHITECTURES))}"
        )
    config = LAYOUTS[arch].config(Meta(reader, arch))
    out_dir.mkdir(parents=True, exist_ok=True)
    dense_why: dict = {}
    tensors = read_tensors(reader, arch, config, keep_quantized=keep_quantized, dense_why=dense_why)
    if keep_quantized:
        _report(reader, dense_why)
    config["vocab_size"] = len(tensors[f"{LAYOUTS[arch].embed}.weight"])
    ids = write_tokenizer(reader, arch, out_dir)
    for k, v in ids.items():
        config[f"{k}_token_id"] = int(v)
    config["torch_dtype"] = "float32"
    packed = {k: w for k, w in tensors.items() if isinstance(w, Packed)}
    if packed:
        # the most common form is the default; mlx-lm reads every other one off the shapes
        bits = Counter(w.bits for w in packed.values()).most_common(1)[0][0]
        config["quantization"] = {"group_size": next(iter(packed.values())).group_size, "bits": bits}
    flat = {}
    for k, w in tensors.items():
        flat.update(w.parts(k) if isinstance(w, Packed) else {k: w})
    save_file(flat, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    gen = {k: config[f"{k}_token_id"] for k in ("bos", "eos", "pad") if f"{k}_token_id" in config}
    gen = {f"{k}_token_id": v for k, v in gen.items()}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return config
