"""Server-Sent Events: live durable events, gapless resume by Last-Event-ID, resets, pings."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import msgspec
import pytest
import redis.asyncio as aioredis

from gateway.frames import Frame
from gateway.sse import SseMember, format_event, parse_last_event_id

from .steps import create, publish

pytestmark = pytest.mark.anyio

Block = dict[str, Any]


# --- helpers ----------------------------------------------------------------------------


class EventStream:
    """Reads an SSE response block by block (a block ends with a blank line)."""

    def __init__(self, response: httpx.Response) -> None:
        self.response = response
        self._lines = response.aiter_lines()

    async def block(self, within: float = 5.0) -> Block | None:
        """The next block: ``{id, event, data, comments}``; None when the stream has ended."""
        block: Block = {"id": None, "event": None, "data": None, "comments": []}
        data: list[str] = []
        async with asyncio.timeout(within):
            while True:
                try:
                    line = await anext(self._lines)
                except (StopAsyncIteration, httpx.RemoteProtocolError):
                    return None
                if line == "":
                    if data or block["event"] or block["id"] or block["comments"]:
                        block["data"] = "\n".join(data) if data else None
                        return block
                    continue
                if line.startswith(":"):
                    block["comments"].append(line[1:].strip())
                    continue
                name, _, value = line.partition(":")
                value = value.removeprefix(" ")
                if name == "data":
                    data.append(value)
                else:
                    block[name] = value

    async def event(self, within: float = 5.0) -> Block:
        """The next block that is an event (ping comments skipped)."""
        async with asyncio.timeout(within):
            while True:
                block = await self.block(within)
                assert block is not None, "the stream ended"
                if block["event"] is not None:
                    return block

    async def events(self, count: int, within: float = 10.0) -> list[Block]:
        async with asyncio.timeout(within):
            return [await self.event(within) for _ in range(count)]

    async def end(self, within: float = 5.0) -> list[Block]:
        """Every block until the server ends the stream."""
        got: list[Block] = []
        async with asyncio.timeout(within):
            while (block := await self.block(within)) is not None:
                got.append(block)
        return got


def stream_path(chat_id: str) -> str:
    return f"/v1/conversations/{chat_id}/stream"


@contextlib.asynccontextmanager
async def open_stream(gw: Any, chat_id: str, user: str, role: str = "user",
                      last_event_id: str | None = None,
                      params: dict[str, str] | None = None) -> AsyncIterator[EventStream]:
    headers = gw.headers(user, role)
    if last_event_id is not None:
        headers["Last-Event-ID"] = last_event_id
    async with httpx.AsyncClient(base_url=gw.http, timeout=httpx.Timeout(10, read=None)) as http, \
            http.stream("GET", stream_path(chat_id), headers=headers, params=params) as resp:
        assert resp.status_code == 200, (await resp.aread()).decode()
        assert resp.headers["content-type"].startswith("text/event-stream")
        assert resp.headers["cache-control"] == "no-cache"
        assert resp.headers["x-accel-buffering"] == "no"
        yield EventStream(resp)




def seq_of(block: Block, epoch: str) -> int:
    """The seq in the event's id; checks the id's epoch and that the data agrees."""
    ep, _, seq = block["id"].partition(":")
    assert ep == epoch, block
    frame = msgspec.json.decode(block["data"])
    assert frame["seq"] == int(seq) and frame["type"] == block["event"], block
    return int(seq)


class Publisher:
    """Publishes one durable event after another until stopped; waitable by count."""

    def __init__(self, gw: Any, chat_id: str) -> None:
        self.gw, self.chat_id = gw, chat_id
        self.seqs: list[int] = []
        self._stop = asyncio.Event()
        self._changed = asyncio.Condition()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        async with httpx.AsyncClient(base_url=self.gw.http) as http:
            n = 0
            while not self._stop.is_set():
                n += 1
                resp = await http.post(f"/v1/conversations/{self.chat_id}/events",
                                       json={"type": "delta2", "data": {"n": n}},
                                       headers=self.gw.headers("agent", "service"))
                assert resp.status_code == 200, resp.text
                self.seqs.extend(resp.json()["seqs"])
                async with self._changed:
                    self._changed.notify_all()

    async def until(self, count: int, within: float = 20.0) -> None:
        async with asyncio.timeout(within), self._changed:
            await self._changed.wait_for(lambda: len(self.seqs) >= count)

    async def stop(self) -> int:
        """Stop (again, harmlessly) and return the last seq published."""
        self._stop.set()
        if self._task is not None:
            await self._task
        return self.seqs[-1] if self.seqs else 0


@pytest.fixture(scope="module")
def small_gw(start_gateway: Any) -> Any:
    """A gateway with a short heartbeat and a tiny replay limit."""
    return start_gateway(heartbeat=0.5, replay_limit=3)


# --- live ---------------------------------------------------------------------------------


async def test_live_durable_events_with_ids_and_stored_json(
    gateway: Any, redis_url: str, user: str, chat_id: str
) -> None:
    conv = await create(gateway, user, chat_id)
    epoch = conv["epoch"]
    async with open_stream(gateway, chat_id, user) as sse:
        ready = await sse.event()
        assert ready["event"] == "ready" and ready["id"] == f"{epoch}:0"
        state = msgspec.json.decode(ready["data"])
        assert state["epoch"] == epoch and state["seq"] == 0 and state["recovered"] is True
        assert state["status"] == "idle" and state["title"] is None
        await publish(gateway, chat_id,
                      {"type": "delta", "data": {"n": 1}},
                      {"type": "tool_call", "data": {"n": 2, "text": "a\nb"}},
                      {"type": "delta", "data": {"n": 3}, "durable": False},  # not over SSE
                      {"type": "goal_state", "data": {"active": True, "objective": "x"}})
        got = await sse.events(3)
    assert [b["id"] for b in got] == [f"{epoch}:{s}" for s in (1, 2, 3)]
    assert [b["event"] for b in got] == ["delta", "tool_call", "goal_state"]
    assert [seq_of(b, epoch) for b in got] == [1, 2, 3]
    # data is the stored frame, byte for byte
    client = aioredis.from_url(redis_url)
    try:
        stored: Any = await client.xrange(f"c:{{{chat_id}}}:stream")
    finally:
        await client.aclose()
    assert [b["data"].encode() for b in got] == [fields[b"f"] for _, fields in stored]


async def test_service_token_and_query_token(gateway: Any, user: str, chat_id: str) -> None:
    conv = await create(gateway, user, chat_id)
    async with open_stream(gateway, chat_id, "agent", role="service") as sse:
        assert (await sse.event())["id"] == f"{conv['epoch']}:0"
    url = f"{gateway.http}{stream_path(chat_id)}?token={gateway.token(user)}"
    async with httpx.AsyncClient(timeout=httpx.Timeout(10, read=None)) as http, \
            http.stream("GET", url) as resp:
        assert resp.status_code == 200
        assert (await EventStream(resp).event())["event"] == "ready"
    async with httpx.AsyncClient(timeout=10) as http:
        head = await http.head(url)  # checks access, streams nothing
    assert head.status_code == 200 and head.content == b""
    assert head.headers["content-type"].startswith("text/event-stream")


async def test_deleted_is_sent_and_ends_the_stream(gateway: Any, user: str,
                                                   chat_id: str) -> None:
    conv = await create(gateway, user, chat_id)
    async with open_stream(gateway, chat_id, user) as sse:
        await sse.event()  # ready
        async with httpx.AsyncClient(base_url=gateway.http) as http:
            resp = await http.delete(f"/v1/conversations/{chat_id}",
                                     headers=gateway.headers(user))
        assert resp.status_code == 204
        deleted = await sse.event()
        assert deleted["event"] == "deleted" and deleted["id"] is None
        assert msgspec.json.decode(deleted["data"])["data"]["epoch"] == conv["epoch"]
        assert [b for b in await sse.end() if b["event"]] == []


async def subscribers(client: aioredis.Redis, channel: str) -> int:
    """Connections subscribed to a room's (sharded) channel."""
    [(_, count)] = await client.pubsub_shardnumsub(channel)
    return int(count)


