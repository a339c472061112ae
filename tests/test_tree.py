"""Conversations as trees: retry, edit, undo and switch as branches on the log, one shared
head that every device follows, the active path and the tree read."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

from gateway.config import Settings
from gateway.redis.backend import Backend
from gateway.redis.store import Store
from gateway.sdk.agent import Turn

from .steps import (
    create,
    end_turn,
    exchange,
    history,
    message_and_reply,
    op,
    post_events,
    reply,
)
from .wsclient import Frame, connect

pytestmark = pytest.mark.anyio


async def active(gw: Any, user: str, chat_id: str, view: str = "active") -> Frame:
    async with httpx.AsyncClient(base_url=gw.http) as http:
        resp = await http.get(f"/v1/conversations/{chat_id}/events",
                              params={"view": view}, headers=gw.headers(user))
    assert resp.status_code == 200, resp.text
    page: Frame = resp.json()
    return page


def texts(events: list[Frame]) -> list[str]:
    """What the transcript shows: user and agent texts, in order."""
    return [e["data"]["text"] for e in events if e["type"] in ("user_message", "message")]


async def test_messages_chain_into_a_path_and_move_the_head(
        gateway: Any, user: str, chat_id: str) -> None:
    await create(gateway, user, chat_id)
    async with connect(gateway.url(user)) as ws:
        assert (await ws.subscribe(chat_id))["snapshot"]["head"] is None
        m1, t1 = await exchange(ws, gateway, chat_id, "one")
        ack, (user_message, turn_start, head) = await message_and_reply(ws, chat_id, "two")
        assert user_message["data"]["parent_id"] == t1
        assert turn_start["data"]["parent_id"] == ack["msg_id"]
        assert head["data"] == {"head_id": ack["turn_id"], "prev_head_id": t1,
                                "cause": "message", "by": user}
        async with connect(gateway.url(user)) as other:
            assert (await other.subscribe(chat_id))["snapshot"]["head"] == ack["turn_id"]
    async with httpx.AsyncClient(base_url=gateway.http) as http:
        got = (await http.get(f"/v1/conversations/{chat_id}",
                              headers=gateway.headers(user))).json()
    assert got["head"] == ack["turn_id"]
    assert m1 != ack["msg_id"]


async def test_retry_answers_the_same_message_beside_the_old_answer(
        gateway: Any, user: str, chat_id: str) -> None:
    await create(gateway, user, chat_id)
    async with connect(gateway.url(user)) as ws, connect(gateway.url(user)) as phone:
        await ws.subscribe(chat_id)
        await phone.subscribe(chat_id)
        m1, t1 = await exchange(ws, gateway, chat_id, "plan a day")
        ack, events = await op(ws, chat_id, "retry", id=7)
        assert ack["type"] == "ack" and ack["id"] == 7
        t2 = ack["turn_id"]
        assert ack["head"] == t2 and t2 != t1
        start, head = events
        assert start["data"]["parent_id"] == m1 and start["data"]["retry_of"] == t1
        assert head["data"] == {"head_id": t2, "prev_head_id": t1, "cause": "retry", "by": user}
        # The second device follows the pointer live.
        seen = await phone.wait_for(lambda f: f.get("type") == "head" and
                                    f["data"]["cause"] == "retry")
        assert seen["data"]["head_id"] == t2
        await post_events(gateway, chat_id, {"type": "message", "data": {"text": "take two"}})
        await end_turn(gateway, chat_id)
    page = await active(gateway, user, chat_id)
    assert texts(page["events"]) == ["plan a day", "take two"]
    assert page["forks"] == {t2: {"siblings": [t1, t2], "index": 1}}
    every = await active(gateway, user, chat_id, view="all")
    assert texts(every["events"]) == ["plan a day", "re: plan a day", "take two"]


async def test_edit_any_message_on_the_path_branches_there(
        gateway: Any, user: str, chat_id: str) -> None:
    await create(gateway, user, chat_id)
    async with connect(gateway.url(user)) as ws:
        await ws.subscribe(chat_id)
        m1, _ = await exchange(ws, gateway, chat_id, "first")
        await exchange(ws, gateway, chat_id, "second")
        ack, events = await op(ws, chat_id, "edit", msg_id=m1, text="first, better")
        assert ack["type"] == "ack", ack
        new_msg, new_turn = ack["msg_id"], ack["turn_id"]
        user_message, turn_start, head = events
        assert user_message["data"]["edit_of"] == m1
        assert user_message["data"]["parent_id"] is None  # m1's parent: the root
        assert turn_start["data"]["parent_id"] == new_msg
        assert head["data"]["cause"] == "edit" and head["data"]["head_id"] == new_turn
        await end_turn(gateway, chat_id)
    page = await active(gateway, user, chat_id)
    assert texts(page["events"]) == ["first, better"]
    assert page["forks"] == {new_msg: {"siblings": [m1, new_msg], "index": 1}}
    assert page["head"] == new_turn


async def test_undo_takes_the_last_exchange_back_and_switch_redoes_it(
        gateway: Any, user: str, chat_id: str) -> None:
    await create(gateway, user, chat_id)
    async with connect(gateway.url(user)) as ws:
        await ws.subscribe(chat_id)
        _, t1 = await exchange(ws, gateway, chat_id, "keep me")
        m2, t2 = await exchange(ws, gateway, chat_id, "take me back")
        ack, (head,) = await op(ws, chat_id, "undo")
        assert ack["head"] == t1 and ack["text"] == "take me back" and ack["msg_id"] == m2
        assert head["data"] == {"head_id": t1, "prev_head_id": t2, "cause": "undo", "by": user}
        assert texts((await active(gateway, user, chat_id))["events"]) == [
            "keep me", "re: keep me"]
        # Nothing was deleted: every event is still in the log.
        assert "take me back" in texts((await active(gateway, user, chat_id, "all"))["events"])
        # Redo: back to the leaf last active under the undone message.
        ack, (head,) = await op(ws, chat_id, "switch", node_id=m2)
        assert ack["head"] == t2 and head["data"]["cause"] == "switch"
        # Undo twice: the head before the first message is none.
        await op(ws, chat_id, "undo")
        ack, _ = await op(ws, chat_id, "undo")
        assert ack["head"] is None
        refused, _ = await op(ws, chat_id, "undo", id="u")
        assert (refused["type"], refused["code"], refused["id"]) == ("error",
                                                                      "nothing_to_undo", "u")


async def test_switch_returns_to_where_the_user_was_at_each_fork(
        gateway: Any, user: str, chat_id: str) -> None:
    """< 1/2 > and back: each fork remembers the leaf last active below it."""
    await create(gateway, user, chat_id)
    async with connect(gateway.url(user)) as ws:
        await ws.subscribe(chat_id)
        m1, _ = await exchange(ws, gateway, chat_id, "root question")
        _, deep = await exchange(ws, gateway, chat_id, "follow-up on branch A")
        ack, _ = await op(ws, chat_id, "edit", msg_id=m1, text="root question, take B")
        b_msg, b_turn = ack["msg_id"], ack["turn_id"]
        await end_turn(gateway, chat_id)
        ack, _ = await op(ws, chat_id, "switch", node_id=m1)
        assert ack["head"] == deep  # not m1's first turn: where the user left branch A
        page = await active(gateway, user, chat_id)
        assert texts(page["events"]) == ["root question", "re: root question",
                                         "follow-up on branch A", "re: follow-up on branch A"]
        assert page["forks"][m1] == {"siblings": [m1, b_msg], "index": 0}
        ack, _ = await op(ws, chat_id, "switch", node_id=b_msg)
        assert ack["head"] == b_turn
    async with httpx.AsyncClient(base_url=gateway.http) as http:
        tree = (await http.get(f"/v1/conversations/{chat_id}/tree",
                               headers=gateway.headers(user))).json()
    assert tree["head"] == b_turn and tree["roots"] == [m1, b_msg]
    assert {"node_id": None, "leaf": b_turn} in tree["forks"]
    kinds = {n["id"]: (n["kind"], n["parent_id"]) for n in tree["nodes"]}
    assert kinds[b_msg] == ("user", None) and kinds[b_turn] == ("turn", b_msg)
    assert kinds[deep][0] == "turn"
    assert [n["seq"] for n in tree["nodes"]] == sorted(n["seq"] for n in tree["nodes"])


async def test_expected_head_that_is_not_the_head_is_a_conflict_naming_it(
        gateway: Any, user: str, chat_id: str) -> None:
    await create(gateway, user, chat_id)
    async with connect(gateway.url(user)) as ws:
        await ws.subscribe(chat_id)
        _, t1 = await exchange(ws, gateway, chat_id, "hello")
        refused, events = await op(ws, chat_id, "undo", expected_head="t_other")
        assert (refused["code"], refused["head"], events) == ("conflict", t1, [])
        refused, _ = await op(ws, chat_id, "retry", expected_head=None)
        assert (refused["code"], refused["head"]) == ("conflict", t1)
        await ws.send({"type": "message", "chat_id": chat_id, "text": "x",
                       "client_msg_id": "c1", "expected_head": "t_stale"})
        refused, _ = await reply(ws, chat_id)
        assert (refused["code"], refused["head"]) == ("conflict", t1)
        ack, _ = await op(ws, chat_id, "undo", expected_head=t1)
        assert ack["type"] == "ack" and ack["head"] is None


async def test_two_devices_racing_get_exactly_one_winner_each_round(
        gateway: Any, user: str, chat_id: str) -> None:
    await create(gateway, user, chat_id)
    async with connect(gateway.url(user)) as a, connect(gateway.url(user)) as b:
        await a.subscribe(chat_id)
        await b.subscribe(chat_id)
        await exchange(a, gateway, chat_id, "base")
        _, t = await exchange(a, gateway, chat_id, "second")
        head = t
        for round_ in range(12):
            kind = ("undo", "switch")[round_ % 2]
            fields: dict[str, Any] = {"expected_head": head}
            if kind == "switch":
                fields["node_id"] = t
            (ra, _), (rb, _) = await asyncio.gather(op(a, chat_id, kind, **fields),
                                                    op(b, chat_id, kind, **fields))
            outcomes = sorted(r["type"] for r in (ra, rb))
            assert outcomes == ["ack", "error"], (round_, ra, rb)
            won = ra if ra["type"] == "ack" else rb
            lost = rb if won is ra else ra
            assert lost["code"] == "conflict" and lost["head"] == won["head"]
            head = won["head"]


async def test_a_running_turn_refuses_operations_unless_cancelled(
        gateway: Any, user: str, chat_id: str) -> None:
    await create(gateway, user, chat_id)
    async with connect(gateway.url(user)) as ws:
        await ws.subscribe(chat_id)
        m1, t1 = await exchange(ws, gateway, chat_id, "question")
        ack, _ = await op(ws, chat_id, "retry")
        running = ack["turn_id"]
        delta = {"type": "delta", "data": {"text": "half an ans"}, "durable": False,
                 "attempt": "w1"}
        assert (await post_events(gateway, chat_id, delta)).status_code == 200
        refused, _ = await op(ws, chat_id, "switch", node_id=t1)
        assert (refused["code"], refused["head"]) == ("turn_in_progress", running)
        ack, events = await op(ws, chat_id, "switch", node_id=t1, cancel=True)
        assert ack["head"] == t1
        partial, end, head = events
        assert partial["data"] == {"text": "half an ans", "stream_id": partial["data"][
            "stream_id"], "partial": True} and partial["node"] == running
        assert end["data"]["reason"] == "cancelled" and end["node"] == running
        assert head["data"]["cause"] == "switch"
        # The late agent is refused: the turn is over, and the head stays where it is.
        late = await post_events(gateway, chat_id, {"type": "turn_end", "data": {
            "turn_id": running}})
        assert late.status_code == 409
        path = await active(gateway, user, chat_id)
        assert path["head"] == t1
        assert texts(path["events"]) == ["question", "re: question"]
        assert [e["data"]["msg_id"] for e in path["events"]
                if e["type"] == "user_message"] == [m1]


async def test_a_publish_that_names_an_ended_turn_is_refused_never_filed_elsewhere(
        gateway: Any, user: str, chat_id: str) -> None:
    """Every publish of a turn names it (``turn_id``): once that turn has ended, each of
    its events is refused, whatever runs now, and the reply says which turn took them."""
    await create(gateway, user, chat_id)
    async with connect(gateway.url(user)) as ws:
        await ws.subscribe(chat_id)
        ack, _ = await message_and_reply(ws, chat_id, "question")
        old = ack["turn_id"]
        note = {"type": "note", "data": {"n": 1}}
        body = {"events": [note], "turn_id": old}
        async with httpx.AsyncClient(base_url=gateway.http) as http:
            async def post(body: dict[str, Any]) -> httpx.Response:
                return await http.post(f"/v1/conversations/{chat_id}/events", json=body,
                                       headers=gateway.headers("agent", "service"))

            ok = await post(body)
            assert ok.status_code == 200 and ok.json()["turn_id"] == old, ok.text
            edited, _ = await op(ws, chat_id, "retry", cancel=True)
            new = edited["turn_id"]
            late = [{"type": "message", "data": {"text": "late"}, "turn_id": old},
                    {"type": "delta", "data": {"text": "late"}, "durable": False,
                     "attempt": "a1", "turn_id": old},
                    {"events": [note, note], "turn_id": old},
                    {"type": "title", "data": {"title": "late"}, "turn_id": old}]
            for body in late:
                refused = await post(body)
                assert refused.status_code == 409, (body, refused.text)
                error = refused.json()["error"]
                assert error["code"] == "turn_mismatch" and old in error["message"], error
            # The running turn's own publishes go on; one that names no turn joins it.
            mine = await post({"type": "message", "data": {"text": "new"}, "turn_id": new})
            assert mine.status_code == 200 and mine.json()["turn_id"] == new, mine.text
            anon = await post({"type": "note", "data": {}})
            assert anon.json()["turn_id"] == new
            await end_turn(gateway, chat_id, turn_id=new)
            after = await post({"type": "message", "data": {"text": "later"}, "turn_id": new})
            assert after.json()["error"]["code"] == "no_active_turn", after.text
            title = await post({"type": "title", "data": {"title": "Named"}})
            assert title.status_code == 200 and title.json()["turn_id"] is None
    stored = await history(gateway, user, chat_id)
    assert [e["data"].get("text") for e in stored if e["type"] == "message"] == ["new"]
    assert [e["node"] for e in stored if e["type"] == "note"] == [old, new]


async def test_unknown_or_foreign_nodes_are_refused_clearly(
        gateway: Any, user: str, chat_id: str) -> None:
    await create(gateway, user, chat_id)
    other = chat_id + "-other"
    await create(gateway, user, other)
    async with connect(gateway.url(user)) as ws:
        await ws.subscribe(chat_id)
        await ws.subscribe(other)
        refused, _ = await op(ws, chat_id, "retry")
        assert refused["code"] == "nothing_to_retry"
        foreign, _ = await exchange(ws, gateway, other, "elsewhere")
        mine, t1 = await exchange(ws, gateway, chat_id, "here")
        for kind, fields in (("edit", {"msg_id": foreign, "text": "x"}),
                             ("switch", {"node_id": foreign}),
                             ("switch", {"node_id": "m_nope"}),
                             ("edit", {"msg_id": t1, "text": "a turn is not a message"})):
            refused, _ = await op(ws, chat_id, kind, **fields)
            assert refused["type"] == "error" and refused["code"] == "not_found", refused
        await op(ws, chat_id, "undo")
        refused, _ = await op(ws, chat_id, "edit", msg_id=mine, text="off the path")
        assert refused["code"] == "not_on_path"
        bad, _ = await op(ws, chat_id, "switch", node_id="bad id!")
        assert bad["code"] == "invalid_frame"


async def test_every_operation_over_http_replies_with_the_same_ack(
        gateway: Any, user: str, chat_id: str) -> None:
    await create(gateway, user, chat_id)
    base = f"/v1/conversations/{chat_id}"
    async with connect(gateway.url(user)) as ws, \
            httpx.AsyncClient(base_url=gateway.http, headers=gateway.headers(user)) as http:
        await ws.subscribe(chat_id)
        m1, t1 = await exchange(ws, gateway, chat_id, "over http")
        retried = await http.post(f"{base}/retry", json={"expected_head": t1})
        assert retried.status_code == 200, retried.text
        t2 = retried.json()["head"]
        await end_turn(gateway, chat_id)
        edited = await http.post(f"{base}/edit", json={"msg_id": m1, "text": "edited"})
        assert edited.status_code == 200 and edited.json()["msg_id"] != m1
        await end_turn(gateway, chat_id)
        undone = await http.post(f"{base}/undo")
        assert (undone.status_code, undone.json()["text"]) == (200, "edited")
        switched = await http.post(f"{base}/switch", json={"node_id": m1})
        assert (switched.status_code, switched.json()["head"]) == (200, t2)
        conflict = await http.post(f"{base}/undo", json={"expected_head": "t_x"})
        assert conflict.status_code == 409
        assert conflict.json()["error"] == {"code": "conflict", "head": t2,
                                            "message": conflict.json()["error"]["message"]}
        missing = await http.post(f"{base}/switch", json={})
        assert missing.status_code == 422
        other = await http.post(f"{base}/undo", headers=gateway.headers(user + "x"))
        assert other.status_code == 403


async def test_resuming_with_since_replays_every_head_move_in_order(
        start_gateway: Any, user: str, chat_id: str) -> None:
    """Two gateway processes: a device on each; one drops, the other moves the head."""
    first, second = start_gateway(turn_timeout=600), start_gateway(turn_timeout=600)
    await create(first, user, chat_id)
    async with connect(first.url(user)) as ws:
        await ws.subscribe(chat_id)
        _, t1 = await exchange(ws, first, chat_id, "a")
        _, t2 = await exchange(ws, first, chat_id, "b")
        async with connect(second.url(user)) as phone:
            mark = await phone.subscribe(chat_id)
        await op(ws, chat_id, "undo")
        await op(ws, chat_id, "switch", node_id=t2)
        await op(ws, chat_id, "undo")
    async with connect(second.url(user)) as phone:
        resumed = await phone.subscribe(chat_id, since=mark)
        assert resumed["recovered"] is True
        moves = [f["data"]["head_id"] for f in await phone.events(chat_id, resumed["replayed"])
                 if f["type"] == "head"]
        assert moves == [t1, t2, t1] and resumed["snapshot"]["head"] == t1


async def test_the_feed_carries_the_head(gateway: Any, user: str, chat_id: str) -> None:
    await create(gateway, user, chat_id)
    async with connect(gateway.url(user)) as ws, connect(gateway.url(user)) as sidebar:
        await ws.subscribe(chat_id)
        _, t1 = await exchange(ws, gateway, chat_id, "hi")
        await sidebar.wait_for(lambda f: f.get("type") == "conversation" and
                               f.get("head") == t1 and f["status"] == "idle")
        await op(ws, chat_id, "undo")
        feed = await sidebar.wait_for(lambda f: f.get("type") == "conversation")
        assert feed["chat_id"] == chat_id and feed["head"] is None, feed


async def test_history_of_an_old_conversation_without_a_tree_is_all_of_it(
        gateway: Any, user: str, chat_id: str) -> None:
    """Events stored before the tree existed carry no node: the active path keeps them."""
    await create(gateway, user, chat_id)
    for i in range(3):
        assert (await post_events(gateway, chat_id, {"type": "note", "data": {"i": i}})
                ).status_code == 200
    assert [e["data"]["i"] for e in await history(gateway, user, chat_id)] == [0, 1, 2]


async def test_an_agent_turn_sees_its_path_retry_and_edit_included(
        gateway: Any, redis_url: str, user: str, chat_id: str) -> None:
    settings = Settings(redis_url=redis_url)
    client = aioredis.from_url(redis_url)
    store = Store(Backend.of(client, settings), settings)

    async def context(turn_id: str, **budget: int) -> list[dict[str, Any]]:
        return await Turn(store, {"chat_id": chat_id, "turn_id": turn_id}).history(**budget)

    try:
        await create(gateway, user, chat_id)
        async with connect(gateway.url(user)) as ws:
            await ws.subscribe(chat_id)
            m1, t1 = await exchange(ws, gateway, chat_id, "first")
            ack, _ = await message_and_reply(ws, chat_id, "second")
            m2, t2 = ack["msg_id"], ack["turn_id"]
            await post_events(gateway, chat_id, {"type": "message", "data": {"text": "half"}})
            await end_turn(gateway, chat_id, reason="cancelled")
            ack, _ = await op(ws, chat_id, "retry")
            t3 = ack["turn_id"]
            path = await context(t2)
            assert await context(t3) == path  # the same messages, the same ids
            answer = path[1]["id"]  # "e" + the seq of its message event
            assert answer.startswith("e") and answer[1:].isdigit(), path
            assert path == [
                {"role": "user", "content": "first", "msg_id": m1, "id": m1},
                {"role": "assistant", "content": "re: first", "id": answer},
                {"role": "user", "content": "second", "msg_id": m2, "id": m2}]
            await end_turn(gateway, chat_id)
            ack, _ = await op(ws, chat_id, "edit", msg_id=m1, text="first, edited")
            assert await context(ack["turn_id"]) == [
                {"role": "user", "content": "first, edited", "msg_id": ack["msg_id"],
                 "id": ack["msg_id"]}]
            await end_turn(gateway, chat_id)
            for i in range(8):  # a long conversation on the edited branch
                await exchange(ws, gateway, chat_id, f"q{i}")
            ack, _ = await message_and_reply(ws, chat_id, "last")
            everything = await context(ack["turn_id"])
            # The edited message (its turn ended unanswered), 8 exchanges, the last message.
            assert len(everything) == 1 + 16 + 1 and everything[-1]["content"] == "last"
            recent = await context(ack["turn_id"], max_messages=4)
            assert [m["content"] for m in recent] == ["q7", "re: q7", "last"]  # from a user
            small = await context(ack["turn_id"], max_tokens=8)
            assert [m["content"] for m in small] == ["last"]
            assert t1
    finally:
        await client.aclose()
