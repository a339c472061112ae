"""``/metrics`` of a real gateway: the counts move by what clients and agents did, the
exposition parses, no label carries a chat or a user, the separate port, ``--workers``."""

from __future__ import annotations

import asyncio
import contextlib
import glob
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import redis
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

from gateway.embedded import EmbeddedRedis
from gateway.redis.agent_inbox import inbox_key, inbox_partition, partitions

from . import faults
from .conftest import GatewayProcess, connect, free_port
from .steps import create, message_and_reply, post_events, publish

pytestmark = pytest.mark.anyio

# Every family the gateway exports (a renamed or lost one breaks dashboards).
FAMILIES = {
    "gateway_connections", "gateway_connections_opened", "gateway_connections_closed",
    "gateway_subscriptions", "gateway_rooms", "gateway_frames_in", "gateway_frames_out",
    "gateway_bytes_out", "gateway_fanouts", "gateway_deliveries", "gateway_publish_seconds",
    "gateway_publish_errors", "gateway_replays", "gateway_gap_repairs",
    "gateway_history_lost", "gateway_resyncs", "gateway_redis_errors",
    "gateway_pubsub_reconnects", "gateway_pubsub_reroutes", "gateway_cluster_slot_map_reloads",
    "gateway_cluster_redirects", "gateway_replica_waits", "gateway_replication_timeouts",
    "gateway_ready", "gateway_inbox_lag", "gateway_inbox_pending", "gateway_turns_running",
    "gateway_inbox_reclaimed", "gateway_handoffs_swept", "gateway_turn_seconds",
    "gateway_turn_timeouts", "gateway_conversations_expired", "gateway_streams_open",
    "gateway_streamed_bytes", "gateway_stream_snapshots", "gateway_streams_discarded",
    "gateway_event_loop_tasks",
}


class Scrape:
    """One parsed ``/metrics`` answer."""

    def __init__(self, text: str) -> None:
        self.families = {f.name: f for f in text_string_to_metric_families(text)}
        self.samples = {(s.name, frozenset(s.labels.items())): s.value
                        for f in self.families.values() for s in f.samples}

    def __call__(self, name: str, **labels: str) -> float:
        """A sample's value (0 when absent: a counter not moved yet)."""
        return self.samples.get((name, frozenset(labels.items())), 0.0)

    def label_values(self) -> set[str]:
        return {value for _, labels in self.samples for _, value in labels}


async def scrape(url: str) -> Scrape:
    async with httpx.AsyncClient() as http:
        resp = await http.get(url + "/metrics")
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("text/plain")
    return Scrape(resp.text)


async def until(url: str, check: Callable[[Scrape], bool], timeout: float = 10.0) -> Scrape:
    """Scrape until ``check`` holds (counts written by other processes, closes finishing)."""
    async with asyncio.timeout(timeout):
        while True:
            got = await scrape(url)
            if check(got):
                return got
            await asyncio.sleep(0.1)


def moved(before: Scrape, after: Scrape, name: str, **labels: str) -> float:
    return after(name, **labels) - before(name, **labels)


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[str]:
    """A Redis of the test's own: the inbox lag then counts its messages only (on the shared
    one, other tests' messages and trims make the lag another number, or unknown)."""
    server = EmbeddedRedis(tmp_path / "redis", persistent=False)
    try:
        yield server.start()
    finally:
        server.stop()


