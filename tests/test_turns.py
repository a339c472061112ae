"""Messages, turns, goals, titles and the conversation feed, end to end."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from .steps import create, history, message_and_reply, post_events, publish, reply
from .wsclient import Client, Frame, connect

pytestmark = pytest.mark.anyio

NOTHING = frozenset[str]()
GOAL = {"active": True, "objective": "Plan a week in Lisbon", "ui_summary": "Planning Lisbon"}


@pytest.fixture(scope="module")
def quick_turns(start_gateway: Any) -> Any:
    return start_gateway(turn_timeout=0.5)


def http(gw: Any, user: str | None = None, role: str = "user") -> httpx.AsyncClient:
    headers = gw.headers(user, role) if user else {}
    return httpx.AsyncClient(base_url=gw.http, headers=headers)


async def conversation(gw: Any, user: str, chat_id: str) -> dict[str, Any]:
    async with http(gw, user) as client:
        resp = await client.get(f"/v1/conversations/{chat_id}")
    assert resp.status_code == 200, resp.text
    result: dict[str, Any] = resp.json()
    return result


async def cancel(ws: Client, chat_id: str, count: int = 0,
                 **request: Any) -> tuple[Frame, list[Frame]]:
    """Send a ``cancel``; return its ack (or error) and the next ``count`` event frames."""
    await ws.send({"type": "cancel", "chat_id": chat_id, **request})
    return await reply(ws, chat_id, count)


async def feed(ws: Client, chat_id: str, **fields: Any) -> Frame:
    """The next conversation-feed frame of ``chat_id`` that has ``fields``."""
    def match(frame: Frame) -> bool:
        return (frame["type"] == "conversation" and frame["chat_id"] == chat_id
                and all(frame.get(k) == v for k, v in fields.items()))
    return await ws.wait_for(match)


async def pong(ws: Client) -> None:
    await ws.send({"type": "ping", "id": "still-there"})
    await ws.expect("pong", id="still-there")


# --- messages and turns -----------------------------------------------------------------


async def test_message_is_acked_and_starts_a_turn(gateway: Any, user: str, chat_id: str) -> None:
    await create(gateway, user, chat_id)
    async with connect(gateway.url(user)) as ws, connect(gateway.url(user)) as other:
        sub = await ws.subscribe(chat_id)
        assert sub["snapshot"]["status"] == "idle" and sub["seq"] == 0
        ack, events = await message_and_reply(ws, chat_id, "Plan a trip", "m-1", id=11,
                                         data={"attachments": []})
        assert ack == {"type": "ack", "chat_id": chat_id, "seq": 1, "client_msg_id": "m-1",
                       "turn_id": ack["turn_id"], "duplicate": False, "id": 11,
                       "head": ack["turn_id"], "msg_id": ack["msg_id"]}
        turn_id, msg_id = ack["turn_id"], ack["msg_id"]
        assert isinstance(turn_id, str) and turn_id and isinstance(msg_id, str) and msg_id
        user_message, turn_start, head = events
        assert (user_message["type"], user_message["seq"]) == ("user_message", 1)
        assert user_message["data"] == {"text": "Plan a trip", "client_msg_id": "m-1",
                                        "user_id": user, "data": {"attachments": []},
                                        "msg_id": msg_id, "parent_id": None}
        assert user_message["node"] == msg_id
        assert (turn_start["type"], turn_start["seq"]) == ("turn_start", 2)
        assert turn_start["data"]["turn_id"] == turn_id and turn_start["node"] == turn_id
        assert turn_start["data"]["started_at"] == turn_start["ts"]
        assert turn_start["data"]["parent_id"] == msg_id
        assert (head["type"], head["seq"], "node" in head) == ("head", 3, False)
        assert head["data"] == {"head_id": turn_id, "prev_head_id": None, "cause": "message",
                                "by": user}

        # Another connection of the same user, not subscribed, sees it in its feed.
        item = await feed(other, chat_id, status="running")
        assert item["preview"] == "Plan a trip" and item["last_seq"] == 3
        assert item["created"] is False and item["deleted"] is False
        assert item["head"] == turn_id

        state = await conversation(gateway, user, chat_id)
        assert state["status"] == "running" and state["turn_id"] == turn_id
        assert state["preview"] == "Plan a trip" and state["last_seq"] == 3


async def test_message_to_an_unknown_chat_creates_it(gateway: Any, user: str,
                                                     chat_id: str) -> None:
    async with connect(gateway.url(user)) as ws, connect(gateway.url(user)) as other:
        ack, _ = await message_and_reply(ws, chat_id, "hello", "first", count=0)
        assert ack["type"] == "ack" and ack["seq"] == 1 and ack["duplicate"] is False
        created = await feed(other, chat_id, created=True)
        assert created["status"] == "running" and created["preview"] == "hello"
    state = await conversation(gateway, user, chat_id)
    assert state["owner"] == user and state["status"] == "running"


async def test_retried_message_is_a_duplicate_even_after_reconnecting(
    gateway: Any, user: str, chat_id: str
) -> None:
    await create(gateway, user, chat_id)
    async with connect(gateway.url(user)) as ws:
        await ws.subscribe(chat_id)
        first, _ = await message_and_reply(ws, chat_id, "once", "m-retry")
        again, _ = await message_and_reply(ws, chat_id, "once", "m-retry", count=0)
        assert again == {**first, "duplicate": True}
        await pong(ws)  # and no event frame came with the duplicate
    async with connect(gateway.url(user)) as ws:  # as after a reconnect
        again, _ = await message_and_reply(ws, chat_id, "once, retried", "m-retry", count=0, id="r")
        assert again == {**first, "duplicate": True, "id": "r"}
    stored = await history(gateway, user, chat_id)
    assert [(e["type"], e["seq"]) for e in stored] == [("user_message", 1), ("turn_start", 2),
                                                       ("head", 3)]
    assert stored[0]["data"]["text"] == "once"

    # Still a duplicate once the turn is over: it must not start another turn.
    assert (await post_events(gateway, chat_id, {"type": "turn_end", "data": {}})).is_success
    async with connect(gateway.url(user)) as ws:
        again, _ = await message_and_reply(ws, chat_id, "once", "m-retry", count=0)
        assert again == {**first, "duplicate": True}
    assert len(await history(gateway, user, chat_id)) == 4
    assert (await conversation(gateway, user, chat_id))["status"] == "idle"


async def test_same_client_msg_id_from_another_user_is_not_a_duplicate(
    gateway: Any, user: str, chat_id: str
) -> None:
    async with connect(gateway.url(user)) as ws:
        mine, _ = await message_and_reply(ws, chat_id, "mine", "shared-id", count=0)
    async with connect(gateway.url(user + "x")) as ws:
        theirs, _ = await message_and_reply(ws, chat_id + "x", "theirs", "shared-id", count=0)
    assert mine["duplicate"] is False and theirs["duplicate"] is False
    assert mine["turn_id"] != theirs["turn_id"]


async def test_message_while_a_turn_runs_is_refused(gateway: Any, user: str,
                                                    chat_id: str) -> None:
    await create(gateway, user, chat_id)
    async with connect(gateway.url(user)) as ws:
        await ws.subscribe(chat_id)
        first, _ = await message_and_reply(ws, chat_id, "first", "m-a")
        error, _ = await message_and_reply(ws, chat_id, "second", "m-b", count=0, id=5)
        assert error["type"] == "error" and error["code"] == "turn_in_progress"
        assert error["id"] == 5 and error["chat_id"] == chat_id
        assert first["turn_id"] in error["message"]
        await pong(ws)  # the connection stays usable
        assert len(await history(gateway, user, chat_id)) == 3

        # The refused attempt was not remembered: once the turn ends, the same id goes in.
        assert (await post_events(gateway, chat_id, {"type": "turn_end", "data": {}})).is_success
        (end,) = await ws.events(chat_id, 1)
        assert end["type"] == "turn_end" and end["data"]["turn_id"] == first["turn_id"]
        second, events = await message_and_reply(ws, chat_id, "second", "m-b")
        assert second["duplicate"] is False and second["seq"] == 5
        assert second["turn_id"] != first["turn_id"]
        assert [e["seq"] for e in events] == [5, 6, 7]


async def test_text_over_the_limit_is_refused(gateway: Any, user: str, chat_id: str) -> None:
    limit = 32 * 1024
    async with connect(gateway.url(user)) as ws:
        assert ws.hello["limits"]["max_text_bytes"] == limit
        error, _ = await message_and_reply(ws, chat_id, "é" * (limit // 2 + 1), "big", count=0)
        assert error["code"] == "text_too_long"
        await pong(ws)


async def test_goal_and_turn_end_reach_subscribers_feed_and_new_subscribers(
    gateway: Any, user: str, chat_id: str
) -> None:
    await create(gateway, user, chat_id, title="Trip plan")
    async with connect(gateway.url(user)) as ws, connect(gateway.url(user)) as other:
        await ws.subscribe(chat_id)
        ack, (_, turn_start, _) = await message_and_reply(ws, chat_id, "Plan Lisbon", "m-goal")
        turn_id = ack["turn_id"]

        # A subscriber arriving mid-turn is hydrated with the running turn.
        async with connect(gateway.url(user)) as late:
            snap = (await late.subscribe(chat_id))["snapshot"]
            presence = snap.pop("presence")  # the three connections of the user, at most
            assert [u["user_id"] for u in presence["users"]] == [user]
            assert snap == {"title": "Trip plan", "status": "running", "turn_id": turn_id,
                            "started_at": turn_start["data"]["started_at"], "goal_state": None,
                            "streams": [], "head": turn_id,
                            "usage": {"billed": {}, "active": {}}, "message_count": 2,
                            "agent": "default"}

        resp = await post_events(gateway, chat_id, {"type": "goal_state", "data": GOAL})
        assert resp.status_code == 200, resp.text
        (goal,) = await ws.events(chat_id, 1)
        assert goal["type"] == "goal_state" and goal["seq"] == 5 and "node" not in goal
        assert {k: goal["data"][k] for k in GOAL} == GOAL
        assert goal["data"]["status"] == "active" and goal["data"]["recap"] is None
        assert isinstance(goal["data"]["updated_at"], int)
        item = await feed(other, chat_id, last_seq=5)
        assert item["goal_state"] == goal["data"] and item["status"] == "running"

        resp = await post_events(gateway, chat_id,
                                   {"type": "turn_end", "data": {"reason": "complete"}})
        assert resp.status_code == 200, resp.text
        (end,) = await ws.events(chat_id, 1)
        assert end["type"] == "turn_end" and end["seq"] == 6 and end["node"] == turn_id
        data = end["data"]
        assert data["turn_id"] == turn_id and data["reason"] == "complete"
        assert isinstance(data["latency_ms"], int) and data["latency_ms"] >= 0
        assert data["latency_ms"] == end["ts"] - turn_start["data"]["started_at"]
        assert data["goal_state"] == goal["data"]
        item = await feed(other, chat_id, status="idle")
        assert item["last_seq"] == 6 and item["goal_state"] == goal["data"]
        assert item["title"] == "Trip plan" and item["preview"] == "Plan Lisbon"

    expected = {"title": "Trip plan", "status": "idle", "turn_id": None, "started_at": None,
                "goal_state": goal["data"], "streams": [], "head": turn_id,
                "usage": {"billed": {}, "active": {}}, "message_count": 2, "agent": "default"}
    for binary in (False, True):  # MessagePack too
        async with connect(gateway.url(user), binary=binary) as fresh:
            sub = await fresh.subscribe(chat_id)
            snapshot = sub["snapshot"]
            assert [u["user_id"] for u in snapshot.pop("presence")["users"]] == [user]
            assert sub["seq"] == 6 and snapshot == expected
    state = await conversation(gateway, user, chat_id)
    assert state["status"] == "idle" and state["goal_state"] == goal["data"]


async def test_turn_end_with_a_stale_turn_id_is_refused(gateway: Any, user: str,
                                                        chat_id: str) -> None:
    async with connect(gateway.url(user)) as ws:
        await ws.subscribe(chat_id)
        ack, _ = await message_and_reply(ws, chat_id, "go", "m-1")
        resp = await post_events(gateway, chat_id,
                                   {"type": "turn_end", "data": {"turn_id": "t_stale"}})
        assert resp.status_code == 409 and resp.json()["error"]["code"] == "turn_mismatch"
        resp = await post_events(gateway, chat_id, {"type": "turn_end",
                                                      "data": {"turn_id": ack["turn_id"]}})
        assert resp.status_code == 200, resp.text
        resp = await post_events(gateway, chat_id, {"type": "turn_end", "data": {}})
        assert resp.status_code == 409 and resp.json()["error"]["code"] == "no_active_turn"
        (end,) = await ws.events(chat_id, 1)
        assert end["seq"] == 4 and end["data"]["turn_id"] == ack["turn_id"]


async def test_silent_turn_times_out(quick_turns: Any, user: str, chat_id: str) -> None:
    gw = quick_turns
    async with connect(gw.url(user)) as ws, connect(gw.url(user)) as other:
        await ws.subscribe(chat_id)
        ack, (_, start, _) = await message_and_reply(ws, chat_id, "anyone there?", "m-1")
        (end,) = await ws.events(chat_id, 1)
        assert end["type"] == "turn_end" and end["seq"] == 4
        assert end["data"]["reason"] == "timeout" and end["data"]["turn_id"] == ack["turn_id"]
        assert end["data"]["latency_ms"] >= 400
        assert end["data"]["latency_ms"] == end["ts"] - start["data"]["started_at"]
        await feed(other, chat_id, status="idle", last_seq=4)
        # The conversation is idle again: a new message starts a new turn.
        again, _ = await message_and_reply(ws, chat_id, "hello?", "m-2")
        assert again["type"] == "ack" and again["seq"] == 5


async def test_timeout_ends_only_the_turn_it_was_set_for(quick_turns: Any, user: str,
                                                         chat_id: str) -> None:
    gw = quick_turns
    async with connect(gw.url(user)) as ws:
        await ws.subscribe(chat_id)
        await message_and_reply(ws, chat_id, "one", "m-1")
        assert (await post_events(gw, chat_id, {"type": "turn_end", "data": {}})).is_success
        (end,) = await ws.events(chat_id, 1)
        assert end["data"]["reason"] == "complete"
        # The first turn's deadline passes while the second turn runs: only the second
        # turn's own deadline may end it.
        second, _ = await message_and_reply(ws, chat_id, "two", "m-2")
        (end,) = await ws.events(chat_id, 1)
        assert end["type"] == "turn_end" and end["seq"] == 8, end
        assert end["data"]["turn_id"] == second["turn_id"]
        assert end["data"]["reason"] == "timeout"
        assert end["data"]["latency_ms"] >= 400


async def test_cancel_during_a_turn(gateway: Any, user: str, chat_id: str) -> None:
    await create(gateway, user, chat_id)
    async with connect(gateway.url(user)) as ws:
        await ws.subscribe(chat_id)
        ack, _ = await message_and_reply(ws, chat_id, "long task", "m-1")
        turn_id = ack["turn_id"]
        cancel_ack, (event,) = await cancel(ws, chat_id, 1, id="c1")
        assert cancel_ack["type"] == "ack" and cancel_ack["id"] == "c1"
        assert cancel_ack["seq"] == 4 and cancel_ack["duplicate"] is False
        assert event["type"] == "cancel_requested" and event["seq"] == 4
        assert event["data"] == {"turn_id": turn_id}
        # Cancelling is a request to the agent: the turn still runs until it ends it.
        assert (await conversation(gateway, user, chat_id))["status"] == "running"
        wrong, _ = await cancel(ws, chat_id, turn_id="t_other")
        assert wrong["type"] == "error" and wrong["code"] == "turn_mismatch"

        resp = await post_events(gateway, chat_id,
                                   {"type": "turn_end", "data": {"reason": "cancelled"}})
        assert resp.status_code == 200, resp.text
        (end,) = await ws.events(chat_id, 1)
        assert end["data"]["reason"] == "cancelled" and end["data"]["turn_id"] == turn_id

        late, _ = await cancel(ws, chat_id, turn_id=turn_id, id=2)
        assert late["type"] == "error" and late["code"] == "no_active_turn"
        assert late["id"] == 2 and late["chat_id"] == chat_id
        await pong(ws)
    stored = await history(gateway, user, chat_id)
    assert [e["type"] for e in stored] == ["user_message", "turn_start", "head",
                                           "cancel_requested", "turn_end"]


async def test_cancel_with_no_turn_and_on_someone_elses_chat(gateway: Any, user: str,
                                                             chat_id: str) -> None:
    await create(gateway, user, chat_id)
    async with connect(gateway.url(user)) as ws:
        error, _ = await cancel(ws, chat_id)
        assert error["type"] == "error" and error["code"] == "no_active_turn"
        await message_and_reply(ws, chat_id, "go", "m-1", count=0)
    async with connect(gateway.url(user + "z")) as intruder:
        error, _ = await cancel(intruder, chat_id)
        assert error["type"] == "error" and error["code"] == "forbidden"
        await pong(intruder)
    assert [e["type"] for e in await history(gateway, user, chat_id)] == [
        "user_message", "turn_start", "head"]


# --- titles -----------------------------------------------------------------------------


async def test_rename_reaches_the_room_and_the_feed(gateway: Any, user: str,
                                                    chat_id: str) -> None:
    await create(gateway, user, chat_id, title="Old name")
    async with connect(gateway.url(user)) as ws, connect(gateway.url(user)) as other:
        await ws.subscribe(chat_id)
        async with http(gateway, user) as client:
            resp = await client.patch(f"/v1/conversations/{chat_id}",
                                      json={"title": "  New \t name "})
        assert resp.status_code == 200, resp.text
        assert resp.json()["title"] == "New name" and resp.json()["last_seq"] == 2
        (event,) = await ws.events(chat_id, 1)
        assert event["type"] == "title" and event["seq"] == 2
        assert event["data"] == {"title": "New name", "previous": "Old name", "source": "user"}
        item = await feed(other, chat_id, title="New name")  # `other` never subscribed
        assert item["last_seq"] == 2 and item["status"] == "idle"

        resp = await post_events(gateway, chat_id,
                                   {"type": "title", "data": {"title": "By the agent"}})
        assert resp.status_code == 200, resp.text
        (event,) = await ws.events(chat_id, 1)
        assert event["data"] == {"title": "By the agent", "previous": "New name",
                                 "source": "agent"}
        await feed(other, chat_id, title="By the agent")
    async with connect(gateway.url(user)) as fresh:
        assert (await fresh.subscribe(chat_id))["snapshot"]["title"] == "By the agent"


async def test_first_title_has_no_previous(gateway: Any, user: str, chat_id: str) -> None:
    await create(gateway, user, chat_id)
    async with connect(gateway.url(user)) as ws:
        await ws.subscribe(chat_id)
        async with http(gateway, user) as client:
            resp = await client.patch(f"/v1/conversations/{chat_id}", json={"title": "x" * 200})
        assert resp.status_code == 200, resp.text
        (event,) = await ws.events(chat_id, 1)
        assert event["data"] == {"title": "x" * 200, "previous": None, "source": "user"}


@pytest.mark.parametrize("title", ["", "   ", "\t\n", "x" * 201, " " + "y" * 201 + " "])
async def test_invalid_titles_are_refused(gateway: Any, user: str, chat_id: str,
                                          title: str) -> None:
    await create(gateway, user, chat_id, title="Kept")
    async with http(gateway, user) as client:
        resp = await client.patch(f"/v1/conversations/{chat_id}", json={"title": title})
    assert resp.status_code == 422, resp.text  # the body breaks the schema's title rule
    assert resp.headers["content-type"].startswith("application/json")
    error = resp.json()["error"]
    assert error["code"] == "unprocessable" and "title" in error["message"]
    state = await conversation(gateway, user, chat_id)
    assert state["title"] == "Kept" and state["last_seq"] == 1


async def test_rename_needs_the_owner_and_an_existing_chat(gateway: Any, user: str,
                                                           chat_id: str) -> None:
    await create(gateway, user, chat_id, title="Mine")
    async with http(gateway, user + "other") as client:
        resp = await client.patch(f"/v1/conversations/{chat_id}", json={"title": "Theirs"})
        assert resp.status_code == 403 and resp.json()["error"]["code"] == "forbidden"
        resp = await client.patch(f"/v1/conversations/{chat_id}-nope", json={"title": "x"})
        assert resp.status_code == 404 and resp.json()["error"]["code"] == "not_found"
    async with http(gateway, user) as client:
        resp = await client.patch(f"/v1/conversations/{chat_id}", json={"title": 5})
        assert resp.status_code == 422 and "title" in resp.json()["error"]["message"]
        resp = await client.patch(f"/v1/conversations/{chat_id}", json={})
        assert resp.status_code == 422 and "title" in resp.json()["error"]["message"]
    async with http(gateway, "admin", "service") as client:  # a service may rename any chat
        resp = await client.patch(f"/v1/conversations/{chat_id}", json={"title": "Ops"})
        assert resp.status_code == 200 and resp.json()["title"] == "Ops"
    assert (await conversation(gateway, user, chat_id))["last_seq"] == 2


# --- what agents may publish ------------------------------------------------------------


@pytest.mark.parametrize("kind", ["user_message", "turn_start", "cancel_requested",
                                  "deleted", "conversation", "subscribed", "ack", "error"])
async def test_reserved_types_cannot_be_published(gateway: Any, user: str, chat_id: str,
                                                  kind: str) -> None:
    await create(gateway, user, chat_id)
    resp = await post_events(gateway, chat_id, {"type": "note", "data": {}},
                               {"type": kind, "data": {"text": "forged"}})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["code"] == "reserved_type" and kind in error["message"]
    assert await history(gateway, user, chat_id) == []  # the valid event was not written either


@pytest.mark.parametrize(("data", "field"), [
    ({"objective": "no active flag"}, "active"),
    ({"active": "yes"}, "active"),
    ({"active": True, "ui_summary": "s" * 121}, "ui_summary"),
    ({"active": True, "objective": 42}, "objective"),
    ({"active": True, "status": "s" * 65}, "status"),
])
async def test_invalid_goal_state_is_refused(gateway: Any, user: str, chat_id: str,
                                             data: dict[str, Any], field: str) -> None:
    await create(gateway, user, chat_id)
    resp = await post_events(gateway, chat_id, {"type": "goal_state", "data": data})
    assert resp.status_code in (400, 422), resp.text
    assert field in resp.json()["error"]["message"]
    state = await conversation(gateway, user, chat_id)
    assert state["goal_state"] is None and state["last_seq"] == 0


async def test_invalid_turn_end_and_title_events_are_refused(gateway: Any, user: str,
                                                             chat_id: str) -> None:
    await create(gateway, user, chat_id)
    async with connect(gateway.url(user)) as ws:
        await message_and_reply(ws, chat_id, "go", "m-1", count=0)
    resp = await post_events(gateway, chat_id, {"type": "turn_end",
                                                  "data": {"reason": "bored"}})
    assert resp.status_code in (400, 422) and "reason" in resp.json()["error"]["message"]
    resp = await post_events(gateway, chat_id, {"type": "title", "data": {"title": "  "}})
    assert resp.status_code == 400 and "title" in resp.json()["error"]["message"]
    resp = await post_events(gateway, chat_id, {"type": "title", "data": {}})
    assert resp.status_code in (400, 422) and "title" in resp.json()["error"]["message"]
    state = await conversation(gateway, user, chat_id)
    assert state["status"] == "running" and state["last_seq"] == 3


async def test_publishing_needs_a_service_token(gateway: Any, user: str, chat_id: str) -> None:
    await create(gateway, user, chat_id)
    async with http(gateway, user) as client:
        resp = await client.post(f"/v1/conversations/{chat_id}/events",
                                 json={"type": "goal_state", "data": GOAL})
    assert resp.status_code == 403 and resp.json()["error"]["code"] == "forbidden"
    assert (await conversation(gateway, user, chat_id))["goal_state"] is None


# --- the conversation list --------------------------------------------------------------


async def list_all(gw: Any, user: str, limit: int) -> list[list[dict[str, Any]]]:
    """Every page of the user's conversation list, following ``next_cursor``."""
    pages: list[list[dict[str, Any]]] = []
    cursor = None
    async with http(gw, user) as client:
        while True:
            params: dict[str, Any] = {"limit": limit}
            if cursor is not None:
                params["cursor"] = cursor
            resp = await client.get("/v1/conversations", params=params)
            assert resp.status_code == 200, resp.text
            body = resp.json()
            pages.append(body["conversations"])
            cursor = body["next_cursor"]
            if cursor is None:
                return pages
            assert len(pages) < 50, "pagination does not end"


