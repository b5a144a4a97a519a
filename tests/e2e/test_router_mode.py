"""Router mode end to end: a real `mlxcel-server --models-dir ... --models-preset ...` over small
real checkpoints (torch backend), with --models-max 1 so every second model evicts the first.

The models directory holds copies of two tiny fixtures plus a link that resolves outside it
(skipped); the model store holds a third as a removable cache model; a preset overlays alias,
tags and context size onto one of them. POST /models downloads from a local HTTP server that
answers the hub's API shape (the real hub is unreachable here), so the download path runs the
real huggingface_hub client end to end. Every event the pool emits is collected from
GET /models/sse by a reader thread for the whole module.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from tests.conftest import ServerProcess, fixture_path
from tests.fixtures import JSON_TOOLS_TINY, LLAMA3_TOOLS_TINY, MISTRAL_TOOLS_TINY, QWEN2_TINY

HUB_REPO = "tiny-org/tiny-chat"
HUB_SHA = "0123456789abcdef0123456789abcdef01234567"
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}


class _Hub(BaseHTTPRequestHandler):
    """The two hub calls huggingface_hub makes for a snapshot: model info, then resolve per file."""

    source: Path

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        if self.path.split("?")[0].startswith(f"/api/models/{HUB_REPO}"):
            files = sorted(p for p in self.source.iterdir() if p.is_file())
            self._send(200, json.dumps({"id": HUB_REPO, "sha": HUB_SHA, "siblings": [
                {"rfilename": p.name, "size": p.stat().st_size} for p in files]}).encode(), "application/json")
        else:
            self._resolve(True)

    def do_HEAD(self) -> None:
        self._resolve(False)

    def _resolve(self, with_body: bool) -> None:
        prefix = f"/{HUB_REPO}/resolve/{HUB_SHA}/"
        path = self.source / self.path[len(prefix):] if self.path.startswith(prefix) else None
        if path is None or not path.is_file():
            return self._send(404, b"", "text/plain", {"X-Error-Code": "RepoNotFound"})
        data = path.read_bytes()
        self._send(200, data if with_body else b"", "application/octet-stream",
                   {"X-Repo-Commit": HUB_SHA, "ETag": f'"{hashlib.sha256(data).hexdigest()}"'}, len(data))

    def _send(self, status: int, body: bytes, ctype: str, headers: dict | None = None, length: int | None = None):
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body) if length is None else length))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("router")
    mdir, store = tmp / "models", tmp / "store"
    mdir.mkdir()
    for ref in (JSON_TOOLS_TINY, LLAMA3_TOOLS_TINY):
        shutil.copytree(fixture_path(ref), mdir / ref.split("/")[1])
    (mdir / "outside").symlink_to(fixture_path(QWEN2_TINY))  # resolves outside: never listed
    (mdir / "broken").mkdir()  # a config.json and no weights: listed, and fails to load
    shutil.copy(fixture_path(JSON_TOOLS_TINY) / "config.json", mdir / "broken" / "config.json")
    shutil.copytree(fixture_path(MISTRAL_TOOLS_TINY), store / MISTRAL_TOOLS_TINY)
    preset = tmp / "presets.ini"
    preset.write_text("[*]\nctx-size = 512\n\n[json-tools-tiny]\nalias = jt\ntags = tiny,json\nctx-size = 256\n"
                      "parallel = 1\nload-on-startup = true\nstop-timeout = 10\n")
    handler = type("Hub", (_Hub,), {"source": fixture_path(JSON_TOOLS_TINY)})
    hub = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=hub.serve_forever, daemon=True).start()
    server = ServerProcess(["--models-dir", str(mdir), "--models-preset", str(preset), "--models-max", "1",
                            "--model-store-root", str(store), "--backend", "torch", "--parallel", "2"],
                           env={"HF_ENDPOINT": f"http://127.0.0.1:{hub.server_port}", "HF_HUB_OFFLINE": "0"})
    server.events, server.mdir, server.store = [], mdir, store

    def read_events() -> None:
        with httpx.stream("GET", server.base_url + "/models/sse", timeout=None) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    server.events.append(json.loads(line[6:]))

    threading.Thread(target=read_events, daemon=True).start()
    yield server
    server.stop()
    hub.shutdown()


def _models(server) -> dict[str, dict]:
    r = httpx.get(server.base_url + "/models", timeout=30)
    assert r.status_code == 200
    return {m["id"]: m for m in r.json()["data"]}


def _until(what, check, timeout: float = 180):
    """Poll until `check()` is truthy (a guard against hanging, not a timing assertion)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"gave up waiting for {what}")


def _post(server, path: str, body: dict, **params) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, params=params, timeout=180)


def _err(r: httpx.Response, status: int) -> str:
    assert r.status_code == status, r.text
    body = r.json()["error"]
    assert body["code"] == status
    return body["message"]


