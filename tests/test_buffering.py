"""Unsubscribe keeps a bounded buffer; subscribing again drains it, or replays on overflow.

Every test pins down exactly which frames of the chat reach the socket and in which order.
To know that the gateway has already handled events published over HTTP, a test publishes
one more event to a *fence* chat the connection is live on: the hub reads every room from
one pub/sub connection, in publish order, so once the fence frame arrives every earlier
event has been delivered to (or buffered for) this connection.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest

from .steps import create, publish
from .wsclient import Client, Frame, connect

pytestmark = pytest.mark.anyio

NOTHING = frozenset[str]()
TTL = 0.3


@pytest.fixture(scope="module")
def small_buffer(start_gateway: Any) -> Any:
    return start_gateway(buffer_max_frames=3)


@pytest.fixture(scope="module")
def small_bytes(start_gateway: Any) -> Any:
    return start_gateway(buffer_max_bytes=600)


@pytest.fixture(scope="module")
def short_ttl(start_gateway: Any) -> Any:
    return start_gateway(buffer_ttl=TTL)


def durable(n: int, **extra: Any) -> dict[str, Any]:
    return {"type": "note", "data": {"n": n, **extra}}


def ephemeral(n: int) -> dict[str, Any]:
    return {"type": "delta", "data": {"n": n}, "durable": False}


async def fence(gw: Any, ws: Client, fence_chat: str, chat_id: str) -> list[Frame]:
    """Publish to ``fence_chat`` and read up to its frame; return every frame of ``chat_id``
    (any type, feed included) that arrived before it."""
    result = await publish(gw, fence_chat, {"type": "fence", "data": {}})
    (seq,) = result["seqs"]
    leaked: list[Frame] = []
    while True:
        frame = await ws.recv(ignore=NOTHING)
        if frame.get("chat_id") == fence_chat and frame.get("seq") == seq:
            assert frame["type"] == "fence", frame
            return leaked
        if frame.get("chat_id") == chat_id:
            leaked.append(frame)


async def pong(ws: Client, chat_id: str) -> None:
    """Ping; nothing of ``chat_id`` may arrive before the pong."""
    await ws.send({"type": "ping", "id": "p"})
    before = []
    while (frame := await ws.recv(ignore=NOTHING))["type"] != "pong":
        before.append(frame)
    assert frame["id"] == "p"
    assert [f for f in before if f.get("chat_id") == chat_id] == []


@contextlib.asynccontextmanager
async def live_on(gw: Any, user: str, chat_id: str) -> AsyncIterator[tuple[Client, Frame, str]]:
    """A connection live on ``chat_id`` (having received its seq 1) and on a fence chat."""
    fence_chat = chat_id + "-fence"
    # Created over HTTP before connecting, so no creation feed frame arrives.
    for chat in (chat_id, fence_chat):
        await create(gw, user, chat)
    async with connect(gw.url(user)) as ws:
        sub = await ws.subscribe(chat_id)
        assert sub["seq"] == 0 and "buffered" not in sub and "overflowed" not in sub
        await ws.subscribe(fence_chat)
        await publish(gw, chat_id, durable(0))
        frame = await ws.recv(ignore=NOTHING)
        assert (frame["chat_id"], frame["seq"], frame["data"]) == (chat_id, 1, {"n": 0})
        yield ws, sub, fence_chat


async def unsubscribe(ws: Client, chat_id: str) -> None:
    await ws.send({"type": "unsubscribe", "chat_id": chat_id, "id": 7})
    await ws.expect("unsubscribed", chat_id=chat_id, id=7)


async def test_resubscribe_drains_the_buffer_in_order_then_goes_live(
    gateway: Any, user: str, chat_id: str
) -> None:
    async with live_on(gateway, user, chat_id) as (ws, first, fence_chat):
        await unsubscribe(ws, chat_id)

        # Durable and ephemeral events, in two batches, while unsubscribed.
        batch = [durable(1), ephemeral(1), durable(2), ephemeral(2)]
        result = await publish(gateway, chat_id, *batch)
        assert result["seqs"] == [2, None, 3, None]
        result = await publish(gateway, chat_id, ephemeral(3), durable(3))
        assert result["seqs"] == [None, 4]
        # Nothing of the chat reached the socket while unsubscribed.
        assert await fence(gateway, ws, fence_chat, chat_id) == []
        await pong(ws, chat_id)

        sub = await ws.subscribe(chat_id, id="again")
        assert sub["id"] == "again"
        assert sub["buffered"] == 6 and sub["overflowed"] is False
        assert sub["epoch"] == first["epoch"] and sub["seq"] == 4
        assert sub["recovered"] is True and sub["replayed"] == 0
        buffered = [await ws.recv() for _ in range(6)]
        assert [(f["type"], f["seq"], f["data"]["n"]) for f in buffered] == [
            ("note", 2, 1), ("delta", None, 1), ("note", 3, 2), ("delta", None, 2),
            ("delta", None, 3), ("note", 4, 3),
        ]
        assert all(f["chat_id"] == chat_id for f in buffered)

        # Live again: the next frames continue the sequence with no gap and no duplicate.
        await publish(gateway, chat_id, durable(4), ephemeral(4), durable(5))
        live = [await ws.recv() for _ in range(3)]
        assert [(f["type"], f["seq"], f["data"]["n"]) for f in live] == [
            ("note", 5, 4), ("delta", None, 4), ("note", 6, 5),
        ]
        await pong(ws, chat_id)  # and nothing extra after them


async def test_resubscribe_with_an_empty_buffer_reports_zero(
    gateway: Any, user: str, chat_id: str
) -> None:
    async with live_on(gateway, user, chat_id) as (ws, _first, _fence_chat):
        await unsubscribe(ws, chat_id)
        sub = await ws.subscribe(chat_id)
        assert sub["buffered"] == 0 and sub["overflowed"] is False and sub["seq"] == 1
        await publish(gateway, chat_id, durable(1))
        frame = await ws.recv()
        assert (frame["seq"], frame["data"]) == (2, {"n": 1})


async def test_buffer_is_per_chat_and_other_chats_stay_live(
    gateway: Any, user: str, chat_id: str
) -> None:
    async with live_on(gateway, user, chat_id) as (ws, _first, fence_chat):
        await unsubscribe(ws, chat_id)
        await publish(gateway, chat_id, durable(1))
        await publish(gateway, fence_chat, durable(100))
        frame = await ws.recv()  # the fence chat is still live, the other chat is held
        assert (frame["chat_id"], frame["seq"], frame["data"]) == (fence_chat, 1, {"n": 100})
        sub = await ws.subscribe(chat_id)
        assert sub["buffered"] == 1
        frame = await ws.recv()
        assert (frame["chat_id"], frame["seq"]) == (chat_id, 2)


async def expect_overflow_replay(gw: Any, ws: Client, chat_id: str, fence_chat: str,
                                 first: Frame, last_seq: int) -> None:
    """Resubscribe without ``since`` after an overflow: seqs 2..last_seq come back from the
    stream, ephemeral frames are gone, then live delivery continues."""
    sub = await ws.subscribe(chat_id)
    assert sub["overflowed"] is True and sub["recovered"] is True
    assert "buffered" not in sub or sub["buffered"] == 0
    assert sub["epoch"] == first["epoch"] and sub["seq"] == last_seq
    assert sub["replayed"] == last_seq - 1
    replayed = [await ws.recv() for _ in range(last_seq - 1)]
    assert [f["seq"] for f in replayed] == list(range(2, last_seq + 1))
    assert all(f["type"] == "note" and f["chat_id"] == chat_id for f in replayed)
    await publish(gw, chat_id, ephemeral(99), durable(99))
    live = [await ws.recv() for _ in range(2)]
    assert [(f["type"], f["seq"], f["data"]["n"]) for f in live] == [
        ("delta", None, 99), ("note", last_seq + 1, 99),
    ]
    assert await fence(gw, ws, fence_chat, chat_id) == []  # no stray duplicate after them


async def test_frame_cap_overflow_replays_durable_events_from_the_stream(
    small_buffer: Any, user: str, chat_id: str
) -> None:
    gw = small_buffer
    async with live_on(gw, user, chat_id) as (ws, first, fence_chat):
        assert ws.hello["limits"]["buffer_max_frames"] == 3
        await unsubscribe(ws, chat_id)
        await publish(gw, chat_id, durable(1), ephemeral(1), durable(2))  # 3 frames: fits
        await publish(gw, chat_id, durable(3), ephemeral(2), durable(4), durable(5))
        await publish(gw, chat_id, ephemeral(3))
        assert await fence(gw, ws, fence_chat, chat_id) == []
        await expect_overflow_replay(gw, ws, chat_id, fence_chat, first, last_seq=6)


async def test_frame_cap_is_not_overflowed_when_exactly_full(
    small_buffer: Any, user: str, chat_id: str
) -> None:
    gw = small_buffer
    async with live_on(gw, user, chat_id) as (ws, _first, fence_chat):
        await unsubscribe(ws, chat_id)
        await publish(gw, chat_id, durable(1), ephemeral(1), durable(2))
        assert await fence(gw, ws, fence_chat, chat_id) == []
        sub = await ws.subscribe(chat_id)
        assert sub["buffered"] == 3 and sub["overflowed"] is False
        frames = [await ws.recv() for _ in range(3)]
        assert [f["seq"] for f in frames] == [2, None, 3]


async def test_byte_cap_overflow_replays_durable_events_from_the_stream(
    small_bytes: Any, user: str, chat_id: str
) -> None:
    gw = small_bytes
    pad = "x" * 200  # each frame is ~300 bytes: the third one does not fit
    async with live_on(gw, user, chat_id) as (ws, first, fence_chat):
        assert ws.hello["limits"]["buffer_max_bytes"] == 600
        await unsubscribe(ws, chat_id)
        await publish(gw, chat_id, durable(1, pad=pad), ephemeral(1))
        await publish(gw, chat_id, durable(2, pad=pad), durable(3, pad=pad))
        await publish(gw, chat_id, {"type": "delta", "data": {"n": 2, "pad": pad},
                                    "durable": False})
        assert await fence(gw, ws, fence_chat, chat_id) == []
        await expect_overflow_replay(gw, ws, chat_id, fence_chat, first, last_seq=4)


async def test_expired_buffer_replays_durable_events_from_the_stream(
    short_ttl: Any, user: str, chat_id: str
) -> None:
    gw = short_ttl
    async with live_on(gw, user, chat_id) as (ws, first, fence_chat):
        await unsubscribe(ws, chat_id)
        await publish(gw, chat_id, durable(1), ephemeral(1), durable(2))
        assert await fence(gw, ws, fence_chat, chat_id) == []
        # Let the configured TTL elapse (time passing, not an event being waited for).
        await anyio.sleep(TTL + 0.2)
        await pong(ws, chat_id)
        await expect_overflow_replay(gw, ws, chat_id, fence_chat, first, last_seq=3)


async def test_events_after_expiry_are_replayed_too(
    short_ttl: Any, user: str, chat_id: str
) -> None:
    gw = short_ttl
    async with live_on(gw, user, chat_id) as (ws, first, fence_chat):
        await unsubscribe(ws, chat_id)
        await publish(gw, chat_id, durable(1))
        await anyio.sleep(TTL + 0.2)
        # Delivered to a buffer whose TTL has passed: dropped, and the buffer overflows.
        await publish(gw, chat_id, durable(2), ephemeral(1), durable(3))
        assert await fence(gw, ws, fence_chat, chat_id) == []
        await expect_overflow_replay(gw, ws, chat_id, fence_chat, first, last_seq=4)


async def test_overflow_is_not_sticky_after_resubscribing(
    small_buffer: Any, user: str, chat_id: str
) -> None:
    gw = small_buffer
    async with live_on(gw, user, chat_id) as (ws, first, fence_chat):
        await unsubscribe(ws, chat_id)
        await publish(gw, chat_id, *(durable(i) for i in range(1, 6)))
        assert await fence(gw, ws, fence_chat, chat_id) == []
        await expect_overflow_replay(gw, ws, chat_id, fence_chat, first, last_seq=6)  # +1 live
        # A second unsubscribe starts a fresh, non-overflowed buffer.
        await unsubscribe(ws, chat_id)
        await publish(gw, chat_id, durable(8), ephemeral(8))
        assert await fence(gw, ws, fence_chat, chat_id) == []
        sub = await ws.subscribe(chat_id)
        assert sub["buffered"] == 2 and sub["overflowed"] is False and sub["seq"] == 8
        frames = [await ws.recv() for _ in range(2)]
        assert [(f["seq"], f["data"]["n"]) for f in frames] == [(8, 8), (None, 8)]


async def test_leave_stops_delivery_and_forgets_the_buffer(
    gateway: Any, user: str, chat_id: str
) -> None:
    async with live_on(gateway, user, chat_id) as (ws, first, fence_chat):
        await unsubscribe(ws, chat_id)
        await publish(gateway, chat_id, durable(1), ephemeral(1))  # buffered, then forgotten
        assert await fence(gateway, ws, fence_chat, chat_id) == []
        await ws.send({"type": "leave", "chat_id": chat_id, "id": "bye"})
        await ws.expect("left", chat_id=chat_id, id="bye")

        await publish(gateway, chat_id, durable(2), ephemeral(2))
        assert await fence(gateway, ws, fence_chat, chat_id) == []
        await pong(ws, chat_id)

        sub = await ws.subscribe(chat_id)
        assert sub.get("buffered", 0) == 0 and "overflowed" not in sub
        assert sub["recovered"] is True and sub["replayed"] == 0
        assert sub["epoch"] == first["epoch"] and sub["seq"] == 3
        await publish(gateway, chat_id, ephemeral(3), durable(3))
        live = [await ws.recv() for _ in range(2)]
        assert [(f["seq"], f["data"]["n"]) for f in live] == [(None, 3), (4, 3)]
        assert await fence(gateway, ws, fence_chat, chat_id) == []


async def test_leave_of_a_live_chat(gateway: Any, user: str, chat_id: str) -> None:
    async with live_on(gateway, user, chat_id) as (ws, _first, fence_chat):
        await ws.send({"type": "leave", "chat_id": chat_id})
        await ws.expect("left", chat_id=chat_id)
        await publish(gateway, chat_id, durable(1), ephemeral(1))
        assert await fence(gateway, ws, fence_chat, chat_id) == []
        # Leaving a chat one is not subscribed to is answered all the same.
        await ws.send({"type": "leave", "chat_id": chat_id, "id": 3})
        await ws.expect("left", chat_id=chat_id, id=3)
        sub = await ws.subscribe(chat_id)
        assert "buffered" not in sub and sub["seq"] == 2 and sub["replayed"] == 0
