"""The chat page of a router-mode server (--models-dir over two tiny checkpoints) under
--api-prefix behind --api-key, in headless Chromium: the page and its files load under the
prefix, the picker lists every model with its load state, and a message sent with the second
model picked names it in the request and gets its answer."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.conftest import ServerProcess, fixture_path
from tests.fixtures import JSON_TOOLS_TINY, LLAMA3_TOOLS_TINY
from tests.webui.conftest import CHROMIUM, KEY

PREFIX = "/mlx"
NAMES = [ref.split("/")[1] for ref in (JSON_TOOLS_TINY, LLAMA3_TOOLS_TINY)]


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    if CHROMIUM is None:
        pytest.skip("no system Chromium: apt-get install chromium (.ci/run does)")
    tmp = tmp_path_factory.mktemp("webui-router")
    mdir, store = tmp / "models", tmp / "store"  # an empty model store: the directory's models only
    mdir.mkdir()
    store.mkdir()
    for ref in (JSON_TOOLS_TINY, LLAMA3_TOOLS_TINY):
        shutil.copytree(fixture_path(ref), mdir / ref.split("/")[1])
    # the prefixed page is public, the prefixed /health is not (b10621 matches it as sent)
    s = ServerProcess(["--models-dir", str(mdir), "--backend", "torch", "--api-prefix", PREFIX, "--api-key", KEY,
                       "--model-store-root", str(store), "-c", "512"], health_path=PREFIX + "/")
    yield s
    s.stop()


def test_picker_lists_the_models_and_the_pick_goes_out(browser, router):
    storage = {"cookies": [], "origins": [{"origin": router.base_url,
                                           "localStorage": [{"name": "mlxcel.apiKey", "value": KEY}]}]}
    context = browser.new_context(storage_state=storage)
    try:
        page = context.new_page()
        errors, bodies, refused = [], [], []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("request", lambda r: bodies.append(json.loads(r.post_data))
                if r.url.endswith(PREFIX + "/v1/chat/completions") else None)
        page.on("response", lambda r: refused.append(r.url) if r.status == 401 else None)
        page.goto(router.base_url + PREFIX + "/")
        page.wait_for_selector("body.ready")
        options = page.locator("#model-picker option")
        assert page.is_visible("#model-picker")
        assert options.all_inner_texts() == [f"{n} (unloaded)" for n in NAMES]
        page.select_option("#model-picker", NAMES[1])
        page.click("#toggle-settings")
        page.fill("#s-max_tokens", "8")
        page.fill("#s-grammar", 'root ::= "routed"')
        page.fill("#prompt", "Hello.")
        page.press("#prompt", "Enter")
        page.wait_for_selector(".msg.assistant:last-child .stats", timeout=180_000)
        assert bodies[0]["model"] == NAMES[1]
        assert page.locator(".msg.assistant .body").last.inner_text().strip() == "routed"
        page.reload()  # the load state is read again from /models
        page.wait_for_selector("body.ready")
        # the second one answered, so it is loaded (the first may be too: the page read its /props)
        assert options.all_inner_texts()[1] == f"{NAMES[1]} (loaded)"
        assert page.input_value("#model-picker") == NAMES[1]  # the pick is kept
        assert refused == [] and not errors
    finally:
        context.close()
