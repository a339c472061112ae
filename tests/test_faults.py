"""Faults under load: nothing acknowledged is lost, no subscriber sees a gap or a duplicate
without being told (``recovered: false``).

Each test starts its own Redis-compatible server (persistent, AOF with ``appendfsync
always``, unless it needs it empty) and its own ``gateway serve`` processes on it, so a fault
never disturbs another test. :class:`tests.faults.Load` runs publishers (HTTP, idempotency
keys, retried until acknowledged) and reconnecting subscribers (WebSocket, resuming with
``since``) while the fault happens, then checks history and every subscriber. The rows are
printed as a table at the end of the session.
"""

from __future__ import annotations

import asyncio
import os
import random
import secrets
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gateway.embedded import EmbeddedRedis

from .conftest import GatewayProcess, free_port
from .faults import (
    Load,
    frozen,
    kill_pubsub_clients,
    kill_server,
    pubsub_clients,
    start_server,
    until,
)

pytestmark = [pytest.mark.anyio, pytest.mark.slow]  # each runs ~5-10 s of load

Backend = tuple[EmbeddedRedis, list[GatewayProcess]]


@pytest.fixture
def backend(tmp_path: Path) -> Iterator[Callable[..., Backend]]:
    """``backend(gateways=2, persistent=True)``: a server of this test only (its own data
    dir and socket) and gateway processes on it; all killed afterwards."""
    servers: list[EmbeddedRedis] = []
    gateways: list[GatewayProcess] = []

    def make(gateways_count: int = 2, persistent: bool = True) -> Backend:
        server = EmbeddedRedis(tmp_path / "redis", persistent=persistent)
        servers.append(server)
        server.start()
        env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
        env.update({
            "GATEWAY_REDIS_URL": server.url,
            "GATEWAY_SECRET": secrets.token_hex(16),
            "GATEWAY_DATA_DIR": str(tmp_path / "gateway"),
            "GATEWAY_DEMO_AGENT": "0",
        })
        (tmp_path / "gateway").mkdir(exist_ok=True)
        started = []
        for _ in range(gateways_count):
            process = GatewayProcess(dict(env, GATEWAY_PORT=str(free_port())))
            gateways.append(process)
            started.append(process.start())
        return server, started

    yield make
    for process in gateways:
        process.stop(signal.SIGKILL)
    for server in servers:
        if server.process is not None and server.process.poll() is None:
            os.kill(server.process.pid, signal.SIGCONT)  # in case a test left it stopped
        server.stop()


async def test_gateway_sigkill_under_load(backend: Callable[..., Backend]) -> None:
    """Two gateways; one is killed. Its clients resume on the other with ``since``."""
    _, (a, b) = backend(2)
    async with asyncio.timeout(60), Load([a, b]) as load:
        await load.until_acked(250)
        victims = [s for s in load.subscribers if s.connected_to == a.port]
        assert victims and len(victims) < len(load.subscribers)
        assert a.proc is not None
        a.proc.kill()
        await asyncio.to_thread(a.proc.wait)
        await load.until_acked(250)  # publishers moved to b
        assert await until(lambda: all(s.ready and s.connected_to == b.port
                                       for s in load.subscribers), 15), "not all resumed on b"
        await load.until_acked(50)
        await load.finish("gateway SIGKILL (1 of 2)")
    assert all(s.reconnects >= 1 for s in victims)


async def test_redis_sigkill_and_aof_restart_under_load(
        backend: Callable[..., Backend]) -> None:
    """The server dies (no flush) and comes back from its AOF on the same socket."""
    server, gateways = backend(2)
    async with asyncio.timeout(60), Load(gateways) as load:
        await load.until_acked(250)
        await kill_server(server)
        await load.bounce()  # every subscriber resumes while the server is down
        await asyncio.sleep(0.5)  # down for a bounded while, under load
        await start_server(server)
        await load.until_acked(250)
        await load.finish("redis SIGKILL + AOF restart")
    assert any(a.outcome != "ok" for a in load.publishers.attempts), "the fault was not felt"
    assert all(s.reconnects >= 1 for s in load.subscribers)


async def test_pubsub_connections_killed_repeatedly_under_load(
        backend: Callable[..., Backend]) -> None:
    """``CLIENT KILL TYPE pubsub`` every 0.5-1 s: the hubs reconnect and repair gaps."""
    server, gateways = backend(2)
    killed: list[int] = []
    async with asyncio.timeout(60), Load(gateways) as load:
        await load.until_acked(100)
        for _ in range(4):
            await asyncio.sleep(random.uniform(0.5, 1.0))  # the load runs meanwhile
            # Every gateway has its pub/sub connection back (it reconnects by itself).
            for _poll in range(500):
                if await pubsub_clients(server.url) >= len(gateways):
                    break
                await asyncio.sleep(0.02)
            killed.append(await kill_pubsub_clients(server.url))
        await load.until_acked(100)
        await load.finish("CLIENT KILL TYPE pubsub x4")
    assert all(n >= len(gateways) for n in killed), killed


async def test_redis_sigstop_for_3s_under_load(backend: Callable[..., Backend]) -> None:
    """The server freezes for 3 s (SIGSTOP), then goes on (SIGCONT): requests time out and
    are retried with the same idempotency key while the first attempts are still queued."""
    server, gateways = backend(2)
    async with asyncio.timeout(60), Load(gateways) as load:
        await load.until_acked(250)
        async with frozen(server):
            await load.bounce()  # every subscriber resumes while the server is frozen
            await asyncio.sleep(3.0)
        await load.until_acked(250)
        await load.finish("redis SIGSTOP 3s")
    assert any(a.outcome != "ok" for a in load.publishers.attempts), "the fault was not felt"
    assert all(s.reconnects >= 1 for s in load.subscribers)


async def test_redis_restarted_empty_under_load(backend: Callable[..., Backend]) -> None:
    """No persistence: the history is gone. Every subscriber must be told (``recovered:
    false``), and what is published afterwards must reach everyone."""
    server, gateways = backend(2, persistent=False)
    async with asyncio.timeout(60), Load(gateways) as load:
        await load.until_acked(250)
        await kill_server(server)
        await start_server(server)
        # Events of the new history (a new epoch), acknowledged and then delivered.
        await load.until_acked(150, where=lambda a: a.epoch != load.epochs[a.chat])
        row = await load.finish("redis restarted empty", history_lost=True)
    assert row.gone > 0
