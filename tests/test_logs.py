"""Logs never hold a token or message text; JSON logs say which connection, user and chat a
line is about; the uvicorn protocol subclass still fits; the ASGI fallback works.

``gateway serve`` processes run here with their own settings and log levels; everything they
print (stdout and stderr) lands in one file, which is searched once they stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import io
import json
import logging
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from websockets.exceptions import InvalidStatus
from websockets.frames import Frame, Opcode

from gateway import logs
from gateway.auth import issue_token
from gateway.config import ConfigError, load_settings
from gateway.logs import JsonFormatter, RedactSecrets
from gateway.transport.uvicorn_ws import (
    GatewayHttpProtocol,
    GatewayWebSocketProtocol,
    check_compatible,
)

from .conftest import GatewayProcess, free_port
from .steps import send_message
from .test_agent import until_turn_end
from .test_fastpath import assert_usable, connect, post_all

pytestmark = pytest.mark.anyio

ACCEPTED = '"WebSocket /v1/ws?token=[redacted]" [accepted]'


def everything_written(data_dir: Path) -> str:
    """Every file the process wrote under its data dir: its combined stdout and stderr."""
    return "\n".join(p.read_text(errors="replace") for p in sorted(data_dir.rglob("*"))
                     if p.is_file())


def secrets_of(token: str) -> list[str]:
    """The token and its signature (what would let someone reuse or forge it); a ticket
    (no dots) is its whole self."""
    return [token, token.rsplit(".", 1)[-1]]


# --- no token in the logs ----------------------------------------------------------------


async def exercise(gw: GatewayProcess, user: str, chat_id: str) -> list[str]:
    """Everything a client may do with ``?token=`` or a ticket; returns every secret used."""
    token, service = gw.token(user), gw.token("agent", "service")
    expired, other = gw.token(user, ttl=-60), gw.token(user + "x")
    base = f"{gw.ws}?token={token}"
    async with connect(base) as ws, connect(base, binary=True) as mp, \
            connect(f"{gw.ws}?v=1&token={token}&after=x") as third:
        await ws.subscribe(chat_id)
        await mp.subscribe(chat_id)
        await third.subscribe(chat_id)
        await send_message(ws, chat_id, "hello", "m1", id="m1")
        for client in (ws, mp, third):
            expected = {"user_message", "turn_start", "head"} | (
                {"ack"} if client is ws else set())
            frames = [await client.recv() for _ in expected]
            assert {f["type"] for f in frames} == expected, frames
            await assert_usable(client, "log")
    # The token in a header instead (what websockets prints at debug, uvicorn at trace).
    async with connect(gw.ws, additional_headers={"Authorization": f"Bearer {token}"}) as hdr:
        await hdr.subscribe(chat_id)
        await assert_usable(hdr, "header")
    # Refused ones too: expired (4001), another user's chat (an error frame), a bad origin.
    async with connect(f"{gw.ws}?token={expired}", hello=False) as ws:
        assert await ws.close_code() == 4001
    async with connect(f"{gw.ws}?token={other}") as ws:
        await ws.send({"type": "subscribe", "chat_id": chat_id, "id": 1})
        await ws.expect("error", code="forbidden")
    with pytest.raises(InvalidStatus):
        async with connect(f"{gw.ws}?token={token}", origin="http://evil.example"):  # type: ignore[arg-type]
            pass
    async with httpx.AsyncClient(base_url=gw.http) as http:
        assert (await http.get(f"/v1/conversations?token={token}")).status_code == 200
        page = await http.get(f"/v1/conversations/{chat_id}/events?after=0&token={token}")
        assert page.status_code == 200 and page.json()["last_seq"] == 3
        resp = await http.post(f"/v1/conversations/{chat_id}/events?token={service}",
                               json={"type": "turn_end", "data": {"reason": "complete"}})
        assert resp.status_code == 200, resp.text
        resp = await http.post(f"/v1/conversations/{chat_id}/events", json={"type": "note"},
                               headers={"Authorization": f"Bearer {service}"})
        assert resp.status_code == 200, resp.text
        assert (await http.get(f"/v1/conversations?token={expired}")).status_code == 401
        assert (await http.get(f"/v1/conversations/{chat_id}?token={other}")
                ).status_code == 403
        async with http.stream("GET", f"/v1/conversations/{chat_id}/stream?token={token}"
                               ) as sse:
            assert sse.status_code == 200
            async with asyncio.timeout(5):
                async for line in sse.aiter_lines():
                    if line.startswith("event: ready"):
                        break
        # A ticket instead of the token: used, then refused when used again.
        ticket = (await http.post("/v1/ws-ticket", headers={"Authorization": f"Bearer {token}"})
                  ).json()["ticket"]
    async with connect(f"{gw.ws}?ticket={ticket}") as ws:
        await assert_usable(ws, "ticket")
    async with connect(f"{gw.ws}?ticket={ticket}", hello=False) as ws:
        assert await ws.close_code() == 4001
    return [token, service, expired, other, ticket]


def serve(gateway_env: dict[str, str], data_dir: Path, level: str) -> GatewayProcess:
    env = dict(gateway_env, GATEWAY_PORT=str(free_port()), GATEWAY_DATA_DIR=str(data_dir))
    return GatewayProcess(env, ["--log-level", level]).start()  # the last --log-level wins


@pytest.mark.parametrize("level", ["info", "debug", "trace"])
async def test_no_token_reaches_the_logs(gateway_env: dict[str, str], tmp_path: Path,
                                         user: str, chat_id: str, level: str) -> None:
    gw = await asyncio.to_thread(serve, gateway_env, tmp_path, level)
    try:
        tokens = await exercise(gw, user, chat_id)
    finally:
        await asyncio.to_thread(gw.stop, signal.SIGTERM)
    assert gw.proc is not None and gw.proc.returncode == 0
    written = everything_written(tmp_path)
    # Logging did happen: refusals at every level; below INFO, a redacted accept line
    # per accepted socket (at INFO none: a reconnect storm would flood the log).
    assert '"WebSocket /v1/ws?token=[redacted]" 403' in written  # the refused origin
    accepts = 0 if level == "info" else 1
    assert written.count(ACCEPTED) == 4 * accepts, written[-3000:]
    assert written.count('"WebSocket /v1/ws?v=1&token=[redacted]&after=x" [accepted]') == accepts
    assert written.count('"WebSocket /v1/ws?ticket=[redacted]" [accepted]') == 2 * accepts
    for token in tokens:
        for secret in secrets_of(token):
            assert secret not in written, [line for line in written.splitlines()
                                           if secret in line][:3]
    assert "Traceback" not in written


def test_the_redacting_filter_rewrites_every_token_parameter() -> None:
    record = logging.LogRecord("uvicorn.error", logging.INFO, __file__, 1,
                               '%s - "WebSocket %s" [accepted]',
                               ("127.0.0.1:5", "/v1/ws?token=a.b.c&x=1&token=d.e.f&ticket=g_h"),
                               None)
    assert RedactSecrets().filter(record) is True
    assert record.getMessage() == (
        '127.0.0.1:5 - "WebSocket /v1/ws?token=[redacted]&x=1&token=[redacted]'
        '&ticket=[redacted]" [accepted]')
    plain = logging.LogRecord("uvicorn.error", logging.INFO, __file__, 1, "%s ready", ("x",),
                              None)
    assert RedactSecrets().filter(plain) is True and plain.getMessage() == "x ready"


# --- JSON logs ---------------------------------------------------------------------------


TS_RE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")


def json_lines(text: str) -> list[dict[str, Any]]:
    """Every line of ``text`` as a JSON object with the four fields every line has."""
    lines = []
    for line in text.splitlines():
        entry = json.loads(line)  # raises on a line that is not JSON
        assert isinstance(entry, dict), line
        assert TS_RE.match(entry["ts"]), line
        assert entry["level"] in ("TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
        assert isinstance(entry["logger"], str) and isinstance(entry["message"], str), line
        lines.append(entry)
    return lines


@contextlib.asynccontextmanager
async def json_agent(env: dict[str, str], group: str, level: str) -> AsyncIterator[bytearray]:
    """``gateway agent`` running the demo agent in JSON at ``level``; yields what it writes
    to stderr, complete once it stopped (stdout says when it is ready)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway", "agent", "gateway.sdk.demo_agent:handle",
        "--group", group, "--start-id", "$", "--log-level", level,
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    err = bytearray()

    async def drain(stream: asyncio.StreamReader) -> None:
        while chunk := await stream.read(65536):
            err.extend(chunk)

    draining = asyncio.create_task(drain(proc.stderr))
    try:
        async with asyncio.timeout(20):
            while not (line := await proc.stdout.readline()).startswith(b"agent ready"):
                assert line, "gateway agent exited: " + err.decode(errors="replace")
        yield err
    finally:
        if proc.returncode is None:
            proc.terminate()
        async with asyncio.timeout(15):
            await proc.stdout.read()
            await proc.wait()
            await draining
    assert proc.returncode == 0, err.decode(errors="replace")[-3000:]


