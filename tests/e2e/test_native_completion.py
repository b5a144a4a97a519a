"""The native llama-server generation routes against the real server (b10621 shapes)."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.fixtures import DEFAULT_MODEL

FRANCE = "The capital of France is"
FINAL_KEYS = {"index", "content", "tokens", "id_slot", "stop", "model", "tokens_predicted", "tokens_evaluated",
              "generation_settings", "prompt", "has_new_line", "truncated", "stop_type", "stopping_word",
              "tokens_cached", "timings"}


def post(server, path, **body):
    return httpx.post(server.base_url + path, json=body, timeout=120)


def stream(server, path="/completion", **body) -> list:
    with httpx.stream("POST", server.base_url + path, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = [line for line in r.iter_lines() if line]
    assert "data: [DONE]" not in raw
    return [json.loads(line[len("data: "):]) for line in raw if line.startswith("data: ")]


def test_native_object(default_server):
    r = post(default_server, "/completion", prompt=FRANCE, n_predict=6, temperature=0, return_tokens=True)
    assert r.status_code == 200
    body = r.json()
    assert set(body) == FINAL_KEYS
    assert "Paris" in body["content"] and body["stop"] is True and body["id_slot"] >= 0
    assert body["stop_type"] == "limit" and body["tokens_predicted"] == 6 == len(body["tokens"])
    assert body["tokens_cached"] == body["tokens_evaluated"] + body["tokens_predicted"] - 1
    timings = body["timings"]  # an earlier test on this server may have cached the prompt
    assert list(timings)[0] == "cache_n" and timings["cache_n"] + timings["prompt_n"] == body["tokens_evaluated"]
    assert body["prompt"] == FRANCE and body["generation_settings"]["n_predict"] == 6
    assert httpx.post(default_server.base_url + "/detokenize", json={"tokens": body["tokens"]}).json()["content"] \
        == body["content"]
    plain = post(default_server, "/completions", prompt=FRANCE, n_predict=6, temperature=0).json()
    assert plain["content"] == body["content"] and plain["tokens"] == []


def test_stream_ends_with_the_final_object(default_server):
    full = post(default_server, "/completion", prompt=FRANCE, n_predict=6, temperature=0).json()
    frames = stream(default_server, prompt=FRANCE, n_predict=6, temperature=0, timings_per_token=True)
    partial, final = frames[:-1], frames[-1]
    assert set(final) == FINAL_KEYS and final["stop"] is True and final["content"] == "" and final["tokens"] == []
    assert all(f["stop"] is False and f["id_slot"] == -1 and len(f["tokens"]) == 1 for f in partial)
    assert [f["tokens_predicted"] for f in partial] == list(range(1, 7))
    # the prompt is cached by the request before: prompt_n counts only what this one ran
    assert all(f["timings"]["cache_n"] + f["timings"]["prompt_n"] == final["tokens_evaluated"] for f in partial)
    assert all(f["timings"]["prompt_n"] == final["timings"]["prompt_n"] == 1 for f in partial)
    assert "".join(f["content"] for f in partial) == full["content"]


@pytest.mark.parametrize("stop", [["ris."], ["Paris.\n"], ["zzz", " Par"]])
def test_stop_string_across_tokens_streams_identically(default_server, stop):
    body = dict(prompt=FRANCE, n_predict=8, temperature=0, stop=stop)
    full = post(default_server, "/completion", **body).json()
    frames = stream(default_server, **body)
    assert full["stop_type"] == "word" and full["stopping_word"] in stop
    assert "".join(f["content"] for f in frames) == full["content"]
    assert full["stopping_word"] not in full["content"]


def test_probabilities_report_text_and_bytes(default_server):
    pre = post(default_server, "/completion", prompt=FRANCE, n_predict=3, temperature=0, n_probs=3).json()
    probs = pre["completion_probabilities"]
    assert len(probs) == 3
    for p in probs:
        assert set(p) == {"id", "token", "bytes", "logprob", "top_logprobs"} and len(p["top_logprobs"]) == 3
        assert bytes(p["bytes"]).decode("utf-8", "replace").startswith(p["token"])
        assert p["top_logprobs"][0]["id"] == p["id"]  # greedy picks the most likely
    post_ = post(default_server, "/completion", prompt=FRANCE, n_predict=2, temperature=0, logprobs=2,
                 post_sampling_probs=True).json()
    assert set(post_["completion_probabilities"][0]) == {"id", "token", "bytes", "prob", "top_probs"}
    frames = stream(default_server, prompt=FRANCE, n_predict=2, temperature=0, n_probs=1)
    assert all(len(f["completion_probabilities"]) == 1 for f in frames[:-1])


def test_response_fields_and_several_prompts(default_server):
    r = post(default_server, "/completion", prompt=[FRANCE, "One, two,"], n_predict=3, temperature=0,
             response_fields=["content", "generation_settings/n_predict", "nope"]).json()
    assert isinstance(r, list) and len(r) == 2
    assert set(r[0]) == {"content", "generation_settings/n_predict"} and r[0]["generation_settings/n_predict"] == 3
    alone = post(default_server, "/completion", prompt="One, two,", n_predict=3, temperature=0).json()
    assert r[1]["content"] == alone["content"]


def test_n_indent_cuts_at_the_first_shallow_line(default_server):
    body = dict(prompt="def add(a, b):\n", n_predict=24, temperature=0)
    free = post(default_server, "/completion", **body).json()["content"]
    cut = post(default_server, "/completion", n_indent=4, **body).json()
    lines = free.split("\n")
    offset = len(lines[0]) + 1
    for i, line in enumerate(lines[1:], 1):
        stripped = len(line) - len(line.lstrip(" \t"))
        # a line ends the completion once any character follows its indentation (its newline counts)
        if stripped < 4 and (stripped < len(line) or i < len(lines) - 1):
            expected = free[: offset + stripped]
            break
        offset += len(line) + 1
    else:
        pytest.fail(f"the free completion has no shallow line: {free!r}")
    assert cut["stop_type"] == "limit" and cut["content"] == expected


def test_t_max_predict_ms_stops_at_a_newline(default_server):
    r = post(default_server, "/completion", prompt=FRANCE, n_predict=20, temperature=0, t_max_predict_ms=1).json()
    assert r["stop_type"] == "limit" and r["content"].endswith("\n") and r["tokens_predicted"] < 20
    assert r["has_new_line"] is True


def test_native_refusals_use_the_native_envelope(default_server):
    cases = [dict(prompt="x", n_predict=-2), dict(n_predict=2),
             dict(prompt="x", n_cmpl=2), dict(prompt="x", top_k="many")]
    for body in cases:
        r = post(default_server, "/completion", **body)
        assert r.status_code == 400, body
        assert set(r.json()["error"]) == {"code", "message", "type"}
    assert "Field 'n_predict': Value must be between -1 <= value <= 2147483647, but got -2" == \
        post(default_server, "/completion", prompt="x", n_predict=-2).json()["error"]["message"]


def test_tokenize_switches_and_detokenize(default_server):
    url = default_server.base_url
    text = "Grüße 東京 <|im_start|>"
    plain = httpx.post(url + "/tokenize", json={"content": text}).json()["tokens"]
    pieces = httpx.post(url + "/tokenize", json={"content": text, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == plain
    joined = b"".join(bytes(p["piece"]) if isinstance(p["piece"], list) else p["piece"].encode() for p in pieces)
    assert joined.decode() == text and any(isinstance(p["piece"], list) for p in pieces)
    literal = httpx.post(url + "/tokenize", json={"content": "<|im_start|>", "parse_special": False}).json()["tokens"]
    assert len(literal) > 1 and httpx.post(url + "/tokenize", json={"content": "<|im_start|>"}).json()["tokens"] == [1]
    assert httpx.post(url + "/tokenize", json={}).json() == {"tokens": []}
    mixed = httpx.post(url + "/tokenize", json={"content": ["Hi", 42, " there"]}).json()["tokens"]
    assert 42 in mixed
    assert httpx.post(url + "/detokenize", json={"tokens": plain}).json() == {"content": text}
    assert httpx.post(url + "/detokenize", json={}).json() == {"content": ""}


def test_apply_template_and_input_tokens_match_chat_prefill(default_server, openai_client):
    url = default_server.base_url
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = httpx.post(url + "/apply-template", json={"messages": messages}).json()["prompt"]
    assert prompt.endswith("<|im_start|>assistant\n") and "capital of France" in prompt
    usage = openai_client.chat.completions.create(model=DEFAULT_MODEL, messages=messages, max_tokens=1).usage
    for path in ("/chat/completions/input_tokens", "/v1/chat/completions/input_tokens"):
        assert httpx.post(url + path, json={"messages": messages}).json() == {"input_tokens": usage.prompt_tokens}
    resp = {"input": [{"role": "user", "content": [{"type": "input_text", "text": messages[0]["content"]}]}]}
    for path in ("/responses/input_tokens", "/v1/responses/input_tokens"):
        assert httpx.post(url + path, json=resp).json() == {"input_tokens": usage.prompt_tokens}


def test_defaults_of_gated_routes(default_server):
    url = default_server.base_url
    assert httpx.get(url + "/metrics").status_code == 501
    slots = httpx.get(url + "/slots").json()
    assert isinstance(slots, list) and {"id", "is_processing", "params", "next_token"} <= set(slots[0])
    assert httpx.get(url + "/props").json()["endpoint_slots"] is True


def test_prompt_cache_hit_reported_by_cache_n_and_usage(default_server, openai_client):
    prompt = " ".join(f"Line {i}: the {('red', 'blue', 'green')[i % 3]} kite flew {i * 3} metres." for i in range(45))
    body = {"prompt": prompt, "n_predict": 8, "temperature": 0}
    first = httpx.post(default_server.base_url + "/completion", json=body, timeout=300).json()
    second = httpx.post(default_server.base_url + "/completion", json=body, timeout=300).json()
    cold = httpx.post(default_server.base_url + "/completion", json={**body, "cache_prompt": False}, timeout=300).json()
    n = second["tokens_evaluated"]
    assert n > 400
    assert second["timings"]["cache_n"] == n - 1 and second["timings"]["prompt_n"] == n - second["timings"]["cache_n"]
    assert cold["timings"]["cache_n"] == 0
    assert first["content"] == second["content"] == cold["content"]
    r = openai_client.completions.create(model=DEFAULT_MODEL, prompt=prompt, max_tokens=4, temperature=0)
    assert r.usage.prompt_tokens_details.cached_tokens == n - 1  # token by token, as llama-server reuses a slot


def test_chat_requests_sharing_a_system_prompt_reuse_it_token_by_token(default_server, openai_client):
    """A second conversation with the same system prompt reuses every token the two rendered
    prompts share, not only whole cache blocks (llama-server's slots reuse a common prefix
    token by token), and answers as a cold prefill does."""
    system = "You keep the lighthouse log at Port Ellery. Reply with one short sentence about the lamp, the tide or the weather."
    asks = [[{"role": "system", "content": system}, {"role": "user", "content": q}]
            for q in ("When was the lamp last lit?", "Is the tide rising now?")]
    ids = [post(default_server, "/tokenize", add_special=True,
                content=post(default_server, "/apply-template", messages=m).json()["prompt"]).json()["tokens"] for m in asks]
    shared = next(i for i, (a, b) in enumerate(zip(*ids)) if a != b)
    assert shared % 16, "the prompts should part inside a cache block"
    first = openai_client.chat.completions.create(model=DEFAULT_MODEL, messages=asks[0], max_tokens=4, temperature=0)
    assert first.usage.prompt_tokens == len(ids[0])
    warm = openai_client.chat.completions.create(model=DEFAULT_MODEL, messages=asks[1], max_tokens=8, temperature=0)
    assert warm.usage.prompt_tokens == len(ids[1])
    assert warm.usage.prompt_tokens_details.cached_tokens == shared
    cold = openai_client.chat.completions.create(model=DEFAULT_MODEL, messages=asks[1], max_tokens=8, temperature=0,
                                                 extra_body={"cache_prompt": False})
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert warm.choices[0].message.content == cold.choices[0].message.content


def test_reasoning_budget_forces_message_and_close(default_server):
    def tokens(text):
        return post(default_server, "/tokenize", content=text).json()["tokens"]

    forced = tokens(" Done.") + tokens("</think>")
    body = post(default_server, "/completion", prompt="Q: why is the sky blue?\n<think>\n", n_predict=12,
                temperature=0, return_tokens=True, reasoning_budget_tokens=4,
                reasoning_budget_message=" Done.").json()
    # the prompt left the block open: four thinking tokens, then the forced run, then the model again
    assert body["tokens"][4:4 + len(forced)] == forced
    assert " Done.</think>" in body["content"]
