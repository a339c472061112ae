"""The gateway on a real Redis Cluster (3 primaries, 3 replicas), with two gateways.

The gateway is given one node's URL and nothing else; it finds the cluster by itself.
Faults (a failover, a primary SIGKILLed, a slot migrated) happen under continuous
publishing, and every acknowledged event must reach a live subscriber once and in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.exceptions import ConnectionClosed

from gateway.redis.keys import room_channel

from .cluster import ValkeyCluster
from .conftest import GatewayProcess, free_port
from .faults import until
from .steps import children, create, message_and_reply, open_child, publish, send_message
from .wsclient import Frame, connect

pytestmark = [pytest.mark.anyio, pytest.mark.cluster]


def start_gateways(env: dict[str, str], cluster: ValkeyCluster, count: int = 2,
                   **settings: Any) -> list[GatewayProcess]:
    """``count`` gateways, each pointed at a different node of ``cluster``."""
    gateways = []
    for i in range(count):
        node = cluster.nodes[i % len(cluster.nodes)]
        process_env = dict(env, GATEWAY_REDIS_URL=node.url, GATEWAY_PORT=str(free_port()))
        process_env.update({f"GATEWAY_{k.upper()}": str(v) for k, v in settings.items()})
        gateways.append(GatewayProcess(process_env).start())
    return gateways


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ValkeyCluster]:
    with ValkeyCluster(tmp_path_factory.mktemp("cluster")) as started:
        yield started


@pytest.fixture(scope="module")
def pair(cluster: ValkeyCluster, gateway_env: dict[str, str]) -> Iterator[list[GatewayProcess]]:
    gateways = start_gateways(gateway_env, cluster)
    yield gateways
    for gw in gateways:
        gw.stop()


def chats_on_every_shard(cluster: ValkeyCluster, per_shard: int = 2) -> dict[int, list[str]]:
    """Chat ids whose slots are spread so that each primary owns ``per_shard`` of them."""
    found: dict[int, list[str]] = {}
    primaries = len(cluster.nodes_by_role("master"))
    while sum(len(v) for v in found.values()) < per_shard * primaries:
        chat = "c-" + uuid.uuid4().hex[:10]
        port = cluster.primary_of(room_channel(chat)).port
        if len(found.setdefault(port, [])) < per_shard:
            found[port].append(chat)
    return found


async def test_core_paths_on_the_cluster(pair: list[GatewayProcess]) -> None:
    """Subscribe on one gateway, publish through the other, resume, list, delete."""
    a, b = pair
    user, chat = "u" + uuid.uuid4().hex[:8], "c-" + uuid.uuid4().hex[:10]
    async with connect(a.url(user)) as ws:
        first = await ws.subscribe(chat)
        await send_message(ws, chat, "hi", "m1")
        assert [f["type"] for f in await ws.events(chat, 3)] == ["user_message", "turn_start",
                                                                 "head"]
        await publish(b, chat, {"type": "turn_end", "data": {"reason": "complete"}},
                      {"type": "title", "data": {"title": "Cluster"}})
        assert [f["type"] for f in await ws.events(chat, 2)] == ["turn_end", "title"]
        conversation = await ws.wait_for(lambda f: f["type"] == "conversation"
                                         and f.get("title") == "Cluster")
        assert conversation["chat_id"] == chat
    async with connect(b.url(user)) as ws:
        resumed = await ws.subscribe(chat, since={"epoch": first["epoch"], "seq": 3})
        assert resumed["recovered"] is True
        assert [f["seq"] for f in await ws.events(chat, 2)] == [4, 5]
    async with httpx.AsyncClient(base_url=b.http, headers=b.headers(user)) as http:
        listed = (await http.get("/v1/conversations")).json()
        assert [c["chat_id"] for c in listed["conversations"]] == [chat]
        assert (await http.delete(f"/v1/conversations/{chat}")).status_code in (200, 204)
        assert (await http.get(f"/v1/conversations/{chat}")).status_code == 404


async def test_tree_operations_on_every_shard(pair: list[GatewayProcess],
                                             cluster: ValkeyCluster) -> None:
    """Retry, undo and switch on a chat of each shard: the tree lives in the chat's slot, and
    a device on the other gateway follows every head move."""
    a, b = pair
    user = "tree" + uuid.uuid4().hex[:6]
    for group in chats_on_every_shard(cluster, per_shard=1).values():
        chat = group[0]
        async with connect(a.url(user)) as ws, connect(b.url(user)) as follower:
            await ws.subscribe(chat)
            await follower.subscribe(chat)
            ack, (*_, first) = await message_and_reply(ws, chat, "hi")
            assert first["type"] == "head" and ack["head"] == first["data"]["head_id"]
            await publish(b, chat, {"type": "turn_end", "data": {"reason": "complete"}})
            heads = []
            for frame in ({"type": "retry"}, {"type": "undo"},
                          {"type": "switch", "node_id": first["data"]["head_id"]}):
                await ws.send({**frame, "chat_id": chat})
                ack = await ws.wait_for(lambda f: f.get("type") in ("ack", "error"))
                assert ack["type"] == "ack", ack
                heads.append(ack["head"])
                if frame["type"] == "retry":
                    await publish(b, chat, {"type": "turn_end", "data": {}})
            moves = []
            while len(moves) < 4:  # the message's head move, then the three operations'
                f = await follower.wait_for(lambda f: f.get("type") == "head")
                moves.append(f["data"]["head_id"])
            assert moves == [first["data"]["head_id"], *heads], (moves, heads)
            assert heads[1] is None and heads[2] == first["data"]["head_id"] != heads[0]


async def test_usage_totals_on_every_shard(pair: list[GatewayProcess],
                                           cluster: ValkeyCluster) -> None:
    """Usage summed in the chat's slot, through a retry, and told through the owner's feed
    (another slot) to a device on the other gateway."""
    a, b = pair
    user = "usage" + uuid.uuid4().hex[:6]
    for group in chats_on_every_shard(cluster, per_shard=1).values():
        chat = group[0]
        async with connect(a.url(user)) as ws, connect(b.url(user)) as follower:
            await ws.subscribe(chat)
            await follower.send({"type": "ping", "id": 1})  # the feed is live after a reply
            await follower.wait_for(lambda f: f.get("type") == "pong")
            await message_and_reply(ws, chat, "hi")
            await publish(b, chat, {"type": "turn_end", "data": {"usage": {"output_tokens": 5}}})
            await ws.send({"type": "retry", "chat_id": chat})
            assert (await ws.wait_for(lambda f: f.get("type") in ("ack", "error")))["type"] == "ack"
            await publish(a, chat, {"type": "turn_end", "data": {"usage": {"output_tokens": 7}}})
            feed = await follower.wait_for(
                lambda f, chat=chat: f.get("type") == "conversation" and f["chat_id"] == chat
                and f["usage"]["billed"].get("output_tokens") == 12)
            assert feed["usage"]["active"] == {"output_tokens": 7}
            async with httpx.AsyncClient(base_url=b.http) as http:
                resp = await http.get(f"/v1/conversations/{chat}", headers=b.headers(user))
            assert resp.json()["usage"] == {"billed": {"output_tokens": 12},
                                            "active": {"output_tokens": 7}}


async def test_chats_on_every_shard_reach_both_gateways(
        pair: list[GatewayProcess], cluster: ValkeyCluster) -> None:
    """Each room's traffic stays on its own shard: its channel is subscribed on the primary
    that owns its slot and on no other node."""
    a, b = pair
    shards = chats_on_every_shard(cluster)
    chats = [c for group in shards.values() for c in group]
    async with connect(a.url("spread")) as on_a, connect(b.url("spread")) as on_b:
        for ws in (on_a, on_b):
            for chat in chats:
                await ws.subscribe(chat)
        for chat in chats:
            await publish(a if hash(chat) % 2 else b, chat, {"type": "note", "data": {"c": chat}})
        for ws in (on_a, on_b):
            got = [await ws.recv() for _ in chats]
            assert sorted(f["chat_id"] for f in got) == sorted(chats)
        for port, group in shards.items():
            for node in cluster.nodes_by_role("master"):
                with node.client() as client:
                    counts = client.pubsub_shardnumsub(*(room_channel(c) for c in group))
                subscribed = [int(n) for _, n in counts]
                assert subscribed == [2 if node.port == port else 0] * len(group), node.port


async def test_children_on_other_shards_than_their_parent(
        pair: list[GatewayProcess], cluster: ValkeyCluster) -> None:
    """A parent, its child and grandchild each on a shard of its own: opened through one
    gateway, listed and deleted through the other, every subscriber of each told."""
    a, b = pair
    user = "kin" + uuid.uuid4().hex[:6]
    parent, child, grandchild = (group[0] for group in
                                 chats_on_every_shard(cluster, per_shard=1).values())
    await create(a, user, parent)
    async with connect(b.url(user)) as on_b, connect(a.url(user)) as on_a:
        await on_b.subscribe(parent)
        assert (await open_child(a, user, parent, child, title="Sub")).status_code == 201
        (event,) = await on_b.events(parent, 1)
        assert event["type"] == "child" and event["data"] == {"chat_id": child, "title": "Sub"}
        resp = await open_child(a, "agent", child, grandchild, role="service")
        assert resp.status_code == 201 and resp.json()["owner"] == user
        assert [c["chat_id"] for c in await children(b, user, parent)] == [child]
        assert [c["chat_id"] for c in (await on_a.subscribe(parent))["snapshot"]["children"]
                ] == [child]
        for ws, chat in ((on_a, child), (on_b, grandchild)):
            await ws.subscribe(chat)
        async with httpx.AsyncClient(base_url=b.http, headers=b.headers(user)) as http:
            assert (await http.delete(f"/v1/conversations/{parent}")).status_code == 204
            gone = [(await ws.expect("deleted"))["chat_id"] for ws in (on_a, on_a, on_b, on_b)]
            assert sorted(gone) == sorted([parent, child, parent, grandchild])
            for chat in (parent, child, grandchild):
                assert (await http.get(f"/v1/conversations/{chat}")).status_code == 404


class Load:
    """Publishes numbered events to ``chats`` through one gateway (each with an idempotency
    key, retried until acknowledged) while subscribers on the other gateway collect them."""

    def __init__(self, publisher: GatewayProcess, chats: list[str]) -> None:
        self.publisher = publisher
        self.chats = chats
        self.acked: dict[str, list[int]] = {c: [] for c in chats}
        self.seen: dict[str, list[int]] = {c: [] for c in chats}
        self.resyncs = 0
        self.running = True

    async def publish_until_stopped(self, chat: str) -> None:
        n = 0
        async with httpx.AsyncClient(base_url=self.publisher.http, timeout=5,
                                     headers=self.publisher.headers("agent", "service")) as http:
            while self.running:
                n += 1
                body = {"events": [{"type": "note", "data": {"n": n}}],
                        "idempotency_key": f"{chat}-{n}"}
                while True:  # the same key until acknowledged: a retry is never a duplicate
                    with contextlib.suppress(httpx.HTTPError):
                        resp = await http.post(f"/v1/conversations/{chat}/events", json=body)
                        if resp.status_code == 200:
                            self.acked[chat].append(n)
                            break
                    await asyncio.sleep(0.05)
                await asyncio.sleep(0.01)

    async def subscribe(self, gw: GatewayProcess, ready: asyncio.Event) -> None:
        """Follow every chat; on a dropped connection, resume from the last seq seen."""
        since: dict[str, Frame] = {}
        while True:
            try:
                async with connect(gw.url("loader")) as ws:
                    for chat in self.chats:
                        reply = await ws.subscribe(chat, since=since.get(chat))
                        self._on_subscribed(reply, since)
                    ready.set()
                    while True:
                        frame = await ws.recv(timeout=3600)
                        if frame["type"] == "subscribed":  # unasked: history was lost
                            self._on_subscribed(frame, since)
                        elif frame.get("seq") is not None and frame["type"] == "note":
                            chat = frame["chat_id"]
                            self.seen[chat].append(frame["data"]["n"])
                            since[chat] = {"epoch": since[chat]["epoch"], "seq": frame["seq"]}
            except (ConnectionClosed, OSError):
                await asyncio.sleep(0.1)

    def _on_subscribed(self, reply: Frame, since: dict[str, Frame]) -> None:
        if reply.get("recovered") is False:
            self.resyncs += 1
        since[reply["chat_id"]] = {"epoch": reply["epoch"], "seq": reply["seq"]}

    async def all_delivered(self, timeout: float = 15) -> None:
        assert await until(lambda: all(self.seen[c][-len(a):] == a
                                       for c, a in self.acked.items() if a), timeout)

    def check(self) -> None:
        for chat in self.chats:
            assert self.acked[chat], f"nothing acknowledged on {chat}"
            # Once each, in order, no gap: exactly the acknowledged numbers.
            assert self.seen[chat] == self.acked[chat], chat
        assert self.resyncs == 0


@contextlib.asynccontextmanager
async def running(load: Load, subscriber: GatewayProcess) -> AsyncIterator[Load]:
    ready = asyncio.Event()
    tasks = [asyncio.create_task(load.subscribe(subscriber, ready))]
    await asyncio.wait_for(ready.wait(), 10)
    tasks += [asyncio.create_task(load.publish_until_stopped(c)) for c in load.chats]
    try:
        yield load
        load.running = False
        await asyncio.wait(tasks[1:], timeout=15)
        await load.all_delivered()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_failover_under_load_loses_nothing(
        pair: list[GatewayProcess], cluster: ValkeyCluster) -> None:
    """``CLUSTER FAILOVER`` (a planned switch) on the shard of a live chat."""
    a, b = pair
    chats = [c for group in chats_on_every_shard(cluster, 1).values() for c in group]
    load = Load(a, chats)
    async with running(load, b):
        assert await until(lambda: all(len(v) >= 5 for v in load.seen.values()))
        primary = cluster.primary_of(room_channel(chats[0]))
        replica = cluster.replica_of(primary)
        with replica.client() as client:
            client.execute_command("CLUSTER FAILOVER")
        assert await until(lambda: replica.role() == "master")
        counted = {c: len(v) for c, v in load.acked.items()}
        assert await until(lambda: all(len(load.acked[c]) > counted[c] + 5 for c in chats))
    load.check()
    cluster.wait_ok()


async def test_a_slot_migrated_while_a_chat_is_live(
        pair: list[GatewayProcess], cluster: ValkeyCluster) -> None:
    """The chat's slot moves to another primary; its keys go with it (MIGRATE)."""
    a, b = pair
    chat = "c-" + uuid.uuid4().hex[:10]
    load = Load(a, [chat])
    async with running(load, b):
        assert await until(lambda: len(load.seen[chat]) >= 5)
        source = cluster.primary_of(room_channel(chat))
        target = next(n for n in cluster.nodes_by_role("master") if n is not source)
        migrate_slot(source, target, room_channel(chat))
        assert cluster.primary_of(room_channel(chat)) is target
        counted = len(load.acked[chat])
        assert await until(lambda: len(load.acked[chat]) > counted + 10)
    load.check()


