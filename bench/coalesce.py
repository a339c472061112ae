"""Coalesced writes: many small frames per socket in one loop turn, and what they cost.

Each of ``--clients`` WebSocket connections watches ``--rooms`` conversations of its own. A
tick publishes one small event into every room at once (one loop turn of the publisher, so
one pipeline and one batch of scripts: the gateway reads their pub/sub pushes a few reads
at a time, as when an agent streams into many rooms one client watches). The next tick
starts once every client has every frame of this one.

Reported for the gateway process over the measured ticks: write system calls
(``syscw`` of ``/proc/<pid>/io``) and CPU time, each per delivered frame. Run it against
two checkouts to compare (``--gateway-dir``: its ``.venv/bin/python`` serves)::

    .venv/bin/python bench/coalesce.py                       # this checkout
    .venv/bin/python bench/coalesce.py --gateway-dir ../main # another one, same load

Linux only (``/proc``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
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
from gateway.redis.records import OutEvent
from gateway.redis.store import Store


def proc_counters(pid: int) -> tuple[float, int]:
    """CPU seconds (user + system) and write system calls of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    io = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
    return cpu, int(io["syscw"])


class Watcher:
    """One connection subscribed to its rooms; counts the event frames it receives."""

    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws
        self.frames = 0
        self.wanted = 0
        self.reached = asyncio.Event()

    async def subscribe(self, rooms: list[str]) -> None:
        for room in rooms:
            await self.ws.send(msgspec.json.encode({"type": "subscribe", "chat_id": room}))
            while msgspec.json.decode(await self.ws.recv()).get("type") != "subscribed":
                pass

    async def read(self) -> None:
        async for raw in self.ws:
            if b'"seq"' in (raw if isinstance(raw, bytes) else raw.encode()):
                self.frames += 1
                if self.frames >= self.wanted:
                    self.reached.set()

    async def until(self, frames: int) -> None:
        self.wanted = frames
        if self.frames < frames:
            self.reached.clear()
            await self.reached.wait()


async def run(args: argparse.Namespace, redis_url: str, port: int, secret: str,
              pid: int) -> None:
    settings = Settings(redis_url=redis_url, secret=secret)
    store = Store(Backend.of(aioredis.from_url(redis_url), settings), settings)
    rooms = [[f"co-{c}-{r}" for r in range(args.rooms)] for c in range(args.clients)]
    watchers: list[Watcher] = []
    try:
        for c, mine in enumerate(rooms):
            await asyncio.gather(*(store.publish(room, [], create_owner=f"w{c}") for room in mine))
            url = f"ws://127.0.0.1:{port}/v1/ws?token={issue_token(secret, f'w{c}')}"
            watcher = Watcher(await connect(url, compression=None, max_size=None))
            await watcher.ws.recv()  # hello
            await watcher.subscribe(mine)
            watchers.append(watcher)
        readers = [asyncio.create_task(w.read()) for w in watchers]
        everyone = [(room, f"w{c}") for c, mine in enumerate(rooms) for room in mine]
        data = msgspec.json.encode({"text": "x" * args.payload})
        # One event into every room at once, then wait for every frame of the tick.
        async def tick(n: int) -> None:
            await asyncio.gather(*(store.publish(room, [OutEvent(type="note", data=data)])
                                   for room, _ in everyone))
            await asyncio.gather(*(w.until(n * args.rooms) for w in watchers))

        for n in range(1, args.warmup + 1):
            await tick(n)
        cpu0, writes0 = proc_counters(pid)
        began = time.perf_counter()
        for n in range(args.warmup + 1, args.warmup + args.ticks + 1):
            await tick(n)
        elapsed = time.perf_counter() - began
        cpu1, writes1 = proc_counters(pid)
        frames = args.ticks * args.clients * args.rooms
        print(f"{args.clients} clients x {args.rooms} rooms, {args.ticks} ticks: "
              f"{frames} frames in {elapsed:.2f} s")
        print(f"gateway write syscalls: {writes1 - writes0} "
              f"({(writes1 - writes0) / frames:.3f} per frame)")
        print(f"gateway CPU: {cpu1 - cpu0:.2f} s "
              f"({(cpu1 - cpu0) / frames * 1e6:.1f} us per frame)")
        for task in readers:
            task.cancel()
    finally:
        for watcher in watchers:
            await watcher.ws.close()
        await store.backend.aclose()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--rooms", type=int, default=50, help="rooms each client watches")
    parser.add_argument("--ticks", type=int, default=100, help="measured ticks")
    parser.add_argument("--warmup", type=int, default=10, help="ticks before measuring")
    parser.add_argument("--payload", type=int, default=32, help="bytes of text per event")
    parser.add_argument("--gateway-dir", type=Path, default=Path(__file__).resolve().parents[1],
                        help="the checkout that serves (its .venv); default: this one")
    args = parser.parse_args()
    with private_gateway("gw-coalesce-", checkout=args.gateway_dir,
                         env={"GATEWAY_MAX_CONNECTIONS_PER_USER": "1000"}) as gw:
        asyncio.run(run(args, gw.redis_url, gw.port, gw.secret, gw.process.pid))
    return 0


if __name__ == "__main__":
    sys.exit(main())
