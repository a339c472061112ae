"""Client tools: the agent asks a person, any device answers, exactly one answer wins, and
a new turn goes on with the answer in its history.

Real parts only: the session's Redis-compatible server, the shared gateway process, an
in-process AgentWorker running a handler that calls ``turn.ask``, WebSockets and HTTP.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from gateway.errors import Rejected
from gateway.sdk.agent import Turn

from .steps import APPROVE, create, history, send_message
from .steps import declare_tools as declare
from .test_agent import agent_worker, until_turn_end
from .wsclient import Client, connect

pytestmark = pytest.mark.anyio

def asking_handler(seen: list[list[dict[str, Any]]]) -> Any:
    """Asks for approval on a message; on the turn the answer starts, says what it got."""
    async def handle(turn: Turn) -> None:
        history = await turn.history()
        seen.append(history)
        if history[-1]["role"] == "tool":
            approved = history[-1]["content"]["approved"]
            await turn.message("paid" if approved else "not paid")
            return
        await turn.ask("approve_payment", {"amount": 42.5})
    return handle


async def asked(ws: Client, chat_id: str) -> dict[str, Any]:
    """The awaiting tool_call, through the turn's end (reason awaiting_input)."""
    frames = await until_turn_end(ws, chat_id)
    assert frames[-1]["data"]["reason"] == "awaiting_input", frames[-1]
    call = next(f for f in frames if f["type"] == "tool_call")
    assert call["data"]["awaiting"] is True and call["data"]["args"] == {"amount": 42.5}
    return call


async def test_any_device_answers_and_exactly_one_answer_wins(
        gateway: Any, redis_url: str, group: str, user: str, chat_id: str) -> None:
    await create(gateway, user, chat_id)
    assert (await declare(gateway, user, chat_id, APPROVE)).status_code == 200
    seen: list[list[dict[str, Any]]] = []
    async with agent_worker(redis_url, asking_handler(seen), group), \
            connect(gateway.url(user)) as phone, connect(gateway.url(user)) as laptop:
        await phone.subscribe(chat_id)
        await laptop.subscribe(chat_id)
        await send_message(phone, chat_id, "pay the hotel")
        call = await asked(phone, chat_id)
        call_id = call["data"]["call_id"]
        # A device that comes now sees the question pending.
        async with connect(gateway.url(user)) as tablet:
            snapshot = (await tablet.subscribe(chat_id))["snapshot"]
            assert snapshot["awaiting"] == {call_id: "approve_payment"}
        # Both devices answer at once: one wins, the other gets conflict.
        answer = {"chat_id": chat_id, "call_id": call_id}
        await phone.send({"type": "tool_result", **answer, "result": {"approved": True},
                          "id": "p"})
        await laptop.send({"type": "tool_result", **answer, "result": {"approved": False},
                           "id": "l"})
        replies = [await ws.wait_for(lambda f: f.get("type") in ("ack", "error"))
                   for ws in (phone, laptop)]
        assert sorted(r["type"] for r in replies) == ["ack", "error"], replies
        loser = next(r for r in replies if r["type"] == "error")
        assert loser["code"] == "conflict"
        won = replies[0]["type"] == "ack"
        end = await laptop.wait_for(lambda f: f.get("type") == "turn_end"
                                    and f["data"]["reason"] != "awaiting_input")
        assert end["data"]["reason"] == "complete"
    stored = await history(gateway, user, chat_id, view="active")
    results = [e for e in stored if e["type"] == "tool_result"]
    winner = next(r for r in replies if r["type"] == "ack")
    assert [e["data"] for e in results] == [{
        "call_id": call_id, "result": {"approved": won}, "by": user,
        "msg_id": winner["msg_id"], "parent_id": call["node"]}]  # a node under the turn
    assert [e["data"]["text"] for e in stored if e["type"] == "message"] == [
        "paid" if won else "not paid"]
    # The new turn's history ends with the question and its answer.
    last = seen[-1]
    assert last[-2]["role"] == "assistant" and last[-2]["tool_calls"][0]["id"] == call_id
    assert last[-1] == {"role": "tool", "tool_call_id": call_id,
                        "content": {"approved": won}, "id": last[-1]["id"]}


async def test_a_bad_answer_is_refused_and_changes_nothing(
        gateway: Any, redis_url: str, group: str, user: str, chat_id: str) -> None:
    await create(gateway, user, chat_id)
    await declare(gateway, user, chat_id, APPROVE)
    async with agent_worker(redis_url, asking_handler([]), group), \
            connect(gateway.url(user)) as ws:
        await ws.subscribe(chat_id)
        await send_message(ws, chat_id, "pay")
        call_id = (await asked(ws, chat_id))["data"]["call_id"]
        async with httpx.AsyncClient(base_url=gateway.http) as http:
            url = f"/v1/conversations/{chat_id}/tool-results"
            bad = await http.post(url, json={"call_id": call_id, "result": {"approved": "y"}},
                                  headers=gateway.headers(user))
            assert bad.status_code == 400, bad.text
            assert "approved" in bad.json()["error"]["message"]
            unknown = await http.post(url, json={"call_id": "call_nope", "result": {}},
                                      headers=gateway.headers(user))
            assert unknown.status_code == 409, unknown.text
            other = await http.post(url, json={"call_id": call_id,
                                               "result": {"approved": True}},
                                    headers=gateway.headers("someone-else"))
            assert other.status_code == 403, other.text
            conv = (await http.get(f"/v1/conversations/{chat_id}",
                                   headers=gateway.headers(user))).json()
            assert conv["awaiting"] == {call_id: "approve_payment"}
            assert conv["status"] == "idle"
            ok = await http.post(url, json={"call_id": call_id, "result": {"approved": True}},
                                 headers=gateway.headers(user))
            assert ok.status_code == 200 and ok.json()["turn_id"], ok.text
        frames = await until_turn_end(ws, chat_id)
    assert [f["data"]["text"] for f in frames if f["type"] == "message"] == ["paid"]


