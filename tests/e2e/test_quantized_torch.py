"""An MLX-quantized checkpoint (4-bit SmolLM2, group 64) served by `--backend torch` through the
real server: the weights stay packed (backends/torch/quantized.py), the startup log says which
kernel runs them, and /v1/chat/completions answers through the openai SDK, streamed and not."""

from __future__ import annotations

import httpx
import pytest
from openai import OpenAI

from tests.conftest import module_server
from tests.fixtures import SMOLLM2_4BIT

server = module_server(SMOLLM2_4BIT, "--backend", "torch", "--device", "cpu")


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.base_url + "/v1", api_key="not-needed", max_retries=0, timeout=120)


def test_props_and_log_say_torch_runs_the_packed_weights(server):
    backend = httpx.get(server.base_url + "/props", timeout=30).json()["backend"]
    assert (backend["name"], backend["device"], backend["reason"]) == ("torch", "cpu", "requested")
    log = server.log()
    assert "MLX-quantized linears" in log


def test_chat_completion_on_packed_weights(client):
    kwargs = dict(model=SMOLLM2_4BIT, temperature=0, max_tokens=40,
                  messages=[{"role": "user", "content": "What is the capital of France?"}])
    r = client.chat.completions.create(**kwargs)
    answer = r.choices[0].message.content
    # 135M parameters at 4 bits do not reliably know the answer (MLX's own greedy text misses it
    # too); the text matching the dequantized model's is tests/models/test_torch_quantized.py's
    assert answer.strip() and r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens > 0 and r.usage.prompt_tokens > 0
    chunks = client.chat.completions.create(stream=True, **kwargs)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer
