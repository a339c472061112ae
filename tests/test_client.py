"""The Python client SDK (``gateway.sdk.client``) and ``gateway tail``, against real gateway
processes on the session's real Redis-compatible server.

Gateways are restarted with ``GatewayProcess.stop()``/``.start()`` on the same port while an
SDK client keeps running; nothing is mocked, and nothing sleeps to wait for an event.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Generic, TypeVar

import httpx
import msgspec
import pytest

from gateway.auth import issue_token
from gateway.sdk.client import (
    ChatItem,
    Ended,
    Event,
    GatewayClient,
    Recovery,
    RequestError,
    TerminalError,
)

from .steps import publish
from .wsclient import connect

pytestmark = pytest.mark.anyio

T = TypeVar("T")
FAST: dict[str, Any] = {"backoff_base": 0.05, "backoff_max": 0.5}




async def take(stream: AsyncIterator[T], count: int, seconds: float = 10.0) -> list[T]:
    got: list[T] = []
    async with asyncio.timeout(seconds):
        while len(got) < count:
            got.append(await anext(stream))
    return got


class Watch(Generic[T]):
    """A list that can be waited on: ``await watch.until(lambda items: ...)``."""

    def __init__(self) -> None:
        self.items: list[T] = []
        self.done = False
        self.error: BaseException | None = None
        self._changed = asyncio.Condition()

    async def add(self, *items: T) -> None:
        async with self._changed:
            self.items.extend(items)
            self._changed.notify_all()

    async def finish(self, error: BaseException | None = None) -> None:
        async with self._changed:
            self.done, self.error = True, error
            self._changed.notify_all()

    async def until(self, predicate: Callable[[list[T]], bool], seconds: float = 15.0) -> None:
        async with asyncio.timeout(seconds), self._changed:
            await self._changed.wait_for(lambda: predicate(self.items) or self.done)
        assert predicate(self.items), (self.error, self.items[-5:])


def collect(stream: AsyncIterator[T]) -> tuple[Watch[T], asyncio.Task[None]]:
    """Consume ``stream`` in the background into a :class:`Watch`."""
    watch: Watch[T] = Watch()

    async def run() -> None:
        try:
            async for item in stream:
                await watch.add(item)
        except Exception as exc:
            await watch.finish(exc)
        else:
            await watch.finish()

    return watch, asyncio.create_task(run())


def seqs(items: list[Any]) -> list[int | None]:
    return [item.seq for item in items if isinstance(item, Event)]


# --- the API ------------------------------------------------------------------------------


async def test_subscribe_message_cancel_feed(gateway: Any, user: str, chat_id: str) -> None:
    async with GatewayClient(gateway.ws, token_factory=lambda: gateway.token(user)) as client:
        assert client.connected and client.hello["user_id"] == user
        sub = await client.subscribe(chat_id)
        assert sub.seq == 0 and sub.recovered and sub.snapshot["status"] == "idle"
        assert client.position(chat_id) == (0, sub.epoch)
        events = client.events(chat_id)

        ack = await client.send_message(chat_id, "hello", data={"k": 1})
        assert ack.seq == 1 and ack.duplicate is False and ack.turn_id
        assert ack.head == ack.turn_id and isinstance(ack.msg_id, str) and ack.msg_id
        message, turn, head = await take(events, 3)
        assert isinstance(message, Event) and isinstance(turn, Event) and isinstance(head, Event)
        assert (message.type, message.seq, turn.type, turn.seq, head.type, head.seq) == (
            "user_message", 1, "turn_start", 2, "head", 3)
        assert message.data["text"] == "hello" and message.data["data"] == {"k": 1}
        assert message.data["client_msg_id"] == ack.client_msg_id
        assert message.data["msg_id"] == ack.msg_id
        assert turn.data["turn_id"] == ack.turn_id
        assert head.data["head_id"] == ack.turn_id

        # Retry-safe: the same client_msg_id returns the first ack and appends nothing.
        again = await client.send_message(chat_id, "hello", client_msg_id=ack.client_msg_id)
        assert again.duplicate is True and (again.seq, again.turn_id) == (ack.seq, ack.turn_id)
        with pytest.raises(RequestError) as refused:
            await client.send_message(chat_id, "while running")
        assert refused.value.code == "turn_in_progress"

        cancelled = await client.cancel(chat_id, ack.turn_id)
        assert cancelled.seq == 4 and cancelled.turn_id == ack.turn_id
        [requested] = await take(events, 1)
        assert isinstance(requested, Event) and requested.type == "cancel_requested"
        assert requested.data == {"turn_id": ack.turn_id}

        await publish(gateway, chat_id, {"type": "progress", "data": {"t": "x"}, "durable": False},
                      {"type": "turn_end", "data": {"reason": "cancelled"}})
        delta, end = await take(events, 2)
        assert isinstance(delta, Event) and delta.seq is None and not delta.durable
        assert isinstance(end, Event) and end.type == "turn_end" and end.seq == 5
        assert client.position(chat_id) == (5, sub.epoch)

        # The conversation feed: created, then running, then idle again.
        feed = client.feed()
        statuses: list[str] = []
        async with asyncio.timeout(10):
            while not statuses or statuses[-1] != "idle" or len(statuses) < 3:
                frame = await anext(feed)
                if frame["chat_id"] == chat_id:
                    statuses.append(frame["status"])
        assert statuses[0] == "idle" and "running" in statuses

        assert isinstance(await client.ping(), int)

    # Someone else's conversation is refused, and the stream of that chat is left alone.
    async with GatewayClient(gateway.ws, gateway.token(user + "x")) as other:
        with pytest.raises(RequestError) as forbidden:
            await other.subscribe(chat_id)
        assert forbidden.value.code == "forbidden" and forbidden.value.chat_id == chat_id


async def test_unsubscribe_buffers_and_leave_ends_the_stream(gateway: Any, user: str,
                                                             chat_id: str) -> None:
    async with GatewayClient(gateway.ws, token_factory=lambda: gateway.token(user)) as client:
        await client.subscribe(chat_id)
        await publish(gateway, chat_id, {"type": "note", "data": {"n": 1}})
        assert seqs(await take(client.events(chat_id), 1)) == [1]
        await client.unsubscribe(chat_id)
        await publish(gateway, chat_id, {"type": "note", "data": {"n": 2}},
                      {"type": "tick", "data": {}, "durable": False},
                      {"type": "note", "data": {"n": 3}})
        again = await client.subscribe(chat_id)
        assert again.buffered == 3 and again.overflowed is False
        items = await take(client.events(chat_id), 3)
        assert [(i.type, i.seq) for i in items if isinstance(i, Event)] == [
            ("note", 2), ("tick", None), ("note", 3)]

        await client.leave(chat_id)
        assert client.position(chat_id) == (None, None)
        with pytest.raises(StopAsyncIteration):
            await take(client.events(chat_id), 1)


# --- reconnecting and resuming ----------------------------------------------------------


async def test_resumes_gaplessly_across_a_gateway_restart(start_gateway: Any, gateway: Any,
                                                          user: str, chat_id: str) -> None:
    gw = start_gateway()
    published: Watch[int] = Watch()
    stop = asyncio.Event()

    async def publisher() -> None:
        # Through the shared gateway (same Redis), so publishing goes on during the restart.
        async with httpx.AsyncClient(base_url=gateway.http,
                                     headers=gateway.headers("agent", "service")) as http:
            n = 0
            while not stop.is_set():
                n += 1
                resp = await http.post(f"/v1/conversations/{chat_id}/events",
                                       json={"type": "delta2", "data": {"n": n}})
                assert resp.status_code == 200, resp.text
                await published.add(*resp.json()["seqs"])
                await asyncio.sleep(0.02)  # pacing (~50/s), well under the replay limit

    async with GatewayClient(gw.ws, token_factory=lambda: gw.token(user), **FAST) as client:
        await client.subscribe(chat_id)
        received, consumer = collect(client.events(chat_id))
        producer = asyncio.create_task(publisher())
        try:
            await received.until(lambda items: len(items) >= 10)
            await asyncio.to_thread(gw.stop)
            async with asyncio.timeout(10):
                await client.wait_disconnected()
            assert not client.connected
            down_at = len(published.items)
            await published.until(lambda items: len(items) >= down_at + 20)  # missed ones

            await asyncio.to_thread(gw.start)
            async with asyncio.timeout(20):
                await client.wait_connected()
            assert client.connections >= 2
            target = published.items[-1] + 20
            await published.until(lambda items: items[-1] >= target)  # and live again
            stop.set()
            await producer
            last = published.items[-1]
            await received.until(lambda items: bool(items) and seqs(items)[-1] == last)
        finally:
            stop.set()
            with contextlib.suppress(Exception):
                await producer
    await consumer
    assert received.error is None
    assert all(isinstance(item, Event) for item in received.items)  # no Recovery
    assert seqs(received.items) == list(range(1, last + 1))  # no gap, no duplicate
    assert client.last_close is not None and client.last_close[0] not in (4001, 4003, 4004)


async def test_surfaces_recovered_false_after_the_conversation_was_recreated(
    start_gateway: Any, gateway: Any, user: str, chat_id: str
) -> None:
    gw = start_gateway()
    async with GatewayClient(gw.ws, token_factory=lambda: gw.token(user), **FAST) as client:
        sub = await client.subscribe(chat_id)
        events = client.events(chat_id)
        await publish(gateway, chat_id, {"type": "note", "data": {"n": 1}},
                      {"type": "note", "data": {"n": 2}})
        assert seqs(await take(events, 2)) == [1, 2]

        await asyncio.to_thread(gw.stop)
        async with asyncio.timeout(10):
            await client.wait_disconnected()
        # While the client is away: deleted by its owner, then recreated (a new epoch).
        async with httpx.AsyncClient(base_url=gateway.http, headers=gateway.headers(user)) as http:
            assert (await http.delete(f"/v1/conversations/{chat_id}")).status_code == 204
            created = await http.post("/v1/conversations",
                                      json={"chat_id": chat_id, "title": "Again"})
        assert created.status_code == 201, created.text
        new_epoch = created.json()["epoch"]
        assert new_epoch != sub.epoch
        await publish(gateway, chat_id, {"type": "note", "data": {"away": True}})  # seq 2
        await asyncio.to_thread(gw.start)

        [recovery] = await take(events, 1, seconds=20)
        assert isinstance(recovery, Recovery), recovery
        assert recovery.recovered is False and recovery.chat_id == chat_id
        assert (recovery.previous_epoch, recovery.previous_seq) == (sub.epoch, 2)
        assert (recovery.epoch, recovery.seq) == (new_epoch, 2)
        assert recovery.frame["recovered"] is False and recovery.frame["replayed"] == 0
        assert client.position(chat_id) == (2, new_epoch)

        # Live from the new position: nothing of the new epoch was replayed.
        await publish(gateway, chat_id, {"type": "note", "data": {"live": True}})
        [live] = await take(events, 1)
        assert isinstance(live, Event) and live.seq == 3 and live.data == {"live": True}


async def test_messages_queued_while_disconnected_are_sent_once_in_order(
    start_gateway: Any, gateway: Any, user: str, chat_id: str
) -> None:
    # One chat per message: a chat runs one turn at a time.
    chats = [f"{chat_id}-{i}" for i in range(3)]
    gw = start_gateway()
    async with GatewayClient(gw.ws, token_factory=lambda: gw.token(user), **FAST) as client:
        for chat in chats:
            await client.subscribe(chat)
        await asyncio.to_thread(gw.stop)
        async with asyncio.timeout(10):
            await client.wait_disconnected()

        acks = [client.send_message(chat, f"text {i}") for i, chat in enumerate(chats)]
        assert not client.connected and client.pending == 3
        await asyncio.to_thread(gw.start)
        async with asyncio.timeout(20):
            done = await asyncio.gather(*acks)
        assert [a.chat_id for a in done] == chats
        assert all(a.seq == 1 and a.duplicate is False for a in done)
        assert client.pending == 0

        for chat in chats:  # a marker after each, so "exactly once" can be checked
            await publish(gateway, chat, {"type": "marker", "data": {}})
        received: list[ChatItem] = []
        stream = client.all_events()
        async with asyncio.timeout(10):
            while sum(1 for i in received if isinstance(i, Event) and i.type == "marker") < 3:
                item = await anext(stream)
                assert not isinstance(item, Ended | Recovery), item
                received.append(item)
    messages = [i for i in received if isinstance(i, Event) and i.type == "user_message"]
    # Sent in call order over one socket: stored and delivered in that order, each once.
    assert [(m.chat_id, m.data["text"]) for m in messages] == [
        (chat, f"text {i}") for i, chat in enumerate(chats)]
    assert [m.data["client_msg_id"] for m in messages] == [a.client_msg_id for a in done]
    for chat in chats:
        assert [(i.type, i.seq) for i in received if isinstance(i, Event)
                and i.chat_id == chat] == [("user_message", 1), ("turn_start", 2), ("head", 3),
                                           ("marker", 4)]
    async with httpx.AsyncClient(base_url=gateway.http, headers=gateway.headers(user)) as http:
        for chat in chats:
            history = (await http.get(f"/v1/conversations/{chat}/events")).json()
            assert [e["type"] for e in history["events"]] == [
                "user_message", "turn_start", "head", "marker"]


async def test_a_token_about_to_expire_is_refreshed_in_band(gateway: Any, user: str,
                                                            chat_id: str) -> None:
    """The gateway says token_expiring; the client asks its factory and sends refresh: the
    same connection outlives the first token, its subscription untouched."""
    issued: Watch[float] = Watch()

    async def token_factory() -> str:
        ttl = 2.0 if not issued.items else 3600.0  # the first one expires soon
        await issued.add(ttl)
        return str(gateway.token(user, ttl=ttl))

    async with GatewayClient(gateway.ws, token_factory=token_factory, **FAST) as client:
        first_expiry = time.time() + 2
        sub = await client.subscribe(chat_id)
        events = client.events(chat_id)
        await publish(gateway, chat_id, {"type": "note", "data": {"n": 1}})
        assert seqs(await take(events, 1)) == [1]
        await issued.until(lambda items: len(items) >= 2)  # refreshed from the factory
        await stays_connected(client, first_expiry + 1 - time.time())
        assert client.connections == 1 and client.last_close is None
        await publish(gateway, chat_id, {"type": "note", "data": {"n": 2}})
        assert seqs(await take(events, 1)) == [2]
        assert client.position(chat_id) == (2, sub.epoch)


async def test_terminal_close_stops_with_an_error(gateway: Any, user: str,
                                                  chat_id: str) -> None:
    # A bad token up front: the client never starts.
    with pytest.raises(TerminalError) as bad:
        async with asyncio.timeout(10), GatewayClient(gateway.ws, "not-a-token"):
            pass
    assert bad.value.code == 4001

    # A good token that expires, then a factory that only has bad ones: the in-band refresh
    # is refused, 4011 closes at the expiry, the reconnect's token gets 4001, which stops
    # the client, and the application hears about it from the stream and from its calls.
    calls: list[int] = []

    def token_factory() -> str:
        calls.append(1)
        if len(calls) == 1:
            return str(gateway.token(user, ttl=2))
        return issue_token("wrong-secret-" + "x" * 32, user)

    client = GatewayClient(gateway.ws, token_factory=token_factory, **FAST)
    async with client:
        await client.subscribe(chat_id)
        with pytest.raises(TerminalError) as stopped:
            await take(client.events(chat_id), 1, seconds=15)
        assert stopped.value.code == 4001
        # connect, refresh (refused), reconnect (4001): no retry after a terminal code
        assert not client.connected and len(calls) == 3
        with pytest.raises(TerminalError):
            client.send_message(chat_id, "too late")
        with pytest.raises(TerminalError):
            await client.subscribe(chat_id)


# --- liveness ---------------------------------------------------------------------------


async def stays_connected(client: GatewayClient, seconds: float) -> None:
    """Assert that ``client`` keeps its connection for ``seconds`` (waiting to be dropped)."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    try:
        async with asyncio.timeout(seconds):
            await client.wait_disconnected()
    except TimeoutError:
        return
    raise AssertionError(f"dropped after {loop.time() - started:.1f}s "
                         f"(connection #{client.connections}): {client.last_close}")


