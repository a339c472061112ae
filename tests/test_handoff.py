"""The hand-off of a user message to the agents survives a crash, and happens once.

A gateway stages the inbox entry in its partition's outbox, publishes the message, then
hands off. Here the crash between publish and hand-off is a :class:`Conversations` in the
test process whose hand-off never runs; the shared ``gateway serve`` process's sweeper has
to do it. Everything else is real: the session's server, the gateway, an agent worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot

from gateway import protocol as p
from gateway.auth import Principal
from gateway.config import Settings
from gateway.conversations import Conversations
from gateway.embedded import EmbeddedRedis
from gateway.errors import Rejected
from gateway.redis.agent_inbox import Handoff, inbox_partition, partitions
from gateway.redis.backend import Backend
from gateway.redis.store import Store
from gateway.sdk.agent import AgentWorker, Turn

from .cluster import ValkeyCluster
from .steps import history, send_message
from .test_agent import agent_worker, eventually, of_type, until_turn_end
from .wsclient import connect

pytestmark = pytest.mark.anyio


@contextlib.asynccontextmanager
async def conversations(redis_url: str) -> AsyncIterator[Conversations]:
    """Conversation operations in this process, on the session's server, with hand-offs
    due for the sweeper at once (no grace)."""
    client = aioredis.from_url(redis_url)
    settings = Settings(redis_url=redis_url)
    convs = Conversations(Store(Backend.of(client, settings), settings), settings)
    convs.inbox.grace = 0
    try:
        yield convs
    finally:
        await client.aclose()


def crash_before_hand_off(convs: Conversations) -> list[Handoff]:
    """Make ``convs`` die, as far as the hand-off goes, right after its publish."""
    skipped: list[Handoff] = []

    async def never(handoff: Handoff, *args: Any) -> bool:
        skipped.append(handoff)
        return False

    convs.inbox.hand_off = never  # type: ignore[method-assign,assignment]
    return skipped


async def message(convs: Conversations, user: str, chat_id: str, text: str) -> p.Ack:
    return await convs.post_message(Principal(user), p.Message(chat_id, text, uuid.uuid4().hex))


async def inbox_entries(convs: Conversations, chat_id: str, turn_id: str | None) -> int:
    """Inbox entries of ``turn_id`` among the latest of its partition."""
    rows = await convs.store.redis.xrevrange(convs.inbox.partition(chat_id).inbox, count=2000)
    wanted = {b"kind": b"message", b"turn_id": str(turn_id).encode()}
    return len([fields for _, fields in rows or [] if wanted.items() <= (fields or {}).items()])


async def staged(convs: Conversations, handoff: Handoff) -> bool:
    score = await convs.store.redis.zscore(convs.inbox.partition(handoff.chat_id).outbox,
                                           handoff.member)
    return score is not None


async def handed(convs: Conversations, chat_id: str, turn_id: str | None) -> bool:
    score = await convs.store.redis.zscore(convs.inbox.partition(chat_id).handed,
                                           f"{chat_id} {turn_id}")
    return score is not None


# --- the sweeper ------------------------------------------------------------------------


async def test_a_message_whose_hand_off_never_happened_is_answered_once(
    gateway: Any, redis_url: str, group: str, user: str, chat_id: str
) -> None:
    turns: list[Turn] = []

    async def answer(turn: Turn) -> None:
        turns.append(turn)
        await turn.message("answered")

    async with conversations(redis_url) as convs, agent_worker(redis_url, answer, group), \
            connect(gateway.url(user)) as ws:
        skipped = crash_before_hand_off(convs)
        await ws.subscribe(chat_id)
        ack = await message(convs, user, chat_id, "is anyone there?")
        assert [h.turn_id for h in skipped] == [ack.turn_id]
        # The gateway's sweeper finds the staged hand-off and the turn running: it hands off.
        frames = await until_turn_end(ws, chat_id)
        assert of_type(frames, "message")[0]["data"]["text"] == "answered"
        assert frames[-1]["data"]["reason"] == "complete"
        assert not await staged(convs, skipped[0])  # nothing left to hand off later
        assert await inbox_entries(convs, chat_id, ack.turn_id) == 1
    assert [(t.turn_id, t.seq, t.text) for t in turns] == [(ack.turn_id, 1, "is anyone there?")]
    events = await history(gateway, user, chat_id)
    assert [e["type"] for e in events] == ["user_message", "turn_start", "head", "message",
                                           "turn_end"]


async def test_a_normal_message_is_handed_off_once(
    gateway: Any, redis_url: str, group: str, user: str, chat_id: str
) -> None:
    async def answer(turn: Turn) -> None:
        await turn.message("answered")

    async with conversations(redis_url) as convs, agent_worker(redis_url, answer, group), \
            connect(gateway.url(user)) as ws:
        await ws.subscribe(chat_id)
        await send_message(ws, chat_id, "hello")
        frames = await until_turn_end(ws, chat_id)
        turn_id = frames[-1]["data"]["turn_id"]
        assert await inbox_entries(convs, chat_id, turn_id) == 1
        assert await handed(convs, chat_id, turn_id)
        # A sweeper that read the entry before the gateway's hand-off removed it comes too
        # late: the turn was handed off already.
        late = Handoff(chat_id, turn_id, user, "hello", "x")
        assert await convs.inbox.hand_off(late, 1, 0, 0) is False
        assert await inbox_entries(convs, chat_id, turn_id) == 1


async def test_publisher_and_sweeper_racing_hand_off_each_turn_once(redis_url: str,
                                                                   user: str) -> None:
    """Hand-offs due at once, with a sweeper running flat out beside the publishers: each
    turn is handed off by exactly one of them, whoever comes first."""
    async with conversations(redis_url) as convs:
        stop = asyncio.Event()

        async def sweep() -> None:
            while not stop.is_set():
                await convs.hand_off_stranded()

        sweeper = asyncio.create_task(sweep())
        chats = [f"{user}-race-{i}" for i in range(30)]
        acks = await asyncio.gather(*(message(convs, user, chat, "hi") for chat in chats))
        stop.set()
        await sweeper
        for chat, ack in zip(chats, acks, strict=True):
            assert await inbox_entries(convs, chat, ack.turn_id) == 1, chat
            assert await handed(convs, chat, ack.turn_id)


async def test_a_publisher_late_for_its_hand_off_finds_it_done(
    gateway: Any, redis_url: str, group: str, user: str, chat_id: str
) -> None:
    """The sweeper hands off first (the publisher stalled after its publish); the
    publisher's own hand-off, when it comes, does nothing."""
    turns: list[Turn] = []

    async def answer(turn: Turn) -> None:
        turns.append(turn)
        await turn.message("answered")

    async with conversations(redis_url) as convs, agent_worker(redis_url, answer, group), \
            connect(gateway.url(user)) as ws:
        hand_off = convs.inbox.hand_off
        late: list[bool] = []

        async def stalled(handoff: Handoff, *args: Any) -> bool:
            async def swept() -> bool:
                return await handed(convs, handoff.chat_id, handoff.turn_id)

            await eventually(swept)  # the gateway's sweeper did it meanwhile
            late.append(await hand_off(handoff, *args))
            return late[-1]

        convs.inbox.hand_off = stalled  # type: ignore[method-assign,assignment]
        await ws.subscribe(chat_id)
        ack = await message(convs, user, chat_id, "hello")
        assert late == [False]
        frames = await until_turn_end(ws, chat_id)
        assert frames[-1]["data"]["turn_id"] == ack.turn_id
        assert await inbox_entries(convs, chat_id, ack.turn_id) == 1
    assert [t.turn_id for t in turns] == [ack.turn_id]


