"""Sub-conversations: a child opened over HTTP or by a turn, the parent's `child` event and
its list of children, who may open one, and a delete that takes the children with it."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

from gateway.config import Settings
from gateway.errors import Rejected
from gateway.redis.backend import Backend
from gateway.redis.store import Store
from gateway.sdk.agent import Turn

from .steps import children, create, history, open_child, publish, start_turn
from .wsclient import Client, Frame, connect

pytestmark = pytest.mark.anyio


@pytest.fixture
async def store(redis_url: str) -> AsyncIterator[Store]:
    """The store a worker uses (the SDK publishes straight to Redis)."""
    settings = Settings(redis_url=redis_url)
    client = aioredis.from_url(redis_url)
    try:
        yield Store(Backend.of(client, settings), settings)
    finally:
        await client.aclose()


NO_USAGE = {"billed": {}, "active": {}}


def new_id() -> str:
    return "c-" + uuid.uuid4().hex[:12]


async def get(gw: Any, user: str, chat_id: str, role: str = "user") -> httpx.Response:
    async with httpx.AsyncClient(base_url=gw.http) as http:
        return await http.get(f"/v1/conversations/{chat_id}", headers=gw.headers(user, role))


async def feed_frame(ws: Client, **fields: Any) -> Frame:
    """The next feed frame with ``fields``."""
    return await ws.wait_for(lambda f: f["type"] == "conversation"
                             and all(f.get(k) == v for k, v in fields.items()))


async def test_a_child_over_http_is_an_event_and_a_listed_child_of_its_parent(
        gateway: Any, user: str, chat_id: str) -> None:
    await create(gateway, user, chat_id, title="Trip")
    child = new_id()
    async with connect(gateway.url(user)) as ws:
        await ws.subscribe(chat_id)
        resp = await open_child(gateway, user, chat_id, child, title="  Book   hotels ")
        assert resp.status_code == 201, resp.text
        created = resp.json()
        assert (created["chat_id"], created["owner"], created["parent"], created["title"]) == (
            child, user, chat_id, "Book hotels")
        # Live, to the parent's subscriber: a durable, conversation-level event; and the
        # owner's feed announced the child, naming its parent (the two in either order).
        seen: dict[str, Frame] = {}
        while len(seen) < 2:
            frame = await ws.recv(ignore=frozenset())
            if frame["type"] == "child" or (frame["type"] == "conversation"
                                            and frame["chat_id"] == child and frame["created"]):
                seen[frame["type"]] = frame
        event, announced = seen["child"], seen["conversation"]
        assert event["type"] == "child" and "node" not in event and event["seq"] == 2
        assert event["data"] == {"chat_id": child, "title": "Book hotels"}
        assert announced["parent"] == chat_id
    # In the parent's log, on the active path too.
    for view in ("all", "active"):
        assert [e["type"] for e in await history(gateway, user, chat_id, view=view)] == [
            "title", "child"]
    assert await children(gateway, user, chat_id) == [
        {"chat_id": child, "title": "Book hotels", "status": "idle", "usage": NO_USAGE}]
    assert (await get(gateway, user, chat_id)).json()["parent"] is None
    assert (await get(gateway, user, child)).json()["parent"] == chat_id
    # And in the parent's snapshot (a child's own snapshot has none).
    async with connect(gateway.url(user)) as ws:
        snapshot = (await ws.subscribe(chat_id))["snapshot"]
        assert snapshot["children"] == [
            {"chat_id": child, "title": "Book hotels", "status": "idle", "usage": NO_USAGE}]
        assert "children" not in (await ws.subscribe(child))["snapshot"]
        # Subscribing again to a live chat: the snapshot still lists them.
        again = (await ws.subscribe(chat_id))["snapshot"]
        assert [c["chat_id"] for c in again["children"]] == [child]


async def test_children_are_listed_oldest_first_with_their_status(
        gateway: Any, user: str, chat_id: str) -> None:
    await create(gateway, user, chat_id)
    first, second = new_id(), new_id()
    for child in (first, second):
        assert (await open_child(gateway, user, chat_id, child)).status_code == 201
    async with connect(gateway.url(user)) as ws:
        for child in (first, second):
            await ws.send({"type": "message", "chat_id": child, "text": "go",
                           "client_msg_id": "m1"})
            await ws.expect("ack", chat_id=child)
    await publish(gateway, first, {"type": "turn_end", "data": {
        "usage": {"input_tokens": 12, "cost": 0.5}}})
    spent = {"input_tokens": 12, "cost": 0.5}
    assert await children(gateway, user, chat_id) == [
        {"chat_id": first, "title": None, "status": "idle",
         "usage": {"billed": spent, "active": spent}},
        {"chat_id": second, "title": None, "status": "running", "usage": NO_USAGE}]


async def test_who_may_open_a_child(gateway: Any, user: str, chat_id: str) -> None:
    await create(gateway, user, chat_id)
    # Another user: refused as for any conversation of someone else, and nothing is left.
    stranger = new_id()
    resp = await open_child(gateway, "mallory", chat_id, stranger)
    assert resp.status_code == 403 and resp.json()["error"]["code"] == "forbidden"
    assert (await get(gateway, "agent", stranger, "service")).status_code == 404
    # A service: the child is the parent owner's.
    by_service = new_id()
    resp = await open_child(gateway, "agent", chat_id, by_service, role="service")
    assert resp.status_code == 201, resp.text
    assert resp.json()["owner"] == user
    assert (await get(gateway, user, by_service)).status_code == 200
    # A parent that does not exist.
    missing = new_id()
    resp = await open_child(gateway, user, new_id(), missing)
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "not_found"
    assert (await get(gateway, "agent", missing, "service")).status_code == 404
    # An id that is taken; a parent id that is not a chat id.
    resp = await open_child(gateway, user, chat_id, by_service)
    assert resp.status_code == 409 and resp.json()["error"]["code"] == "conflict"
    resp = await open_child(gateway, user, "no spaces", new_id())
    assert resp.status_code == 422 and "parent_chat_id" in resp.json()["error"]["message"]
    # Agents cannot forge the event.
    async with httpx.AsyncClient(base_url=gateway.http) as http:
        resp = await http.post(f"/v1/conversations/{chat_id}/events",
                               json={"type": "child", "data": {"chat_id": "x"}},
                               headers=gateway.headers("agent", "service"))
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "reserved_type"
    assert [c["chat_id"] for c in await children(gateway, user, chat_id)] == [by_service]


async def test_a_turn_opens_a_child_once_even_when_redelivered(
        gateway: Any, store: Store, user: str, chat_id: str) -> None:
    await create(gateway, user, chat_id)
    async with connect(gateway.url(user)) as ws:
        await ws.subscribe(chat_id)
        fields = {"chat_id": chat_id, "turn_id": await start_turn(ws, chat_id)}
        await ws.wait_for(lambda f: f.get("type") == "head")
        turn = Turn(store, fields)
        child, second = await turn.open_child("Research"), await turn.open_child()
        assert child != second
        first_event, second_event = await ws.events(chat_id, 2)
        # Conversation-level while the turn runs: no node, on every branch's path.
        assert first_event["type"] == "child" and "node" not in first_event
        assert first_event["data"] == {"chat_id": child, "title": "Research"}
        assert second_event["data"] == {"chat_id": second, "title": None}
        # The same turn run again (its worker crashed): the same children, not new ones.
        again = Turn(store, fields)
        assert [await again.open_child("Research"), await again.open_child()] == [child, second]
    meta = await store.meta(child)
    assert meta is not None and meta.owner == user and meta.parent == chat_id
    assert [(e["type"], e["data"]["source"]) for e in await history(gateway, user, child)] == [
        ("title", "agent")]
    assert [e["type"] for e in await history(gateway, user, chat_id, view="active")] == [
        "user_message", "turn_start", "head", "child", "child"]
    assert [c["chat_id"] for c in await children(gateway, user, chat_id)] == [child, second]
    with pytest.raises(Rejected) as refused:
        await Turn(store, {"chat_id": new_id(), "turn_id": "t_x"}).open_child()
    assert refused.value.code == "not_found"


async def test_deleting_a_parent_deletes_its_children_and_tells_every_subscriber(
        gateway: Any, user: str, chat_id: str) -> None:
    await create(gateway, user, chat_id)
    child, grandchild, sibling = new_id(), new_id(), new_id()
    for parent, made in ((chat_id, child), (child, grandchild), (chat_id, sibling)):
        assert (await open_child(gateway, user, parent, made)).status_code == 201
    family = [chat_id, child, grandchild, sibling]
    async with (connect(gateway.url(user)) as feed, connect(gateway.url(user)) as on_parent,
                connect(gateway.url(user)) as on_children):
        await feed.send({"type": "ping", "id": 1})  # the feed is live after the reply
        await feed.expect("pong")
        await on_parent.subscribe(chat_id)
        for made in (child, grandchild, sibling):
            await on_children.subscribe(made)
        async with httpx.AsyncClient(base_url=gateway.http) as http:
            resp = await http.delete(f"/v1/conversations/{chat_id}",
                                     headers=gateway.headers(user))
        assert resp.status_code == 204
        await on_parent.expect("deleted", chat_id=chat_id)
        gone = {(await on_children.expect("deleted"))["chat_id"] for _ in range(3)}
        assert gone == {child, grandchild, sibling}
        told: list[str] = []
        while set(told) != set(family):  # the feed tells each deletion, children first
            told.append((await feed_frame(feed, deleted=True))["chat_id"])
        assert told[-1] == chat_id and told.index(grandchild) < told.index(child), told
    for made in family:
        assert (await get(gateway, user, made)).status_code == 404
    async with httpx.AsyncClient(base_url=gateway.http) as http:
        listed = (await http.get("/v1/conversations", params={"limit": 200},
                                 headers=gateway.headers(user))).json()
    assert not {c["chat_id"] for c in listed["conversations"]} & set(family)


async def test_a_child_deleted_on_its_own_leaves_its_parents_list(
        gateway: Any, user: str, chat_id: str) -> None:
    await create(gateway, user, chat_id)
    kept, dropped = new_id(), new_id()
    for made in (kept, dropped):
        assert (await open_child(gateway, user, chat_id, made)).status_code == 201
    async with httpx.AsyncClient(base_url=gateway.http) as http:
        assert (await http.delete(f"/v1/conversations/{dropped}",
                                  headers=gateway.headers(user))).status_code == 204
    assert [c["chat_id"] for c in await children(gateway, user, chat_id)] == [kept]
    assert (await get(gateway, user, chat_id)).status_code == 200
    # Opened again under the same id: a new child, told and listed again, with its title.
    assert (await open_child(gateway, user, chat_id, dropped, "Again")).status_code == 201
    assert [(c["chat_id"], c["title"]) for c in await children(gateway, user, chat_id)] == [
        (kept, None), (dropped, "Again")]
    assert [e["data"]["chat_id"] for e in await history(gateway, user, chat_id)] == [
        kept, dropped, dropped]


async def test_a_delete_racing_an_open_leaves_no_orphan(
        gateway: Any, store: Store, user: str) -> None:
    """Whichever of the two writes of an open the delete falls between, the child goes with
    its parent: the open either succeeded (and the delete took the child) or was refused."""
    outcomes: dict[str, int] = {}

    async def delete_once(parent: str, child: str, wait: int) -> str | None:
        """Delete ``parent`` at once (0), as soon as ``child`` exists (1) or has its title
        (2): between the open's writes, or about to be."""
        async with asyncio.timeout(5):
            while wait and ((meta := await store.meta(child)) is None
                            or (wait == 2 and meta.title is None)):
                pass
        return await store.delete(parent)

    for i in range(60):
        parent, child = new_id(), new_id()
        await create(gateway, user, parent)
        opened, deleted = await asyncio.gather(
            store.open_child(parent, child, "Race", writer=user),
            delete_once(parent, child, wait=i % 3), return_exceptions=True)
        assert deleted == user, deleted
        outcome = "opened" if opened is None else getattr(opened, "code", repr(opened))
        assert outcome in ("opened", "not_found"), opened
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
        assert await store.meta(child) is None and await store.meta(parent) is None
        assert await store.children(parent) == []
    print("open vs delete:", outcomes)


async def test_a_turn_completes_a_child_its_crashed_run_half_opened(
        gateway: Any, store: Store, user: str, chat_id: str) -> None:
    await create(gateway, user, chat_id)
    fields = {"chat_id": chat_id, "turn_id": "t_" + uuid.uuid4().hex[:16]}
    child = f"{fields['turn_id']}.c0"  # the id Turn.open_child gives its first child
    # The first run wrote the child, then crashed before its parent heard of it.
    await store.pipeline.evalsha(*store._child.call(child, user, chat_id, "e1", "default"))
    assert await store.children(chat_id) == []
    assert await Turn(store, fields).open_child("Again") == child
    assert [c for c, _ in await store.children(chat_id)] == [child]
    assert [e["data"] for e in await history(gateway, user, chat_id)] == [
        {"chat_id": child, "title": "Again"}]