async def test_answered_pings_keep_an_idle_connection(gateway: Any, user: str) -> None:
    # Short timers: twenty ping/pong rounds in four seconds, the connection stays.
    async with GatewayClient(gateway.ws, token_factory=lambda: gateway.token(user),
                             idle_ping=0.1, pong_timeout=0.1) as client:
        first = client.hello["connection_id"]
        await stays_connected(client, 4)
        assert client.connections == 1 and client.hello["connection_id"] == first


@pytest.mark.slow
async def test_an_idle_client_keeps_one_connection_for_a_minute(start_gateway: Any, user: str,
                                                                chat_id: str) -> None:
    """The default timers, a minute idle, played ten times faster: the client pings after
    5 s of silence and gives up 5 s later when nothing came, the server's keepalive runs
    every 25 s (GATEWAY_HEARTBEAT). Every answered ping must count as a frame heard, for
    the six client rounds and two server rounds of a minute."""
    assert (GatewayClient.__init__.__kwdefaults__["idle_ping"],
            GatewayClient.__init__.__kwdefaults__["pong_timeout"]) == (5.0, 5.0)
    scale = 10
    gw = start_gateway(heartbeat=25.0 / scale)
    async with GatewayClient(gw.ws, token_factory=lambda: gw.token(user),
                             idle_ping=5.0 / scale, pong_timeout=5.0 / scale) as client:
        await client.subscribe(chat_id)
        first = client.hello["connection_id"]
        await stays_connected(client, 60 / scale)
        assert client.connections == 1 and client.hello["connection_id"] == first
        assert isinstance(await client.ping(), int)


