"""Shared conversations: members and viewers, every role against every operation over
WebSocket, HTTP and Server-Sent Events, their lists and feeds, and removal.

Against a real gateway process and a real Redis-compatible server.
"""

from __future__ import annotations

import uuid
from typing import Any

import httpx
import msgspec
import pytest

from .steps import create, publish
from .test_sse import open_stream, stream_path
from .wsclient import Client, Frame, connect

pytestmark = pytest.mark.anyio

ROLES = ("owner", "member", "viewer", "stranger")


def people(user: str) -> dict[str, str]:
    """A user id per role (the owner is ``user``)."""
    return {role: user if role == "owner" else f"{user}-{role}" for role in ROLES}


async def share(gw: Any, owner: str, chat_id: str, body: dict[str, Any],
                by: str | None = None) -> httpx.Response:
    async with httpx.AsyncClient(base_url=gw.http) as http:
        return await http.patch(f"/v1/conversations/{chat_id}/members", json=body,
                                headers=gw.headers(by or owner))


async def shared(gw: Any, chat_id: str, who: dict[str, str]) -> None:
    """``chat_id`` created by the owner, shared with a member and a viewer."""
    await create(gw, who["owner"], chat_id)
    resp = await share(gw, who["owner"], chat_id,
                       {"set": {who["member"]: "member", who["viewer"]: "viewer"}})
    assert resp.status_code == 200, resp.text
    assert resp.json() == {"chat_id": chat_id, "owner": who["owner"], "removed": [],
                           "members": {who["member"]: "member", who["viewer"]: "viewer"}}


async def answer(ws: Client, frame: Frame) -> Frame:
    """Send ``frame`` (with a fresh request id) and return its reply: its ack, its error."""
    rid = uuid.uuid4().hex
    await ws.send({**frame, "id": rid})
    return await ws.wait_for(lambda f: f.get("id") == rid
                             and f["type"] not in ("members",))


# What each role may do: read (owner, member, viewer), write (owner, member), own (owner).
MAY = {"read": {"owner", "member", "viewer"}, "write": {"owner", "member"},
       "own": {"owner"}}


def check(role: str, kind: str, refused: bool, what: str) -> None:
    assert refused == (role not in MAY[kind]), f"{role} {what}: refused={refused}"


async def test_every_role_against_every_websocket_operation(gateway: Any, user: str,
                                                            chat_id: str) -> None:
    who = people(user)
    await shared(gateway, chat_id, who)
    for role, uid in who.items():
        async with connect(gateway.url(uid)) as ws:
            sub = await answer(ws, {"type": "subscribe", "chat_id": chat_id, "create": False})
            check(role, "read", sub["type"] == "error" and sub["code"] == "forbidden",
                  "subscribe")
            # Each write, made to go through whatever the conversation's state: a message
            # cancels the turn the last one started; the tree operations too.
            writes: list[Frame] = [
                {"type": "message", "chat_id": chat_id, "text": f"from {role}",
                 "client_msg_id": uuid.uuid4().hex, "cancel": True},
                {"type": "cancel", "chat_id": chat_id},
                {"type": "retry", "chat_id": chat_id, "cancel": True},
                {"type": "undo", "chat_id": chat_id, "cancel": True},
                {"type": "switch", "chat_id": chat_id, "node_id": "n_none", "cancel": True},
                {"type": "edit", "chat_id": chat_id, "msg_id": "m_none", "text": "x",
                 "cancel": True},
                {"type": "tool_result", "chat_id": chat_id, "call_id": "call_none",
                 "result": {"ok": True}},
            ]
            for frame in writes:
                got = await answer(ws, frame)
                refused = got["type"] == "error" and got["code"] == "forbidden"
                check(role, "write", refused, frame["type"])
                if refused and role == "viewer":
                    assert "viewer" in got["message"], got
    # The history holds the messages of the owner and the member only, each with its author.
    async with httpx.AsyncClient(base_url=gateway.http) as http:
        page = (await http.get(f"/v1/conversations/{chat_id}/events",
                               params={"view": "all"}, headers=gateway.headers(user))).json()
    authors = [e["data"]["user_id"] for e in page["events"] if e["type"] == "user_message"]
    assert authors == [who["owner"], who["member"]]


