"""Property-based fuzz of every JSON route's request decoder against one real loopback server.

Bodies come from the request structs (tests/hardening/bodies.py): mostly the declared fields
with plausible and wrong values, sometimes broken or deeply nested JSON. Every answer must be
below 500 (or 501: a feature this server lacks), carry no server error inside a stream,
arrive within CASE_LIMIT_S, and leave /health answering 200. Derandomized in `make test`;
scripts/hardening.py runs it longer.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest
from hypothesis import given

from mlxcel.config.limits import ERROR_MESSAGE_CHARS
from tests.conftest import ServerProcess, fixture_path
from tests.fixtures import MINILM, QWEN2_TINY, RERANKER_TINY
from tests.hardening.bodies import HEADERS, ROUTES, raw_bodies
from tests.hardening.budget import examples, fuzz_settings

# generous: the machine may be shared; a case asks for at most 8 tokens of a tiny model
CASE_LIMIT_S = 30.0
EXAMPLES_PER_ROUTE = 200  # x 20 routes: 4000 cases in make test
# per route: a stuck case fails this test instead of running to CI's limit (scaled for long runs)
pytestmark = pytest.mark.timeout(int(600 * examples(1)))


@pytest.fixture(scope="module")
def server():
    for ref in (QWEN2_TINY, MINILM, RERANKER_TINY):
        fixture_path(ref)
    s = ServerProcess(["-m", QWEN2_TINY, "--offline", "-np", "2", "-c", "512", "-n", "16", "--max-queue-depth", "4",
                       "--embedding-model", MINILM, "--reranker-model", RERANKER_TINY])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.base_url, timeout=CASE_LIMIT_S) as c:
        yield c


def stream_errors(text: str) -> list[str]:
    """Server errors carried in SSE frames (a stream's status is 200 before anything fails)."""
    found = []
    for line in text.splitlines():
        if not line.startswith("data:"):
            continue
        try:
            frame = json.loads(line[5:])
        except ValueError:
            continue
        err = frame.get("error") if isinstance(frame, dict) else None
        if isinstance(err, dict) and (err.get("type") in ("server_error", "api_error") or err.get("code") == 500):
            found.append(line[:300])
    return found


def check_case(client: httpx.Client, path: str, body: bytes, headers: dict[str, str]) -> None:
    start = time.monotonic()
    raw = {k: v.encode() for k, v in headers.items()}  # bytes: a header may carry non-ASCII
    r = client.post(path, content=body, headers={"Content-Type": "application/json", **raw})
    elapsed = time.monotonic() - start
    # 501 is b10621's deliberate "this server lacks the feature" (image input on a text model)
    assert r.status_code < 500 or r.status_code == 501, \
        f"{path} answered {r.status_code}: {r.text[:800]}\nbody: {body[:800]!r} {headers}"
    assert elapsed < CASE_LIMIT_S, f"{path} took {elapsed:.1f}s\nbody: {body[:800]!r}"
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        errors = stream_errors(r.text)
        assert not errors, f"{path} streamed a server error: {errors}\nbody: {body[:800]!r}"
    health = client.get("/health", timeout=10)
    assert health.status_code == 200, f"/health answered {health.status_code} after {path} body {body[:800]!r}"


@pytest.mark.parametrize("path", list(ROUTES))
def test_route_decoder_never_answers_5xx(client, path):
    @fuzz_settings(EXAMPLES_PER_ROUTE, deadline_ms=None)
    @given(raw_bodies(ROUTES[path]), HEADERS)
    def case(body, headers):
        check_case(client, path, body, headers)

    case()


@pytest.mark.parametrize("path, bias", [("/completion", {"5": 1e308}), ("/completion", [[5, 3e38], [5, 3e38]]),
                                        ("/infill", [[5, 1e308]])])
def test_a_logit_bias_past_float32_is_a_400(client, path, bias):
    """Found by this fuzz: a native logit_bias of 1e308 (+inf as upstream's C float) was a 500
    from the sampler; it is refused before the request runs."""
    body = {"prompt": "hi", "input_prefix": "a", "input_suffix": "b", "n_predict": 2, "logit_bias": bias}
    r = client.post(path, json=body)
    assert r.status_code == 400 and "logit_bias for token 5" in r.json()["error"]["message"], r.text


BIG = "x" * (1 << 20)  # 1 MiB of client text where an error message would quote it
HI = [{"role": "user", "content": "hi"}]
STRICT = {"X-miLLM-Strict": "1"}


@pytest.mark.parametrize("method, path, body, headers", [
    ("POST", "/v1/chat/completions", {"model": BIG, "messages": HI}, {}),
    ("POST", "/v1/chat/completions", {BIG: 1, "messages": HI}, STRICT),
    ("POST", "/v1/chat/completions", {"messages": HI, "response_format": {"type": BIG}}, {}),
    ("POST", "/v1/chat/completions", {"messages": HI, "logit_bias": {BIG: 1}}, {}),
    ("POST", "/v1/completions", {"model": BIG, "prompt": "hi"}, {}),
    ("POST", "/completion", {"prompt": "hi", "samplers": [BIG]}, {}),
    ("POST", "/completion", {"prompt": "hi", "json_schema": {"type": BIG}}, {}),
    ("POST", "/completion", {"prompt": "hi", "grammar": "root ::= " + BIG}, {}),
    ("POST", "/v1/messages", {"model": BIG, "messages": HI, "max_tokens": 2}, {}),
    ("POST", "/v1/messages", {"model": "m", "messages": HI, "max_tokens": 2, "tool_choice": {"type": BIG}}, {}),
    ("POST", "/v1/messages", {"model": "m", "max_tokens": 2,
                              "messages": [{"role": "user", "content": [{"type": BIG}]}]}, {}),
    ("POST", "/v1/responses", {"input": [{"type": BIG}]}, {}),
    ("POST", "/v1/responses", {"input": "hi", "tools": [{"type": BIG}]}, {}),
    ("POST", "/v1/chat/completions/control", {"id": "c", "action": BIG}, {}),
    ("GET", "/v1/models/" + "m" * 8000, None, {}),  # a URL stops at the header limit (16 KiB)
    ("POST", "/api/models/" + "m" * 8000 + "/load", {}, {}),
])
def test_an_error_quotes_a_bounded_part_of_the_client_text(client, method, path, body, headers):
    """Found by the hostile-client pass: model names, field names and values were quoted whole, so
    a 1 MiB name came back as a 1 MiB error. Each is cut (config/limits.echo), and any message is
    cut at ERROR_MESSAGE_CHARS wherever it is rendered."""
    r = client.request(method, path, json=body, headers=headers)
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    assert len(r.content) < 2 * ERROR_MESSAGE_CHARS, (len(r.content), r.text[:300])


def test_server_logged_no_unhandled_exception(server, client):
    """Runs after the fuzz (same module, declared last): an error the handlers turned into a 4xx
    is fine, a traceback from the framework's last-resort handler is a missed case."""
    assert client.get("/health").status_code == 200
    log = server.log_path.read_text(errors="replace")
    assert "Traceback" not in log, log[log.index("Traceback") - 200:][:3000]
