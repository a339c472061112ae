"""Redis losing data never forks history silently: subscribers are told (`recovered: false`).

Each test runs its own Redis-compatible server (no persistence) and gateway, so it can
restart or flush it under live subscribers.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import redis
import redis.asyncio as aioredis

from gateway.config import Settings
from gateway.embedded import EmbeddedRedis
from gateway.redis.backend import Backend
from gateway.redis.records import OutEvent
from gateway.redis.scripts import PublishScript
from gateway.redis.store import Store
from gateway.sdk.client import GatewayClient, Recovery

from .conftest import GatewayProcess, free_port
from .faults import until
from .steps import publish, send_message
from .test_client import FAST, collect
from .wsclient import Client, Frame, connect

pytestmark = pytest.mark.anyio


@pytest.fixture
def private(start_gateway: Any, tmp_path: Path) -> Iterator[tuple[EmbeddedRedis, Any]]:
    """A server of this test only, and a gateway on it (the demo agent off)."""
    server = EmbeddedRedis(tmp_path / "redis", persistent=False)
    gw = start_gateway(redis_url=server.start(), demo_agent=0)
    try:
        yield server, gw
    finally:
        gw.stop(signal.SIGKILL)
        server.stop()


async def events_of(ws: Client, chat_id: str, count: int) -> list[Frame]:
    return [f for f in await ws.events(chat_id, count)]


async def unasked_subscribed(ws: Client, chat_id: str, timeout: float = 15) -> Frame:
    """The `subscribed` the gateway sends by itself when the history changed under us."""
    frame = await ws.wait_for(lambda f: f.get("type") == "subscribed", timeout=timeout)
    assert frame["chat_id"] == chat_id and "id" not in frame, frame
    return frame


async def test_redis_restarted_empty_under_a_live_subscriber(
        private: tuple[EmbeddedRedis, Any], user: str, chat_id: str) -> None:
    server, gw = private
    async with connect(gw.url(user)) as ws:
        first = await ws.subscribe(chat_id)
        await publish(gw, chat_id, *({"type": "note", "data": {"i": i}} for i in range(3)))
        assert [f["seq"] for f in await events_of(ws, chat_id, 3)] == [1, 2, 3]

        server.stop()
        server.start()  # the same socket, no data: every conversation is gone

        # Told at once, not left believing it is at seq 3 of a history that is gone.
        told = await unasked_subscribed(ws, chat_id)
        assert told["recovered"] is False and told["epoch"] != first["epoch"]
        assert told["seq"] == 0 and told["replayed"] == 0
        # The new history's events arrive (seq 1, 2 again, under the new epoch).
        await publish(gw, chat_id, {"type": "note", "data": {"i": "a"}},
                      {"type": "note", "data": {"i": "b"}})
        again = await events_of(ws, chat_id, 2)
        assert [(f["seq"], f["data"]["i"]) for f in again] == [(1, "a"), (2, "b")]

    # A client coming back with its old position is told too.
    async with connect(gw.url(user)) as late:
        resumed = await late.subscribe(chat_id, since={"seq": 3, "epoch": first["epoch"]})
        assert resumed["recovered"] is False and resumed["replayed"] == 0
        assert resumed["epoch"] == told["epoch"] and resumed["seq"] == 2


async def test_a_subscriber_that_would_not_create_is_told_the_chat_is_gone(
        private: tuple[EmbeddedRedis, Any], user: str, chat_id: str) -> None:
    """Subscribed with ``create: false`` (a link), a history lost under it ends in
    ``not_found``: the resync does not write the conversation back."""
    server, gw = private
    async with connect(gw.url(user)) as ws:
        await ws.subscribe(chat_id)  # created here
    async with connect(gw.url(user)) as ws:
        await ws.subscribe(chat_id, create=False)
        server.stop()
        server.start()  # every conversation is gone
        gone = await ws.wait_for(lambda f: f.get("type") in ("error", "subscribed"), timeout=10)
        assert gone["type"] == "error" and gone["code"] == "not_found", gone
        assert gone.get("chat_id") == chat_id
    async with httpx.AsyncClient(base_url=gw.http) as http:
        resp = await http.get(f"/v1/conversations/{chat_id}", headers=gw.headers(user))
    assert resp.status_code == 404, resp.text


async def test_flushall_then_a_new_message_resyncs_live_subscribers(
        private: tuple[EmbeddedRedis, Any], user: str, chat_id: str) -> None:
    server, gw = private
    async with connect(gw.url(user)) as ws, connect(gw.url(user)) as sender:
        first = await ws.subscribe(chat_id)
        await publish(gw, chat_id, {"type": "note", "data": {}}, {"type": "note", "data": {}})
        assert [f["seq"] for f in await events_of(ws, chat_id, 2)] == [1, 2]

        client = redis.Redis.from_url(server.url)
        try:
            client.flushall()  # the pub/sub connection survives: only the data is gone
        finally:
            client.close()
        # The next message recreates the conversation under a new epoch: seq 1 again.
        await send_message(sender, chat_id, "hello again", "after-flush")
        told = await unasked_subscribed(ws, chat_id)
        assert told["recovered"] is False and told["epoch"] != first["epoch"]
        await publish(gw, chat_id, {"type": "note", "data": {"after": True}})
        later = await ws.wait_for(lambda f: f.get("type") == "note", timeout=10)
        assert later["seq"] == told["seq"] + 1 and later["data"] == {"after": True}


async def test_the_python_sdk_surfaces_lost_history_as_recovery(
        private: tuple[EmbeddedRedis, Any], user: str, chat_id: str) -> None:
    server, gw = private
    async with GatewayClient(gw.ws, token_factory=lambda: gw.token(user), **FAST) as client:
        sub = await client.subscribe(chat_id)
        watch, task = collect(client.events(chat_id))
        await publish(gw, chat_id, {"type": "note", "data": {}})
        await watch.until(lambda items: len(items) == 1)
        server.stop()
        server.start()
        await watch.until(lambda items: any(isinstance(i, Recovery) for i in items), 20)
        recovery = next(i for i in watch.items if isinstance(i, Recovery))
        assert recovery.previous_epoch == sub.epoch and recovery.epoch != sub.epoch
        await publish(gw, chat_id, {"type": "note", "data": {"n": 1}})
        await watch.until(lambda items: getattr(items[-1], "seq", None) == 1)
        assert client.position(chat_id) == (1, recovery.epoch)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_gap_already_trimmed_from_the_stream_resyncs_with_recovered_false(
        start_gateway: Any, tmp_path: Path, user: str, chat_id: str) -> None:
    """Pub/sub lost a stretch of events, and the stream no longer holds it either."""
    server = EmbeddedRedis(tmp_path / "redis", persistent=False)
    gw = start_gateway(redis_url=server.start(), demo_agent=0, history_maxlen=10)
    client = redis.Redis.from_url(server.url)
    try:
        async with connect(gw.url(user)) as ws:
            first = await ws.subscribe(chat_id)
            await publish(gw, chat_id, {"type": "note", "data": {}})
            assert [f["seq"] for f in await events_of(ws, chat_id, 1)] == [1]
            # The gateway's pub/sub connection drops; while it is away, far more events than
            # the stream keeps (trimming is approximate: Redis trims whole nodes of ~100).
            # Both in one transaction: the reader cannot be back before the publish.
            settings = Settings(redis_url=server.url, history_maxlen=10)
            script, keys, args = PublishScript(settings).call(
                chat_id, [OutEvent(type="note", data=b'{"i":%d}' % i) for i in range(400)],
                fresh="unused", create_owner="", writer="", idempotency_key=None)
            with client.pipeline(transaction=True) as pipe:
                pipe.client_kill_filter(_type="pubsub")
                pipe.eval(script.source, len(keys), *keys, *args)
                killed, _ = pipe.execute()
            assert killed >= 1
            told = await unasked_subscribed(ws, chat_id)
            assert told["recovered"] is False and told["replayed"] == 0
            assert told["epoch"] == first["epoch"] and told["seq"] == 401
            # Never a silent partial repair: no event of the lost stretch reached it.
            await publish(gw, chat_id, {"type": "note", "data": {"last": True}})
            after = await ws.wait_for(lambda f: f.get("type") == "note", timeout=10)
            assert after["seq"] == 402 and after["data"] == {"last": True}
    finally:
        client.close()
        gw.stop(signal.SIGKILL)
        server.stop()


async def test_readyz_fails_while_the_pubsub_connection_is_down(
        private: tuple[EmbeddedRedis, Any]) -> None:
    """Redis answers, yet live frames are not arriving: not ready."""
    server, gw = private
    client = redis.Redis.from_url(server.url)
    seen: set[int] = set()
    try:
        async with httpx.AsyncClient(base_url=gw.http) as http, asyncio.timeout(10), \
                connect(gw.url("u-ready")) as ws:
            # A room to read: the pub/sub connection is then in pub/sub mode (CLIENT KILL's
            # type pubsub).
            await ws.subscribe("ready")
            while 503 not in seen:  # kill it again and again: it is down most of the time
                client.client_kill_filter(_type="pubsub")
                for _ in range(50):  # it reconnects within about 50 ms
                    resp = await http.get("/readyz")
                    seen.add(resp.status_code)
                    if resp.status_code == 503:
                        assert resp.json()["error"]["message"] == "pubsub: reconnecting"
                        break
            # Back once it reconnects (each probe is a real request: no idle wait needed).
            while (await http.get("/readyz")).status_code != 200:
                pass
    finally:
        client.close()


async def test_an_acknowledged_event_survives_a_sigkill_of_the_embedded_server(
        tmp_path: Path) -> None:
    """The embedded default keeps an append-only file: what was acknowledged is in it
    (`appendfsync always` also covers a crash of the machine, which a test here cannot)."""
    server = EmbeddedRedis(tmp_path / "redis")  # persistent, as `gateway serve` runs it
    server.start()
    try:
        client = aioredis.from_url(server.url)
        store = Store(Backend.of(client, Settings()), Settings())
        for i in range(200):
            await store.publish("durable", [OutEvent(type="note", data=b'{"i":%d}' % i)],
                                create_owner="alice")
        await client.aclose()
        assert server.process is not None
        server.process.kill()  # no chance to flush anything
        server.process.wait()
        server.start()
        client = aioredis.from_url(server.url)
        history = await Store(Backend.of(client, Settings()), Settings()).read("durable", 0, 1000)
        await client.aclose()
        assert history.meta is not None and history.meta.seq == 200
        assert [seq for seq, _ in history.frames] == list(range(1, 201))
    finally:
        server.stop()


async def test_the_embedded_server_is_restarted_when_it_dies(
        gateway_env: dict[str, str], tmp_path: Path, user: str, chat_id: str) -> None:
    """`gateway serve` with no GATEWAY_REDIS_URL supervises its own server: SIGKILLed, it
    comes back on the same data, the gateway is ready again, and a client resumes with every
    acknowledged event, once."""
    env = {k: v for k, v in gateway_env.items() if k != "GATEWAY_REDIS_URL"}
    env.update(GATEWAY_PORT=str(free_port()), GATEWAY_DATA_DIR=str(tmp_path),
               GATEWAY_DEMO_AGENT="0")
    gw = GatewayProcess(env).start()
    try:
        async with connect(gw.url(user)) as ws:
            first = await ws.subscribe(chat_id)
            await publish(gw, chat_id, *({"type": "note", "data": {"i": i}} for i in range(3)))
            assert [f["seq"] for f in await ws.events(chat_id, 3)] == [1, 2, 3]
            server = psutil.Process(gw.proc.pid).children()  # type: ignore[union-attr]
            [valkey] = [p for p in server if "valkey" in p.name() or "redis" in p.name()]
            valkey.kill()
            # The supervisor starts it again, on the same data (a new process). /readyz may
            # or may not catch it down: on a busy machine the restart can beat any probe.
            def restarted() -> bool:
                children = psutil.Process(gw.proc.pid).children()  # type: ignore[union-attr]
                return any(p.pid != valkey.pid and ("valkey" in p.name() or "redis" in p.name())
                           for p in children)

            assert await until(restarted, timeout=20), "the server was not started again"
            async with httpx.AsyncClient(base_url=gw.http) as http, asyncio.timeout(20):
                while (await http.get("/readyz")).status_code != 200:
                    pass  # each probe is a real request
            await publish(gw, chat_id, {"type": "note", "data": {"i": 3}})
        async with connect(gw.url(user)) as ws:
            resumed = await ws.subscribe(chat_id, since={"epoch": first["epoch"], "seq": 3})
            assert resumed["recovered"] is True and resumed["epoch"] == first["epoch"]
            [after] = await ws.events(chat_id, 1)
            assert after["seq"] == 4 and after["data"] == {"i": 3}
    finally:
        gw.stop()


async def test_conversation_lists_of_the_old_key_layout_are_moved(
        private: tuple[EmbeddedRedis, Any], user: str) -> None:
    """Lists written before per-user hash tags (``convs:<user>``) are still listed after an
    upgrade: a restarted gateway moves them to the new key."""
    server, gw = private
    client = redis.Redis.from_url(server.url)
    try:
        client.zadd(f"convs:{user}", {"old-chat": 1000})
        gw.stop()
        gw.start()
        assert not client.exists(f"convs:{user}")
        assert client.zrange(f"{{u:{user}}}:convs", 0, -1) == [b"old-chat"]
    finally:
        client.close()