class Seen:
    """What the session below did: its connections' ids and users, every token it used."""

    def __init__(self) -> None:
        self.connections: dict[str, str] = {}  # connection_id -> user_id
        self.secrets: list[str] = []

    def token(self, token: str) -> str:
        self.secrets += secrets_of(token)
        return token

    def hello(self, ws: Any) -> None:
        self.connections[ws.hello["connection_id"]] = ws.hello["user_id"]


async def json_session(gw: GatewayProcess, seen: Seen, user: str, chat_id: str,
                       text: str) -> None:
    """A whole session: the two ways to give a token, subscribe, a message and the agent's
    reply, a service's publish, SSE, bad frames, refused requests and refused tokens."""
    token, service = seen.token(gw.token(user)), seen.token(gw.token("agent", "service"))
    other = seen.token(gw.token(user + "x"))
    expired = seen.token(gw.token(user, ttl=-60))
    forged = seen.token(issue_token("not-the-secret-" * 3, user))
    bearer = {"additional_headers": {"Authorization": f"Bearer {token}"}}
    async with connect(f"{gw.ws}?token={token}") as ws, connect(gw.ws, **bearer) as hdr, \
            connect(f"{gw.ws}?token={other}") as intruder:
        for client in (ws, hdr, intruder):
            seen.hello(client)
        await ws.subscribe(chat_id)
        await hdr.subscribe(chat_id)
        await intruder.send({"type": "subscribe", "chat_id": chat_id, "id": 1})
        await intruder.expect("error", code="forbidden")

        await send_message(ws, chat_id, text, id="m1")
        frames = await until_turn_end(ws, chat_id)
        replies = [f for f in frames if f["type"] == "message"]
        assert replies and text in replies[0]["data"]["text"], frames  # the agent echoes it
        async with httpx.AsyncClient(base_url=gw.http) as http:
            resp = await http.post(f"/v1/conversations/{chat_id}/events",
                                   json={"type": "note", "data": {"text": text}},
                                   headers={"Authorization": f"Bearer {service}"})
            assert resp.status_code == 200, resp.text
        assert (await ws.wait_for(lambda f: f["type"] == "note"))["data"]["text"] == text

        await ws.send_raw("{not json " + text)
        await ws.expect("error")
        await ws.send({"type": "message", "chat_id": chat_id, "text": text,
                       "client_msg_id": 5})
        await ws.expect("error", chat_id=chat_id)
        await assert_usable(ws, "after-bad-frames")

        for refused in (expired, forged):
            async with connect(f"{gw.ws}?token={refused}", hello=False) as gone:
                assert await gone.close_code() == 4001

        # SSE until the conversation is deleted under it: the stream's end is logged.
        async with httpx.AsyncClient(base_url=gw.http) as http, \
                http.stream("GET", f"/v1/conversations/{chat_id}/stream?token={token}") as sse:
            assert sse.status_code == 200
            async with asyncio.timeout(10):
                lines = sse.aiter_lines()
                async for line in lines:
                    if line.startswith("event: ready"):
                        break
                deleted = await http.delete(f"/v1/conversations/{chat_id}",
                                            headers={"Authorization": f"Bearer {token}"})
                assert deleted.status_code == 204, deleted.text
                async for line in lines:
                    if line.startswith("event: deleted"):
                        break
        for client in (ws, hdr):
            await client.wait_for(lambda f: f["type"] == "deleted")


