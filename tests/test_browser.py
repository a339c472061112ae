"""The demo page and gateway-client.js in a real headless Chromium, against real processes.

A gateway in dev mode (it serves the page), the demo agent as its own process (``gateway
agent gateway.sdk.demo_agent:handle``), and a private Redis-compatible server, so agents other
test modules start never pick up these turns. Needs Debian's Chromium at /usr/bin/chromium
(``apt-get install -y chromium``) and the ``playwright`` package; the tests fail, not skip,
without them. Never downloads a browser.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.embedded import EmbeddedRedis

from .conftest import GatewayProcess, free_port
from .steps import history_sync as history  # these tests are synchronous

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


def new_chat(page: Any) -> str:
    before = page.get_by_test_id("chat").get_attribute("data-chat-id") or ""
    page.get_by_test_id("new-chat").click()
    chat = page.get_by_test_id("chat")
    expect(chat).not_to_have_attribute("data-chat-id", re.compile("^" + re.escape(before) + "$"),
                                       timeout=TURN)
    chat_id: str = chat.get_attribute("data-chat-id")
    synced(page, chat_id)
    return chat_id


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
    """Every stored message shows exactly once, in order, with its text; nothing else does."""
    stored = [(e["seq"], "user" if e["type"] == "user_message" else "assistant", e["data"]["text"])
              for e in history(gw, user, chat_id) if e["type"] in ("user_message", "message")]
    shown = page.eval_on_selector_all(
        '[data-testid="messages"] [data-testid="message"]',
        "els => els.map(e => [Number(e.dataset.seq), e.dataset.role, e.innerText.trim()])")
    # The page shows a stopped reply with a "stopped" note under the text.
    shown = [(seq, role, text.removesuffix("\nstopped").strip()) for seq, role, text in shown]
    assert [(s, r, t.strip()) for s, r, t in stored] == [tuple(x) for x in shown]
    ends = [e["seq"] for e in history(gw, user, chat_id) if e["type"] == "turn_end"]
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
    chat_id = new_chat(page)
    send(page, "Plan a weekend in Lisbon")
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
    first = new_chat(page)
    send(page, "/slow")
    expect(page.get_by_test_id("streaming-text")).to_contain_text("word3", timeout=TURN)
    expect(sidebar_item(page, first)).to_have_attribute("data-status", "running")

    second = new_chat(page)  # unsubscribes the first chat: the gateway buffers its frames
    send(page, "hello from the other chat")
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
    first = new_chat(page)
    send(page, "/slow")
    expect(page.get_by_test_id("streaming-text")).to_contain_text("word3", timeout=TURN)
    new_chat(page)
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
    open_app(page, gw, user)
    chat_id = new_chat(page)
    send(page, "first question")
    expect(page.get_by_test_id("turn-latency")).to_have_count(1, timeout=TURN)
    send(page, "/slow")
    expect(page.get_by_test_id("streaming-text")).to_contain_text("word3", timeout=TURN)

    gw.stop()
    connection = page.get_by_test_id("connection")
    expect(connection).not_to_have_attribute("data-state", "open", timeout=RECONNECT)
    expect(page.get_by_test_id("connection-label")).to_contain_text("Reconnect")
    gw.start()
    expect(connection).to_have_attribute("data-state", "open", timeout=RECONNECT)
    # Resumed from the last seq it had, on the new connection.
    expect(page.get_by_test_id("chat")).to_have_attribute("data-subscribe-mode", "since",
                                                          timeout=TURN)

    reply = messages(page, "assistant")
    expect(reply).to_have_count(2, timeout=SLOW_TURN)
    expect(reply.nth(1)).to_have_text(SLOW_REPLY)
    expect(page.get_by_test_id("turn-latency")).to_have_count(2, timeout=TURN)
    assert_transcript(page, gw, user, chat_id)

    page.reload()
    expect(page.get_by_test_id("app")).to_have_attribute("data-ready", "true", timeout=TURN)
    synced(page, chat_id)
    assert_transcript(page, gw, user, chat_id)


def test_message_sent_while_offline_goes_out_once(page: Any, restartable: GatewayProcess,
                                                  user: str) -> None:
    gw = restartable
    open_app(page, gw, user)
    chat_id = new_chat(page)
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
    expect(messages(page, "user")).to_have_text(["sent while offline"], timeout=TURN)
    expect(page.get_by_test_id("turn-latency")).to_have_count(1, timeout=TURN)
    assert_transcript(page, gw, user, chat_id)
    stored = [e for e in history(gw, user, chat_id) if e["type"] == "user_message"]
    assert len(stored) == 1


def test_rename_over_http_updates_the_sidebar_live(page: Any, demo: GatewayProcess,
                                                   user: str) -> None:
    open_app(page, demo, user)
    first = new_chat(page)
    second = new_chat(page)
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
    chat_id = new_chat(page)
    strip = page.get_by_test_id("goal-strip")
    expect(strip).to_be_hidden()
    send(page, "Plan a weekend in Lisbon")
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


def test_bad_token_stops_reconnecting(page: Any, demo: GatewayProcess) -> None:
    page.goto(f"{demo.http}/?token=not-a-token")
    connection = page.get_by_test_id("connection")
    expect(connection).to_have_attribute("data-state", "closed", timeout=TURN)
    expect(page.get_by_test_id("connection-label")).to_have_text("Disconnected: invalid token")


def test_page_without_token_explains_itself(page: Any, demo: GatewayProcess) -> None:
    page.goto(f"{demo.http}/")
    expect(page.get_by_test_id("notice")).to_contain_text("gateway serve --dev")
    expect(page.get_by_test_id("connection")).to_have_attribute("data-state", "closed")


# --- gateway-client.js on its own, against a scripted WebSocket ---------------------------

# Each scenario drives a GatewayClient through a fake WebSocket in the page and throws on the
# first broken expectation. Delays are tiny: initialDelay 4 ms, maxDelay 20 ms.
CLIENT_SCENARIOS = r"""
async (name) => {
  const mod = await import("/static/gateway-client.js");
  const { GatewayClient, backoffDelay, TERMINAL_CLOSE_CODES } = mod;
  const check = (cond, msg) => { if (!cond) throw new Error(name + ": " + msg); };
  const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
  const until = async (cond, msg, ms = 2000) => {
    const end = Date.now() + ms;
    while (!cond()) {
      if (Date.now() > end) throw new Error(name + ": timed out: " + msg);
      await sleep(2);
    }
  };

  class FakeSocket {
    static all = [];
    constructor(url, protocols) {
      this.url = url; this.protocols = protocols; this.sent = []; this.readyState = 0;
      FakeSocket.all.push(this);
    }
    send(data) { this.sent.push(JSON.parse(data)); }
    close() { this.readyState = 3; }
    // server side
    accept(user = "u1") {
      this.readyState = 1;
      this.push({ type: "hello", connection_id: "c" + FakeSocket.all.length, user_id: user,
                  role: "user", heartbeat_interval: 25, protocol: "v1", limits: {} });
    }
    push(frame) { this.onmessage && this.onmessage({ data: JSON.stringify(frame) }); }
    drop(code, reason = "") { this.readyState = 3; this.onclose && this.onclose({ code, reason }); }
    last(type) { return [...this.sent].reverse().find((f) => f.type === type); }
    sentOf(type) { return this.sent.filter((f) => f.type === type); }
  }
  const latest = () => FakeSocket.all[FakeSocket.all.length - 1];
  const make = (extra = {}) => new GatewayClient({
    url: "ws://gateway.test/v1/ws", token: "tok", WebSocket: FakeSocket,
    initialDelay: 4, maxDelay: 20, rateLimitRetry: 5, ...extra });
  const subscribed = (ws, req, fields = {}) => ws.push({
    type: "subscribed", chat_id: req.chat_id, id: req.id, epoch: "e1", seq: 0, recovered: true,
    replayed: 0, snapshot: { title: null, status: "idle", turn_id: null, started_at: null,
    goal_state: null }, ...fields });
  const ev = (chat, seq, type = "note", data = {}) => ({ type, chat_id: chat, seq, ts: 1, data });

  const scenarios = {
    async resume_dedupes_by_seq() {
      const client = make();
      const seen = [];
      client.on("event", (f) => seen.push(f.seq));
      const first = client.subscribe("c1");
      client.connect();
      await until(() => FakeSocket.all.length === 1, "first socket");
      let ws = latest();
      check(ws.url === "ws://gateway.test/v1/ws?token=tok", "token in the URL: " + ws.url);
      ws.accept();
      const sub = ws.last("subscribe");
      check(sub && sub.chat_id === "c1" && !sub.since, "fresh subscribe");
      subscribed(ws, sub, { seq: 5 });
      check((await first).seq === 5, "subscribe resolves with the frame");
      ws.push(ev("c1", 6)); ws.push(ev("c1", 7)); ws.push(ev("c1", null, "delta"));
      ws.drop(1012, "server restarting");
      check(client.state === "reconnecting", "reconnecting after 1012, not " + client.state);
      await until(() => FakeSocket.all.length === 2, "reconnected");
      ws = latest(); ws.accept();
      const again = ws.last("subscribe");
      check(again.since && again.since.seq === 7 && again.since.epoch === "e1",
            "resumed with since 7: " + JSON.stringify(again));
      subscribed(ws, again, { seq: 8, replayed: 2 });
      ws.push(ev("c1", 7)); ws.push(ev("c1", 8)); ws.push(ev("c1", 9));
      check(JSON.stringify(seen) === "[6,7,null,8,9]", "each event once: " + JSON.stringify(seen));
      check(client.duplicatesDropped === 1, "one duplicate dropped");
      check(JSON.stringify(client.position("c1")) === '{"seq":9,"epoch":"e1"}', "position");
      client.close();
    },

    async recovered_false_is_surfaced() {
      const client = make();
      const recoveries = [];
      client.on("recovery", (r) => recoveries.push(r));
      client.subscribe("c1", { since: { seq: 3, epoch: "old" } });
      client.connect();
      await until(() => FakeSocket.all.length === 1, "socket");
      const ws = latest(); ws.accept();
      const sub = ws.last("subscribe");
      check(sub.since.seq === 3 && sub.since.epoch === "old", "app's since is used");
      subscribed(ws, sub, { epoch: "new", seq: 12, recovered: false });
      check(recoveries.length === 1 && recoveries[0].chatId === "c1" && recoveries[0].seq === 12,
            "recovery event: " + JSON.stringify(recoveries));
      check(JSON.stringify(client.position("c1")) === '{"seq":12,"epoch":"new"}', "new position");
      const seen = [];
      client.on("event", (f) => seen.push(f.seq));
      ws.push(ev("c1", 13));
      check(seen[0] === 13, "live after the reset");
      client.close();
    },

    async gap_is_repaired() {
      const client = make();
      const seen = [], gaps = [];
      client.on("event", (f) => seen.push(f.seq));
      client.on("gap", (g) => gaps.push(g));
      client.subscribe("c1");
      client.connect();
      await until(() => FakeSocket.all.length === 1, "socket");
      const ws = latest(); ws.accept();
      subscribed(ws, ws.last("subscribe"), { seq: 1 });
      ws.push(ev("c1", 2)); ws.push(ev("c1", 4));
      check(gaps.length === 1 && gaps[0].expected === 3, "gap reported");
      const resync = ws.last("subscribe");
      check(resync.since && resync.since.seq === 2, "resubscribed from 2");
      ws.push(ev("c1", 5)); // still before the reply: covered by the replay
      subscribed(ws, resync, { seq: 5, replayed: 3 });
      ws.push(ev("c1", 3)); ws.push(ev("c1", 4)); ws.push(ev("c1", 5)); ws.push(ev("c1", 6));
      check(JSON.stringify(seen) === "[2,3,4,5,6]", "in order, no hole: " + JSON.stringify(seen));
      client.close();
    },

    async unsubscribe_then_subscribe_drains_the_buffer() {
      const client = make();
      const seen = [];
      client.on("event", (f) => seen.push(f.type + (f.seq ?? "")));
      client.subscribe("c1");
      client.connect();
      await until(() => FakeSocket.all.length === 1, "socket");
      const ws = latest(); ws.accept();
      subscribed(ws, ws.last("subscribe"), { seq: 4 });
      const off = client.unsubscribe("c1");
      const unsub = ws.last("unsubscribe");
      check(unsub && unsub.chat_id === "c1", "unsubscribe sent");
      ws.push(ev("c1", 5)); // sent before the gateway read our unsubscribe: still counts
      ws.push({ type: "unsubscribed", chat_id: "c1", id: unsub.id });
      await off;
      client.subscribe("c1");
      const back = ws.last("subscribe");
      check(!back.since, "no since: the gateway drains its buffer");
      subscribed(ws, back, { seq: 7, buffered: 3, overflowed: false });
      ws.push(ev("c1", 6)); ws.push(ev("c1", null, "delta")); ws.push(ev("c1", 7));
      check(JSON.stringify(seen) === '["note5","note6","delta","note7"]', JSON.stringify(seen));
      // After a reconnect the buffer is gone: the next subscribe resumes with since.
      client.unsubscribe("c1");
      ws.drop(1006);
      await until(() => FakeSocket.all.length === 2, "reconnected");
      const ws2 = latest(); ws2.accept();
      check(ws2.sentOf("subscribe").length === 0, "an unsubscribed chat is not resubscribed");
      client.subscribe("c1");
      check(ws2.last("subscribe").since.seq === 7, "since after a reconnect");
      client.close();
    },

    async overflowed_buffer_replays_durable_events() {
      const client = make();
      const seen = [];
      client.on("event", (f) => seen.push(f.seq));
      client.subscribe("c1");
      client.connect();
      await until(() => FakeSocket.all.length === 1, "socket");
      const ws = latest(); ws.accept();
      subscribed(ws, ws.last("subscribe"), { seq: 4 });
      client.unsubscribe("c1");
      client.subscribe("c1");
      const back = ws.last("subscribe");
      check(!back.since, "no since: the gateway decides between buffer and replay");
      subscribed(ws, back, { seq: 6, overflowed: true, replayed: 2 });
      ws.push(ev("c1", 5)); ws.push(ev("c1", 6)); ws.push(ev("c1", null, "delta"));
      ws.push(ev("c1", 7));
      check(JSON.stringify(seen) === "[5,6,null,7]", JSON.stringify(seen));
      client.close();
    },

    async outbox_is_sent_once_in_order_with_stable_ids() {
      const client = make();
      client.subscribe("c1");
      const a = client.sendMessage("c1", "first");
      const b = client.sendMessage("c2", "second");
      const c = client.cancel("c1", "t_1");
      check(client.outboxSize === 3, "queued while disconnected");
      client.connect();
      await until(() => FakeSocket.all.length === 1, "socket");
      let ws = latest(); ws.accept();
      const order = ws.sent.map((f) => f.type + ":" + (f.text ?? f.chat_id));
      check(JSON.stringify(order)
            === '["subscribe:c1","message:first","message:second","cancel:c1"]',
            "subscribes first, then the outbox in order: " + JSON.stringify(order));
      const ids = ws.sentOf("message").map((f) => f.client_msg_id);
      check(ids[0] && ids[1] && ids[0] !== ids[1], "one client_msg_id per message");
      // The first message was stored but its ack was lost with the connection.
      ws.drop(1006);
      await until(() => FakeSocket.all.length === 2, "reconnected");
      ws = latest(); ws.accept();
      const retry = ws.sentOf("message");
      check(JSON.stringify(retry.map((f) => f.client_msg_id)) === JSON.stringify(ids),
            "the retry reuses the client_msg_ids");
      ws.push({ type: "ack", chat_id: "c1", id: retry[0].id, seq: 3, client_msg_id: ids[0],
                turn_id: "t_1", duplicate: true });
      ws.push({ type: "error", code: "turn_in_progress", message: "busy", id: retry[1].id,
                chat_id: "c2" });
      const cancel = ws.last("cancel");
      ws.push({ type: "error", code: "no_active_turn", message: "none", id: cancel.id,
                chat_id: "c1" });
      check((await a).duplicate === true, "ack of the retry");
      let err = null;
      try { await b; } catch (e) { err = e; }
      check(err && err.code === "turn_in_progress", "rejected with the gateway's code");
      check((await c) === null, "a retried cancel that finds no turn is done");
      check(client.outboxSize === 0, "outbox empty");
      ws.drop(1006);
      await until(() => FakeSocket.all.length === 3, "reconnected again");
      latest().accept();
      check(latest().sentOf("message").length === 0, "nothing sent twice once acked");
      client.close();
    },

    async rate_limited_frames_are_resent() {
      const client = make();
      client.connect();
      await until(() => FakeSocket.all.length === 1, "socket");
      const ws = latest(); ws.accept();
      const p = client.sendMessage("c1", "hi", { clientMsgId: "m-fixed" });
      ws.push({ type: "error", code: "rate_limited", message: "slow down" });
      await until(() => ws.sentOf("message").length === 2, "resent");
      const [one, two] = ws.sentOf("message");
      check(one.client_msg_id === "m-fixed" && two.client_msg_id === "m-fixed", "same id");
      ws.push({ type: "ack", chat_id: "c1", id: two.id, seq: 1, client_msg_id: "m-fixed",
                turn_id: "t", duplicate: false });
      check((await p).seq === 1, "acked");
      client.close();
    },

    async terminal_codes_stop_and_4011_gets_a_fresh_token() {
      let n = 0;
      const asked = [];
      const client = make({ token: async (req) => { asked.push(req.reason); return "t" + ++n; } });
      const states = [];
      client.on("state", (s) => states.push(s.state + (s.code ? ":" + s.code : "")));
      client.connect();
      await until(() => FakeSocket.all.length === 1, "socket");
      latest().accept();
      latest().drop(4011, "token expired");
      await until(() => FakeSocket.all.length === 2, "reconnected");
      check(latest().url.endsWith("token=t2"), "fresh token: " + latest().url);
      check(JSON.stringify(asked) === '["connect","expired"]', JSON.stringify(asked));
      latest().accept();
      latest().drop(4029, "too many");
      const waited = states.filter((s) => s.startsWith("reconnecting:4029")).length;
      check(waited === 1, "backs off after 4029");
      await until(() => FakeSocket.all.length === 3, "reconnected after 4029");
      for (const code of [4001, 4003, 4004]) {
        check(TERMINAL_CLOSE_CODES.has(code), "terminal " + code);
        latest().accept();
        const before = FakeSocket.all.length;
        latest().drop(code, "no");
        check(client.state === "closed", "closed after " + code);
        await sleep(60);
        check(FakeSocket.all.length === before, "no reconnect after " + code);
        client.connect();
        await until(() => FakeSocket.all.length === before + 1, "connect() again");
      }
      client.close();
    },

    async backoff_is_exponential_with_full_jitter() {
      const caps = [0, 1, 2, 3, 4, 10].map((n) => backoffDelay(n, 500, 15000, () => 0.999999));
      check(JSON.stringify(caps) === "[499,999,1999,3999,7999,14999]", JSON.stringify(caps));
      check(backoffDelay(3, 500, 15000, () => 0) === 0, "full jitter reaches 0");
      const client = make({ initialDelay: 100, maxDelay: 1000, random: () => 0.5 });
      const delays = [];
      client.on("state", (s) => { if (s.state === "reconnecting") delays.push(s.delay); });
      client.connect();
      for (let i = 1; i <= 4; i++) {
        await until(() => FakeSocket.all.length === i, "attempt " + i, 5000);
        latest().drop(1006);
      }
      check(JSON.stringify(delays) === "[50,100,200,400]", "grows: " + JSON.stringify(delays));
      await until(() => FakeSocket.all.length === 5, "attempt 5", 5000);
      latest().accept();
      latest().drop(1006);
      check(delays[4] === 50, "reset after a successful hello: " + delays[4]);
      client.close();
    },
  };
  await scenarios[name]();
  return "ok";
}
"""

SCENARIOS = ["resume_dedupes_by_seq", "recovered_false_is_surfaced", "gap_is_repaired",
             "unsubscribe_then_subscribe_drains_the_buffer",
             "overflowed_buffer_replays_durable_events",
             "outbox_is_sent_once_in_order_with_stable_ids", "rate_limited_frames_are_resent",
             "terminal_codes_stop_and_4011_gets_a_fresh_token",
             "backoff_is_exponential_with_full_jitter"]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_client_sdk(page: Any, demo: GatewayProcess, scenario: str) -> None:
    page.goto(f"{demo.http}/static/app.css")  # any document of the gateway's origin
    assert page.evaluate(CLIENT_SCENARIOS, scenario) == "ok"


# --- answers being written: reload, offline, a second tab ------------------------------

SLOW_WORDS = SLOW_REPLY.split()

# Installed before the page's own scripts (and again after each reload): records every text
# the streaming bubble showed, the connection label's every change, and the browser's
# online/offline events, each with performance.now() of that document.
RECORDER = r"""
(() => {
  const rec = { streamed: [], labels: [], network: [] };
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
    }
  };
  new MutationObserver(look).observe(document, {
    subtree: true, childList: true, characterData: true, attributes: true,
    attributeFilter: ["data-state"],
  });
  addEventListener("offline", () => rec.network.push([performance.now(), "offline"]));
  addEventListener("online", () => rec.network.push([performance.now(), "online"]));
})();
"""


def recorded(page: Any) -> dict[str, list[list[Any]]]:
    rec: dict[str, list[list[Any]]] = page.evaluate("window.__rec")
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
    chat_id = new_chat(page)
    send(page, "/slow")
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
    chat_id = new_chat(page)
    send(page, "/slow")
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


def test_second_tab_joins_mid_answer(page: Any, browser: Any, demo: GatewayProcess,
                                     user: str) -> None:
    page.add_init_script(RECORDER)
    open_app(page, demo, user)
    chat_id = new_chat(page)
    send(page, "/slow")
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
