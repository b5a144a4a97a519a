"""The thinking switch over a real server: qwen3-tiny started with Qwen3-0.6B's published
template (--chat-template-file, tests/chat/templates/), answered as b10621's /apply-template
answers it.

Under the default `--reasoning auto` the template has a thinking mode, so `enable_thinking` is
true and the prompt ends with the bare assistant turn; a request's `chat_template_kwargs` or
`reasoning_effort: "none"` makes the template write an empty thinking block. The same rendering
is what a chat completion prefills.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.conftest import ServerProcess, fixture_path
from tests.fixtures import QWEN3_TINY

QWEN3 = Path(__file__).parents[1] / "chat" / "templates" / "Qwen-Qwen3-0.6B.jinja"
ASK = [{"role": "user", "content": "Why is the sky blue?"}]
OPEN_END, CLOSED_END = "<|im_start|>assistant\n", "<|im_start|>assistant\n<think>\n\n</think>\n\n"


@pytest.fixture(scope="module")
def server():
    fixture_path(QWEN3_TINY)
    s = ServerProcess(["-m", QWEN3_TINY, "--offline", "--chat-template-file", str(QWEN3)])
    yield s
    s.stop()


def _apply(server, **body) -> httpx.Response:
    return httpx.post(server.base_url + "/apply-template", json={"messages": ASK, **body}, timeout=60)


def test_apply_template_thinking_endings(server):
    assert _apply(server).json()["prompt"].endswith(OPEN_END)
    assert not _apply(server).json()["prompt"].endswith(CLOSED_END)
    for body in ({"chat_template_kwargs": {"enable_thinking": False}}, {"reasoning_effort": "none"}):
        assert _apply(server, **body).json()["prompt"].endswith(CLOSED_END), body
    assert _apply(server, chat_template_kwargs={"enable_thinking": True}).json()["prompt"].endswith(OPEN_END)
    r = _apply(server, chat_template_kwargs={"enable_thinking": "no"})
    assert r.status_code == 400 and "expected boolean" in r.json()["error"]["message"]


def test_chat_prefills_the_same_rendering(server):
    for kwargs in ({}, {"chat_template_kwargs": {"enable_thinking": False}}):
        body = {"messages": ASK, **kwargs}
        counted = httpx.post(server.base_url + "/v1/chat/completions/input_tokens", json=body, timeout=60).json()
        prompt = _apply(server, **kwargs).json()["prompt"]
        tokens = httpx.post(server.base_url + "/tokenize", json={"content": prompt, "parse_special": True},
                            timeout=60).json()["tokens"]
        chat = httpx.post(server.base_url + "/v1/chat/completions", timeout=120,
                          json={**body, "max_tokens": 1, "temperature": 0}).json()
        assert chat["usage"]["prompt_tokens"] == counted["input_tokens"] == len(tokens), kwargs
