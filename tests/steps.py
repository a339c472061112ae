"""The steps tests share, taken as an app or an agent takes them: over HTTP and WebSocket.

One definition of each: create a conversation, read its history, send a message (and wait
for its reply), publish events as an agent. ``gw`` is anything with ``http`` (the base URL)
and ``headers(sub, role)`` (a bearer token for them): a ``GatewayProcess`` of conftest.
"""

from __future__ import annotations

import asyncio
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from .wsclient import Client, Frame

# --- conversations ----------------------------------------------------------------------


async def read(gw: Any, user: str, path: str) -> Any:
    """``GET path`` as ``user``: its JSON body, which must come with 200."""
    async with httpx.AsyncClient(base_url=gw.http) as http:
        resp = await http.get(path, headers=gw.headers(user))
    assert resp.status_code == 200, resp.text
    return resp.json()


async def create(gw: Any, user: str, chat_id: str, title: str | None = None) -> Frame:
    """Create ``chat_id``, owned by ``user``; returns the conversation (``epoch``...)."""
    body: dict[str, Any] = {"chat_id": chat_id}
    if title is not None:
        body["title"] = title
    async with httpx.AsyncClient(base_url=gw.http) as http:
        resp = await http.post("/v1/conversations", json=body, headers=gw.headers(user))
    assert resp.status_code == 201, resp.text
    created: Frame = resp.json()
    return created


async def open_child(gw: Any, user: str, parent: str, chat_id: str | None = None,
                     title: str | None = None, role: str = "user") -> httpx.Response:
    """Ask to open a sub-conversation of ``parent`` as ``user`` (with ``role``); returns the
    response whatever its status."""
    body: dict[str, Any] = {"parent_chat_id": parent}
    if chat_id is not None:
        body["chat_id"] = chat_id
    if title is not None:
        body["title"] = title
    async with httpx.AsyncClient(base_url=gw.http) as http:
        return await http.post("/v1/conversations", json=body, headers=gw.headers(user, role))


async def children(gw: Any, user: str, chat_id: str) -> list[Frame]:
    """``chat_id``'s sub-conversations as ``GET .../children`` lists them."""
    async with httpx.AsyncClient(base_url=gw.http) as http:
        resp = await http.get(f"/v1/conversations/{chat_id}/children", headers=gw.headers(user))
    assert resp.status_code == 200, resp.text
    assert resp.json()["chat_id"] == chat_id
    found: list[Frame] = resp.json()["children"]
    return found


# --- history ----------------------------------------------------------------------------


async def history_page(gw: Any, user: str, chat_id: str, *, after: int = 0, limit: int = 1000,
                       role: str = "user", token: str | None = None,
                       view: str = "all") -> Frame:
    """One page of ``chat_id``'s stored events (every branch's; ``view="active"`` for the
    active path's) as ``user`` reads it (with ``token`` if given, instead of a fresh one):
    ``epoch``, ``last_seq``, ``events`` and ``next_after``."""
    headers = {"Authorization": f"Bearer {token}"} if token else gw.headers(user, role)
    async with httpx.AsyncClient(base_url=gw.http) as http:
        resp = await http.get(f"/v1/conversations/{chat_id}/events",
                              params={"after": after, "limit": limit, "view": view},
                              headers=headers)
    assert resp.status_code == 200, resp.text
    page: Frame = resp.json()
    return page


async def history_with_epoch(gw: Any, user: str, chat_id: str, role: str = "user",
                             view: str = "all") -> tuple[str, list[Frame]]:
    """Every stored event of ``chat_id`` (``view="active"``: the active path's), page after
    page, and the epoch they all belong to."""
    page = await history_page(gw, user, chat_id, role=role, view=view)
    epoch, events = page["epoch"], list(page["events"])
    while page["events"] and page["next_after"] is not None:
        page = await history_page(gw, user, chat_id, after=page["next_after"], role=role,
                                  view=view)
        assert page["epoch"] == epoch, "the history was recreated while it was read"
        events += page["events"]
    return epoch, events


async def history(gw: Any, user: str, chat_id: str, role: str = "user",
                  view: str = "all") -> list[Frame]:
    """Every stored event of ``chat_id`` (``view="active"``: the active path's), in order,
    as ``user`` reads them."""
    return (await history_with_epoch(gw, user, chat_id, role, view))[1]


