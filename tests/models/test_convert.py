"""Converted checkpoints are numerically the model they came from.

Each converted checkpoint is loaded twice from the same directory: by MLXBackend (mlx-lm
modules under our registry) in fp32 and by transformers on torch in fp32. Their logits for a
fixed prompt must agree, and the rope base must be the checkpoint's own: mlx-lm silently uses
10000 when config.json lacks a top-level rope_theta, which these tests would catch.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.fixtures import (
    DEFAULT_MODEL,
    GEMMA3,
    QWEN2_TINY,
    QWEN3_TINY,
    SMOLLM2_4BIT,
    SMOLLM2_8BIT,
    available,
    fixture_path,
)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from mlxcel.backends.mlx.backend import MLXBackend  # noqa: E402

# Max abs logit difference allowed between MLX (CPU, fp32) and torch (CPU, fp32).
TOLERANCE = 1e-3


def need(repo_id: str) -> Path:
    if not available(repo_id):
        pytest.skip(f"{repo_id} is not in the model store; run `make fixtures`")
    return fixture_path(repo_id)


def prompt_ids(path: Path, text: str) -> list[int]:
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    if tok.chat_template:
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if not isinstance(ids, list) else ids
    else:
        ids = tok(text).input_ids
    return list(ids)


def torch_logits(path: Path, ids: list[int]) -> np.ndarray:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    embed = model.get_input_embeddings()
    if model.config.model_type == "gemma3_text":
        # mlx-lm rounds Gemma's sqrt(hidden) embedding scale to bf16 (the training dtype);
        # transformers keeps it in the compute dtype. Use the same constant on both sides.
        embed.embed_scale.fill_(float(torch.tensor(model.config.hidden_size**0.5, dtype=torch.bfloat16)))
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def mlx_logits(path: Path, ids: list[int]) -> tuple[np.ndarray, MLXBackend]:
    backend = MLXBackend(path, "float32")
    return backend.forward_all(ids, backend.new_sequence()), backend


def rope_bases(backend: MLXBackend) -> set[float]:
    return {float(layer.self_attn.rope.base) for layer in backend.model.layers}


def greedy(backend: MLXBackend, ids: list[int], n: int) -> list[int]:
    cache = backend.new_sequence()
    logits = backend.forward_all(ids, cache)[-1]
    out = []
    for _ in range(n):
        token = int(np.argmax(logits))
        out.append(token)
        logits = backend.forward_all([token], cache)[-1]
    return out


def check_against_torch(path: Path, text: str) -> tuple[np.ndarray, MLXBackend]:
    ids = prompt_ids(path, text)
    ours, backend = mlx_logits(path, ids)
    ref = torch_logits(path, ids)
    assert ours.shape == ref.shape
    diff = float(np.abs(ours - ref).max())
    assert diff <= TOLERANCE, f"{path.name}: max abs logit diff {diff:.2e} > {TOLERANCE}"
    assert int(np.argmax(ours[-1])) == int(np.argmax(ref[-1]))
    return ours, backend


def test_smollm2_matches_transformers():
    path = need(DEFAULT_MODEL)
    config = json.loads((path / "config.json").read_text())
    # The GGUF's llama.rope.freq_base; a fallback to 10000 would change every logit.
    assert config["rope_theta"] == 100000.0
    _, backend = check_against_torch(path, "What is the capital of France?")
    assert rope_bases(backend) == {100000.0}


def test_smollm2_answers_and_keeps_chat_template():
    from mlxcel.store.resolve import resolve_model

    path = need(DEFAULT_MODEL)
    # `-m HuggingFaceTB/SmolLM2-135M-Instruct` resolves offline, exactly as after a download.
    assert resolve_model(DEFAULT_MODEL, root=path.parent.parent, offline=True) == path
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    assert "<|im_start|>" in json.loads((path / "tokenizer_config.json").read_text())["chat_template"]
    backend = MLXBackend(path, "float32")
    out = greedy(backend, prompt_ids(path, "What is the capital of France?"), 8)
    assert "Paris" in tok.decode(out)
    # SmolLM2 splits digits one by one; the GGUF pre-tokenizer name 'smollm' must keep that.
    assert len(tok("2024").input_ids) == 4


@pytest.mark.slow
def test_gemma3_matches_transformers():
    path = need(GEMMA3)
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "gemma3_text"
    assert (config["rope_theta"], config["rope_local_base_freq"]) == (1000000.0, 10000.0)
    _, backend = check_against_torch(path, "The capital of France is")
    assert rope_bases(backend) == {1000000.0, 10000.0}
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    assert tok("Hi").input_ids[0] == tok.bos_token_id == 2  # base model: BOS added, no template


@pytest.mark.parametrize("repo_id", [QWEN2_TINY, QWEN3_TINY])
def test_qwen_tiny_matches_transformers(repo_id):
    path = need(repo_id)
    config = json.loads((path / "config.json").read_text())
    assert config["rope_theta"] == 1000000.0  # transformers 5 wrote it only under rope_parameters
    _, backend = check_against_torch(path, "Hello, world")
    assert rope_bases(backend) == {1000000.0}
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [151643, 151644, 151645]
    assert tok("Hello world").input_ids == [9707, 1879]  # the real Qwen BPE ids
    if config["model_type"] == "qwen3":
        assert tok.convert_tokens_to_ids(["<think>", "</think>"]) == [151667, 151668]


@pytest.mark.parametrize("repo_id, bits", [(SMOLLM2_4BIT, 4), (SMOLLM2_8BIT, 8)])
def test_quantized_loads_and_decodes(repo_id, bits):
    path = need(repo_id)
    config = json.loads((path / "config.json").read_text())
    assert config["quantization"]["bits"] == bits and config["quantization"]["group_size"] == 64
    backend = MLXBackend(path, "auto")
    assert backend.info.quantization == f"{bits}bit-g64"
    ids = prompt_ids(path, "What is the capital of France?")
    first = greedy(backend, ids, 6)
    assert all(0 <= t < backend.info.vocab_size for t in first)
    if bits == 8:
        tok = transformers.AutoTokenizer.from_pretrained(str(path))
        assert "Paris" in tok.decode(first)


def test_convert_cli_from_transformers5_checkpoint(tmp_path):
    """`mlxcel convert` on an HF dir saved by transformers 5 (rope only under rope_parameters)."""
    from mlxcel.cli.main import main as mlxcel_main
    from scripts.fixtures.build_qwen import write_hf

    src = tmp_path / "hf"
    write_hf("qwen3", src)
    raw = json.loads((src / "config.json").read_text())
    assert "rope_theta" not in raw  # the trap this conversion exists to close
    root = tmp_path / "store"
    rc = mlxcel_main(["convert", str(src), "--out-repo", "t/qwen3-8bit", "-q", "--q-bits", "8", "--models-dir", str(root)])
    assert rc == 0
    out = root / "t" / "qwen3-8bit"
    config = json.loads((out / "config.json").read_text())
    assert config["rope_theta"] == 1000000.0
    assert config["quantization"] == config["quantization_config"]
    assert config["quantization"]["bits"] == 8 and config["quantization"]["group_size"] == 64
    assert (out / "tokenizer.json").is_file() and (out / "generation_config.json").is_file()
    backend = MLXBackend(out, "float32")
    assert rope_bases(backend) == {1000000.0}
    assert len(greedy(backend, [9707, 1879], 3)) == 3
    assert not (root / ".staging").exists()