async def test_a_silently_dead_connection_is_dropped_within_10_s(start_gateway: Any,
                                                                  user: str,
                                                                  chat_id: str) -> None:
    gw = start_gateway()
    assert gw.proc is not None
    async with GatewayClient(gw.ws, token_factory=lambda: gw.token(user), **FAST) as client:
        assert (client.idle_ping, client.pong_timeout) == (5.0, 5.0)
        await client.subscribe(chat_id)
        first = client.hello["connection_id"]
        # A quiet second, so the last frame heard is a second old when the gateway stops:
        # a dead connection is dropped idle_ping + pong_timeout (10 s) after the last frame.
        await stays_connected(client, 1)
        # A stopped process: its kernel still acknowledges the client's packets, nothing
        # answers, nothing closes (no FIN, no RST).
        gw.proc.send_signal(signal.SIGSTOP)
        try:
            async with asyncio.timeout(10):
                await client.wait_disconnected()
        finally:
            gw.proc.send_signal(signal.SIGCONT)
        async with asyncio.timeout(30):
            await client.wait_connected()
        assert client.connections == 2 and client.hello["connection_id"] != first
        await publish(gw, chat_id, {"type": "note", "data": {"n": 1}})  # resubscribed
        assert seqs(await take(client.events(chat_id), 1)) == [1]


