"""The fast path: frames written straight to each socket's transport from a room's direct set.

Everything is real: ``gateway serve`` processes on the session's Redis-compatible server,
WebSockets and HTTP over loopback. These tests aim at what writing past uvicorn's send path
could break: the order of fanned-out frames against the connection's own replies, the frame
kind (text/binary) per connection, writes to sockets that are going away or closing, members
leaving and rejoining the direct set (unsubscribe, leave, backpressure), and a conversation
deleted under members that sit in it.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import random
import signal
import socket
import struct
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import redis.asyncio as aioredis
from websockets.asyncio.client import connect as ws_connect

from gateway.embedded import EmbeddedRedis

from . import faults
from .steps import create, publish
from .wsclient import FEED, Client, Frame

pytestmark = pytest.mark.anyio

# Log lines that mean something went wrong inside the gateway process.
BAD_LOG_LINES = ("Traceback", "Task exception was never retrieved",
                 "socket.send() raised exception")
BUFFER_MAX_FRAMES = 30


@pytest.fixture(scope="module")
def fast(start_gateway: Any) -> Any:
    """A gateway whose rate and connection limits stay out of the way of a busy client."""
    return start_gateway(rate_limit=100_000, rate_burst=100_000, max_connections_per_user=200,
                         buffer_max_frames=BUFFER_MAX_FRAMES)


class StrictClient(Client):
    """A test client that also checks each WebSocket frame's opcode: a MessagePack
    connection must get binary frames only, a JSON one text frames only (the fast path
    writes prebuilt frames of either kind)."""

    async def recv(self, timeout: float = 5.0, ignore: frozenset[str] = FEED) -> Frame:
        async with asyncio.timeout(timeout):
            while True:
                raw = await self.ws.recv()
                assert isinstance(raw, bytes) is self.binary, raw[:100]
                frame: Frame = (msgspec.msgpack.decode(raw) if isinstance(raw, bytes)
                                else msgspec.json.decode(raw))
                if frame.get("type") not in ignore:
                    return frame


@contextlib.asynccontextmanager
async def connect(url: str, *, binary: bool = False, hello: bool = True,
                  **kwargs: Any) -> AsyncIterator[StrictClient]:
    """As :func:`tests.wsclient.connect`, with a :class:`StrictClient`."""
    if binary:
        kwargs.setdefault("subprotocols", ["gateway.v1.msgpack"])
    async with ws_connect(url, max_size=None, compression=None, **kwargs) as ws:
        client = StrictClient(ws, binary)
        if hello:
            client.hello = await client.expect("hello")
        yield client


class Progress:
    """A counter other tasks can wait on (no polling)."""

    def __init__(self) -> None:
        self.count = 0
        self._cond = asyncio.Condition()

    async def add(self, n: int = 1) -> None:
        async with self._cond:
            self.count += n
            self._cond.notify_all()

    async def reach(self, n: int, timeout: float = 15.0) -> None:
        async with asyncio.timeout(timeout), self._cond:
            await self._cond.wait_for(lambda: self.count >= n)


def is_event(frame: Frame, chat_id: str) -> bool:
    return frame.get("chat_id") == chat_id and "seq" in frame and "data" in frame


async def post_all(gw: Any, jobs: list[tuple[str, dict[str, Any]]],
                   connections: int = 32) -> list[httpx.Response]:
    """POST every ``(chat_id, body)`` at once, as a service, over a pool of connections."""
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    async with httpx.AsyncClient(base_url=gw.http, limits=limits, timeout=30) as http:
        headers = gw.headers("agent", "service")
        return list(await asyncio.gather(*(
            http.post(f"/v1/conversations/{chat}/events", json=body, headers=headers)
            for chat, body in jobs)))


async def assert_usable(ws: Client, req_id: str) -> None:
    """A ping gets its pong and nothing (no late or duplicate event) comes before it."""
    await ws.send({"type": "ping", "id": req_id})
    await ws.expect("pong", id=req_id)


# --- order: fast-path writes against replies ---------------------------------------------


async def test_a_ping_is_answered_at_once_yet_after_the_request_before_it(
    start_gateway: Any, tmp_path: Path, user: str, chat_id: str
) -> None:
    """A ping is answered from the socket's callback, with no task and no Redis, but only
    when nothing is waiting before it: with Redis frozen, an idle connection's ping is
    answered at once, while behind a subscribe that reads the store the pong comes second,
    once Redis is back."""
    server = EmbeddedRedis(tmp_path / "redis", persistent=False)
    server.start()
    try:
        gw = start_gateway(redis_url=server.url, redis_timeout=10)
        async with connect(gw.url(user)) as ws, connect(gw.url(user)) as idle:
            await assert_usable(ws, "first")  # the first request waits for the feed
            await assert_usable(idle, "first")
            for round_ in range(2):
                async with faults.frozen(server):
                    await ws.send({"type": "subscribe", "chat_id": f"{chat_id}-{round_}",
                                   "id": "s"})
                    await ws.send({"type": "ping", "id": "p"})
                    await idle.send({"type": "ping", "id": f"at-once-{round_}"})
                    await idle.expect("pong", id=f"at-once-{round_}")
                await ws.expect("subscribed", id="s")
                await ws.expect("pong", id="p")
            for round_ in range(3):
                await assert_usable(ws, f"alone-{round_}")
    finally:
        server.stop()


@pytest.mark.slow  # ~5 s of load
async def test_fanned_out_events_and_replies_keep_their_order(
    fast: Any, user: str, chat_id: str
) -> None:
    events, pings, extra_events = 300, 120, 60
    others = [f"{chat_id}-o{k}" for k in range(3)]
    # The first and last are subscribed with `since` seq 0: a replay, then live frames.
    since = {other: (await create(fast, user, other))["epoch"] for other in others}
    del since[others[1]]
    jobs = [(chat_id, {"type": "note", "data": {"i": i}}) for i in range(events)]
    jobs += [(other, {"type": "note", "data": {"o": k, "i": i}})
             for k, other in enumerate(others) for i in range(extra_events)]
    random.Random(7).shuffle(jobs)

    async with connect(fast.url(user)) as js, \
            connect(fast.url(user), binary=True) as mp:
        assert (await js.subscribe(chat_id))["seq"] == 0
        assert (await mp.subscribe(chat_id))["seq"] == 0
        received = Progress()  # events of `chat_id` read by `js`
        frames: list[Frame] = []

        async def read_js() -> None:
            pongs = 0
            last = dict.fromkeys(others, -1)  # last seq seen per other chat, -1: no subscribed
            main = 0
            async with asyncio.timeout(30):
                while (main < events or pongs < pings
                       or any(seq != extra_events for seq in last.values())):
                    frame = await js.recv(10)
                    frames.append(frame)
                    if frame["type"] == "pong":
                        pongs += 1
                    elif frame["type"] == "subscribed" and frame["chat_id"] in last:
                        # With `since` seq 0, every event follows (the replay, then live).
                        last[frame["chat_id"]] = 0 if frame["chat_id"] in since else frame["seq"]
                    elif frame.get("chat_id") in last and "seq" in frame:
                        last[frame["chat_id"]] = frame["seq"]
                    elif is_event(frame, chat_id):
                        main += 1
                        await received.add()

        async def pinger() -> None:
            # Pings spread over the whole stream, each sent once `js` has read its share of
            # events, and subscribes to the other chats at three points in the middle.
            for i in range(pings):
                await received.reach(i * events // (pings + 20))
                await js.send({"type": "ping", "id": i})
                if i in (20, 50, 80):
                    other = others[(20, 50, 80).index(i)]
                    request: Frame = {"type": "subscribe", "chat_id": other, "id": other}
                    if other in since:
                        request["since"] = {"seq": 0, "epoch": since[other]}
                    await js.send(request)

        reader = asyncio.create_task(read_js())
        pinging = asyncio.create_task(pinger())
        replies = await post_all(fast, jobs)
        got_mp = await mp.events(chat_id, events, timeout=30)
        await pinging
        await reader

        assert all(r.status_code == 200 for r in replies), [r.text for r in replies
                                                             if r.status_code != 200][:3]
        main = [f for f in frames if is_event(f, chat_id)]
        assert [f["seq"] for f in main] == list(range(1, events + 1))
        assert sorted(f["data"]["i"] for f in main) == list(range(events))
        pongs = [f["id"] for f in frames if f["type"] == "pong"]
        assert pongs == list(range(pings))
        for other in others:
            mine = [f for f in frames if f.get("chat_id") == other]
            assert mine[0]["type"] == "subscribed" and mine[0]["id"] == other, mine[:2]
            assert all("seq" in f and "data" in f for f in mine[1:]), mine
            # The reply first; then the replay (with `since`), then live frames: every event
            # after the position once, in order, and none before the reply.
            first = 1 if other in since else mine[0]["seq"] + 1
            if other in since:
                assert mine[0]["recovered"] is True
                assert mine[0]["replayed"] == mine[0]["seq"], mine[0]
            assert [f["seq"] for f in mine[1:]] == list(range(first, extra_events + 1))
        assert not [f for f in frames if f["type"] == "error"]
        # The MessagePack member of the same room saw exactly the same events.
        assert got_mp == main
        await assert_usable(js, "after")
        await assert_usable(mp, "after")


# --- writes to sockets that are going away -----------------------------------------------


def masked_close_frame(code: int = 1000) -> bytes:
    """A client's close frame (clients must mask), built by hand."""
    mask = bytes(random.getrandbits(8) for _ in range(4))
    payload = struct.pack("!H", code)
    masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
    return bytes((0x88, 0x80 | len(payload))) + mask + masked


