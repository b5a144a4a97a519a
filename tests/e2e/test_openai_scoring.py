"""Scoring mode through the `openai` SDK on the real server: normalisation over the allowed
set, agreement with the transformers reference, chat scoring == completion scoring of the
rendered prompt, the response shapes and every refusal.

Reference tolerance: at fp32 (MLX on a CPU) the parity suite holds logits within 1e-3 of
transformers fp32; a log-softmax adds at most the same error through its normaliser, so
log-probabilities must agree within 2e-3. At bf16 (torch's CPU default where the CPU has
native bf16) each logit of size ~20 is already rounded by up to 0.06, so 0.15 there: still
far below what a wrong position or a wrong token would move.
"""

from __future__ import annotations

import math

import httpx
import numpy as np
import openai
import pytest

from tests import fixtures
from tests.conftest import DEFAULT_MODEL, ServerProcess, fixture_path

TOLERANCE = {"float32": 2e-3, "bfloat16": 0.15}
PROMPT = "Question: Is the sky blue on a clear day? Answer yes or no.\nAnswer:"
CHAT = [{"role": "system", "content": "Answer with yes or no."},
        {"role": "user", "content": "Is the sky blue on a clear day?"}]


@pytest.fixture(scope="module")
def tok():
    from mlxcel.engine.tokenizer import Tokenizer

    return Tokenizer(fixture_path(DEFAULT_MODEL))


@pytest.fixture(scope="module")
def candidates(tok):
    ids = [tok.encode(w, add_special_tokens=False)[0] for w in (" yes", " no", " Yes", " No", " maybe")]
    assert len(set(ids)) == 5
    return ids


def _score(client, prompt, **extra):
    return client.completions.create(model=DEFAULT_MODEL, prompt=prompt, max_tokens=1, extra_body=extra,
                                     **({"logprobs": extra.pop("logprobs")} if "logprobs" in extra else {}))


def test_allowed_set_sums_to_one_and_matches_the_reference(default_server, openai_client, tok, candidates):
    import torch
    from tests.models.reference import load_reference

    r = _score(openai_client, PROMPT, logprobs=len(candidates), allowed_token_ids=candidates,
               add_special_tokens=False, return_tokens_as_token_ids=True, temperature=1.0)
    lp = r.choices[0].logprobs
    top = lp.top_logprobs[0]
    assert sorted(top) == sorted(f"token_id:{t}" for t in candidates)
    assert abs(sum(math.exp(v) for v in top.values()) - 1.0) < 1e-6
    assert lp.tokens[0] == max(top, key=top.get) and lp.token_logprobs[0] == top[lp.tokens[0]]
    assert lp.text_offset == [len(PROMPT)]
    assert r.choices[0].text == tok.decode([int(lp.tokens[0].split(":")[1])], skip_special_tokens=False)
    assert r.choices[0].finish_reason == "length"

    ids = tok.encode(PROMPT, add_special_tokens=False)
    ref = load_reference(fixture_path(DEFAULT_MODEL))
    with torch.no_grad():
        logits = ref(torch.tensor([ids])).logits[0, -1].double().numpy()
    sub = logits[candidates]
    expected = sub - (sub.max() + np.log(np.exp(sub - sub.max()).sum()))
    tolerance = TOLERANCE[default_server.dtype]
    for t, want in zip(candidates, expected):
        assert abs(top[f"token_id:{t}"] - want) <= tolerance, (t, top[f"token_id:{t}"], want)

    # temperature divides the logits before normalising
    hot = _score(openai_client, PROMPT, logprobs=2, allowed_token_ids=candidates[:2], add_special_tokens=False,
                 return_tokens_as_token_ids=True, temperature=2.0).choices[0].logprobs.top_logprobs[0]
    s2 = sub[:2] / 2.0
    want2 = s2 - (s2.max() + np.log(np.exp(s2 - s2.max()).sum()))
    for t, want in zip(candidates[:2], want2):
        assert abs(hot[f"token_id:{t}"] - want) <= tolerance


def test_text_keys_and_constrained_without_logprobs(openai_client, tok, candidates):
    paris = tok.encode(" Paris", add_special_tokens=False)[0]
    r = _score(openai_client, "The capital of France is", logprobs=3, temperature=0,
               allowed_token_ids=list(range(100)) + [paris])
    lp = r.choices[0].logprobs
    assert lp.tokens == [" Paris"] and r.choices[0].text == " Paris" and len(lp.top_logprobs[0]) == 3
    assert sum(math.exp(v) for v in lp.top_logprobs[0].values()) < 1.0
    c = _score(openai_client, PROMPT, allowed_token_ids=candidates, add_special_tokens=False)
    assert c.choices[0].logprobs is None
    full = _score(openai_client, PROMPT, logprobs=1, allowed_token_ids=candidates, add_special_tokens=False)
    assert c.choices[0].text == full.choices[0].text