@pytest.mark.parametrize("level", ["debug", "trace"])
async def test_json_logs_of_a_whole_session(gateway_env: dict[str, str], tmp_path: Path,
                                            group: str, user: str, chat_id: str,
                                            level: str) -> None:
    text = "zebra quartz " + uuid.uuid4().hex  # the message: no log line may hold it
    seen = Seen()
    env = dict(gateway_env, GATEWAY_LOG_FORMAT="json")
    gw = await asyncio.to_thread(serve, env, tmp_path, level)
    try:
        async with json_agent(env, group, level) as agent_output:
            await json_session(gw, seen, user, chat_id, text)
    finally:
        await asyncio.to_thread(gw.stop, signal.SIGTERM)
    assert gw.proc is not None and gw.proc.returncode == 0
    written = everything_written(tmp_path)
    lines = json_lines(written)
    agent_written = agent_output.decode(errors="replace")
    agent_lines = json_lines(agent_written)

    # Nothing secret or private, anywhere: not the tokens, not the key, not the text.
    for secret in [*seen.secrets, gateway_env["GATEWAY_SECRET"], text]:
        for output in (written, agent_written):
            assert secret not in output, [line for line in output.splitlines()
                                          if secret in line][:3]
    # Logging did happen, frames included (without their payload), in both processes.
    assert any(e["message"] == "Application startup complete." for e in lines)
    assert any(re.fullmatch(r"< TEXT \[\d+ bytes\]", e["message"]) for e in lines)
    assert any(e["logger"] == "gateway.agent" for e in agent_lines)

    def about(entry: dict[str, Any]) -> tuple[Any, Any, Any]:
        return entry.get("connection_id"), entry.get("user_id"), entry.get("chat_id")

    # Each handshake line names its connection (its user is not known yet).
    accepted = [e for e in lines if e["message"].endswith("[accepted]")]
    assert len(accepted) == 5, accepted
    assert set(seen.connections) <= {e.get("connection_id") for e in accepted}
    assert all(e["logger"] == "uvicorn.error.gateway" and e["connection_id"]
               for e in accepted)
    refused = [e for e in lines if e["logger"] == "gateway.connect"]
    assert [e["message"] for e in refused] == [
        "token refused: token expired",
        "token refused: invalid token: Signature verification failed"]
    assert all(e["connection_id"] and "user_id" not in e for e in refused)
    # A session's lines carry its connection and user, and the chat of the frame they are
    # about.
    session = [e for e in lines if e["logger"] == "gateway.session"]
    for entry in session:
        assert seen.connections.get(entry["connection_id"]) == entry["user_id"], entry
    ws_id, hdr_id, intruder_id = seen.connections
    got = {(about(e), e["message"]) for e in session}
    assert got == {
        ((ws_id, user, chat_id), "subscribed at seq 0, 0 replayed, recovered: True"),
        ((hdr_id, user, chat_id), "subscribed at seq 0, 0 replayed, recovered: True"),
        ((intruder_id, user + "x", chat_id), "subscribe refused: forbidden"),
        ((ws_id, user, None), "invalid frame: malformed"),
        ((ws_id, user, None), "invalid frame: invalid_frame"),
    }, session
    (ended,) = [e for e in lines if e["logger"] == "gateway.sse"]
    assert about(ended) == (None, user, chat_id) and "stream ended" in ended["message"]
    # Lines of other tasks (the pub/sub reader a session started, a pipeline's flush) are
    # not about the session, even though those tasks inherited its context.
    for entry in lines:
        if entry.get("connection_id"):
            assert entry["logger"].startswith(("uvicorn.error", "uvicorn.asgi",
                                               "gateway.session", "gateway.connect")), entry


