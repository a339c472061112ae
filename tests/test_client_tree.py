"""Conversations as trees through the Python client SDK, against real gateway processes: the
tree operations and their acks, a second client following every head move live, two clients
racing, a resume across head moves, and a tree reloaded after ``recovered: false``."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from gateway.sdk.client import (
    ANY_HEAD,
    Ack,
    Event,
    GatewayClient,
    Recovery,
    RequestError,
    Siblings,
)

from .steps import create, publish
from .test_client import FAST, Watch, collect, take

pytestmark = pytest.mark.anyio


async def answer(gw: Any, chat_id: str, text: str) -> None:
    """The running turn answers ``text`` and ends, as an agent would."""
    await publish(gw, chat_id, {"type": "message", "data": {"text": text}},
                  {"type": "turn_end", "data": {"reason": "complete"}})


async def active_page(gw: Any, user: str, chat_id: str) -> dict[str, Any]:
    """``GET .../events``: the active path's events and its forks (one page holds them)."""
    async with httpx.AsyncClient(base_url=gw.http, headers=gw.headers(user)) as http:
        resp = await http.get(f"/v1/conversations/{chat_id}/events", params={"limit": 1000})
    assert resp.status_code == 200, resp.text
    page: dict[str, Any] = resp.json()
    assert page["next_after"] is None
    return page


def texts(frames: list[dict[str, Any]]) -> list[str]:
    return [f["data"]["text"] for f in frames if f["type"] in ("user_message", "message")]


def shown(client: GatewayClient, chat_id: str, items: list[Any]) -> list[str]:
    """What a client shows: the texts of the durable events it received that are on its
    active path."""
    tree = client.tree(chat_id)
    return texts([i.frame for i in items if isinstance(i, Event) and i.durable
                  and tree.visible(i.frame)])


class Device:
    """A client subscribed to one chat, its events consumed in the background."""

    def __init__(self, client: GatewayClient, chat_id: str) -> None:
        self.client = client
        self.chat_id = chat_id
        self.seen: Watch[Any]
        self.task: asyncio.Task[None]

    async def start(self) -> Device:
        await self.client.subscribe(self.chat_id)
        self.seen, self.task = collect(self.client.events(self.chat_id))
        return self

    async def at(self, head: str | None) -> None:
        """Wait until the client's head is ``head`` (a head known, not just None)."""
        tree = self.client.tree(self.chat_id)
        await self.seen.until(lambda _: tree.head_known and tree.head == head)

    @property
    def path(self) -> list[str]:
        return self.client.active_path(self.chat_id)


def client_of(gw: Any, user: str) -> GatewayClient:
    return GatewayClient(gw.ws, token_factory=lambda: gw.token(user), **FAST)