def abort(ws: Client) -> None:
    """Drop the TCP connection without a close handshake (FIN, no close frame)."""
    ws.ws.transport.abort()


def reset(ws: Client) -> None:
    """Drop the TCP connection with a reset (SO_LINGER 0)."""
    sock = ws.ws.transport.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    ws.ws.transport.abort()


def close_frame_then_vanish(ws: Client) -> None:
    """Send a close frame and go away before the server's reply (or anything else) lands."""
    ws.ws.transport.write(masked_close_frame())
    reset(ws)


async def test_members_dropping_mid_stream_do_not_hurt_the_room_or_the_process(
    start_gateway: Any, user: str, chat_id: str
) -> None:
    gw = start_gateway(max_connections_per_user=200)
    log_path = Path(gw.env["GATEWAY_DATA_DIR"]) / f"gateway-{gw.port}.log"
    events, batch = 400, 20
    waves = {60: 0, 160: 1, 260: 2}  # events published -> the wave of victims to drop then
    kinds = [abort, reset, close_frame_then_vanish, "close"]
    async with contextlib.AsyncExitStack() as stack:
        survivors = [await stack.enter_async_context(connect(gw.url(user), binary=i % 3 == 2))
                     for i in range(6)]
        # Victims keep reading into their own buffers (no client-side flow control), so
        # those that close cleanly read the server's close frame behind the events.
        victims = [await stack.enter_async_context(connect(gw.url(user), binary=i % 2 == 1,
                                                           max_queue=None))
                   for i in range(24)]
        for ws in survivors + victims:
            await ws.subscribe(chat_id)
        wave_started = [asyncio.Event() for _ in range(3)]

        async def drop(wave: int) -> None:
            await asyncio.wait_for(wave_started[wave].wait(), timeout=20)
            closing, cleanly = [], []
            for i, ws in enumerate(victims[wave * 8:(wave + 1) * 8]):
                kind = kinds[i % len(kinds)]
                if kind == "close":  # a close handshake, answered in time
                    cleanly.append(ws)
                    closing.append(asyncio.create_task(asyncio.wait_for(ws.close(), 5)))
                else:
                    assert callable(kind)
                    kind(ws)
            await asyncio.gather(*closing)
            assert [ws.ws.close_code for ws in cleanly] == [1000] * len(cleanly)

        async def publisher() -> None:
            for start in range(0, events, batch):
                jobs = [(chat_id, {"type": "note", "data": {"i": i}})
                        for i in range(start, start + batch)]
                replies = await post_all(gw, jobs, connections=batch)
                assert all(r.status_code == 200 for r in replies)
                if start + batch in waves:
                    wave_started[waves[start + batch]].set()  # and go on publishing

        droppers = [asyncio.create_task(drop(w)) for w in range(3)]
        publishing = asyncio.create_task(publisher())
        got = await asyncio.gather(*(ws.events(chat_id, events, timeout=30)
                                     for ws in survivors))
        await publishing
        await asyncio.gather(*droppers)
        for frames in got:
            assert [f["seq"] for f in frames] == list(range(1, events + 1))
            assert sorted(f["data"]["i"] for f in frames) == list(range(events))
        for ws in survivors:
            await assert_usable(ws, "after-drops")

        # The process is healthy: ready, and a new connection joins and receives.
        async with httpx.AsyncClient(base_url=gw.http) as http:
            assert (await http.get("/readyz")).status_code == 200
        async with connect(gw.url(user)) as fresh:
            sub = await fresh.subscribe(chat_id)
            assert sub["seq"] == events
            replies = await post_all(gw, [(chat_id, {"type": "note", "data": {"i": events}})])
            assert replies[0].json()["seqs"] == [events + 1]
            assert [f["seq"] for f in await fresh.events(chat_id, 1)] == [events + 1]
            for ws in survivors:
                assert [f["seq"] for f in await ws.events(chat_id, 1)] == [events + 1]

    await asyncio.to_thread(gw.stop, signal.SIGTERM)
    assert gw.proc.returncode == 0
    log = log_path.read_text(errors="replace")
    for bad in BAD_LOG_LINES:
        assert bad not in log, log[-4000:]


