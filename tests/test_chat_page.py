"""The chat page of `llmcli serve`, driven in a real headless Chromium (Debian's, through Playwright).

Answers are forced by a grammar typed into the page's own settings (a model's words differ between CPUs). With
LLMCLI_SCREENSHOT=PATH the first test also writes the README's screenshot there.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import start_server, stop_server

playwright_api = pytest.importorskip("playwright.sync_api")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (.ci/run installs it)")
# As root on a closed network: no sandbox, and none of Chromium's own connections (they are refused here).
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]

ANSWER = ("# Plan\n\nStart with **the first** step, then the *second*.\n\n- one `item`\n- two items\n\n"
          "| step | cost |\n|---|---|\n| first | 3 |\n\n```sh\necho done\n```\n")
HOSTILE = ('<script>window.pwned = 1</script> <img src=x onerror="window.pwned = 2"> '
           '[click](javascript:window.pwned=3) <b>bold?</b>')


def forced(text: str) -> str:
    return 'root ::= "' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with playwright_api.sync_playwright() as driver:
        launched = driver.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        yield launched
        launched.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    proc, url = start_server(tmp_path_factory.mktemp("page"), "--temp", "0", "-P", "2")
    yield url
    stop_server(proc)


def open_page(browser: Any, url: str) -> Any:
    page = browser.new_context(viewport={"width": 1100, "height": 760}).new_page()
    page.add_init_script("window.violations = []; document.addEventListener('securitypolicyviolation', "
                         "(e) => window.violations.push(e.violatedDirective));")
    response = page.goto(url + "/")
    assert response.status == 200 and "script-src 'self'" in response.headers["content-security-policy"]
    return page


def use_grammar(page: Any, text: str, max_tokens: int | None = None) -> None:
    page.click("#settings summary")
    page.fill("#grammar", forced(text) if max_tokens is None else text)
    page.fill("#max_tokens", str(max_tokens or ""))
    page.click("#settings summary")


def send(page: Any, text: str) -> None:
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def wait_until(page: Any, condition: str, timeout: float = 60) -> None:
    """Until the JavaScript `condition` holds in the page (Playwright's wait_for_function evaluates its text in the
    page, which the page's policy forbids: this asks from outside, as page.evaluate does)."""
    deadline = time.monotonic() + timeout
    while not page.evaluate(condition):
        assert time.monotonic() < deadline, f"still not {condition}"
        time.sleep(0.05)


def last_answer(page: Any) -> Any:
    return page.locator("article.message.assistant").last


def kept(page: Any) -> list[dict[str, Any]]:
    """The conversations the page keeps in the browser."""
    return json.loads(page.evaluate("localStorage.getItem('llmcli.conversations')"))


def in_flight(url: str) -> int:
    with urllib.request.urlopen(url + "/health", timeout=10) as response:
        return sum(model["in_flight"] for model in json.load(response)["models"])


def test_the_page_streams_an_answer_and_stops_regenerates_edits_and_keeps_it(browser, server, tmp_path):
    page = open_page(browser, server)
    page.wait_for_selector("#model option", state="attached")
    asked = []
    page.on("request", lambda request: asked.append(request) if request.url.endswith("/v1/chat/completions") else None)
    use_grammar(page, ANSWER)
    # Every state the answer's element went through: streamed, it is seen in pieces before it is whole.
    page.evaluate("""() => { window.seen = new Set(); new MutationObserver(() => {
        const body = document.querySelector('article.message.assistant:last-of-type .body');
        if (body) window.seen.add(body.textContent); }).observe(document.getElementById('messages'),
        {childList: true, subtree: true, characterData: true}); }""")
    send(page, "Make a plan")
    answer = last_answer(page)
    answer.locator(".stats").wait_for()
    assert kept(page)[0]["messages"][1]["content"] == ANSWER
    assert answer.locator("h1").inner_text() == "Plan" and answer.locator("strong").inner_text() == "the first"
    assert answer.locator("li").all_inner_texts() == ["one item", "two items"]
    assert answer.locator("td").all_inner_texts() == ["first", "3"] and answer.locator("pre code").inner_text() == "echo done"
    assert len([text for text in page.evaluate("[...window.seen]") if text]) >= 3  # partial answers were shown
    stats = answer.locator(".stats").inner_text()
    assert "TTFT" in stats and "tok/s" in stats and "prompt tokens cached" in stats
    if os.environ.get("LLMCLI_SCREENSHOT"):
        page.screenshot(path=os.environ["LLMCLI_SCREENSHOT"])
    shot = tmp_path / "page.png"
    page.screenshot(path=str(shot))
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    answer.locator("button.regenerate").click()  # the same request again, the answer replaced
    wait_until(page, "document.querySelectorAll('article.message').length === 2 && "
                           "document.querySelector('article.message.assistant .stats')")
    assert len(asked) == 2 and kept(page)[0]["messages"][1]["content"] == ANSWER

    use_grammar(page, "A better plan.")  # (a short answer this time)
    page.locator("article.message.user button.edit").click()  # an edited question: what followed it goes
    page.fill("article.message.user textarea", "Make a better plan")
    page.locator("article.message.user button.save").click()
    wait_until(page, "document.querySelector('article.message.assistant .stats')")
    messages = kept(page)[0]["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant"] and messages[0]["content"] == "Make a better plan"
    assert messages[1]["content"] == "A better plan."  # the answer to the edited question replaced the old one

    # An answer that would go on for a long time: sampled words (greedy ones would loop, and the server's
    # repetition guard would end the answer before Stop does).
    use_grammar(page, 'root ::= [a-z]{2,8} " " root', max_tokens=3000)
    page.click("#settings summary")
    page.fill("#temperature", "1.5")
    page.click("#settings summary")
    send(page, "Sing")
    wait_until(page, "(document.querySelector('article.message.assistant:last-of-type .body') || "
                           "{textContent: ''}).textContent.length > 30")
    page.click("#stop")
    last_answer(page).locator(".stats").wait_for()
    assert page.locator("#send").is_visible() and not page.locator("#stop").is_visible()
    stopped = kept(page)[0]["messages"][-1]
    assert "stopped" in stopped["stats"] and 30 < len(stopped["content"]) < 3 * 3000
    assert "pieces/s" in stopped["stats"]  # a stopped answer has no server timings: its rate as the page saw it
    deadline = time.monotonic() + 10
    while in_flight(server) and time.monotonic() < deadline:  # the server let the cut answer go
        time.sleep(0.1)
    assert in_flight(server) == 0

    page.reload()  # conversations are kept in the browser
    page.wait_for_selector("article.message")
    assert page.locator("#conversations li").count() == 1 and page.locator("article.message").count() == 4
    assert page.evaluate("window.violations") == []
    page.context.close()


def test_a_phone_sized_screen_keeps_the_conversation_usable_and_headings_render(browser, server):
    """390 px wide (a phone): the conversations are a row above the chat, not a 240 px column; the message box and
    the conversation keep the width, settings open or not. Setext headings and a bare `##` are headings.
    LLMCLI_PHONE_SCREENSHOT=PATH writes what it looks like."""
    page = browser.new_context(viewport={"width": 390, "height": 844}).new_page()
    page.goto(server + "/")
    page.wait_for_selector("#model option", state="attached")
    use_grammar(page, "Title\n=====\n\nSub\n---\n\n##\n\nDone.\n")
    send(page, "Headings")
    answer = last_answer(page)
    answer.locator(".stats").wait_for()
    assert answer.locator("h1").inner_text() == "Title" and answer.locator("h2").first.inner_text() == "Sub"
    assert answer.locator("h2").count() == 2 and "=====" not in answer.inner_text() and "##" not in answer.inner_text()
    width = lambda selector: page.evaluate(f"document.querySelector('{selector}').getBoundingClientRect().width")  # noqa: E731
    assert width("#prompt") > 250 and width("#messages") > 350 and width("#sidebar") > 350  # a row, not a column
    if os.environ.get("LLMCLI_PHONE_SCREENSHOT"):
        page.screenshot(path=os.environ["LLMCLI_PHONE_SCREENSHOT"])
    page.click("#settings summary")
    assert width("#messages") > 350 and page.evaluate("document.documentElement.scrollWidth") <= 390
    page.context.close()


def test_a_finished_answer_s_tokens_show_their_candidates_when_clicked(browser, server):
    """Settings → Token candidates (issue 61): the page asks with llmcli's `trace` and reads the SSE comments every
    other client skips; a finished answer's tokens are buttons, and one clicked shows its candidates as the model
    scored them and as the sampler left them — text, never HTML — and the conversation keeps them."""
    page = open_page(browser, server)
    page.wait_for_selector("#model option", state="attached")
    page.click("#settings summary")
    page.check("#trace")
    page.fill("#grammar", forced("one two three four five six seven eight"))  # (6 tokens on any CPU)
    page.fill("#max_tokens", "6")
    page.click("#settings summary")
    send(page, "Say hi.")
    answer = last_answer(page)
    answer.locator(".stats").wait_for()
    tokens = answer.locator("button.token")
    assert tokens.count() == 6
    assert "".join(tokens.all_text_contents()).strip() == answer.locator(".body").inner_text().strip()
    tokens.nth(1).click()
    detail = answer.locator(".token-detail")
    assert detail.is_visible() and detail.locator("li").count() >= 1 and detail.locator("li.chosen").count() == 1
    assert "model" in detail.inner_text() and "→ sampler" in detail.inner_text()
    assert len(kept(page)[0]["messages"][-1]["tokens"]) == 6 and page.evaluate("window.violations") == []
    page.context.close()


def test_a_model_answer_with_html_runs_nothing(browser, server):
    page = open_page(browser, server)
    page.wait_for_selector("#model option", state="attached")
    use_grammar(page, HOSTILE)
    send(page, "Say something dangerous")
    answer = last_answer(page)
    answer.locator(".stats").wait_for()
    assert answer.locator(".body").inner_text().strip() == HOSTILE  # shown as written
    assert page.locator("#messages script, #messages img, #messages b, #messages a").count() == 0
    assert page.evaluate("window.pwned") is None and page.evaluate("window.violations") == []
    page.context.close()


def test_a_refused_request_shows_the_server_s_error_under_the_question(browser, server):
    page = open_page(browser, server)
    page.wait_for_selector("#model option", state="attached")
    use_grammar(page, "root ::= (", max_tokens=8)  # not a grammar: the server says why, with a 400
    send(page, "hi")
    error = last_answer(page).locator(".error")
    error.wait_for()
    assert "grammar" in error.inner_text().lower() and last_answer(page).locator(".stats").count() == 0
    assert page.locator("#send").is_visible()
    page.context.close()


def test_a_server_with_a_key_asks_for_it(browser, tmp_path):
    proc, url = start_server(tmp_path, "--temp", "0", "-P", "1", "--api-key", "sesame")
    try:
        page = open_page(browser, url)
        page.wait_for_selector("#key-dialog[open]")
        page.fill("#key", "wrong")
        page.click("#key-save")
        wait_until(page, "document.getElementById('key-error').textContent.length > 0")
        assert page.locator("#key-dialog").is_visible() and page.locator("#model option").count() == 0
        page.fill("#key", "sesame")
        page.click("#key-save")
        page.wait_for_selector("#model option", state="attached")
        use_grammar(page, "Open sesame.")
        send(page, "hi")
        last_answer(page).locator(".stats").wait_for()
        assert last_answer(page).locator(".body").inner_text().strip() == "Open sesame."
        page.context.close()
    finally:
        stop_server(proc)
    off, off_url = start_server(tmp_path, "-P", "1", "--no-webui")
    try:
        html = {"Accept": "text/html"}
        with urllib.request.urlopen(urllib.request.Request(off_url + "/", headers=html), timeout=10) as response:
            assert response.headers["content-type"].startswith("text/plain") and b"llmcli is running" in response.read()
        with pytest.raises(urllib.error.HTTPError) as missing:
            urllib.request.urlopen(off_url + "/ui/chat.js", timeout=10)
        missing.value.close()  # (an HTTPError holds the response's socket: a ResourceWarning in a later test)
        assert missing.value.code == 404
    finally:
        stop_server(off)


def test_a_client_that_is_not_a_browser_gets_one_line_at_the_root(server):
    with urllib.request.urlopen(server + "/", timeout=10) as response:
        assert response.read().startswith(b"llmcli is running")
    with pytest.raises(urllib.error.HTTPError) as missing:
        urllib.request.urlopen(server + "/ui/other.js", timeout=10)
    missing.value.close()
    assert missing.value.code == 404



def test_the_page_asks_about_an_attached_image(browser, seeing, tmp_path):
    """A picture picked (or pasted, or dropped) goes with the message as an image_url part; the conversation shows it."""
    from PIL import Image

    picture = tmp_path / "red.png"
    Image.new("RGB", (80, 60), (220, 30, 30)).save(picture)
    proc, url = start_server(tmp_path, "-m", str(seeing), "--temp", "0")
    try:
        page = open_page(browser, url)
        page.wait_for_selector("#model option", state="attached")
        sent = []
        page.on("request", lambda r: sent.append(r.post_data_json) if r.url.endswith("/v1/chat/completions") else None)
        use_grammar(page, "A red picture.")
        page.set_input_files("#image-file", str(picture))
        page.locator("#attachments img.thumb").wait_for()
        send(page, "What is this?")
        answer = last_answer(page)
        answer.locator(".stats").wait_for()
        assert "1 image" in answer.locator(".stats").inner_text()
        assert answer.locator(".body").inner_text() == "A red picture."
        assert page.locator("article.message.user img.thumb").count() == 1
        assert page.locator("#attachments img").count() == 0  # sent: no longer attached
        parts = sent[0]["messages"][-1]["content"]
        assert parts[0]["type"] == "image_url" and parts[0]["image_url"]["url"].startswith("data:image/png;base64,")
        assert parts[1] == {"type": "text", "text": "What is this?"}
        assert kept(page)[0]["messages"][0]["images"][0].startswith("data:image/png")
        assert page.evaluate("window.violations") == []
    finally:
        stop_server(proc)