def test_inventory_lists_every_source(router):
    models = _models(router)
    assert set(models) == {"broken", "json-tools-tiny", "llama3-tools-tiny", MISTRAL_TOOLS_TINY}  # no "outside"
    jt = models["json-tools-tiny"]
    assert (jt["source"], jt["can_remove"], jt["aliases"], jt["tags"]) == ("models_dir", False, ["jt"], ["json", "tiny"])
    assert "[json-tools-tiny]" in jt["status"]["preset"]
    assert jt["status"]["args"][2:] == ["--ctx-size", "256"]  # the router's own --parallel 2 wins over the preset
    assert jt["owned_by"] == "llamacpp" and jt["architecture"]["output_modalities"] == ["text"]
    assert models["llama3-tools-tiny"]["status"]["value"] == "unloaded"
    # load-on-startup: the preset's model loads without being asked
    _until("the load-on-startup model", lambda: _models(router)["json-tools-tiny"]["status"]["value"] == "loaded")
    cached = models[MISTRAL_TOOLS_TINY]
    assert (cached["source"], cached["can_remove"]) == ("cache", True)
    assert set(m["id"] for m in httpx.get(router.base_url + "/v1/models").json()["data"]) == set(models)
    props = httpx.get(router.base_url + "/props").json()
    assert (props["role"], props["max_instances"], props["models_autoload"]) == ("router", 1, True)


def test_requests_route_by_model_and_evict_lru(router):
    _until("the load-on-startup model", lambda: _models(router)["json-tools-tiny"]["status"]["value"] == "loaded")
    mark = len(router.events)
    # GET routes take ?model=: the preset's context (over the global 512) reached that model, and
    # the router's command-line --parallel 2 won over the preset's parallel = 1
    props = httpx.get(router.base_url + "/props", params={"model": "jt"}, timeout=30).json()
    assert props["geometry"]["n_ctx"] == 256 and props["geometry"]["n_parallel"] == 2
    assert props["model_alias"] == "json-tools-tiny"
    assert len(httpx.get(router.base_url + "/slots", params={"model": "json-tools-tiny"}, timeout=30).json()) == 2
    # another model, with --models-max 1, unloads the loaded one (autoload)
    r = _post(router, "/completion", {"model": "llama3-tools-tiny", "prompt": "a", "n_predict": 2})
    assert r.status_code == 200, r.text
    models = _models(router)
    assert models["llama3-tools-tiny"]["status"]["value"] == "loaded"
    assert models["json-tools-tiny"]["status"]["value"] == "unloaded"
    # and back, by alias, on the OpenAI route
    r = _post(router, "/v1/chat/completions", {**CHAT, "model": "jt"})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "length"
    models = _models(router)
    assert (models["json-tools-tiny"]["status"]["value"], models["llama3-tools-tiny"]["status"]["value"]) == \
        ("loaded", "unloaded")
    seen = [(e["model"], e["event"], e.get("data", {}).get("status")) for e in router.events[mark:]]
    order = [("json-tools-tiny", "status_change", "unloaded"), ("llama3-tools-tiny", "model_status", "loading"),
             ("llama3-tools-tiny", "status_change", "loaded"), ("llama3-tools-tiny", "status_change", "unloaded"),
             ("json-tools-tiny", "model_status", "loading"), ("json-tools-tiny", "status_change", "loaded")]
    assert all(e in seen for e in order), seen
    assert [seen.index(e) for e in order] == sorted(seen.index(e) for e in order), seen


def test_routing_refusals_and_autoload_switch(router):
    assert _err(_post(router, "/v1/completions", {"prompt": "a"}), 400) == "model name is missing from the request"
    assert _err(_post(router, "/v1/completions", {"model": "zz", "prompt": "a"}), 400) == "model 'zz' not found"
    assert _err(httpx.get(router.base_url + "/slots"), 400) == "model name is missing from the request"
    state = _models(router)
    unloaded = next(n for n in ("json-tools-tiny", "llama3-tools-tiny") if state[n]["status"]["value"] == "unloaded")
    r = _post(router, "/v1/completions", {"model": unloaded, "prompt": "a", "max_tokens": 1}, autoload="false")
    assert _err(r, 400) == "model is not loaded"
    assert _models(router)[unloaded]["status"]["value"] == "unloaded"
    # a load that fails answers the request and leaves the model listed as failed
    message = _err(_post(router, "/v1/completions", {"model": "broken", "prompt": "a"}), 500)
    assert message.startswith("model name=broken failed to load") and "safetensors" in message
    status = _models(router)["broken"]["status"]
    assert (status["value"], status["failed"], status["exit_code"]) == ("unloaded", True, 1)


def test_load_and_unload_routes(router):
    assert _err(_post(router, "/models/load", {"model": "nope"}), 404) == "model is not found"
    assert _err(_post(router, "/models/unload", {"model": "nope"}), 400) == "model is not found"
    assert _post(router, "/models/load", {"model": MISTRAL_TOOLS_TINY}).json() == {"success": True}
    _until("the cache model to load", lambda: _models(router)[MISTRAL_TOOLS_TINY]["status"]["value"] == "loaded")
    assert _err(_post(router, "/models/load", {"model": MISTRAL_TOOLS_TINY}), 400) == "model is already running"
    r = _post(router, "/v1/completions", {"model": MISTRAL_TOOLS_TINY, "prompt": "a", "max_tokens": 1},
              autoload="0")  # loaded: served without autoload
    assert r.status_code == 200, r.text
    assert _post(router, "/models/unload", {"model": MISTRAL_TOOLS_TINY}).json() == {"success": True}
    assert _models(router)[MISTRAL_TOOLS_TINY]["status"]["value"] == "unloaded"
    assert _err(_post(router, "/models/unload", {"model": MISTRAL_TOOLS_TINY}), 400) == "model is not running"