async def test_a_hand_off_not_replicated_in_time_refuses_the_message_unpublished(
    redis_url: str, user: str, chat_id: str
) -> None:
    """GATEWAY_WAIT_REPLICAS=1 on a server with no replica: the outbox entry is not safe, so
    the message is refused before its publish (a retry is safe) and nothing is stored."""
    client = aioredis.from_url(redis_url)
    settings = Settings(redis_url=redis_url, wait_replicas=1, wait_timeout_ms=50)
    convs = Conversations(Store(Backend.of(client, settings), settings), settings)
    try:
        with pytest.raises(Rejected) as refused:
            await message(convs, user, chat_id, "hello")
        assert refused.value.code == "replication_timeout"
        assert await convs.store.meta(chat_id) is None
    finally:
        await client.aclose()


async def test_a_hand_off_whose_publish_never_happened_is_dropped(
    gateway: Any, redis_url: str, user: str, chat_id: str
) -> None:
    async with conversations(redis_url) as convs:
        handoff = Handoff(chat_id, "t_" + uuid.uuid4().hex[:16], user, "lost", "c1")
        await convs.inbox.stage(handoff)  # ... and the gateway died before publishing

        async def dropped() -> bool:
            return not await staged(convs, handoff)

        await eventually(dropped)  # the gateway's sweeper: no conversation runs that turn
        assert await inbox_entries(convs, chat_id, handoff.turn_id) == 0
        assert not await handed(convs, chat_id, handoff.turn_id)
        assert await convs.store.meta(chat_id) is None


async def test_a_publish_landing_after_its_hand_off_was_dropped_still_hands_off(
    gateway: Any, redis_url: str, group: str, user: str, chat_id: str
) -> None:
    """A publish slower than the grace: the sweeper sees no turn and drops the hand-off;
    the publisher, its publish done, hands off itself."""

    async def answer(turn: Turn) -> None:
        await turn.message("answered")

    async with conversations(redis_url) as convs, agent_worker(redis_url, answer, group), \
            connect(gateway.url(user)) as ws:
        stage = convs.inbox.stage

        async def slow_stage(handoff: Handoff) -> None:
            await stage(handoff)

            async def dropped() -> bool:
                return not await staged(convs, handoff)

            await eventually(dropped)

        convs.inbox.stage = slow_stage  # type: ignore[method-assign]
        await ws.subscribe(chat_id)
        ack = await message(convs, user, chat_id, "slow")
        frames = await until_turn_end(ws, chat_id)
        assert frames[-1]["data"]["turn_id"] == ack.turn_id
        assert frames[-1]["data"]["reason"] == "complete"
        assert await inbox_entries(convs, chat_id, ack.turn_id) == 1