def test_a_line_is_about_the_task_that_bound_it() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    handler.addFilter(RedactSecrets())
    log = logging.getLogger("gateway.test-logs")
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    log.propagate = False

    async def session() -> None:
        logs.bind(connection_id="c1", user_id="u1")
        log.info("session")
        about = logs.bind(chat_id="chat-1")
        log.info("a frame")
        # A task this one starts (a shared reader, say) inherits the context, not the ids.
        await asyncio.get_running_loop().create_task(reader())
        logs.unbind(about)
        log.info("after the frame")
        log.info("explicit", extra={"chat_id": "chat-2"})

    async def reader() -> None:
        log.warning("a reader")
        logs.about_chat("chat-3")  # on top of a binding it inherited: still not its own
        log.warning("a reader's chat")

    try:
        asyncio.run(session())
        log.info("no loop")
    finally:
        log.removeHandler(handler)
    got = [(e["message"], e.get("connection_id"), e.get("user_id"), e.get("chat_id"))
           for e in json_lines(stream.getvalue())]
    assert got == [("session", "c1", "u1", None), ("a frame", "c1", "u1", "chat-1"),
                   ("a reader", None, None, None), ("a reader's chat", None, None, None),
                   ("after the frame", "c1", "u1", None),
                   ("explicit", "c1", "u1", "chat-2"), ("no loop", None, None, None)]


