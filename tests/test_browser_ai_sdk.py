"""A page on ``@ai-sdk/react``'s ``useChat`` in Chromium, against the gateway's AI SDK transport.

The page (``tests/js/use-chat-page.jsx``: React, ``@ai-sdk/react`` and ``ai`` from
``tests/js/node_modules``, pinned in ``tests/js/package.json``) is bundled with esbuild once
per session into a temp dir and served by a tiny static server on an origin of its own, which
the gateway allows (``GATEWAY_ALLOWED_ORIGINS``): the page talks to ``/v1/ai-sdk/chat`` across
origins, preflights included, as the README's example does. Its first render is the chat's
``/messages``, then ``useChat``'s ``resume: true`` picks up the answer still running.

An in-process agent streams a long answer word by word and holds it halfway until the test
has reloaded the page, so the reload is always mid-answer. Needs ``npm install`` in tests/js
(``scripts/test`` does it), Debian's Chromium and Playwright (see tests/test_browser.py).
"""

from __future__ import annotations

import asyncio
import functools
import http.server
import re
import subprocess
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.sdk.agent import Turn

from .conftest import GatewayProcess, free_port
from .test_browser import CHROMIUM, CHROMIUM_ARGS, TURN, expect, running_agents

pytestmark = pytest.mark.browser

JS = Path(__file__).resolve().parent / "js"
ESBUILD = JS / "node_modules" / ".bin" / "esbuild"

WORDS = 60
HELD = 20  # the agent holds its answer after this many words, until the test lets it go
ANSWER = "".join(f"w{i} " for i in range(WORDS))
SHOWN = "".join(f"w{i} " for i in range(HELD))  # what the page shows when it reloads

# Every text the answer shows, as it changes: each must be a prefix of the answer (never a
# part of it twice, not even for a moment). Installed before the page's own scripts, on
# every load.
RECORD_ANSWERS = """
window.__answers = [];
new MutationObserver(() => {
  const shown = [...document.querySelectorAll('[data-testid=message][data-role=assistant]')]
    .map((el) => el.textContent);
  const last = window.__answers.at(-1);
  if (JSON.stringify(shown) !== JSON.stringify(last)) window.__answers.push(shown);
}).observe(document, { subtree: true, childList: true, characterData: true });
"""


def held_answer(gate: threading.Event) -> Any:
    """Streams ANSWER a word every 20 ms, waiting for ``gate`` after HELD words."""
    async def handle(turn: Turn) -> None:
        for i in range(WORDS):
            if i == HELD:
                await asyncio.get_running_loop().run_in_executor(None, gate.wait, TURN / 1000)
            await turn.delta(f"w{i} ")
            if await turn.sleep(0.02):
                break
        await turn.message()
        await turn.end(usage={"output_tokens": WORDS})
    return handle


# --- fixtures ---------------------------------------------------------------------------


@pytest.fixture(scope="session")
def use_chat_page(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The page, bundled: a directory with index.html and app.js."""
    if not ESBUILD.exists():
        pytest.fail("tests/js needs `npm install` (scripts/test does it): esbuild, react, "
                    "react-dom, @ai-sdk/react and ai", pytrace=False)
    out = tmp_path_factory.mktemp("use-chat-page")
    built = subprocess.run(
        [str(ESBUILD), "use-chat-page.jsx", "--bundle", "--format=esm", "--jsx=automatic",
         "--define:process.env.NODE_ENV=\"production\"", f"--outfile={out / 'app.js'}",
         "--log-level=warning"],
        cwd=JS, capture_output=True, text=True, timeout=120,
    )
    assert built.returncode == 0, f"esbuild failed:\n{built.stdout}{built.stderr}"
    (out / "index.html").write_text(
        '<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
        "<title>useChat on the gateway</title></head>\n"
        '<body><div id="root"></div><script type="module" src="app.js"></script></body></html>\n'
    )
    return out


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def page_origin(use_chat_page: Path) -> Iterator[str]:
    """A static server of the bundled page, on an origin other than the gateway's."""
    handler = functools.partial(QuietHandler, directory=str(use_chat_page))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join()


@pytest.fixture(scope="module")
def ai_gateway(start_gateway: Any, page_origin: str) -> GatewayProcess:
    """A gateway that allows the page's origin."""
    gw: GatewayProcess = start_gateway(turn_timeout=60, allowed_origins=page_origin)
    return gw


@pytest.fixture(scope="module")
def chromium() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS,
                                     headless=True)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture
