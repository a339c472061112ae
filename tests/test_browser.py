"""The demo page and gateway-client.js in a real headless Chromium, against real processes.

A gateway in dev mode (it serves the page), the demo agent as its own process (``gateway
agent gateway.sdk.demo_agent:handle``), and a private Redis-compatible server, so agents other
test modules start never pick up these turns. Needs Debian's Chromium at /usr/bin/chromium
(``apt-get install -y chromium``) and the ``playwright`` package; the tests fail, not skip,
without them. Never downloads a browser.

The client's own logic (reconnect, resume with ``since``, de-duplication, ``recovered:
false``, the buffer, the outbox, stream positions, the watchdog) is tested on its own under
Node, against a fake gateway: ``tests/js`` (``npm test`` there; ``scripts/test`` runs it).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.embedded import EmbeddedRedis

from .conftest import GatewayProcess, free_port
from .netproxy import SilenceableProxy
from .steps import history_sync as history  # these tests are synchronous
from .test_agent import agent_worker
from .test_client_tools import asking_handler
from .test_named_agents import answering

pytestmark = pytest.mark.browser

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
TURN = 20_000  # ms: a demo turn, agent round trip included
SLOW_TURN = 40_000  # ms: a /slow turn streams for about ten seconds
RECONNECT = 30_000  # ms: a gateway restart plus the page's backoff (capped at 8 s)

SLOW_REPLY = " ".join(f"word{i}" for i in range(1, 101))


# --- fixtures ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server = EmbeddedRedis(tmp_path_factory.mktemp("browser-redis"), persistent=False)
    server.start()
    yield server.url
    server.stop()


def start_demo_gateway(start_gateway: Any, redis_url: str, **settings: Any) -> GatewayProcess:
    """A dev-mode gateway serving the page, whose origin it allows.

    Its in-process demo agent is off: turns go to the ``agent`` process, which keeps working
    while a test restarts the gateway.
    """
    port = free_port()
    gw: GatewayProcess = start_gateway(
        dev=1, turn_timeout=30, port=port, redis_url=redis_url, demo_agent=0,
        allowed_origins=f"http://127.0.0.1:{port}", **settings,
    )
    return gw


@pytest.fixture(scope="module")
def demo(start_gateway: Any, browser_redis: str) -> GatewayProcess:
    """A dev-mode gateway that serves the page."""
    return start_demo_gateway(start_gateway, browser_redis)


@pytest.fixture(scope="module")
def agent(demo: GatewayProcess) -> Iterator[subprocess.Popen[bytes]]:
    """The demo agent, a worker process reading the inbox of the same Redis."""
    demo_agent = Path(__file__).parent.parent / "gateway" / "sdk" / "demo_agent.py"
    assert demo_agent.exists(), "gateway/sdk/demo_agent.py is missing"
    with open(Path(demo.env["GATEWAY_DATA_DIR"]) / "browser-agent.log", "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gateway", "agent", "gateway.sdk.demo_agent:handle",
             "--log-level", "warning"],
            env=demo.env, stdout=log, stderr=subprocess.STDOUT,
        )
    yield proc
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Debian's Chromium, headless, with a fresh profile."""
    if not os.path.exists(CHROMIUM):
        pytest.fail(f"{CHROMIUM} is missing: install Debian's Chromium with "
                    "`apt-get update && apt-get install -y chromium` (never `playwright install`)",
                    pytrace=False)
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("the playwright package is missing: `.venv/bin/pip install playwright` "
                    "(it drives the system Chromium; no browser download)", pytrace=False)
    profile = tmp_path_factory.mktemp("chromium-profile")
    with sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            str(profile), executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True,
            viewport={"width": 1280, "height": 800}, device_scale_factor=1,
        )
        try:
            yield context
        finally:
            context.close()


@pytest.fixture
def page(browser: Any, agent: Any) -> Iterator[Any]:
    page = browser.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    if os.environ.get("BROWSER_CONSOLE"):
        page.on("console", lambda msg: print(f"[console.{msg.type}] {msg.text}"))
    yield page
    page.close()
    assert agent.poll() is None, "the demo agent process died"
    assert not errors, f"uncaught errors in the page: {errors}"


# --- helpers ----------------------------------------------------------------------------


def expect(locator: Any) -> Any:
    from playwright.sync_api import expect as pw_expect

    return pw_expect(locator)


# The sizes each point of the reference client is tried at: a laptop, a phone (390x844), and
# the laptop at 200 % zoom (its CSS viewport halves: the page lays out as at 640x400).
SIZES = {
    "desktop": {"width": 1280, "height": 800},
    "phone": {"width": 390, "height": 844},
    "zoom200": {"width": 640, "height": 400},
}
BOTH = pytest.mark.parametrize("size", ["desktop", "phone"])


def show_sidebar(page: Any) -> None:
    """The conversation list: on a phone, open its drawer first."""
    opener = page.get_by_test_id("open-drawer")
    if opener.is_visible():
        opener.click()
        expect(opener).to_have_attribute("aria-expanded", "true")
    expect(page.get_by_test_id("sidebar")).to_be_in_viewport()


def open_app(page: Any, gw: GatewayProcess, user: str, chat: str | None = None) -> None:
    url = f"{gw.http}/?token={gw.token(user)}" + (f"&chat={chat}" if chat else "")
    page.goto(url)
    expect(page.get_by_test_id("app")).to_have_attribute("data-ready", "true", timeout=TURN)
    expect(page.get_by_test_id("connection")).to_have_attribute("data-state", "open",
                                                                 timeout=TURN)


def synced(page: Any, chat_id: str) -> None:
    chat = page.get_by_test_id("chat")
    expect(chat).to_have_attribute("data-chat-id", chat_id, timeout=TURN)
    expect(chat).to_have_attribute("data-synced", "true", timeout=TURN)


def draft(page: Any) -> None:
    """"+ New chat": an empty chat that exists nowhere until its first message."""
    show_sidebar(page)
    page.get_by_test_id("new-chat").click()
    expect(page.get_by_test_id("chat")).to_have_attribute("data-chat-id", "", timeout=TURN)
    expect(page.get_by_test_id("message-input")).to_be_focused()


def current_chat(page: Any) -> str:
    """The chat on screen, once there is one and the page is subscribed to it."""
    chat = page.get_by_test_id("chat")
    expect(chat).not_to_have_attribute("data-chat-id", "", timeout=TURN)
    chat_id: str = chat.get_attribute("data-chat-id")
    synced(page, chat_id)
    return chat_id


def new_chat(page: Any, text: str) -> str:
    """A new chat, started by sending ``text``; returns its id."""
    draft(page)
    send(page, text)
    return current_chat(page)


def send(page: Any, text: str) -> None:
    expect(page.get_by_test_id("send")).to_be_enabled(timeout=TURN)
    page.get_by_test_id("message-input").fill(text)
    page.get_by_test_id("message-input").press("Enter")


def sidebar_item(page: Any, chat_id: str) -> Any:
    return page.locator(f'[data-testid="conversation"][data-chat-id="{chat_id}"]')


def messages(page: Any, role: str) -> Any:
    return page.locator(f'[data-testid="message"][data-role="{role}"]')


def watch_deltas(gw: GatewayProcess, user: str, chat_id: str, count: int) -> None:
    """Return once ``count`` deltas of ``chat_id`` went out, seen from a socket of our own."""
    from websockets.sync.client import connect as ws_connect

    with ws_connect(gw.url(user)) as ws:
        ws.send(json.dumps({"type": "subscribe", "chat_id": chat_id}))
        seen = 0
        while seen < count:
            frame = json.loads(ws.recv(timeout=TURN / 1000))
            seen += frame.get("type") == "delta" and frame.get("chat_id") == chat_id


def assert_transcript(page: Any, gw: GatewayProcess, user: str, chat_id: str) -> None:
    """Every stored message of the active path shows exactly once, in order, with its text;
    nothing else does."""
    path = history(gw, user, chat_id, view="active")
    stored = [(e["seq"], "user" if e["type"] == "user_message" else "assistant", e["data"]["text"])
              for e in path if e["type"] in ("user_message", "message")]
    shown = page.eval_on_selector_all(
        '[data-testid="messages"] [data-testid="message"]',
        "els => els.map(e => [Number(e.dataset.seq), e.dataset.role, e.innerText.trim()])")
    assert [(s, r, t.strip()) for s, r, t in stored] == [tuple(x) for x in shown]
    ends = [e["seq"] for e in path if e["type"] == "turn_end"]
    latencies = page.eval_on_selector_all('[data-testid="turn-latency"]',
                                          "els => els.map(e => Number(e.dataset.seq))")
    assert latencies == ends
    expect(page.get_by_test_id("streaming")).to_have_count(0)
    expect(page.get_by_test_id("pending-message")).to_have_count(0)


# --- tests ------------------------------------------------------------------------------