async def test_disconnect_leaves_the_room(gateway: Any, redis_url: str, user: str,
                                          chat_id: str) -> None:
    await create(gateway, user, chat_id)
    channel = f"c:{{{chat_id}}}:ev"
    client = aioredis.from_url(redis_url)
    try:
        async with open_stream(gateway, chat_id, user) as sse:
            await sse.event()  # ready: the room was joined before it was sent
            assert await subscribers(client, channel) == 1
        deadline = time.monotonic() + 5
        while await subscribers(client, channel) != 0:
            assert time.monotonic() < deadline, "the room was not left"
            await asyncio.sleep(0.02)
    finally:
        await client.aclose()


async def test_stream_ends_when_the_token_expires(gateway: Any, user: str,
                                                  chat_id: str) -> None:
    await create(gateway, user, chat_id)
    url = f"{gateway.http}{stream_path(chat_id)}?token={gateway.token(user, ttl=2)}"
    async with httpx.AsyncClient(timeout=httpx.Timeout(10, read=None)) as http, \
            http.stream("GET", url) as resp:
        sse = EventStream(resp)
        assert (await sse.event())["event"] == "ready"
        rest = await sse.end(within=5)
    assert rest and rest[-1]["comments"] == ["token expired"]


async def test_heartbeat_comments(small_gw: Any, user: str, chat_id: str) -> None:
    await create(small_gw, user, chat_id)
    async with open_stream(small_gw, chat_id, user) as sse:
        assert (await sse.event())["event"] == "ready"
        for _ in range(2):
            block = await sse.block(within=3)
            assert block is not None and block["comments"] == ["ping"], block
            assert block["event"] is None and block["data"] is None
        # events still flow between pings
        await publish(small_gw, chat_id, {"type": "note", "data": {}})
        assert (await sse.event(within=3))["event"] == "note"