def migrate_slot(source: Any, target: Any, key: str) -> None:
    """The standard slot migration, step by step, as an operator's tool runs it."""
    with source.client() as src, target.client() as dst:
        slot = int(src.execute_command("CLUSTER KEYSLOT", key))
        source_id, target_id = source.node_id(), target.node_id()
        dst.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", source_id)
        src.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", target_id)
        while keys := src.execute_command("CLUSTER GETKEYSINSLOT", slot, 100):
            src.execute_command("MIGRATE", "127.0.0.1", target.port, "", 0, 5000,
                                "REPLACE", "KEYS", *keys)
        dst.execute_command("CLUSTER SETSLOT", slot, "NODE", target_id)
        src.execute_command("CLUSTER SETSLOT", slot, "NODE", target_id)


@pytest.mark.slow
async def test_a_primary_sigkilled_under_load(
        gateway_env: dict[str, str], tmp_path: Path) -> None:
    """A primary dies without warning. With ``GATEWAY_WAIT_REPLICAS=1`` an acknowledged
    event is on a replica, so the promoted replica has it: nothing acknowledged is lost."""
    with ValkeyCluster(tmp_path / "cluster") as cluster:
        gateways = start_gateways(gateway_env, cluster, wait_replicas=1, wait_timeout_ms=500)
        try:
            a, b = gateways
            chats = [c for group in chats_on_every_shard(cluster, 1).values() for c in group]
            load = Load(a, chats)
            async with running(load, b):
                assert await until(lambda: all(len(v) >= 5 for v in load.seen.values()))
                victim = cluster.primary_of(room_channel(chats[0]))
                replica = cluster.replica_of(victim)
                victim.kill(signal.SIGKILL)
                assert await until(lambda: replica.role() == "master", timeout=20)
                # Back as the new primary's replica: WAIT 1 can be met on that shard again.
                victim.start()
                counted = {c: len(v) for c, v in load.acked.items()}
                assert await until(lambda: all(len(load.acked[c]) > counted[c] + 5
                                             for c in chats), timeout=20)
            load.check()
        finally:
            for gw in gateways:
                gw.stop()