def test_chat_scoring_equals_completion_scoring_of_the_rendered_prompt(default_server, openai_client, candidates):
    r = openai_client.chat.completions.create(model=DEFAULT_MODEL, messages=CHAT, max_tokens=1, logprobs=True,
                                              top_logprobs=5, seed=4, extra_body={"allowed_token_ids": candidates})
    content = r.choices[0].logprobs.content
    assert len(content) == 1 and len(content[0].top_logprobs) == 5
    assert content[0].bytes == list(content[0].token.encode("utf-8"))
    assert r.choices[0].message.content == content[0].token
    rendered = httpx.post(default_server.base_url + "/apply-template", json={"messages": CHAT}).json()["prompt"]
    c = _score(openai_client, rendered, logprobs=5, allowed_token_ids=candidates, add_special_tokens=False)
    assert {e.token: e.logprob for e in content[0].top_logprobs} == c.choices[0].logprobs.top_logprobs[0]
    assert content[0].token == c.choices[0].logprobs.tokens[0]
    # extra_messages: one choice per conversation, in order, each scored on its own
    other = [{"role": "user", "content": "Is fire cold?"}]
    both = openai_client.chat.completions.create(model=DEFAULT_MODEL, messages=CHAT, max_tokens=1, logprobs=True,
                                                 extra_body={"allowed_token_ids": candidates, "extra_messages": [other]})
    alone = openai_client.chat.completions.create(model=DEFAULT_MODEL, messages=other, max_tokens=1, logprobs=True,
                                                  extra_body={"allowed_token_ids": candidates})
    assert [ch.index for ch in both.choices] == [0, 1]
    assert both.choices[0].logprobs.content[0].logprob == content[0].logprob
    assert both.choices[1].logprobs.content[0].logprob == alone.choices[0].logprobs.content[0].logprob
    assert both.choices[0].logprobs.content[0].top_logprobs == []


# every body is a scoring request: allowed_token_ids [1, 2] unless the row sends its own
REFUSALS = [
    ("completions", {"logprobs": 5, "max_tokens": 100}, "max_tokens"),
    ("completions", {"logprobs": 2}, "max_tokens"),
    ("completions", {"logprobs": 2, "max_tokens": 1, "n": 2}, "n"),
    ("completions", {"allowed_token_ids": [10**9], "max_tokens": 1}, "allowed_token_ids"),
    ("completions", {"logprobs": 2, "max_tokens": 1, "temperature": 0.0005}, "temperature"),
    ("completions", {"logprobs": 2, "max_tokens": 1, "prompt": "", "add_special_tokens": False}, "prompt"),
    ("completions", {"logprobs": 2, "max_tokens": 1, "stream": True}, "stream"),
    ("chat", {"logprobs": True, "max_tokens": 10}, "max_tokens"),
    ("chat", {"top_logprobs": 2, "max_tokens": 1}, "top_logprobs"),
    ("chat", {"logprobs": True, "top_logprobs": 21, "max_tokens": 1}, "top_logprobs"),
]


@pytest.mark.parametrize("route,body,param", REFUSALS)
def test_scoring_refusals(default_server, route, body, param):
    base = {"model": DEFAULT_MODEL, "allowed_token_ids": [1, 2]}
    base.update({"prompt": PROMPT} if route == "completions" else {"messages": CHAT})
    path = "/v1/completions" if route == "completions" else "/v1/chat/completions"
    r = httpx.post(default_server.base_url + path, json={**base, **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert err["code"] == "invalid_scoring_request"


def test_scoring_refusals_are_sdk_bad_requests(openai_client):
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.completions.create(model=DEFAULT_MODEL, prompt=PROMPT, max_tokens=1, logprobs=2,
                                         extra_body={"allowed_token_ids": [-1]})
    assert e.value.code == "invalid_scoring_request"
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.completions.create(model=DEFAULT_MODEL, prompt=PROMPT, max_tokens=1, logprobs=2,
                                         extra_body={"profile": "judge"})
    assert e.value.param == "profile"


def test_chat_scoring_without_a_template_is_no_chat_template():
    fixture_path(fixtures.GEMMA3)
    server = ServerProcess(["-m", fixtures.GEMMA3, "--offline", "-c", "512"])
    try:
        from openai import OpenAI

        client = OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=120)
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=fixtures.GEMMA3, messages=CHAT, max_tokens=1, logprobs=True,
                                           extra_body={"allowed_token_ids": [1, 2]})
        assert e.value.code == "no_chat_template"
        ok = client.completions.create(model=fixtures.GEMMA3, prompt=PROMPT, max_tokens=1, logprobs=2,
                                       extra_body={"allowed_token_ids": [1, 2]})
        assert abs(sum(math.exp(v) for v in ok.choices[0].logprobs.top_logprobs[0].values())) <= 1.0 + 1e-9
    finally:
        server.stop()
