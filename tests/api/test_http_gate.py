"""The HTTP pieces of the flag surface on a small Litestar app: API keys, CORS, the /tools and
/cors-proxy stubs, and the Vertex AI /predict fan-out."""

from __future__ import annotations

import asyncio

import httpx
from litestar import Litestar, Request, get, post

from mlxcel.api.llamacpp.stubs import FEATURE_DISABLED_HANDLERS
from mlxcel.api.security import wrap_app
from mlxcel.api.vertex import alias_table, check_predict_route, make_predict_handler, route_alias
from mlxcel.cli.flags import parse_server_args
from mlxcel.config.refusal import StartupRefusal

import pytest


@get("/health", sync_to_thread=False)
def health() -> dict:
    return {"status": "ok"}


@get("/v1/models", sync_to_thread=False)
def models() -> dict:
    return {"data": []}


@post("/v1/chat/completions")
async def chat(request: Request) -> dict:
    data = await request.json()
    return {"echo": data}


@post("/apply-template")
async def apply_template(request: Request) -> dict:
    data = await request.json()
    return {"prompt": str(data.get("messages"))}


@post("/completions")
async def native_completions(request: Request) -> dict:
    await request.json()
    return {"native": True}


@post("/v1/completions")
async def oai_completions(request: Request) -> dict:
    await request.json()
    return {"oai": True}


def make_client(*argv: str, predict: bool = False, **environ: str) -> httpx.AsyncClient:
    settings = parse_server_args(list(argv), environ)
    handlers = [health, models, chat, apply_template, native_completions, oai_completions, *FEATURE_DISABLED_HANDLERS]
    if predict:
        handlers.append(make_predict_handler(settings.server.vertex_predict_route or "/predict"))
    app = wrap_app(Litestar(route_handlers=handlers), settings)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def call(client: httpx.AsyncClient, method: str, path: str, **kw) -> httpx.Response:
    async def go():
        async with client:
            return await client.request(method, path, **kw)

    return asyncio.run(go())


def test_no_keys_means_open():
    assert call(make_client(), "GET", "/v1/models").status_code == 200


