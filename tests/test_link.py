"""The pipelined link the auto-pipeline writes to: batches back to back on one connection,
each caller gets its own replies, and a server that stops answering or a dropped connection
fails the batches in flight in bounded time. Real Redis, real sockets."""

from __future__ import annotations

import asyncio
import inspect
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import anyio
import hiredis
import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.config import Settings
from gateway.redis.backend import Node, _pool

pytestmark = pytest.mark.anyio


def pack(*commands: tuple[Any, ...]) -> bytes:
    return b"".join(hiredis.pack_command(c) for c in commands)  # type: ignore[arg-type]


@pytest.fixture
async def node(redis_url: str) -> AsyncIterator[Node]:
    settings = Settings(redis_url=redis_url, secret="x", redis_timeout=0.5)
    node = Node("test", _pool(redis_url, settings))
    yield node
    node.close_link()
    await node.client.aclose()


async def test_batches_in_flight_get_their_own_replies_in_order(node: Node) -> None:
    link = await node.link()
    key, text = f"n:{uuid.uuid4().hex}", f"s:{uuid.uuid4().hex}"
    await node.client.set(text, "a string")
    # 200 batches written back to back before any reply is read.
    batches = [link.request(pack(("INCR", key), ("HGET", text, "f"), ("ECHO", b"%d" % i)), 3)
               for i in range(200)]
    replies = await asyncio.gather(*batches)
    for i, (count, wrong, echo) in enumerate(replies):
        assert count == i + 1
        assert isinstance(wrong, ResponseError) and "WRONGTYPE" in str(wrong)  # in its place
        assert echo == b"%d" % i
    assert await node.link() is link  # one connection carried them all


async def test_replies_reach_the_sender_from_the_read_and_a_failing_one_costs_no_other(
        node: Node, caplog: pytest.LogCaptureFixture) -> None:
    """``send``'s callback runs inside the read that completes its batch (not a loop turn
    later). One that raises is logged; the batches after it still get their replies, on
    the same connection."""
    link = await node.link()
    got: list[tuple[list[Any] | BaseException, bool]] = []
    done = asyncio.Event()

    def broken(outcome: list[Any] | BaseException) -> None:
        raise RuntimeError("a sender's bug")

    def later(outcome: list[Any] | BaseException) -> None:
        in_read = any(frame.function == "data_received" for frame in inspect.stack())
        got.append((outcome, in_read))
        done.set()

    link.send(pack(("PING",)), 1, broken)
    link.send(pack(("ECHO", b"after"), ("ECHO", b"it")), 2, later)
    with anyio.fail_after(5):
        await done.wait()
    assert got == [([b"after", b"it"], True)]
    assert "a batch's callback failed" in caplog.text
    assert link.open and await node.link() is link
    assert await link.request(pack(("PING",)), 1) == [b"PONG"]


async def test_a_server_that_stops_answering_fails_the_batches_in_flight(
        node: Node, redis_url: str) -> None:
    link = await node.link()
    admin = aioredis.from_url(redis_url)
    try:
        await admin.execute_command("CLIENT", "PAUSE", 2000, "ALL")
        began = time.monotonic()
        with anyio.fail_after(5), pytest.raises(RedisTimeoutError):
            await link.request(pack(("PING",)), 1)
        assert time.monotonic() - began < 1.5  # the 0.5 s timeout, not the pause's end
        assert not link.open
    finally:
        await admin.execute_command("CLIENT", "UNPAUSE")
        await admin.aclose()
    fresh = await node.link()  # a new connection for the next batch
    assert fresh is not link
    assert await fresh.request(pack(("PING",)), 1) == [b"PONG"]


async def test_a_dropped_connection_fails_its_batches_and_the_next_call_reconnects(
        node: Node, redis_url: str) -> None:
    link = await node.link()
    [client_id] = await link.request(pack(("CLIENT", "ID")), 1)
    admin = aioredis.from_url(redis_url)
    try:
        # A batch the server will not answer before the kill: BLPOP on an empty list.
        pending = link.request(pack(("BLPOP", f"empty:{uuid.uuid4().hex}", 5)), 1)
        await admin.execute_command("CLIENT", "KILL", "ID", client_id)
    finally:
        await admin.aclose()
    with anyio.fail_after(5), pytest.raises(RedisConnectionError):
        await pending
    assert not link.open
    with pytest.raises(RedisConnectionError):
        link.request(pack(("PING",)), 1)
    fresh = await node.link()
    assert await fresh.request(pack(("PING",)), 1) == [b"PONG"]
