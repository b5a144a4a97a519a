"""The chat page at / in headless Chromium against the real server: the key prompt, a streamed
answer, stop, regenerate, settings and a steering dial carried in the requests, the heat map,
an answer full of markup rendered inert, and a screenshot kept as an artifact."""

from __future__ import annotations

import json

import httpx

from tests.webui.conftest import KEY

CHAT = "/v1/chat/completions"


def chat_bodies(page) -> list[dict]:
    """Records the JSON body of every chat request the page sends from now on."""
    bodies: list[dict] = []
    page.on("request", lambda r: bodies.append(json.loads(r.post_data)) if r.url.endswith(CHAT) else None)
    return bodies


def settings(page, **values: str) -> None:
    if page.is_hidden("#settings"):
        page.click("#toggle-settings")
    for name, value in values.items():
        page.fill(f"#s-{name}", value)


def ask(page, text: str) -> None:
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def answer(page):
    """The last assistant message, once its answer is complete."""
    page.wait_for_selector(".msg.assistant:last-child .stats")
    return page.locator(".msg.assistant").last


def test_page_and_its_files_are_served_with_a_strict_policy(server):
    r = httpx.get(server.base_url + "/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    csp = r.headers["content-security-policy"]
    assert "default-src 'self'" in csp and "script-src 'self';" in csp and "unsafe" not in csp
    assert "frame-ancestors 'none'" in csp and r.headers["x-content-type-options"] == "nosniff"
    # the page's files are public like /, the API is not
    assert httpx.get(server.base_url + "/webui/app.js").headers["content-type"].startswith("text/javascript")
    assert httpx.get(server.base_url + "/webui/nope.js").status_code == 401
    assert httpx.get(server.base_url + "/v1/models").status_code == 401


def test_api_key_is_asked_once_and_kept(browser, server):
    context = browser.new_context()
    try:
        page = context.new_page()
        seen = []
        page.on("request", lambda r: seen.append(r.headers.get("authorization")) if r.url.endswith("/models") else None)
        page.goto(server.base_url + "/")
        page.wait_for_selector("#key-dialog[open]")
        page.fill("#key-input", KEY)
        page.click("#key-ok")
        page.wait_for_selector("body.ready")
        assert page.inner_text("#model-name").endswith("SmolLM2-135M-Instruct")
        assert page.evaluate("localStorage.getItem('mlxcel.apiKey')") == KEY
        assert seen == [None, f"Bearer {KEY}"]  # refused once, then retried with the key
        page.reload()
        page.wait_for_selector("body.ready")
        assert not page.is_visible("#key-dialog")
    finally:
        context.close()


def test_streamed_answer_carries_the_settings_then_regenerate(page):
    bodies = chat_bodies(page)
    streamed = []
    page.on("response", lambda r: streamed.append(r.headers["content-type"]) if r.url.endswith(CHAT) else None)
    settings(page, temperature="0.35", max_tokens="8", seed="7", system="Answer briefly.")
    ask(page, "Name a fruit.")
    first = answer(page).locator(".body").inner_text()
    assert first.strip() and streamed[0].startswith("text/event-stream")
    assert "tokens" in answer(page).locator(".stats").inner_text()
    sent = bodies[0]
    assert (sent["temperature"], sent["max_tokens"], sent["seed"], sent["stream"]) == (0.35, 8, 7, True)
    assert sent["messages"] == [{"role": "system", "content": "Answer briefly."},
                                {"role": "user", "content": "Name a fruit."}]
    with page.expect_response(lambda r: r.url.endswith(CHAT)):
        page.click(".msg.assistant .regenerate")
    page.wait_for_selector("#stop", state="hidden")
    answer(page)
    assert len(bodies) == 2 and bodies[1]["messages"] == sent["messages"]
    assert page.locator(".msg").count() == 2
    # the conversation is kept in the browser, named after its first message
    stored = page.evaluate("JSON.parse(localStorage.getItem('mlxcel.conversations'))")
    assert stored[0]["title"] == "Name a fruit." and len(stored[0]["messages"]) == 2


def test_stop_ends_the_stream_mid_answer(page):
    bodies = chat_bodies(page)
    settings(page, max_tokens="400", extra='{"ignore_eos": true}')
    ask(page, "Write a long story about a dragon.")
    page.wait_for_selector(".msg.assistant .body > *")  # the first words are on the page
    page.click("#stop")
    page.wait_for_selector(".msg.assistant .status:text('stopped')")
    assert page.is_visible("#send") and page.is_hidden("#stop")
    assert bodies[0]["ignore_eos"] is True
    assert page.locator(".msg.assistant .stats").count() == 0  # the final chunk never came


def test_steering_dial_goes_out_with_the_next_message_and_the_heat_map(page, server, artifacts):
    bodies = chat_bodies(page)
    profiles = []
    page.on("request", lambda r: profiles.append(json.loads(r.post_data)) if "/api/profiles" in r.url
            and r.method in ("PUT", "POST") else None)
    settings(page, max_tokens="6")
    page.click("#toggle-steering")
    page.fill("#feature-search", "3")
    page.click("#feature-results button")
    page.fill("#dials li[data-feature='3'] .dial-value", "6.5")
    page.press("#dials li[data-feature='3'] .dial-value", "Enter")
    ask(page, "Name a colour.")
    msg = answer(page)
    sent = bodies[0]
    assert sent["profile"] == "webui-dials"
    assert sent["return_sae_activations"] == {"sae_id": server.sae_id, "top_k": 5, "positions": "completion"}
    assert profiles and profiles[-1]["steering"] == {"3": 6.5} and profiles[-1]["sae_id"] == server.sae_id
    page.wait_for_selector(".heatmap .tok")
    tokens = msg.locator(".heatmap .tok")
    assert tokens.count() >= 1
    tokens.first.click()
    assert msg.locator(".heatmap .features li").count() == 5
    # a feature is found by the token it fired on most
    word = next(t.strip() for t in tokens.all_inner_texts() if t.strip())
    page.fill("#feature-search", word)
    assert page.locator("#feature-results li").count() >= 1
    path = artifacts / "chat-page.png"
    page.screenshot(path=str(path), full_page=True)
    print(f"chat page screenshot: {path}")
    assert path.stat().st_size > 0 and not page.errors


def test_markup_in_an_answer_stays_text(page):
    # a grammar forces an answer made of markup; none of it may become an element or run
    evil = '<img src=x onerror="document.title=1"><script>document.title=2</script> [go](javascript:document.title=3)'
    settings(page, max_tokens="80", grammar='root ::= "' + evil.replace('"', '\\"') + '"')
    ask(page, "Say something.")
    body = answer(page).locator(".body")
    assert "<script>document.title=2</script>" in body.inner_text()
    assert body.locator("img, script, a").count() == 0
    assert page.title() == "mlxcel" and not page.errors
    # the renderer itself: code, emphasis, safe links only
    html = page.evaluate("""async () => {
        const md = await import('./webui/md.js');
        const d = md.renderMarkdown('**b** *i* `c` [ok](https://x.test/) [no](javascript:x)\\n\\n```py\\ndef f(): pass\\n```\\n- one');
        return d.innerHTML; }""")
    assert "<strong>b</strong>" in html and "<em>i</em>" in html and "<code>c</code>" in html
    assert 'href="https://x.test/"' in html and "javascript" in html and html.count("<a ") == 1
    assert '<span class="tok-k">def</span>' in html and "<li>one</li>" in html


def test_saved_profile_and_intensity_from_the_menu(page):
    bodies = chat_bodies(page)
    settings(page, max_tokens="2")
    page.click("#toggle-steering")
    page.select_option("#profile", "bright")
    page.fill("#intensity", "1.5")
    page.uncheck("#show-activations")
    ask(page, "Hi.")
    answer(page)
    assert bodies[0]["profile"] == "bright" and bodies[0]["steering_intensity"] == 1.5
    assert "return_sae_activations" not in bodies[0]


def test_conversations_renamed_exported_and_deleted(page):
    page.click("#new-chat")  # the page opened with one empty conversation
    assert page.locator("#conversations li").count() == 2
    page.click("#conversations li >> nth=0 >> .rename")
    page.fill("#rename-input", "Kept")
    page.click("#rename-ok")
    assert page.inner_text("#conversations li >> nth=0 >> .title") == "Kept"
    with page.expect_download() as download:
        page.click("#export")
    exported = json.loads(open(download.value.path()).read())
    assert [c["title"] for c in exported] == ["Kept", "New chat"]
    page.click("#conversations li >> nth=0 >> .delete")
    assert page.locator("#conversations li .title").all_inner_texts() == ["New chat"]
    stored = page.evaluate("JSON.parse(localStorage.getItem('mlxcel.conversations'))")
    assert [c["title"] for c in stored] == ["New chat"]


def test_json_schema_constrains_the_streamed_answer_and_a_bad_one_is_caught(page):
    bodies = chat_bodies(page)
    settings(page, max_tokens="40", json_schema="{not json")
    ask(page, "Give me JSON.")
    page.wait_for_selector("#error:has-text('JSON schema is not valid JSON')")
    # nothing was sent and the message is back in the composer
    assert bodies == [] and page.locator(".msg").count() == 0 and page.input_value("#prompt") == "Give me JSON."
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    settings(page, json_schema=json.dumps(schema))
    page.click("#send")
    text = answer(page).locator(".body").inner_text()
    assert bodies[-1]["json_schema"] == schema and page.locator(".msg.user").count() == 1
    if "finish: stop" in answer(page).locator(".stats").inner_text():
        assert isinstance(json.loads(text)["n"], int)


def test_reasoning_is_collapsed_and_tool_calls_are_shown(page):
    shown = page.evaluate("""async () => {
        const chat = await import('./webui/chat.js');
        const view = chat.messageView({role: 'assistant', content: 'done', reasoning: 'because <b>x</b>',
            tool_calls: [{id: 'c1', type: 'function', function: {name: 'get_weather', arguments: '{"city":"Oslo"}'}}]}, 1, false);
        const reasoning = view.querySelector('details.reasoning');
        return {open: reasoning.open, reasoning: reasoning.textContent, bold: view.querySelectorAll('b').length,
                tool: view.querySelector('details.tool-call').textContent};
    }""")
    assert shown["open"] is False and "because <b>x</b>" in shown["reasoning"] and shown["bold"] == 0
    assert "get_weather" in shown["tool"] and '{"city":"Oslo"}' in shown["tool"]


def forced(page, text: str, max_tokens: str = "200"):
    """The rendered answer to a message whose reply a grammar fixes to `text`."""
    literal = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    settings(page, max_tokens=max_tokens, grammar=f'root ::= "{literal}"')
    ask(page, "Say it.")
    return answer(page).locator(".body")


def test_math_is_mathml_and_markup_in_it_stays_text(page):
    body = forced(page, "Inline $\\frac{a}{b}$ and \\(x^2 \\le \\alpha\\).\n\n"
                        "$$\\sum_{n=1}^{\\infty} \\frac{1}{n^2} = \\text{ok}$$\n\n"
                        "$x<script>document.title=4</script>$ then $\\bogus{1}$\n")
    assert body.locator("math").count() == 4  # \bogus is outside the subset: shown as its source
    assert body.locator("math[display=block] munderover mo").first.text_content() == "∑"
    assert body.locator("math mfrac").count() == 2 and body.locator("math msup").count() == 2
    assert body.locator("math mo").all_text_contents().count("≤") == 1
    assert body.locator("math mi").all_text_contents().count("α") == 1
    assert body.locator("math mtext").text_content() == "ok"
    assert body.locator("code.math").inner_text() == "\\bogus{1}"
    assert body.locator("script").count() == 0 and page.title() == "mlxcel" and not page.errors


def test_pipe_table(page):
    body = forced(page, "| name | n |\n|:--|--:|\n| `a\\|b` | $\\pi$ |\n| c |\n")
    assert body.locator("table th").all_inner_texts() == ["name", "n"]
    assert body.locator("table tbody tr").count() == 2
    cells = body.locator("table td")
    assert [cells.nth(k).inner_text() for k in (0, 2, 3)] == ["a|b", "c", ""]  # a short row is padded
    assert cells.nth(1).locator("math mi").text_content() == "π"
    assert "align-right" in cells.nth(1).get_attribute("class")
    assert cells.nth(0).locator("code").count() == 1