def test_an_exception_is_one_field_of_one_line() -> None:
    try:
        raise ValueError("bad things at /v1/ws?token=a.b.c")
    except ValueError:
        record = logging.LogRecord("gateway.x", logging.ERROR, __file__, 1, "failed: %s",
                                   ("Bearer x.y.z",), sys.exc_info())
    assert RedactSecrets().filter(record) is True
    line = JsonFormatter().format(record)
    assert "\n" not in line
    (entry,) = json_lines(line)
    assert entry["message"] == "failed: Bearer [redacted]" and entry["level"] == "ERROR"
    assert entry["exc"].startswith("Traceback (most recent call last):")
    assert entry["exc"].endswith("ValueError: bad things at /v1/ws?token=[redacted]")
    assert "a.b.c" not in line and "x.y.z" not in line


def test_frame_dumps_keep_their_kind_and_size_only() -> None:
    frame = Frame(Opcode.TEXT, b'{"type":"message","text":"private"}')
    record = logging.LogRecord("uvicorn.error", logging.DEBUG, __file__, 1, "< %s", (frame,),
                               None)
    assert RedactSecrets().filter(record) is True
    assert record.getMessage() == "< TEXT [35 bytes]"
    header = logging.LogRecord("uvicorn.error", logging.DEBUG, __file__, 1, "< %s: %s",
                               ("Authorization", "bearer a.b.c"), None)
    assert RedactSecrets().filter(header) is True
    assert header.getMessage() == "< Authorization: bearer [redacted]"


def test_the_log_format_setting() -> None:
    assert load_settings({}).log_format == "text"
    assert load_settings({"GATEWAY_LOG_FORMAT": "json"}).log_format == "json"
    with pytest.raises(ConfigError, match="log_format"):
        load_settings({"GATEWAY_LOG_FORMAT": "xml"})


# --- the gateway's protocol inside uvicorn ----------------------------------------------


def test_the_installed_uvicorn_is_compatible() -> None:
    check_compatible()  # raises RuntimeError on an incompatible uvicorn or websockets
    # The upgrade hook overrides something uvicorn really has and calls on an upgrade.
    assert "handle_websocket_upgrade" in GatewayHttpProtocol.__dict__
    assert issubclass(GatewayHttpProtocol, HttpToolsProtocol)
    assert (inspect.signature(GatewayHttpProtocol.handle_websocket_upgrade).parameters.keys()
            == inspect.signature(HttpToolsProtocol.handle_websocket_upgrade).parameters.keys())
    assert "handle_websocket_upgrade" in HttpToolsProtocol.data_received.__code__.co_names
    # The protocol of our own is no uvicorn class, and a connection has no __dict__.
    assert not issubclass(GatewayWebSocketProtocol, WebSocketsSansIOProtocol)
    assert not hasattr(GatewayWebSocketProtocol.__new__(GatewayWebSocketProtocol), "__dict__")

    # ...and uvicorn accepts the class as its HTTP protocol.
    async def app(scope: Any, receive: Any, send: Any) -> None:
        raise AssertionError("not called")

    config = uvicorn.Config(app, http=GatewayHttpProtocol)
    config.load()
    assert config.http_protocol_class is GatewayHttpProtocol


# --- the ASGI fallback: plain uvicorn, no fast path --------------------------------------


FALLBACK = """
import logging, sys
import uvicorn
logging.basicConfig(level=logging.INFO, stream=sys.stdout, force=True,
                    format="%(levelname)s %(name)s: %(message)s")
uvicorn.run("gateway.app:create_app", factory=True, host="127.0.0.1", port={port},
            ws="websockets-sansio", ws_per_message_deflate=False, log_config=None,
            log_level="info", lifespan="on", access_log=False)
"""