async def test_a_connection_that_dies_mid_answer_is_dropped_within_5_s(start_gateway: Any,
                                                                       user: str,
                                                                       chat_id: str) -> None:
    gw = start_gateway()
    assert gw.proc is not None
    async with GatewayClient(gw.ws, token_factory=lambda: gw.token(user), **FAST) as client:
        assert (client.active_ping, client.active_pong_timeout) == (2.0, 2.5)
        await client.subscribe(chat_id)
        events = client.events(chat_id)
        await client.send_message(chat_id, "hello")  # a turn runs: frames are expected
        assert "turn_start" in [e.type for e in await take(events, 3)]
        gw.proc.send_signal(signal.SIGSTOP)  # silent: no FIN, no RST
        loop = asyncio.get_running_loop()
        stopped = loop.time()
        try:
            async with asyncio.timeout(5):
                await client.wait_disconnected()
        finally:
            gw.proc.send_signal(signal.SIGCONT)
        assert loop.time() - stopped < 5


async def test_subscribe_without_creating(gateway: Any, user: str, chat_id: str) -> None:
    async with GatewayClient(gateway.ws, token_factory=lambda: gateway.token(user)) as client:
        with pytest.raises(RequestError) as refused:
            await client.subscribe(chat_id, create=False)
        assert refused.value.code == "not_found"
    async with httpx.AsyncClient(base_url=gateway.http) as http:
        reply = await http.get(f"/v1/conversations/{chat_id}", headers=gateway.headers(user))
        assert reply.status_code == 404, reply.text
    async with GatewayClient(gateway.ws, token_factory=lambda: gateway.token(user)) as client:
        await client.subscribe(chat_id)  # the default creates it
        assert (await client.subscribe(chat_id + "-", create=True)).seq == 0
    async with GatewayClient(gateway.ws, token_factory=lambda: gateway.token(user)) as client:
        assert (await client.subscribe(chat_id, create=False)).seq == 0


