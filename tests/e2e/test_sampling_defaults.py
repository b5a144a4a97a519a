"""Server-wide sampler defaults from the b10621 command line, through the real CLI and server.

One server carries every sampling flag at once: /props and /slots report them, a native
request without the fields inherits them (and reports them in generation_settings), a
request's own fields win, and /v1 inherits them too. The values' effect on sampling is
shown where it is observable on a random-weight model: -l forces a token, --ignore-eos is
reported and bans EOS, and --sampler-seq leaves top_k out of the chain. The same server carries
the output flags --special and --spm-infill (their off state is tests/e2e/test_native_flags.py).
"""

from __future__ import annotations

import httpx

from tests.conftest import module_server
from tests.fixtures import QWEN2_TINY

FORCED = 1000  # -l 1000+1000: every sampled token is this one
FLAGS = ("--parallel", "1", "--no-warmup", "--slots", "-sp", "--spm-infill",
         "--top-nsigma", "1.5", "--typical", "0.9", "--repeat-last-n", "32", "--repeat-penalty", "1.1",
         "--presence-penalty", "0.2", "--frequency-penalty", "0.3", "--dry-multiplier", "0.5", "--dry-base", "2",
         "--dry-allowed-length", "3", "--dry-penalty-last-n", "16", "--dry-sequence-breaker", "\\n",
         "--dry-sequence-breaker", "END", "--dynatemp-range", "0.5", "--dynatemp-exp", "1.5", "--mirostat", "2",
         "--mirostat-lr", "0.2", "--mirostat-ent", "4", "--xtc-probability", "0.1", "--xtc-threshold", "0.2",
         "--adaptive-target", "0.5", "--adaptive-decay", "0.8", "--sampler-seq", "edymxt", "--ignore-eos",
         "-l", f"{FORCED}+1000")
EXPECTED = {
    "top_n_sigma": 1.5, "typical_p": 0.9, "repeat_last_n": 32, "repeat_penalty": 1.1, "presence_penalty": 0.2,
    "frequency_penalty": 0.3, "dry_multiplier": 0.5, "dry_base": 2.0, "dry_allowed_length": 3,
    "dry_penalty_last_n": 16, "dynatemp_range": 0.5, "dynatemp_exponent": 1.5, "mirostat": 2, "mirostat_eta": 0.2,
    "mirostat_tau": 4.0, "xtc_probability": 0.1, "xtc_threshold": 0.2, "ignore_eos": True,
    "samplers": ["penalties", "dry", "typ_p", "min_p", "xtc", "temperature"],
}

server = module_server(QWEN2_TINY, *FLAGS)


def _close(got: dict, want: dict) -> list[str]:
    return [f"{k}: {got.get(k)!r} != {v!r}" for k, v in want.items()
            if not (got.get(k) == v or (isinstance(v, float) and abs(got.get(k, 0) - v) < 1e-6))]


def completion(server, **body) -> dict:
    r = httpx.post(server.base_url + "/completion", json={"prompt": "hello there", "n_predict": 6,
                                                          "return_tokens": True, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_props_and_slots_report_the_flag_defaults(server):
    params = httpx.get(server.base_url + "/props").json()["default_generation_settings"]["params"]
    assert not _close(params, EXPECTED)
    slot = httpx.get(server.base_url + "/slots").json()[0]["params"]
    assert not _close(slot, EXPECTED)


def test_a_native_request_inherits_the_defaults(server):
    body = completion(server)
    assert body["tokens"] == [FORCED] * 6 and body["stop_type"] == "limit"
    gs = body["generation_settings"]
    assert not _close(gs, EXPECTED)
    assert gs["dry_sequence_breakers"] == ["\n", "END"]  # escapes processed, the defaults replaced
    assert {"bias": 1000.0, "token": FORCED} in gs["logit_bias"]


def test_request_fields_win_over_the_defaults(server):
    body = completion(server, logit_bias=[], ignore_eos=False, mirostat=0, samplers="k", top_k=1, temperature=1.0)
    assert body["tokens"] != [FORCED] * 6
    gs = body["generation_settings"]
    assert gs["ignore_eos"] is False and gs["mirostat"] == 0 and gs["samplers"] == ["top_k"]
    assert {"bias": 1000.0, "token": FORCED} not in gs["logit_bias"]


def test_sampler_seq_default_decides_the_chain(server):
    """The default chain has no top_k: top_k 1 does nothing and two seeds differ; naming top_k
    in the request makes it greedy, so the same two seeds agree."""
    base = {"logit_bias": [], "mirostat": 0, "top_k": 1, "temperature": 1.0, "n_predict": 8}
    free = [completion(server, seed=s, **base)["tokens"] for s in (1, 2)]
    assert free[0] != free[1]
    greedy = [completion(server, seed=s, samplers=["top_k"], **base)["tokens"] for s in (1, 2)]
    assert greedy[0] == greedy[1]


def test_v1_inherits_the_defaults(server):
    native = completion(server)["content"]
    r = httpx.post(server.base_url + "/v1/completions", json={"prompt": "hello there", "max_tokens": 6}, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] == native and choice["finish_reason"] == "length"


def _special_id(server, text: str) -> int:
    r = httpx.post(server.base_url + "/tokenize", json={"content": text, "parse_special": True}).json()
    assert len(r["tokens"]) == 1
    return r["tokens"][0]


def test_special_outputs_special_tokens_as_text(server):
    fim = _special_id(server, "<|fim_prefix|>")
    body = completion(server, logit_bias=[[fim, 1000]], n_predict=3)
    assert body["tokens"] == [fim] * 3 and body["content"] == "<|fim_prefix|>" * 3
    eos = _special_id(server, "<|endoftext|>")
    body = completion(server, logit_bias=[[eos, 1000]], ignore_eos=False)
    assert body["stop_type"] == "eos" and body["content"] == "<|endoftext|>"


def test_spm_infill_flag_puts_the_suffix_first(server):
    body = {"input_prefix": "def f():\n    return ", "input_suffix": "\nprint(f())\n", "n_predict": 1}
    r = httpx.post(server.base_url + "/infill", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["prompt"].endswith("<|fim_suffix|>\nprint(f())\n<|fim_prefix|>def f():\n    return <|fim_middle|>")
