"""MLX-quantized linears and embeddings on the torch backend, the weights kept packed.

MLX's affine format (mx.quantize): a weight row is cut into groups of `group` values; each
group has a scale s and a bias z, and a value is w = s * q + z for an unsigned `bits`-bit code
q. A row's codes are one little-endian bit stream stored as uint32 words (held here as int32,
the same bits). Scales and biases stay in the checkpoint's dtype (bf16 as mlx-lm writes them, fp16
as a lossless GGUF conversion does, or fp32), which the kernel reads as is: 4-bit weights in
groups of 64 read 4.5 bits per weight, in groups of 32 (GGUF's Q4_1) 5.

What runs a product: on the CPU, every row takes mlxcel's kernel (kernels/cpu/quant_rows.cpp),
which unpacks and scales the codes inside the dot products, up to eight rows per pass over a
weight row. Each row's sum runs in the same order whatever else the call holds, so a prompt
token gets the same bits prefilled whole, after a cached prefix, or beside other sequences.
It is also the faster CPU path for prompt chunks: on SmolLM2's 4-bit products (2-core AVX-512
machine) it ran 1.5-15x faster than dequantizing output-row chunks and multiplying them in
torch, at 32 to 512 rows. Elsewhere (CUDA, or no compiler on the CPU) a product dequantizes
CHUNK_VALUES weights' worth of output rows at a time into a scratch matrix in the compute dtype
and multiplies it in torch (`chunked`): never the whole matrix at once, and plain torch ops, so
it runs on CUDA with the stock wheel. The embedding dequantizes only the rows it looks up; a
tied LM head shares the embedding's packed tensors.

The modules keep nn.Linear's `in_features` / `out_features`, so LoRA terms (lora.py) and
forward hooks find and wrap them as they do dense linears.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mlxcel.backends.torch.row_gemv import RowKernel

CHUNK_VALUES = 1 << 20  # weights dequantized per scratch matrix (4 MiB in fp32)
BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)


def unpack_codes(words: torch.Tensor, bits: int, k: int) -> torch.Tensor:
    """The codes [.., k] (uint8 or int32) of packed rows [.., k * bits / 32] (int32 words)."""
    data = words.contiguous().view(torch.uint8)  # the bit stream, a byte at a time
    if 8 % bits == 0:  # whole codes per byte: a shift and a mask per code
        if bits == 8:
            return data
        parts = [(data >> shift) & ((1 << bits) - 1) for shift in range(0, 8, bits)]
        return torch.stack(parts, dim=-1).reshape(*data.shape[:-1], k)
    # codes straddle bytes: each is read from the two bytes that hold its first bit
    data = data.to(torch.int32)
    nbytes = data.shape[-1]
    bit = torch.arange(k, device=words.device) * bits
    lo = bit // 8
    hi = (lo + 1).clamp(max=nbytes - 1)
    pair = data[..., lo] | (data[..., hi] << 8)
    return (pair >> (bit % 8).to(torch.int32)) & ((1 << bits) - 1)


def dequantize(words: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, bits: int, group: int,
               dtype: torch.dtype) -> torch.Tensor:
    """Dense rows [.., k] in `dtype` of packed rows (w = s * q + z, computed in fp32)."""
    k = words.shape[-1] * 32 // bits
    codes = unpack_codes(words, bits, k).view(*words.shape[:-1], k // group, group).float()
    w = torch.addcmul(biases.float().unsqueeze(-1), codes, scales.float().unsqueeze(-1))
    return w.view(*words.shape[:-1], k).to(dtype)


class _Packed(torch.nn.Module):
    """Packed weight, scales and biases as buffers (they follow .to(device), never a dtype cast)."""

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, bits: int,
                 group: int) -> None:
        super().__init__()
        if bits not in BITS or group not in GROUP_SIZES:
            raise ValueError(f"MLX quantization with {bits} bits, group {group} is not supported "
                             f"(bits {BITS}, group sizes {GROUP_SIZES})")
        k = weight.shape[-1] * 32 // bits
        if weight.shape[-1] * 32 != k * bits or scales.shape != (weight.shape[0], k // group) \
                or biases.shape != scales.shape:
            raise ValueError(f"packed shapes {tuple(weight.shape)}, scales {tuple(scales.shape)} do not fit "
                             f"{bits}-bit codes in groups of {group}")
        self.bits, self.group = bits, group
        self.register_buffer("weight", weight.contiguous().view(torch.int32))
        # the checkpoint's own dtype where the kernel reads it (it widens bf16 and fp16 exactly)
        keep = scales.dtype if scales.dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.float32
        self.register_buffer("scales", scales.to(keep).contiguous())
        self.register_buffer("biases", biases.to(keep).contiguous())


class QuantizedLinear(_Packed):
    """nn.Linear over packed weights: y = x @ W^T (+ bias), W never materialised whole."""

    def __init__(self, weight, scales, biases, bits, group, bias: torch.Tensor | None = None) -> None:
        super().__init__(weight, scales, biases, bits, group)
        self.out_features = weight.shape[0]
        self.in_features = weight.shape[-1] * 32 // bits
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)
        self.op = None  # the CPU kernel (torch.ops.mlxcel_cpu.quant_rows_linear); None: `chunked`

    @classmethod
    def tied(cls, embedding: QuantizedEmbedding) -> QuantizedLinear:
        """The LM head of a tied checkpoint: the embedding's packed tensors, shared."""
        head = cls(embedding.weight, embedding.scales, embedding.biases, embedding.bits, embedding.group)
        head.weight, head.scales, head.biases = embedding.weight, embedding.scales, embedding.biases
        return head

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bits={self.bits}, group={self.group}"

    def dequantized(self, start: int = 0, stop: int | None = None, dtype: torch.dtype = torch.float32):
        """Output rows [start, stop) as a dense [rows, in] matrix."""
        return dequantize(self.weight[start:stop], self.scales[start:stop], self.biases[start:stop], self.bits,
                          self.group, dtype)

    def chunked(self, x: torch.Tensor) -> torch.Tensor:
        """Every row through scratch matrices of CHUNK_VALUES weights, one block of outputs each."""
        step = max(64, CHUNK_VALUES // self.in_features // 64 * 64)
        parts = []
        for start in range(0, self.out_features, step):
            w = self.dequantized(start, start + step, x.dtype)
            b = None if self.bias is None else self.bias[start:start + step]
            parts.append(F.linear(x, w, b))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.op is None:
            return self.chunked(x)
        return self.op(x, self.weight, self.scales, self.biases, self.bias, self.bits, self.group)


class QuantizedEmbedding(_Packed):
    """nn.Embedding over packed rows: only the looked-up rows are dequantized."""

    def __init__(self, weight, scales, biases, bits, group, dtype: torch.dtype,
                 embed_scale: torch.Tensor | float | None = None) -> None:
        super().__init__(weight, scales, biases, bits, group)
        self.num_embeddings = weight.shape[0]
        self.embedding_dim = weight.shape[-1] * 32 // bits
        self.dtype = dtype
        # Gemma's scaled embedding multiplies its rows by sqrt(hidden) in its own forward
        self.embed_scale = embed_scale

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, bits={self.bits}, group={self.group}"

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        rows = dequantize(self.weight[flat], self.scales[flat], self.biases[flat], self.bits, self.group, self.dtype)
        rows = rows.view(*ids.shape, self.embedding_dim)
        if self.embed_scale is not None:
            scale = self.embed_scale
            rows = rows * (scale.to(rows.dtype) if isinstance(scale, torch.Tensor) else scale)
        return rows


def quantized_linears(*roots: torch.nn.Module) -> list[QuantizedLinear]:
    seen: dict[int, QuantizedLinear] = {}
    for root in roots:
        for module in root.modules():
            if isinstance(module, QuantizedLinear):
                seen[id(module)] = module
    return list(seen.values())


def _kernel_forward(module: QuantizedLinear):
    """The instance forward of a linear on the CPU kernel: its tensors read once here (a step makes
    ~200 of these calls, and each buffer lookup through nn.Module costs about a microsecond)."""
    op, w, s, z, b, bits, group = module.op, module.weight, module.scales, module.biases, module.bias, \
        module.bits, module.group

    def forward(x: torch.Tensor) -> torch.Tensor:
        return op(x, w, s, z, b, bits, group)
    return forward


def install_kernel(kernel: RowKernel | None, *roots: torch.nn.Module) -> int:
    """Give every quantized linear under `roots` whose weights are on the CPU the kernel op when
    `kernel` (the loaded library) is given, else the chunked path; returns how many take it. Call
    it again after moving the modules (the kernel's forward holds their tensors)."""
    op = torch.ops.mlxcel_cpu.quant_rows_linear if kernel is not None else None
    taken = 0
    for module in quantized_linears(*roots):
        module.op = op if module.weight.device.type == "cpu" else None
        if module.op is not None:
            module.forward = _kernel_forward(module)
        elif "forward" in module.__dict__:
            del module.forward
        taken += module.op is not None
    return taken


def label(modules: list[torch.nn.Module]) -> str | None:
    """The checkpoint's quantization as ModelInfo says it (mlx backend's form: 4bit-g64), the
    most common form first when layers differ."""
    forms: dict[str, int] = {}
    for m in modules:
        if isinstance(m, _Packed):
            key = f"{m.bits}bit-g{m.group}"
            forms[key] = forms.get(key, 0) + 1
    if not forms:
        return None
    return "+".join(sorted(forms, key=lambda f: -forms[f]))


__all__ = ["QuantizedEmbedding", "QuantizedLinear", "dequantize", "install_kernel", "label",
           "quantized_linears", "unpack_codes"]