def test_static_routes(demo: GatewayProcess, gateway: GatewayProcess) -> None:
    js = httpx.get(f"{demo.http}/static/gateway-client.js")
    assert js.status_code == 200
    assert js.headers["content-type"].startswith("text/javascript")
    assert "export class GatewayClient" in js.text
    assert js.headers["access-control-allow-origin"] == "*"  # importable from other origins
    dts = httpx.get(f"{demo.http}/static/gateway-client.d.ts")
    assert dts.status_code == 200 and "declare class GatewayClient" in dts.text
    page = httpx.get(f"{demo.http}/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "content-security-policy" in page.headers
    assert page.headers["referrer-policy"] == "no-referrer"  # the URL carries the token
    assert httpx.get(f"{demo.http}/static/app.js").headers["content-type"].startswith(
        "text/javascript")
    assert httpx.get(f"{demo.http}/static/app.css").headers["content-type"].startswith("text/css")
    # Outside dev mode only the client is served, not the demo page.
    assert httpx.get(f"{gateway.http}/static/gateway-client.js").status_code == 200
    assert httpx.get(f"{gateway.http}/").status_code == 404
    assert httpx.get(f"{demo.http}/static/../config.py").status_code == 404


def test_streamed_reply_with_latency(page: Any, demo: GatewayProcess, user: str) -> None:
    open_app(page, demo, user)
    chat_id = new_chat(page, "Plan a weekend in Lisbon")
    expect(messages(page, "user")).to_have_text(["Plan a weekend in Lisbon"], timeout=TURN)
    reply = messages(page, "assistant")
    expect(reply).to_have_count(1, timeout=TURN)
    expect(reply).to_contain_text("You said: “Plan a weekend in Lisbon”")
    # The reply arrived as deltas first, then the durable message replaced them.
    assert int(reply.get_attribute("data-streamed")) > 5
    latency = page.get_by_test_id("turn-latency")
    expect(latency).to_have_count(1, timeout=TURN)
    expect(latency).to_have_attribute("data-reason", "complete")
    expect(latency).to_contain_text(re.compile(r"replied in \d+(\.\d+)? (ms|s)"))
    assert int(latency.get_attribute("data-latency-ms")) > 0
    # The agent titled the chat from the first message; the sidebar got it from the feed.
    expect(sidebar_item(page, chat_id).get_by_test_id("conversation-title")).to_have_text(
        "Plan a weekend in Lisbon", timeout=TURN)
    expect(page.get_by_test_id("chat-title")).to_have_text("Plan a weekend in Lisbon")
    assert_transcript(page, demo, user, chat_id)


def test_switching_chats_mid_turn_keeps_the_reply_whole(page: Any, demo: GatewayProcess,
                                                        user: str) -> None:
    open_app(page, demo, user)
    first = new_chat(page, "/slow")
    expect(page.get_by_test_id("streaming-text")).to_contain_text("word3", timeout=TURN)
    expect(sidebar_item(page, first)).to_have_attribute("data-status", "running")

    # Unsubscribes the first chat: the gateway buffers its frames.
    second = new_chat(page, "hello from the other chat")
    expect(messages(page, "assistant")).to_contain_text(["You said: “hello from the other chat”"],
                                                        timeout=TURN)
    expect(page.get_by_test_id("turn-latency")).to_have_count(1, timeout=TURN)
    expect(sidebar_item(page, first)).to_have_attribute("data-status", "running")

    sidebar_item(page, first).click()
    synced(page, first)
    chat = page.get_by_test_id("chat")
    expect(chat).to_have_attribute("data-subscribe-mode", "buffer")
    assert int(chat.get_attribute("data-buffered")) > 0
    reply = messages(page, "assistant")
    expect(reply).to_have_count(1, timeout=SLOW_TURN)
    expect(reply).to_have_text(SLOW_REPLY)
    # Every one of the 100 deltas reached the page (some live, some from the buffer).
    expect(reply).to_have_attribute("data-streamed", "100")
    expect(page.get_by_test_id("turn-latency")).to_have_count(1, timeout=TURN)
    assert_transcript(page, demo, user, first)

    sidebar_item(page, second).click()
    synced(page, second)
    assert_transcript(page, demo, user, second)


def test_switching_back_after_the_buffer_overflowed(page: Any, start_gateway: Any,
                                                   browser_redis: str, user: str) -> None:
    gw = start_demo_gateway(start_gateway, browser_redis, buffer_max_frames=5)
    open_app(page, gw, user)
    first = new_chat(page, "/slow")
    expect(page.get_by_test_id("streaming-text")).to_contain_text("word3", timeout=TURN)
    draft(page)  # unsubscribes the first chat
    # Go back once well over five frames (the buffer's bound) went out in the meantime.
    watch_deltas(gw, user, first, 10)
    sidebar_item(page, first).click()
    synced(page, first)
    chat = page.get_by_test_id("chat")
    expect(chat).to_have_attribute("data-overflowed", "true")
    reply = messages(page, "assistant")
    expect(reply).to_have_count(1, timeout=SLOW_TURN)
    expect(reply).to_have_text(SLOW_REPLY)
    # The buffer's deltas were dropped, but the subscribe's snapshot repaired the stream:
    # by the commit the page held every one of the 100 words.
    assert int(reply.get_attribute("data-streamed")) == 100
    expect(page.get_by_test_id("turn-latency")).to_have_count(1, timeout=TURN)
    assert_transcript(page, gw, user, first)


@pytest.fixture
def restartable(start_gateway: Any, browser_redis: str) -> GatewayProcess:
    """A gateway of its own: these tests stop and start it."""
    return start_demo_gateway(start_gateway, browser_redis)


def test_gateway_restart_mid_turn(page: Any, restartable: GatewayProcess, user: str) -> None:
    gw = restartable
    page.add_init_script(RECORDER)
    open_app(page, gw, user)
    page.evaluate("() => demo.client.on('state', (s) => __rec.states.push("
                  "[performance.now(), s.state, s.delay ?? null, s.attempt ?? null]))")
    chat_id = new_chat(page, "first question")
    expect(page.get_by_test_id("turn-latency")).to_have_count(1, timeout=TURN)
    asked = page.evaluate("performance.now()")
    send(page, "/slow")
    expect(page.get_by_test_id("streaming-text")).to_contain_text("word3", timeout=TURN)

    gw.stop()
    connection = page.get_by_test_id("connection")
    expect(connection).not_to_have_attribute("data-state", "open", timeout=RECONNECT)
    expect(page.get_by_test_id("connection-label")).to_contain_text("Reconnect")
    # While offline the header does not claim the agent is answering.
    expect(page.get_by_test_id("chat-status")).to_have_text("waiting for the connection…")
    gw.start()
    ready = page.evaluate("performance.now()")
    expect(connection).to_have_attribute("data-state", "open", timeout=RECONNECT)
    # Back soon after the gateway is: after a 1012 the client retries at once, then waits
    # at most 2 s between attempts for a while (not a back-off grown to 8 s).
    back = page.evaluate("performance.now()") - ready
    assert back <= 3_500, f"connected {back:.0f} ms after the gateway was ready"
    # Resumed from the last seq it had, on the new connection.
    expect(page.get_by_test_id("chat")).to_have_attribute("data-subscribe-mode", "since",
                                                          timeout=TURN)

    reply = messages(page, "assistant")
    expect(reply).to_have_count(2, timeout=SLOW_TURN)
    expect(reply.nth(1)).to_have_text(SLOW_REPLY)
    expect(page.get_by_test_id("turn-latency")).to_have_count(2, timeout=TURN)
    assert_transcript(page, gw, user, chat_id)

    rec = recorded(page)
    # Never "answering" unless connected.
    shown = [row for row in rec["header"] if row[1] != "open" and "answering" in row[2]]
    assert not shown, shown
    # The answer on screen never shrank.
    assert_streamed_whole([row for row in rec["streamed"] if row[0] > asked])
    # Each "Reconnecting in N s" was the real wait, to the second.
    assert_real_waits(rec)

    page.reload()
    expect(page.get_by_test_id("app")).to_have_attribute("data-ready", "true", timeout=TURN)
    synced(page, chat_id)
    assert_transcript(page, gw, user, chat_id)


def assert_real_waits(rec: dict[str, Any]) -> None:
    """Each "Reconnecting in N s" the page showed was within a second of the wait the client
    had left then (from its last "reconnecting" state: its delay, less the time since)."""
    for t, _, label in rec["labels"]:
        said = re.match(r"Reconnecting in (\d+) s", label)
        if not said:
            continue
        before = [s for s in rec["states"] if s[0] <= t and s[1] == "reconnecting"]
        assert before, f"{label!r} with no reconnecting state before it: {rec['states']}"
        at, _, delay, _ = before[-1]
        left = delay - (t - at)
        assert abs(left - int(said.group(1)) * 1000) <= 1000, (label, left, rec["states"])


@pytest.fixture
def with_agent_inside(start_gateway: Any, tmp_path: Path) -> Iterator[GatewayProcess]:
    """A gateway running the demo agent inside it, on a Redis of its own (no other agent
    takes its turns): stopping it stops the agent mid-answer, and the turn is redelivered."""
    server = EmbeddedRedis(tmp_path / "redis", persistent=False)
    server.start()
    port = free_port()
    gw: GatewayProcess = start_gateway(dev=1, turn_timeout=30, port=port, redis_url=server.url,
                                       demo_agent=1, allowed_origins=f"http://127.0.0.1:{port}")
    yield gw
    gw.stop()
    server.stop()


@BOTH
def test_a_redelivered_answer_does_not_shrink(page: Any, with_agent_inside: GatewayProcess,
                                             user: str, size: str) -> None:
    gw = with_agent_inside
    sized(page, size)
    page.add_init_script(RECORDER)
    open_app(page, gw, user)
    chat_id = new_chat(page, "/slow")
    streaming = page.get_by_test_id("streaming-text")
    expect(streaming).to_contain_text("word20", timeout=TURN)
    gw.stop()
    connection = page.get_by_test_id("connection")
    expect(connection).not_to_have_attribute("data-state", "open", timeout=RECONNECT)
    had = len(shown_words(page))
    assert had >= 20, had
    gw.start()
    expect(connection).to_have_attribute("data-state", "open", timeout=RECONNECT)
    reply = messages(page, "assistant")
    expect(reply).to_have_count(1, timeout=SLOW_TURN * 2)
    expect(reply).to_have_text(SLOW_REPLY)
    # The agent started over (from word1, while the page had shown `had` words): the page
    # kept the earlier attempt's words, dimmed, past the new one's, so the text on screen
    # never shrank.
    assert_streamed_whole(recorded(page)["streamed"])
    assert_transcript(page, gw, user, chat_id)


def test_message_sent_while_offline_goes_out_once(page: Any, restartable: GatewayProcess,
                                                  user: str) -> None:
    gw = restartable
    open_app(page, gw, user)
    chat_id = new_chat(page, "sent while online")
    expect(page.get_by_test_id("turn-latency")).to_have_count(1, timeout=TURN)
    gw.stop()
    expect(page.get_by_test_id("connection")).not_to_have_attribute("data-state", "open",
                                                                    timeout=RECONNECT)
    send(page, "sent while offline")
    pending = page.get_by_test_id("pending-message")
    expect(pending).to_have_count(1)
    expect(pending).to_contain_text("queued")
    gw.start()
    expect(page.get_by_test_id("connection")).to_have_attribute("data-state", "open",
                                                                timeout=RECONNECT)
    expect(messages(page, "user")).to_have_text(["sent while online", "sent while offline"],
                                                timeout=TURN)
    expect(page.get_by_test_id("turn-latency")).to_have_count(2, timeout=TURN)
    assert_transcript(page, gw, user, chat_id)
    stored = [e for e in history(gw, user, chat_id) if e["type"] == "user_message"]
    assert len(stored) == 2


def test_rename_over_http_updates_the_sidebar_live(page: Any, demo: GatewayProcess,
                                                   user: str) -> None:
    open_app(page, demo, user)
    first = new_chat(page, "background chat")
    # The agent titles a chat from its first message: wait for that before renaming.
    expect(sidebar_item(page, first).get_by_test_id("conversation-title")).to_have_text(
        "Background chat", timeout=TURN)
    second = new_chat(page, "shown chat")
    expect(sidebar_item(page, second).get_by_test_id("conversation-title")).to_have_text(
        "Shown chat", timeout=TURN)
    for chat_id, title in ((second, "Shown chat, renamed"), (first, "Background chat, renamed")):
        resp = httpx.patch(f"{demo.http}/v1/conversations/{chat_id}", json={"title": title},
                           headers=demo.headers(user))
        assert resp.status_code == 200, resp.text
        expect(sidebar_item(page, chat_id).get_by_test_id("conversation-title")).to_have_text(
            title, timeout=TURN)
    expect(page.get_by_test_id("chat-title")).to_have_text("Shown chat, renamed")
    # Someone else cannot rename it, and the page did not reload to learn any of this.
    other = httpx.patch(f"{demo.http}/v1/conversations/{first}", json={"title": "nope"},
                        headers=demo.headers(user + "x"))
    assert other.status_code == 403


def test_goal_strip_survives_reload(page: Any, demo: GatewayProcess, user: str,
                                    tmp_path: Path) -> None:
    open_app(page, demo, user)
    draft(page)
    strip = page.get_by_test_id("goal-strip")
    expect(strip).to_be_hidden()
    chat_id = new_chat(page, "Plan a weekend in Lisbon")
    expect(page.get_by_test_id("turn-latency")).to_have_count(1, timeout=TURN)
    send(page, "/goal Plan a 3-day trip to Lisbon with one day in Sintra")
    expect(strip).to_be_visible(timeout=TURN)
    expect(page.get_by_test_id("goal-summary")).to_have_text(
        "Goal: Plan a 3-day trip to Lisbon with one day in Sintra")
    expect(strip).to_have_attribute("data-status", "active")
    expect(page.get_by_test_id("turn-latency")).to_have_count(2, timeout=TURN)
    send(page, "Which neighbourhood should we stay in?")
    expect(page.get_by_test_id("turn-latency")).to_have_count(3, timeout=TURN)

    page.reload()
    expect(page.get_by_test_id("app")).to_have_attribute("data-ready", "true", timeout=TURN)
    synced(page, chat_id)
    expect(strip).to_be_visible()
    expect(page.get_by_test_id("goal-summary")).to_have_text(
        "Goal: Plan a 3-day trip to Lisbon with one day in Sintra")
    assert_transcript(page, demo, user, chat_id)
    shot = Path(os.environ.get("GATEWAY_SCREENSHOT") or tmp_path / "screenshot.png")
    shot.parent.mkdir(parents=True, exist_ok=True)
    page.get_by_test_id("message-input").blur()
    page.screenshot(path=str(shot))

    send(page, "/done")
    expect(strip).to_have_attribute("data-status", "complete", timeout=TURN)
    expect(page.get_by_test_id("goal-summary")).to_contain_text("Done:")
    page.reload()
    synced(page, chat_id)
    expect(strip).to_have_attribute("data-status", "complete")


# --- answers being written: reload, offline, a second tab ------------------------------

SLOW_WORDS = SLOW_REPLY.split()

# Installed before the page's own scripts (and again after each reload): records every text
# the streaming bubble showed, the connection label's every change, and the browser's
# online/offline events, each with performance.now() of that document.
RECORDER = r"""
(() => {
  const rec = { streamed: [], labels: [], network: [], header: [], states: [] };
  window.__rec = rec;
  const look = () => {
    const now = performance.now();
    const bubble = document.querySelector('[data-testid="streaming-text"]');
    const text = bubble ? bubble.textContent : "";
    const last = rec.streamed[rec.streamed.length - 1];
    if (text && (!last || last[1] !== text)) rec.streamed.push([now, text]);
    const box = document.querySelector('[data-testid="connection"]');
    const label = document.querySelector('[data-testid="connection-label"]');
    if (box && label) {
      const shown = [box.dataset.state, label.textContent];
      const prev = rec.labels[rec.labels.length - 1];
      if (!prev || prev[1] !== shown[0] || prev[2] !== shown[1]) rec.labels.push([now, ...shown]);
      const status = document.querySelector('[data-testid="chat-status"]');
      const head = [box.dataset.state, status ? status.textContent : ""];
      const was = rec.header[rec.header.length - 1];
      if (!was || was[1] !== head[0] || was[2] !== head[1]) rec.header.push([now, ...head]);
    }
  };
  new MutationObserver(look).observe(document, {
    subtree: true, childList: true, characterData: true, attributes: true,
    attributeFilter: ["data-state", "data-status"],
  });
  addEventListener("offline", () => rec.network.push([performance.now(), "offline"]));
  addEventListener("online", () => rec.network.push([performance.now(), "online"]));
})();
"""


def recorded(page: Any) -> dict[str, Any]:
    rec: dict[str, Any] = page.evaluate("window.__rec")
    return rec


def shown_words(page: Any) -> list[str]:
    text: str = page.get_by_test_id("streaming-text").inner_text()
    return text.split()


def assert_streamed_whole(samples: list[list[Any]], at_least: int = 1) -> None:
    """Each text the streaming bubble showed is the answer's beginning, every word once, and
    it only grew; the first one already held ``at_least`` words."""
    assert samples, "the streaming bubble never showed anything"
    counts = []
    for _, text in samples:
        words = text.split()
        assert len(set(words)) == len(words), f"a word shown twice: {text!r}"
        assert words == SLOW_WORDS[:len(words)], f"not the answer's beginning: {text!r}"
        counts.append(len(words))
    assert counts == sorted(counts), f"the partial answer shrank: {counts}"
    assert counts[0] >= at_least, (
        f"the first text shown had {counts[0]} words, not the {at_least} already streamed: "
        f"{samples[0][1]!r}")


def assert_final_reply(page: Any, gw: GatewayProcess, user: str, chat_id: str) -> None:
    reply = messages(page, "assistant")
    expect(reply).to_have_count(1, timeout=SLOW_TURN)
    expect(reply).to_have_text(SLOW_REPLY)
    expect(page.get_by_test_id("turn-latency")).to_have_count(1, timeout=TURN)
    assert_transcript(page, gw, user, chat_id)


def test_reload_mid_answer_shows_the_partial_answer_at_once(page: Any, demo: GatewayProcess,
                                                             user: str) -> None:
    page.add_init_script(RECORDER)
    open_app(page, demo, user)
    chat_id = new_chat(page, "/slow")
    streaming = page.get_by_test_id("streaming-text")
    expect(streaming).to_contain_text("word12", timeout=TURN)
    had = len(shown_words(page))
    assert 12 <= had < 100

    page.reload()
    # The whole partial answer at once: the first text the new page shows holds every word
    # the old one had (not a stream starting over from the next delta).
    expect(streaming).to_contain_text(SLOW_WORDS[had - 1], timeout=5_000)
    first = recorded(page)["streamed"][0]
    assert first[1].split()[:3] == ["word1", "word2", "word3"], first
    assert len(first[1].split()) >= had, (had, first)
    synced(page, chat_id)
    # It keeps growing after the reload.
    grown = SLOW_WORDS[min(had + 10, 99) - 1]
    expect(streaming).to_contain_text(grown, timeout=TURN)

    assert_final_reply(page, demo, user, chat_id)
    samples = recorded(page)["streamed"]
    assert len(samples) >= 5, f"saw the answer grow only {len(samples)} times"
    assert_streamed_whole(samples, at_least=had)
    expect(messages(page, "assistant")).to_have_attribute("data-streamed", "100")


def test_offline_mid_answer(page: Any, demo: GatewayProcess, user: str) -> None:
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    page.add_init_script(RECORDER)
    open_app(page, demo, user)
    chat_id = new_chat(page, "/slow")
    streaming = page.get_by_test_id("streaming-text")
    expect(streaming).to_contain_text("word12", timeout=TURN)
    connection = page.get_by_test_id("connection")
    label = page.get_by_test_id("connection-label")
    expect(label).to_have_text("Connected")

    context = page.context
    went_offline = page.evaluate("performance.now()")
    context.set_offline(True)
    try:
        # The browser's "offline" event drops the socket at once and the page says so. Where
        # set_offline does not fire it, the liveness check (a ping after 5 s of silence, the
        # socket dropped 5 s later) must still notice: allow ~10 s more for that.
        try:
            page.wait_for_function("() => window.__rec.network.some(e => e[1] === 'offline')",
                                   timeout=2_000)
            event = True
        except PlaywrightTimeout:
            event = False
        if event:
            expect(connection).to_have_attribute("data-state", "offline", timeout=2_000)
            expect(label).to_have_text("Offline: waiting for the network")
        else:
            expect(connection).not_to_have_attribute("data-state", "open", timeout=12_000)
            expect(label).not_to_have_text("Connected")
        page.wait_for_timeout(3_000)  # stay offline for 3 s
        expect(label).not_to_have_text("Connected")
    finally:
        back_online = page.evaluate("performance.now()")
        context.set_offline(False)
    # "online" reconnects at once; without the event the backoff (at most 8 s) decides.
    expect(connection).to_have_attribute("data-state", "open",
                                         timeout=5_000 if event else RECONNECT)
    expect(label).to_have_text("Connected")
    reconnected = page.evaluate("performance.now()")

    rec = recorded(page)
    seen = (f"network events {rec['network']}; connected again "
            f"{reconnected - back_online:.0f} ms after going online; labels {rec['labels']}")
    # It said so within ~2 s of the network going (~12.5 s through the liveness check), and
    # from then until the network came back it never said "Connected".
    shown_offline = next(t for t, state, _ in rec["labels"] if t >= went_offline and (
        state == "offline" if event else state != "open"))
    assert shown_offline - went_offline <= (2_000 if event else 14_000), seen
    while_offline = [row for row in rec["labels"] if shown_offline <= row[0] <= back_online]
    assert not [row for row in while_offline if row[1] == "open" or row[2] == "Connected"], seen
    if event:
        assert all(state == "offline" for _, state, _ in while_offline), seen

    assert_final_reply(page, demo, user, chat_id)
    samples = recorded(page)["streamed"]
    assert_streamed_whole(samples)
    if event:
        # Back online mid-answer: the bubble went on growing from where the gateway was, and
        # by the commit the page held all 100 pieces.
        assert [t for t, _ in samples if t > reconnected], f"no growth after reconnecting: {seen}"
        expect(messages(page, "assistant")).to_have_attribute("data-streamed", "100")


def test_a_silent_network_death_mid_answer_reconnects_within_9_s(
        page: Any, start_gateway: Any, browser_redis: str, user: str) -> None:
    """The network goes silent (nothing closed: a phone moving from Wi-Fi to cellular) while
    an answer streams. The page notices in about 5 s; its ticket request must not wait out
    the dead keep-alive connection it would ride: the new socket opens within 9 s."""
    port = free_port()
    with SilenceableProxy("127.0.0.1", port) as proxy:
        origin = f"http://127.0.0.1:{proxy.port}"
        gw: GatewayProcess = start_gateway(dev=1, turn_timeout=30, port=port,
                                           redis_url=browser_redis, demo_agent=0,
                                           allowed_origins=origin)
        page.add_init_script(RECORDER)
        page.goto(f"{origin}/?token={gw.token(user)}")
        expect(page.get_by_test_id("app")).to_have_attribute("data-ready", "true", timeout=TURN)
        connection = page.get_by_test_id("connection")
        expect(connection).to_have_attribute("data-state", "open", timeout=TURN)
        page.evaluate("() => demo.client.on('state', (s) => __rec.states.push("
                      "[performance.now(), s.state, s.reason ?? null]))")
        chat_id = new_chat(page, "/slow")
        expect(page.get_by_test_id("streaming-text")).to_contain_text("word8", timeout=TURN)

        died = page.evaluate("performance.now()")
        proxy.silence()
        expect(connection).not_to_have_attribute("data-state", "open", timeout=10_000)
        expect(connection).to_have_attribute("data-state", "open", timeout=RECONNECT)
        states = recorded(page)["states"]
        opened = next((t for t, state, _ in states if t > died and state == "open"), None)
        assert opened is not None, states
        noticed = next(t for t, state, _ in states if t > died and state != "open")
        trace = [(round(t - died), state, why) for t, state, why in states if t > died]
        assert noticed - died < 6_000, f"the dead socket noticed late: {trace}"
        assert opened - died < 9_000, f"the new socket opened {opened - died:.0f} ms after " \
            f"the network died: {trace}"
        # The answer resumed on the new connection and ended whole.
        assert_final_reply(page, gw, user, chat_id)
        assert_streamed_whole(recorded(page)["streamed"])


def test_second_tab_joins_mid_answer(page: Any, browser: Any, demo: GatewayProcess,
                                     user: str) -> None:
    page.add_init_script(RECORDER)
    open_app(page, demo, user)
    chat_id = new_chat(page, "/slow")
    expect(page.get_by_test_id("streaming-text")).to_contain_text("word12", timeout=TURN)
    had = len(shown_words(page))

    other = browser.new_page()
    errors: list[str] = []
    other.on("pageerror", lambda exc: errors.append(str(exc)))
    try:
        other.add_init_script(RECORDER)
        open_app(other, demo, user, chat=chat_id)
        synced(other, chat_id)
        streaming = other.get_by_test_id("streaming-text")
        expect(streaming).to_contain_text(SLOW_WORDS[had - 1], timeout=5_000)
        first = recorded(other)["streamed"][0]
        assert first[1].split()[:2] == ["word1", "word2"], first
        assert len(first[1].split()) >= had, (had, first)

        assert_final_reply(other, demo, user, chat_id)
        assert_final_reply(page, demo, user, chat_id)
        assert (messages(other, "assistant").inner_text().strip()
                == messages(page, "assistant").inner_text().strip() == SLOW_REPLY)
        assert_streamed_whole(recorded(other)["streamed"], at_least=had)
        assert_streamed_whole(recorded(page)["streamed"])
    finally:
        other.close()
    assert not errors, f"uncaught errors in the second page: {errors}"


# --- the conversation tree: retry, edit, undo, versions, a second tab -------------------


def head_of(page: Any) -> str:
    """The head the page shows (``none`` before the first message)."""
    head: str = page.get_by_test_id("chat").get_attribute("data-head")
    return head


def head_moved(page: Any, old: str) -> str:
    """Wait until the page's head is no longer ``old``; returns the new one."""
    chat = page.get_by_test_id("chat")
    # From a new chat (no head shown yet), "none" (created, nothing said) is no move either.
    was = re.escape(old) if old else "none"
    expect(chat).not_to_have_attribute("data-head", re.compile(f"^({was})?$"), timeout=TURN)
    return head_of(page)


def answered(page: Any, turn_id: str) -> None:
    """Wait until the turn ``turn_id`` (on the page's path) ended and the page is idle."""
    expect(page.locator(f'[data-testid="turn-latency"][data-turn-id="{turn_id}"]')).to_have_count(
        1, timeout=TURN)
    expect(page.get_by_test_id("send")).to_be_enabled(timeout=TURN)


def exchange(page: Any, text: str) -> str:
    """Send ``text`` and wait for its answer; returns its turn (the head)."""
    before = head_of(page)
    send(page, text)
    head = head_moved(page, before)
    answered(page, head)
    return head


def fork(page: Any, bar: str, node_id: str) -> Any:
    """The "i/n" version switch of a node (``bar``: "user-bar" or "turn-bar")."""
    return page.locator(f'[data-testid="{bar}"][data-node-id="{node_id}"] [data-testid="fork"]')


def user_node(page: Any, text: str) -> str:
    node: str = messages(page, "user").filter(has_text=text).get_attribute("data-node")
    return node


def test_retry_the_last_answer(page: Any, demo: GatewayProcess, user: str) -> None:
    open_app(page, demo, user)
    draft(page)
    first = exchange(page, "Plan a day in Porto")
    chat_id = current_chat(page)
    usage = page.get_by_test_id("chat-usage")
    expect(usage).to_have_text(re.compile(r"^[\d,]+ tokens$"), timeout=TURN)
    # The details in words, not field names.
    expect(usage).to_have_attribute("title", re.compile(
        r"^This version: [\d,]+ input tokens, [\d,]+ output tokens\. "
        r"Billed: [\d,]+ input tokens, [\d,]+ output tokens\.$"))
    retry = page.get_by_role("button", name="Retry: answer this message again")
    expect(retry).to_have_count(1)
    retry.click()
    second = head_moved(page, first)
    answered(page, second)
    # Both answers were paid for; the path shown holds one of them.
    expect(usage).to_have_text(re.compile(r"^[\d,]+ tokens \([\d,]+ billed\)$"), timeout=TURN)
    shown, billed = (int(n.replace(",", "")) for n in re.findall(r"[\d,]+", usage.inner_text()))
    assert 0 < shown < billed
    # Only the active path shows: one answer, the second version of two.
    expect(messages(page, "assistant")).to_have_count(1)
    expect(messages(page, "assistant")).to_have_attribute("data-node", second)
    versions = fork(page, "turn-bar", second)
    expect(versions.get_by_test_id("fork-position")).to_have_text("2/2")
    assert_transcript(page, demo, user, chat_id)
    # Back to the first answer, then forward again.
    versions.get_by_role("button", name="Previous version of this answer").click()
    expect(page.get_by_test_id("chat")).to_have_attribute("data-head", first, timeout=TURN)
    expect(messages(page, "assistant")).to_have_attribute("data-node", first)
    expect(fork(page, "turn-bar", first).get_by_test_id("fork-position")).to_have_text("1/2")
    assert_transcript(page, demo, user, chat_id)
    fork(page, "turn-bar", first).get_by_role("button", name="Next version of this answer").click()
    expect(page.get_by_test_id("chat")).to_have_attribute("data-head", second, timeout=TURN)
    assert_transcript(page, demo, user, chat_id)


LAYOUT_RECORDER = r"""
(() => {
  // Every order the transcript's last exchange was shown in: U user message, UB its
  // controls, S the answer being written, A the answer stored, N a note, L the turn's end,
  // TB the turn's controls (Retry, versions).
  window.__layouts = [];
  const label = (el) => el.dataset.testid === "streaming" ? "S"
    : el.dataset.testid === "turn-bar" ? "TB" : el.dataset.testid === "user-bar" ? "UB"
    : el.dataset.testid === "turn-latency" ? "L" : el.dataset.testid === "note" ? "N"
    : el.classList.contains("user") ? "U" : el.classList.contains("assistant") ? "A" : "?";
  const look = () => {
    const box = document.querySelector('[data-testid="messages"]');
    if (!box) return;
    const all = [...box.children].map(label);
    // An empty transcript (a reconnect's reload, seen once under load) shows no order.
    if (!all.length) return;
    const last = all.lastIndexOf("U");
    const shown = all.slice(last).join(" ");
    if (window.__layouts.at(-1) !== shown) window.__layouts.push(shown);
  };
  new MutationObserver(look).observe(document, { subtree: true, childList: true });
})();
"""


def test_the_controls_stay_below_the_answer_as_it_streams(page: Any, demo: GatewayProcess,
                                                         user: str) -> None:
    """Retry (greyed while it runs), the versions and "stop requested" sit below the answer
    while it is written and after it is stored: nothing jumps when it ends."""
    page.add_init_script(LAYOUT_RECORDER)
    open_app(page, demo, user)
    new_chat(page, "/slow")
    streaming = page.get_by_test_id("streaming-text")
    expect(streaming).to_contain_text("word3", timeout=TURN)
    expect(page.get_by_test_id("retry")).to_be_disabled()
    page.get_by_test_id("stop").click()
    latency = page.get_by_test_id("turn-latency")
    expect(latency).to_have_attribute("data-reason", "cancelled", timeout=TURN)
    # Again, as the second version: "< 2/2 > Retry" under the answer being written.
    page.get_by_test_id("retry").click()
    expect(streaming).to_contain_text("word3", timeout=TURN)
    expect(page.get_by_test_id("fork-position")).to_have_text("2/2")
    page.get_by_test_id("stop").click()
    expect(latency).to_have_attribute("data-reason", "cancelled", timeout=TURN)
    layouts = page.evaluate("window.__layouts")
    assert "U UB S TB" in layouts, layouts
    assert "U UB A N L TB" == layouts[-1], layouts
    for shown in layouts[layouts.index("U"):]:
        # The answer (being written or stored) comes right after the message's controls;
        # its notes, its end and its controls after it.
        assert re.fullmatch(r"U( UB)?( [SA])?( N)*( L)?( TB)?", shown), layouts


def test_an_agent_failure_is_said_and_offers_retry(page: Any, demo: GatewayProcess,
                                                  user: str) -> None:
    open_app(page, demo, user)
    draft(page)
    failed = exchange(page, "/fail")
    chat_id = current_chat(page)
    end = page.locator(f'[data-testid="turn-latency"][data-turn-id="{failed}"]')
    expect(end).to_have_attribute("data-reason", "error")
    # In words (the turn_end's error, from the worker SDK: never the exception's text), in
    # the transcript (the log announces it), and to screen readers at once.
    said = "The agent failed while answering (RuntimeError)."
    expect(end.get_by_test_id("turn-failure")).to_have_text(said)
    expect(end).to_contain_text(re.compile(r"after \d+(\.\d+)? (ms|s)"))
    expect(page.get_by_test_id("announcer")).to_have_text(said)
    # Retry is offered right under it, enabled, and stands out.
    bar = page.locator(f'[data-testid="turn-bar"][data-node-id="{failed}"]')
    retry = bar.get_by_role("button", name="Retry: answer this message again")
    expect(retry).to_be_enabled()
    expect(retry).to_have_class(re.compile(r"\bprimary\b"))
    problems = axe_problems(page, "an agent failure")
    assert not problems, "\n".join(problems)
    retry.click()
    again = head_moved(page, failed)
    answered(page, again)
    expect(fork(page, "turn-bar", again).get_by_test_id("fork-position")).to_have_text("2/2")
    assert_transcript(page, demo, user, chat_id)
    # A turn that answered has a plain Retry.
    exchange(page, "hello")
    expect(page.get_by_test_id("retry")).not_to_have_class(re.compile(r"\bprimary\b"))


def test_edit_a_message_inline(page: Any, demo: GatewayProcess, user: str) -> None:
    open_app(page, demo, user)
    draft(page)
    exchange(page, "first question")
    chat_id = current_chat(page)
    exchange(page, "second question")
    original = user_node(page, "first question")
    bar = page.locator(f'[data-testid="user-bar"][data-node-id="{original}"]')
    bar.get_by_role("button", name="Edit this message").click()
    editor = page.get_by_test_id("message-editor")
    expect(editor.get_by_role("textbox", name="Edited message")).to_have_value("first question")
    editor.get_by_role("textbox", name="Edited message").fill("first question, edited")
    before = head_of(page)
    editor.get_by_role("button", name="Send the edited message").click()
    edited_turn = head_moved(page, before)
    answered(page, edited_turn)
    # The edited version replaces the message and everything after it on screen.
    expect(messages(page, "user")).to_have_text(["first question, edited"])
    expect(messages(page, "assistant")).to_contain_text(["You said: “first question, edited”"])
    edited = user_node(page, "first question, edited")
    expect(fork(page, "user-bar", edited).get_by_test_id("fork-position")).to_have_text("2/2")
    assert_transcript(page, demo, user, chat_id)
    # The first version is one click away, with what followed it.
    fork(page, "user-bar", edited).get_by_role(
        "button", name="Previous version of this message").click()
    expect(messages(page, "user")).to_have_text(["first question", "second question"],
                                                timeout=TURN)
    expect(fork(page, "user-bar", original).get_by_test_id("fork-position")).to_have_text("1/2")
    assert_transcript(page, demo, user, chat_id)


def test_undo_puts_the_text_back(page: Any, demo: GatewayProcess, user: str) -> None:
    open_app(page, demo, user)
    draft(page)
    undo = page.get_by_role("button", name="Undo the last message")
    expect(undo).to_be_disabled()  # nothing said yet
    exchange(page, "one")
    chat_id = current_chat(page)
    kept = head_of(page)
    exchange(page, "two, with a typo")
    taken = user_node(page, "two, with a typo")
    undo.click()
    expect(page.get_by_test_id("message-input")).to_have_value("two, with a typo", timeout=TURN)
    expect(page.get_by_test_id("chat")).to_have_attribute("data-head", kept)
    expect(messages(page, "user")).to_have_text(["one"])
    expect(messages(page, "assistant")).to_have_count(1)
    assert_transcript(page, demo, user, chat_id)
    # Fix it and send again: a new version beside the one taken back.
    page.get_by_test_id("message-input").fill("two, fixed")
    page.get_by_test_id("message-input").press("Enter")
    fixed_turn = head_moved(page, kept)
    answered(page, fixed_turn)
    expect(messages(page, "user")).to_have_text(["one", "two, fixed"])
    fixed = user_node(page, "two, fixed")
    expect(fork(page, "user-bar", fixed).get_by_test_id("fork-position")).to_have_text("2/2")
    fork(page, "user-bar", fixed).get_by_role(
        "button", name="Previous version of this message").click()
    expect(messages(page, "user")).to_have_text(["one", "two, with a typo"], timeout=TURN)
    assert user_node(page, "two, with a typo") == taken
    assert_transcript(page, demo, user, chat_id)


def test_undoing_every_message_says_so_and_offers_the_versions(
        page: Any, demo: GatewayProcess, user: str) -> None:
    open_app(page, demo, user)
    draft(page)
    exchange(page, "A question about Porto")
    chat_id = current_chat(page)
    title = page.get_by_test_id("chat-title")
    expect(title).to_have_text("A question about Porto", timeout=TURN)
    # An edit of the first message: the agent titles the chat after the new version.
    first = user_node(page, "A question about Porto")
    page.locator(f'[data-testid="user-bar"][data-node-id="{first}"]').get_by_role(
        "button", name="Edit this message").click()
    editor = page.get_by_test_id("message-editor").get_by_role("textbox", name="Edited message")
    editor.fill("Lisbon instead, for three days")
    before = head_of(page)
    page.get_by_test_id("message-editor").get_by_role(
        "button", name="Send the edited message").click()
    answered(page, head_moved(page, before))
    expect(title).to_have_text("Lisbon instead, for three days", timeout=TURN)
    expect(sidebar_item(page, chat_id).get_by_test_id("conversation-title")).to_have_text(
        "Lisbon instead, for three days")

    # Undo the only message on the path: not a blank pane, and both versions one click away.
    page.get_by_role("button", name="Undo the last message").click()
    expect(page.get_by_test_id("message-input")).to_have_value(
        "Lisbon instead, for three days", timeout=TURN)
    expect(page.get_by_test_id("chat")).to_have_attribute("data-head", "none")
    undone = page.get_by_test_id("undone")
    expect(undone).to_contain_text("You undid every message. Type a new one below", timeout=TURN)
    back = undone.get_by_test_id("bring-back")
    expect(back).to_have_text(["↩ “A question about Porto”", "↩ “Lisbon instead, for three days”"])
    problems = axe_problems(page, "everything undone")
    assert not problems, "\n".join(problems)
    # So after a reload too.
    page.reload()
    expect(page.get_by_test_id("app")).to_have_attribute("data-ready", "true", timeout=TURN)
    synced(page, chat_id)
    expect(back).to_have_count(2, timeout=TURN)
    undone.get_by_role("button", name="Bring back “A question about Porto” and what followed "
                                       "it").click()
    expect(messages(page, "user")).to_have_text(["A question about Porto"], timeout=TURN)
    expect(messages(page, "assistant")).to_contain_text(["You said: “A question about Porto”"])
    expect(undone).to_have_count(0)
    assert_transcript(page, demo, user, chat_id)


def test_versions_after_a_reload(page: Any, demo: GatewayProcess, user: str) -> None:
    """The forks come from GET .../events on load; a version never loaded is fetched."""
    open_app(page, demo, user)
    draft(page)
    first = exchange(page, "tell me about tiles")
    chat_id = current_chat(page)
    page.get_by_role("button", name="Retry: answer this message again").click()
    second = head_moved(page, first)
    answered(page, second)
    exchange(page, "and about trams")

    page.reload()
    expect(page.get_by_test_id("app")).to_have_attribute("data-ready", "true", timeout=TURN)
    synced(page, chat_id)
    versions = fork(page, "turn-bar", second)
    expect(versions.get_by_test_id("fork-position")).to_have_text("2/2")
    assert_transcript(page, demo, user, chat_id)
    # The first answer's branch was not on the path the page loaded: it is fetched.
    versions.get_by_role("button", name="Previous version of this answer").click()
    expect(page.get_by_test_id("chat")).to_have_attribute("data-head", first, timeout=TURN)
    expect(messages(page, "assistant")).to_have_count(1, timeout=TURN)
    expect(messages(page, "assistant")).to_have_attribute("data-node", first)
    expect(messages(page, "user")).to_have_text(["tell me about tiles"])
    assert_transcript(page, demo, user, chat_id)


def test_second_tab_follows_every_move(page: Any, browser: Any, demo: GatewayProcess,
                                       user: str) -> None:
    open_app(page, demo, user)
    draft(page)
    first = exchange(page, "hello there")
    chat_id = current_chat(page)
    other = browser.new_page()
    errors: list[str] = []
    other.on("pageerror", lambda exc: errors.append(str(exc)))
    try:
        open_app(other, demo, user, chat=chat_id)
        synced(other, chat_id)
        expect(other.get_by_test_id("chat")).to_have_attribute("data-head", first)

        def both(head: str, users: list[str]) -> None:
            for tab in (page, other):
                expect(tab.get_by_test_id("chat")).to_have_attribute("data-head", head,
                                                                      timeout=TURN)
                expect(messages(tab, "user")).to_have_text(users, timeout=TURN)
                assert_transcript(tab, demo, user, chat_id)

        # A retry in one tab: the other shows the new answer and its "2/2". Each move is
        # made in the tab in front, as a person would: a tab in the background gets no
        # animation frames, and every click there waits on them (about 2 s each).
        page.bring_to_front()
        page.get_by_role("button", name="Retry: answer this message again").click()
        second = head_moved(page, first)
        answered(page, second)
        answered(other, second)
        both(second, ["hello there"])
        expect(fork(other, "turn-bar", second).get_by_test_id("fork-position")).to_have_text(
            "2/2")
        # Versions chosen in the second tab: the first follows.
        other.bring_to_front()
        fork(other, "turn-bar", second).get_by_role(
            "button", name="Previous version of this answer").click()
        both(first, ["hello there"])
        # An edit in the first tab.
        page.bring_to_front()
        message = user_node(page, "hello there")
        page.locator(f'[data-testid="user-bar"][data-node-id="{message}"]').get_by_role(
            "button", name="Edit this message").click()
        page.get_by_role("textbox", name="Edited message").fill("hello again")
        page.get_by_role("textbox", name="Edited message").press("Enter")
        edited = head_moved(page, first)
        answered(page, edited)
        answered(other, edited)
        both(edited, ["hello again"])
        # An undo in the second tab: the text comes back there only.
        other.bring_to_front()
        other.get_by_role("button", name="Undo the last message").click()
        expect(other.get_by_test_id("message-input")).to_have_value("hello again",
                                                                   timeout=TURN)
        both("none", [])
        expect(page.get_by_test_id("message-input")).to_have_value("")
    finally:
        other.close()
    assert not errors, f"uncaught errors in the second page: {errors}"


# --- the reference client: type at once, phones, accessibility, rename and delete, links,
# --- errors in words, no token in any URL ------------------------------------------------

AXE = Path(__file__).parent / "js" / "node_modules" / "axe-core" / "axe.min.js"


def sized(page: Any, size: str) -> None:
    page.set_viewport_size(SIZES[size])


def axe_problems(page: Any, state: str) -> list[str]:
    """axe-core's serious and critical violations on the page as it is now."""
    if not AXE.exists():
        pytest.fail(f"{AXE} is missing: `npm install` in tests/js (scripts/test runs it)",
                    pytrace=False)
    if not page.evaluate("() => !!window.axe"):
        # The page's CSP allows scripts from its own origin only: serve axe from there.
        page.route("**/__axe.js", lambda route: route.fulfill(
            body=AXE.read_text(), content_type="text/javascript"))
        page.add_script_tag(url="/__axe.js")
    # target-size (WCAG 2.2's 2.5.8, tagged wcag22aa) is off unless asked for.
    result = page.evaluate("() => axe.run(document, {resultTypes: ['violations'], "
                           "rules: {'target-size': {enabled: true}}})")
    problems = [f"{state}: {v['id']} ({v['impact']}): {v['help']} at "
                f"{[n['target'] for n in v['nodes']][:3]}"
                for v in result["violations"] if v["impact"] in ("serious", "critical")]
    # axe passes a small target with room around it; a finger needs the target itself.
    small = page.eval_on_selector_all(
        "button, a[href], input, textarea, select",
        """els => els.filter(e => e.checkVisibility() && !e.closest('[inert]')).map(e => {
          const r = e.getBoundingClientRect();
          return [e.dataset.testid || e.id || e.tagName, Math.round(r.width * 10) / 10,
                  Math.round(r.height * 10) / 10];
        }).filter(([, w, h]) => w < 24 || h < 24)""")
    problems += [f"{state}: {name} is {w}x{h} px, under 24x24 (WCAG 2.5.8)"
                 for name, w, h in small]
    return problems


def tab_stops(page: Any, count: int) -> list[dict[str, Any]]:
    """Press Tab ``count`` times from the top; what had the focus each time."""
    page.evaluate("() => document.activeElement?.blur()")
    stops = []
    for _ in range(count):
        page.keyboard.press("Tab")
        stops.append(page.evaluate("""() => {
          const el = document.activeElement;
          if (!el || el === document.body) return null;
          const style = getComputedStyle(el);
          const name = (el.getAttribute('aria-label') || el.labels?.[0]?.textContent
                        || el.textContent || el.placeholder || '').trim();
          const r = el.getBoundingClientRect();
          return {testid: el.dataset.testid || el.id || el.tagName, name,
                  visible: el.checkVisibility({visibilityProperty: true, opacityProperty: true})
                           && r.width > 0 && r.height > 0,
                  disabled: el.disabled === true || el.closest('[inert]') !== null,
                  ring: style.outlineStyle !== 'none' && parseFloat(style.outlineWidth) >= 1
                        || style.boxShadow !== 'none'};
        }"""))
    return [stop for stop in stops if stop]


def assert_fits(page: Any, what: str) -> None:
    """Nothing cut off: no sideways scrolling, the controls inside the window, the
    placeholder inside its box."""
    viewport = page.viewport_size
    overflow = page.evaluate("() => document.documentElement.scrollWidth - innerWidth")
    assert overflow <= 0, f"{what}: the page scrolls sideways by {overflow} px"
    for testid in ("chat-title", "connection", "message-input", "send", "undo",
                   "composer-hint", "open-drawer"):
        el = page.get_by_test_id(testid)
        if not el.is_visible():
            continue
        box = el.bounding_box()
        assert box["x"] >= 0 and box["x"] + box["width"] <= viewport["width"] + 0.5, (
            f"{what}: {testid} is cut off: {box}")
        assert box["y"] >= 0 and box["y"] + box["height"] <= viewport["height"] + 0.5, (
            f"{what}: {testid} is cut off: {box}")
    room = page.evaluate("""() => {
      const t = document.getElementById('input');
      const s = getComputedStyle(t);
      const ctx = document.createElement('canvas').getContext('2d');
      ctx.font = `${s.fontWeight} ${s.fontSize} ${s.fontFamily}`;
      return t.clientWidth - parseFloat(s.paddingLeft) - parseFloat(s.paddingRight)
             - ctx.measureText(t.placeholder).width;
    }""")
    assert room >= 0, f"{what}: the placeholder is cut off by {-room:.0f} px"


@BOTH
def test_type_at_once_and_send_becomes_stop(page: Any, demo: GatewayProcess, user: str,
                                           size: str) -> None:
    sized(page, size)
    open_app(page, demo, user)
    box = page.get_by_test_id("message-input")
    # Live on load, with no chat: the first message starts one.
    expect(page.get_by_test_id("chat")).to_have_attribute("data-chat-id", "")
    expect(box).to_be_enabled()
    expect(box).to_be_editable()
    send_box = page.get_by_test_id("send").bounding_box()
    box.fill("/slow")
    box.press("Enter")
    chat_id = current_chat(page)
    assert chat_id.startswith("c_")
    assert f"chat={chat_id}" in page.url
    expect(messages(page, "user")).to_have_text(["/slow"], timeout=TURN)
    show_sidebar(page)
    expect(sidebar_item(page, chat_id)).to_be_visible()
    page.keyboard.press("Escape")  # the drawer (phone); nothing on a desktop
    # While it answers, Send becomes Stop, in its place.
    expect(page.get_by_test_id("streaming-text")).to_contain_text("word3", timeout=TURN)
    stop = page.get_by_test_id("stop")
    expect(stop).to_be_visible()
    expect(page.get_by_test_id("send")).to_be_hidden()
    stop_box = stop.bounding_box()
    assert abs((stop_box["x"] + stop_box["width"]) - (send_box["x"] + send_box["width"])) < 2
    # Enter says why nothing went, and keeps the text (it is not queued).
    box.fill("a second question")
    box.press("Enter")
    hint = page.get_by_test_id("composer-hint")
    expect(hint).to_have_text("The agent is still answering: press Stop, or wait and then send.")
    expect(hint).to_have_attribute("aria-live", "polite")
    expect(box).to_have_value("a second question")
    expect(page.get_by_test_id("pending-message")).to_have_count(0)
    stop.click()
    latency = page.get_by_test_id("turn-latency")
    expect(latency).to_have_attribute("data-reason", "cancelled", timeout=TURN)
    expect(page.get_by_test_id("send")).to_be_visible()
    expect(page.get_by_test_id("message-input")).to_be_focused()
    expect(hint).not_to_contain_text("still answering")
    # Now Enter sends it; multi-line text stays whole.
    box.fill("a second question\nover two lines")
    box.press("Enter")
    expect(messages(page, "user")).to_have_text(["/slow", "a second question\nover two lines"],
                                                timeout=TURN)
    expect(latency).to_have_count(2, timeout=TURN)
    assert_transcript(page, demo, user, chat_id)


def test_a_message_too_long_stays_in_the_box(page: Any, demo: GatewayProcess, user: str) -> None:
    open_app(page, demo, user)
    box = page.get_by_test_id("message-input")
    hint = page.get_by_test_id("composer-hint")
    long_text = "x" * 40_000  # the gateway takes 32 KiB of text

    def refused() -> None:
        expect(hint).to_contain_text("Too long to send: shorten it by about 7,232 characters.")
        expect(hint).to_contain_text("up to 32,768 bytes")
        expect(hint).to_have_attribute("aria-live", "polite")
        expect(box).to_have_value(long_text)  # kept, to shorten
        expect(box).to_have_attribute("aria-invalid", "true")
        expect(page.get_by_test_id("pending-message")).to_have_count(0)

    # A new chat: nothing is created for a message that cannot go.
    box.fill(long_text)
    box.press("Enter")
    refused()
    expect(page.get_by_test_id("chat")).to_have_attribute("data-chat-id", "")
    # In a chat: nothing is sent; shortened, it goes.
    box.fill("")
    chat_id = new_chat(page, "hello")
    expect(page.get_by_test_id("turn-latency")).to_have_count(1, timeout=TURN)
    box.fill(long_text)
    page.get_by_test_id("send").click()
    refused()
    box.fill(long_text[:32_000])
    expect(box).not_to_have_attribute("aria-invalid", "true")
    expect(hint).not_to_contain_text("Too long")
    box.press("Enter")
    expect(messages(page, "user")).to_have_count(2, timeout=TURN)
    expect(box).to_have_value("")
    expect(page.get_by_test_id("turn-latency")).to_have_count(2, timeout=TURN)
    assert_transcript(page, demo, user, chat_id)


@pytest.mark.parametrize("size", ["phone", "zoom200"])
def test_phone_layout(page: Any, demo: GatewayProcess, user: str, size: str,
                      tmp_path: Path) -> None:
    sized(page, size)
    open_app(page, demo, user)
    sidebar = page.get_by_test_id("sidebar")
    opener = page.get_by_test_id("open-drawer")
    # The conversation list is a drawer, closed: not on screen, not in the tab order.
    expect(sidebar).not_to_be_in_viewport()
    expect(page.get_by_test_id("new-chat")).to_be_hidden()
    expect(opener).to_be_visible()
    expect(opener).to_have_attribute("aria-expanded", "false")
    assert_fits(page, f"{size}, empty")
    first = new_chat(page, "first chat")
    expect(page.get_by_test_id("turn-latency")).to_have_count(1, timeout=TURN)
    second = new_chat(page, "second chat")
    expect(page.get_by_test_id("turn-latency")).to_have_count(1, timeout=TURN)
    # It opens over the chat, takes the focus, and goes with Escape.
    opener.click()
    expect(sidebar).to_be_in_viewport()
    expect(opener).to_have_attribute("aria-expanded", "true")
    expect(page.get_by_test_id("chat")).to_have_attribute("inert", "")
    focused = page.evaluate(
        "() => document.getElementById('sidebar').contains(document.activeElement)")
    assert focused, "the open drawer does not hold the focus"
    page.keyboard.press("Escape")
    expect(sidebar).not_to_be_in_viewport()
    expect(opener).to_be_focused()
    # Choosing a chat in it closes it; so does the scrim.
    opener.click()
    sidebar_item(page, first).get_by_test_id("conversation-title").click()
    synced(page, first)
    expect(sidebar).not_to_be_in_viewport()
    opener.click()
    page.get_by_test_id("scrim").click(position={"x": SIZES[size]["width"] - 10, "y": 200})
    expect(sidebar).not_to_be_in_viewport()
    assert second
    # The box grows with its text (up to a bound, then scrolls), and nothing is cut off.
    box = page.get_by_test_id("message-input")
    one_line = box.bounding_box()["height"]
    box.fill("\n".join(f"line {i}" for i in range(1, 4)))
    three_lines = box.bounding_box()["height"]
    assert three_lines > one_line + 20, (one_line, three_lines)
    box.fill("\n".join(f"line {i}" for i in range(1, 40)))
    many = box.bounding_box()["height"]
    assert three_lines < many <= SIZES[size]["height"] * 0.35, (three_lines, many)
    assert_fits(page, f"{size}, a long draft")
    box.fill("")
    assert_fits(page, f"{size}, a chat")
    shot = os.environ.get("GATEWAY_SCREENSHOT_PHONE")
    if size == "phone":
        page.get_by_test_id("message-input").blur()
        page.screenshot(path=shot or str(tmp_path / "phone.png"))


@BOTH
def test_accessible_transcript_and_controls(page: Any, demo: GatewayProcess, user: str,
                                           size: str) -> None:
    sized(page, size)
    open_app(page, demo, user)
    problems = axe_problems(page, "a new chat")
    chat_id = new_chat(page, "Plan a weekend in Lisbon")
    expect(page.get_by_test_id("turn-latency")).to_have_count(1, timeout=TURN)
    send(page, "/goal Plan a 3-day trip to Lisbon")
    expect(page.get_by_test_id("goal-strip")).to_be_visible(timeout=TURN)
    expect(page.get_by_test_id("turn-latency")).to_have_count(2, timeout=TURN)
    # The transcript is a log; each message says who wrote it.
    log = page.get_by_role("log", name="Conversation")
    expect(log).to_have_attribute("aria-live", "polite")
    authors = page.eval_on_selector_all(
        '[data-testid="messages"] .msg',
        "els => els.map(e => e.querySelector('.sr-only')?.textContent)")
    assert authors == ["You said: ", "The agent said: ", "You said: ", "The agent said: "], authors
    problems += axe_problems(page, "a chat with a goal")

    # The answer being written is not announced as it grows: the log announces the whole
    # message once; a status line says that the agent is answering.
    send(page, "/slow")
    streaming = page.get_by_test_id("streaming")
    expect(streaming).to_contain_text("word3", timeout=TURN)
    expect(streaming).to_have_attribute("aria-live", "off")
    expect(streaming).to_have_attribute("aria-busy", "true")
    expect(page.get_by_test_id("announcer")).to_have_text("The agent is answering.")
    problems += axe_problems(page, "an answer being written")

    # Every stop of the tab order is a visible, enabled, named control with a focus ring.
    stops = tab_stops(page, 14)
    assert stops, "Tab reaches nothing"
    for stop in stops:
        assert stop["visible"] and not stop["disabled"], stop
        assert stop["name"], f"a control without a name: {stop}"
        assert stop["ring"], f"no visible focus on {stop}"
    reached = {stop["testid"] for stop in stops}
    assert {"message-input", "stop"} <= reached, reached
    assert "send" not in reached  # hidden while Stop stands in its place
    if size == "desktop":
        assert {"new-chat", "rename", "delete"} <= reached, reached
    else:
        assert "new-chat" not in reached and "open-drawer" in reached, reached
    page.get_by_test_id("stop").click()
    expect(page.get_by_test_id("send")).to_be_visible(timeout=TURN)

    # Every control of the transcript on screen: versions (< 2/2 >), Edit, Retry.
    stopped = head_of(page)
    page.get_by_role("button", name="Retry: answer this message again").click()
    answered(page, head_moved(page, stopped))
    for control in ("fork-prev", "fork-position", "fork-next", "edit", "retry"):
        expect(page.get_by_test_id(control).first).to_be_visible()
    problems += axe_problems(page, "versions, Edit and Retry")

    show_sidebar(page)
    problems += axe_problems(page, "the conversation list")
    sidebar_item(page, chat_id).get_by_test_id("rename").click()
    problems += axe_problems(page, "renaming")
    page.get_by_test_id("rename-cancel").click()
    sidebar_item(page, chat_id).get_by_test_id("delete").click()
    problems += axe_problems(page, "confirming a deletion")
    page.get_by_test_id("delete-cancel").click()
    assert not problems, "\n".join(problems)


@BOTH
def test_rename_and_delete_from_the_sidebar(page: Any, browser: Any, demo: GatewayProcess,
                                            user: str, size: str) -> None:
    sized(page, size)
    open_app(page, demo, user)
    keep = new_chat(page, "/goal keep this one")
    expect(page.get_by_test_id("turn-latency")).to_have_count(1, timeout=TURN)
    chat_id = new_chat(page, "/done")  # a quick turn (no goal to complete)
    expect(page.get_by_test_id("turn-latency")).to_have_count(1, timeout=TURN)
    other = browser.new_page()  # a second device, showing the same chat
    errors: list[str] = []
    other.on("pageerror", lambda exc: errors.append(str(exc)))
    try:
        open_app(other, demo, user, chat=chat_id)
        synced(other, chat_id)
        # A chat started with a slash command is not titled with the command.
        title = sidebar_item(other, chat_id).get_by_test_id("conversation-title")
        expect(title).not_to_have_text("/done")

        # Back to the first device's tab: a tab in the background gets no animation
        # frames, and every click waits on them (about 2 s each).
        page.bring_to_front()
        show_sidebar(page)
        sidebar_item(page, chat_id).get_by_test_id("rename").click()
        field = page.get_by_role("textbox", name="Conversation title")
        expect(field).to_be_focused()
        # The title, Save and Cancel on one line, none cut off.
        row = [page.get_by_test_id(t).bounding_box()
               for t in ("rename-input", "rename-save", "rename-cancel")]
        middles = [box["y"] + box["height"] / 2 for box in row]
        assert max(middles) - min(middles) < 2, row
        assert row[0]["width"] >= 100, row
        sidebar = page.get_by_test_id("sidebar").bounding_box()
        assert row[2]["x"] + row[2]["width"] <= sidebar["x"] + sidebar["width"], (row, sidebar)
        field.fill("  Quick   words, renamed ")
        field.press("Enter")
        expect(sidebar_item(page, chat_id).get_by_test_id("conversation-title")).to_have_text(
            "Quick words, renamed", timeout=TURN)
        # The other device heard it from the feed.
        expect(title).to_have_text("Quick words, renamed", timeout=TURN)
        expect(other.get_by_test_id("chat-title")).to_have_text("Quick words, renamed")
        got = httpx.get(f"{demo.http}/v1/conversations/{chat_id}", headers=demo.headers(user))
        assert got.json()["title"] == "Quick words, renamed"

        # Escape leaves the title as it was.
        sidebar_item(page, chat_id).get_by_test_id("rename").click()
        page.get_by_role("textbox", name="Conversation title").fill("not this")
        page.get_by_role("textbox", name="Conversation title").press("Escape")
        expect(sidebar_item(page, chat_id).get_by_test_id("conversation-title")).to_have_text(
            "Quick words, renamed")

        # Delete asks first; Keep keeps it.
        sidebar_item(page, chat_id).get_by_test_id("delete").click()
        expect(page.get_by_test_id("delete-cancel")).to_be_focused()
        page.get_by_test_id("delete-cancel").click()
        expect(sidebar_item(page, chat_id)).to_have_count(1)
        sidebar_item(page, chat_id).get_by_test_id("delete").click()
        page.get_by_test_id("delete-confirm").click()
        expect(sidebar_item(page, chat_id)).to_have_count(0, timeout=TURN)
        expect(page.get_by_test_id("chat")).to_have_attribute("data-chat-id", "")
        expect(page.get_by_test_id("message-input")).to_be_focused()
        # Gone on the other device too, which says so, and from the API.
        expect(sidebar_item(other, chat_id)).to_have_count(0, timeout=TURN)
        expect(other.get_by_test_id("chat")).to_have_attribute("data-chat-id", "")
        # Said quietly where the chat was (no alert over the other chats), and said once.
        line = other.get_by_test_id("gone")
        expect(line).to_have_text("“Quick words, renamed” was deleted on another device.")
        expect(other.get_by_test_id("notice")).to_be_hidden()
        expect(other.get_by_test_id("announcer")).to_have_text(
            "“Quick words, renamed” was deleted on another device.")
        gone = httpx.get(f"{demo.http}/v1/conversations/{chat_id}", headers=demo.headers(user))
        assert gone.status_code == 404
        listed = httpx.get(f"{demo.http}/v1/conversations", headers=demo.headers(user)).json()
        assert [c["chat_id"] for c in listed["conversations"]] == [keep]
        expect(sidebar_item(other, keep)).to_have_count(1)
        # It concerns only that chat: opening another one takes it away.
        other.bring_to_front()
        show_sidebar(other)
        sidebar_item(other, keep).get_by_test_id("conversation-title").click()
        synced(other, keep)
        expect(line).to_be_hidden()
    finally:
        other.close()
    assert not errors, f"uncaught errors in the second page: {errors}"


@BOTH
def test_a_link_to_a_missing_chat_creates_nothing(page: Any, demo: GatewayProcess, user: str,
                                                 size: str) -> None:
    sized(page, size)
    missing = "does_not_exist_" + user
    open_app(page, demo, user, chat=missing)
    notice = page.get_by_test_id("notice")
    expect(notice).to_contain_text(f"There is no conversation “{missing}”", timeout=TURN)
    expect(page.get_by_test_id("chat")).to_have_attribute("data-chat-id", "")
    assert "chat=" not in page.url
    assert httpx.get(f"{demo.http}/v1/conversations/{missing}",
                     headers=demo.headers(user)).status_code == 404
    listed = httpx.get(f"{demo.http}/v1/conversations", headers=demo.headers(user)).json()
    assert listed["conversations"] == []
    expect(sidebar_item(page, missing)).to_have_count(0)
    problems = axe_problems(page, "a link to a missing chat")
    assert not problems, "\n".join(problems)
    # Typing still works: a new chat, not that one.
    chat_id = new_chat(page, "hello")
    assert chat_id != missing
    assert httpx.get(f"{demo.http}/v1/conversations/{missing}",
                     headers=demo.headers(user)).status_code == 404


@BOTH
def test_a_refused_token_says_what_to_do(page: Any, demo: GatewayProcess, user: str,
                                        size: str) -> None:
    sized(page, size)
    page.clock.install()  # to see the notice outlive the old 6 s without waiting for it
    for token, words in (("not-a-token", "was not accepted"),
                         (demo.token(user, ttl=-60), "has expired")):
        page.goto(f"{demo.http}/?token={token}")
        notice = page.get_by_test_id("notice")
        expect(notice).to_contain_text(f"Your sign-in {words}", timeout=TURN)
        expect(notice).to_contain_text("gateway serve --dev")
        expect(page.get_by_test_id("connection")).to_have_attribute("data-state", "closed")
        expect(page.get_by_test_id("connection-label")).to_have_text("Not signed in")
        # What cannot work is off, and looks it.
        expect(page.get_by_test_id("message-input")).to_be_disabled()
        expect(page.get_by_test_id("send")).to_be_disabled()
        show_sidebar(page)
        expect(page.get_by_test_id("new-chat")).to_be_disabled()
        page.keyboard.press("Escape")
        # No parser's or server's words reach the page.
        text = page.locator("body").inner_text()
        for internal in ("segments", "invalid token", "Signature", "JWT", "decode", "4001"):
            assert internal not in text, f"{internal!r} shown: {text!r}"
        page.clock.run_for(10_000)
        expect(notice).to_be_visible()
        expect(page.get_by_test_id("notice-close")).to_be_hidden()
        problems = axe_problems(page, f"signed out ({words})")
        assert not problems, "\n".join(problems)


def test_page_without_token_explains_itself(page: Any, demo: GatewayProcess) -> None:
    page.goto(f"{demo.http}/")
    expect(page.get_by_test_id("notice")).to_contain_text("gateway serve --dev")
    expect(page.get_by_test_id("connection")).to_have_attribute("data-state", "closed")
    expect(page.get_by_test_id("message-input")).to_be_disabled()


def test_a_token_about_to_expire_is_refreshed_in_band_and_the_socket_stays(
        page: Any, start_gateway: Any, browser_redis: str, user: str) -> None:
    """The page's token expires soon; a fresher sign-in is kept for the tab (as a sign-in
    would keep it) before the gateway says `token_expiring`. The page's token callback hands
    it over in band: past the first token's expiry the socket is the same one (no reconnect,
    no second ticket), and a turn works on it."""
    ttl, before = 12, 7  # token_expiring about 5 s after the page's token was made
    gw = start_demo_gateway(start_gateway, browser_redis, token_refresh_before=before)
    tickets: list[str] = []
    page.on("request", lambda r: tickets.append(r.url) if "/v1/ws-ticket" in r.url else None)
    short = gw.token(user, ttl=ttl)
    expires = time.time() + ttl
    page.goto(f"{gw.http}/?token={short}")
    expect(page.get_by_test_id("connection")).to_have_attribute("data-state", "open",
                                                                 timeout=TURN)
    page.evaluate("""() => {
      window.__refresh = { states: [], refreshed: [], failed: [] };
      demo.client.on("state", (s) => __refresh.states.push(s.state));
      demo.client.on("token_refreshed", (e) => __refresh.refreshed.push(e.expiresAt));
      demo.client.on("token_refresh_failed", (e) => __refresh.failed.push(e.error.code));
    }""")
    first = page.evaluate("() => demo.client.hello.connection_id")
    fresh = gw.token(user, ttl=3600)
    page.evaluate("(t) => sessionStorage.setItem('gateway-demo-token', t)", fresh)
    assert time.time() < expires - before, "the page took too long: the refresh came first"

    page.wait_for_function("() => __refresh.refreshed.length > 0 || __refresh.failed.length > 0",
                           timeout=(before + 5) * 1000)
    record = page.evaluate("() => __refresh")
    assert record["failed"] == [], record
    assert record["refreshed"][0] / 1000 > time.time() + 3000, record
    # Past the first token's expiry (and its 4011, had it not been refreshed): the same socket.
    page.wait_for_timeout(max(0.0, expires + 1.5 - time.time()) * 1000)
    record = page.evaluate("() => __refresh")
    assert record["states"] == [], f"the socket was replaced: {record}"
    assert page.evaluate("() => demo.client.hello?.connection_id") == first
    expect(page.get_by_test_id("connection")).to_have_attribute("data-state", "open")
    assert len(tickets) == 1, tickets
    # The connection runs on the fresh token: a turn goes through.
    new_chat(page, "hello")
    expect(messages(page, "assistant")).to_have_count(1, timeout=TURN)
    assert page.evaluate("() => demo.client.hello?.connection_id") == first


def test_a_page_disconnected_by_an_administrator_stays_disconnected(
        page: Any, demo: GatewayProcess, user: str) -> None:
    """4005 is terminal: the page says why and does not come back by itself."""
    open_app(page, demo, user)
    page.evaluate("""() => {
      window.__states = [];
      demo.client.on("state", (s) => __states.push(s.state));
    }""")
    resp = httpx.post(f"{demo.http}/v1/admin/disconnect",
                      json={"user_id": user, "reason": "account suspended"},
                      headers=demo.headers("ops", "service"))
    assert resp.status_code == 202, resp.text
    notice = page.get_by_test_id("notice")
    expect(notice).to_contain_text(
        "You were disconnected by an administrator: account suspended", timeout=TURN)
    connection = page.get_by_test_id("connection")
    expect(connection).to_have_attribute("data-state", "closed")
    expect(page.get_by_test_id("connection-label")).to_have_text("Disconnected")
    page.wait_for_timeout(1500)  # longer than any first reconnect (0 to 0.5 s)
    assert page.evaluate("() => __states") == ["closed"]
    expect(connection).to_have_attribute("data-state", "closed")


@BOTH
def test_the_list_catches_up_after_a_reconnect(page: Any, restartable: GatewayProcess,
                                               demo: GatewayProcess, user: str,
                                               size: str) -> None:
    """Feed frames sent while the page was away are not replayed: the page lists again."""
    sized(page, size)
    gw = restartable
    open_app(page, gw, user)
    chat_id = new_chat(page, "hello")
    expect(page.get_by_test_id("turn-latency")).to_have_count(1, timeout=TURN)
    gw.stop()
    connection = page.get_by_test_id("connection")
    expect(connection).not_to_have_attribute("data-state", "open", timeout=RECONNECT)
    # Meanwhile, through another gateway on the same Redis: a new chat, and a rename.
    made = httpx.post(f"{demo.http}/v1/conversations", json={"title": "Made while away"},
                      headers=demo.headers(user))
    assert made.status_code == 201, made.text
    renamed = httpx.patch(f"{demo.http}/v1/conversations/{chat_id}",
                          json={"title": "Renamed while away"}, headers=demo.headers(user))
    assert renamed.status_code == 200, renamed.text
    gw.start()
    expect(connection).to_have_attribute("data-state", "open", timeout=RECONNECT)
    show_sidebar(page)
    expect(sidebar_item(page, made.json()["chat_id"]).get_by_test_id(
        "conversation-title")).to_have_text("Made while away", timeout=TURN)
    expect(sidebar_item(page, chat_id).get_by_test_id("conversation-title")).to_have_text(
        "Renamed while away", timeout=TURN)


def test_no_token_in_the_address_bar_a_console_or_a_socket_url(
        page: Any, restartable: GatewayProcess, user: str) -> None:
    gw = restartable
    token = gw.token(user)
    console: list[str] = []
    sockets: list[str] = []
    requests: list[str] = []
    page.on("console", lambda msg: console.append(msg.text))
    page.on("websocket", lambda ws: sockets.append(ws.url))
    page.on("request", lambda req: requests.append(req.url))
    page.goto(f"{gw.http}/?token={token}")
    expect(page.get_by_test_id("connection")).to_have_attribute("data-state", "open",
                                                                 timeout=TURN)
    assert "token" not in page.url and token not in page.url
    assert page.evaluate("() => location.href.includes('token')") is False
    chat_id = new_chat(page, "hello")
    expect(page.get_by_test_id("turn-latency")).to_have_count(1, timeout=TURN)
    # A restart: Chromium logs each failed socket with its URL.
    gw.stop()
    connection = page.get_by_test_id("connection")
    expect(connection).not_to_have_attribute("data-state", "open", timeout=RECONNECT)
    page.wait_for_function("() => document.querySelector('[data-testid=connection-label]')"
                           ".textContent.startsWith('Reconnecting in')", timeout=RECONNECT)
    gw.start()
    expect(connection).to_have_attribute("data-state", "open", timeout=RECONNECT)
    # A reload of the tab signs in again from sessionStorage; the URL stays clean.
    page.reload()
    expect(connection).to_have_attribute("data-state", "open", timeout=TURN)
    synced(page, chat_id)
    assert "token" not in page.url
    assert len(sockets) >= 3, sockets
    assert any("ticket=" in url for url in sockets), sockets
    assert any("Failed" in line or "failed" in line for line in console), console
    assert token in requests[0]  # the link the test opened: the page's only one with it
    for where, seen in (("console", console), ("WebSocket URL", sockets),
                        ("request URL", requests[1:])):
        leaked = [line for line in seen if token in line or "token=" in line]
        assert not leaked, f"the token in a {where}: {leaked}"


# --- what an agent does besides answering: tool calls, steps, its state; named agents ----


def scripted_chat(gw: GatewayProcess, user: str) -> str:
    """A conversation of an agent no worker runs (its turns wait in their inbox): the test
    plays that agent, publishing over HTTP as a service, each publish naming its turn."""
    chat_id = f"c_{uuid.uuid4().hex[:12]}"
    resp = httpx.post(f"{gw.http}/v1/conversations", headers=gw.headers(user),
                      json={"chat_id": chat_id, "agent": f"scripted-{uuid.uuid4().hex[:8]}"})
    assert resp.status_code == 201, resp.text
    return chat_id


def as_agent(gw: GatewayProcess, chat_id: str, turn_id: str, *events: dict[str, Any]) -> None:
    """Publish ``events`` (one batch) for the turn ``turn_id``, as its agent would."""
    resp = httpx.post(f"{gw.http}/v1/conversations/{chat_id}/events",
                      json={"events": list(events), "turn_id": turn_id},
                      headers=gw.headers("agent", "service"))
    assert resp.status_code == 200, resp.text


def step(name: str, status: str) -> dict[str, Any]:
    return {"type": "step", "data": {"name": name, "status": status}, "durable": False}


def ask(page: Any, text: str) -> str:
    """Send ``text`` in a scripted chat; returns the turn it started, once the page runs it."""
    before = head_of(page)
    send(page, text)
    turn = head_moved(page, before)
    expect(page.get_by_test_id("chat-status")).to_have_attribute("data-status", "running",
                                                                 timeout=TURN)
    return turn


def before(first: Any, second: Any) -> bool:
    """Whether ``first`` comes before ``second`` in the page."""
    ok: bool = first.evaluate("(a, b) => !!(a.compareDocumentPosition(b) & "
                              "Node.DOCUMENT_POSITION_FOLLOWING)", second.element_handle())
    return ok


@BOTH
def test_tool_calls_are_rows_that_open_on_their_arguments_and_result(
        page: Any, demo: GatewayProcess, user: str, size: str) -> None:
    sized(page, size)
    chat_id = scripted_chat(demo, user)
    open_app(page, demo, user, chat=chat_id)
    synced(page, chat_id)
    turn = ask(page, "Which tram goes to Belém?")
    as_agent(demo, chat_id, turn, {"type": "tool_call", "data": {
        "call_id": "call_1", "name": "search_timetable", "args": {"line": 15, "to": "Belém"}}})
    row = page.locator('[data-testid="tool-call"][data-call-id="call_1"]')
    expect(row).to_be_visible(timeout=TURN)
    # Collapsed: its name, its arguments in a line, running until its result comes.
    expect(row.get_by_test_id("tool-name")).to_have_text("search_timetable")
    expect(row.get_by_test_id("tool-brief")).to_have_text('line: 15 · to: "Belém"')
    expect(row.get_by_test_id("tool-status")).to_have_text("running…")
    expect(row).to_have_js_property("open", False)
    expect(row.get_by_test_id("tool-args")).to_be_hidden()
    as_agent(demo, chat_id, turn, {"type": "tool_result", "data": {
        "call_id": "call_1", "result": {"departs": "12:04", "stop": "Praça da Figueira"}}})
    expect(row.get_by_test_id("tool-status")).to_have_text("done", timeout=TURN)
    as_agent(demo, chat_id, turn, {"type": "message", "data": {"text": "Tram 15, at 12:04."}},
             {"type": "turn_end", "data": {}})
    answered(page, turn)
    answer = messages(page, "assistant")
    expect(answer).to_have_text("Tram 15, at 12:04.")
    assert before(row, answer), "the tool row comes before the answer it led to"
    expect(row).to_have_count(1)

    # Opened from the keyboard (a <details>: its summary is a button), on both.
    summary = row.locator("summary")
    summary.focus()
    page.keyboard.press("Enter")
    expect(row).to_have_js_property("open", True)
    args = row.get_by_test_id("tool-args")
    expect(args).to_be_visible()
    expect(args).to_contain_text('"line": 15')
    expect(args).to_contain_text('"to": "Belém"')
    expect(row.get_by_test_id("tool-result")).to_contain_text('"stop": "Praça da Figueira"')
    problems = axe_problems(page, "a tool row opened")
    assert not problems, "\n".join(problems)
    page.keyboard.press("Enter")
    expect(row).to_have_js_property("open", False)
    expect(args).to_be_hidden()

    # From the history after a reload: the same row, with its result.
    page.reload()
    expect(page.get_by_test_id("app")).to_have_attribute("data-ready", "true", timeout=TURN)
    synced(page, chat_id)
    expect(row).to_have_count(1)
    expect(row.get_by_test_id("tool-status")).to_have_text("done")
    row.locator("summary").click()
    expect(row.get_by_test_id("tool-result")).to_contain_text('"departs": "12:04"')
    assert_transcript(page, demo, user, chat_id)


def test_a_step_shows_under_the_answer_while_it_runs(page: Any, demo: GatewayProcess,
                                                     user: str) -> None:
    chat_id = scripted_chat(demo, user)
    open_app(page, demo, user, chat=chat_id)
    synced(page, chat_id)
    turn = ask(page, "Is there a bakery open nearby?")
    line = page.get_by_test_id("step")
    expect(line).to_have_count(0)
    as_agent(demo, chat_id, turn, step("search_places", "started"))
    expect(line).to_have_text("search places…", timeout=TURN)
    # Under the answer being written.
    as_agent(demo, chat_id, turn, {"type": "delta", "data": {"text": "There is one "},
                                   "durable": False})
    streaming = page.get_by_test_id("streaming-text")
    expect(streaming).to_have_text("There is one ", timeout=TURN)
    assert before(streaming, line)
    as_agent(demo, chat_id, turn, step("search_places", "finished"))
    expect(line).to_have_count(0, timeout=TURN)
    # One that is still running when the turn ends goes with the turn.
    as_agent(demo, chat_id, turn, step("check_hours", "started"))
    expect(line).to_have_text("check hours…", timeout=TURN)
    as_agent(demo, chat_id, turn, {"type": "message", "data": {"text": "There is one open."}},
             {"type": "turn_end", "data": {}})
    answered(page, turn)
    expect(line).to_have_count(0)
    assert_transcript(page, demo, user, chat_id)


def test_the_agent_state_panel_is_hydrated_on_reload_and_updated_live(
        page: Any, demo: GatewayProcess, user: str) -> None:
    chat_id = scripted_chat(demo, user)
    open_app(page, demo, user, chat=chat_id)
    synced(page, chat_id)
    panel = page.get_by_test_id("agent-state")
    line = page.get_by_test_id("agent-state-brief")
    expect(panel).to_be_hidden()  # no state yet: no panel
    turn = ask(page, "Plan three days in Lisbon")
    as_agent(demo, chat_id, turn, {"type": "state",
                                   "data": {"snapshot": {"city": "Lisbon", "days": 3}}})
    expect(panel).to_be_visible(timeout=TURN)
    expect(line).to_have_text('city: "Lisbon" · days: 3')
    expect(panel).to_have_js_property("open", False)  # small: a line, until opened
    as_agent(demo, chat_id, turn, {"type": "message", "data": {"text": "Done."}},
             {"type": "turn_end", "data": {}})
    answered(page, turn)

    page.reload()
    expect(page.get_by_test_id("app")).to_have_attribute("data-ready", "true", timeout=TURN)
    synced(page, chat_id)
    expect(panel).to_be_visible()
    expect(line).to_have_text('city: "Lisbon" · days: 3')

    turn = ask(page, "Make it four, with Sintra")
    as_agent(demo, chat_id, turn, {"type": "state", "data": {"snapshot": {
        "city": "Lisbon", "days": 4, "stops": ["Sintra"]}}})
    expect(line).to_have_text('city: "Lisbon" · days: 4 · stops: [1]', timeout=TURN)
    panel.locator("summary").click()
    json_view = page.get_by_test_id("agent-state-json")
    expect(json_view).to_be_visible()
    expect(json_view).to_contain_text('"days": 4')
    expect(json_view).to_contain_text('"Sintra"')
    problems = axe_problems(page, "the agent state panel opened")
    assert not problems, "\n".join(problems)
    as_agent(demo, chat_id, turn, {"type": "turn_end", "data": {}})
    answered(page, turn)
    # Another conversation (a new one) has no state: no panel.
    draft(page)
    expect(panel).to_be_hidden()


@contextlib.contextmanager
def named_agents(redis_url: str, *names: str) -> Iterator[None]:
    """In-process AgentWorkers, one per name, each answering "<name> here"."""
    with running_agents(redis_url, {name: answering(name) for name in names}):
        yield


@contextlib.contextmanager
def running_agents(redis_url: str, handlers: dict[str, Any]) -> Iterator[None]:
    """In-process AgentWorkers, one per agent name and its handler, on an event loop of
    their own (Playwright's sync API holds this thread's)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    stack = contextlib.AsyncExitStack()

    async def start() -> None:
        for name, handler in handlers.items():
            await stack.enter_async_context(
                agent_worker(redis_url, handler, "agents", name=name))

    try:
        asyncio.run_coroutine_threadsafe(start(), loop).result(TURN / 1000)
        yield
    finally:
        asyncio.run_coroutine_threadsafe(stack.aclose(), loop).result(TURN / 1000)
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()


def test_new_chat_offers_the_live_agents_and_the_header_names_the_one_chosen(
        page: Any, demo: GatewayProcess, browser_redis: str, user: str) -> None:
    suffix = uuid.uuid4().hex[:8]
    alpha, beta = f"alpha-{suffix}", f"beta-{suffix}"
    header = page.get_by_test_id("chat-agent")
    picker = page.get_by_test_id("agent-select")
    with named_agents(browser_redis, alpha, beta):
        open_app(page, demo, user)
        draft(page)
        # The demo agent (default) and the two: each live agent is offered, default first picked.
        expect(picker).to_be_visible(timeout=TURN)
        expect(picker.locator("option")).to_have_text(
            [alpha, beta, "default"], timeout=TURN)
        expect(picker).to_have_value("default")
        problems = axe_problems(page, "new chat with three live agents")
        assert not problems, "\n".join(problems)
        picker.select_option(beta)
        send(page, "Who is answering?")
        chat_id = current_chat(page)
        expect(header).to_have_text(f"agent: {beta}")
        expect(messages(page, "assistant")).to_have_text(f"{beta} here", timeout=TURN)
        stored = httpx.get(f"{demo.http}/v1/conversations/{chat_id}", headers=demo.headers(user))
        assert stored.json()["agent"] == beta
        expect(picker).to_be_hidden()  # a conversation names its agent for good
        # The next new chat offers the one picked last.
        draft(page)
        expect(picker).to_have_value(beta)
        picker.select_option(alpha)
        send(page, "And now?")
        other = current_chat(page)
        assert other != chat_id
        expect(header).to_have_text(f"agent: {alpha}")
        expect(messages(page, "assistant")).to_have_text(f"{alpha} here", timeout=TURN)
        show_sidebar(page)
        sidebar_item(page, chat_id).locator(".select").click()
        synced(page, chat_id)
        expect(header).to_have_text(f"agent: {beta}")

    # Their workers stopped: only the demo agent is live, and "New chat" is one click again.
    draft(page)
    expect(page.get_by_test_id("agent-pick")).to_be_hidden(timeout=TURN)
    send(page, "hello")
    current_chat(page)
    expect(header).to_have_text("agent: default")
    expect(page.get_by_test_id("turn-latency")).to_have_count(1, timeout=TURN)


# --- client tools: the agent asks, any tab answers ----------------------------------------

APPROVE = {"name": "approve_payment", "description": "Approve this payment from your account",
           "parameters": {"type": "object", "required": ["amount"],
                          "properties": {"amount": {"type": "number"}}},
           "result": {"type": "object", "required": ["approved"],
                      "properties": {"approved": {"type": "boolean"}}}}


def asking_chat(gw: GatewayProcess, user: str, agent: str, tool: dict[str, Any]) -> str:
    """A conversation answered by ``agent`` (an asking handler), with ``tool`` declared over
    HTTP as its client tool."""
    chat_id = f"c_{uuid.uuid4().hex[:12]}"
    resp = httpx.post(f"{gw.http}/v1/conversations", headers=gw.headers(user),
                      json={"chat_id": chat_id, "agent": agent})
    assert resp.status_code == 201, resp.text
    resp = httpx.patch(f"{gw.http}/v1/conversations/{chat_id}", headers=gw.headers(user),
                       json={"client_tools": [tool]})
    assert resp.status_code == 200, resp.text
    return chat_id


class HeldSocket:
    """A page's WebSocket through Playwright's route, so that what the gateway sends can be
    held back for a moment (a network that stalls one way) and then delivered in order."""

    def __init__(self, page: Any) -> None:
        self.held: list[tuple[Any, str | bytes]] | None = None
        page.route_web_socket(lambda url: "/v1/ws" in url, self._route)

    def _route(self, ws: Any) -> None:
        server = ws.connect_to_server()
        ws.on_message(server.send)
        server.on_message(lambda message: self._down(ws, message))

    def _down(self, ws: Any, message: str | bytes) -> None:
        if self.held is None:
            ws.send(message)
        else:
            self.held.append((ws, message))

    def hold(self) -> None:
        self.held = []

    def release(self) -> None:
        held, self.held = self.held or [], None
        for ws, message in held:
            ws.send(message)


def waiting_prompt(page: Any) -> Any:
    """The prompt that waits for an answer, once there is one (whatever its state later)."""
    waiting = page.locator('[data-testid="prompt"][data-state="waiting"]')
    expect(waiting).to_have_count(1, timeout=TURN)
    call_id = waiting.get_attribute("data-call-id")
    return page.locator(f'[data-testid="prompt"][data-call-id="{call_id}"]')


def test_a_client_tool_asks_every_tab_and_the_first_answer_wins(
        page: Any, browser: Any, demo: GatewayProcess, browser_redis: str, user: str) -> None:
    agent = f"asker-{uuid.uuid4().hex[:8]}"
    other = browser.new_page()  # a second tab of the same person, phone-sized
    errors: list[str] = []
    other.on("pageerror", lambda exc: errors.append(str(exc)))
    try:
        sized(other, "phone")
        network = HeldSocket(other)
        with running_agents(browser_redis, {agent: asking_handler([])}):
            chat_id = asking_chat(demo, user, agent, APPROVE)
            for tab in (page, other):
                open_app(tab, demo, user, chat=chat_id)
                synced(tab, chat_id)
            send(page, "Pay the hotel")
            # The question shows on both tabs, live: the tool, what it is for, its arguments,
            # and Approve and Reject (the tool's result schema has a boolean `approved`).
            for tab in (page, other):
                prompt = waiting_prompt(tab)
                expect(prompt.get_by_test_id("prompt-tool")).to_have_text("approve_payment")
                expect(prompt.get_by_test_id("prompt-description")).to_have_text(
                    APPROVE["description"])
                expect(prompt.get_by_test_id("prompt-args")).to_contain_text("42.5")
                expect(prompt.get_by_role("button", name="Approve")).to_be_visible()
                expect(prompt.get_by_role("button", name="Reject")).to_be_visible()
            # A tab that opens the conversation later shows it pending too.
            page.reload()
            expect(page.get_by_test_id("app")).to_have_attribute("data-ready", "true",
                                                                 timeout=TURN)
            synced(page, chat_id)
            prompt = waiting_prompt(page)
            problems = axe_problems(page, "a client tool's prompt") + axe_problems(
                other, "a client tool's prompt on a phone")
            assert not problems, "\n".join(problems)
            assert_fits(other, "a client tool's prompt on a phone")

            # One tab approves: the other's prompt turns answered, and cannot answer again.
            prompt.get_by_role("button", name="Approve").click()
            expect(prompt).to_have_attribute("data-state", "answered", timeout=TURN)
            expect(prompt.get_by_test_id("prompt-answer")).to_have_text(
                "You answered: Approved", timeout=TURN)
            answered_there = other.locator(
                f'[data-testid="prompt"][data-call-id="{prompt.get_attribute("data-call-id")}"]')
            expect(answered_there).to_have_attribute("data-state", "answered", timeout=TURN)
            expect(answered_there.get_by_test_id("prompt-answer")).to_have_text(
                "Answered: Approved")
            expect(answered_there.get_by_test_id("answer-form")).to_have_count(0)
            expect(answered_there.get_by_role("button")).to_have_count(0)
            # The agent goes on, on both tabs.
            for tab in (page, other):
                expect(messages(tab, "assistant")).to_have_text(["paid"], timeout=TURN)

            # Asked again; this time the phone answers too, while the gateway's frames to it
            # stall: the laptop's answer wins, and the phone says so politely, with it.
            send(page, "Pay the taxi as well")
            mine, late = waiting_prompt(page), waiting_prompt(other)
            network.hold()
            mine.get_by_role("button", name="Approve").click()
            expect(mine).to_have_attribute("data-state", "answered", timeout=TURN)
            expect(late).to_have_attribute("data-state", "waiting")  # it heard nothing yet
            late.get_by_role("button", name="Reject").click()
            network.release()
            lost = late
            expect(lost.get_by_test_id("prompt-answer")).to_have_text(
                "Sorry: another device answered first, so yours was not used. "
                "The answer: Approved", timeout=TURN)
            expect(lost.get_by_test_id("answer-form")).to_have_count(0)
            for tab in (page, other):
                expect(messages(tab, "assistant")).to_have_text(["paid", "paid"], timeout=TURN)
            stored = history(demo, user, chat_id, view="active")
            assert [e["data"]["result"] for e in stored if e["type"] == "tool_result"] == [
                {"approved": True}, {"approved": True}]
    finally:
        other.close()
    assert not errors, f"uncaught errors in the second tab: {errors}"


TIPPED = {"name": "approve_payment", "description": "Approve this payment, with a tip",
          "parameters": APPROVE["parameters"],
          "result": {"type": "object", "required": ["approved", "note"], "properties": {
              "approved": {"type": "boolean"},
              "tip": {"type": "integer", "minimum": 0, "maximum": 20, "title": "Tip (%)"},
              "method": {"enum": ["card", "cash"]},
              "note": {"type": "string", "description": "Printed on the receipt"}}}}


def test_a_bad_answer_is_refused_next_to_the_form_which_keeps_it(
        page: Any, demo: GatewayProcess, browser_redis: str, user: str) -> None:
    sized(page, "phone")
    agent = f"asker-{uuid.uuid4().hex[:8]}"
    with running_agents(browser_redis, {agent: asking_handler([])}):
        chat_id = asking_chat(demo, user, agent, TIPPED)
        open_app(page, demo, user, chat=chat_id)
        synced(page, chat_id)
        send(page, "Pay the hotel")
        prompt = waiting_prompt(page)
        # A field per property: a number box, a choice, a text box (labelled); `approved` is
        # the pair of buttons.
        tip = prompt.get_by_label("Tip (%)")
        method = prompt.get_by_label("Method")
        note = prompt.get_by_label("Note")
        expect(tip).to_have_attribute("type", "number")
        expect(method.locator("option")).to_have_text(["Choose…", "card", "cash"])
        expect(note).to_have_attribute("type", "text")
        error = prompt.get_by_test_id("answer-error")
        expect(error).to_be_hidden()

        # Out of the schema's range: refused by the gateway, said next to the form.
        tip.fill("150")
        method.select_option("card")
        note.fill("Room 12")
        prompt.get_by_role("button", name="Approve").click()
        expect(error).to_have_text("That answer was not accepted. Tip (%): 150 is greater "
                                   "than the maximum of 20.", timeout=TURN)
        expect(prompt).to_have_attribute("data-state", "waiting")
        expect(tip).to_have_value("150")  # what was typed stays, to fix
        expect(note).to_have_value("Room 12")
        expect(method.locator("option:checked")).to_have_text("card")
        expect(tip).to_have_attribute("aria-invalid", "true")
        expect(tip).to_be_focused()
        problems = axe_problems(page, "a refused answer on a phone")
        assert not problems, "\n".join(problems)
        assert_fits(page, "a refused answer on a phone")

        # A required field left out: refused too.
        tip.fill("10")
        note.fill("")
        prompt.get_by_role("button", name="Approve").click()
        expect(error).to_have_text("That answer was not accepted. Note is needed.", timeout=TURN)
        expect(note).to_be_focused()
        expect(tip).to_have_value("10")
        assert not [e for e in history(demo, user, chat_id, view="active")
                    if e["type"] == "tool_result"], "a refused answer is not stored"

        note.fill("Room 12")
        prompt.get_by_role("button", name="Approve").click()
        expect(prompt).to_have_attribute("data-state", "answered", timeout=TURN)
        expect(prompt.get_by_test_id("prompt-answer")).to_have_text(
            'You answered: Approved · tip: 10 · method: "card" · note: "Room 12"', timeout=TURN)
        expect(messages(page, "assistant")).to_have_text(["paid"], timeout=TURN)


# --- who is here, who is typing ---------------------------------------------------------


def me_here(page: Any, devices: int) -> None:
    """The header lists this person, with ``devices`` connections."""
    mine = page.locator('[data-testid="present-user"][data-me="true"]')
    expect(mine).to_have_attribute("data-connections", str(devices), timeout=TURN)
    expect(mine).to_have_text(f"You · {devices} device{'s' if devices != 1 else ''}")


def test_who_is_here_and_typing_on_another_tab(page: Any, browser: Any, demo: GatewayProcess,
                                               user: str) -> None:
    open_app(page, demo, user)
    chat_id = new_chat(page, "Anyone there?")
    expect(page.get_by_test_id("turn-latency")).to_have_count(1, timeout=TURN)
    presence = page.get_by_test_id("chat-presence")
    expect(presence).to_be_visible()
    expect(presence).to_have_attribute("aria-label", "Here now")
    me_here(page, 1)
    typing = page.get_by_test_id("typing")
    expect(typing).to_have_attribute("aria-live", "polite")
    expect(typing).to_have_text("")

    other = browser.new_page()  # a second tab of the same person, phone-sized
    errors: list[str] = []
    other.on("pageerror", lambda exc: errors.append(str(exc)))
    try:
        sized(other, "phone")
        open_app(other, demo, user, chat=chat_id)
        synced(other, chat_id)
        # Both tabs count both devices, live.
        me_here(page, 2)
        me_here(other, 2)

        # Typing on the phone shows on the laptop (said politely), not on the phone itself,
        # and goes once nothing more is typed (three typing intervals: 6 s).
        box = other.get_by_test_id("message-input")
        box.press_sequentially("Let me think")
        expect(typing).to_have_text("You are typing on another device…", timeout=TURN)
        expect(typing).to_have_attribute("data-users", user)
        expect(other.get_by_test_id("typing")).to_have_text("")
        problems = axe_problems(page, "someone typing") + axe_problems(
            other, "two devices here on a phone")
        assert not problems, "\n".join(problems)
        assert_fits(other, "two devices here on a phone")
        expect(typing).to_have_text("", timeout=TURN)
        expect(typing).to_have_attribute("data-users", "")

        # Typing again, then sending: the message ends the typing at once (long before its
        # time is up).
        box.press_sequentially(" about Lisbon")
        expect(typing).to_have_text("You are typing on another device…", timeout=TURN)
        box.press("Enter")
        expect(typing).to_have_text("", timeout=3_000)
        expect(messages(page, "user")).to_have_count(2, timeout=TURN)
    finally:
        other.close()
    assert not errors, f"uncaught errors in the second tab: {errors}"
    # The phone's tab closed: one device again.
    me_here(page, 1)


def held_turn(gate: threading.Event) -> Any:
    """A handler whose turn runs until ``gate`` is set, then answers "done"."""
    async def handle(turn: Any) -> None:
        await asyncio.get_running_loop().run_in_executor(None, gate.wait, TURN / 1000)
        await turn.message("done")
    return handle


@BOTH
def test_the_agent_is_here_while_it_answers(page: Any, demo: GatewayProcess, browser_redis: str,
                                            user: str, size: str) -> None:
    sized(page, size)
    agent = f"holder-{uuid.uuid4().hex[:8]}"
    gate = threading.Event()
    try:
        with running_agents(browser_redis, {agent: held_turn(gate)}):
            chat_id = f"c_{uuid.uuid4().hex[:12]}"
            resp = httpx.post(f"{demo.http}/v1/conversations", headers=demo.headers(user),
                              json={"chat_id": chat_id, "agent": agent})
            assert resp.status_code == 201, resp.text
            open_app(page, demo, user, chat=chat_id)
            synced(page, chat_id)
            me_here(page, 1)
            here = page.get_by_test_id("present-agent")
            expect(here).to_have_count(0)
            send(page, "Take your time")
            # While its turn runs, the agent is here, next to the person.
            expect(here).to_have_attribute("data-agent", agent, timeout=TURN)
            expect(here).to_have_text(f"{agent} · agent")
            me_here(page, 1)
            problems = axe_problems(page, f"the agent here ({size})")
            assert not problems, "\n".join(problems)
            assert_fits(page, f"the agent here ({size})")
            gate.set()
            expect(messages(page, "assistant")).to_have_text(["done"], timeout=TURN)
            # Its turn is over: it is no longer here.
            expect(here).to_have_count(0, timeout=TURN)
            me_here(page, 1)
    finally:
        gate.set()


# --- shared conversations: who wrote what, a viewer reads, a removed member's chat closes --


@contextlib.contextmanager
def page_of(browser: Any, gw: GatewayProcess, uid: str, size: str,
            chat: str | None = None) -> Iterator[Any]:
    """Another user's page (their own token, in a tab of its own), checked for errors."""
    other = browser.new_page()
    errors: list[str] = []
    other.on("pageerror", lambda exc: errors.append(str(exc)))
    try:
        sized(other, size)
        open_app(other, gw, uid, chat=chat)
        yield other
    finally:
        other.close()
    assert not errors, f"uncaught errors in {uid}'s page: {errors}"


def share(gw: GatewayProcess, owner: str, chat_id: str, body: dict[str, Any]) -> None:
    resp = httpx.patch(f"{gw.http}/v1/conversations/{chat_id}/members", json=body,
                       headers=gw.headers(owner))
    assert resp.status_code == 200, resp.text


def authors(page: Any) -> Any:
    return page.get_by_test_id("messages").get_by_test_id("message-author")


@BOTH
def test_a_shared_conversation_says_who_wrote_each_message(page: Any, browser: Any,
                                                           demo: GatewayProcess, user: str,
                                                           size: str) -> None:
    sized(page, size)
    member, viewer = f"{user}-member", f"{user}-viewer"
    open_app(page, demo, user)
    chat_id = new_chat(page, "from the owner")
    expect(page.get_by_test_id("turn-latency")).to_have_count(1, timeout=TURN)
    expect(authors(page)).to_have_count(1)
    expect(authors(page)).to_be_hidden()  # not shared yet: no names
    share(demo, user, chat_id, {"set": {member: "member", viewer: "viewer"}})
    # The owner's page hears it live (`members`): who shares it, and a name on each message.
    sharers = page.get_by_test_id("chat-sharing").get_by_test_id("sharer")
    expect(sharers).to_have_count(3, timeout=TURN)
    expect(sharers).to_have_text(["You (owner)", f"{member} (member)", f"{viewer} (can read)"])
    expect(authors(page)).to_have_text(["You"])
    with page_of(browser, demo, member, size) as other:
        # The conversation is in the member's list; opened, it names its owner's message.
        show_sidebar(other)
        row = sidebar_item(other, chat_id)
        expect(row.get_by_test_id("conversation-shared")).to_have_text(f"shared by {user}",
                                                                       timeout=TURN)
        row.locator(".select").click()
        synced(other, chat_id)
        expect(authors(other)).to_have_text([user], timeout=TURN)
        expect(other.get_by_test_id("message-input")).to_be_enabled()
        send(other, "from the member")
        expect(other.get_by_test_id("turn-latency")).to_have_count(2, timeout=TURN)
        expect(authors(other)).to_have_text([user, "You"], timeout=TURN)
        expect(messages(other, "user")).to_have_text(["from the owner", "from the member"])
        assert axe_problems(other, f"a member's page ({size})") == []
        assert_fits(other, f"a member's page ({size})")
    page.bring_to_front()
    expect(authors(page)).to_have_text(["You", member], timeout=TURN)
    mine = page.locator('[data-testid="messages"] .msg.user').nth(1)
    expect(mine).to_have_attribute("data-by", member)
    expect(mine.locator(".sr-only")).to_have_text(f"{member} said: ")


@BOTH
def test_a_viewer_reads_and_a_removed_member_sees_the_chat_close(
        page: Any, browser: Any, demo: GatewayProcess, user: str, size: str) -> None:
    sized(page, size)
    member, viewer = f"{user}-member", f"{user}-viewer"
    made = httpx.post(f"{demo.http}/v1/conversations", json={"title": "Shared plan"},
                      headers=demo.headers(user))
    assert made.status_code == 201, made.text
    chat_id = made.json()["chat_id"]
    share(demo, user, chat_id, {"set": {member: "member", viewer: "viewer"}})
    # The viewer: the composer and Undo are disabled, and the page says why.
    open_app(page, demo, viewer, chat=chat_id)
    synced(page, chat_id)
    expect(page.get_by_test_id("read-only")).to_be_visible(timeout=TURN)
    expect(page.get_by_test_id("read-only")).to_contain_text("You can read this conversation")
    expect(page.get_by_test_id("message-input")).to_be_disabled()
    expect(page.get_by_test_id("send")).to_be_disabled()
    expect(page.get_by_test_id("undo")).to_be_disabled()
    assert axe_problems(page, f"a viewer's page ({size})") == []
    assert_fits(page, f"a viewer's page ({size})")
    with page_of(browser, demo, member, size, chat=chat_id) as other:
        synced(other, chat_id)
        expect(other.get_by_test_id("message-input")).to_be_enabled()
        expect(other.get_by_test_id("read-only")).to_be_hidden()
        # The owner takes the member off: their chat closes with a word, and leaves the list.
        share(demo, user, chat_id, {"remove": [member]})
        expect(other.get_by_test_id("gone")).to_contain_text(
            "You were removed from this conversation", timeout=TURN)
        expect(other.get_by_test_id("chat")).to_have_attribute("data-chat-id", "")
        expect(sidebar_item(other, chat_id)).to_have_count(0)
        assert chat_id not in other.evaluate("() => demo.client.subscriptions")
    # The viewer made a member writes from now on (a `members` frame), without a reload.
    page.bring_to_front()
    share(demo, user, chat_id, {"set": {viewer: "member"}})
    expect(page.get_by_test_id("message-input")).to_be_enabled(timeout=TURN)
    expect(page.get_by_test_id("read-only")).to_be_hidden()