# --- partitions -------------------------------------------------------------------------


def test_partitions_spread_over_equal_slot_ranges_and_keep_their_keys_together() -> None:
    parts = partitions(8)
    third = 16384 // 3  # a cluster of three primaries splitting the slots evenly
    per_node = [0, 0, 0]
    for n, part in enumerate(parts):
        slots = {key_slot(key.encode())
                 for key in (part.inbox, part.turns, part.outbox, part.handed)}
        assert len(slots) == 1, part  # one slot: one script may touch them all
        (slot,) = slots
        assert n * 2048 <= slot < (n + 1) * 2048, (n, part)
        per_node[min(slot // third, 2)] += 1
    assert min(per_node) >= 2, per_node
    assert len({part.tag for part in parts}) == 8
    assert partitions(8) is parts  # computed once
    for count in (1, 3, 16, 100):
        assert all(n * 16384 // count <= key_slot(part.inbox.encode()) < (n + 1) * 16384 // count
                   for n, part in enumerate(partitions(count)))
    # A chat's partition is fixed (crc32), whatever process computes it.
    assert [inbox_partition(c, 8) for c in ("a", "trip", "chat-1")] == [3, 3, 4]


# --- the in-process demo agent ------------------------------------------------------------


async def test_demo_agent_resumes_its_turn_right_after_a_gateway_restart(
    start_gateway: Any, tmp_path: Path, user: str, chat_id: str
) -> None:
    """SIGKILL mid-turn, restart with the same settings and port: the demo agent, under the
    same consumer name, runs the turn it owned again at once (claim_idle is 30 s)."""
    server = EmbeddedRedis(tmp_path / "redis", persistent=False)  # a fresh "agents" group
    server.start()
    gw = start_gateway(redis_url=server.url, demo_agent=1)
    try:
        async with connect(gw.url(user)) as ws:
            await ws.subscribe(chat_id)
            await send_message(ws, chat_id, "/slow")  # about ten seconds of streaming
            first = await ws.wait_for(lambda f: f["type"] == "delta", timeout=10)
        gw.stop(signal.SIGKILL)
        gw.start()
        async with connect(gw.url(user)) as ws:
            await ws.subscribe(chat_id)
            again = await ws.wait_for(lambda f: f["type"] == "delta", timeout=8)
            assert again["stream"]["id"] != first["stream"]["id"]  # a new run of the turn
            await ws.send({"type": "cancel", "chat_id": chat_id})
            end = await ws.wait_for(lambda f: f["type"] == "turn_end", timeout=5)
        assert end["data"]["reason"] == "cancelled"
        events = await history(gw, user, chat_id)
        # The first run titled the chat ("Slow answer") before its first delta; the second
        # found it titled.
        assert [e["type"] for e in events] == ["user_message", "turn_start", "head", "title",
                                               "cancel_requested", "message", "turn_end"]
    finally:
        gw.stop()
        server.stop()


# --- on a cluster -----------------------------------------------------------------------


@pytest.mark.cluster
async def test_hand_offs_and_workers_on_a_cluster(tmp_path: Path) -> None:
    """Every partition in its own slot: the hand-off scripts, the sweeper and a worker
    reading each partition with its own call, on a real 3-primary cluster."""
    with ValkeyCluster(tmp_path / "cluster", replicas_each=0) as cluster:
        settings = Settings(redis_url=cluster.url)
        backend = await Backend.connect(settings)
        convs = Conversations(Store(backend, settings), settings)
        convs.inbox.grace = 0
        sweeper = Conversations(convs.store, settings)  # another gateway's
        client = RedisCluster.from_url(cluster.url)
        chats = [f"cluster-{i}" for i in range(24)]
        answered: dict[str, list[str]] = {chat: [] for chat in chats}
        all_done = asyncio.Event()

        async def answer(turn: Turn) -> None:
            answered[turn.chat_id].append(turn.turn_id)
            await turn.message("answered")
            if all(answered.values()):
                all_done.set()

        worker = AgentWorker(client, settings, answer, group="agents", claim_idle=30)
        try:
            await worker.start()
            assert [len(keys) for keys in worker._key_groups] == [1] * 8
            # Half of the messages lose their hand-off (their gateway "crashed"); the
            # sweeper does those.
            acks = [await message(convs, "u", chat, "hi") for chat in chats[:12]]
            crash_before_hand_off(convs)
            acks += [await message(convs, "u", chat, "hi") for chat in chats[12:]]
            assert await sweeper.hand_off_stranded() == 12
            async with asyncio.timeout(10):
                await all_done.wait()
            assert answered == {chat: [ack.turn_id] for chat, ack in zip(chats, acks,
                                                                          strict=True)}
            assert await sweeper.hand_off_stranded() == 0
            used = {convs.inbox.partition(chat).inbox for chat in chats}
            assert len({cluster.primary_of(key).port for key in used}) == 3
        finally:
            await worker.stop(grace=5)
            await client.aclose()
            await backend.aclose()