class RawSocket:
    """A WebSocket client by hand, to see every byte the server sends, in order, even
    after its close frame (which a client library would stop reading at)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def open(cls, port: int, path: str) -> RawSocket:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # fills fast
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
        reader, writer = await asyncio.open_connection(sock=sock)
        key = base64.b64encode(random.randbytes(16)).decode()
        writer.write((f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                      "Upgrade: websocket\r\nConnection: Upgrade\r\n"
                      f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
                      ).encode())
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 101 "), head
        return cls(reader, writer)

    def send(self, opcode: int, payload: bytes) -> None:
        assert len(payload) < 126
        mask = random.randbytes(4)
        masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
        self.writer.write(bytes((0x80 | opcode, 0x80 | len(payload))) + mask + masked)

    def send_json(self, frame: Frame) -> None:
        self.send(0x1, msgspec.json.encode(frame))

    async def read(self) -> tuple[int, bytes] | None:
        """The next frame's opcode and payload; None at the end of the stream."""
        try:
            first, second = await self.reader.readexactly(2)
        except asyncio.IncompleteReadError as exc:
            assert exc.partial == b"", exc.partial  # never a torn frame
            return None
        assert not second & 0x80, "a server frame must not be masked"
        size = second & 0x7F
        if size == 126:
            (size,) = struct.unpack("!H", await self.reader.readexactly(2))
        elif size == 127:
            (size,) = struct.unpack("!Q", await self.reader.readexactly(8))
        return first & 0x0F, await self.reader.readexactly(size)


