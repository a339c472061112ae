"""Several gateway processes on one Redis, gap repair, and the embedded default's lifecycle.

Everything here is real: ``gateway serve`` child processes, the session's Redis-compatible
server (or the gateway's own embedded one), WebSockets and HTTP over loopback.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import msgspec
import psutil
import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError

from gateway.redis.keys import log_key, meta_key

from .conftest import free_port
from .steps import history_page, publish, send_message
from .wsclient import Client, connect

pytestmark = pytest.mark.anyio

Frame = dict[str, Any]




async def feed_frame(ws: Client, chat_id: str) -> Frame:
    """The next frame on a connection that subscribes to nothing: a feed frame."""
    frame = await ws.recv(5.0, ignore=frozenset())
    assert frame["type"] == "conversation" and frame["chat_id"] == chat_id, frame
    return frame


# --- several processes ------------------------------------------------------------------


async def test_two_processes_share_rooms_and_the_feed(start_gateway: Any, user: str,
                                                      chat_id: str) -> None:
    a, b = start_gateway(), start_gateway()
    assert a.port != b.port and a.proc.pid != b.proc.pid
    async with (connect(a.url(user)) as feed_a, connect(a.url(user)) as on_a,
                connect(b.url(user)) as on_b, connect(b.url(user)) as sender_b):
        # B creates the conversation: A's feed-only connection hears about it.
        sub_b = await on_b.subscribe(chat_id)
        created = await feed_frame(feed_a, chat_id)
        assert created["created"] is True and created["status"] == "idle"
        assert created["last_seq"] == 0

        sub_a = await on_a.subscribe(chat_id)
        assert sub_a["epoch"] == sub_b["epoch"] and sub_a["seq"] == 0

        # An agent publishes through B's HTTP API; the subscriber on A receives it.
        result = await publish(b, chat_id, {"type": "note", "data": {"n": 1}})
        assert result["seqs"] == [1]
        note = (await on_a.events(chat_id, 1))[0]
        assert note["type"] == "note" and note["seq"] == 1 and note["data"] == {"n": 1}

        # A user's message sent over a WebSocket on B reaches A, and so does the feed.
        await send_message(sender_b, chat_id, "hello from B", "m1", id=7)
        ack = await sender_b.expect("ack", chat_id=chat_id, id=7, seq=2, duplicate=False)
        message, turn, head = await on_a.events(chat_id, 3)
        assert message["type"] == "user_message" and message["seq"] == 2
        assert message["data"]["text"] == "hello from B"
        assert message["data"]["user_id"] == user
        assert turn["type"] == "turn_start" and turn["seq"] == 3
        assert turn["data"]["turn_id"] == ack["turn_id"]
        assert head["type"] == "head" and head["seq"] == 4
        assert head["data"]["head_id"] == ack["turn_id"] == ack["head"]
        running = await feed_frame(feed_a, chat_id)
        assert running["created"] is False and running["status"] == "running"
        assert running["preview"] == "hello from B" and running["last_seq"] == 4
        assert running["head"] == ack["turn_id"]

        # The agent ends the turn through B; A sees the event and the feed change.
        await publish(b, chat_id, {"type": "turn_end", "data": {"reason": "complete"}})
        end = (await on_a.events(chat_id, 1))[0]
        assert end["type"] == "turn_end" and end["seq"] == 5
        assert end["data"]["turn_id"] == ack["turn_id"]
        idle = await feed_frame(feed_a, chat_id)
        assert idle["status"] == "idle" and idle["last_seq"] == 5

        # And the other way round: published through A, received on B.
        await publish(a, chat_id, {"type": "note", "data": {"n": 5}})
        on_b_frames = await on_b.events(chat_id, 6)
        on_a_last = (await on_a.events(chat_id, 1))[0]
        assert [f["seq"] for f in on_b_frames] == [1, 2, 3, 4, 5, 6]
        # Both processes delivered the very same frames.
        assert on_b_frames == [note, message, turn, head, end, on_a_last]
        assert on_a_last["data"] == {"n": 5}


# --- gap repair -------------------------------------------------------------------------


async def test_pubsub_loss_is_repaired_from_the_stream(gateway: Any, redis_url: str, user: str,
                                                       chat_id: str) -> None:
    direct = aioredis.from_url(redis_url)
    try:
        async with connect(gateway.url(user)) as ws, connect(gateway.url(user),
                                                             binary=True) as packed:
            sub = await ws.subscribe(chat_id)
            await packed.subscribe(chat_id)
            await publish(gateway, chat_id, {"type": "note", "data": {"n": 1}})
            assert [f["seq"] for f in await ws.events(chat_id, 1)] == [1]
            assert [f["seq"] for f in await packed.events(chat_id, 1)] == [1]

            # Events 2..4 are stored as the Lua script would store them, but their PUBLISH
            # never happens: what a pub/sub reconnect or a failover looks like to the hub.
            lost = []
            for seq in (2, 3, 4):
                frame = {"type": "note", "chat_id": chat_id, "seq": seq,
                         "ts": int(time.time() * 1000), "data": {"n": seq, "lost": True}}
                lost.append(frame)
                await direct.xadd(log_key(chat_id), {"f": msgspec.json.encode(frame)},
                                  id=f"{seq}-0")
                await direct.hset(meta_key(chat_id), "seq", seq)
            assert (await direct.hget(meta_key(chat_id), "epoch")).decode() == sub["epoch"]

            result = await publish(gateway, chat_id, {"type": "note", "data": {"n": 5}})
            assert result["seqs"] == [5]  # the script continued after the lost events

            for client in (ws, packed):
                got = await client.events(chat_id, 4)
                assert [f["seq"] for f in got] == [2, 3, 4, 5]
                assert got[:3] == lost
                assert got[3]["data"] == {"n": 5}

            # Live delivery carries on normally after the repair.
            await publish(gateway, chat_id, {"type": "note", "data": {"n": 6}})
            assert [f["seq"] for f in await ws.events(chat_id, 1)] == [6]
            assert [f["seq"] for f in await packed.events(chat_id, 1)] == [6]
    finally:
        await direct.aclose()


# --- the embedded default ---------------------------------------------------------------


class Serve:
    """``python -m gateway serve --dev --data-dir DIR`` with no GATEWAY_* settings but one:
    the demo agent is off, so the test alone decides what the conversation holds."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
        self.env["GATEWAY_DEMO_AGENT"] = "0"
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def ws(self, token: str) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/ws?token={token}"

    def launch(self) -> None:
        self.port = free_port()
        with open(self.data_dir.parent / f"serve-{self.port}.log", "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "gateway", "serve", "--dev",
                 "--data-dir", str(self.data_dir), "--port", str(self.port),
                 "--log-level", "warning"],
                env=self.env, stdout=log, stderr=subprocess.STDOUT,
            )

    async def start(self) -> None:
        """Launch, then poll /readyz (for up to 20 s) until the gateway answers."""
        self.launch()
        assert self.proc is not None
        async with asyncio.timeout(20), httpx.AsyncClient(base_url=self.http, timeout=1) as http:
            while True:
                assert self.proc.poll() is None, f"gateway exited with {self.proc.returncode}"
                with contextlib.suppress(httpx.HTTPError):
                    if (await http.get("/readyz")).status_code == 200:
                        return
                await asyncio.sleep(0.05)

    def token(self, sub: str, role: str = "user") -> str:
        done = subprocess.run(
            [sys.executable, "-m", "gateway", "token", "--sub", sub, "--role", role,
             "--data-dir", str(self.data_dir)],
            env=self.env, capture_output=True, text=True, timeout=30, check=True,
        )
        return done.stdout.strip()

    def server_child(self) -> psutil.Process:
        """The embedded Redis-compatible server this gateway started."""
        assert self.proc is not None
        socket_path = str(self.data_dir / "redis.sock")
        children = [c for c in psutil.Process(self.proc.pid).children()
                    if socket_path in " ".join(c.cmdline())]
        assert len(children) == 1, [c.cmdline() for c in children]
        return children[0]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout=timeout)

    def kill_all(self) -> None:
        """Cleanup after a failure: this gateway and its server child, by pid."""
        if self.proc is None:
            return
        with contextlib.suppress(psutil.Error):
            for child in psutil.Process(self.proc.pid).children():
                child.kill()
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def exited(process: psutil.Process) -> bool:
    try:
        return not process.is_running() or process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