async def test_tree_operations_and_a_second_client_follows(gateway: Any, user: str,
                                                           chat_id: str) -> None:
    await create(gateway, user, chat_id)
    async with client_of(gateway, user) as a_client, client_of(gateway, user) as b_client:
        a = await Device(a_client, chat_id).start()
        b = await Device(b_client, chat_id).start()
        assert a_client.head(chat_id) is None and a_client.tree(chat_id).head_known
        devices = (a, b)

        async def everyone_at(head: str | None) -> None:
            for device in devices:
                await device.at(head)

        first = await a_client.send_message(chat_id, "plan a trip")
        m1, t1 = first.msg_id, first.turn_id
        assert isinstance(m1, str) and first.head == t1
        await answer(gateway, chat_id, "first answer")
        await everyone_at(t1)
        assert a.path == b.path == [m1, t1]

        # retry: a new answer beside t1; B follows.
        retried = await a_client.retry(chat_id)
        t2 = retried.turn_id
        assert t2 not in (None, t1) and retried.head == t2
        await everyone_at(t2)
        for device in devices:
            assert device.path == [m1, t2]
            assert device.client.siblings(chat_id, t2) == Siblings([t1, t2], 1)
        await answer(gateway, chat_id, "second answer")

        # edit, from B: a new version of m1 and its turn; A follows.
        edited = await b_client.edit(chat_id, m1, "plan a weekend")
        m2, t3 = edited.msg_id, edited.turn_id
        assert isinstance(m2, str) and edited.head == t3
        await everyone_at(t3)
        for device in devices:
            assert device.path == [m2, t3]
            assert device.client.siblings(chat_id, m2) == Siblings([m1, m2], 1)
        await answer(gateway, chat_id, "weekend answer")

        # undo: the text comes back, the head goes before the message (none: it was first).
        undone = await a_client.undo(chat_id)
        assert (undone.text, undone.msg_id, undone.head) == ("plan a weekend", m2, None)
        await everyone_at(None)
        assert a.path == b.path == []

        # switch: redo, then the other version of the first message.
        redone = await b_client.switch(chat_id, m2)
        assert redone.head == t3
        await everyone_at(t3)
        back = await a_client.switch(chat_id, m1)
        assert back.head == t2  # the leaf last active below m1
        await everyone_at(t2)
        assert a.path == b.path == [m1, t2]
        assert a_client.tree(chat_id).forks() == {
            m1: Siblings([m1, m2], 0), t2: Siblings([t1, t2], 1)}

        # What each client shows is what the gateway's active path holds.
        page = await active_page(gateway, user, chat_id)
        assert page["head"] == t2
        assert texts(page["events"]) == ["plan a trip", "second answer"]
        for device in devices:
            await device.seen.until(lambda items: len(items) >= page["last_seq"])
            assert shown(device.client, chat_id, device.seen.items) == texts(page["events"])
        assert {i.type for i in a.seen.items if isinstance(i, Event)} >= {"head", "turn_start"}


async def test_racing_clients_get_a_clean_conflict(gateway: Any, user: str,
                                                   chat_id: str) -> None:
    await create(gateway, user, chat_id)
    async with client_of(gateway, user) as a_client, client_of(gateway, user) as b_client:
        a = await Device(a_client, chat_id).start()
        b = await Device(b_client, chat_id).start()
        first = await a_client.send_message(chat_id, "hello")
        await answer(gateway, chat_id, "hi")
        await a.at(first.turn_id)
        await b.at(first.turn_id)

        # Both retry from the same head: exactly one wins.
        results = await asyncio.gather(a_client.retry(chat_id), b_client.retry(chat_id),
                                       return_exceptions=True)
        wins = [r for r in results if isinstance(r, Ack)]
        losses = [r for r in results if isinstance(r, RequestError)]
        assert len(wins) == 1 and len(losses) == 1, results
        won = wins[0].head
        assert losses[0].code == "conflict" and losses[0].has_head and losses[0].head == won
        await a.at(won)
        await b.at(won)

        # An explicit stale head is refused the same way.
        with pytest.raises(RequestError) as stale:
            await b_client.undo(chat_id, expected_head=first.turn_id)
        assert (stale.value.code, stale.value.head) == ("conflict", won)
        # The retried turn runs: refused, unless the operation cancels it first.
        with pytest.raises(RequestError) as busy:
            await b_client.undo(chat_id)
        assert (busy.value.code, busy.value.head) == ("turn_in_progress", won)
        undone = await b_client.undo(chat_id, cancel=True)
        assert (undone.head, undone.text) == (None, "hello")
        await a.at(None)
        ended = [i for i in a.seen.items if isinstance(i, Event) and i.type == "turn_end"]
        assert ended[-1].data["reason"] == "cancelled" and ended[-1].node == won

        # Nothing left to retry or undo: refused with the head (none).
        with pytest.raises(RequestError) as nothing:
            await a_client.retry(chat_id)
        assert (nothing.value.code, nothing.value.has_head, nothing.value.head) == (
            "nothing_to_retry", True, None)
        with pytest.raises(RequestError) as empty:
            await a_client.undo(chat_id, expected_head=ANY_HEAD)
        assert empty.value.code == "nothing_to_undo"


