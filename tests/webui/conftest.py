"""The chat page's browser tests: one real server (the default model, an API key, the random
SAE attached) and one headless Chromium for the module, driven by Playwright.

Playwright is pointed at the system's Chromium (Debian's `chromium`, which .ci/run installs):
`playwright install` downloads browsers from a CDN. Without it the browser tests skip.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest

from tests.conftest import ServerProcess, fixture_path
from tests.fixtures import DEFAULT_MODEL, SAE_RANDOM, sae_available
from tests.fixtures import fixture_path as store_path

KEY = "webui-test-key"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if CHROMIUM is None:
        pytest.skip("no system Chromium: apt-get install chromium (.ci/run does)")
    fixture_path(DEFAULT_MODEL)
    assert sae_available(SAE_RANDOM), f"fixture {SAE_RANDOM} is missing: run `make fixtures`"
    sae = store_path(SAE_RANDOM)
    state = tmp_path_factory.mktemp("webui-state")
    s = ServerProcess(["-m", DEFAULT_MODEL, "--offline", "-c", "2048", "--api-key", KEY, "--state-dir", str(state)],
                      env={"MLXCEL_SAE_DIR": str(sae.parent)})
    r = httpx.post(s.base_url + "/api/saes/attach", json={"path": str(sae)},
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == 201, r.text
    s.sae_id = r.json()["data"]["sae_id"]
    r = httpx.post(s.base_url + "/api/profiles", json={"name": "bright", "sae_id": s.sae_id, "steering": {"5": 4}},
                   headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 201, r.text
    yield s
    s.stop()


@pytest.fixture(scope="module")
def browser():
    if CHROMIUM is None:
        pytest.skip("no system Chromium: apt-get install chromium (.ci/run does)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()


@pytest.fixture
def page(browser, server):
    """A fresh browser profile holding the API key, the page loaded."""
    storage = {"cookies": [], "origins": [{"origin": server.base_url,
                                           "localStorage": [{"name": "mlxcel.apiKey", "value": KEY}]}]}
    context = browser.new_context(storage_state=storage)
    pg = context.new_page()
    pg.errors = []
    pg.on("pageerror", lambda e: pg.errors.append(str(e)))
    pg.goto(server.base_url + "/")
    pg.wait_for_selector("body.ready")
    yield pg
    context.close()


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("webui-artifacts")
