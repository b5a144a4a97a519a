"""Native routes whose behaviour hangs on server flags the CLI does not parse yet
(--metrics, --props, --no-slots, --parallel, --spm-infill): the real app and a real
model under uvicorn in this process, with the settings set directly."""

from __future__ import annotations

import json
import time
from dataclasses import replace

import httpx
import pytest

from mlxcel.api.state import AppState
from mlxcel.backends.select import choose
from mlxcel.config.settings import EngineSection, ServerSection, ServerSettings, SourceSection
from mlxcel.runtime.load import load_served_model
from tests.conftest import default_compute_dtype, fixture_path
from tests.e2e.inprocess import AppServer
from tests.fixtures import DEFAULT_MODEL, QWEN2_TINY


@pytest.fixture(scope="module")
def smol():
    settings = ServerSettings(source=SourceSection(model=DEFAULT_MODEL),
                              server=ServerSection(metrics=True, props=True),
                              engine=EngineSection(parallel=1, warmup=False))
    model = load_served_model(settings, fixture_path(DEFAULT_MODEL))
    on = AppServer(AppState(settings=settings, model=model))
    off = AppServer(AppState(settings=replace(settings, server=replace(settings.server, metrics=False, props=False, slots=False)), model=model))
    yield on, off
    on.stop()
    off.stop()
    model.engine.shutdown()


@pytest.fixture(scope="module")
def qwen():
    settings = ServerSettings(source=SourceSection(model=QWEN2_TINY), engine=EngineSection(warmup=False))
    model = load_served_model(settings, fixture_path(QWEN2_TINY))
    psm = AppServer(AppState(settings=settings, model=model))
    spm = AppServer(AppState(settings=replace(settings, server=replace(settings.server, spm_infill=True)), model=model))
    yield psm, spm
    psm.stop()
    spm.stop()
    model.engine.shutdown()


def test_gated_endpoints_answer_upstream_501(smol):
    _, off = smol
    for method, path, flag in (("GET", "/metrics", "--metrics"), ("GET", "/slots", "--slots"),
                               ("POST", "/props", "--props")):
        r = httpx.request(method, off.base_url + path, json={} if method == "POST" else None)
        assert r.status_code == 501, path
        err = r.json()["error"]
        assert err["type"] == "not_supported_error" and err["code"] == 501 and f"Start it with `{flag}`" in err["message"]
    props = httpx.get(off.base_url + "/props").json()  # GET /props is never gated
    assert (props["endpoint_metrics"], props["endpoint_slots"], props["endpoint_props"]) == (False, False, False)
    r = httpx.post(off.base_url + "/slots/0?action=save", json={"filename": "x"})
    assert r.status_code == 501 and "--slot-save-path" in r.json()["error"]["message"]


def test_props_post_acknowledges_and_get_reports_the_key_set(smol):
    on, _ = smol
    assert httpx.post(on.base_url + "/props", json={"anything": 1}).json() == {"success": True}
    props = httpx.get(on.base_url + "/props").json()
    assert set(props) == {
        "default_generation_settings", "total_slots", "model_alias", "model_ftype", "model_path", "modalities",
        "media_marker", "endpoint_slots", "endpoint_props", "endpoint_metrics", "ui", "ui_settings",
        "chat_template", "chat_template_caps", "bos_token", "eos_token", "build_info", "is_sleeping",
        "cors_proxy_enabled",
        # mlxcel's extensions
        "capabilities", "backend", "geometry", "kv_cache", "speculative", "distributed"}
    assert props["speculative"] is None  # no --spec-type / -md: nothing speculates
    assert props["distributed"] is None  # one process: no --tp-size / --pp-size group
    # SmolLM2's layers all read the whole context: no block goes back behind a window, and /props says why
    kv = props["kv_cache"]
    assert kv["free_behind_window"] is False and "no layer" in kv["free_behind_window_off_reason"]
    auto = choose("auto", "auto")  # these settings leave --backend/--device at auto
    backend = props["backend"]
    assert (backend["name"], backend["device"], backend["reason"]) == (auto.backend, auto.device, auto.reason)
    assert backend["compute_dtype"] == default_compute_dtype(auto.backend, auto.device)
    assert set(props["default_generation_settings"]) == {"params", "n_ctx"}
    assert props["default_generation_settings"]["params"]["top_k"] == 40
    assert props["total_slots"] == 1 and props["model_alias"] == DEFAULT_MODEL
    assert "<|im_start|>" in props["chat_template"] and props["eos_token"] == "<|im_end|>"


