"""The chat page's routes in the app the server builds (no model, no browser): the page and its
files with their policy, public behind --api-key, under --api-prefix, off with --no-ui, and a
--path directory served in its place without leaving it."""

from __future__ import annotations

import asyncio
import re

import httpx
import pytest

from mlxcel.api.app import build_app
from mlxcel.api.state import AppState
from mlxcel.api.webui.routes import CSP, STATIC, builtin_assets
from mlxcel.cli.flags import parse_server_args
from mlxcel.config.refusal import StartupRefusal

NOT_FOUND = {"error": {"message": "File Not Found", "type": "not_found_error", "code": 404}}


def get(argv: list[str], *paths: str, **headers: str) -> list[httpx.Response]:
    app = build_app(AppState(settings=parse_server_args(argv, {})))

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return [await c.get(p, headers=headers) for p in paths]

    return asyncio.run(go())


def test_page_is_served_with_its_policy():
    root, index, js, css = get(["--api-key", "k"], "/", "/index.html", "/webui/app.js", "/webui/app.css")
    assert root.status_code == index.status_code == 200 and root.content == index.content
    assert root.headers["content-type"] == "text/html; charset=utf-8" and b'src="webui/app.js"' in root.content
    assert root.headers["content-security-policy"] == CSP and "unsafe" not in CSP
    assert js.status_code == 200 and js.headers["content-type"].startswith("text/javascript")
    assert css.headers["content-type"].startswith("text/css")
    assert {"/webui/app.js", "/webui/md.js", "/webui/steer.js"} <= builtin_assets()
    # the page's files are public, nothing else is
    for path in ("/webui/missing.js", "/webui/../v1/models", "/v1/models", "/webui/"):
        assert get(["--api-key", "k"], path)[0].status_code == 401, path
    # a name too long for the filesystem names no file: the app's 404, never a 500
    assert [r.status_code for r in get([], "/webui/" + "a" * 300, "/" + "b" * 5000)] == [404, 404]


def test_page_under_api_prefix(tmp_path):
    page, js, bare = get(["--api-prefix", "/api"], "/api/", "/api/webui/app.js", "/")
    assert page.status_code == 200 and js.status_code == 200
    assert (bare.status_code, bare.json()) == (404, NOT_FOUND)
    # behind a key the prefixed page and its files are public (it asks for the key itself), the
    # prefixed API and /health are not (b10621 matches its public set as sent), nor is --path's page
    paths = ("/api/", "/api/index.html", "/api/webui/app.js", "/api/health", "/api/v1/models", "/")
    page, index, asset, health, models, bare = get(["--api-prefix", "/api", "--api-key", "k"], *paths)
    assert (page.status_code, index.status_code, asset.status_code) == (200, 200, 200)
    assert page.headers["content-security-policy"] == CSP and page.content == index.content
    assert (health.status_code, models.status_code, bare.status_code) == (401, 401, 404)
    (tmp_path / "index.html").write_text("<p>site</p>")
    site = get(["--api-prefix", "/api", "--api-key", "k", "--path", str(tmp_path)], "/api/")[0]
    assert site.status_code == 401


def test_no_ui_and_path_flags(tmp_path):
    for argv in (["--no-ui"], ["--no-webui"]):
        root, js = get(argv, "/", "/webui/app.js")
        assert root.status_code == js.status_code == 404
        assert js.status_code == 404
    site = tmp_path / "site"
    (site / "sub").mkdir(parents=True)
    (site / "index.html").write_text("<p>mine</p>")
    (site / "sub" / "a.txt").write_text("hello")
    (tmp_path / "secret.txt").write_text("outside")
    (site / "link.txt").symlink_to(tmp_path / "secret.txt")
    root, index, sub, builtin, link, up = get(["--path", str(site)], "/", "/index.html", "/sub/a.txt",
                                              "/webui/app.js", "/link.txt", "/../secret.txt")
    assert root.text == index.text == "<p>mine</p>" and "content-security-policy" not in root.headers
    assert sub.text == "hello" and sub.headers["x-content-type-options"] == "nosniff"
    assert builtin.status_code == link.status_code == up.status_code == 404
    assert get([], "/v1/models")[0].status_code == 200  # the API behind the page is untouched
    with pytest.raises(StartupRefusal, match="not a directory"):
        parse_server_args(["--path", str(tmp_path / "nope")], {})


def test_page_sources_never_turn_text_into_markup():
    # the policy forbids inline script and eval; the sources must not need them, and no model
    # text may reach an HTML parser (md.js builds nodes from text)
    for script in STATIC.glob("*.js"):
        source = script.read_text()
        for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function",
                     "setAttribute('style'", "DOMParser"):
            assert sink not in source, f"{script.name} uses {sink}"
    page = (STATIC / "index.html").read_text()
    assert not re.search(r"<script(?![^>]*\bsrc=)", page) and not re.search(r"\son\w+=|\sstyle=", page)
    assert "http://" not in page and "https://" not in page  # nothing from elsewhere