async def test_every_role_against_every_http_operation(gateway: Any, user: str,
                                                       chat_id: str) -> None:
    who = people(user)
    await shared(gateway, chat_id, who)
    base = f"/v1/conversations/{chat_id}"
    reads = ["", "/events", "/tree", "/presence", "/children"]
    writes: list[tuple[str, dict[str, Any]]] = [
        ("/retry", {"cancel": True}), ("/undo", {"cancel": True}),
        ("/switch", {"node_id": "n_none", "cancel": True}),
        ("/edit", {"msg_id": "m_none", "text": "x", "cancel": True}),
        ("/tool-results", {"call_id": "call_none", "result": {"ok": True}}),
    ]
    async with httpx.AsyncClient(base_url=gateway.http) as http:
        for role, uid in who.items():
            h = gateway.headers(uid)
            for path in reads:
                resp = await http.get(base + path, headers=h)
                check(role, "read", resp.status_code == 403, f"GET {path}")
                assert resp.status_code in (200, 403), resp.text
            head = await http.head(stream_path(chat_id), headers=h)
            check(role, "read", head.status_code == 403, "HEAD stream")
            listed = (await http.get("/v1/conversations", headers=h)).json()["conversations"]
            mine = [c for c in listed if c["chat_id"] == chat_id]
            assert bool(mine) == (role != "stranger"), (role, listed)
            if mine:
                assert mine[0]["owner"] == who["owner"]
                assert mine[0]["members"].items() >= {who["member"]: "member",
                                                      who["viewer"]: "viewer"}.items()
            for path, body in writes:
                resp = await http.post(base + path, json=body, headers=h)
                check(role, "write", resp.status_code == 403, f"POST {path}")
            owned: list[tuple[str, str, dict[str, Any]]] = [
                ("PATCH", base, {"title": f"by {role}"}),
                ("PATCH", base, {"client_tools": []}),
                ("PATCH", base + "/members", {"set": {f"{user}-extra": "viewer"}}),
                ("POST", "/v1/conversations", {"parent_chat_id": chat_id}),
            ]
            for method, path, change in owned:
                resp = await http.request(method, path, json=change, headers=h)
                check(role, "own", resp.status_code == 403, f"{method} {path} {change}")
                assert resp.status_code < 300 or resp.status_code == 403, resp.text
            if role != "owner":
                resp = await http.delete(base, headers=h)
                assert resp.status_code == 403, (role, resp.text)
        # Only the owner's title stuck.
        conv = (await http.get(base, headers=gateway.headers(user))).json()
        assert conv["title"] == "by owner"
        assert (await http.delete(base, headers=gateway.headers(user))).status_code == 204
        for uid in who.values():  # gone from every list
            listed = (await http.get("/v1/conversations",
                                     headers=gateway.headers(uid))).json()["conversations"]
            assert chat_id not in [c["chat_id"] for c in listed]


async def test_every_role_over_sse(gateway: Any, user: str, chat_id: str) -> None:
    who = people(user)
    await shared(gateway, chat_id, who)
    for role, uid in who.items():
        if role == "stranger":
            async with httpx.AsyncClient(base_url=gateway.http) as http:
                resp = await http.get(stream_path(chat_id), headers=gateway.headers(uid))
            assert resp.status_code == 403
            continue
        async with open_stream(gateway, chat_id, uid) as sse:
            assert (await sse.event())["event"] == "ready"
            await publish(gateway, chat_id, {"type": "note", "data": {"to": role}})
            note = await sse.event()
            assert note["event"] == "note" and msgspec.json.decode(note["data"])["data"] == {
                "to": role}


async def test_members_bodies_that_are_refused(gateway: Any, user: str, chat_id: str) -> None:
    await create(gateway, user, chat_id)
    bodies: list[tuple[dict[str, Any], int]] = [
        ({}, 400), ({"set": {"x": "owner"}}, 422), ({"set": {user: "viewer"}}, 400),
        ({"remove": [user]}, 400), ({"set": {"a:b": "member"}}, 422),
        ({"set": {"x": "member"}, "remove": ["x"]}, 400), ({"add": {}}, 422),
        ({"set": {f"u{i}": "viewer" for i in range(101)}}, 422)]
    for body, status in bodies:
        resp = await share(gateway, user, chat_id, body)
        assert resp.status_code == status, (body, resp.text)
    resp = await share(gateway, user, "c_" + uuid.uuid4().hex, {"remove": ["x"]})
    assert resp.status_code == 404
    resp = await share(gateway, user, chat_id, {"set": {f"{user}-s": "member"}}, by="svc")
    assert resp.status_code == 403  # a user token of someone else
    async with httpx.AsyncClient(base_url=gateway.http) as http:
        resp = await http.patch(f"/v1/conversations/{chat_id}/members",
                                json={"set": {f"{user}-s": "member"}},
                                headers=gateway.headers("svc", "service"))
    assert resp.status_code == 200 and resp.json()["members"] == {f"{user}-s": "member"}