# --- resume -------------------------------------------------------------------------------


async def test_resume_with_last_event_id_is_gapless_while_publishing(
    gateway: Any, user: str, chat_id: str
) -> None:
    epoch = (await create(gateway, user, chat_id))["epoch"]
    publisher = Publisher(gateway, chat_id)
    try:
        async with open_stream(gateway, chat_id, user) as sse:
            assert (await sse.event())["event"] == "ready"
            publisher.start()
            first = await sse.events(5)
        seen = [seq_of(b, epoch) for b in first]
        assert seen == [1, 2, 3, 4, 5]
        # Disconnected: the publisher keeps going, and keeps going through the reconnect.
        await publisher.until(seen[-1] + 20)
        async with open_stream(gateway, chat_id, user, last_event_id=first[-1]["id"]) as sse:
            await publisher.until(len(publisher.seqs) + 20)
            total = await publisher.stop()
            rest = await sse.events(total - seen[-1], within=20)
            assert all(b["event"] == "delta2" for b in rest)  # no ready, no reset
            seqs = seen + [seq_of(b, epoch) for b in rest]
            assert seqs == list(range(1, total + 1))  # gapless, ordered, no duplicate
            # and live after that
            await publish(gateway, chat_id, {"type": "note", "data": {"live": 1}})
            live = await sse.event()
            assert live["event"] == "note" and seq_of(live, epoch) == total + 1
    finally:
        await publisher.stop()


async def test_resume_when_nothing_was_missed_sends_only_live(
    gateway: Any, user: str, chat_id: str
) -> None:
    epoch = (await create(gateway, user, chat_id))["epoch"]
    await publish(gateway, chat_id, {"type": "note", "data": {}})
    async with open_stream(gateway, chat_id, user, last_event_id=f"{epoch}:1") as sse:
        await publish(gateway, chat_id, {"type": "note", "data": {"n": 2}})
        block = await sse.event()
        assert block["event"] == "note" and seq_of(block, epoch) == 2


async def test_last_event_id_query_and_header_precedence(
    gateway: Any, user: str, chat_id: str
) -> None:
    epoch = (await create(gateway, user, chat_id))["epoch"]
    await publish(gateway, chat_id, *({"type": "note", "data": {"i": i}} for i in range(3)))
    async with open_stream(gateway, chat_id, user,
                           params={"last_event_id": f"{epoch}:1"}) as sse:
        assert [seq_of(b, epoch) for b in await sse.events(2)] == [2, 3]
    # An EventSource reconnecting to that URL sends a newer header: the header wins.
    async with open_stream(gateway, chat_id, user, last_event_id=f"{epoch}:2",
                           params={"last_event_id": "other:0"}) as sse:
        assert seq_of(await sse.event(), epoch) == 3


