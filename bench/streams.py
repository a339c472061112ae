"""Streamed answers: what a resumable delta costs next to a plain ephemeral one.

Three measurements, each on a private Redis-compatible server and one ``gateway serve``:

1. **Delta cost.** N answers at once, each streaming R deltas a second to 2 subscribers.
   Run with ephemeral deltas (no turn running: plain pub/sub frames) and with streamed ones
   (a turn runs: each delta is appended to its stream and carries a position), at several
   rates. Reports the gateway's CPU per delta and the publish-to-delivery latency; a rate
   passes with every delta delivered and p99 < 50 ms.
2. **Coalescing.** A model emitting 150 tokens a second through the worker SDK's ``Turn``
   (``delta_window_ms`` 25): Redis script calls per 1000 tokens.
3. **Resume size.** A 2000-delta answer: the bytes of the ``subscribed`` frame a client
   gets on joining it (snapshot with the whole text) against the bytes of the deltas
   themselves.

    .venv/bin/python bench/streams.py
    .venv/bin/python bench/streams.py --answers 50 --rates 10,20,40
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import secrets
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import redis.asyncio as aioredis
from websockets.asyncio.client import connect

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fanout import cpu_seconds, percentile
from launch import private_gateway

from gateway.auth import issue_token
from gateway.config import Settings
from gateway.redis.backend import Backend
from gateway.redis.records import OutEvent
from gateway.redis.store import Store
from gateway.sdk.agent import Turn

OWNER = "bench"


class Tally:
    """Deltas received; ``done`` is set once ``expect``'s count has arrived."""

    def __init__(self) -> None:
        self.count = 0
        self.target: int | None = None
        self.done = asyncio.Event()

    def add(self) -> None:
        self.count += 1
        if self.target is not None and self.count >= self.target:
            self.done.set()

    def expect(self, target: int) -> None:
        self.target = target
        if self.count >= target:
            self.done.set()


class Delta(msgspec.Struct):
    type: str
    data: dict[str, Any] | None = None


async def subscriber(url: str, chat_id: str, latencies: list[float], received: Tally,
                     ready: asyncio.Event, joined: list[int], total: int) -> None:
    decode = msgspec.json.Decoder(Delta).decode
    async with connect(url, compression=None, max_size=None) as ws:
        await ws.recv()  # hello
        await ws.send(msgspec.json.encode({"type": "subscribe", "chat_id": chat_id}).decode())
        while decode(await ws.recv()).type != "subscribed":
            pass
        joined[0] += 1
        if joined[0] == total:
            ready.set()
        while True:
            frame = decode(await ws.recv())
            if frame.type == "delta" and frame.data is not None:
                latencies.append(time.perf_counter() - frame.data["t"])
                received.add()


async def answer(store: Store, chat_id: str, rate: float, seconds: float) -> int:
    """Stream deltas to one chat at ``rate`` a second; returns how many were published."""
    interval, start, sent = 1.0 / rate, time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        await asyncio.sleep(max(0.0, start + sent * interval - time.perf_counter()))
        data = b'{"t":%r,"text":"token "}' % time.perf_counter()
        await store.publish(
            chat_id, [OutEvent(type="delta", data=data, durable=False, attempt="bench")])
        sent += 1
    return sent


async def delta_cost(store: Store, port: int, secret: str, gateway_pid: int, answers: int,
                     rate: float, streamed: bool, seconds: float) -> dict[str, Any]:
    run = secrets.token_hex(3)
    chats = [f"answer-{run}-{i}" for i in range(answers)]
    for chat_id in chats:
        events = ([OutEvent(type="turn_start", data=b"{}", turn_id=f"t_{chat_id}")]
                  if streamed else [])
        await store.publish(chat_id, events, create_owner=OWNER)
    latencies: list[float] = []
    received, joined, ready = Tally(), [0], asyncio.Event()
    base = f"ws://127.0.0.1:{port}/v1/ws?token="
    subs = [asyncio.create_task(subscriber(
        base + issue_token(secret, f"viewer{run}{i}{k}", "service"), chat_id, latencies,
        received, ready, joined, 2 * answers)) for i, chat_id in enumerate(chats) for k in (0, 1)]
    await asyncio.wait_for(ready.wait(), 60)
    cpu0 = cpu_seconds(gateway_pid) or 0.0
    sent = sum(await asyncio.gather(*(answer(store, c, rate, seconds) for c in chats)))
    received.expect(2 * sent)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(received.done.wait(), 10)
    cpu = (cpu_seconds(gateway_pid) or 0.0) - cpu0
    for task in subs:
        task.cancel()
    await asyncio.gather(*subs, return_exceptions=True)
    ordered = sorted(latencies)
    p99 = 1000 * percentile(ordered, 0.99)
    return {"mode": "streamed" if streamed else "ephemeral", "deltas/s": sent / seconds,
            "deliveries": received.count, "expected": 2 * sent,
            "cpu us/delta": 1e6 * cpu / max(sent, 1),
            "p50 ms": 1000 * percentile(ordered, 0.5), "p99 ms": p99,
            "pass": received.count == 2 * sent and p99 < 50}


