"""A decode step's small per-layer ops through mlxcel's CPU kernels (kernels/cpu/decode_ops.cpp).

Once decode rows' weights are read near the memory rate (row_gemv.py), a one-token step of a
small model spends most of its time in transformers' eager ops, a few microseconds each:
eight per RMSNorm, fourteen to apply RoPE, and SDPA's setup over a short history
(at SmolLM2's decode shapes an RMSNorm took 24 us, RoPE 35 us; fused 4.8 and 12 us:
docs/benchmarks.md). With the kernels loaded (torch CPU, bf16) three seams take them:

- RMSNorm: each norm module of a known form gets the fused norm as its instance `forward`
  (the module stays itself, as row_gemv's linears do), for every row: a row's result does not
  depend on the others, and it is within one last-place step of the family's own (fp32 sums in
  another order; tests).
- RoPE: transformers' attention calls its family module's `apply_rotary_pos_emb` by name, so
  that name is rebound to the fused op, once per family module and only after a probe finds the
  op gives that function's exact bits (it rounds after every product and sum as the eager ops
  do); anything else it is handed (other shapes, under torch.compile) goes to the original.
- Attention: decode rows (one token, `ForwardRow.decode`) attend their paged history through
  the kernel, read straight from the slot table, whatever shares their step; prompt tokens
  through its sibling where the AMX tiles run their linears, else transformers' SDPA
  (backend.set_fused_ops says why). A row's output depends only on that row (batch
  invariance), but its last bits differ from SDPA's, so the path follows what a row is, as
  row_gemv's does.
"""

from __future__ import annotations

import sys
import types
from functools import partial
from typing import NamedTuple

import torch

# RMSNorm classes whose forward is known, by form: Llama's rounds the normalised row to the
# input dtype before the weight; Gemma's multiplies by (1 + weight) in fp32, then rounds
NORM_FORMS: dict[str, tuple[bool, str]] = {  # class name -> (offset form, eps attribute)
    "LlamaRMSNorm": (False, "variance_epsilon"),
    "Qwen2RMSNorm": (False, "variance_epsilon"),
    "Qwen3RMSNorm": (False, "variance_epsilon"),
    "Qwen2VLRMSNorm": (False, "variance_epsilon"),
    "Gemma3RMSNorm": (True, "eps"),
}

# the attribute each attention module carries its layer's window in (TorchBackend._set_windows):
# mlxcel's own, so a family's `sliding_window`, which its forward may read, is never overwritten
WINDOW_ATTR = "mlxcel_window"


def _norm_forward(module: torch.nn.Module, offset: bool, eps: float):
    """The instance forward of one norm (the weight read once here, as row_gemv's linears do)."""
    weight, own = module.weight, types.MethodType(type(module).forward, module)
    op = torch.ops.mlxcel_cpu.rms_norm.default

    def forward(x: torch.Tensor) -> torch.Tensor:
        if x.dtype is weight.dtype and x.device.type == "cpu" and not torch.compiler.is_compiling():
            return op(x, weight, eps, offset)
        return own(x)

    return forward


def install_norms(*roots: torch.nn.Module) -> int:
    """The fused norm for every RMSNorm of a known form under `roots`; returns how many."""
    count = 0
    for root in roots:
        for module in root.modules():
            form = NORM_FORMS.get(type(module).__name__)
            weight = getattr(module, "weight", None)
            if form is None or not isinstance(weight, torch.Tensor) or weight.dtype not in (torch.bfloat16,
                                                                                              torch.float32):
                continue
            offset, eps_name = form
            module.forward = _norm_forward(module, offset, float(getattr(module, eps_name)))
            count += 1
    return count


def remove_norms(*roots: torch.nn.Module) -> None:
    """Back to each norm's own forward (benchmarks compare the two)."""
    for root in roots:
        for module in root.modules():
            if type(module).__name__ in NORM_FORMS and "forward" in module.__dict__:
                del module.forward


def _fits_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or q.device.type != "cpu":
        return False
    if not (q.dtype is k.dtype is cos.dtype is sin.dtype) or q.dtype not in (torch.bfloat16, torch.float32):
        return False
    b, _, n, d = q.shape
    return cos.shape == sin.shape == (b, n, d) and k.shape[0] == b and k.shape[2] == n and k.shape[3] == d


def _fused_rope(original, q, k, cos, sin, unsqueeze_dim=1, **kwargs):
    if kwargs or unsqueeze_dim != 1 or torch.compiler.is_compiling() or not _fits_rope(q, k, cos, sin):
        return original(q, k, cos, sin, unsqueeze_dim, **kwargs)
    # [b, heads, n, d] as the op's [b, n, heads, d]: the families' q and k are views of that layout
    qo, ko = torch.ops.mlxcel_cpu.rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    return qo.transpose(1, 2), ko.transpose(1, 2)


