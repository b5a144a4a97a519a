"""llama-server launch lines and request fields that real deployments use, on a real server.

One server, started as such a deployment starts llama-server: `--no-jinja`, a built-in
template name (`--chat-template chatml`) and `--kv-unified`, two slots over a 256-token
context. The /v1 routes read b10621's native sampler and grammar fields through the same
parser as /completion, so the same prompt, seed and fields give the same text on both.
"""

from __future__ import annotations

import httpx
import openai
import pytest
from openai import OpenAI

from tests.conftest import ServerProcess, fixture_path
from tests.fixtures import QWEN3_TINY

N_CTX, N_PARALLEL = 256, 2
MESSAGES = [{"role": "user", "content": "Count: one two three"}]
YES_NO = 'root ::= ("yes" | "no") " " [a-z]+'


@pytest.fixture(scope="module")
def server():
    fixture_path(QWEN3_TINY)
    s = ServerProcess(["-m", QWEN3_TINY, "--offline", "--no-jinja", "--chat-template", "chatml", "--kv-unified",
                       "-np", str(N_PARALLEL), "-c", str(N_CTX)])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=120)


def _native(server, prompt: str, **fields) -> str:
    r = httpx.post(server.base_url + "/completion", timeout=120,
                   json={"prompt": prompt, "n_predict": 24, "temperature": 0, "seed": 7, **fields})
    assert r.status_code == 200, r.text
    return r.json()["content"]


def _chat(client, **fields):
    return client.chat.completions.with_raw_response.create(
        model=QWEN3_TINY, messages=MESSAGES, max_tokens=24, temperature=0, seed=7, extra_body=fields)


def test_launch_lines_start_and_behave(server, client):
    # --chat-template chatml: the built-in format renders the prompt (qwen3-tiny has no BOS)
    r = httpx.post(server.base_url + "/apply-template", json={"messages": [{"role": "user", "content": "Hi"}]})
    assert r.json()["prompt"] == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    # --no-jinja: tools are refused with b10621's words, on every chat route
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    with pytest.raises(openai.BadRequestError, match="tools param requires --jinja flag"):
        client.chat.completions.create(model=QWEN3_TINY, messages=MESSAGES, max_tokens=1, tools=tools)
    with pytest.raises(openai.BadRequestError, match="tool_choice param requires --jinja flag"):
        client.chat.completions.create(model=QWEN3_TINY, messages=MESSAGES, max_tokens=1, tool_choice="none")
    r = httpx.post(server.base_url + "/v1/messages", timeout=120, json={
        "model": QWEN3_TINY, "max_tokens": 1, "messages": MESSAGES,
        "tools": [{"name": "f", "input_schema": {"type": "object"}}]})
    assert r.status_code == 400 and "tools param requires --jinja flag" in r.text
    # ... and replies are not parsed: a thinking block stays in the content
    out = client.chat.completions.create(
        model=QWEN3_TINY, max_tokens=1, temperature=0, extra_body={"echo": True},
        messages=[*MESSAGES, {"role": "assistant", "content": "<think>\nhm"}])
    msg = out.choices[0].message
    assert msg.content.startswith("<think>\nhm") and getattr(msg, "reasoning_content", None) is None
    # --kv-unified: each of the two slots may fill the whole context
    geometry = httpx.get(server.base_url + "/props").json()["geometry"]
    assert (geometry["n_ctx_slot"], geometry["n_parallel"]) == (N_CTX, N_PARALLEL)
    long = client.chat.completions.create(model=QWEN3_TINY, max_tokens=2,
                                          messages=[{"role": "user", "content": "word " * 180}])
    assert N_CTX // N_PARALLEL < long.usage.prompt_tokens < N_CTX


def test_v1_grammar_and_repeat_penalty_as_on_completion(server, client):
    prompt = httpx.post(server.base_url + "/apply-template", json={"messages": MESSAGES}).json()["prompt"]
    plain = _chat(client)
    for fields in ({"grammar": YES_NO}, {"repeat_penalty": 2.0, "repeat_last_n": 64}):
        raw = _chat(client, **fields)
        text = raw.parse().choices[0].message.content
        assert "X-miLLM-Ignored-Fields" not in raw.headers  # read, not reported as unused
        assert text == _native(server, prompt, **fields)
        assert text != plain.parse().choices[0].message.content
    grammared = _chat(client, grammar=YES_NO).parse().choices[0].message.content
    assert grammared.split(" ")[0] in ("yes", "no")
    # the text completion route reads them too
    done = OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0).completions.create(
        model=QWEN3_TINY, prompt=prompt, max_tokens=24, temperature=0, seed=7, extra_body={"grammar": YES_NO})
    assert done.choices[0].text == grammared


def test_v1_id_slot_pins_the_row(server, client):
    # slot 0 is the lowest free slot, where an unpinned request would land
    client.chat.completions.create(model=QWEN3_TINY, messages=MESSAGES, max_tokens=3, extra_body={"id_slot": 1})
    slots = {s["id"]: s for s in httpx.get(server.base_url + "/slots").json()}
    assert slots[1]["next_token"][0]["n_decoded"] == 3 and slots[1]["n_prompt_tokens"] > 0


@pytest.mark.parametrize("fields,param", [
    ({"id_slot": N_PARALLEL}, "id_slot"),
    ({"repeat_last_n": -2}, "repeat_last_n"),  # /completion's own limit and wording
    ({"grammar": "root ::= nope"}, "grammar"),
    ({"grammar": YES_NO, "response_format": {"type": "json_object"}}, "grammar"),
])
def test_v1_native_fields_refused_as_on_completion(client, fields, param):
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, **fields)
    assert e.value.body["param"] == param