async def test_a_session_moves_the_counts_by_what_it_did(
    start_gateway: Any, own_redis: str, user: str, chat_id: str, group: str
) -> None:
    redis_url = own_redis
    gw = start_gateway(turn_timeout=600, redis_url=redis_url)
    partition = inbox_partition(chat_id, 8)
    client = redis.Redis.from_url(redis_url)
    client.xgroup_create(inbox_key(partition), group, id="$", mkstream=True)
    before = await scrape(gw.http)
    async with connect(gw.url(user)) as first:
        subscribed = await first.subscribe(chat_id)
        ack, _ = await message_and_reply(first, chat_id, "plan a day in Lisbon")
        assert ack["type"] == "ack", ack
        delta = {"type": "delta", "data": {"text": "Sure"}, "durable": False, "attempt": "a1"}
        await publish(gw, chat_id, delta)
        await first.wait_for(lambda f: f.get("type") == "delta")
        during = await scrape(gw.http)
        async with connect(gw.url(user)) as second:
            # A resume from seq 1 (the user message): two events replayed, the answer's
            # stream sent whole; then one from an epoch the conversation never had.
            resumed = await second.subscribe(chat_id, {"seq": 1, "epoch": subscribed["epoch"]})
            assert resumed["recovered"] is True and resumed["replayed"] == 2  # start, head
            assert len(resumed["snapshot"]["streams"]) == 1
            await second.expect("turn_start", seq=2)
            await second.expect("head", seq=3)
            lost = await second.subscribe(chat_id, {"seq": 1, "epoch": "gone"})
            assert lost["recovered"] is False and len(lost["snapshot"]["streams"]) == 1
            await publish(gw, chat_id, {"type": "message", "data": {}, "attempt": "a1"},
                          {"type": "turn_end", "data": {"reason": "complete"}})
            await second.wait_for(lambda f: f.get("type") == "turn_end")
            await first.wait_for(lambda f: f.get("type") == "turn_end")
            refused = await post_events(gw, chat_id, {"type": "turn_end", "data": {}})
            assert refused.status_code == 409, refused.text
            both = await scrape(gw.http)
    after = await until(gw.http, lambda s: s("gateway_connections") == 0
                        and moved(before, s, "gateway_connections_closed_total", code="1000") == 2)

    # Connections and subscriptions.
    assert moved(before, after, "gateway_connections_opened_total") == 2
    assert during("gateway_connections") == 1 and both("gateway_connections") == 2
    assert both("gateway_subscriptions") == 2 and both("gateway_rooms") == 1
    assert after("gateway_subscriptions") == 0 and after("gateway_rooms") == 0
    # Frames in, by type; the replies and replays went out.
    assert moved(before, after, "gateway_frames_in_total", type="subscribe") == 3
    assert moved(before, after, "gateway_frames_in_total", type="message") == 1
    assert moved(before, after, "gateway_frames_out_total", **{"class": "reply"}) >= 6
    assert moved(before, after, "gateway_frames_out_total", **{"class": "replay"}) >= 1
    assert moved(before, after, "gateway_bytes_out_total") > 0
    # Fan-out: user_message, turn_start, head and the delta to one member, the commit and
    # turn_end to two (a fan-out per frame, deliveries by the size of the room); and the
    # presence frames the joins and leaves made, coalesced, so how many depends on timing.
    assert moved(before, after, "gateway_fanouts_total") >= 6
    deliveries = sum(moved(before, after, "gateway_deliveries_total", lane=lane)
                     for lane in ("direct", "handed"))
    assert deliveries >= 4 * 1 + 2 * 2  # presence frames are handed to the room too
    # Publishes: the message, the delta, the commit with turn_end, the refused turn_end.
    assert moved(before, after, "gateway_publish_seconds_count") == 4
    assert moved(before, after, "gateway_publish_errors_total", code="no_active_turn") == 1
    assert moved(before, after, "gateway_turn_seconds_count") == 1
    assert 0 < moved(before, after, "gateway_turn_seconds_sum") < 60
    assert moved(before, after, "gateway_streamed_bytes_total") == len(
        msgspec.json.encode(delta["data"]))
    # Resumes and the open answer.
    assert moved(before, after, "gateway_replays_total", recovered="true",
                 overflowed="false") == 1
    assert moved(before, after, "gateway_replays_total", recovered="false",
                 overflowed="false") == 1
    assert moved(before, after, "gateway_stream_snapshots_total") == 2  # both resumes
    assert during("gateway_streams_open") == 1 and both("gateway_streams_open") == 0
    # The inbox: the message waits for the group, then a worker reads it.
    labels = {"partition": str(partition), "group": group}
    assert both("gateway_inbox_lag", **labels) == 1
    assert both("gateway_inbox_pending", **labels) == 0
    assert during("gateway_turns_running", partition=str(partition)) >= 1
    client.xreadgroup(group, "reader", {inbox_key(partition): ">"}, count=1)
    read = await scrape(gw.http)
    assert read("gateway_inbox_lag", **labels) == 0
    assert read("gateway_inbox_pending", **labels) == 1
    # The process.
    assert after("gateway_ready", dependency="redis") == 1
    assert after("gateway_ready", dependency="pubsub") == 1

    # The exposition: every family, and no chat or user in any label.
    assert FAMILIES <= set(after.families)
    assert all(f.name.startswith(("gateway_", "process_")) for f in after.families.values())
    for value in after.label_values() | both.label_values():
        assert chat_id not in value and user not in value and "agent" != value


