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
from redis.asyncio.cluster import RedisCluster
from websockets.exceptions import ConnectionClosed

from gateway.config import Settings
from gateway.redis.keys import presence_key, room_channel
from gateway.sdk.agent import AgentWorker, Handler, Turn

from .cluster import ValkeyCluster
from .conftest import GatewayProcess, free_port
from .faults import until
from .steps import children, create, message_and_reply, open_child, publish, send_message
from .test_retention import Reader
from .wsclient import Client, Frame, connect

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


async def test_presence_and_typing_on_every_shard(
        pair: list[GatewayProcess], cluster: ValkeyCluster) -> None:
    """Presence lives in each conversation's own slot, and its frames and typing cross
    the two gateways on every shard."""
    a, b = pair
    chats = [c for group in chats_on_every_shard(cluster, per_shard=1).values() for c in group]
    user = "here-" + uuid.uuid4().hex[:6]
    async with connect(a.url(user)) as on_a, connect(b.url(user)) as on_b:
        for chat in chats:
            first = await on_a.subscribe(chat)
            assert first["snapshot"]["presence"]["users"] == [{"user_id": user,
                                                               "connections": 1}]
            second = await on_b.subscribe(chat)
            assert second["snapshot"]["presence"]["users"] == [{"user_id": user,
                                                                "connections": 2}]
            await on_a.wait_for(lambda f, c=chat: f["type"] == "presence" and f["chat_id"] == c
                                and f["users"] == [{"user_id": user, "connections": 2}])
            with cluster.primary_of(presence_key(chat)).client() as client:
                assert client.zcard(presence_key(chat)) == 2
            await on_b.send({"type": "typing", "chat_id": chat})
            assert (await on_b.expect("typed"))["sent"] is True
            typed = await on_a.wait_for(lambda f, c=chat: f["type"] == "typing"
                                        and f["chat_id"] == c)
            assert typed["user_id"] == user
        await on_b.close()
        for chat in chats:
            await on_a.wait_for(lambda f, c=chat: f["type"] == "presence" and f["chat_id"] == c
                                and f["users"] == [{"user_id": user, "connections": 1}])


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


@contextlib.asynccontextmanager
async def cluster_worker(cluster: ValkeyCluster, handler: Handler,
                         name: str) -> AsyncIterator[AgentWorker]:
    """An AgentWorker of agent ``name`` on a cluster client of its own, new entries only."""
    client = RedisCluster.from_url(cluster.url)
    worker = AgentWorker(client, Settings(redis_url=cluster.url), handler, name=name,
                         group="agents", start_id="$")
    await worker.start()
    try:
        yield worker
    finally:
        await worker.stop(grace=5)
        await client.aclose()


async def turn_ends(ws: Client, chats: list[str], within: float = 20) -> dict[str, list[Frame]]:
    """Each chat's frames on ``ws`` up to and including its next ``turn_end``."""
    frames: dict[str, list[Frame]] = {chat: [] for chat in chats}
    waiting = set(chats)
    async with asyncio.timeout(within):
        while waiting:
            frame = await ws.recv(within)
            if frame.get("chat_id") in waiting:
                frames[frame["chat_id"]].append(frame)
                if frame["type"] == "turn_end":
                    waiting.discard(frame["chat_id"])
    return frames


