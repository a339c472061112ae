"""Durable publishes over HTTP: the gateway's CPU time per publish, closed loop.

``--rooms`` conversations, each watched by one WebSocket connection (so every publish is
also a fan-out of one frame, as in the peer bench's rooms scenario). ``--connections``
keep-alive HTTP connections then publish ``--publishes`` durable events, round-robin over
the rooms, each connection sending its next request when the previous reply is in.

Reported: the gateway process's CPU time per publish (``/proc/<pid>/stat``), its read and
write system calls per publish (``/proc/<pid>/io``), the publish rate this closed loop
reached, and the Redis server's CPU time per publish (``INFO cpu``). CPU time per publish
is what a rate costs, and it holds up better than a pass/fail rate on a machine shared with
other work. ``--gateway-dir`` serves another checkout (its
``.venv``), to compare two under the same load; ``--rounds`` alternates them::

    .venv/bin/python bench/publish.py
    .venv/bin/python bench/publish.py --gateway-dir ../main --rounds 3   # A/B, interleaved

Linux only (``/proc``). The HTTP client is a few lines of asyncio, so the bench process
spends little CPU of its own.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

import msgspec
import redis.asyncio as aioredis
from websockets.asyncio.client import ClientConnection, connect

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from launch import private_gateway

from gateway.auth import issue_token
from gateway.config import Settings
from gateway.redis.backend import Backend
from gateway.redis.store import Store

HERE = Path(__file__).resolve().parents[1]


def counters(pid: int) -> tuple[float, int, int]:
    """CPU seconds, read and write system calls of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    io = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
    return cpu, int(io["syscr"]), int(io["syscw"])


async def http_worker(port: int, token: str, rooms: list[str], count: int, start: int,
                      payload: bytes) -> None:
    """``count`` publishes on one keep-alive connection, one at a time."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for i in range(start, start + count):
            room = rooms[i % len(rooms)]
            body = b'{"type":"bench","data":{"i":%d,"p":"%s"}}' % (i, payload)
            writer.write(b"POST /v1/conversations/%s/events HTTP/1.1\r\nhost: x\r\n"
                         b"authorization: Bearer %s\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n%s"
                         % (room.encode(), token.encode(), len(body), body))
            head = await reader.readuntil(b"\r\n\r\n")
            if not head.startswith(b"HTTP/1.1 200"):
                raise SystemExit(f"publish refused: {head!r}")
            length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:"))
            await reader.readexactly(length)
    finally:
        writer.close()


async def drain(ws: ClientConnection) -> None:
    with contextlib.suppress(Exception):
        async for _ in ws:
            pass


Result = tuple[float, float, float, float, float]


async def redis_cpu(redis: aioredis.Redis) -> float:
    """CPU seconds the Redis server has used so far."""
    info = await redis.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


async def measure(args: argparse.Namespace, checkout: Path) -> Result:
    """One gateway from ``checkout`` under the load: (µs CPU, reads, writes per publish,
    publishes/s, µs of Redis CPU per publish)."""
    with private_gateway("gw-publish-", checkout=checkout,
                         env={"GATEWAY_MAX_CONNECTIONS_PER_USER": "1000"}) as gw:
        return await run(args, gw.redis_url, gw.port, gw.secret, gw.process.pid)


async def run(args: argparse.Namespace, redis_url: str, port: int, secret: str,
              pid: int) -> Result:
    settings = Settings(redis_url=redis_url, secret=secret)
    store = Store(Backend.of(aioredis.from_url(redis_url), settings), settings)
    rooms = [f"pub-{r}" for r in range(args.rooms)]
    sockets: list[ClientConnection] = []
    try:
        await asyncio.gather(*(store.publish(room, [], create_owner=f"u{r}")
                               for r, room in enumerate(rooms)))
        for r, room in enumerate(rooms):
            ws = await connect(f"ws://127.0.0.1:{port}/v1/ws?token="
                               + issue_token(secret, f"u{r}"), compression=None)
            await ws.recv()  # hello
            await ws.send(msgspec.json.encode({"type": "subscribe", "chat_id": room}))
            while msgspec.json.decode(await ws.recv()).get("type") != "subscribed":
                pass
            sockets.append(ws)
        readers = [asyncio.create_task(drain(ws)) for ws in sockets]
        token = issue_token(secret, "bench-agent", "service")
        payload = b"x" * args.payload
        per = args.publishes // args.connections
        warm = max(1, per // 10)
        await asyncio.gather(*(http_worker(port, token, rooms, warm, c * per, payload)
                               for c in range(args.connections)))
        cpu0, reads0, writes0 = counters(pid)
        redis0 = await redis_cpu(store.backend.client)
        began = time.perf_counter()
        await asyncio.gather(*(http_worker(port, token, rooms, per, c * per + warm, payload)
                               for c in range(args.connections)))
        elapsed = time.perf_counter() - began
        cpu1, reads1, writes1 = counters(pid)
        redis1 = await redis_cpu(store.backend.client)
        for task in readers:
            task.cancel()
        n = per * args.connections
        return ((cpu1 - cpu0) / n * 1e6, (reads1 - reads0) / n, (writes1 - writes0) / n,
                n / elapsed, (redis1 - redis0) / n * 1e6)
    finally:
        for ws in sockets:
            await ws.close()
        await store.backend.aclose()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rooms", type=int, default=200, help="rooms, one watcher each")
    parser.add_argument("--connections", type=int, default=32, help="HTTP connections")
    parser.add_argument("--publishes", type=int, default=20000, help="measured publishes")
    parser.add_argument("--payload", type=int, default=100, help="bytes of text per event")
    parser.add_argument("--gateway-dir", type=Path, action="append",
                        help="checkout that serves (its .venv); twice to compare; "
                        "default: this one")
    parser.add_argument("--rounds", type=int, default=1, help="runs per checkout, alternated")
    args = parser.parse_args()
    checkouts = [d.resolve() for d in args.gateway_dir or [HERE]]
    results: dict[Path, list[Result]] = {d: [] for d in checkouts}
    for _ in range(args.rounds):
        for checkout in checkouts:
            got = asyncio.run(measure(args, checkout))
            results[checkout].append(got)
            print(f"{checkout}: {got[0]:.1f} us CPU, {got[1]:.2f} reads, {got[2]:.2f} writes "
                  f"per publish; {got[3]:.0f} publishes/s; Redis {got[4]:.1f} us CPU per "
                  "publish", flush=True)
    for checkout, runs in results.items():
        print(f"median of {len(runs)}, {checkout}: "
              f"{statistics.median(r[0] for r in runs):.1f} us CPU per publish")
    return 0


if __name__ == "__main__":
    sys.exit(main())