@pytest.mark.slow  # ~5 s of load
async def test_nothing_is_written_after_the_close_frame(
    fast: Any, user: str, chat_id: str
) -> None:
    """Clients close while events are fanned out to them: what the server sends ends with
    its close frame, and the events before it are a gapless prefix."""
    total, clients = 600, 12
    path = f"/v1/ws?token={fast.token(user)}"
    raws = [await RawSocket.open(fast.port, path) for _ in range(clients)]
    for n, raw in enumerate(raws):
        raw.send_json({"type": "subscribe", "chat_id": chat_id, "id": n})
    for raw in raws:  # hello, feed frames, then subscribed
        while True:
            item = await asyncio.wait_for(raw.read(), 5)
            assert item is not None and item[0] == 0x1
            if msgspec.json.decode(item[1])["type"] == "subscribed":
                break

    async def run(n: int, raw: RawSocket) -> None:
        seqs: list[int] = []
        close_at = 5 + n * 40  # each client closes at another point of the stream
        after_close: list[tuple[int, bytes]] = []
        closed = False
        async with asyncio.timeout(20):
            while (item := await raw.read()) is not None:
                opcode, payload = item
                if closed:
                    after_close.append(item)
                elif opcode == 0x8:
                    closed = True
                    assert struct.unpack("!H", payload[:2])[0] == 1000, payload
                else:
                    assert opcode == 0x1, item
                    frame = msgspec.json.decode(payload)
                    if is_event(frame, chat_id):
                        seqs.append(frame["seq"])
                        if len(seqs) == close_at:
                            raw.send(0x8, struct.pack("!H", 1000))
        raw.writer.close()
        assert closed, seqs[-3:]
        assert after_close == [], after_close[:3]
        assert seqs == list(range(1, len(seqs) + 1)) and len(seqs) >= close_at

    async with contextlib.AsyncExitStack() as stack:
        watcher = await stack.enter_async_context(connect(fast.url(user)))
        await watcher.subscribe(chat_id)
        readers = [asyncio.create_task(run(n, raw)) for n, raw in enumerate(raws)]
        for start in range(0, total, 100):
            replies = await post_all(fast, [(chat_id, {"type": "note", "data": {"i": i}})
                                            for i in range(start, start + 100)])
            assert all(r.status_code == 200 for r in replies)
        await asyncio.gather(*readers)
        assert [f["seq"] for f in await watcher.events(chat_id, total)] == list(
            range(1, total + 1))
        await assert_usable(watcher, "end")


