"""Images through /v1/chat/completions on vision-language checkpoints, as a client sends them.

One server (the tiny Qwen2-VL fixture, fp32, --media-path on a scratch directory, private
fetches allowed so a local HTTP server can stand in for a public one). The answer to a data:
image equals transformers' own greedy generate on the same picture and prompt; the same
picture named by file:// (relative and absolute) and by http:// gives the same answer; an
escape from the media root is refused; an image row and a text row sent together answer as
they do alone.

Every further family (tests/fixtures.VLM_TINY) is served by one router-mode server on
`--backend torch` over the fixtures' folder, one child per family: a data: image answers as
transformers' greedy generate does, the same picture by file:// under --media-path answers the
same, and an https URL to a non-public address is refused (private fetches stay off there).
"""

from __future__ import annotations

import base64
import io
import threading
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from PIL import Image

from tests.conftest import ServerProcess, fixture_path
from tests.fixtures import QWEN2_VL_TINY, VLM_TINY
from tests.vlm_reference import expected_chat_answer, picture

QUESTION = "What is in this picture?"
MAX_TOKENS = 8


def png(seed: int) -> bytes:
    buf = io.BytesIO()
    picture(seed).save(buf, "PNG")
    return buf.getvalue()


def data_url(seed: int) -> str:
    return "data:image/png;base64," + base64.b64encode(png(seed)).decode()


class _Quiet(SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def media_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("media").resolve()
    (root / "pics").mkdir()
    (root / "pics" / "cat.png").write_bytes(png(0))
    (root.parent / "outside.png").write_bytes(png(0))
    return root


@pytest.fixture(scope="module")
def http_root(media_root):
    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(_Quiet, directory=str(media_root)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture(scope="module")
def server(media_root):
    fixture_path(QWEN2_VL_TINY)
    s = ServerProcess(["-m", QWEN2_VL_TINY, "--offline", "--dtype", "float32", "--media-path", str(media_root)],
                      env={"MLXCEL_ALLOW_PRIVATE_MEDIA_URLS": "1"})
    yield s
    s.stop()


def ask(server, url: str | None, text: str = QUESTION, **extra):
    content = [{"type": "text", "text": text}]
    if url is not None:
        content.insert(0, {"type": "image_url", "image_url": {"url": url}})
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": MAX_TOKENS, "temperature": 0, **extra}
    return httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=120)


def answer(server, url, text=QUESTION):
    r = ask(server, url, text)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_a_data_image_answers_as_transformers_generate(server):
    import torch
    from transformers import AutoTokenizer, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    path = str(fixture_path(QWEN2_VL_TINY))
    tok = AutoTokenizer.from_pretrained(path)
    proc = Qwen2VLImageProcessorPil.from_pretrained(path)
    pixels = proc(images=[Image.open(io.BytesIO(png(0))).convert("RGB")], return_tensors="pt")
    n = int(pixels["image_grid_thw"][0].prod()) // 4
    prompt = tok.apply_chat_template([{"role": "user", "content": [{"type": "image"},
                                                                   {"type": "text", "text": QUESTION}]}],
                                     tokenize=False, add_generation_prompt=True)
    prompt = prompt.replace("<|image_pad|>", "<|image_pad|>" * n)
    ids = torch.tensor([tok.encode(prompt, add_special_tokens=False)])
    model = Qwen2VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=pixels["pixel_values"],
                             image_grid_thw=pixels["image_grid_thw"], mm_token_type_ids=(ids == 151655).int(),
                             max_new_tokens=MAX_TOKENS, do_sample=False)
    r = ask(server, data_url(0))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["message"]["content"] == tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert body["usage"]["prompt_tokens"] == ids.shape[1]
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # images skip the prompt cache
    assert answer(server, data_url(1)) != body["choices"][0]["message"]["content"]


def test_props_report_vision(server):
    assert httpx.get(server.base_url + "/props").json()["modalities"] == {"vision": True, "video": False,
                                                                          "audio": False}


def test_file_and_http_urls_read_the_same_picture(server, media_root, http_root):
    expected = answer(server, data_url(0))
    for url in ("file://pics/cat.png", f"file://{media_root}/pics/cat.png", "file:///pics/cat.png",
                f"{http_root}/pics/cat.png"):
        assert answer(server, url) == expected, url


@pytest.mark.parametrize("url, words", [
    ("file:///etc/passwd", "does not exist or cannot be opened under --media-path"),
    ("file://../outside.png", "'..' is not allowed"),
    ("file://pics/missing.png", "does not exist"),
    ("file://pics/%2e%2e/x.png", "percent-encoded"),
    ("data:image/png;base64,not-base64!", "not valid base64"),
    ("data:image/png;base64," + base64.b64encode(b"not an image").decode(), "could not be decoded"),
])
def test_bad_media_is_refused_with_a_reason(server, url, words):
    r = ask(server, url)
    assert r.status_code == 400 and words in r.json()["error"]["message"]


def test_other_media_and_a_spelled_placeholder_are_refused(server):
    body = {"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}]}
    r = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 501 and r.json()["error"]["message"].startswith("audio input is not supported")
    r = ask(server, data_url(0), text="<|image_pad|> twice")
    assert r.status_code == 400 and "placeholder" in r.json()["error"]["message"]


def test_an_image_row_and_a_text_row_batch_as_they_answer_alone(server):
    alone = (answer(server, data_url(2)), answer(server, None, "Name a colour."))
    with ThreadPoolExecutor(2) as pool:
        together = tuple(pool.map(lambda a: answer(server, *a), [(data_url(2), QUESTION), (None, "Name a colour.")]))
    assert together == alone


def test_streamed_image_answer_equals_the_whole(server):
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(0)}},
                                                      {"type": "text", "text": QUESTION}]}],
            "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}) as r:
        import json

        text = "".join(json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                       for line in r.iter_lines() if line.startswith("data: {") and '"choices":[{' in line)
    assert text == answer(server, data_url(0))


