"""MLX-quantized weights on the torch backend's device path, without MLX installed: what
scripts/bench/gpu_check.sh runs on CUDA (MLXCEL_TEST_DEVICE=cuda; default cpu, where the same
checks run through the CPU kernel).

The packing here is written from MLX's documented format (mx.quantize: per group of `group`
values, scale = (max - min) / (2^bits - 1), bias = min, codes in one little-endian bit stream
of uint32 words), in numpy, so the machine needs no MLX (test_torch_quantized.py checks the
same format against mx.quantize itself).
1. A packed linear on the device (the chunked dequantize-and-multiply path on CUDA): within
   1e-5 of the largest output of the numpy product with s * q + z; the embedding's rows exact.
2. A tiny random llama written as an MLX-quantized checkpoint (4-bit g32 linears, 8-bit g64
   embedding and tied head) served on the device against the same weights dequantized into a
   dense checkpoint: logits over a prompt and 4 decode steps within 1e-4 of their range, the
   same greedy tokens.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from mlxcel.backends.torch.quantized import QuantizedEmbedding, QuantizedLinear

DEVICE = os.environ.get("MLXCEL_TEST_DEVICE", "cpu")


def quantize(w: np.ndarray, bits: int, group: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(words int32 [n, k * bits / 32], scales, biases, dequantized fp32) of `w` [n, k]."""
    n, k = w.shape
    g = w.reshape(n, k // group, group).astype(np.float32)
    lo, hi = g.min(-1), g.max(-1)
    scales = np.maximum(hi - lo, 1e-8) / (2 ** bits - 1)
    codes = np.clip(np.rint((g - lo[..., None]) / scales[..., None]), 0, 2 ** bits - 1).astype(np.uint32)
    stream = ((codes.reshape(n, k, 1) >> np.arange(bits, dtype=np.uint32)) & 1).astype(np.uint8)
    words = np.packbits(stream.reshape(n, k * bits), axis=1, bitorder="little").view(np.int32)
    deq = (codes * scales[..., None] + lo[..., None]).reshape(n, k).astype(np.float32)
    return words, scales.astype(np.float32), lo.astype(np.float32), deq


@pytest.mark.parametrize("bits,group", [(4, 32), (8, 64), (3, 128), (6, 32)])
def test_packed_linear_and_embedding_on_the_device(bits, group):
    rng = np.random.default_rng(bits)
    words, s, b, deq = quantize(rng.standard_normal((200, 256)).astype(np.float32), bits, group)
    t = [torch.from_numpy(a) for a in (words, s, b)]
    linear = QuantizedLinear(*t, bits, group).to(DEVICE)
    x = rng.standard_normal((7, 256)).astype(np.float32)
    with torch.inference_mode():
        got = linear(torch.from_numpy(x).to(DEVICE)).cpu().double().numpy()
    want = x.astype(np.float64) @ deq.astype(np.float64).T
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    embed = QuantizedEmbedding(*t, bits, group, torch.float32).to(DEVICE)
    ids = torch.tensor([[5, 199, 0]], device=DEVICE)
    np.testing.assert_allclose(embed(ids).cpu().numpy()[0], deq[[5, 199, 0]], rtol=0, atol=1e-6)


def _tiny_llama(tmp_path):
    """A random 2-layer llama saved dense, and its MLX-quantized form with the dense twin of
    the quantized weights; returns (quantized dir, dequantized dir)."""
    from safetensors.numpy import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True)
    model = LlamaForCausalLM(config).float()
    for p in model.parameters():  # weights large enough that logits spread
        p.data.normal_(0, 0.2)
    quant_dir, dense_dir = tmp_path / "q", tmp_path / "dense"
    model.save_pretrained(str(dense_dir))
    packed, dense = {}, {}
    for name, value in model.state_dict().items():
        arr = value.numpy()
        if name == "lm_head.weight":
            continue
        if name.endswith("proj.weight") or name == "model.embed_tokens.weight":
            bits, group = (8, 64) if "embed" in name else (4, 32)
            words, s, b, deq = quantize(arr, bits, group)
            stem = name[: -len(".weight")]
            packed.update({f"{stem}.weight": words.view(np.uint32), f"{stem}.scales": s, f"{stem}.biases": b})
            dense[name] = deq
        else:
            packed[name] = dense[name] = arr
    quant_dir.mkdir()
    save_file(packed, str(quant_dir / "model.safetensors"))
    for f in dense_dir.glob("*.safetensors"):
        f.unlink()
    save_file(dense, str(dense_dir / "model.safetensors"))
    raw = json.loads((dense_dir / "config.json").read_text())
    raw["quantization"] = {"group_size": 32, "bits": 4, "mode": "affine",
                           "model.embed_tokens": {"group_size": 64, "bits": 8}}
    (quant_dir / "config.json").write_text(json.dumps(raw))
    return quant_dir, dense_dir


def test_quantized_checkpoint_matches_its_dequantized_twin_on_the_device(tmp_path):
    from mlxcel.backends.torch.backend import TorchBackend
    from mlxcel.engine.backend import ForwardRow

    quant_dir, dense_dir = _tiny_llama(tmp_path)
    ids = [1, 17, 300, 42, 7, 99, 256, 3, 8, 150, 11]
    runs = []
    for path in (quant_dir, dense_dir):
        backend = TorchBackend(path, dtype="float32", device=DEVICE, build_env=os.environ)
        seq = backend.new_sequence()
        out = [backend.forward_all(ids, seq)]
        for _ in range(4):
            out.append(backend.forward([ForwardRow([int(out[-1][-1].argmax())], seq, decode=True)]))
        runs.append(np.concatenate(out))
        if path == quant_dir:
            assert backend.info.quantization == "4bit-g32+8bit-g64"
    got, want = runs
    span = float(want.max() - want.min())
    assert np.abs(got - want).max() <= 1e-4 * span
    assert (got.argmax(-1) == want.argmax(-1)).all()