# --- backpressure: out of the direct set while paused, back in once drained -------------


def kernel_send_buffer_max() -> int:
    """How much the kernel may buffer toward a peer that does not read (as test_security)."""
    try:
        return int(Path("/proc/sys/net/ipv4/tcp_wmem").read_text().split()[2])
    except (OSError, ValueError, IndexError):
        return 4 << 20


@pytest.mark.slow  # ~5 s of load
async def test_a_stalled_reader_pauses_then_rejoins_without_a_gap(
    start_gateway: Any, user: str, chat_id: str
) -> None:
    """A member that stops reading fills its socket: its transport pauses, it leaves the
    direct set and gets frames through ``deliver``; once it reads again it drains, resumes
    and rejoins the direct set at the room's position. Nothing is lost or doubled, and the
    room never waits for it."""
    gw = start_gateway(queue_max_bytes=256 << 20)  # far from 4008: only the pause matters
    blob = "y" * 16384
    stalled_count = (2 * kernel_send_buffer_max() + (1 << 20)) // len(blob)  # past the kernel
    live_count = 200
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", gw.port))
    sock.setblocking(False)
    async with connect(gw.url(user)) as fast_reader, \
            connect(gw.url(user), max_queue=1, sock=sock) as stalled:
        await fast_reader.subscribe(chat_id)
        await stalled.subscribe(chat_id)  # and reads nothing for a while
        async with httpx.AsyncClient(base_url=gw.http) as http:
            headers = gw.headers("agent", "service")

            async def publish_blobs() -> None:
                for i in range(stalled_count):
                    resp = await http.post(f"/v1/conversations/{chat_id}/events",
                                           json={"type": "blob", "data": {"i": i, "b": blob}},
                                           headers=headers)
                    assert resp.status_code == 200, resp.text

            task = asyncio.create_task(publish_blobs())
            got = await fast_reader.events(chat_id, stalled_count, timeout=60)
            await task
            assert [f["seq"] for f in got] == list(range(1, stalled_count + 1))
            # The stalled member now reads everything that piled up, then live events.
            drained = await stalled.events(chat_id, stalled_count, timeout=60)
            assert [f["seq"] for f in drained] == list(range(1, stalled_count + 1))
            assert [f["data"]["i"] for f in drained] == list(range(stalled_count))
            await assert_usable(stalled, "drained")
            replies = await post_all(gw, [(chat_id, {"type": "note", "data": {"n": n}})
                                          for n in range(live_count)])
            assert all(r.status_code == 200 for r in replies)
        expected = list(range(stalled_count + 1, stalled_count + live_count + 1))
        for ws in (fast_reader, stalled):
            assert [f["seq"] for f in await ws.events(chat_id, live_count)] == expected
            await assert_usable(ws, "end")