async def test_named_agents_never_take_each_others_turns(
        pair: list[GatewayProcess], cluster: ValkeyCluster) -> None:
    """Two agent names, a worker each on a cluster client, and conversations on every shard
    naming one or the other, messaged through both gateways: every turn is answered once,
    by the agent its conversation names, and a cancel reaches that agent's worker only.
    Each name has inbox partitions of its own, spread over the primaries."""
    a, b = pair
    user = "named" + uuid.uuid4().hex[:6]
    alpha, beta = "alpha-" + uuid.uuid4().hex[:6], "beta-" + uuid.uuid4().hex[:6]
    chats = [c for group in chats_on_every_shard(cluster, 4).values() for c in group]
    named = {chat: (alpha, beta)[n % 2] for n, chat in enumerate(chats)}  # 2 each per shard
    for n, chat in enumerate(chats):
        async with httpx.AsyncClient(base_url=pair[n % 2].http) as http:
            resp = await http.post("/v1/conversations", headers=pair[n % 2].headers(user),
                                   json={"chat_id": chat, "agent": named[chat]})
        assert resp.status_code == 201 and resp.json()["agent"] == named[chat], resp.text
    answered: list[tuple[str, str, str]] = []  # (agent, chat, turn) per handler run
    waiting: dict[str, asyncio.Event] = {chat: asyncio.Event() for chat in chats}
    cancelled: list[tuple[str, str]] = []

    def answering(name: str) -> Handler:
        async def handle(turn: Turn) -> None:
            answered.append((name, turn.chat_id, turn.turn_id))
            if turn.text == "wait for a cancel":
                await turn.delta("waiting")
                waiting[turn.chat_id].set()
                if await turn.sleep(15):
                    cancelled.append((name, turn.chat_id))
                return
            await turn.message(f"{name} here")
        return handle

    turns: list[tuple[str, str]] = []  # (chat, turn) of every turn_start
    async with cluster_worker(cluster, answering(alpha), alpha) as on_alpha, \
            cluster_worker(cluster, answering(beta), beta) as on_beta, \
            connect(a.url(user)) as ws_a, connect(b.url(user)) as ws_b:
        workers = {alpha: on_alpha, beta: on_beta}
        for ws in (ws_a, ws_b):
            for chat in chats:
                await ws.subscribe(chat)
        for round_ in range(2):
            for n, chat in enumerate(chats):  # handed off by either gateway, both agents
                await send_message((ws_a, ws_b)[(n // 2 + round_) % 2], chat, f"q{round_}")
            for ws in (ws_a, ws_b):
                for chat, frames in (await turn_ends(ws, chats)).items():
                    assert [f["data"]["text"] for f in frames if f["type"] == "message"] == [
                        f"{named[chat]} here"], (chat, frames)
                    assert frames[-1]["data"]["reason"] == "complete", frames[-1]
                    if ws is ws_a:
                        turns += [(chat, f["data"]["turn_id"]) for f in frames
                                  if f["type"] == "turn_start"]
        # A cancel of each agent's turn, on two different shards, reaches its worker.
        targets = [chats[0], chats[-1]]
        assert {named[c] for c in targets} == {alpha, beta}
        for chat in targets:
            await send_message(ws_a, chat, "wait for a cancel")
        for chat in targets:
            await asyncio.wait_for(waiting[chat].wait(), 10)
            await ws_b.send({"type": "cancel", "chat_id": chat})
        for chat, frames in (await turn_ends(ws_a, targets)).items():
            assert frames[-1]["data"]["reason"] == "cancelled", frames[-1]
            turns += [(chat, f["data"]["turn_id"]) for f in frames if f["type"] == "turn_start"]
        assert sorted(cancelled) == sorted((named[c], c) for c in targets)
        assert await until(lambda: on_alpha.stats["handled"] + on_beta.stats["handled"]
                           == len(turns))
        for name, worker in workers.items():
            mine = [t for t in answered if t[0] == name]
            assert worker.stats["handled"] == len(mine) and worker.stats["failed"] == 0
            assert worker.stats["cancels"] == 1, (name, worker.stats)
    assert len(turns) == 2 * len(chats) + 2
    # Every turn answered exactly once, by the agent its conversation names.
    assert sorted(answered) == sorted((named[chat], chat, turn) for chat, turn in turns)
    # Inboxes of their own, each name's partitions spread over every primary.
    assert not set(on_alpha.keys) & set(on_beta.keys)
    for worker in (on_alpha, on_beta):
        assert len({cluster.primary_of(key).port for key in worker.keys}) == 3


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


async def test_list_filters_and_retention_on_every_shard(
        pair: list[GatewayProcess], cluster: ValkeyCluster,
        gateway_env: dict[str, str]) -> None:
    """A filtered list walks chats of every shard page by page, through both gateways in
    turn, while some change; then two sweeping gateways delete each once: every subscriber
    on either gateway gets one ``deleted`` per chat, the owner's feed one deletion."""
    a, b = pair
    user = "u" + uuid.uuid4().hex[:8]
    chats = [c for group in chats_on_every_shard(cluster, 3).values() for c in group]
    for n, chat in enumerate(chats):
        await create(pair[n % 2], user, chat, f"{'Alpha' if n % 2 else 'beta'} {n}")
    alphas = set(chats[1::2])
    seen: list[str] = []
    cursor: str | None = None
    touched: set[str] = set()
    for page in range(len(chats) + 1):
        gw = pair[page % 2]
        params: dict[str, Any] = {"q": "alpha", "limit": 1}
        if cursor is not None:
            params["cursor"] = cursor
        async with httpx.AsyncClient(base_url=gw.http, headers=gw.headers(user)) as http:
            body = (await http.get("/v1/conversations", params=params)).json()
            seen += [c["chat_id"] for c in body["conversations"]]
            cursor = body["next_cursor"]
            if cursor is None:
                break
            ahead = sorted(alphas - set(seen) - touched)
            if ahead and page % 2:  # one not reached yet changes: it moves past the walk
                touched.add(ahead[0])
                resp = await http.patch(f"/v1/conversations/{ahead[0]}",
                                        json={"title": "alpha again"})
                assert resp.status_code == 200, resp.text
    assert len(seen) == len(set(seen)) and set(seen) <= alphas
    assert alphas - touched <= set(seen)
    async with connect(a.url(user)) as on_a, connect(b.url(user)) as on_b:
        for ws in (on_a, on_b):
            for chat in chats:
                await ws.subscribe(chat)
        readers = [Reader(on_a), Reader(on_b)]
        sweepers = start_gateways(gateway_env, cluster, conversation_ttl=1)
        try:
            for reader in readers:
                assert await until(lambda r=reader: set(chats) <= set(r.deleted()), 30,
                                   "deleted")
            for reader in readers:
                await reader.settle()
                assert reader.deleted() == dict.fromkeys(chats, 1)
                assert reader.feed_deleted() == dict.fromkeys(chats, 1)
        finally:
            for gw in sweepers:
                gw.stop()
            for reader in readers:
                await reader.stop()


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