def test_responses_and_messages_routes_take_the_same_picture(server):
    expected = answer(server, data_url(0))
    r = httpx.post(server.base_url + "/v1/responses", timeout=120, json={
        "input": [{"role": "user", "content": [{"type": "input_image", "image_url": data_url(0)},
                                               {"type": "input_text", "text": QUESTION}]}],
        "max_output_tokens": MAX_TOKENS, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["output"][0]["content"][0]["text"] == expected
    r = httpx.post(server.base_url + "/v1/messages", timeout=120, json={
        "max_tokens": MAX_TOKENS, "temperature": 0,
        "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(png(0)).decode()}},
            {"type": "text", "text": QUESTION}]}]})
    assert r.status_code == 200, r.text
    assert r.json()["content"][0]["text"] == expected


# ---- the further families, one router-mode server ----------------------------------------------

FAMILIES = sorted(set(VLM_TINY) - {"qwen2_vl"})


@pytest.fixture(scope="module")
def router(media_root, tmp_path_factory):
    folder = fixture_path(VLM_TINY["llava"]).parent
    s = ServerProcess(["--models-dir", str(folder), "--models-max", str(len(FAMILIES)), "--backend", "torch",
                       "--dtype", "float32", "--media-path", str(media_root), "--offline"],
                      env={"MLXCEL_MODELS_DIR": str(tmp_path_factory.mktemp("empty-store"))})
    yield s
    s.stop()


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_answers_a_data_image_as_transformers_and_reads_file_urls(router, family):
    path = fixture_path(VLM_TINY[family])
    want, prompt_tokens = expected_chat_answer(path, picture(0), QUESTION, MAX_TOKENS)
    r = ask(router, data_url(0), model=path.name)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == want
    assert r.json()["usage"]["prompt_tokens"] == prompt_tokens
    assert answer_of(ask(router, "file://pics/cat.png", model=path.name)) == want
    r = ask(router, "https://127.0.0.1/pics/cat.png", model=path.name)
    assert r.status_code == 400 and "non-public address" in r.json()["error"]["message"]


def answer_of(r) -> str:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


# ---- native multimodal_data, and hostile images in every route that takes images ---------------

NATIVE_PROMPT = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n<__media__>"
                 f"{QUESTION}<|im_end|>\n<|im_start|>assistant\n")


def test_native_completion_takes_multimodal_data_as_chat_takes_the_image(server):
    r = httpx.post(server.base_url + "/completion", timeout=120, json={
        "prompt": {"prompt_string": NATIVE_PROMPT, "multimodal_data": [base64.b64encode(png(0)).decode()]},
        "n_predict": MAX_TOKENS, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["content"] == answer(server, data_url(0))
    r = httpx.post(server.base_url + "/completion", timeout=60, json={
        "prompt": {"prompt_string": NATIVE_PROMPT + "<__media__>",
                   "multimodal_data": [base64.b64encode(png(0)).decode()]},
        "n_predict": 1})
    assert r.status_code == 400 and "2 media marker(s)" in r.json()["error"]["message"]
    r = httpx.post(server.base_url + "/completion", timeout=60, json={
        "prompt": {"prompt_string": ["<__media__>"], "multimodal_data": [base64.b64encode(png(0)).decode()]},
        "n_predict": 1})
    assert r.status_code == 400 and "prompt_string must be a string" in r.json()["error"]["message"], r.text


def test_an_image_the_processor_cannot_resize_is_a_400(server):
    from tests.hostile_images import extreme_aspect_png

    path, body = _route_request("/v1/chat/completions", extreme_aspect_png())
    r = httpx.post(server.base_url + path, json=body, timeout=60)
    assert r.status_code == 400 and "aspect ratio" in _error_message(path, r.json()), r.text


def _route_request(route: str, payload: bytes) -> tuple[str, dict]:
    b64 = base64.b64encode(payload).decode()
    url = "data:image/png;base64," + b64
    if route == "/v1/chat/completions":
        return route, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}],
                       "max_tokens": 1}
    if route == "/v1/responses":
        return route, {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": url}]}],
                       "max_output_tokens": 1}
    if route == "/v1/messages":
        return route, {"max_tokens": 1, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64}}]}]}
    return route, {"prompt": {"prompt_string": "<__media__>hi", "multimodal_data": [b64]}, "n_predict": 1}


def _error_message(route: str, body: dict) -> str:
    """The refusal in the route's own error shape."""
    if route == "/v1/messages":
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    elif route == "/completion":
        assert body["error"]["code"] == 400 and body["error"]["type"] == "invalid_request_error"
    else:
        assert body["error"]["type"] == "invalid_request_error"
    return body["error"]["message"]


@pytest.mark.parametrize("case", ["png-bomb", "gif-frames-bomb", "truncated", "text-as-png"])
@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/responses", "/v1/messages", "/completion"])
def test_a_hostile_image_is_a_typed_400_in_each_routes_format(server, route, case):
    from tests.hostile_images import HOSTILE

    build, words = HOSTILE[case]
    path, body = _route_request(route, build())
    r = httpx.post(server.base_url + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert words in _error_message(route, r.json())