# --- leaving and rejoining the direct set ------------------------------------------------


async def test_unsubscribe_and_resubscribe_while_events_flow_is_gapless(
    fast: Any, user: str, chat_id: str
) -> None:
    total = 400
    allowed, published = Progress(), Progress()  # the flipper lets the publisher go on

    async def publisher() -> None:
        async with httpx.AsyncClient(base_url=fast.http) as http:
            headers = fast.headers("agent", "service")
            for i in range(total):
                await allowed.reach(i + 1)
                resp = await http.post(f"/v1/conversations/{chat_id}/events",
                                       json={"type": "note", "data": {"i": i}}, headers=headers)
                assert resp.status_code == 200, resp.text
                await published.add()

    async with connect(fast.url(user)) as flipper, connect(fast.url(user)) as steady, \
            connect(fast.url(user), binary=True) as steady_mp:
        first = await flipper.subscribe(chat_id)
        epoch = first["epoch"]
        await steady.subscribe(chat_id)
        await steady_mp.subscribe(chat_id)
        publishing = asyncio.create_task(publisher())
        seqs: list[int] = []

        def take(frame: Frame) -> None:
            assert frame["type"] == "note" and frame["chat_id"] == chat_id, frame
            seqs.append(frame["seq"])

        async def read_events(count: int) -> None:
            for _ in range(count):
                take(await flipper.recv(10))

        async def read_until(type_: str, req_id: str) -> None:
            """Events still in flight, then the reply."""
            while (frame := await flipper.recv(10))["type"] != type_:
                take(frame)
            assert frame.get("id") == req_id, frame

        # How many events are published while the flipper is out of the room's direct set.
        away = {"buffer": 5, "overflow": BUFFER_MAX_FRAMES + 5, "since": 15, "leave": 15}
        modes = ["buffer", "overflow", "since", "leave"] * 2
        for cycle, mode in enumerate(modes):
            await allowed.add(10)
            await read_events(10)  # live, from the direct set
            req = f"u{cycle}"
            if mode == "leave":
                await flipper.send({"type": "leave", "chat_id": chat_id, "id": req})
                await read_until("left", req)
            else:
                await flipper.send({"type": "unsubscribe", "chat_id": chat_id, "id": req})
                await read_until("unsubscribed", req)
            await allowed.add(away[mode])
            await published.reach(allowed.count)
            await allowed.add(10)  # and more events flow while it subscribes again
            since = {"seq": seqs[-1], "epoch": epoch} if mode in ("since", "leave") else None
            await flipper.send({"type": "subscribe", "chat_id": chat_id, "id": f"s{cycle}",
                                **({"since": since} if since else {})})
            sub = await flipper.recv(10)  # nothing of the chat between the two replies
            assert sub["type"] == "subscribed" and sub["id"] == f"s{cycle}", sub
            assert sub["epoch"] == epoch and sub["recovered"] is True, sub
            if mode == "buffer":
                assert sub["overflowed"] is False and sub["buffered"] >= away[mode], sub
            else:  # the buffer dropped, or none: a replay from the last seq received
                assert sub.get("overflowed", False) is (mode == "overflow"), sub
                assert sub["replayed"] == sub["seq"] - seqs[-1] >= away[mode], sub
        await allowed.add(total)
        await publishing
        await read_events(total - len(seqs))
        assert seqs == list(range(1, total + 1))  # gapless, ordered, no duplicate
        for ws in (steady, steady_mp):
            assert [f["seq"] for f in await ws.events(chat_id, total)] == seqs
        for ws in (flipper, steady, steady_mp):
            await assert_usable(ws, "done")