async def coalescing(client: aioredis.Redis, store: Store) -> tuple[int, int]:
    """Script calls a 150 tokens/s model makes per 1000 tokens through the worker SDK."""
    chat_id = f"coalesce-{secrets.token_hex(3)}"
    await store.publish(chat_id, [OutEvent(type="turn_start", data=b"{}", turn_id="t_c")],
                        create_owner=OWNER)
    turn = Turn(store, {"chat_id": chat_id, "turn_id": "t_c"}, delta_window_ms=25)
    before = await _script_calls(client)
    tokens, start = 1000, time.perf_counter()
    for i in range(tokens):
        await asyncio.sleep(max(0.0, start + i / 150 - time.perf_counter()))
        await turn.delta("tok ")
    await turn.message()
    return tokens, await _script_calls(client) - before - 1  # the commit itself not counted


async def _script_calls(client: aioredis.Redis) -> int:
    stats: dict[str, Any] = await client.info("commandstats")
    return sum(int(v["calls"]) for k, v in stats.items() if k in ("cmdstat_evalsha",
                                                                   "cmdstat_eval"))


async def resume_size(store: Store, port: int, secret: str, deltas: int) -> tuple[int, int]:
    chat_id = f"long-{secrets.token_hex(3)}"
    await store.publish(chat_id, [OutEvent(type="turn_start", data=b"{}", turn_id="t_l")],
                        create_owner=OWNER)
    delta_bytes = 0
    for i in range(deltas):
        data = b'{"text":"tok%d "}' % i
        await store.publish(
            chat_id, [OutEvent(type="delta", data=data, durable=False, attempt="bench")])
        # What this delta weighs on the wire, as a live frame.
        delta_bytes += len(b'{"type":"delta","chat_id":"%s","seq":null,"ts":1763712000000,'
                           b'"stream":{"id":"s0123456789.1","pos":%d},"data":%s}'
                           % (chat_id.encode(), i, data))
    url = f"ws://127.0.0.1:{port}/v1/ws?token=" + issue_token(secret, "resumer", "service")
    async with connect(url, compression=None, max_size=None) as ws:
        await ws.recv()
        await ws.send(msgspec.json.encode({"type": "subscribe", "chat_id": chat_id}).decode())
        while True:
            raw = await ws.recv()
            if msgspec.json.decode(raw)["type"] == "subscribed":
                return len(raw), delta_bytes


async def run(args: argparse.Namespace, redis_url: str, port: int, secret: str,
              gateway_pid: int) -> None:
    client = aioredis.from_url(redis_url)
    store = Store(Backend.of(client, Settings()), Settings())
    try:
        print(f"delta cost: {args.answers} answers x 2 subscribers, {args.seconds:g} s per rate")
        print(f"  {'mode':<10} {'deltas/s':>9} {'cpu us/delta':>13} {'p50 ms':>8} {'p99 ms':>8}"
              f"  delivered")
        for rate in [float(r) for r in args.rates.split(",")]:
            rows = [await delta_cost(store, port, secret, gateway_pid, args.answers, rate,
                                     streamed, args.seconds) for streamed in (False, True)]
            for row in rows:
                print(f"  {row['mode']:<10} {row['deltas/s']:>9.0f} {row['cpu us/delta']:>13.1f}"
                      f" {row['p50 ms']:>8.2f} {row['p99 ms']:>8.2f}  {row['deliveries']}/"
                      f"{row['expected']} {'PASS' if row['pass'] else 'fail'}")
            ratio = rows[1]["cpu us/delta"] / max(rows[0]["cpu us/delta"], 1e-9)
            print(f"  streamed / ephemeral CPU per delta at {rate:g}/s per answer: {ratio:.2f}")
        tokens, calls = await coalescing(client, store)
        print(f"coalescing: {tokens} tokens at 150/s with a 25 ms window -> {calls} publishes "
              f"({1000 * calls / tokens:.0f} Redis script calls per 1000 tokens)")
        size, replayed = await resume_size(store, port, secret, args.long)
        print(f"resume: a {args.long}-delta answer -> subscribed frame {size:,} B "
              f"(the deltas themselves: {replayed:,} B)")
    finally:
        await client.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--answers", type=int, default=50)
    parser.add_argument("--rates", default="10,20,40", help="deltas per second per answer")
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--long", type=int, default=2000, help="deltas in the resumed answer")
    args = parser.parse_args()
    with private_gateway("gw-streams-") as gw:
        asyncio.run(run(args, gw.redis_url, gw.port, gw.secret, gw.process.pid))


if __name__ == "__main__":
    main()
