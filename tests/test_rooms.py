"""Multiplexing, live delivery, replay after reconnect, and recovery failures."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from .steps import publish
from .wsclient import connect

pytestmark = pytest.mark.anyio




async def test_several_chats_multiplex_on_one_socket(gateway: Any, user: str) -> None:
    chats = [f"{user}-a", f"{user}-b", f"{user}-c"]
    async with connect(gateway.url(user)) as ws:
        for chat in chats:
            sub = await ws.subscribe(chat)
            assert sub["seq"] == 0 and sub["recovered"] is True
        for i, chat in enumerate(chats):
            await publish(gateway, chat, {"type": "message", "data": {"n": i}})
        got = {}
        for _ in chats:
            frame = await ws.wait_for(lambda f: f["type"] == "message")
            got[frame["chat_id"]] = frame
        assert {c: f["data"]["n"] for c, f in got.items()} == {c: i for i, c in enumerate(chats)}
        assert all(f["seq"] == 1 for f in got.values())


async def test_reconnect_replays_exactly_what_was_missed_while_publishing(
    gateway: Any, user: str, chat_id: str
) -> None:
    stop = asyncio.Event()
    published: list[int] = []
    progress = asyncio.Condition()

    async def publisher() -> None:
        n = 0
        while not stop.is_set():
            n += 1
            result = await publish(gateway, chat_id, {"type": "delta2", "data": {"n": n}})
            async with progress:
                published.extend(result["seqs"])
                progress.notify_all()

    async def published_at_least(count: int) -> None:
        async with asyncio.timeout(10), progress:
            await progress.wait_for(lambda: len(published) >= count)

    async with connect(gateway.url(user)) as ws:
        sub = await ws.subscribe(chat_id)
        epoch = sub["epoch"]
        task = asyncio.create_task(publisher())
        first = await ws.events(chat_id, 5)
    seen = [f["seq"] for f in first]
    # Disconnected; the publisher keeps going.
    await published_at_least(seen[-1] + 20)
    async with connect(gateway.url(user)) as ws:
        sub = await ws.subscribe(chat_id, since={"seq": seen[-1], "epoch": epoch})
        assert sub["recovered"] is True and sub["epoch"] == epoch
        missed = sub["seq"] - seen[-1]
        assert sub["replayed"] == missed >= 20
        await published_at_least(sub["seq"] + 20)
        stop.set()
        await task
        total = published[-1]
        rest = await ws.events(chat_id, total - seen[-1])
    seqs = seen + [f["seq"] for f in rest]
    assert seqs == list(range(1, total + 1))  # gapless, ordered, no duplicate


async def test_recovery_fails_explicitly_on_changed_epoch(gateway: Any, user: str,
                                                          chat_id: str) -> None:
    async with connect(gateway.url(user)) as ws:
        sub = await ws.subscribe(chat_id)
        await publish(gateway, chat_id, {"type": "note", "data": {}})
        await ws.events(chat_id, 1)
    async with connect(gateway.url(user)) as ws:
        sub = await ws.subscribe(chat_id, since={"seq": 0, "epoch": "not-" + sub["epoch"]})
        assert sub["recovered"] is False and sub["replayed"] == 0
        await publish(gateway, chat_id, {"type": "note", "data": {"live": True}})
        frame = await ws.recv()
        assert frame["seq"] == 2 and frame["data"] == {"live": True}  # nothing replayed


async def test_recovery_fails_explicitly_on_trimmed_history(start_gateway: Any, user: str,
                                                            chat_id: str) -> None:
    gw = start_gateway(history_maxlen=5)
    async with connect(gw.url(user)) as ws:
        sub = await ws.subscribe(chat_id)
    # Approximate trimming needs a few hundred entries to bite.
    await publish(gw, chat_id, *({"type": "note", "data": {"i": i}} for i in range(300)))
    async with connect(gw.url(user)) as ws:
        sub = await ws.subscribe(chat_id, since={"seq": 0, "epoch": sub["epoch"]})
        assert sub["seq"] == 300
        assert sub["recovered"] is False and sub["replayed"] == 0
        await publish(gw, chat_id, {"type": "note", "data": {"live": True}})
        assert (await ws.recv())["seq"] == 301


async def test_replay_over_the_cap_is_not_recovered(start_gateway: Any, user: str,
                                                    chat_id: str) -> None:
    gw = start_gateway(replay_limit=3)
    async with connect(gw.url(user)) as ws:
        sub = await ws.subscribe(chat_id)
    await publish(gw, chat_id, *({"type": "note", "data": {}} for _ in range(4)))
    async with connect(gw.url(user)) as ws:
        again = await ws.subscribe(chat_id, since={"seq": 0, "epoch": sub["epoch"]})
        assert again["recovered"] is False and again["replayed"] == 0
        ok = await ws.subscribe(chat_id, since={"seq": 1, "epoch": sub["epoch"]})
        assert ok["recovered"] is True and ok["replayed"] == 3
        assert [f["seq"] for f in await ws.events(chat_id, 3)] == [2, 3, 4]


async def test_subscribe_with_create_false_creates_nothing(gateway: Any, user: str,
                                                           chat_id: str) -> None:
    """Opening a link to a conversation that does not exist must not write it."""
    async with connect(gateway.url(user)) as ws:
        await ws.send({"type": "subscribe", "chat_id": chat_id, "create": False, "id": "s1"})
        err = await ws.expect("error", code="not_found", id="s1", chat_id=chat_id)
        assert chat_id in err["message"]
        # With since as well (a stale link with a resume point).
        await ws.send({"type": "subscribe", "chat_id": chat_id, "create": False, "id": "s2",
                       "since": {"seq": 3, "epoch": "e"}})
        await ws.expect("error", code="not_found", id="s2")
        await ws.send({"type": "ping", "id": "p"})
        await ws.expect("pong", id="p")  # nothing for the refused chat came first
        await ws.send({"type": "subscribe", "chat_id": chat_id, "create": "no", "id": "s3"})
        bad = await ws.expect("error", code="invalid_frame", id="s3")
        assert "create" in bad["message"]
    async with httpx.AsyncClient(base_url=gateway.http) as http:
        mine = gateway.headers(user)
        assert (await http.get(f"/v1/conversations/{chat_id}", headers=mine)).status_code == 404
        listed = (await http.get("/v1/conversations", headers=mine)).json()["conversations"]
        assert chat_id not in [c["chat_id"] for c in listed]
    # An existing one subscribes as usual; the default still creates.
    async with connect(gateway.url(user)) as ws:
        created = await ws.subscribe(chat_id)
        assert created["seq"] == 0
        again = await ws.subscribe(chat_id + "x", create=True)
        assert again["seq"] == 0
    async with connect(gateway.url(user)) as ws:
        found = await ws.subscribe(chat_id, create=False)
        assert found["epoch"] == created["epoch"]