async def later_than(ws: Client, ts: int) -> None:
    """Return once the server clock is past ``ts`` (ms), so the next change sorts after."""
    while True:
        await ws.send({"type": "ping"})
        if (await ws.expect("pong"))["ts"] > ts:
            return


async def test_list_is_newest_first_with_previews_and_pages(gateway: Any, user: str) -> None:
    chats = [f"{user}-{i}" for i in range(4)]
    long_text = "word  " * 60  # 360 chars, whitespace collapsed in the preview
    async with connect(gateway.url(user)) as ws:
        last_ts = 0
        for i, chat in enumerate(chats):
            await later_than(ws, last_ts)
            await ws.subscribe(chat)
            text = long_text if i == 1 else f"message {i}"
            _, (_, start, _) = await message_and_reply(ws, chat, text, f"m-{i}")
            last_ts = start["ts"]
        # Chat 0 gets a second message: it becomes the newest, with the new preview.
        await later_than(ws, last_ts)
        await publish(gateway, chats[0], {"type": "turn_end", "data": {}})
        (end,) = await ws.events(chats[0], 1)
        await later_than(ws, end["ts"])
        await message_and_reply(ws, chats[0], "  second   message ", "m-0b")
    async with connect(gateway.url(user + "x")) as ws:  # someone else's chat: not listed
        await message_and_reply(ws, user + "-x", "not mine", "m-x", count=0)

    (everything,) = await list_all(gateway, user, limit=50)
    assert [c["chat_id"] for c in everything] == [chats[0], chats[3], chats[2], chats[1]]
    previews = {c["chat_id"]: c["preview"] for c in everything}
    assert previews[chats[0]] == "second message"
    assert previews[chats[1]] == ("word " * 24)[:120] and len(previews[chats[1]]) == 120
    assert previews[chats[2]] == "message 2"
    assert all(c["owner"] == user and c["status"] == "running" for c in everything)

    pages = await list_all(gateway, user, limit=1)
    assert all(len(p) <= 1 for p in pages)
    assert [c["chat_id"] for p in pages for c in p] == [c["chat_id"] for c in everything]
    pages = await list_all(gateway, user, limit=3)
    assert [[c["chat_id"] for c in p] for p in pages if p] == [
        [chats[0], chats[3], chats[2]], [chats[1]]]


async def test_pages_skip_and_repeat_nothing(gateway: Any, user: str) -> None:
    """Conversations changed in the same millisecond, or changed by events that do not
    reorder the list, must still come out exactly once."""
    chats = [f"{user}-{i:02}" for i in range(12)]
    async with http(gateway, user) as client:
        created = await asyncio.gather(*(
            client.post("/v1/conversations", json={"chat_id": chat}) for chat in chats))
    assert all(resp.status_code == 201 for resp in created)
    # Plain events change updated_at without moving a chat in the list.
    for chat in chats[::3]:
        await publish(gateway, chat, {"type": "note", "data": {}})
    (everything,) = await list_all(gateway, user, limit=200)
    assert sorted(c["chat_id"] for c in everything) == chats
    for limit in (1, 2, 5):
        pages = await list_all(gateway, user, limit=limit)
        listed = [c["chat_id"] for p in pages for c in p]
        assert listed == [c["chat_id"] for c in everything], limit