async def test_wrong_epoch_resets_without_replay(gateway: Any, user: str,
                                                 chat_id: str) -> None:
    epoch = (await create(gateway, user, chat_id))["epoch"]
    await publish(gateway, chat_id, {"type": "note", "data": {}}, {"type": "note", "data": {}})
    async with open_stream(gateway, chat_id, user, last_event_id=f"not{epoch}:1") as sse:
        reset = await sse.event()
        assert reset["event"] == "reset" and reset["id"] == f"{epoch}:2"
        state = msgspec.json.decode(reset["data"])
        assert state["recovered"] is False and state["epoch"] == epoch and state["seq"] == 2
        await publish(gateway, chat_id, {"type": "note", "data": {"live": True}})
        live = await sse.event()
        assert seq_of(live, epoch) == 3  # nothing was replayed
        assert msgspec.json.decode(live["data"])["data"] == {"live": True}


async def test_seq_ahead_of_the_conversation_resets(gateway: Any, user: str,
                                                    chat_id: str) -> None:
    epoch = (await create(gateway, user, chat_id))["epoch"]
    async with open_stream(gateway, chat_id, user, last_event_id=f"{epoch}:99") as sse:
        reset = await sse.event()
        assert reset["event"] == "reset" and reset["id"] == f"{epoch}:0"


async def test_over_the_replay_limit_resets(small_gw: Any, user: str, chat_id: str) -> None:
    epoch = (await create(small_gw, user, chat_id))["epoch"]
    await publish(small_gw, chat_id, *({"type": "note", "data": {}} for _ in range(4)))
    async with open_stream(small_gw, chat_id, user, last_event_id=f"{epoch}:0") as sse:
        reset = await sse.event()
        assert reset["event"] == "reset" and reset["id"] == f"{epoch}:4"
        await publish(small_gw, chat_id, {"type": "note", "data": {}})
        assert seq_of(await sse.event(), epoch) == 5
    async with open_stream(small_gw, chat_id, user, last_event_id=f"{epoch}:2") as sse:
        assert [seq_of(b, epoch) for b in await sse.events(3)] == [3, 4, 5]


# --- refusals -----------------------------------------------------------------------------


async def test_refusals_are_json_before_the_stream(gateway: Any, user: str,
                                                   chat_id: str) -> None:
    await create(gateway, user, chat_id)
    async with httpx.AsyncClient(base_url=gateway.http) as http:
        cases = [
            (401, "unauthorized", stream_path(chat_id), {}),
            (401, "unauthorized", stream_path(chat_id), {"Authorization": "Bearer nope"}),
            (403, "forbidden", stream_path(chat_id), gateway.headers("someone-else")),
            (404, "not_found", stream_path(chat_id + "-missing"), gateway.headers(user)),
            (400, "invalid_request", stream_path("bad%20id"), gateway.headers(user)),
        ]
        for status, code, path, headers in cases:
            resp = await http.get(path, headers=headers)
            assert resp.status_code == status, (path, resp.text)
            assert resp.headers["content-type"] == "application/json"
            assert resp.json()["error"]["code"] == code


@pytest.mark.parametrize("value", ["nope", "abc:", ":3", "abc:-1", "abc:1.5", "a b:1",
                                   "abc:12345678901234567890"])
async def test_malformed_last_event_id_is_400(gateway: Any, user: str, chat_id: str,
                                              value: str) -> None:
    await create(gateway, user, chat_id)
    async with httpx.AsyncClient(base_url=gateway.http) as http:
        for headers, params in (({"Last-Event-ID": value}, {}), ({}, {"last_event_id": value})):
            resp = await http.get(stream_path(chat_id), headers=gateway.headers(user) | headers,
                                  params=params)
            assert resp.status_code == 400, resp.text
            assert resp.json()["error"]["code"] == "invalid_request"


# --- units --------------------------------------------------------------------------------


class _NoRooms:
    def room(self, chat_id: str) -> None:
        return None


