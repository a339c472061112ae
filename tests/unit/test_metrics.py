"""The metric families as exposed: histograms kept as plain integers, bounded labels, and
the multiprocess files of ``--workers`` merged by prometheus-client into one view."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway.frames import Frame
from gateway.metrics import COUNTS, Family, Sampled, close_label, frame_label
from gateway.metrics import families as gateway_families
from gateway.protocol import Message, Subscribe
from gateway.redis.counters import Histogram
from gateway.rooms import Room
from gateway.scrape import FileWriter, forget_dead_workers, multiprocess_registry, to_metrics


def samples(registry: CollectorRegistry) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    text = generate_latest(registry).decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def histogram(*values: float) -> Histogram:
    hist = Histogram((0.1, 1.0))
    for value in values:
        hist.observe(value)
    return hist


def test_a_histogram_counts_each_value_in_the_first_bucket_that_holds_it() -> None:
    hist = histogram(0.05, 0.1, 0.5, 1.0, 7.0)
    assert hist.counts == [2, 2, 1]  # le 0.1 (a value on the bound counts), le 1, above
    assert hist.cumulative() == [2, 4, 5]
    assert hist.sum == 0.05 + 0.1 + 0.5 + 1.0 + 7.0


def test_labels_come_from_small_fixed_sets() -> None:
    assert close_label(4008) == "4008" and close_label(1000) == "1000"
    assert close_label(4321) == "other" and close_label(3999) == "other"
    assert frame_label(Subscribe) == "subscribe" and frame_label(Message) == "message"
    assert frame_label(None) == "invalid" and frame_label(int) == "other"


def families(opened: int, open_now: int, ready: int, *latencies: float) -> list[Family]:
    return [
        Family("gateway_connections_closed", "counter", "closes", ("code",),
               [(("1000",), opened), (("4008",), 1)]),
        Family("gateway_connections", "gauge", "open", (), [((), open_now)]),
        Family("gateway_ready", "gauge", "ready", ("dependency",), [(("redis",), ready)],
               "livemin"),
        Family("gateway_publish_seconds", "histogram", "latency", (),
               [((), histogram(*latencies))]),
    ]


def test_one_process_exposes_its_families() -> None:
    registry = CollectorRegistry()

    class Live:
        def collect(self):  # type: ignore[no-untyped-def]
            return to_metrics(families(3, 2, 1, 0.05, 2.0))

    registry.register(Live())
    got = samples(registry)
    assert got["gateway_connections_closed_total", frozenset({("code", "1000")})] == 3
    assert got["gateway_connections", frozenset()] == 2
    assert got["gateway_publish_seconds_bucket", frozenset({("le", "0.1")})] == 1
    assert got["gateway_publish_seconds_bucket", frozenset({("le", "+Inf")})] == 2
    assert got["gateway_publish_seconds_count", frozenset()] == 2
    assert got["gateway_publish_seconds_sum", frozenset()] == 2.05


def test_workers_files_merge_into_one_view(tmp_path: Path) -> None:
    one, two = FileWriter(str(tmp_path), 101), FileWriter(str(tmp_path), 102)
    one.write(families(1, 1, 1, 0.05))
    one.write(families(3, 2, 1, 0.05, 0.5))  # counts written again replace, never add
    two.write(families(4, 5, 0, 2.0))
    got = samples(multiprocess_registry(str(tmp_path)))
    assert got["gateway_connections_closed_total", frozenset({("code", "1000")})] == 7
    assert got["gateway_connections_closed_total", frozenset({("code", "4008")})] == 2
    assert got["gateway_connections", frozenset()] == 7  # summed
    assert got["gateway_ready", frozenset({("dependency", "redis")})] == 0  # the least
    assert got["gateway_publish_seconds_bucket", frozenset({("le", "0.1")})] == 1
    assert got["gateway_publish_seconds_bucket", frozenset({("le", "1.0")})] == 2
    assert got["gateway_publish_seconds_bucket", frozenset({("le", "+Inf")})] == 3
    assert got["gateway_publish_seconds_count", frozenset()] == 3
    assert got["gateway_publish_seconds_sum", frozenset()] == 2.55
    one.close()
    two.close()


def test_a_dead_workers_gauges_go_and_its_counts_stay(tmp_path: Path) -> None:
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead = int(gone.stdout)  # exited: no such process now
    alive, ghost = FileWriter(str(tmp_path), os.getpid()), FileWriter(str(tmp_path), dead)
    alive.write(families(1, 1, 1))
    ghost.write(families(2, 5, 1))
    forget_dead_workers(str(tmp_path))
    got = samples(multiprocess_registry(str(tmp_path)))
    assert got["gateway_connections", frozenset()] == 1
    assert got["gateway_connections_closed_total", frozenset({("code", "1000")})] == 3
    alive.close()
    ghost.close()


def exported() -> set[str]:
    """Every sample name the gateway exports, from its families (read with no traffic)."""

    async def read() -> list[Family]:
        return gateway_families((0, 0, 0), Sampled(), 0)

    suffixes: dict[str, tuple[str, ...]] = {
        "counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_count", "_sum")}
    return {family.name + suffix for family in asyncio.run(read())
            for suffix in suffixes[family.kind]}


def test_the_grafana_dashboard_asks_only_for_metrics_the_gateway_exports() -> None:
    path = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "gateway.json"
    dashboard: Any = json.loads(path.read_text())
    exprs = [target["expr"] for panel in dashboard["panels"]
             for target in panel.get("targets", [])]
    assert exprs
    asked = {name for expr in exprs for name in re.findall(r"\bgateway_\w+", expr)}
    names = exported()
    assert asked - names == set()
    assert all(name.startswith("gateway_") for name in names)


def test_a_room_counts_the_answers_streaming_in_it() -> None:
    room = Room("c1")
    before = COUNTS.discarded

    def delta(stream_id: str, pos: int) -> Frame:
        return Frame(b'{"type":"delta","chat_id":"c1","seq":null,"stream":{"id":"'
                     + stream_id.encode() + b'","pos":' + str(pos).encode()
                     + b'},"data":{"text":"x"}}', None, (stream_id, pos))

    room.fan_out(delta("s1", 0))
    room.fan_out(delta("s1", 1))
    room.fan_out(delta("s2", 3))  # joined mid-answer: it counts too
    assert len(room.streams) == 2
    room.fan_out(Frame(b'{"type":"tool_call","chat_id":"c1","seq":4,"data":{}}', 4))
    assert len(room.streams) == 2  # a frame that names no stream ends none
    room.fan_out(Frame(b'{"type":"message","chat_id":"c1","seq":5,"data":'
                       b'{"stream_id":"s1","text":"xx"}}', 5))
    assert list(room.streams) == ["s2"]  # committed
    room.fan_out(Frame(b'{"type":"stream_discarded","chat_id":"c1","seq":null,"data":'
                       b'{"stream_id":"s2","type":"delta","turn_id":"t"}}'))
    assert not room.streams and COUNTS.discarded == before + 1
    room.fan_out(delta("s3", 0))
    room.fan_out(Frame(b'{"type":"turn_end","chat_id":"c1","seq":6,"data":{}}', 6))
    assert not room.streams  # the turn's end ends every answer