async def test_event_loop_tasks_count_the_streams_being_served(
        gateway: Any, user: str, chat_id: str) -> None:
    """Open SSE responses run as tasks of the gateway's loop: four streams move the gauge
    up while they are open (by 3 to 6 here, as the server's tasks per request vary; at
    least 2 is asked), and it comes back down once they close."""
    await create(gateway, user, chat_id)
    tasks = "gateway_event_loop_tasks"
    before = (await scrape(gateway.http))(tasks)
    async with httpx.AsyncClient(base_url=gateway.http, timeout=10) as http:
        async with contextlib.AsyncExitStack() as streams:
            for _ in range(4):
                reply = await streams.enter_async_context(http.stream(
                    "GET", f"/v1/conversations/{chat_id}/stream", headers=gateway.headers(user)))
                lines = reply.aiter_lines()
                while await anext(lines) != "event: ready":
                    pass
            during = await until(gateway.http, lambda got: got(tasks) >= before + 2)
    await until(gateway.http, lambda got: got(tasks) <= during(tasks) - 2)


async def test_turn_timeouts_and_closes_are_counted(start_gateway: Any, user: str,
                                                    chat_id: str) -> None:
    # Every gateway's sweeper ends the overdue turns of its inbox partitions: these are
    # swept by this gateway alone, so its count is the one that moves.
    assert not {p.tag for p in partitions(13)} & {p.tag for p in partitions(8)}
    gw = start_gateway(turn_timeout=1, rate_limit=5, rate_burst=5, inbox_partitions=13)
    before = await scrape(gw.http)
    async with connect(gw.url(user)) as ws:
        await ws.subscribe(chat_id)
        await message_and_reply(ws, chat_id, "hello")
        end = await ws.wait_for(lambda f: f.get("type") == "turn_end", timeout=10)
        assert end["data"]["reason"] == "timeout"
        for i in range(30):  # a flood: warned, then closed with 4029
            await ws.send({"type": "ping", "id": i})
        assert await ws.close_code() == 4029
    after = await until(gw.http, lambda s: s("gateway_connections") == 0)
    assert moved(before, after, "gateway_turn_timeouts_total") == 1
    assert moved(before, after, "gateway_turn_seconds_count") == 1
    assert 1 <= moved(before, after, "gateway_turn_seconds_sum") < 10
    assert moved(before, after, "gateway_connections_closed_total", code="4029") == 1
    assert moved(before, after, "gateway_frames_in_total", type="ping") >= 5