async def test_a_member_shares_the_head_list_and_feed(gateway: Any, user: str,
                                                      chat_id: str) -> None:
    who = people(user)
    await create(gateway, user, chat_id)
    async with connect(gateway.url(user)) as alice, connect(gateway.url(who["member"])) as bob:
        await alice.subscribe(chat_id)
        resp = await share(gateway, user, chat_id, {"set": {who["member"]: "member"}})
        assert resp.status_code == 200
        feed = await bob.wait_for(lambda f: f.get("type") == "conversation"
                                  and f["chat_id"] == chat_id, ignore=frozenset())
        assert feed["owner"] == user and feed["members"] == {who["member"]: "member"}
        changed = await alice.expect("members", chat_id=chat_id)
        assert changed["owner"] == user and changed["members"] == {who["member"]: "member"}
        await bob.subscribe(chat_id, create=False)
        ack = await answer(bob, {"type": "message", "chat_id": chat_id, "text": "from bob",
                                 "client_msg_id": "b1"})
        assert ack["type"] == "ack", ack
        seen = await alice.wait_for(lambda f: f.get("type") == "user_message")
        assert seen["data"]["user_id"] == who["member"]
        head = await alice.wait_for(lambda f: f.get("type") == "head")
        retry = await answer(bob, {"type": "retry", "chat_id": chat_id, "cancel": True})
        assert retry["type"] == "ack", retry
        moved = await alice.wait_for(lambda f: f.get("type") == "head"
                                     and f["data"]["head_id"] != head["data"]["head_id"])
        assert moved["data"]["head_id"] == retry["head"] and moved["data"]["by"] == who["member"]
        # Bob's list has it as it is now (his feed heard of it too: before the ack).
        async with httpx.AsyncClient(base_url=gateway.http) as http:
            listed = (await http.get("/v1/conversations", headers=gateway.headers(
                who["member"]))).json()["conversations"]
        [mine] = [c for c in listed if c["chat_id"] == chat_id]
        assert mine["head"] == retry["head"] and mine["owner"] == user


async def test_removal_ends_subscriptions_buffers_and_streams(gateway: Any, user: str,
                                                              chat_id: str) -> None:
    who = people(user)
    bob = who["member"]
    await shared(gateway, chat_id, who)
    async with connect(gateway.url(bob)) as live, connect(gateway.url(bob)) as buffering, \
            connect(gateway.url(who["viewer"])) as viewer, \
            open_stream(gateway, chat_id, bob) as sse:
        assert (await sse.event())["event"] == "ready"
        await live.subscribe(chat_id, create=False)
        await buffering.subscribe(chat_id, create=False)
        await buffering.send({"type": "unsubscribe", "chat_id": chat_id, "id": "u"})
        await buffering.expect("unsubscribed", id="u")
        await viewer.subscribe(chat_id, create=False)
        await publish(gateway, chat_id, {"type": "note", "data": {"n": 1}})  # into the buffer
        await live.expect("note")
        resp = await share(gateway, user, chat_id, {"remove": [bob, f"{user}-nobody"]})
        assert resp.status_code == 200 and resp.json()["removed"] == [bob]
        for ws in (live, buffering):
            # Both: `removed` on the subscription, and the feed's word that it is gone.
            seen: dict[str, Frame] = {}
            while len(seen) < 2:
                frame = await ws.recv(ignore=frozenset({"presence"}))
                if frame["type"] == "conversation" and frame["chat_id"] == chat_id:
                    seen["feed"] = frame
                elif frame["type"] == "removed":
                    seen["removed"] = frame
            assert seen["removed"]["user_id"] == bob and seen["removed"]["chat_id"] == chat_id
            assert "removed" in seen["removed"]["reason"]
            assert seen["feed"]["deleted"] is True and seen["feed"]["removed"] is True
        ended = await sse.end()
        removed = [b for b in ended if b["event"] == "removed"]
        assert len(removed) == 1 and msgspec.json.decode(removed[0]["data"])["user_id"] == bob
        # The viewer stays, and learns who shares it now.
        changed = await viewer.wait_for(lambda f: f.get("type") == "members")
        assert changed["members"] == {who["viewer"]: "viewer"}
        await publish(gateway, chat_id, {"type": "note", "data": {"n": 2}})
        assert (await viewer.expect("note"))["data"] == {"n": 2}
        # Bob gets nothing more, not even the buffered note on a subscribe: forbidden.
        for ws in (live, buffering):
            again = await answer(ws, {"type": "subscribe", "chat_id": chat_id,
                                      "create": False})
            assert again["type"] == "error" and again["code"] == "forbidden", again
    async with httpx.AsyncClient(base_url=gateway.http) as http:
        listed = (await http.get("/v1/conversations",
                                 headers=gateway.headers(bob))).json()["conversations"]
        assert chat_id not in [c["chat_id"] for c in listed]
        resp = await http.get(stream_path(chat_id), headers=gateway.headers(bob))
        assert resp.status_code == 403
