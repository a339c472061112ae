"""The webhook for people who are away: signed, at least once from a durable outbox,
deduplicable by id, bounded per user, and none for a person connected to the conversation.

Real parts: a receiver served by uvicorn in this test, gateway processes with
``GATEWAY_WEBHOOK_URL``, an in-process agent worker, WebSockets. The gateways of this file
run on a Redis of their own, so no other test's turns reach the receiver.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import os
import signal
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.config import Settings
from gateway.embedded import EmbeddedRedis
from gateway.redis.backend import Backend
from gateway.redis.notify_outbox import PER_USER_MAX, Notification, NotifyOutbox
from gateway.redis.pipeline import AutoPipeline
from gateway.sdk.agent import Turn

from .steps import send_message
from .test_agent import agent_worker, until_turn_end
from .wsclient import connect

pytestmark = pytest.mark.anyio

SECRET = "webhook-secret-0123456789"


class Receiver:
    """A webhook receiver: records each delivery, answers with ``statuses`` in turn (then
    200), or holds the request open while ``hold`` is set."""

    def __init__(self) -> None:
        self.deliveries: list[tuple[dict[str, str], bytes]] = []
        self.statuses: list[int] = []
        self.hold = asyncio.Event()
        self.closing = asyncio.Event()  # held requests end with the receiver
        self.arrived = asyncio.Condition()

    async def endpoint(self, request: Request) -> Response:
        body = await request.body()
        async with self.arrived:
            self.deliveries.append((dict(request.headers), body))
            self.arrived.notify_all()
        if self.hold.is_set():
            await self.closing.wait()  # no answer: the gateway dies first
        return Response(status_code=self.statuses.pop(0) if self.statuses else 200)

    async def wait_for(self, count: int, within: float = 15.0) -> list[dict[str, Any]]:
        async with asyncio.timeout(within), self.arrived:
            await self.arrived.wait_for(lambda: len(self.deliveries) >= count)
        return [json.loads(body) for _, body in self.deliveries]


@contextlib.asynccontextmanager
async def receiving() -> AsyncIterator[tuple[str, Receiver]]:
    receiver = Receiver()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    app = Starlette(routes=[Route("/hook", receiver.endpoint, methods=["POST"])])
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/hook", receiver
    finally:
        receiver.closing.set()
        server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, 5)
        sock.close()


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[str]:
    server = EmbeddedRedis(tmp_path / "redis", persistent=False)
    try:
        yield server.start()
    finally:
        server.stop()


def verified(headers: dict[str, str], body: bytes) -> bool:
    stamp = headers["gateway-webhook-timestamp"]
    mac = hmac.new(SECRET.encode(), f"{stamp}.".encode() + body, hashlib.sha256).hexdigest()
    return hmac.compare_digest(headers["gateway-webhook-signature"], "v1=" + mac)


async def until_away(gw: Any, user: str, chat_id: str) -> None:
    """Wait until the conversation's presence list no longer has ``user`` (their leave is
    written within GATEWAY_PRESENCE_WINDOW): from then on they are away."""
    async with httpx.AsyncClient(base_url=gw.http) as http, asyncio.timeout(10):
        while True:
            listed = (await http.get(f"/v1/conversations/{chat_id}/presence",
                                     headers=gw.headers(user))).json()
            if all(u["user_id"] != user for u in listed["users"]):
                return
            await asyncio.sleep(0.05)


def agent_of(release: asyncio.Event) -> Any:
    """Answers at once, but waits for ``release`` before answering a message that says
    "later" (so the person can leave first)."""
    async def handle(turn: Turn) -> None:
        if "later" in turn.text:
            await release.wait()
        await turn.message(f"Here is your plan for {turn.text}")
    return handle


async def test_only_an_away_owner_gets_a_signed_webhook_when_the_answer_is_ready(
        start_gateway: Any, own_redis: str, user: str, chat_id: str) -> None:
    """Connected, the answer reaches the person live: no webhook. Gone before it was
    done: one signed delivery, with an id the receiver dedupes by."""
    release = asyncio.Event()
    async with receiving() as (url, receiver):
        gw = start_gateway(redis_url=own_redis, webhook_url=url, webhook_secret=SECRET)
        async with agent_worker(own_redis, agent_of(release), "agents"):
            async with connect(gw.url(user)) as ws:
                await ws.subscribe(chat_id)
                await send_message(ws, chat_id, "Lisbon")
                await until_turn_end(ws, chat_id)
                await send_message(ws, chat_id, "Porto, later")
                await ws.wait_for(lambda f: f.get("type") == "ack")
            await until_away(gw, user, chat_id)
            release.set()  # the person is gone: the answer comes now
            [payload] = await receiver.wait_for(1)
    headers, body = receiver.deliveries[0]
    assert verified(headers, body)
    assert payload["type"] == "turn_end" and payload["chat_id"] == chat_id
    assert payload["user_id"] == user
    assert payload["preview"] == "Here is your plan for Porto, later"
    assert headers["gateway-webhook-id"] == payload["id"]
    assert payload["id"].startswith(chat_id + ":") and payload["id"].endswith(
        f":{payload['seq']}")


async def test_a_failing_receiver_is_tried_again_with_the_same_id(
        start_gateway: Any, own_redis: str, user: str, chat_id: str) -> None:
    release = asyncio.Event()
    async with receiving() as (url, receiver):
        receiver.statuses = [500, 503]
        gw = start_gateway(redis_url=own_redis, webhook_url=url, webhook_secret=SECRET)
        async with agent_worker(own_redis, agent_of(release), "agents"):
            async with connect(gw.url(user)) as ws:
                await ws.subscribe(chat_id)
                await send_message(ws, chat_id, "later")
                await ws.wait_for(lambda f: f.get("type") == "ack")
            await until_away(gw, user, chat_id)
            release.set()
            payloads = await receiver.wait_for(3)
    assert len({p["id"] for p in payloads}) == 1  # one notification, three attempts
    assert all(verified(h, b) for h, b in receiver.deliveries)


async def test_a_gateway_killed_mid_delivery_loses_nothing(
        start_gateway: Any, own_redis: str, user: str, chat_id: str) -> None:
    """The first gateway dies holding the delivery; another takes it once the lease
    lapses (three webhook timeouts)."""
    release = asyncio.Event()
    async with receiving() as (url, receiver):
        receiver.hold.set()
        first = start_gateway(redis_url=own_redis, webhook_url=url, webhook_secret=SECRET,
                              webhook_timeout=1)
        async with agent_worker(own_redis, agent_of(release), "agents"):
            async with connect(first.url(user)) as ws:
                await ws.subscribe(chat_id)
                await send_message(ws, chat_id, "later")
                await ws.wait_for(lambda f: f.get("type") == "ack")
            await until_away(first, user, chat_id)
            release.set()
            [held] = await receiver.wait_for(1)
            assert first.proc is not None
            os.kill(first.proc.pid, signal.SIGKILL)
            receiver.hold.clear()
            start_gateway(redis_url=own_redis, webhook_url=url, webhook_secret=SECRET,
                          webhook_timeout=1)
            payloads = await receiver.wait_for(2, within=20)
    assert payloads[1]["id"] == held["id"]


async def test_the_outbox_keeps_at_most_so_many_per_user(own_redis: str) -> None:
    """Bounded per user: past :data:`PER_USER_MAX` pending, new notifications are dropped,
    another user's are not."""
    settings = Settings(redis_url=own_redis)
    backend = await Backend.connect(settings)
    try:
        outbox = NotifyOutbox(AutoPipeline(backend), settings.inbox_partitions)

        def note(user: str, n: int) -> Notification:
            return Notification(f"c:{user}:{n}", user, "c", "turn_end", n, n)

        kept = [await outbox.enqueue(note("ann", n)) for n in range(PER_USER_MAX + 5)]
        assert kept == [True] * PER_USER_MAX + [False] * 5
        assert await outbox.enqueue(note("bob", 1))
        client = aioredis.from_url(own_redis)
        try:
            members = sum([await client.zcard(f"notify:{{{tag}}}")
                           for tag in outbox.partitions], 0)
        finally:
            await client.aclose()
        assert members == PER_USER_MAX + 1
    finally:
        await backend.aclose()