def test_api_key_401_shape_and_public_paths(caplog):
    c = lambda: make_client("--api-key", "sekrit-key")  # noqa: E731
    r = call(c(), "GET", "/v1/models")
    assert r.status_code == 401
    assert r.content == b'{"error":{"message":"Invalid API Key","type":"authentication_error","code":401}}'
    assert r.headers["content-type"] == "application/json; charset=utf-8"
    assert call(c(), "GET", "/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert call(c(), "GET", "/v1/models", headers={"Authorization": "Bearer sekrit-key"}).status_code == 200
    assert call(c(), "GET", "/v1/models", headers={"X-Api-Key": "sekrit-key"}).status_code == 200
    assert call(c(), "GET", "/health").status_code == 200
    assert "sekrit-key" not in caplog.text


def test_api_key_from_environment_and_file(tmp_path):
    f = tmp_path / "keys"
    f.write_text("# ops\nfile-key\n")
    assert call(make_client(LLAMA_API_KEY="env-key"), "GET", "/v1/models",
                headers={"Authorization": "Bearer env-key"}).status_code == 200
    assert call(make_client("--api-key-file", str(f)), "GET", "/v1/models",
                headers={"Authorization": "Bearer file-key"}).status_code == 200


def test_preflight_is_answered_before_auth_and_routing():
    r = call(make_client("--api-key", "k"), "OPTIONS", "/no/such/route", headers={"Origin": "http://a.example"})
    assert r.status_code == 200 and r.content == b""
    assert r.headers["access-control-allow-origin"] == "http://a.example"
    assert "access-control-allow-credentials" not in r.headers  # an Origin echoed for `*`: never credentialed
    assert r.headers["access-control-allow-methods"] == "GET, POST, DELETE, OPTIONS"
    assert r.headers["access-control-allow-headers"] == "*"


def test_cors_default_echoes_origin_without_preflight_lists():
    r = call(make_client(), "GET", "/health", headers={"Origin": "http://a.example"})
    assert r.headers["access-control-allow-origin"] == "http://a.example"
    assert "access-control-allow-methods" not in r.headers
    assert "access-control-expose-headers" not in r.headers


def test_cors_variants():
    r = call(make_client("--no-cors-credentials"), "GET", "/health", headers={"Origin": "http://a.example"})
    assert r.headers["access-control-allow-origin"] == "*" and "access-control-allow-credentials" not in r.headers
    r = call(make_client("--cors-origins", "localhost"), "GET", "/health", headers={"Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in r.headers
    r = call(make_client("--cors-origins", "localhost"), "GET", "/health", headers={"Origin": "http://localhost:3000"})
    assert r.headers["access-control-allow-origin"] == "http://localhost:3000"
    r = call(make_client("--cors-origins", "https://x.example, https://y.example"), "GET", "/health",
             headers={"Origin": "https://y.example"})
    assert r.headers["access-control-allow-origin"] == "https://y.example"


@pytest.mark.parametrize("flags", [(), ("--cors-origins", "*"), ("--cors-origins", "localhost"),
                                   ("--cors-origins", "null, https://x.example"), ("--no-cors-credentials",)])
@pytest.mark.parametrize("origin", ["null", "NULL", "http://evil.example", "https://x.example"])
def test_a_reflected_or_null_origin_never_carries_credentials(flags, origin):
    for method in ("GET", "OPTIONS"):
        r = call(make_client(*flags), method, "/health", headers={"Origin": origin})
        allowed = r.headers.get("access-control-allow-origin")
        assert allowed is None or allowed.lower() != "null"
        named = "--cors-origins" in flags and origin == "https://x.example" and "null, https://x.example" in flags
        if r.headers.get("access-control-allow-credentials") == "true":
            assert named and allowed == origin  # credentials only with an origin the operator listed
        if allowed not in (None, "*"):
            assert r.headers["vary"] == "Origin"


def test_credentials_go_with_named_origins_only():
    r = call(make_client("--cors-origins", "https://x.example"), "GET", "/health", headers={"Origin": "https://x.example"})
    assert r.headers["access-control-allow-credentials"] == "true"
    r = call(make_client("--cors-origins", "localhost"), "GET", "/health", headers={"Origin": "http://127.0.0.1:8080"})
    assert r.headers["access-control-allow-credentials"] == "true"
    r = call(make_client(), "GET", "/health", headers={"Origin": "null"})
    assert r.headers["access-control-allow-origin"] == "*" and "access-control-allow-credentials" not in r.headers
    assert "access-control-allow-origin" not in call(make_client(), "GET", "/health").headers


def test_tools_and_cors_proxy_stubs():
    for method in ("GET", "POST"):
        for path in ("/tools", "/cors-proxy"):
            r = call(make_client(), method, path, json={"x": 1} if method == "POST" else None)
            assert r.status_code == 403
            assert r.content == b'{"error":{"message":"this feature is disabled","type":"feature_disabled"}}'


def test_predict_aliases():
    assert route_alias("/v1/chat/completions") == "chatCompletions"
    assert route_alias("/apply-template") == "applyTemplate"
    table = alias_table(["/completions", "/v1/completions", "/embeddings"])
    assert table["completions"] == "/v1/completions" and table["embeddings"] == "/embeddings"
    with pytest.raises(StartupRefusal):
        check_predict_route("/v1/models", ["/v1/models", "/health"])


def test_predict_fan_out_in_order_with_per_instance_errors():
    c = make_client(predict=True, AIP_MODE="PREDICTION")
    body = {"instances": [
        {"@requestFormat": "chatCompletions", "messages": [], "stream": True},
        {"@requestFormat": "nope"},
        {"@requestFormat": "/apply-template", "messages": ["hi"]},
        {"@requestFormat": "completions"},
    ]}
    r = call(c, "POST", "/predict", json=body)
    assert r.status_code == 200
    p = r.json()["predictions"]
    assert p[0] == {"echo": {"messages": [], "stream": False}}
    assert p[1]["error"]["code"] == 400
    assert p[2] == {"prompt": "['hi']"}
    assert p[3] == {"oai": True}


def test_predict_carries_the_api_key_check():
    c = lambda: make_client("--api-key", "k", predict=True, AIP_MODE="PREDICTION")  # noqa: E731
    body = {"instances": [{"@requestFormat": "chatCompletions"}]}
    assert call(c(), "POST", "/predict", json=body).status_code == 401
    r = call(c(), "POST", "/predict", json=body, headers={"Authorization": "Bearer k"})
    assert r.json()["predictions"] == [{"echo": {}}]
    assert call(c(), "POST", "/predict", json={"instances": [{}] * 129},
                headers={"Authorization": "Bearer k"}).status_code == 400


NOT_FOUND = {"error": {"message": "File Not Found", "type": "not_found_error", "code": 404}}


def test_api_prefix_moves_every_route_and_404s_outside_it():
    c = lambda: make_client("--api-prefix", "/api")  # noqa: E731
    assert call(c(), "GET", "/api/health").json() == {"status": "ok"}
    assert call(c(), "POST", "/api/v1/chat/completions", json={"a": 1}).json() == {"echo": {"a": 1}}
    assert call(c(), "POST", "/api/tools", json={}).status_code == 403
    for path in ("/health", "/v1/models", "/api", "/apihealth", "/x/api/health"):
        r = call(c(), "GET", path)
        assert (r.status_code, r.json()) == (404, NOT_FOUND), path
    assert call(c(), "OPTIONS", "/anything").status_code == 200  # preflights stay ahead of routing


def test_api_prefix_from_environment_and_reuse_port_flag():
    s = parse_server_args([], {"LLAMA_ARG_API_PREFIX": "/v2", "LLAMA_ARG_REUSE_PORT": "true"})
    assert (s.server.api_prefix, s.server.reuse_port) == ("/v2", True)
    s = parse_server_args(["--api-prefix", "/cli"], {"LLAMA_ARG_API_PREFIX": "/env"})
    assert (s.server.api_prefix, s.server.reuse_port) == ("/cli", False)
    assert any("--api-prefix 'api/'" in n for n in parse_server_args(["--api-prefix", "api/"], {}).notices)


def test_api_prefix_public_paths_are_matched_as_sent():
    # b10621 checks its public set against the path as received, so the prefixed /health
    # needs the key and the bare one is public (and then not found).
    c = lambda: make_client("--api-prefix", "/api", "--api-key", "k")  # noqa: E731
    assert call(c(), "GET", "/api/health").status_code == 401
    assert call(c(), "GET", "/api/health", headers={"Authorization": "Bearer k"}).status_code == 200
    assert call(c(), "GET", "/health").status_code == 404
    assert call(c(), "GET", "/index.html").status_code == 404
    assert call(c(), "GET", "/v1/models").status_code == 401


def test_predict_under_prefix_and_b10621_dispatch_rules():
    c = lambda: make_client("--api-prefix", "/api", predict=True, AIP_MODE="PREDICTION")  # noqa: E731
    body = {"instances": [
        {"@requestFormat": "health"},  # a GET-only path: dispatched as GET
        {"@requestFormat": "/v1/models"},
        {"@requestFormat": 7},
        "text",
        {"@requestFormat": "predict"},
        {"@requestFormat": "applyTemplate", "messages": ["x"], "stream": "yes"},
    ]}
    p = call(c(), "POST", "/api/predict", json=body).json()["predictions"]
    assert p[0] == {"status": "ok"} and p[1] == {"data": []}
    assert p[2]["error"]["message"] == "each instance must include a string @requestFormat"
    assert p[3]["error"]["message"] == "each instance must be a JSON object"
    assert p[4]["error"]["message"] == "no handler registered for @requestFormat: predict"
    assert p[5] == {"prompt": "['x']"}
    assert call(c(), "POST", "/predict", json=body).status_code == 404
    for bad, message in (([], "request body must be a JSON object"),
                         ({}, "request body must include an array field named instances"),
                         ({"instances": [{}] * 129}, "instances array exceeds maximum size of 128")):
        r = call(c(), "POST", "/api/predict", json=bad)
        assert r.status_code == 400 and r.json()["error"]["message"] == message