async def until_exited(pidfd: int) -> None:
    """Wait for the process a pidfd refers to to exit: the fd turns readable then."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    loop.add_reader(pidfd, lambda: done.done() or done.set_result(None))
    try:
        await done
    finally:
        loop.remove_reader(pidfd)


async def test_embedded_default_keeps_history_across_a_restart(tmp_path: Path,
                                                               chat_id: str) -> None:
    data_dir = tmp_path / "data"
    serve = Serve(data_dir)
    try:
        await serve.start()
        assert (data_dir / "secret").is_file() and (data_dir / "redis.sock").exists()
        alice, agent = serve.token("alice"), serve.token("agent", "service")
        async with httpx.AsyncClient(base_url=serve.http) as http:
            resp = await http.post(f"/v1/conversations/{chat_id}/events",
                                   headers={"Authorization": f"Bearer {agent}"},
                                   json={"type": "note", "data": {}})
            assert resp.status_code == 404, resp.text  # does not exist yet
        async with connect(serve.ws(alice)) as ws, connect(serve.ws(alice)) as sender:
            sub = await ws.subscribe(chat_id)
            epoch = sub["epoch"]
            await send_message(sender, chat_id, "before restart", "c1")
            ack = await sender.expect("ack", seq=1, duplicate=False)
            async with httpx.AsyncClient(base_url=serve.http) as http:
                for body in ({"type": "progress", "data": {"text": "partial"}, "durable": False},
                             {"type": "note", "data": {"n": 3}},
                             {"type": "turn_end", "data": {"reason": "complete"}}):
                    resp = await http.post(f"/v1/conversations/{chat_id}/events", json=body,
                                           headers={"Authorization": f"Bearer {agent}"})
                    assert resp.status_code == 200, resp.text
            before = [f for f in await ws.events(chat_id, 6) if f["seq"] is not None]
        assert [f["seq"] for f in before] == [1, 2, 3, 4, 5]
        assert [f["type"] for f in before] == ["user_message", "turn_start", "head", "note",
                                               "turn_end"]
        assert (await history_page(serve, "alice", chat_id, token=alice))["events"] == before

        child = serve.server_child()
        # A clean stop exits 0 and has stopped (and waited for) its server by then.
        assert serve.stop(signal.SIGTERM) == 0
        assert exited(child), "the gateway exited before its embedded server"

        await serve.start()
        # The secret was kept in the data dir: tokens issued before the restart still work.
        page = await history_page(serve, "alice", chat_id, token=alice)
        assert page["epoch"] == epoch and page["last_seq"] == 5
        assert page["events"] == before
        async with httpx.AsyncClient(base_url=serve.http) as http:
            resp = await http.get("/v1/conversations",
                                  headers={"Authorization": f"Bearer {alice}"})
        assert [c["chat_id"] for c in resp.json()["conversations"]] == [chat_id]
        assert resp.json()["conversations"][0]["preview"] == "before restart"
        async with connect(serve.ws(alice)) as ws, connect(serve.ws(alice)) as sender:
            again = await ws.subscribe(chat_id, since={"seq": 1, "epoch": epoch})
            assert again["epoch"] == epoch and again["seq"] == 5
            assert again["recovered"] is True and again["replayed"] == 4
            assert again["snapshot"]["status"] == "idle"
            assert again["snapshot"]["head"] == ack["turn_id"]  # the tree survived too
            assert await ws.events(chat_id, 4) == before[1:]
            async with httpx.AsyncClient(base_url=serve.http) as http:
                resp = await http.post(f"/v1/conversations/{chat_id}/events",
                                       json={"type": "note", "data": {"after": True}},
                                       headers={"Authorization": f"Bearer {agent}"})
                assert resp.status_code == 200 and resp.json()["seqs"] == [6], resp.text
            live = (await ws.events(chat_id, 1))[0]
            assert live["seq"] == 6 and live["data"] == {"after": True}
            # The message's idempotency record survived too: a retry is a duplicate.
            await send_message(sender, chat_id, "before restart", "c1")
            await sender.expect("ack", seq=1, duplicate=True, turn_id=ack["turn_id"])
    finally:
        serve.kill_all()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
async def test_embedded_server_does_not_outlive_a_killed_gateway(tmp_path: Path,
                                                                 chat_id: str) -> None:
    serve = Serve(tmp_path / "data")
    try:
        await serve.start()
        child = serve.server_child()
        pidfd = os.pidfd_open(child.pid)  # taken while it runs: immune to pid reuse
        try:
            assert not exited(child)
            async with connect(serve.ws(serve.token("bob"))) as ws:
                assert (await ws.subscribe(chat_id))["recovered"] is True
            assert serve.stop(signal.SIGKILL) == -signal.SIGKILL
            # The kernel sends it SIGTERM when its parent dies (PR_SET_PDEATHSIG).
            async with asyncio.timeout(5):
                await until_exited(pidfd)
        finally:
            os.close(pidfd)
        assert exited(child)
        # Nothing answers on its socket any more.
        with pytest.raises(RedisConnectionError):
            client = aioredis.from_url(f"unix://{serve.data_dir / 'redis.sock'}")
            try:
                await client.ping()
            finally:
                await client.aclose()
    finally:
        serve.kill_all()


# --- bursts -----------------------------------------------------------------------------


async def test_a_burst_of_subscribes_waits_for_redis_connections(gateway: Any, user: str) -> None:
    """More concurrent subscribes than the Redis pool has connections: all succeed, none
    is closed with 1013 (redis-py's default pool raised MaxConnectionsError at 100)."""
    count = 150
    async with contextlib.AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(connect(gateway.url(f"{user}-{i}")))
                   for i in range(count)]
        chats = [f"{user}-burst-{i}" for i in range(count)]
        await asyncio.gather(*(ws.send({"type": "subscribe", "chat_id": chat, "id": i})
                               for i, (ws, chat) in enumerate(zip(clients, chats, strict=True))))
        replies = await asyncio.gather(*(ws.recv(15) for ws in clients))
        for i, (reply, chat) in enumerate(zip(replies, chats, strict=True)):
            assert reply["type"] == "subscribed" and reply["chat_id"] == chat, reply
            assert reply["id"] == i and reply["seq"] == 0
        # Every connection is live: one event each, all delivered.
        await asyncio.gather(*(publish(gateway, chat, {"type": "note", "data": {"i": i}})
                               for i, chat in enumerate(chats[:20])))
        for i, ws in enumerate(clients[:20]):
            assert (await ws.events(chats[i], 1))[0]["data"] == {"i": i}