async def test_a_lone_member_leaving_and_rejoining_stays_live(
    fast: Any, user: str, chat_id: str
) -> None:
    """The only member of a room leaves (the room and its pub/sub subscription go) and joins
    again at once, over and over, while events are published: every rejoin must end up
    subscribed (an UNSUBSCRIBE overtaking the new SUBSCRIBE would leave it deaf)."""
    stop = asyncio.Event()
    published = Progress()

    async def publisher() -> None:
        async with httpx.AsyncClient(base_url=fast.http) as http:
            headers = fast.headers("agent", "service")
            i = 0
            while not stop.is_set():
                resp = await http.post(f"/v1/conversations/{chat_id}/events",
                                       json={"type": "note", "data": {"i": i}}, headers=headers)
                assert resp.status_code == 200, resp.text
                i += 1
                await published.add()

    async with connect(fast.url(user)) as ws:
        epoch = (await ws.subscribe(chat_id))["epoch"]
        task = asyncio.create_task(publisher())
        seqs: list[int] = []
        try:
            for cycle in range(25):
                await published.reach(published.count + 2)
                await ws.send({"type": "leave", "chat_id": chat_id, "id": f"l{cycle}"})
                while (frame := await ws.recv())["type"] != "left":
                    assert is_event(frame, chat_id), frame
                    seqs.append(frame["seq"])
                since = {"seq": seqs[-1] if seqs else 0, "epoch": epoch}
                sub = await ws.subscribe(chat_id, since=since)
                assert sub["recovered"] is True, sub
        finally:
            stop.set()
            await task
        # Live after the last rejoin: whatever is still to come, then one more event.
        last = (await publish(fast, chat_id, {"type": "note", "data": {"last": True}}))["seqs"][0]
        while not seqs or seqs[-1] < last:
            frame = await ws.recv()
            assert is_event(frame, chat_id), frame
            seqs.append(frame["seq"])
        assert seqs == list(range(1, last + 1))
        await assert_usable(ws, "end")


# --- a deleted conversation --------------------------------------------------------------


async def test_delete_reaches_direct_members_and_a_recreated_chat_does_not_leak_in(
    fast: Any, user: str, chat_id: str
) -> None:
    service = fast.headers("agent", "service")
    async with connect(fast.url(user)) as js, connect(fast.url(user), binary=True) as mp, \
            connect(fast.url(user)) as witness, httpx.AsyncClient(base_url=fast.http) as http:
        old = await js.subscribe(chat_id)
        await mp.subscribe(chat_id)
        result = await publish(fast, chat_id, *({"type": "note", "data": {"old": i}}
                                                for i in range(3)))
        assert result["seqs"] == [1, 2, 3]
        # Live at the room's position now: both sit in the direct sets.
        for ws in (js, mp):
            assert [f["data"] for f in await ws.events(chat_id, 3)] == [{"old": i}
                                                                       for i in range(3)]
            await assert_usable(ws, "live")

        resp = await http.delete(f"/v1/conversations/{chat_id}", headers=fast.headers(user))
        assert resp.status_code == 204, resp.text
        for ws in (js, mp):
            deleted = await ws.expect("deleted", chat_id=chat_id)
            assert deleted["seq"] is None
            assert deleted["data"] == {"epoch": old["epoch"], "last_seq": 3}

        # Recreated under the same id: a new epoch, seqs from 1 again.
        created = await create(fast, user, chat_id)
        assert created["epoch"] != old["epoch"] and created["last_seq"] == 0
        assert (await witness.subscribe(chat_id))["epoch"] == created["epoch"]
        result = await publish(fast, chat_id, *({"type": "note", "data": {"new": i}}
                                                for i in range(2)))
        assert result["seqs"] == [1, 2]
        assert [f["data"] for f in await witness.events(chat_id, 2)] == [{"new": 0},
                                                                         {"new": 1}]
        # The witness got them, so fan-out is done: the ended subscriptions got nothing.
        for ws in (js, mp):
            await assert_usable(ws, "ended")

        # Resuming from the old incarnation is refused explicitly, with nothing replayed.
        again = await js.subscribe(chat_id, since={"seq": 3, "epoch": old["epoch"]})
        assert again["recovered"] is False and again["replayed"] == 0
        assert again["epoch"] == created["epoch"] and again["seq"] == 2
        fresh = await mp.subscribe(chat_id)
        assert fresh["epoch"] == created["epoch"] and fresh["seq"] == 2
        resp = await http.post(f"/v1/conversations/{chat_id}/events", headers=service,
                               json={"type": "note", "data": {"new": 2}})
        assert resp.json()["seqs"] == [3]
        for ws in (js, mp, witness):
            frames = await ws.events(chat_id, 1)
            assert [(f["seq"], f["data"]) for f in frames] == [(3, {"new": 2})]
            await assert_usable(ws, "end")


