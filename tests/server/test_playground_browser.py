"""The playground in a real headless browser (Debian's Chromium, driven by Playwright's library)
against the real server on the default model, started with an API key: a pasted text run under
two settings side by side, an over-long document's length error next to the document, a
cancelled column freeing the engine, and a 30k-token document typed into without freezing.
It shares test_server.py's server; ``scripts/install_browser.sh`` (run by ``make test``) installs Chromium."""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path

import httpx
import pytest

from tests.server.test_server import API_KEY, metric_value

CHROMIUM = shutil.which("chromium")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium here (scripts/install_browser.sh installs it)")
# what the machine's sandbox allows and needs (no network beyond loopback, root, no GPU)
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
SHORT_TEXT = ("The Eiffel Tower is in Paris. It was built for the 1889 World's Fair and is 330 metres tall. "
              "Paris is the capital of France. ") * 6


@pytest.fixture(scope="module")
def server(shared_server):
    """test_server.py's server (tests/server/conftest.py): a start saved."""
    return shared_server


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture
def page(browser, server):
    """The playground, connected with the API key (kept in the page's session storage)."""
    context = browser.new_context(viewport={"width": 1400, "height": 1000},
                                  permissions=["clipboard-read", "clipboard-write"])
    page = context.new_page()
    page.goto(server.base + "/")
    page.wait_for_selector("body[data-ready=true]")
    page.fill("#api-key", API_KEY)
    page.dispatch_event("#api-key", "change")
    page.wait_for_function("document.querySelector('#model-facts').textContent.includes('trained on')")
    yield page
    context.close()


def paste(page, text: str) -> int:
    """Paste ``text`` over the document as a person does (the clipboard, Ctrl+A, Ctrl+V) and wait
    for its count; returns the tokens. (Playwright's fill inserts through the editing commands,
    which take seconds on 100 kB; a real paste takes milliseconds.)"""
    page.evaluate("text => navigator.clipboard.writeText(text)", text)
    page.click("#doc")
    page.keyboard.press("Control+A")
    page.keyboard.press("Control+V")
    page.wait_for_function("([length, text]) => document.querySelector('#doc').value.length === length"
                           " && document.querySelector('#doc').value.endsWith(text)", arg=[len(text), text[-20:]])
    page.wait_for_function("document.querySelector('#doc-count').dataset.tokens !== undefined"
                           " && !document.querySelector('#doc-count').textContent.startsWith('counting')")
    return int(page.get_attribute("#doc-count", "data-tokens"))


def columns(page):
    return page.locator(".column")


def test_two_settings_stream_side_by_side_with_what_was_applied(page, server):
    tokens = paste(page, SHORT_TEXT)
    assert tokens > 100 and "inside the training length" in page.text_content("#doc-count")
    page.fill("#question", "Where is the Eiffel Tower?")
    page.fill("#max-tokens", "12")
    assert columns(page).count() == 2  # auto (the server's default) and rerope
    page.select_option(".column:nth-child(2) [name=method]", "self_extend")
    page.fill(".column:nth-child(2) [name=group]", "4")
    page.click("#run")
    page.wait_for_function("[...document.querySelectorAll('.column')].every(c => c.dataset.state === 'done')",
                           timeout=120_000)
    applied = [json.loads(columns(page).nth(i).locator(".applied").text_content()) for i in range(2)]
    assert applied[0] == {"method": "none"}  # auto inside the training length
    assert applied[1]["method"] == "self_extend" and applied[1]["group"] == 4
    for i in range(2):
        column = columns(page).nth(i)
        assert column.locator(".output").text_content().strip()
        stats = column.locator(".stats").text_content()
        assert re.search(r"first token \d+\.\d\d s · [\d.–]+ tokens/s · [\d,]+ prompt tokens · done", stats), stats
        assert int(re.search(r"([\d,]+) prompt tokens", stats)[1].replace(",", "")) > tokens


def test_an_overlong_document_shows_the_length_error_next_to_it(page):
    tokens = paste(page, "word " * 5000)
    assert tokens >= 4096 and "longer than the served maximum" in page.text_content("#doc-count")
    page.click("#run")
    error = page.locator(".document .field-error")
    error.wait_for(state="visible", timeout=60_000)
    assert "maximum context is 4096 tokens" in error.text_content()
    assert "invalid" in page.get_attribute("#doc", "class")
    assert "refused (400)" in columns(page).nth(0).locator(".stats").text_content()


def test_a_bad_setting_shows_its_error_in_its_column(page):
    paste(page, SHORT_TEXT)
    page.select_option(".column:nth-child(2) [name=method]", "rerope")
    page.fill(".column:nth-child(2) [name=window]", "100000")
    page.click("#run")
    error = columns(page).nth(1).locator(".field-error")
    error.wait_for(state="visible", timeout=60_000)
    assert "window" in error.text_content() and "train_length" in error.text_content()
    assert "invalid" in columns(page).nth(1).locator("[name=window]").get_attribute("class")


def test_cancelling_a_column_frees_the_engine(page, server):
    paste(page, SHORT_TEXT * 6)
    page.fill("#question", "Repeat the text above word for word, ten times.")  # a long answer, so still running
    page.fill("#max-tokens", "2000")
    page.click(".column:nth-child(2) .remove")
    page.click("#run")
    deadline = time.time() + 60
    while metric_value(server, "rope_extend_num_requests_running") < 1 and time.time() < deadline:
        time.sleep(0.2)
    assert metric_value(server, "rope_extend_num_requests_running") == 1
    page.click(".column .cancel")
    page.wait_for_function("document.querySelector('.column').dataset.state === 'cancelled'")
    deadline = time.time() + 30
    while metric_value(server, "rope_extend_num_requests_running") > 0 and time.time() < deadline:
        time.sleep(0.2)
    assert metric_value(server, "rope_extend_num_requests_running") == 0
    assert httpx.get(f"{server.base}/health").status_code == 200


FREEZE_MS = 500  # a main-thread task this long is felt as a freeze (the server shares the CPU here)


def test_a_30k_token_document_keeps_the_page_responsive(page):
    """Pasting, counting and typing into a 30k-token document: no task on the page's main thread
    long enough to be a freeze (the browser's long-task entries, each over 50 ms)."""
    page.evaluate("""() => { window.longTasks = [];
        new PerformanceObserver(list => window.longTasks.push(...list.getEntries().map(e => e.duration)))
            .observe({type: 'longtask'}); }""")
    text = Path(__file__).with_name("test_server.py").read_text()
    text = (text * (1 + 130_000 // len(text)))[:130_000]
    assert paste(page, text) > 30_000
    page.click("#doc")
    page.keyboard.press("Control+End")  # the end of the document, not of a line
    page.keyboard.type(" and a few more words typed at the end", delay=20)
    page.wait_for_timeout(2000)  # the count after the last key (debounced), and its rendering
    assert page.input_value("#doc").endswith("typed at the end")
    longest = max(page.evaluate("window.longTasks"), default=0)
    assert longest < FREEZE_MS, f"the page froze for {longest:.0f} ms"