# --- gateway tail -----------------------------------------------------------------------


async def test_tail_prints_frames_as_json_lines(gateway: Any, user: str, chat_id: str,
                                                tmp_path: Any) -> None:
    async with httpx.AsyncClient(base_url=gateway.http, headers=gateway.headers(user)) as http:
        created = await http.post("/v1/conversations", json={"chat_id": chat_id})
    assert created.status_code == 201, created.text
    epoch = created.json()["epoch"]
    await publish(gateway, chat_id, {"type": "note", "data": {"n": 1}},
                  {"type": "note", "data": {"n": 2}})
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    env.update(GATEWAY_SECRET=gateway.secret, GATEWAY_DATA_DIR=str(tmp_path))
    base = f"ws://127.0.0.1:{gateway.port}"

    async def tail(*args: str) -> asyncio.subprocess.Process:
        return await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gateway", "tail", chat_id, "--url", base, *args, env=env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)

    async def line(proc: asyncio.subprocess.Process) -> dict[str, Any]:
        assert proc.stdout is not None
        raw = await asyncio.wait_for(proc.stdout.readline(), 20)
        assert raw, "tail exited: " + (await proc.stderr.read()).decode()  # type: ignore[union-attr]
        frame: dict[str, Any] = msgspec.json.decode(raw)
        return frame

    live, resumed = await tail(), await tail("--since", "1")
    try:
        subscribed = await line(live)
        assert subscribed["type"] == "subscribed" and subscribed["chat_id"] == chat_id
        assert subscribed["seq"] == 2 and subscribed["epoch"] == epoch
        again = await line(resumed)  # --since 1: the epoch is looked up over HTTP
        assert again["type"] == "subscribed" and again["replayed"] == 1
        assert again["recovered"] is True
        replayed = await line(resumed)
        assert (replayed["type"], replayed["seq"], replayed["data"]) == ("note", 2, {"n": 2})

        await publish(gateway, chat_id, {"type": "note", "data": {"n": 3}},
                      {"type": "delta", "data": {"t": "x"}, "durable": False})
        for proc in (live, resumed):
            note, delta = await line(proc), await line(proc)
            assert note == {"type": "note", "chat_id": chat_id, "seq": 3, "ts": note["ts"],
                            "data": {"n": 3}}
            assert delta["type"] == "delta" and delta["seq"] is None
    finally:
        for proc in (live, resumed):
            if proc.returncode is None:
                proc.terminate()
            await proc.wait()


