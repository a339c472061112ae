"""Connect cost: N clients connect, each subscribes its own new conversation, then all idle.

Reports the gateway's CPU seconds per connection, the wall time to connect everyone and the
RSS added per connection, for one ``gateway serve`` process on a private server. With
``--profile`` it runs the gateway under ``py-spy record`` (raw stacks to a file) while the
clients connect, so the time per part of the connect path can be read off.

    .venv/bin/python bench/connect.py                    # 2000 clients, 200 at a time
    .venv/bin/python bench/connect.py --clients 5000 --profile /tmp/connect.txt
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import psutil
from redis.asyncio import Redis
from websockets.asyncio.client import connect

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

sys.path.insert(0, str(Path(__file__).resolve().parent))
from launch import free_port, start_gateway, stop_gateway

from gateway.auth import issue_token
from gateway.embedded import EmbeddedRedis


async def client(url: str, index: int, opened: list[object]) -> None:
    ws = await connect(url, compression=None, open_timeout=60)
    assert msgspec.json.decode(await ws.recv())["type"] == "hello"
    await ws.send(msgspec.json.encode({"type": "subscribe", "chat_id": f"idle-{index}"}).decode())
    while msgspec.json.decode(await ws.recv())["type"] != "subscribed":
        pass
    opened.append(ws)


def stop_profile(spy: subprocess.Popen[bytes] | None) -> None:
    if spy is not None and spy.poll() is None:
        spy.send_signal(signal.SIGINT)  # py-spy writes its file on ^C
        spy.wait()


async def command_calls(redis_url: str) -> dict[str, tuple[int, int]]:
    """Calls and microseconds per Redis command so far (``INFO commandstats``)."""
    client = Redis.from_url(redis_url)
    try:
        stats = await client.info("commandstats")
    finally:
        await client.aclose()
    return {name.removeprefix("cmdstat_"): (int(value["calls"]), int(value["usec"]))
            for name, value in stats.items()}


async def run(args: argparse.Namespace) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="gateway-connect-"))
    redis = EmbeddedRedis(tmp / "redis", persistent=False)
    (tmp / "redis").mkdir()
    redis_url = redis.start()
    secret, port = secrets.token_hex(16), free_port()
    proc = start_gateway(redis_url, secret, port, tmp, log_level=args.log_level)
    server = psutil.Process(proc.pid)
    spy = None
    try:
        if args.profile:
            spy = subprocess.Popen([str(Path(sys.executable).parent / "py-spy"), "record",  # noqa: ASYNC220
                                    "-p", str(proc.pid), "-r", "500", "-f", "raw", "-o",
                                    args.profile, "--nonblocking"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            await asyncio.sleep(1)  # py-spy attaches
        rss0, cpu0 = server.memory_info().rss, sum(server.cpu_times()[:2])
        io0 = server.io_counters()
        assert redis.process is not None
        redis_proc = psutil.Process(redis.process.pid)
        redis_cpu0 = sum(redis_proc.cpu_times()[:2])
        commands0 = await command_calls(redis_url)
        urls = [f"ws://127.0.0.1:{port}/v1/ws?token="
                + issue_token(secret, f"idle{i}", "service") for i in range(args.clients)]
        opened: list[object] = []
        gate = asyncio.Semaphore(args.concurrency)

        async def one(i: int) -> None:
            async with gate:
                await client(urls[i], i, opened)

        start = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(args.clients)))
        wall = time.perf_counter() - start
        stop_profile(spy)  # the connect phase only, not the idle time or the closes
        cpu = sum(server.cpu_times()[:2]) - cpu0
        io = server.io_counters()
        redis_cpu = sum(redis_proc.cpu_times()[:2]) - redis_cpu0
        commands = await command_calls(redis_url)
        await asyncio.sleep(2)  # let the server settle before reading RSS
        rss = server.memory_info().rss - rss0
        cpu_idle0 = sum(server.cpu_times()[:2])
        await asyncio.sleep(args.idle)
        idle_pct = (sum(server.cpu_times()[:2]) - cpu_idle0) / args.idle * 100
        n = len(opened)
        print(f"{n} clients connected+subscribed in {wall:.2f} s; gateway CPU "
              f"{cpu * 1e6 / n:.0f} us/connection; RSS +{rss / 1024 / n:.1f} KiB/connection; "
              f"idle CPU {idle_pct:.1f} %; system calls per connection: "
              f"{(io.read_count - io0.read_count) / n:.1f} reads, "
              f"{(io.write_count - io0.write_count) / n:.1f} writes")
        used = {name: (calls - commands0.get(name, (0, 0))[0],
                       usec - commands0.get(name, (0, 0))[1])
                for name, (calls, usec) in commands.items() if name not in ("info", "client")}
        print(f"Redis CPU {redis_cpu * 1e6 / n:.0f} us/connection; per connection, calls "
              "(and us inside Redis) of each command: "
              + ", ".join(f"{name} {calls / n:.2f} ({usec / n:.1f})"
                          for name, (calls, usec) in sorted(used.items()) if calls))
        await asyncio.gather(*(ws.close() for ws in opened))  # type: ignore[attr-defined]
    finally:
        stop_profile(spy)
        stop_gateway(proc)
        redis.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=200)
    parser.add_argument("--idle", type=float, default=5.0, help="seconds idle CPU is measured")
    parser.add_argument("--profile", help="py-spy raw output file")
    parser.add_argument("--log-level", default="info",
                        help="the gateway's (info, as the peer bench runs it)")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