async def test_member_queue_is_bounded_in_bytes() -> None:
    member = SseMember(_NoRooms(), max_bytes=100)  # type: ignore[arg-type]
    frame = Frame(b'{"type":"x","chat_id":"c","seq":1,"ts":0,"data":{"pad":"' + b"x" * 40
                  + b'"}}', 1)
    member.deliver("c", Frame(b'{"type":"x","seq":null}', None))  # ephemeral: dropped
    member.deliver("c", frame)
    assert member.queued_bytes == frame.size and not member.overflowed
    member.deliver("c", frame)  # would pass 100 bytes
    assert member.overflowed
    member.deliver("c", frame)  # ignored once overflowed
    assert await member.next_batch(1) == [(None, frame), None]
    assert member.queued_bytes == 0
    assert await member.next_batch(0.01) is None


def test_wire_format() -> None:
    assert format_event(b"x", b'{"a":1}', b"e:1") == b'id: e:1\nevent: x\ndata: {"a":1}\n\n'
    assert format_event(b"x", b'{"a":\n1}') == b'event: x\ndata: {"a":\ndata: 1}\n\n'
    last = parse_last_event_id("a1b2:41")
    assert (last.since.epoch, last.since.seq, last.stream) == ("a1b2", 41, None)
    last = parse_last_event_id("a1b2:41:sab.1:7")
    assert (last.since.seq, last.stream) == (41, ("sab.1", 7))


# --- slow readers -------------------------------------------------------------------------


def dechunk(body: bytes) -> bytes:
    """Undo HTTP/1.1 chunked transfer encoding (up to the last complete chunk)."""
    out = bytearray()
    while True:
        size_line, sep, rest = body.partition(b"\r\n")
        if not sep:
            return bytes(out)
        size = int(size_line.split(b";")[0], 16)
        if size == 0 or len(rest) < size + 2:
            return bytes(out)
        out += rest[:size]
        body = rest[size + 2:]


async def test_slow_reader_does_not_stall_fan_out_and_resumes(
    gateway: Any, user: str, chat_id: str
) -> None:
    gw = gateway  # queue_max_bytes: 1 MiB
    epoch = (await create(gw, user, chat_id))["epoch"]
    loop = asyncio.get_running_loop()
    slow = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    slow.setblocking(False)
    # ~14 MB: far more than the slow reader's queue and both kernels' socket buffers hold
    n, blob = 300, "x" * 49152
    try:
        await loop.sock_connect(slow, ("127.0.0.1", gw.port))
        await loop.sock_sendall(slow, (
            f"GET {stream_path(chat_id)} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Authorization: Bearer {gw.token(user)}\r\nConnection: close\r\n\r\n").encode())
        async with open_stream(gw, chat_id, user) as fast:
            assert (await fast.event())["event"] == "ready"
            async with httpx.AsyncClient(base_url=gw.http) as http:
                async def pub() -> None:
                    for i in range(n):
                        resp = await http.post(
                            f"/v1/conversations/{chat_id}/events",
                            json={"type": "blob", "data": {"i": i, "blob": blob}},
                            headers=gw.headers("agent", "service"))
                        assert resp.status_code == 200

                task = asyncio.create_task(pub())
                got = await fast.events(n, within=60)  # the slow reader holds nobody up
                await task
        assert [seq_of(b, epoch) for b in got] == list(range(1, n + 1))
        # Now read what the slow reader was sent: a gapless prefix, then the stream ended.
        raw = bytearray()
        async with asyncio.timeout(30):
            while chunk := await loop.sock_recv(slow, 1 << 16):
                raw += chunk
    finally:
        slow.close()
    head, _, body = bytes(raw).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    text = dechunk(body).decode()
    assert text.endswith(": slow consumer\n\n")
    ids = [line[4:] for line in text.splitlines() if line.startswith("id: ")]
    seqs = [int(i.partition(":")[2]) for i in ids]
    assert seqs[0] == 0 and seqs == list(range(len(seqs)))  # ready, then 1, 2, ... no gap
    assert seqs[-1] < n
    # The reconnect with the last id it got receives exactly the rest.
    async with open_stream(gw, chat_id, user, last_event_id=ids[-1]) as sse:
        rest = await sse.events(n - seqs[-1], within=30)
    assert [seq_of(b, epoch) for b in rest] == list(range(seqs[-1] + 1, n + 1))