async def test_a_new_message_instead_of_an_answer_leaves_the_question_unanswered(
        gateway: Any, redis_url: str, group: str, user: str, chat_id: str) -> None:
    await create(gateway, user, chat_id)
    await declare(gateway, user, chat_id, APPROVE)
    seen: list[list[dict[str, Any]]] = []
    async with agent_worker(redis_url, asking_handler(seen), group), \
            connect(gateway.url(user)) as ws:
        await ws.subscribe(chat_id)
        await send_message(ws, chat_id, "pay")
        call_id = (await asked(ws, chat_id))["data"]["call_id"]
        await send_message(ws, chat_id, "never mind, what is the weather?")
        await asked(ws, chat_id)  # the handler asks again: it is what it does
        await ws.send({"type": "tool_result", "chat_id": chat_id, "call_id": call_id,
                       "result": {"approved": True}})
        refused = await ws.wait_for(lambda f: f.get("type") == "error")
        assert refused["code"] == "conflict"
    # The agent saw its first question standing unanswered before the new message.
    roles = [m["role"] for m in seen[-1]]
    assert roles == ["user", "assistant", "user"]
    assert seen[-1][1]["tool_calls"][0]["id"] == call_id


async def test_tools_are_declared_with_checked_schemas_and_asked_only_by_name(
        gateway: Any, redis_url: str, group: str, user: str, chat_id: str) -> None:
    await create(gateway, user, chat_id)
    bad_schema = dict(APPROVE, parameters={"type": "nonsense"})
    resp = await declare(gateway, user, chat_id, bad_schema)
    assert resp.status_code == 400 and "JSON Schema" in resp.json()["error"]["message"]
    twice = await declare(gateway, user, chat_id, APPROVE, APPROVE)
    assert twice.status_code == 400 and "once" in twice.json()["error"]["message"]
    resp = await declare(gateway, user, chat_id, APPROVE)
    assert resp.json()["client_tools"][0]["name"] == "approve_payment"
    errors: list[str] = []
    done = asyncio.Event()

    async def handle(turn: Turn) -> None:
        assert [t.name for t in turn.client_tools] == ["approve_payment"]
        for name, args in (("delete_everything", {}), ("approve_payment", {"amount": "x"})):
            try:
                await turn.ask(name, args)
            except Rejected as exc:
                errors.append(exc.message)
        done.set()

    async with agent_worker(redis_url, handle, group), connect(gateway.url(user)) as ws:
        await ws.subscribe(chat_id)
        await send_message(ws, chat_id, "go")
        await asyncio.wait_for(done.wait(), 10)
        await until_turn_end(ws, chat_id)
    assert "not a client tool" in errors[0] and "amount" in errors[1]
    # Over HTTP, an agent's tool_call asking with a tool the conversation lacks is refused.
    async with connect(gateway.url(user)) as ws:
        await ws.subscribe(chat_id)
        await send_message(ws, chat_id, "again")
        async with httpx.AsyncClient(base_url=gateway.http) as http:
            for data, says in (({"call_id": "c1", "name": "nope", "args": {}},
                                "not a client tool"),
                               ({"call_id": "c2", "name": "approve_payment",
                                 "args": {"amount": "x"}}, "amount")):
                resp = await http.post(
                    f"/v1/conversations/{chat_id}/events",
                    json={"type": "tool_call", "data": {**data, "awaiting": True}},
                    headers=gateway.headers("agent", "service"))
                assert resp.status_code == 400 and says in resp.json()["error"]["message"]


async def test_the_python_client_answers_and_keeps_the_answer_in_its_tree(
        gateway: Any, redis_url: str, group: str, user: str) -> None:
    """``GatewayClient``: a creating subscribe names the agent, ``answer`` answers the
    question, and the answer is a node of the active path it keeps."""
    from gateway.sdk.client import GatewayClient, RequestError

    from .test_named_agents import fresh

    agent, chat_id = fresh("asker"), fresh("chat")
    async with agent_worker(redis_url, asking_handler([]), "agents", name=agent), \
            GatewayClient(gateway.ws, token_factory=lambda: gateway.token(user)) as client:
        await client.subscribe(chat_id, agent=agent)
        await declare(gateway, user, chat_id, APPROVE)
        await client.send_message(chat_id, "pay")
        call = None
        async for item in client.events(chat_id):
            if item.type == "tool_call":
                call = item.data
            if item.type == "turn_end":
                break
        assert call is not None and call["awaiting"] is True
        ack = await client.answer(chat_id, call["call_id"], {"approved": True})
        with pytest.raises(RequestError) as refused:
            await client.answer(chat_id, call["call_id"], {"approved": False})
        assert refused.value.code == "conflict"
        async for item in client.events(chat_id):
            if item.type == "turn_end":
                break
        path = client.active_path(chat_id)
        assert path[-2:] == [ack.msg_id, ack.turn_id] and client.head(chat_id) == ack.turn_id