async def test_a_failover_to_a_replica_that_lagged_forks_nothing(
        pair: list[GatewayProcess], cluster: ValkeyCluster) -> None:
    """History that goes backwards under the same epoch (a replica promoted before it had
    the last writes) is never silent: live subscribers get ``recovered: false``."""
    a, b = pair
    chat = "c-" + uuid.uuid4().hex[:10]
    async with connect(b.url("lag")) as ws:
        first = await ws.subscribe(chat)
        await publish(a, chat, *({"type": "note", "data": {"i": i}} for i in range(3)))
        assert [f["seq"] for f in await ws.events(chat, 3)] == [1, 2, 3]
        # What a lagging replica looks like once promoted: the same epoch, fewer events.
        primary = cluster.primary_of(room_channel(chat))
        with primary.client() as client:
            stream = f"c:{{{chat}}}:stream"
            [(entry_id, fields)] = client.xrange(stream, count=1)
            client.delete(stream)
            client.xadd(stream, fields, id=entry_id)
            client.hset(f"c:{{{chat}}}:meta", "seq", 1)
        replica = cluster.replica_of(primary)
        with replica.client() as client:
            client.execute_command("CLUSTER FAILOVER")
        assert await until(lambda: replica.role() == "master")
        told = await ws.wait_for(lambda f: f["type"] == "subscribed", timeout=15)
        assert told["recovered"] is False and told["epoch"] != first["epoch"]
        await publish(a, chat, {"type": "note", "data": {"i": 9}})
        after = await ws.events(chat, 1)
        assert after[0]["data"] == {"i": 9}
    cluster.wait_ok()
