"""Fan-out benchmark: one room, N WebSocket subscribers, M published events.

Starts a private Redis-compatible server (the embedded one, in a temporary directory, no
persistence) and one ``gateway serve`` process, connects ``--subscribers`` real WebSocket
clients to one conversation, then publishes ``--events`` events at a steady ``--rate``.

Events are published by calling :meth:`gateway.redis.store.Store.publish` on a direct Redis
client: the very Lua script the HTTP API and the WebSocket ``message`` path run, minus the
HTTP hop, so the publisher is not what limits the measurement. Each event carries
``time.perf_counter()`` taken just before its publish call; every subscriber (same process,
same clock) compares it with ``time.perf_counter()`` when the frame comes out of ``recv()``.
So latency covers Lua + pub/sub + the gateway's hub and per-connection writer + the socket +
the client library, including any queueing in this (single-threaded) client process.

Usage (from the repository root)::

    .venv/bin/python bench/fanout.py                      # 200 subscribers, 2000 events
    .venv/bin/python bench/fanout.py --msgpack
    .venv/bin/python bench/fanout.py --rate 0             # publish as fast as possible
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import redis.asyncio as aioredis
from websockets.asyncio.client import connect

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from launch import private_gateway

from gateway.auth import issue_token
from gateway.config import Settings
from gateway.redis.backend import Backend
from gateway.redis.records import OutEvent
from gateway.redis.store import Store

CHAT_ID = "bench-room"
OWNER = "bench-owner"


class Data(msgspec.Struct):
    t: float = 0.0


class Event(msgspec.Struct):
    """The fields of a server frame the benchmark reads; the rest is skipped."""

    type: str
    seq: int | None = None
    data: Data | None = None


class Stats:
    def __init__(self, subscribers: int) -> None:
        self.latencies: list[float] = []
        self.received = [0] * subscribers
        self.disorder = 0  # frames whose seq was not the previous one + 1
        self.first_send = 0.0
        self.last_recv = 0.0
        self.done = asyncio.Event()
        self.remaining = subscribers


async def subscriber(index: int, url: str, binary: bool, events: int, stats: Stats,
                     ready: asyncio.Event, counter: list[int]) -> None:
    decode: Callable[[Any], Event] = (
        msgspec.msgpack.Decoder(Event) if binary else msgspec.json.Decoder(Event)).decode
    encode: Callable[[Any], Any] = (
        msgspec.msgpack.encode if binary else (lambda f: msgspec.json.encode(f).decode()))
    protocols = ["gateway.v1.msgpack"] if binary else ["gateway.v1.json"]
    async with connect(url, compression=None, max_size=None, subprotocols=protocols,  # type: ignore[arg-type]
                       open_timeout=30) as ws:
        assert decode(await ws.recv()).type == "hello"
        await ws.send(encode({"type": "subscribe", "chat_id": CHAT_ID}))
        while (frame := decode(await ws.recv())).type != "subscribed":
            pass
        counter[0] += 1
        if counter[0] == len(stats.received):
            ready.set()
        latencies = stats.latencies
        clock = time.perf_counter
        last_seq = frame.seq or 0
        got = 0
        while got < events:
            raw = await ws.recv()
            now = clock()
            frame = decode(raw)
            if frame.data is None:
                continue  # not an event of the room
            latencies.append(now - frame.data.t)
            got += 1
            if frame.seq is not None:
                if frame.seq != last_seq + 1:
                    stats.disorder += 1
                last_seq = frame.seq
            stats.received[index] = got
        stats.last_recv = max(stats.last_recv, clock())
    stats.remaining -= 1
    if stats.remaining == 0:
        stats.done.set()


async def publisher(store: Store, events: int, rate: float, payload: bytes, durable: bool,
                    stats: Stats) -> float:
    """Publish ``events`` at ``rate`` per second (0: back to back); returns the time taken."""
    interval = 1.0 / rate if rate > 0 else 0.0
    start = time.perf_counter()
    stats.first_send = start
    for i in range(events):
        if interval:
            delay = start + i * interval - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
        now = time.perf_counter()
        data = b'{"t":%r,"i":%d,"text":"%s"}' % (now, i, payload)
        await store.publish(CHAT_ID, [OutEvent(type="delta", data=data, durable=durable)])
    return time.perf_counter() - start


def percentile(ordered: list[float], q: float) -> float:
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a process (Linux /proc; None elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def run(args: argparse.Namespace, redis_url: str, port: int, secret: str,
              pids: dict[str, int]) -> int:
    stats = Stats(args.subscribers)
    client = aioredis.from_url(redis_url)
    settings = Settings()
    store = Store(Backend.of(client, settings), settings)
    try:
        await store.publish(CHAT_ID, [], create_owner=OWNER)  # the room exists, owned by OWNER
        ready, counter = asyncio.Event(), [0]
        base = f"ws://127.0.0.1:{port}/v1/ws?token="
        t0 = time.perf_counter()
        # Service tokens may read any room; one user each keeps clear of the per-user cap.
        tasks = [
            asyncio.create_task(subscriber(
                i, base + issue_token(secret, f"watcher{i}", "service", 3600),
                args.msgpack, args.events, stats, ready, counter))
            for i in range(args.subscribers)
        ]
        waiter = asyncio.create_task(ready.wait())
        await asyncio.wait([waiter, *tasks], timeout=60, return_when=asyncio.FIRST_COMPLETED)
        if not ready.is_set():
            failed = [t for t in tasks if t.done()]
            raise SystemExit(f"only {counter[0]}/{args.subscribers} subscribed"
                             + (f": {failed[0].exception()!r}" if failed else ""))
        connect_time = time.perf_counter() - t0

        payload = b"x" * args.payload
        cpu_before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        published = await publisher(store, args.events, args.rate, payload,
                                    not args.ephemeral, stats)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(args.timeout):
                await stats.done.wait()
        for task in tasks:
            task.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        errors = [r for r in results
                  if isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError)]
        cpu = {}
        for name, pid in pids.items():
            before, after = cpu_before[name], cpu_seconds(pid)
            if before is not None and after is not None:
                cpu[name] = after - before
    finally:
        await client.aclose()

    total = sum(stats.received)
    expected = args.subscribers * args.events
    wall = (stats.last_recv or time.perf_counter()) - stats.first_send
    ordered = sorted(stats.latencies)
    ms = [1000 * percentile(ordered, q) for q in (0.5, 0.9, 0.99, 1.0)]
    fmt = "msgpack" if args.msgpack else "json"
    kind = "ephemeral" if args.ephemeral else "durable"
    rate = f"{args.rate:g}/s" if args.rate > 0 else "unthrottled"
    rows = [
        ("setup", f"{args.subscribers} subscribers connected+subscribed in {connect_time:.2f} s"),
        ("publish", f"{args.events} {kind} events ({args.payload} B text), {fmt}, rate {rate}: "
                    f"{published:.2f} s ({args.events / published:,.0f} events/s) "
                    "via Store.publish"),
        ("delivered", f"{total:,} / {expected:,} frames"
                      f"{'' if total == expected else f'  ({expected - total:,} MISSING)'}"
                      f", out of order: {stats.disorder}"),
        ("fan-out", f"{total / wall:,.0f} deliveries/s  (first publish -> last delivery "
                    f"{wall:.2f} s)"),
        ("latency", "p50 {:.2f} ms   p90 {:.2f} ms   p99 {:.2f} ms   max {:.2f} ms".format(*ms)),
    ]
    with contextlib.suppress(OSError):
        rows.append(("host", f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} "
                             "(other work on the machine skews the latency tail)"))
    if cpu:
        rows.append(("cpu", "   ".join(f"{name} {seconds:.1f} s ({seconds / wall:.0%})"
                                       for name, seconds in cpu.items())))
    print()
    for name, value in rows:
        print(f"  {name:<10} {value}")
    for error in errors[:3]:
        print(f"  error: {error!r}")
    ok = total == expected and stats.disorder == 0 and not errors
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--subscribers", type=int, default=200)
    parser.add_argument("--events", type=int, default=2000)
    parser.add_argument("--rate", type=float, default=200.0,
                        help="events published per second (0: as fast as possible)")
    parser.add_argument("--payload", type=int, default=64, help="bytes of text per event")
    parser.add_argument("--msgpack", action="store_true", help="subscribers use MessagePack")
    parser.add_argument("--ephemeral", action="store_true",
                        help="publish ephemeral events (no stream write, no seq)")
    parser.add_argument("--timeout", type=float, default=30.0,
                        help="seconds to wait for deliveries after the last publish")
    args = parser.parse_args()

    code = 1
    with private_gateway("gw-bench-") as gw:
        assert gw.server.process is not None
        pids = {"gateway": gw.process.pid, "redis": gw.server.process.pid,
                "bench client": os.getpid()}
        try:
            code = asyncio.run(run(args, gw.redis_url, gw.port, gw.secret, pids))
        finally:
            log = (gw.data_dir / "gateway.log").read_text(errors="replace").strip()
            if code != 0 and log:
                print("gateway log (last 40 lines):\n" + "\n".join(log.splitlines()[-40:]),
                      file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