def page(chromium: Any) -> Iterator[Any]:
    context = chromium.new_context()
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.add_init_script(RECORD_ANSWERS)
    yield page
    context.close()
    assert not errors, f"uncaught errors in the page: {errors}"


# --- helpers ----------------------------------------------------------------------------


def shown_answers(page: Any) -> list[list[str]]:
    """What the answer showed since the page loaded (see RECORD_ANSWERS)."""
    answers: list[list[str]] = page.evaluate("window.__answers")
    return answers


def assert_once(page: Any, text: str) -> None:
    """The page shows the user's message and one answer, ``text`` exactly, in one part,
    and never showed more than a prefix of the answer."""
    messages = page.get_by_test_id("message")
    expect(messages).to_have_count(2)
    assert [m.get_attribute("data-role") for m in messages.all()] == ["user", "assistant"]
    answer = messages.nth(1)
    assert answer.text_content() == text
    assert answer.get_attribute("data-text-parts") == "1"
    for shown in shown_answers(page):
        assert len(shown) <= 1, f"two answers on the page: {shown}"
        assert ANSWER.startswith(shown[0] if shown else ""), f"not the answer: {shown}"
    expect(page.get_by_test_id("error")).to_have_count(0)


# --- the test ---------------------------------------------------------------------------


def test_use_chat_reloaded_mid_answer_shows_the_whole_answer_once(
        page: Any, ai_gateway: GatewayProcess, page_origin: str, redis_url: str,
        user: str) -> None:
    agent = f"storyteller-{uuid.uuid4().hex[:8]}"
    chat_id = f"c_{uuid.uuid4().hex[:12]}"
    url = (f"{page_origin}/index.html?gateway={ai_gateway.http}&token={ai_gateway.token(user)}"
           f"&chat={chat_id}&agent={agent}")
    app = page.get_by_test_id("app")
    answer = page.locator("[data-testid=message][data-role=assistant]")
    gate = threading.Event()
    try:
        with running_agents(redis_url, {agent: held_answer(gate)}):
            page.goto(url)
            expect(app).to_have_attribute("data-ready", "true", timeout=TURN)
            page.get_by_test_id("input").fill("tell me a long story")
            page.get_by_test_id("send").click()
            # Halfway: the agent holds the rest back.
            expect(app).to_have_attribute("data-status", "streaming", timeout=TURN)
            expect(answer).to_have_text(re.compile(rf"{SHOWN.strip()}\s*$"), timeout=TURN)
            assert_once(page, SHOWN)
            turn_id = answer.get_attribute("data-id")
            assert turn_id and turn_id.startswith("t_")

            # A reload: the first render is /messages, then resume: true reads the running
            # answer from its start. Still half of it, once.
            with page.expect_response(lambda r: r.url.endswith(f"/{chat_id}/stream")) as resumed:
                page.reload()
            assert resumed.value.status == 200
            expect(app).to_have_attribute("data-ready", "true", timeout=TURN)
            expect(app).to_have_attribute("data-status", "streaming", timeout=TURN)
            expect(answer).to_have_text(re.compile(rf"{SHOWN.strip()}\s*$"), timeout=TURN)
            assert_once(page, SHOWN)

            # The rest streams into the same answer, each word once.
            gate.set()
            expect(app).to_have_attribute("data-status", "ready", timeout=TURN)
            expect(answer).to_have_text(re.compile(rf"w{WORDS - 1}\s*$"), timeout=TURN)
            assert_once(page, ANSWER)
            assert answer.get_attribute("data-id") == turn_id
            assert len(shown_answers(page)) > 2, "the answer did not stream after the reload"

            # Reloaded once it is over: the history, nothing to resume.
            with page.expect_response(lambda r: r.url.endswith(f"/{chat_id}/stream")) as resumed:
                page.reload()
            assert resumed.value.status == 204
            expect(app).to_have_attribute("data-ready", "true", timeout=TURN)
            expect(answer).to_have_text(re.compile(rf"w{WORDS - 1}\s*$"), timeout=TURN)
            expect(app).to_have_attribute("data-status", "ready", timeout=TURN)
            assert_once(page, ANSWER)
            assert answer.get_attribute("data-id") == turn_id
    finally:
        gate.set()
