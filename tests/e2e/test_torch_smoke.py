"""A smoke subset of the e2e suite on `--backend torch`: the small set scripts/bench/gpu_check.sh
runs on a CUDA machine (the full default-model matrix runs on both backends through the
`default_server` fixture; MLXCEL_TEST_BACKENDS=torch narrows it to torch).

MLXCEL_TEST_DEVICE picks the device (default cpu); gpu_check.sh sets it to cuda.
MLXCEL_TEST_MODEL picks the checkpoint (default: the default model). gpu_check.sh points it at a
random-weight twin of SmolLM2 (scripts/fixtures/build_random_twin.py) where the real weights
cannot travel; the tests that expect words ("Paris") need the real weights and skip on a twin,
the rest hold for any weights: each served greedy token is checked against transformers' own
forward of the same checkpoint on the same device, and a request gets the same tokens alone,
beside seven others and from the prompt cache (on a GPU, the first run of those properties there).
"""

from __future__ import annotations

import os
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import httpx
import pytest

from tests.conftest import DEFAULT_MODEL, ServerProcess, fixture_path

DEVICE = os.environ.get("MLXCEL_TEST_DEVICE", "cpu")
MODEL = os.environ.get("MLXCEL_TEST_MODEL", DEFAULT_MODEL)
real_weights = pytest.mark.skipif(MODEL != DEFAULT_MODEL, reason=f"{MODEL} is not the default model's real weights")

# A served greedy token may sit below the reference's best logit by at most this much: fp32 on
# both sides, different kernels (mlxcel's row kernel and paged attention against transformers'
# own). A wrong position, mask or cache row moves the choice by whole logits, not 1e-3.
FP32_LOGIT_SLACK = 1e-3

PROMPTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "1, 2, 3, 4,", "The chemical symbol for gold is", "Translate to French: good morning",
           "My favourite colour is", "Water boils at")


def start(*extra: str) -> ServerProcess:
    fixture_path(MODEL)
    return ServerProcess(["-m", MODEL, "--offline", "--backend", "torch", "--device", DEVICE, *extra])


@pytest.fixture(scope="module")
def torch_server():
    server = start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(torch_server):
    from openai import OpenAI

    return OpenAI(base_url=torch_server.base_url + "/v1", api_key="not-needed", max_retries=0, timeout=120)


def test_props_and_log_name_the_torch_backend(torch_server):
    backend = httpx.get(torch_server.base_url + "/props").json()["backend"]
    assert backend["name"] == "torch" and backend["device"].startswith(DEVICE)
    assert backend["reason"] == "requested"
    log = torch_server.log()
    assert "backend torch on" in log
    # one line format from start to end: Litestar must not replace the CLI's logging when it starts
    loaded = next(line for line in log.splitlines() if " loaded: " in line)
    assert re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} I model ", loaded), loaded
    if backend["device"] == "cpu" and backend["compute_dtype"] in ("bfloat16", "float32"):
        # the CI machine kind has a C++ compiler: the served model runs mlxcel's row kernel
        assert f"decoding computes its {backend['compute_dtype']} matrix products with mlxcel row kernel" in log


@real_weights
def test_chat_greedy_answers_paris(client):
    r = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=40,
                                       messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in r.choices[0].message.content and r.choices[0].finish_reason == "stop"


def test_stream_concatenates_to_non_stream(client):
    # no prompt cache: the second request's prefill then has the first's shapes, which is what
    # keeps bf16 bits equal on a device without mlxcel's kernels (docs/api.md)
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Name three colors."}],
                  temperature=0, max_tokens=24, extra_body={"cache_prompt": False})
    full = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = client.chat.completions.create(stream=True, **kwargs)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full


def test_native_completion(torch_server):
    r = httpx.post(torch_server.base_url + "/completion", timeout=120,
                   json={"prompt": "The capital of France is", "n_predict": 8, "temperature": 0, "ignore_eos": True})
    body = r.json()
    assert r.status_code == 200 and body["tokens_predicted"] == 8
    if MODEL == DEFAULT_MODEL:
        assert "Paris" in body["content"]


