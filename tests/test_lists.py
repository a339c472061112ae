"""``GET /v1/conversations``: its filters, and its cursor while conversations change.

The walk's promise (protocol.md, "Listing conversations"): a conversation that does not
change during a walk is listed exactly once if it fits the filter; one that changes is
listed at most once, and a list with ``updated_after`` from before the walk (or the feed)
has it. Checked in lockstep (changes between pages, above and below the cursor), with a
writer on another gateway changing conversations while a reader walks, and with ties: many
conversations changed in the same millisecond.
"""

from __future__ import annotations

import asyncio
import random
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

from gateway.config import Settings
from gateway.redis.backend import Backend
from gateway.redis.keys import index_key
from gateway.redis.listing import ListFilter, Place
from gateway.redis.store import Store

from .conftest import GatewayProcess
from .steps import create, open_child, start_turn
from .wsclient import connect

pytestmark = pytest.mark.anyio


async def listing(gw: GatewayProcess, user: str, **query: Any) -> httpx.Response:
    async with httpx.AsyncClient(base_url=gw.http) as http:
        return await http.get("/v1/conversations", params=query, headers=gw.headers(user))


async def walk(gw: GatewayProcess, user: str, between: Any = None,
               **query: Any) -> tuple[list[str], int]:
    """Every page of the list, in order: the chat ids and how many pages it took.
    ``between(seen)`` runs after each page but the last."""
    seen: list[str] = []
    pages, cursor = 0, None
    while True:
        params = dict(query, **({"cursor": cursor} if cursor is not None else {}))
        resp = await listing(gw, user, **params)
        assert resp.status_code == 200, resp.text
        page = resp.json()
        pages += 1
        seen += [c["chat_id"] for c in page["conversations"]]
        cursor = page["next_cursor"]
        if cursor is None:
            return seen, pages
        if between is not None:
            await between(seen)


async def rename(gw: GatewayProcess, user: str, chat: str, title: str) -> None:
    async with httpx.AsyncClient(base_url=gw.http) as http:
        resp = await http.patch(f"/v1/conversations/{chat}", json={"title": title},
                                headers=gw.headers(user))
    assert resp.status_code == 200, resp.text


async def server_ms(redis_url: str) -> int:
    client = aioredis.from_url(redis_url)
    try:
        seconds, micros = await client.time()
    finally:
        await client.aclose()
    return int(seconds) * 1000 + int(micros) // 1000


def check_walk(seen: list[str], wanted: set[str], touched: set[str]) -> None:
    """The promise: nothing twice; everything wanted and untouched exactly once."""
    repeated = [c for c, n in Counter(seen).items() if n > 1]
    assert not repeated, f"listed twice: {repeated}"
    missing = (wanted - touched) - set(seen)
    assert not missing, f"unchanged but skipped: {sorted(missing)}"
    assert set(seen) <= wanted, f"not wanted: {sorted(set(seen) - wanted)}"


async def test_each_filter(gateway: GatewayProcess, user: str) -> None:
    chats = {name: f"{name}-{uuid.uuid4().hex[:8]}" for name in ("a", "b", "c", "kid")}
    await create(gateway, user, chats["a"], "Trip to Lisbon")
    # Its `child` event moves a's updated_at, not its place in the list (not a list change).
    resp = await open_child(gateway, user, chats["a"], chats["kid"], "lisbon sub-task")
    assert resp.status_code == 201, resp.text
    await create(gateway, user, chats["b"], "groceries")
    await create(gateway, user, chats["c"], "LISBON hotels")
    async with connect(gateway.url(user)) as ws:
        await ws.subscribe(chats["b"])
        await start_turn(ws, chats["b"])

    async def ids(**query: Any) -> list[str]:
        seen, _ = await walk(gateway, user, **query)
        return seen

    a, b, c, kid = chats["a"], chats["b"], chats["c"], chats["kid"]
    assert await ids() == [b, c, a]  # b's turn moved it up; the child is left out
    assert await ids(include_children="true") == [b, c, kid, a]
    assert await ids(status="running") == [b]
    assert await ids(status="idle") == [c, a]
    assert await ids(q="lisBON") == [c, a]
    assert await ids(q="lisbon", include_children="true") == [c, kid, a]
    assert await ids(q="nowhere") == []
    # c's and b's last change is their list time (created and named; the turn began), a's is
    # its child's opening: later than its list time, yet before c was created.
    rows = (await listing(gateway, user, include_children="true")).json()["conversations"]
    at = {row["chat_id"]: row["updated_at"] for row in rows}
    assert await ids(updated_after=at[c] - 1) == [x for x in (b, c, a) if at[x] >= at[c]]
    assert await ids(updated_before=at[c]) == [x for x in (b, c, a) if at[x] < at[c]]
    assert await ids(updated_after=at[c] - 1, q="lisbon", status="idle") == [c]
    assert await ids(updated_after=at[c], updated_before=at[c]) == []
    running = (await listing(gateway, user, status="running")).json()["conversations"]
    assert running[0]["status"] == "running" and running[0]["title"] == "groceries"