def history_sync(gw: Any, user: str, chat_id: str, view: str = "all") -> list[Frame]:
    """:func:`history` for a synchronous test; it runs on a thread of its own, since the
    caller's thread may hold an event loop (Playwright's sync API does)."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, history(gw, user, chat_id, view=view)).result()


# --- messages ---------------------------------------------------------------------------


async def send_message(ws: Client, chat_id: str, text: str, client_msg_id: str | None = None,
                       **extra: Any) -> str:
    """Send a ``message`` (a fresh ``client_msg_id`` unless one is given) with ``extra``
    fields (a request ``id``, ``data``...); returns its ``client_msg_id``."""
    if client_msg_id is None:
        client_msg_id = uuid.uuid4().hex
    await ws.send({"type": "message", "chat_id": chat_id, "text": text,
                   "client_msg_id": client_msg_id, **extra})
    return client_msg_id


async def reply(ws: Client, chat_id: str, count: int = 0,
                within: float = 5.0) -> tuple[Frame, list[Frame]]:
    """The reply (``ack`` or ``error``) to the request just sent on ``ws``, and the next
    ``count`` event frames of ``chat_id`` (the two may interleave: the reply is sent once the
    events are stored)."""
    answer: Frame | None = None
    events: list[Frame] = []
    async with asyncio.timeout(within):
        while answer is None or len(events) < count:
            frame = await ws.recv()
            if frame["type"] in ("ack", "error"):
                assert answer is None, (answer, frame)
                answer = frame
            else:
                assert frame.get("chat_id") == chat_id and "seq" in frame, frame
                events.append(frame)
    return answer, events


async def message_and_reply(ws: Client, chat_id: str, text: str,
                            client_msg_id: str | None = None, count: int = 3,
                            **extra: Any) -> tuple[Frame, list[Frame]]:
    """:func:`send_message`, then its :func:`reply` and the ``count`` events it appended
    (``user_message``, ``turn_start`` and ``head`` when it is accepted)."""
    await send_message(ws, chat_id, text, client_msg_id, **extra)
    return await reply(ws, chat_id, count)


async def start_turn(ws: Client, chat_id: str, text: str = "hi") -> str:
    """Send a message on ``ws`` (subscribed to ``chat_id``); returns the id of the turn it
    started, once its ``turn_start`` arrived."""
    await send_message(ws, chat_id, text)
    frame = await ws.wait_for(lambda f: f.get("type") == "turn_start")
    turn_id: str = frame["data"]["turn_id"]
    return turn_id


# --- publishing, as an agent does: HTTP with a service token -----------------------------


async def post_events(gw: Any, chat_id: str, *events: dict[str, Any],
                      key: str | None = None) -> httpx.Response:
    """POST ``events`` (in order, one batch) to ``chat_id`` as an agent; returns the response
    whatever its status."""
    body: dict[str, Any] = {"events": list(events)}
    if key:
        body["idempotency_key"] = key
    async with httpx.AsyncClient(base_url=gw.http) as http:
        return await http.post(f"/v1/conversations/{chat_id}/events", json=body,
                               headers=gw.headers("agent", "service"))


async def publish(gw: Any, chat_id: str, *events: dict[str, Any], key: str | None = None) -> Any:
    """:func:`post_events`, which must succeed; returns the reply body (``seqs``...)."""
    resp = await post_events(gw, chat_id, *events, key=key)
    assert resp.status_code == 200, resp.text
    return resp.json()


# --- the conversation tree ------------------------------------------------------------


async def op(ws: Client, chat_id: str, kind: str, **fields: Any) -> tuple[Frame, list[Frame]]:
    """Send a tree operation; returns its reply and the events it appended (through its
    ``head`` event; none when refused)."""
    await ws.send({"type": kind, "chat_id": chat_id, **fields})
    answer: Frame | None = None
    events: list[Frame] = []
    async with asyncio.timeout(5):  # the reply and the events may come in either order
        while answer is None or (answer["type"] == "ack"
                                 and not any(e["type"] == "head" for e in events)):
            frame = await ws.recv()
            if frame["type"] in ("ack", "error"):
                answer = frame
            elif frame.get("chat_id") == chat_id:
                events.append(frame)
    return answer, events


async def end_turn(gw: Any, chat_id: str, **data: Any) -> None:
    resp = await post_events(gw, chat_id, {"type": "turn_end", "data": data})
    assert resp.status_code == 200, resp.text


async def exchange(ws: Client, gw: Any, chat_id: str, text: str) -> tuple[str, str]:
    """A message and its answer, turn ended: returns (msg_id, turn_id)."""
    ack, _ = await message_and_reply(ws, chat_id, text)
    assert ack["type"] == "ack", ack
    await post_events(gw, chat_id, {"type": "message", "data": {"text": f"re: {text}"}})
    await end_turn(gw, chat_id)
    await ws.wait_for(lambda f: f.get("type") == "turn_end")
    return ack["msg_id"], ack["turn_id"]


# --- client tools -----------------------------------------------------------------------

APPROVE = {"name": "approve_payment", "description": "Ask to approve a payment",
           "parameters": {"type": "object", "required": ["amount"],
                          "properties": {"amount": {"type": "number"}}},
           "result": {"type": "object", "required": ["approved"],
                      "properties": {"approved": {"type": "boolean"}}}}
"""A client tool: the agent asks a person to approve a payment."""


async def declare_tools(gw: Any, user: str, chat_id: str,
                        *tools: dict[str, Any]) -> httpx.Response:
    """``PATCH`` the conversation's client tools (creating it first when it is new);
    returns the response whatever its status."""
    async with httpx.AsyncClient(base_url=gw.http) as http:
        await http.post("/v1/conversations", json={"chat_id": chat_id},
                        headers=gw.headers(user))
        return await http.patch(f"/v1/conversations/{chat_id}",
                                json={"client_tools": list(tools)}, headers=gw.headers(user))