@pytest.fixture(scope="module")
def fp32_server(torch_server):
    torch_server.stop()  # one model server at a time
    server = start("--dtype", "float32", "--parallel", str(len(PROMPTS)))
    yield server
    server.stop()


class Reference(NamedTuple):
    model: Any  # transformers' own model of the checkpoint, fp32, on the test device
    tokenizer: Any
    eos: list[int]  # the end-of-generation tokens the server bans under ignore_eos


@pytest.fixture(scope="module")
def reference() -> Reference:
    import torch
    import transformers

    from mlxcel.engine.tokenizer import Tokenizer

    path = fixture_path(MODEL)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).to(DEVICE).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
    return Reference(model, tokenizer, sorted(Tokenizer(path).eos_token_ids))


def complete(server: ServerProcess, ids: list[int], n: int = 12, cache_prompt: bool = False) -> dict:
    """/completion's body for `n` greedy tokens after the prompt `ids`, end tokens banned."""
    r = httpx.post(server.base_url + "/completion", timeout=300, json={
        "prompt": ids, "n_predict": n, "temperature": 0, "ignore_eos": True, "return_tokens": True,
        "cache_prompt": cache_prompt})
    assert r.status_code == 200, r.text
    return r.json()


def served_greedy(server: ServerProcess, ids: list[int], n: int = 12, cache_prompt: bool = False) -> list[int]:
    return complete(server, ids, n, cache_prompt)["tokens"]


def assert_reference_greedy(reference, prompt_ids: list[int], served: list[int]) -> None:
    """Each served token is (within FP32_LOGIT_SLACK) the reference's best next token, given the
    prompt and the served tokens before it (one teacher-forced reference forward); the end
    tokens are out of the running on both sides (ignore_eos)."""
    import torch

    with torch.inference_mode():
        ids = torch.tensor([prompt_ids + served], device=reference.model.device)
        logits = reference.model(input_ids=ids).logits[0, len(prompt_ids) - 1:-1].float().cpu()
        logits[:, reference.eos] = -torch.inf
    best = logits.max(dim=-1).values
    chosen = logits[torch.arange(len(served)), torch.tensor(served)]
    behind = (best - chosen).tolist()
    assert max(behind) <= FP32_LOGIT_SLACK, f"served tokens {served} trail the reference's best by {behind}"


def test_fp32_greedy_follows_transformers_forward(fp32_server, reference):
    backend = httpx.get(fp32_server.base_url + "/props").json()["backend"]
    assert backend["compute_dtype"] == "float32" and backend["device"].startswith(DEVICE)
    ids = reference.tokenizer(PROMPTS[0]).input_ids
    served = served_greedy(fp32_server, ids)
    assert len(served) == 12
    assert_reference_greedy(reference, ids, served)


@pytest.fixture(scope="module")
def alone_and_together(fp32_server, reference):
    """Each prompt's 16 greedy tokens served alone, then all eight requests at once (sharing
    batched steps: prefill chunks beside decode rows)."""
    prompts = [reference.tokenizer(p).input_ids for p in PROMPTS]
    alone = [served_greedy(fp32_server, ids, 16) for ids in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(lambda ids: served_greedy(fp32_server, ids, 16), prompts))
    return prompts, alone, together


def test_fp32_concurrent_greedy_follows_transformers_forward(alone_and_together, reference):
    prompts, _, together = alone_and_together
    for ids, served in zip(prompts, together):
        assert len(served) == 16
        assert_reference_greedy(reference, ids, served)


def test_fp32_rows_get_the_same_tokens_alone_and_together(alone_and_together):
    """Batch invariance over HTTP: what shares a request's steps does not change its tokens."""
    _, alone, together = alone_and_together
    assert together == alone


def test_fp32_prompt_cache_gives_the_cold_tokens(fp32_server, reference):
    """Prompt-cache identity: a prompt served again from its cached prefix gets the tokens a cold
    prefill got."""
    ids = reference.tokenizer(" ".join(PROMPTS)).input_ids
    cold = served_greedy(fp32_server, ids, 16, cache_prompt=True)
    warm = complete(fp32_server, ids, 16, cache_prompt=True)
    assert warm["tokens"] == cold
    assert warm["timings"]["cache_n"] == len(ids) - 1  # all but the last prompt token came from the cache