@pytest.mark.parametrize(("query", "named"), [
    ({"status": "done"}, "status"),
    ({"q": ""}, "q"),
    ({"q": "x" * 201}, "q"),
    ({"updated_after": "yesterday"}, "updated_after"),
    ({"updated_before": "-1"}, "updated_before"),
    ({"include_children": "maybe"}, "include_children"),
    ({"cursor": "next"}, "cursor"),
    ({"cursor": "12:a/b"}, "cursor"),
    ({"limit": "0"}, "limit"),
])
async def test_bad_values_are_named(gateway: GatewayProcess, user: str,
                                    query: dict[str, str], named: str) -> None:
    resp = await listing(gateway, user, **query)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["code"] == "invalid_request" and f"`$.{named}`" in error["message"], error


async def test_changes_between_pages(gateway: GatewayProcess, user: str,
                                     redis_url: str) -> None:
    """Between pages, a conversation already listed and one not yet reached change: the
    first is not listed again, the second moves past the walk and is not listed, every other
    is listed once; a list from before the walk's start has both."""
    chats = [f"w{n:02d}-{uuid.uuid4().hex[:6]}" for n in range(30)]
    for n, chat in enumerate(chats):
        await create(gateway, user, chat, f"{'odd' if n % 2 else 'even'} {n}")
    for query in ({}, {"q": "ODD"}):
        wanted = set(chats) if not query else set(chats[1::2])
        started = await server_ms(redis_url)
        touched: set[str] = set()

        async def change(seen: list[str], touched: set[str] = touched) -> None:
            ahead = [c for c in chats if c not in seen and c not in touched]
            for chat in (seen[0], ahead[0]):  # the newest listed, the oldest not reached
                touched.add(chat)
                title = "odd again" if chat in chats[1::2] else "even again"
                await rename(gateway, user, chat, title)

        seen, pages = await walk(gateway, user, change, limit=4, **query)
        assert pages > 3
        check_walk(seen, wanted, touched)
        assert touched - set(seen), "a conversation ahead of the walk should have moved past it"
        since, _ = await walk(gateway, user, updated_after=started - 1, **query)
        assert (touched & wanted) <= set(since)
        assert wanted <= set(seen) | set(since)


async def test_a_writer_on_another_gateway(start_gateway: Any, gateway: GatewayProcess,
                                           user: str, redis_url: str) -> None:
    """A writer renames conversations through one gateway while a reader walks through
    another, unpaced: the promise holds, plain and filtered."""
    other: GatewayProcess = start_gateway(turn_timeout=600)
    chats = [f"r{n:02d}-{uuid.uuid4().hex[:6]}" for n in range(40)]
    await asyncio.gather(*(create(gateway, user, chat, f"topic {n % 3}")
                           for n, chat in enumerate(chats)))
    rng = random.Random(7)
    for query, wanted in (({}, set(chats)),
                          ({"q": "TOPIC 1"}, {c for n, c in enumerate(chats) if n % 3 == 1})):
        touched: set[str] = set()
        done = asyncio.Event()

        async def writer(done: asyncio.Event = done, touched: set[str] = touched) -> None:
            while not done.is_set():
                chat = rng.choice(chats)
                touched.add(chat)
                n = chats.index(chat)
                await rename(other, user, chat, f"topic {n % 3}")

        task = asyncio.create_task(writer())
        try:
            seen, pages = await walk(gateway, user, limit=3, **query)
        finally:
            done.set()
            await task
        assert pages > 3 and len(touched) > 3
        check_walk(seen, wanted, touched)


async def test_scan_bound(start_gateway: Any, user: str) -> None:
    """A request reads at most GATEWAY_LIST_SCAN entries: a filter that fits none of them
    returns an empty page and a cursor, and the walk goes on to the end."""
    bounded: GatewayProcess = start_gateway(turn_timeout=600, list_scan=10)
    chats = [f"s{n:02d}-{uuid.uuid4().hex[:6]}" for n in range(25)]
    for n, chat in enumerate(chats):
        await create(bounded, user, chat, "needle" if n == 0 else f"hay {n}")
    first = (await listing(bounded, user, q="needle")).json()
    assert first["conversations"] == [] and first["next_cursor"] is not None
    seen, pages = await walk(bounded, user, q="needle")
    assert seen == [chats[0]] and pages == 3
    seen, pages = await walk(bounded, user, limit=50)
    assert seen == chats[::-1] and pages == 3