def test_download_then_delete(router):
    assert _err(_post(router, "/models", {"model": ""}), 400) == "model must be a non-empty string"
    assert "not a repository id" in _err(_post(router, "/models", {"model": "a/b/c"}), 400)
    assert "GGUF" in _err(_post(router, "/models", {"model": "x/y.gguf"}), 400)
    missing = _err(_post(router, "/models", {"model": "tiny-org/missing"}), 500)
    assert missing.startswith("model validation failed, unable to download tiny-org/missing")
    assert _err(_post(router, "/models", {"model": MISTRAL_TOOLS_TINY}), 500).startswith("model validation failed")
    assert _post(router, "/models", {"model": HUB_REPO}).json() == {"success": True}
    _until("the download to finish", lambda: any(e["event"] in ("download_finished", "download_failed")
                                                 and e["model"] == HUB_REPO for e in router.events))
    mine = [e for e in router.events if e["model"] == HUB_REPO]
    assert [e["event"] for e in mine][-1] == "download_finished", mine
    progress = [e for e in mine if e["event"] == "download_progress"]
    last = progress[-1]["data"]["progress"]
    assert any(url.endswith("/model.safetensors") and p["done"] == p["total"] > 0 for url, p in last.items())
    entry = _models(router)[HUB_REPO]
    assert (entry["source"], entry["can_remove"], entry["status"]["value"]) == ("cache", True, "unloaded")
    assert (router.store / HUB_REPO / "config.json").is_file()
    assert _err(_post(router, "/models", {"model": HUB_REPO}), 400) == f"model '{HUB_REPO}' already exists"
    r = _post(router, "/v1/completions", {"model": HUB_REPO, "prompt": "a", "max_tokens": 1})  # it serves
    assert r.status_code == 200, r.text
    # DELETE unloads it and removes the snapshot; only cache models are removable
    assert httpx.delete(router.base_url + "/models", params={"model": HUB_REPO}, timeout=60).json() == {"success": True}
    assert not (router.store / HUB_REPO).exists() and HUB_REPO not in _models(router)
    assert (HUB_REPO, "model_remove") in [(e["model"], e["event"]) for e in router.events]
    delete = lambda name: httpx.delete(router.base_url + "/models", params={"model": name}, timeout=60)  # noqa: E731
    assert _err(delete("llama3-tools-tiny"), 400) == "model name=llama3-tools-tiny is not removable (not from cache)"
    assert _err(delete("nope"), 404) == "model name=nope is not found"
    assert _err(httpx.delete(router.base_url + "/models"), 400) == "model must be a non-empty string"


def test_reload_rescans_the_sources(router):
    (router.mdir / "second-name").symlink_to(router.mdir / "llama3-tools-tiny")  # inside: listed
    assert "second-name" not in _models(router)
    r = httpx.get(router.base_url + "/models", params={"reload": "1"})
    assert "second-name" in {m["id"] for m in r.json()["data"]}
    _until("models_reload", lambda: ("*", "models_reload") in [(e["model"], e["event"]) for e in router.events])


def test_resumable_streams_need_no_model(router):
    headers = {"X-Conversation-Id": "conv-router-1"}
    with httpx.stream("POST", router.base_url + "/v1/chat/completions", headers=headers, timeout=180,
                      json={**CHAT, "model": "jt", "stream": True}) as r:
        assert r.status_code == 200
        live = b"".join(r.iter_bytes())
    assert live.rstrip().endswith(b"data: [DONE]")
    # the router answers the stream routes itself, from the session store every model records into
    replay = httpx.get(router.base_url + "/v1/stream", params={"conv_id": "conv-router-1", "from": 0}, timeout=60)
    assert replay.status_code == 200 and replay.content == live
    found = httpx.post(router.base_url + "/v1/streams/lookup", json={"conversation_ids": ["conv-router-1", "x"]})
    assert [(s["conversation_id"], s["is_done"]) for s in found.json()] == [("conv-router-1", True)]
    assert httpx.delete(router.base_url + "/v1/stream", params={"conv_id": "conv-router-1"}).status_code == 204
    assert httpx.get(router.base_url + "/v1/stream", params={"conv_id": "conv-router-1"}).status_code == 404


def test_router_serves_the_chat_page(router):
    page = httpx.get(router.base_url + "/")
    assert page.status_code == 200 and "content-security-policy" in page.headers and b"webui/app.js" in page.content
    assert httpx.get(router.base_url + "/webui/app.js").status_code == 200