def _rope_probe_agrees(original) -> bool:
    gen = torch.Generator().manual_seed(7)
    for dtype in (torch.bfloat16, torch.float32):
        q = torch.randn(2, 3, 5, 64, generator=gen).to(dtype)
        k = torch.randn(2, 1, 5, 64, generator=gen).to(dtype)
        cos = torch.randn(2, 5, 64, generator=gen).to(dtype)
        sin = torch.randn(2, 5, 64, generator=gen).to(dtype)
        try:
            want = original(q, k, cos, sin)
        except Exception:  # noqa: BLE001 - another signature: not the form the op computes
            return False
        got = _fused_rope(original, q, k, cos, sin)
        if not all(torch.equal(w, g) for w, g in zip(want, got)):
            return False
    return True


def install_rope(model: torch.nn.Module) -> list[str]:
    """Rebind `apply_rotary_pos_emb` in the family modules `model` is built from, where the
    fused op gives its exact bits; returns those modules' names."""
    done = []
    for name in sorted({type(m).__module__ for m in model.modules()}):
        module = sys.modules.get(name)
        fn = getattr(module, "apply_rotary_pos_emb", None)
        if fn is None or not callable(fn):
            continue
        if isinstance(fn, partial) and fn.func is _fused_rope:
            done.append(name)
            continue
        if _rope_probe_agrees(fn):
            setattr(module, "apply_rotary_pos_emb", partial(_fused_rope, fn))
            done.append(name)
    return done


def remove_rope(model: torch.nn.Module) -> None:
    """Give the family modules of `model` their own `apply_rotary_pos_emb` back."""
    for name in {type(m).__module__ for m in model.modules()}:
        module = sys.modules.get(name)
        fn = getattr(module, "apply_rotary_pos_emb", None)
        if isinstance(fn, partial) and fn.func is _fused_rope:
            setattr(module, "apply_rotary_pos_emb", fn.args[0])


class KVQuantOperands(NamedTuple):
    """A paged layer's quantized sides as the kernel (kernels/cpu/kv_quant.cpp) reads them: per
    side, the per-slot, per-head scales (int8 and turbo), and for turbo the codebook levels and
    the rotation's signs (engine/kv_turbo.py); all None: that side is in the compute dtype."""

    key_scales: torch.Tensor | None = None
    key_levels: torch.Tensor | None = None
    key_signs: torch.Tensor | None = None
    value_scales: torch.Tensor | None = None
    value_levels: torch.Tensor | None = None
    value_signs: torch.Tensor | None = None

    @property
    def quantized(self) -> bool:
        return self.key_scales is not None or self.value_scales is not None


def decode_attention(module: torch.nn.Module, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     table: torch.Tensor, lengths: torch.Tensor, scaling: float | None,
                     write: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                     quant: KVQuantOperands | None = None) -> torch.Tensor:
    """[rows, heads, dv] for one query per row [rows, heads, dk] over each row's first
    `lengths` slots of `table` [rows, width] (or [1, width], one table for every row: a prompt
    chunk's tokens) in the paged keys/values of the module's layer; `write`: (new keys
    [rows, kv_heads, dk], new values, slots [rows]) stored first. `quant`: the sides stored
    int8 or turbo (new keys or values quantized as they are stored), read inside the kernel's
    dot products."""
    window = getattr(module, WINDOW_ATTR, None) or 0
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if quant is not None and quant.quantized:
        return _quant_attention(query, keys, values, table, lengths, window, scale, quant, write)
    return torch.ops.mlxcel_cpu.decode_attention(query.contiguous(), keys, values, table, lengths, window, scale,
                                                 *(write or ()))


def prompt_attention(module: torch.nn.Module, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     table: torch.Tensor, lengths: torch.Tensor, scaling: float | None,
                     quant: KVQuantOperands | None = None) -> torch.Tensor:
    """decode_attention for prompt tokens (nothing stored): where the CPU has AMX tiles and
    the head size is 64, 128 or 256 (bf16), the queries sharing a table get their scores from
    tiles; a token's result is the same whatever its chunk, but not the bits decode_attention
    gives it (a generated token is computed one way, a prompt token another, each always so).
    Over quantized keys or values, the same kernel as decode_attention's."""
    window = getattr(module, WINDOW_ATTR, None) or 0
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if quant is not None and quant.quantized:
        return _quant_attention(query, keys, values, table, lengths, window, scale, quant)
    return torch.ops.mlxcel_cpu.prompt_attention(query.contiguous(), keys, values, table, lengths, window, scale)


def _quant_attention(query, keys, values, table, lengths, window: int, scale: float, quant: KVQuantOperands,
                     write=None) -> torch.Tensor:
    return torch.ops.mlxcel_cpu.attention_kv_quant(query.contiguous(), keys, quant.key_scales, quant.key_levels,
                                                   quant.key_signs, values, quant.value_scales, quant.value_levels,
                                                   quant.value_signs, table, lengths, window, scale, *(write or ()))


def attention_fits(query: torch.Tensor, dropout: float, kwargs: dict) -> bool:
    """The kernel computes plain softmax attention: no sinks, no logit soft-capping, no dropout."""
    return (query.device.type == "cpu" and query.dtype in (torch.bfloat16, torch.float32) and not dropout
            and kwargs.get("s_aux") is None and not kwargs.get("softcap"))