@pytest.fixture
async def store(redis_url: str) -> AsyncIterator[Store]:
    client = aioredis.from_url(redis_url)
    settings = Settings(redis_url=redis_url, list_scan=1000)
    try:
        yield Store(Backend.of(client, settings), settings)
    finally:
        await client.aclose()


async def test_ties_in_one_millisecond(store: Store, user: str) -> None:
    """Conversations changed in the same millisecond: pages split them anywhere and the
    cursor resumes between them, also when its own conversation moved or is gone."""
    chats = [f"t{n:02d}" for n in range(12)]
    for chat in chats:
        await store.publish(f"{user}-{chat}", [], create_owner=user, writer=user)
    ids = [f"{user}-{c}" for c in chats]
    await store.redis.zadd(index_key(user), {chat: 1000 + (n // 5) for n, chat in
                                             enumerate(ids)})
    order = sorted(ids, key=lambda c: (1000 + ids.index(c) // 5, c), reverse=True)

    async def collect(move: Any = None) -> list[str]:
        seen: list[str] = []
        cursor: Place | None = None
        while True:
            rows, cursor = await store.conversations(user, cursor, 3, ListFilter())
            seen += [chat for chat, _ in rows]
            if cursor is None:
                return seen
            if move is not None:
                await move(cursor)

    assert await collect() == order

    async def bump(cursor: Place) -> None:  # the cursor's own conversation changes
        await store.redis.zadd(index_key(user), {cursor.chat_id: 5000}, gt=True)

    assert await collect(bump) == order
    await store.redis.zadd(index_key(user), {chat: 1000 + (n // 5) for n, chat in
                                             enumerate(ids)})

    async def drop(cursor: Place) -> None:  # ... or is deleted
        await store.delete(cursor.chat_id)

    assert await collect(drop) == order


async def test_the_preview_is_the_latest_thing_said_on_the_path(
        gateway: GatewayProcess, user: str, chat_id: str) -> None:
    """The list shows what was said last on the path the person sees: the question while
    it waits, then its answer (a stopped one's partial too), and after a retry, a switch
    or an undo whatever is last on the new path."""
    from .steps import end_turn, message_and_reply, op, post_events

    async def preview() -> str | None:
        found = (await listing(gateway, user)).json()["conversations"]
        value: str | None = next(c["preview"] for c in found if c["chat_id"] == chat_id)
        return value

    await create(gateway, user, chat_id)
    long_answer = "Lisbon  in\n spring " + "é" * 200
    async with connect(gateway.url(user)) as ws:
        await ws.subscribe(chat_id)
        ack, _ = await message_and_reply(ws, chat_id, "plan a   day")
        first = ack["turn_id"]
        assert await preview() == "plan a day"
        await post_events(gateway, chat_id, {"type": "message", "data": {"text": long_answer},
                                             "turn_id": first})
        feed = await ws.wait_for(lambda f: f.get("type") == "conversation"
                                 and f["chat_id"] == chat_id and f["preview"] != "plan a day")
        expected = ("Lisbon in spring " + "é" * 200)[:120]
        assert feed["preview"] == expected and await preview() == expected
        await end_turn(gateway, chat_id, turn_id=first)
        await ws.wait_for(lambda f: f.get("type") == "turn_end")
        # A retry asks again: the question is the latest; a stopped answer is what was said.
        ack, _ = await op(ws, chat_id, "retry")
        assert await preview() == "plan a day"
        await post_events(gateway, chat_id, {"type": "delta", "data": {"text": "half"},
                                             "durable": False, "attempt": "a",
                                             "turn_id": ack["turn_id"]})
        await ws.send({"type": "cancel", "chat_id": chat_id})
        await end_turn(gateway, chat_id, turn_id=ack["turn_id"], reason="cancelled")
        await ws.wait_for(lambda f: f.get("type") == "turn_end")
        assert await preview() == "half"
        await op(ws, chat_id, "switch", node_id=first)
        assert await preview() == expected
        second, _ = await message_and_reply(ws, chat_id, "and tomorrow?")
        assert await preview() == "and tomorrow?"
        await end_turn(gateway, chat_id, turn_id=second["turn_id"])
        await ws.wait_for(lambda f: f.get("type") == "turn_end"
                          and f["data"]["turn_id"] == second["turn_id"])
        await op(ws, chat_id, "undo")
        assert await preview() == expected