async def test_a_client_resumes_across_head_moves(start_gateway: Any, gateway: Any, user: str,
                                                  chat_id: str) -> None:
    gw = start_gateway()  # A's gateway, restarted; B works through the shared one meanwhile
    await create(gateway, user, chat_id)
    async with client_of(gw, user) as a_client, client_of(gateway, user) as b_client:
        a = await Device(a_client, chat_id).start()
        b = await Device(b_client, chat_id).start()
        first = await a_client.send_message(chat_id, "hello")
        m1, t1 = first.msg_id, first.turn_id
        await answer(gateway, chat_id, "one")
        await a.at(t1)
        await b.at(t1)

        await asyncio.to_thread(gw.stop)
        async with asyncio.timeout(10):
            await a_client.wait_disconnected()
        t2 = (await b_client.retry(chat_id)).turn_id
        await answer(gateway, chat_id, "two")
        await b.at(t2)
        t3 = (await b_client.retry(chat_id)).turn_id
        await answer(gateway, chat_id, "three")
        await b.at(t3)
        assert (await b_client.switch(chat_id, t2)).head == t2
        await b.at(t2)
        assert a_client.head(chat_id) == t1  # A heard none of it

        await asyncio.to_thread(gw.start)
        last = b_client.position(chat_id)[0]
        assert last is not None
        await a.seen.until(lambda _: a_client.position(chat_id)[0] == last, seconds=30)
        assert a_client.connections >= 2
        assert a_client.head(chat_id) == t2
        assert a.path == b.path == [m1, t2]
        assert a_client.siblings(chat_id, t2) == Siblings([t1, t2, t3], 1)
        # The replay brought every move, in order, and nothing was lost or repeated.
        assert not [i for i in a.seen.items if isinstance(i, Recovery)]
        moves = [i.data["cause"] for i in a.seen.items if isinstance(i, Event) and i.type == "head"]
        assert moves == ["message", "retry", "retry", "switch"]
        seqs = [i.seq for i in a.seen.items if isinstance(i, Event) and i.durable]
        assert seqs == list(range(1, last + 1))
        assert shown(a_client, chat_id, a.seen.items) == ["hello", "two"]


async def test_a_tree_from_a_history_page_and_after_recovery(gateway: Any, user: str,
                                                             chat_id: str) -> None:
    created = await create(gateway, user, chat_id)
    async with client_of(gateway, user) as a_client:
        a = await Device(a_client, chat_id).start()
        first = await a_client.send_message(chat_id, "hello")
        m1, t1 = first.msg_id, first.turn_id
        await answer(gateway, chat_id, "one")
        await a.at(t1)
        t2 = (await a_client.retry(chat_id)).turn_id
        await answer(gateway, chat_id, "two")
        await a.at(t2)
    page = await active_page(gateway, user, chat_id)
    assert page["forks"] == {t2: {"siblings": [t1, t2], "index": 1}}

    # A client that joins live knows the head, then only what happens from then on.
    async with client_of(gateway, user) as c_client:
        await c_client.subscribe(chat_id)
        tree = c_client.tree(chat_id)
        assert c_client.head(chat_id) == t2
        assert c_client.active_path(chat_id) == [t2] and tree.missing() == [t2]
        c_client.load_history(chat_id, {**page, "epoch": "another", "events": []})
        assert tree.nodes == {}, "a page of another epoch is ignored"
        c_client.load_history(chat_id, page)
        assert c_client.active_path(chat_id) == [m1, t2] and tree.missing() == []
        assert c_client.siblings(chat_id, t2) == Siblings([t1, t2], 1)
        assert not tree.nodes[t1].seen  # known from the page's forks only

        # recovered: false: the tree goes with the history, and a reloaded page fills it.
        events = c_client.events(chat_id)
        await c_client.subscribe(chat_id, seq=1, epoch="not-" + created["epoch"])
        [recovery] = await take(events, 1)
        assert isinstance(recovery, Recovery)
        assert c_client.active_path(chat_id) == [t2] and list(tree.nodes) == []
        c_client.load_history(chat_id, page)
        assert c_client.active_path(chat_id) == [m1, t2]