async def test_a_metrics_port_serves_metrics_and_the_main_port_does_not(
    start_gateway: Any, user: str, chat_id: str
) -> None:
    port = free_port()
    gw = start_gateway(metrics_port=port)
    async with httpx.AsyncClient() as http:
        assert (await http.get(gw.http + "/metrics")).status_code == 404
    url = f"http://127.0.0.1:{port}"
    async with connect(gw.url(user)) as ws:
        await ws.subscribe(chat_id)
        live = await scrape(url)  # read on the gateway's event loop, at this instant
        assert live("gateway_connections") == 1 and live("gateway_subscriptions") == 1
        assert live("gateway_ready", dependency="redis") == 1
        assert FAMILIES <= set(live.families)


@pytest.fixture
def workers_gateway(gateway_env: dict[str, str], tmp_path: Path) -> Any:
    """``gateway serve --workers 2`` with settings of the test's own; stopped afterwards."""
    started: list[GatewayProcess] = []

    def start(**settings: Any) -> GatewayProcess:
        env = dict(gateway_env, GATEWAY_PORT=str(free_port()),
                   PROMETHEUS_MULTIPROC_DIR=str(tmp_path / f"metrics-{len(started)}"))
        env.update({f"GATEWAY_{k.upper()}": str(v) for k, v in settings.items()})
        process = GatewayProcess(env, ["--workers", "2"]).start()
        started.append(process)
        return process

    yield start
    for process in started:
        process.stop()


def per_worker(directory: str, name: str) -> dict[str, float]:
    """``name``'s total in each worker's own counter file, by pid."""
    totals = {}
    for path in glob.glob(os.path.join(directory, "counter_*.db")):
        pid = Path(path).stem.split("_")[1]
        totals[pid] = sum(s.value for m in MultiProcessCollector.merge([path])
                          for s in m.samples if s.name == name)
    return totals


async def spread(gw: GatewayProcess, user: str, directory: str) -> int:
    """Open connections until both workers have served some; returns how many."""
    def written() -> dict[str, float]:
        return per_worker(directory, "gateway_connections_opened_total")

    for opened in range(4, 101, 4):
        for _ in range(4):
            async with connect(gw.url(user)):
                pass
        # The workers write their counts every 2 s: wait until every connection shows.
        assert await faults.until(lambda n=opened: sum(written().values()) >= n, timeout=10)
        counts = written()
        if len(counts) == 2 and all(counts.values()):
            return opened
    raise AssertionError("every connection went to the same worker")


@pytest.mark.slow
async def test_workers_add_up_on_one_target(workers_gateway: Any, user: str,
                                            chat_id: str) -> None:
    gw = workers_gateway()
    directory = gw.env["PROMETHEUS_MULTIPROC_DIR"]
    opened = await spread(gw, user, directory)
    await create(gw, user, chat_id)  # a publish too
    for i in range(5):
        await publish(gw, chat_id, {"type": "note", "data": {"i": i}})

    def complete(s: Scrape) -> bool:
        return (s("gateway_connections_opened_total") == opened
                and s("gateway_publish_seconds_count") == 6)

    # Whichever worker answers, it shows the instance: both workers' counts, summed.
    for _ in range(6):
        got = await until(gw.http, complete)
        assert got("gateway_connections") == 0
        assert got("gateway_ready", dependency="redis") == 1
    assert sum(per_worker(directory, "gateway_connections_opened_total").values()) == opened


@pytest.mark.slow
async def test_workers_metrics_port_is_served_by_the_supervisor(
    workers_gateway: Any, user: str, chat_id: str
) -> None:
    port = free_port()
    gw = workers_gateway(metrics_port=port)
    async with httpx.AsyncClient() as http:
        assert (await http.get(gw.http + "/metrics")).status_code == 404
    await create(gw, user, chat_id)
    got = await until(f"http://127.0.0.1:{port}",
                      lambda s: s("gateway_publish_seconds_count") == 1)
    # Families with samples only: multiprocess mode writes no family that has none yet.
    assert {"gateway_connections", "gateway_publish_seconds", "gateway_fanouts",
            "gateway_ready", "gateway_event_loop_tasks"} <= set(got.families)
    assert user not in got.label_values() and chat_id not in got.label_values()
