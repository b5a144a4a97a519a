"""Per-token logprobs on /v1 generations through the `openai` SDK on the real server: the
numbers equal native /completion's `n_probs` for the same prompt and seed (chat and text,
streamed and not, every choice of n), the legacy object's offsets, echo's prompt part, and
the bounds. Scoring mode's own contract is test_openai_scoring.py's.

Tolerance: the /v1 row and the native row run the same sampler report over the same
prompt; only the forward's batch shape and prompt-cache reuse differ between them, which
moves a logit by float rounding, far below 1e-4 in a log-probability at fp32. At bf16
(torch's CPU default where the CPU has native bf16) that rounding is up to ~0.06 per logit,
so 0.15 there, as in test_openai_scoring.py.
"""

from __future__ import annotations

import httpx
import openai
import pytest

from mlxcel.api.openai.generation import row_seed
from tests.conftest import DEFAULT_MODEL

TOLERANCE = {"float32": 1e-4, "bfloat16": 0.15}
CHAT = [{"role": "user", "content": "Name three colours."}]
PROMPT = "The capital of France is"
TOP = 5


def native(server, prompt, n_predict: int, seed: int, temperature: float) -> list[dict]:
    body = {"prompt": prompt, "n_predict": n_predict, "n_probs": TOP, "seed": seed, "temperature": temperature}
    r = httpx.post(server.base_url + "/completion", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["completion_probabilities"]


def close_entries(got: list[tuple[bytes, float]], want: list[dict], tolerance: float) -> None:
    """(bytes, logprob) pairs against native entries: same tokens in order, numbers within tolerance."""
    assert [b for b, _ in got] == [bytes(e["bytes"]) for e in want]
    for (_, lp), e in zip(got, want):
        assert abs(lp - e["logprob"]) <= tolerance, (lp, e)


def check_chat_content(content, want: list[dict], tolerance: float) -> None:
    close_entries([(bytes(c.bytes), c.logprob) for c in content], want, tolerance)
    for c, e in zip(content, want):
        assert bytes(c.bytes).decode("utf-8", "ignore").startswith(c.token) or not c.bytes
        close_entries([(bytes(t.bytes), t.logprob) for t in c.top_logprobs], e["top_logprobs"], tolerance)


def chat_prompt(server, tok) -> list[int]:
    rendered = httpx.post(server.base_url + "/apply-template", json={"messages": CHAT}).json()["prompt"]
    return tok.encode(rendered, add_special_tokens=False)


@pytest.fixture(scope="module")
def tok():
    from mlxcel.engine.tokenizer import Tokenizer
    from tests.conftest import fixture_path

    return Tokenizer(fixture_path(DEFAULT_MODEL))


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_equal_native(default_server, openai_client, tok, stream):
    args = dict(model=DEFAULT_MODEL, messages=CHAT, max_tokens=8, logprobs=True, top_logprobs=TOP, seed=11,
                temperature=0)
    if stream:
        content = []
        for chunk in openai_client.chat.completions.create(stream=True, **args):
            for choice in chunk.choices:
                if choice.logprobs is not None:
                    content += choice.logprobs.content
    else:
        content = openai_client.chat.completions.create(**args).choices[0].logprobs.content
    want = native(default_server, chat_prompt(default_server, tok), 8, 11, 0)
    check_chat_content(content, want, TOLERANCE[default_server.dtype])


def test_chat_every_choice_of_n_equals_native_with_its_seed(default_server, openai_client, tok):
    r = openai_client.chat.completions.create(model=DEFAULT_MODEL, messages=CHAT, max_tokens=6, n=2, seed=7,
                                              temperature=1.0, logprobs=True, top_logprobs=TOP)
    prompt = chat_prompt(default_server, tok)
    for i, choice in enumerate(r.choices):
        want = native(default_server, prompt, 6, row_seed(7, i), 1.0)
        check_chat_content(choice.logprobs.content, want, TOLERANCE[default_server.dtype])


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_equal_native(default_server, openai_client, stream):
    args = dict(model=DEFAULT_MODEL, prompt=PROMPT, max_tokens=6, logprobs=TOP, seed=5, temperature=0)
    tokens, lps, tops, offsets = [], [], [], []
    for r in (openai_client.completions.create(stream=True, **args) if stream
              else [openai_client.completions.create(**args)]):
        for choice in r.choices:
            if choice.logprobs is not None:
                tokens += choice.logprobs.tokens
                lps += choice.logprobs.token_logprobs
                tops += choice.logprobs.top_logprobs
                offsets += choice.logprobs.text_offset
    want = native(default_server, PROMPT, 6, 5, 0)
    tolerance = TOLERANCE[default_server.dtype]
    assert tokens == [e["token"] for e in want]
    assert all(abs(a - e["logprob"]) <= tolerance for a, e in zip(lps, want))
    for top, e in zip(tops, want):
        assert len(top) == TOP
        expected = {t["token"]: t["logprob"] for t in reversed(e["top_logprobs"])}  # a shared text keeps the best
        assert top.keys() == expected.keys() and all(abs(top[k] - expected[k]) <= tolerance for k in top)
    assert offsets == [len(PROMPT) + sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]


@pytest.mark.parametrize("stream", [False, True])
def test_completion_n_choices_per_prompt_each_equal_native_with_its_seed(default_server, openai_client, stream):
    prompts = [PROMPT, "Hello"]
    args = dict(model=DEFAULT_MODEL, prompt=prompts, max_tokens=4, n=2, seed=3, temperature=1.0, logprobs=1,
                echo=True)
    texts, tokens, lps = {}, {}, {}
    for r in (openai_client.completions.create(stream=True, **args) if stream
              else [openai_client.completions.create(**args)]):
        for ch in r.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
            if ch.logprobs is not None:
                tokens.setdefault(ch.index, []).extend(ch.logprobs.tokens)
                lps.setdefault(ch.index, []).extend(ch.logprobs.token_logprobs)
    assert sorted(texts) == [0, 1, 2, 3]
    tolerance = TOLERANCE[default_server.dtype]
    for index in range(4):
        prompt, j = prompts[index // 2], index % 2  # choice index = prompt_index * n + j
        assert texts[index].startswith(prompt)
        want = native(default_server, prompt, 4, row_seed(3, j), 1.0)
        n_prompt = len(tokens[index]) - len(want)
        assert "".join(tokens[index][:n_prompt]) == prompt and lps[index][0] is None
        assert tokens[index][n_prompt:] == [e["token"] for e in want]
        assert all(abs(a - e["logprob"]) <= tolerance for a, e in zip(lps[index][n_prompt:], want))


def test_echo_prepends_the_prompt_and_its_logprobs(default_server, openai_client):
    plain = openai_client.completions.create(model=DEFAULT_MODEL, prompt=PROMPT, max_tokens=3, logprobs=2,
                                             temperature=0)
    echoed = openai_client.completions.create(model=DEFAULT_MODEL, prompt=PROMPT, max_tokens=3, logprobs=2,
                                              temperature=0, echo=True)
    lp, gen = echoed.choices[0].logprobs, plain.choices[0].logprobs
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    n_prompt = echoed.usage.prompt_tokens
    assert len(lp.tokens) == n_prompt + len(gen.tokens) and "".join(lp.tokens[:n_prompt]) == PROMPT
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset[:n_prompt] == [len("".join(lp.tokens[:i])) for i in range(n_prompt)]
    assert lp.tokens[n_prompt:] == gen.tokens and lp.text_offset[n_prompt:] == gen.text_offset
    tolerance = TOLERANCE[default_server.dtype]
    assert all(abs(a - b) <= tolerance for a, b in zip(lp.token_logprobs[n_prompt:], gen.token_logprobs))

    # the prompt's logprobs are the ones generating it gives: echo the completed text
    full = openai_client.completions.create(model=DEFAULT_MODEL, prompt=echoed.choices[0].text, max_tokens=1,
                                            logprobs=2, temperature=0, echo=True).choices[0].logprobs
    assert full.tokens[n_prompt:n_prompt + len(gen.tokens)] == gen.tokens
    for a, b in zip(full.token_logprobs[n_prompt:], gen.token_logprobs):
        assert abs(a - b) <= tolerance
    assert full.top_logprobs[n_prompt].keys() == gen.top_logprobs[0].keys()

    chunks = list(openai_client.completions.create(model=DEFAULT_MODEL, prompt=PROMPT, max_tokens=3, logprobs=2,
                                                   temperature=0, echo=True, stream=True))
    assert chunks[0].choices[0].text == PROMPT and chunks[0].choices[0].logprobs.tokens == lp.tokens[:n_prompt]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == echoed.choices[0].text


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_max_tokens_0_is_the_prompt_alone(openai_client, stream):
    args = dict(model=DEFAULT_MODEL, prompt=[PROMPT, "Hello"], max_tokens=0, logprobs=1, echo=True)
    if stream:
        chunks = list(openai_client.completions.create(stream=True, stream_options={"include_usage": True}, **args))
        choices, usage = [ch for c in chunks for ch in c.choices], chunks[-1].usage
        first = [lp for ch in choices if ch.index == 0 and ch.logprobs for lp in ch.logprobs.token_logprobs]
    else:
        r = openai_client.completions.create(**args)
        choices, usage, first = r.choices, r.usage, r.choices[0].logprobs.token_logprobs
    assert ["".join(ch.text for ch in choices if ch.index == i) for i in (0, 1)] == [PROMPT, "Hello"]
    assert {ch.index: ch.finish_reason for ch in choices if ch.finish_reason} == {0: "length", 1: "length"}
    assert usage.completion_tokens == 0
    one = openai_client.completions.create(model=DEFAULT_MODEL, prompt=PROMPT, max_tokens=1, logprobs=1, echo=True)
    assert len(first) == one.usage.prompt_tokens and first == one.choices[0].logprobs.token_logprobs[:len(first)]


def test_echo_without_logprobs_and_token_id_keys(openai_client):
    r = openai_client.completions.create(model=DEFAULT_MODEL, prompt=PROMPT, max_tokens=2, temperature=0, echo=True)
    assert r.choices[0].text.startswith(PROMPT) and r.choices[0].logprobs is None
    ids = openai_client.chat.completions.create(model=DEFAULT_MODEL, messages=CHAT, max_tokens=2, temperature=0,
                                                logprobs=True, top_logprobs=1,
                                                extra_body={"return_tokens_as_token_ids": True})
    content = ids.choices[0].logprobs.content
    assert all(c.token.startswith("token_id:") and c.top_logprobs[0].token.startswith("token_id:") for c in content)
    none = openai_client.chat.completions.create(model=DEFAULT_MODEL, messages=CHAT, max_tokens=2, temperature=0,
                                                 logprobs=True)
    assert len(none.choices[0].logprobs.content) == 2 and none.choices[0].logprobs.content[0].top_logprobs == []


def test_stop_word_tokens_are_left_out_streamed_or_not(openai_client):
    args = dict(model=DEFAULT_MODEL, prompt=PROMPT, max_tokens=6, logprobs=1, temperature=0, stop=["."])
    whole = openai_client.completions.create(**args).choices[0]
    assert whole.finish_reason == "stop" and "".join(whole.logprobs.tokens) == whole.text
    streamed = [t for c in openai_client.completions.create(stream=True, **args) for ch in c.choices
                if ch.logprobs is not None for t in ch.logprobs.tokens]
    assert streamed == whole.logprobs.tokens


def test_constrained_output_reports_every_token(openai_client):
    r = openai_client.chat.completions.create(model=DEFAULT_MODEL, messages=CHAT, max_tokens=6, temperature=0,
                                              logprobs=True, top_logprobs=2, response_format={"type": "json_object"})
    assert len(r.choices[0].logprobs.content) == r.usage.completion_tokens
    assert "".join(c.token for c in r.choices[0].logprobs.content).startswith(r.choices[0].message.content[:1])


@pytest.mark.parametrize("route,body,param", [
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("completions", {"logprobs": 21}, "logprobs"),
    ("completions", {"logprobs": -1}, "logprobs"),
])
def test_logprobs_bounds(default_server, route, body, param):
    path, base = (("/v1/chat/completions", {"messages": CHAT}) if route == "chat"
                  else ("/v1/completions", {"prompt": PROMPT}))
    r = httpx.post(default_server.base_url + path, json={"model": DEFAULT_MODEL, "max_tokens": 2, **base, **body},
                   timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["code"] == "invalid_parameter"


def test_sdk_refuses_too_many_alternatives(openai_client):
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.chat.completions.create(model=DEFAULT_MODEL, messages=CHAT, max_tokens=2, logprobs=True,
                                              top_logprobs=21)
    assert e.value.param == "top_logprobs"


def _post(server, route: str, body: dict) -> httpx.Response:
    path, base = (("/v1/chat/completions", {"messages": CHAT}) if route == "chat"
                  else ("/v1/completions", {"prompt": PROMPT}))
    r = httpx.post(server.base_url + path, json={"model": DEFAULT_MODEL, "temperature": 0, **base, **body},
                   timeout=120)
    assert r.status_code == 200, r.text
    return r


def _entries(route: str, choice: dict) -> list:
    """(token, logprob, top tokens) per generated token, in either route's shape."""
    lp = choice["logprobs"]
    if route == "chat":
        return [(c["token"], c["logprob"], [t["token"] for t in c["top_logprobs"]]) for c in lp["content"]]
    return [(t, v, list(top)) for t, v, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"])]


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_native_n_probs_asks_for_the_routes_logprobs(default_server, route):
    """b10621's OpenAI routes read n_probs: on chat as logprobs: true with that many
    top_logprobs, on text completions as the integer logprobs (its alias there, which it wins over)."""
    openai_spelling = {"logprobs": True, "top_logprobs": 3} if route == "chat" else {"logprobs": 3}
    want = _entries(route, _post(default_server, route, {"max_tokens": 4, **openai_spelling}).json()["choices"][0])
    extra = {} if route == "chat" else {"logprobs": 5}
    got = _post(default_server, route, {"max_tokens": 4, "n_probs": 3, **extra})
    assert "x-millm-ignored-fields" not in got.headers
    entries = _entries(route, got.json()["choices"][0])
    assert [(t, top) for t, _, top in entries] == [(t, top) for t, _, top in want] and len(want[0][2]) == 3
    tolerance = TOLERANCE[default_server.dtype]
    assert all(abs(a[1] - b[1]) <= tolerance for a, b in zip(entries, want))
    assert _post(default_server, route, {"max_tokens": 2, "n_probs": 0}).json()["choices"][0]["logprobs"] is None
    r = httpx.post(default_server.base_url + ("/v1/chat/completions" if route == "chat" else "/v1/completions"),
                   json={"model": DEFAULT_MODEL, "max_tokens": 2, "n_probs": -1,
                         **({"messages": CHAT} if route == "chat" else {"prompt": PROMPT})}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n_probs", r.text


def test_n_probs_beside_logprobs_true_is_reported_on_chat(default_server):
    r = _post(default_server, "chat", {"max_tokens": 2, "logprobs": True, "top_logprobs": 1, "n_probs": 4})
    assert r.headers["x-millm-ignored-fields"] == '"n_probs"'
    assert len(r.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 1


def _sse(r: httpx.Response) -> list[dict]:
    import json

    return [json.loads(line[6:]) for line in r.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_timings_per_token_puts_timings_on_every_chunk(default_server, route):
    body = {"max_tokens": 5, "stream": True, "ignore_eos": True}
    chunks = [c for c in _sse(_post(default_server, route, {**body, "timings_per_token": True}))
              if c["choices"] and (route == "completions" or c["choices"][0]["delta"].get("role") is None)]
    assert chunks and all("timings" in c for c in chunks)
    predicted = [c["timings"]["predicted_n"] for c in chunks]
    assert predicted == sorted(predicted) and predicted[-1] == 5
    assert all(c["timings"]["prompt_n"] + c["timings"]["cache_n"] > 0 for c in chunks)
    plain = _sse(_post(default_server, route, body))
    assert not any("timings" in c for c in plain)
    whole = _post(default_server, route, {"max_tokens": 3, "timings_per_token": True}).json()
    assert whole["timings"]["predicted_n"] == whole["usage"]["completion_tokens"] == 3
    assert "timings" not in _post(default_server, route, {"max_tokens": 3}).json()


@pytest.mark.parametrize("stream", [False, True])
def test_responses_output_text_logprobs_equal_native(default_server, tok, stream):
    body = {"model": DEFAULT_MODEL, "input": CHAT, "max_output_tokens": 6, "temperature": 0,
            "include": ["message.output_text.logprobs"], "top_logprobs": TOP, "stream": stream}
    r = httpx.post(default_server.base_url + "/v1/responses", json=body, timeout=120)
    assert r.status_code == 200, r.text
    if stream:
        events = _sse(r)
        entries = [e for ev in events if ev["type"] == "response.output_text.delta" for e in ev["logprobs"]]
        [item] = events[-1]["response"]["output"]
        assert item["content"][0]["logprobs"][:len(entries)] == entries
    else:
        [item] = r.json()["output"]
        entries = item["content"][0]["logprobs"]
    want = native(default_server, chat_prompt(default_server, tok), 6, 0, 0)
    tolerance = TOLERANCE[default_server.dtype]
    close_entries([(bytes(e["bytes"]), e["logprob"]) for e in entries], want, tolerance)
    for e, w in zip(entries, want):
        close_entries([(bytes(t["bytes"]), t["logprob"]) for t in e["top_logprobs"]], w["top_logprobs"], tolerance)


@pytest.mark.parametrize("body,param,code", [
    ({"top_logprobs": 2}, "top_logprobs", "invalid_parameter"),
    ({"include": ["message.output_text.logprobs"], "top_logprobs": 21}, "top_logprobs", "invalid_parameter"),
    ({"include": ["reasoning.encrypted_content"]}, "include", "field_not_honoured"),
])
def test_responses_logprobs_refusals(default_server, body, param, code):
    r = httpx.post(default_server.base_url + "/v1/responses", timeout=60,
                   json={"model": DEFAULT_MODEL, "input": "Hi", "max_output_tokens": 2, **body})
    assert r.status_code == 400, r.text
    assert (r.json()["error"]["param"], r.json()["error"]["code"]) == (param, code)
