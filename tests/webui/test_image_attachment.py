"""An image attached in the chat page goes to the vision-language fixture as a data URL, and the
page offers attachments only because /props says the model takes images."""

from __future__ import annotations

import json

import pytest
from PIL import Image

from tests.conftest import ServerProcess, fixture_path
from tests.fixtures import QWEN2_VL_TINY
from tests.webui.conftest import CHROMIUM


@pytest.fixture(scope="module")
def server():
    if CHROMIUM is None:
        pytest.skip("no system Chromium: apt-get install chromium (.ci/run does)")
    fixture_path(QWEN2_VL_TINY)
    s = ServerProcess(["-m", QWEN2_VL_TINY, "--offline", "--dtype", "float32"])
    yield s
    s.stop()


def test_image_is_sent_as_a_data_url(page, tmp_path):
    picture = tmp_path / "red.png"
    Image.new("RGB", (32, 32), (220, 20, 20)).save(picture)
    bodies = []
    page.on("request", lambda r: bodies.append(json.loads(r.post_data)) if r.url.endswith("/v1/chat/completions")
            else None)
    assert page.is_visible("#attach-label") and page.get_attribute("#attach", "accept") == "image/*"
    page.set_input_files("#attach", str(picture))
    page.wait_for_selector("#attachments .chip")
    page.click("#toggle-settings")
    page.fill("#s-max_tokens", "4")
    page.fill("#prompt", "What colour is this?")
    page.press("#prompt", "Enter")
    page.wait_for_selector(".msg.assistant .stats")
    content = bodies[0]["messages"][-1]["content"]
    assert content[0] == {"type": "text", "text": "What colour is this?"}
    assert content[1]["type"] == "image_url" and content[1]["image_url"]["url"].startswith("data:image/png;base64,")
    assert page.locator(".msg.user img.attachment").count() == 1
    assert page.locator(".msg.assistant .status.error").count() == 0 and not page.errors