@pytest.fixture
def fallback(gateway_env: dict[str, str], tmp_path: Path) -> Iterator[Any]:
    """The app under plain uvicorn: its own websockets-sansio protocol, so no
    ``gateway.transport`` extension and every frame goes through ASGI ``send``."""
    port = free_port()
    env = dict(gateway_env, GATEWAY_PORT=str(port), GATEWAY_DATA_DIR=str(tmp_path),
               GATEWAY_RATE_LIMIT="10000", GATEWAY_RATE_BURST="10000")
    gw = GatewayProcess(env)
    log = open(tmp_path / "fallback.log", "wb")
    gw.proc = subprocess.Popen([sys.executable, "-c", FALLBACK.format(port=port)],
                               env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 20
        while True:
            assert gw.proc.poll() is None, (tmp_path / "fallback.log").read_text()
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(gw.http + "/readyz", timeout=1).status_code == 200:
                    break
            assert time.monotonic() < deadline, "the fallback server did not become ready"
            time.sleep(0.05)
        yield gw
    finally:
        gw.stop()
        log.close()


async def test_the_asgi_fallback_serves_a_whole_session(
    fallback: Any, tmp_path: Path, user: str, chat_id: str
) -> None:
    count = 300
    bearer = {"additional_headers": fallback.headers(user)}  # no token in the URL here
    async with connect(fallback.ws, **bearer) as js, \
            connect(fallback.ws, binary=True, **bearer) as mp:
        assert (await js.subscribe(chat_id))["seq"] == 0
        assert (await mp.subscribe(chat_id))["seq"] == 0
        replies = await post_all(fallback, [(chat_id, {"type": "note",
                                                        "data": {"i": i, "pad": "x" * 1000}})
                                            for i in range(count)])
        assert all(r.status_code == 200 for r in replies)
        got = [await ws.events(chat_id, count, timeout=20) for ws in (js, mp)]
        assert [f["seq"] for f in got[0]] == list(range(1, count + 1))
        assert got[0] == got[1]
        # Replies, a user message and its turn, a buffered unsubscribe and a replay.
        await send_message(js, chat_id, "hi", "m1", id="m1")
        frames = [await js.recv() for _ in range(4)]  # the ack and the three events
        ack = next(f for f in frames if f["type"] == "ack")
        assert ack["id"] == "m1" and ack["seq"] == count + 1, ack
        events = [f for f in frames if f is not ack]
        assert [(f["type"], f["seq"]) for f in events] == [("user_message", count + 1),
                                                           ("turn_start", count + 2),
                                                           ("head", count + 3)]
        assert events[1]["data"]["turn_id"] == ack["turn_id"] == ack["head"]
        assert await mp.events(chat_id, 3) == events
        await mp.send({"type": "unsubscribe", "chat_id": chat_id, "id": "u"})
        await mp.expect("unsubscribed", id="u")
        result = await post_all(fallback, [(chat_id, {"type": "turn_end", "data": {}})])
        assert result[0].json()["seqs"] == [count + 4]
        assert (await js.events(chat_id, 1))[0]["type"] == "turn_end"
        again = await mp.subscribe(chat_id)
        assert again["buffered"] == 1 and again["overflowed"] is False
        assert [f["seq"] for f in await mp.events(chat_id, 1)] == [count + 4]
        replay = await js.subscribe(chat_id, since={"seq": count - 5, "epoch": again["epoch"]})
        assert replay["recovered"] is True and replay["replayed"] == 9
        assert [f["seq"] for f in await js.events(chat_id, 9)] == list(
            range(count - 4, count + 5))
        for ws in (js, mp):
            await assert_usable(ws, "fallback")
    # Closed by us, normally: the server answered with 1000 (no 4008 or anything else).
    assert js.ws.close_code == 1000 and mp.ws.close_code == 1000
    # The server's own closes go through ASGI too.
    async with connect(fallback.ws + "?token=junk", hello=False) as ws:
        assert await ws.close_code() == 4001
    async with connect(fallback.ws, **bearer) as ws:
        await assert_usable(ws, "still")

    fallback.stop()
    # Plain uvicorn.run() re-raises the SIGTERM it handled once shut down.
    assert fallback.proc.returncode in (0, -signal.SIGTERM)
    assert "Application shutdown complete." in (tmp_path / "fallback.log").read_text()
    log = (tmp_path / "fallback.log").read_text(errors="replace")
    # Plain uvicorn's protocol logged the accepts (the gateway's would log them from
    # "uvicorn.error.gateway"): the session above did run on the fallback.
    assert re.search(r"^INFO uvicorn\.error: .*\"WebSocket /v1/ws\" \[accepted\]$", log,
                     re.MULTILINE), log[-2000:]
    assert "uvicorn.error.gateway" not in log
    assert "Traceback" not in log, log[-4000:]