def test_slots_live_while_streaming_and_metrics_count(smol):
    on, _ = smol
    url = on.base_url
    body = {"prompt": "Write a long story about a dragon.", "n_predict": 64, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.Client(timeout=120) as c, c.stream("POST", url + "/completion", json=body) as r:
        lines = r.iter_lines()
        frame = next(json.loads(x[6:]) for x in lines if x.startswith("data: "))
        assert frame["tokens"] and frame["id_slot"] == -1
        slots = c.get(url + "/slots").json()
        assert len(slots) == 1 and slots[0]["is_processing"] is True
        assert slots[0]["n_prompt_tokens"] == slots[0]["n_prompt_tokens_processed"] > 0
        assert slots[0]["params"]["n_predict"] == 64 and slots[0]["next_token"][0]["n_decoded"] >= 1
        busy = c.get(url + "/slots", params={"fail_on_no_slot": 1})
        assert busy.status_code == 503
        assert busy.json()["error"] == {"code": 503, "message": "no slot available", "type": "unavailable_error"}
        m = c.get(url + "/metrics")
        assert "llamacpp:requests_processing 1" in m.text
    # the stream closed early: the slot frees once the engine sees the cancel
    deadline = time.monotonic() + 30
    while httpx.get(url + "/slots").json()[0]["is_processing"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert httpx.get(url + "/slots", params={"fail_on_no_slot": 1}).status_code == 200
    m = httpx.get(url + "/metrics")
    assert m.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert int(m.headers["process-start-time-unix"]) > 0
    values = {ln.split()[0]: float(ln.split()[1]) for ln in m.text.splitlines() if not ln.startswith("#")}
    assert values["llamacpp:prompt_tokens_total"] > 0 and values["llamacpp:tokens_predicted_total"] >= 1
    assert values["llamacpp:requests_processing"] == 0


def _metrics(url: str) -> tuple[dict[str, float], dict[str, str]]:
    text = httpx.get(url + "/metrics").text
    values = {ln.split()[0]: float(ln.split()[1]) for ln in text.splitlines() if not ln.startswith("#")}
    types = dict(ln.split()[2:4] for ln in text.splitlines() if ln.startswith("# TYPE"))
    return values, types


def test_metrics_count_cached_prompt_tokens_and_busy_slots(smol):
    """A prefix-cache hit moves prompt_tokens_cached_total by the hit's cache_n (and prompt_tokens_total
    by the rest); the speculative counters stay at zero without a draft; busy slots is a gauge."""
    on, _ = smol
    url = on.base_url
    body = {"prompt": "A cached prefix: the quick brown fox jumps over the lazy dog, twice over.", "n_predict": 2,
            "temperature": 0, "cache_prompt": True}
    httpx.post(url + "/completion", json=body, timeout=120).raise_for_status()
    before, types = _metrics(url)
    second = httpx.post(url + "/completion", json=body, timeout=120).json()
    after, _ = _metrics(url)
    t = second["timings"]
    assert t["cache_n"] > 0
    assert after["llamacpp:prompt_tokens_cached_total"] - before["llamacpp:prompt_tokens_cached_total"] == t["cache_n"]
    assert after["llamacpp:prompt_tokens_total"] - before["llamacpp:prompt_tokens_total"] == t["prompt_n"]
    for name in ("draft_tokens", "accepted_tokens", "drafts"):
        assert types[f"llamacpp:spec_decode_num_{name}_total"] == "counter"
        assert after[f"llamacpp:spec_decode_num_{name}_total"] == 0
    assert types["llamacpp:n_busy_slots_per_decode"] == "gauge"
    assert types["llamacpp:prompt_tokens_cached_total"] == "counter"
    assert after["llamacpp:n_busy_slots_per_decode"] == 1.0  # --parallel 1: every forward ran one row


def test_infill_prompt_layout_and_spm(qwen):
    psm, spm = qwen
    body = {"input_prefix": "def add(a, b):\n    return ", "input_suffix": "\n\nprint(add(1, 2))\n",
            "input_extra": [{"filename": "util.py", "text": "X = 1\n"}], "n_predict": 2, "temperature": 0}
    a = httpx.post(psm.base_url + "/infill", json=body, timeout=60).json()
    b = httpx.post(spm.base_url + "/infill", json=body, timeout=60).json()
    extra = "<|repo_name|>myproject\n<|file_sep|>util.py\nX = 1\n<|file_sep|>filename\n"
    assert a["prompt"] == (extra + "<|fim_prefix|>def add(a, b):\n    return <|fim_suffix|>\n\nprint(add(1, 2))\n"
                           "<|fim_middle|>")
    assert b["prompt"] == (extra + "<|fim_suffix|>\n\nprint(add(1, 2))\n<|fim_prefix|>def add(a, b):\n    return "
                           "<|fim_middle|>")
    assert a["tokens_predicted"] >= 1 and a["stop"] is True
    # a marker spelled inside the text stays text, as upstream tokenizes these fields
    short = {**body, "n_predict": 1}
    lit = httpx.post(psm.base_url + "/infill", json={**short, "input_prefix": "<|fim_middle|>"}, timeout=60).json()
    base = httpx.post(psm.base_url + "/infill", json={**short, "input_prefix": ""}, timeout=60).json()
    spelled = httpx.post(psm.base_url + "/tokenize", json={"content": "<|fim_middle|>", "parse_special": False}).json()
    assert len(spelled["tokens"]) > 1
    assert lit["tokens_evaluated"] - base["tokens_evaluated"] == len(spelled["tokens"])
    r = httpx.post(psm.base_url + "/infill", json={"input_suffix": ""})
    assert r.status_code == 400 and r.json()["error"]["message"] == '"input_prefix" is required'


def test_infill_refused_without_fim_markers(smol):
    on, _ = smol
    r = httpx.post(on.base_url + "/infill", json={"input_prefix": "a", "input_suffix": "b"})
    assert r.status_code == 501
    assert r.json()["error"]["message"] == ("Infill is not supported by this model: prefix token is missing. "
                                            "suffix token is missing. middle token is missing. ")


def test_special_tokens_are_not_text_without_special(qwen):
    psm, _ = qwen
    fim = httpx.post(psm.base_url + "/tokenize", json={"content": "<|fim_prefix|>", "parse_special": True}).json()
    body = {"prompt": "x", "n_predict": 2, "logit_bias": [[fim["tokens"][0], 1000]], "return_tokens": True}
    r = httpx.post(psm.base_url + "/completion", json=body, timeout=60).json()
    assert r["tokens"] == fim["tokens"] * 2 and r["content"] == ""
