"""GATEWAY_CONVERSATION_TTL: untouched conversations are deleted, once, whoever sweeps.

Two gateway processes sweep one server of the module's own (a sweeper deletes every old
conversation it finds: on the shared server it would take other tests' ones); the
in-process sweepers get a server of their own each test, which no gateway sweeps. Subscribers
on both get one ``deleted`` per conversation, the owner's feed one deletion, and the
processes' counts add up to the conversations deleted; a running turn keeps its
conversation until it ends. In-process: two sweepers racing over the same conversations,
and what the delete script decides for each kind of candidate.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

from gateway.config import Settings
from gateway.embedded import EmbeddedRedis
from gateway.events import now_ms
from gateway.redis.backend import Backend
from gateway.redis.keys import expiry_bucket, expiry_key, meta_key, room_channel
from gateway.redis.store import Store
from gateway.retention import Retention

from .conftest import GatewayProcess, free_port
from .faults import until
from .steps import children, create, open_child, publish, start_turn
from .test_metrics import scrape
from .wsclient import Client, Frame, connect

pytestmark = pytest.mark.anyio
TTL = 2  # seconds: room to subscribe before anything expires, on a busy machine too


@pytest.fixture(scope="module")
def own_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server = EmbeddedRedis(Path(tmp_path_factory.mktemp("retention")), persistent=False)
    try:
        yield server.start()
    finally:
        server.stop()


@pytest.fixture(scope="module")
def sweepers(own_redis: str, gateway_env: dict[str, str]) -> Iterator[list[GatewayProcess]]:
    """Two gateways that sweep with a TTL of ``TTL`` seconds."""
    started = []
    try:
        for _ in range(2):
            env = dict(gateway_env, GATEWAY_REDIS_URL=own_redis, GATEWAY_PORT=str(free_port()),
                       GATEWAY_CONVERSATION_TTL=str(TTL), GATEWAY_TURN_TIMEOUT="600")
            started.append(GatewayProcess(env).start())
        yield started
    finally:
        for gw in started:
            gw.stop()


class Reader:
    """Every frame a connection receives, feed frames too, kept in order."""

    def __init__(self, ws: Client) -> None:
        self.ws = ws
        self.frames: list[Frame] = []
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            self.frames.append(await self.ws.recv(timeout=3600, ignore=frozenset()))

    def deleted(self) -> Counter[str]:
        """Room ``deleted`` frames per chat."""
        return Counter(f["chat_id"] for f in self.frames if f["type"] == "deleted")

    def feed_deleted(self) -> Counter[str]:
        return Counter(f["chat_id"] for f in self.frames
                       if f["type"] == "conversation" and f.get("deleted"))

    def has(self, kind: str, **fields: Any) -> bool:
        return any(f["type"] == kind and all(f.get(k) == v for k, v in fields.items())
                   for f in self.frames)

    async def settle(self) -> None:
        """A ping's pong: whatever was sent before it has been read."""
        ping = uuid.uuid4().int % 10**9
        await self.ws.send({"type": "ping", "id": ping})
        assert await until(lambda: self.has("pong", id=ping), 10, "pong")

    async def stop(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


async def expired(gateways: list[GatewayProcess]) -> float:
    scrapes = await asyncio.gather(*(scrape(gw.http) for gw in gateways))
    return sum(s("gateway_conversations_expired_total") for s in scrapes)


async def test_untouched_ones_go_once_and_a_running_turn_waits(
        sweepers: list[GatewayProcess], user: str) -> None:
    a, b = sweepers
    counted = await expired(sweepers)
    running = "run-" + uuid.uuid4().hex[:8]
    idle = [f"idle{n}-{uuid.uuid4().hex[:6]}" for n in range(12)]
    async with connect(a.url(user)) as wa, connect(b.url(user)) as wb:
        await wa.subscribe(running)  # creates it
        await start_turn(wa, running)
        readers = [Reader(wa), Reader(wb)]
        try:
            for chat in idle:  # a subscribe creates each, on one gateway or the other
                for ws in (wa, wb):
                    await ws.send({"type": "subscribe", "chat_id": chat})
            await wb.send({"type": "subscribe", "chat_id": running})
            for reader, asked in zip(readers, (idle, [*idle, running]), strict=True):
                assert await until(lambda r=reader, asked=asked: all(
                    r.has("subscribed", chat_id=c) for c in asked), 10, "subscribed")
            for reader in readers:
                assert await until(lambda r=reader: set(idle) <= set(r.deleted()),
                                   TTL + 15, "deleted")
            # Older than every idle one, so looked at in the runs that deleted them: kept.
            async with httpx.AsyncClient(base_url=a.http) as http:
                resp = await http.get(f"/v1/conversations/{running}", headers=a.headers(user))
            assert resp.status_code == 200 and resp.json()["status"] == "running", resp.text
            for reader in readers:
                assert running not in reader.deleted()
            await publish(b, running, {"type": "turn_end", "data": {"reason": "complete"}})
            for reader in readers:
                assert await until(lambda r=reader: running in r.deleted(), TTL + 15,
                                   "deleted after its turn")
            for reader in readers:
                await reader.settle()
                everything = {*idle, running}
                assert reader.deleted() == dict.fromkeys(everything, 1)
                assert reader.feed_deleted() == dict.fromkeys(everything, 1)
        finally:
            for reader in readers:
                await reader.stop()
    assert await expired(sweepers) - counted == len(idle) + 1
    async with httpx.AsyncClient(base_url=b.http) as http:
        listed = (await http.get("/v1/conversations", headers=b.headers(user))).json()
    assert listed["conversations"] == [] and listed["next_cursor"] is None


async def test_a_family_goes_together_once_none_of_it_is_touched(
        sweepers: list[GatewayProcess], user: str) -> None:
    """A parent whose sub-conversation runs a turn is kept; once nothing in the family was
    touched for the TTL, parent and child go, each with one ``deleted``."""
    a, b = sweepers
    parent, child, later = (f"{kind}-{uuid.uuid4().hex[:8]}"
                            for kind in ("parent", "child", "later"))
    await create(a, user, parent)
    assert (await open_child(a, user, parent, child)).status_code == 201
    async with connect(a.url(user)) as wa, connect(b.url(user)) as wb:
        await wa.subscribe(child)
        await start_turn(wa, child)
        readers = [Reader(wa), Reader(wb)]
        try:
            for ws, chats in ((wa, (later, parent)), (wb, (later, parent, child))):
                for chat in chats:  # `later` is created by the first
                    await ws.send({"type": "subscribe", "chat_id": chat})
            for reader, asked in zip(readers, ((later, parent), (later, parent, child)),
                                     strict=True):
                assert await until(lambda r=reader, asked=asked: all(
                    r.has("subscribed", chat_id=c) for c in asked), 10, "subscribed")
            for reader in readers:
                assert await until(lambda r=reader: later in r.deleted(), TTL + 15, "deleted")
            # Both older than `later`, so looked at in the run that deleted it: kept.
            assert [c["chat_id"] for c in await children(b, user, parent)] == [child]
            await publish(b, child, {"type": "turn_end", "data": {"reason": "complete"}})
            for reader in readers:
                assert await until(lambda r=reader: {parent, child} <= set(r.deleted()),
                                   TTL + 15, "the family deleted")
            for reader in readers:
                await reader.settle()
                assert reader.deleted() == {parent: 1, child: 1, later: 1}
                assert reader.feed_deleted() == {parent: 1, child: 1, later: 1}
        finally:
            for reader in readers:
                await reader.stop()


@pytest.fixture
def quiet_redis(tmp_path: Path) -> Iterator[str]:
    """A server no gateway sweeps: the in-process sweepers below are the only ones."""
    server = EmbeddedRedis(tmp_path / "redis", persistent=False)
    try:
        yield server.start()
    finally:
        server.stop()


@pytest.fixture
async def stores(quiet_redis: str) -> AsyncIterator[list[Store]]:
    """Two stores with clients of their own, as two processes have."""
    clients = [aioredis.from_url(quiet_redis) for _ in range(2)]
    settings = Settings(redis_url=quiet_redis, conversation_ttl=60)
    try:
        yield [Store(Backend.of(client, settings), settings) for client in clients]
    finally:
        for client in clients:
            await client.aclose()


async def backdate(store: Store, chat: str, ms: int) -> None:
    """Make ``chat`` look untouched since ``ms``: its meta and its retention entry."""
    await store.redis.hset(meta_key(chat), "updated_at", ms)
    await store.redis.zadd(expiry_key(expiry_bucket(chat)), {chat: ms})


async def test_two_sweepers_at_once(stores: list[Store], user: str) -> None:
    """Both sweep the same old conversations at the same moment: each is deleted by one of
    them, and its room hears one ``deleted``."""
    store = stores[0]
    chats = [f"race{n}-{uuid.uuid4().hex[:6]}" for n in range(40)]
    old = now_ms() - 120_000
    for chat in chats:
        await store.publish(chat, [], create_owner=user, writer=user)
        await backdate(store, chat, old)
    pubsub = store.redis.pubsub()
    await pubsub.execute_command("SSUBSCRIBE", *(room_channel(c) for c in chats))
    sweepers = [Retention(s, s.settings) for s in stores]
    deleted = [0, 0]
    for _ in range(10):  # each run is bounded (8 a bucket): as many runs as it takes
        counts = await asyncio.gather(*(s.sweep() for s in sweepers))
        deleted = [d + c for d, c in zip(deleted, counts, strict=True)]
        if not any(await asyncio.gather(*(store.redis.exists(meta_key(c)) for c in chats))):
            break
    assert sum(deleted) == len(chats), deleted
    frames: Counter[str] = Counter()
    await pubsub.execute_command("PING")  # after the messages published before it
    async with asyncio.timeout(10):
        while True:
            message = await pubsub.parse_response(block=True)
            if message == b"PONG" or message[0] == b"pong":
                break
            if message[0] == b"smessage" and b'"type":"deleted"' in message[2]:
                frames[message[1].decode()] += 1
    await pubsub.aclose()
    assert frames == {room_channel(c): 1 for c in chats}


async def test_what_the_script_decides(stores: list[Store], user: str) -> None:
    store = stores[0]
    sweeper = Retention(store, store.settings)
    old, now = now_ms() - 120_000, now_ms()
    touched, untouched, running = (f"{kind}-{uuid.uuid4().hex[:6]}"
                                   for kind in ("touched", "untouched", "running"))
    for chat in (touched, untouched, running):
        await store.publish(chat, [], create_owner=user, writer=user)
    # touched: its list change is old, but something was stored since (updated_at)
    await store.redis.zadd(expiry_key(expiry_bucket(touched)), {touched: old})
    await backdate(store, untouched, old)
    await backdate(store, running, old)
    await store.redis.hset(meta_key(running), "status", "running")
    ghost = "ghost-" + uuid.uuid4().hex[:6]  # its deletion's list change was lost
    await store.redis.zadd(expiry_key(expiry_bucket(ghost)), {ghost: old})

    assert await sweeper.sweep() == 1
    assert not await store.redis.exists(meta_key(untouched))
    assert await store.redis.exists(meta_key(touched)) and \
        await store.redis.exists(meta_key(running))
    meta = await store.meta(touched)
    assert meta is not None
    assert await store.redis.zscore(expiry_key(expiry_bucket(touched)), touched) == \
        meta.updated_at  # looked at again when it could expire
    score = await store.redis.zscore(expiry_key(expiry_bucket(running)), running)
    assert score is not None and score >= now  # looked at again a TTL from now
    assert await store.redis.zscore(expiry_key(expiry_bucket(ghost)), ghost) is None
    assert await store.redis.zscore(expiry_key(expiry_bucket(untouched)), untouched) is None
    for chat in (touched, running):
        await store.delete(chat)