async def test_tail_joining_mid_answer_prints_the_stream_so_far(
        gateway: Any, user: str, chat_id: str, tmp_path: Any) -> None:
    async with connect(gateway.url(user)) as ws:
        await ws.subscribe(chat_id)
        await ws.send({"type": "message", "chat_id": chat_id, "text": "hi",
                       "client_msg_id": "tail-mid-answer"})
        start = await ws.wait_for(lambda f: f.get("type") == "turn_start")
        await publish(gateway, chat_id,
                      {"type": "delta", "data": {"text": "Half "}, "durable": False},
                      {"type": "delta", "data": {"text": "way"}, "durable": False})
        await ws.wait_for(lambda f: f.get("stream", {}).get("pos") == 1)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    env.update(GATEWAY_SECRET=gateway.secret, GATEWAY_DATA_DIR=str(tmp_path))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway", "tail", chat_id, "--url",
        f"ws://127.0.0.1:{gateway.port}", env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        assert proc.stdout is not None
        lines = [msgspec.json.decode(await asyncio.wait_for(proc.stdout.readline(), 20))
                 for _ in range(2)]
        assert lines[0]["type"] == "subscribed"
        stream = lines[1]
        assert stream["type"] == "stream" and stream["chat_id"] == chat_id
        assert stream["stream"]["type"] == "delta" and stream["stream"]["pos"] == 2
        assert stream["stream"]["text"] == "Half way"
        assert stream["stream"]["turn_id"] == start["data"]["turn_id"]
    finally:
        proc.terminate()
        await proc.wait()