async def test_resubscribing_right_after_delete_follows_the_new_incarnation(
    fast: Any, user: str, chat_id: str
) -> None:
    count = 120
    async with connect(fast.url(user)) as js, connect(fast.url(user), binary=True) as mp, \
            httpx.AsyncClient(base_url=fast.http) as http:
        old = await js.subscribe(chat_id)
        await mp.subscribe(chat_id)
        replies = await post_all(fast, [(chat_id, {"type": "note", "data": {"old": i}})
                                        for i in range(20)])
        assert all(r.status_code == 200 for r in replies)
        for ws in (js, mp):
            assert [f["seq"] for f in await ws.events(chat_id, 20)] == list(range(1, 21))
        resp = await http.delete(f"/v1/conversations/{chat_id}", headers=fast.headers(user))
        assert resp.status_code == 204
        subs = []
        for ws in (js, mp):
            await ws.expect("deleted", chat_id=chat_id)
            sub = await ws.subscribe(chat_id)  # auto-creates it again
            assert sub["epoch"] != old["epoch"] and sub["seq"] == 0, sub
            subs.append(sub)
        assert subs[0]["epoch"] == subs[1]["epoch"]
        replies = await post_all(fast, [(chat_id, {"type": "note", "data": {"new": i}})
                                        for i in range(count)])
        assert all(r.status_code == 200 for r in replies)
        got = [await ws.events(chat_id, count) for ws in (js, mp)]
        assert [f["seq"] for f in got[0]] == list(range(1, count + 1))
        assert all("new" in f["data"] for f in got[0])
        assert got[0] == got[1]
        for ws in (js, mp):
            await assert_usable(ws, "end")


# --- coalesced writes --------------------------------------------------------------------


def write_calls(pid: int) -> int:
    """The process's write system calls so far (``syscw`` of /proc/<pid>/io)."""
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("syscw:"):
            return int(line.split()[1])
    raise AssertionError("no syscw in /proc/<pid>/io")


async def test_frames_for_many_rooms_one_client_watches_leave_in_one_write(
    fast: Any, redis_url: str, user: str, chat_id: str
) -> None:
    """An agent publishes into every room one client watches at once: the frames reach the
    gateway in one pub/sub read, and leave for the client's socket in one write, not one
    each, in order (gateway/transport/cork.py)."""
    from gateway.config import Settings
    from gateway.redis.backend import Backend
    from gateway.redis.records import OutEvent
    from gateway.redis.store import Store

    rooms = [f"{chat_id}-r{k}" for k in range(40)]
    for room in rooms:
        await create(fast, user, room)
    settings = Settings(redis_url=redis_url, secret="x")
    client = aioredis.from_url(redis_url)
    store = Store(Backend.of(client, settings), settings)
    assert fast.proc is not None
    try:
        async with connect(fast.url(user)) as ws:
            for room in rooms:
                await ws.subscribe(room)
            await assert_usable(ws, "before")
            before = write_calls(fast.proc.pid)
            # One loop turn: one pipeline, one batch of scripts, their pushes in one read.
            await asyncio.gather(*(
                store.publish(room, [OutEvent(type="note", data=b'{"k":%d}' % k)])
                for k, room in enumerate(rooms)))
            got = [await ws.recv() for _ in rooms]
            writes = write_calls(fast.proc.pid) - before
            await assert_usable(ws, "after")
    finally:
        await store.backend.aclose()
    assert [f["chat_id"] for f in got] == rooms  # every frame, in publish order
    assert [f["data"]["k"] for f in got] == list(range(len(rooms)))
    assert writes < len(rooms) // 4, f"{writes} writes for {len(rooms)} frames"
