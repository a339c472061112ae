"""Named agents: a conversation names the agent that answers it, each agent name has its
own inbox, and ``GET /v1/agents`` lists the agents with a live worker.

Real parts only: the session's Redis-compatible server, gateway processes, in-process
:class:`AgentWorker` s reading the inboxes, WebSockets and HTTP. Agent names are fresh per
test, so no other test's worker reads their inboxes.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import httpx
import pytest

from gateway.sdk.agent import Turn

from .steps import send_message
from .test_agent import agent_worker, until_turn_end
from .wsclient import connect

pytestmark = pytest.mark.anyio


def fresh(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def answering(name: str, seen: list[tuple[str, str]] | None = None) -> Any:
    async def handle(turn: Turn) -> None:
        if seen is not None:
            seen.append((name, turn.chat_id))
        await turn.message(f"{name} here")
    return handle


async def create(gw: Any, user: str, chat_id: str, **body: Any) -> httpx.Response:
    async with httpx.AsyncClient(base_url=gw.http) as http:
        return await http.post("/v1/conversations", json={"chat_id": chat_id, **body},
                               headers=gw.headers(user))


async def live_agents(gw: Any, user: str) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=gw.http) as http:
        resp = await http.get("/v1/agents", headers=gw.headers(user))
    assert resp.status_code == 200, resp.text
    return {a["name"]: a for a in resp.json()["agents"]}


async def test_each_agent_answers_only_the_conversations_that_name_it(
        gateway: Any, redis_url: str, user: str) -> None:
    alpha, beta = fresh("alpha"), fresh("beta")
    chats = {alpha: fresh("chat"), beta: fresh("chat")}
    seen: list[tuple[str, str]] = []
    for agent, chat_id in chats.items():
        resp = await create(gateway, user, chat_id, agent=agent)
        assert resp.status_code == 201 and resp.json()["agent"] == agent, resp.text
    async with agent_worker(redis_url, answering(alpha, seen), "agents", name=alpha), \
            agent_worker(redis_url, answering(beta, seen), "agents", name=beta), \
            connect(gateway.url(user)) as ws:
        for agent, chat_id in chats.items():
            await ws.subscribe(chat_id)
            for n in range(3):
                await send_message(ws, chat_id, f"question {n}")
                frames = await until_turn_end(ws, chat_id)
                assert [f["data"]["text"] for f in frames if f["type"] == "message"] == [
                    f"{agent} here"]
    assert sorted(seen) == sorted([(a, c) for a, c in chats.items()] * 3)


async def test_the_conversation_list_and_feed_carry_the_agent_and_filter_by_it(
        gateway: Any, user: str) -> None:
    agent = fresh("lister")
    mine, other = fresh("chat"), fresh("chat")
    async with connect(gateway.url(user)) as sidebar:
        assert (await create(gateway, user, mine, agent=agent)).status_code == 201
        feed = await sidebar.wait_for(lambda f: f.get("type") == "conversation"
                                      and f["chat_id"] == mine)
        assert feed["agent"] == agent
    assert (await create(gateway, user, other)).json()["agent"] == "default"
    async with httpx.AsyncClient(base_url=gateway.http) as http:
        listed = (await http.get("/v1/conversations", params={"agent": agent},
                                 headers=gateway.headers(user))).json()["conversations"]
        assert [c["chat_id"] for c in listed] == [mine] and listed[0]["agent"] == agent
        everything = (await http.get("/v1/conversations",
                                     headers=gateway.headers(user))).json()["conversations"]
        assert {c["chat_id"]: c["agent"] for c in everything} == {mine: agent,
                                                                   other: "default"}
        bad = await http.get("/v1/conversations", params={"agent": "Not A Name"},
                             headers=gateway.headers(user))
        assert bad.status_code == 400 and "agent" in bad.json()["error"]["message"]


async def test_a_creating_subscribe_names_the_agent(gateway: Any, redis_url: str,
                                                    user: str) -> None:
    agent, chat_id = fresh("subscriber"), fresh("chat")
    async with agent_worker(redis_url, answering(agent), "agents", name=agent), \
            connect(gateway.url(user)) as ws:
        await ws.send({"type": "subscribe", "chat_id": chat_id, "agent": agent})
        subscribed = await ws.wait_for(lambda f: f.get("type") == "subscribed")
        assert subscribed["snapshot"]["agent"] == agent
        await send_message(ws, chat_id, "hello")
        frames = await until_turn_end(ws, chat_id)
    assert [f["data"]["text"] for f in frames if f["type"] == "message"] == [f"{agent} here"]


async def test_live_agents_are_listed_with_their_workers_until_they_stop(
        gateway: Any, redis_url: str, user: str) -> None:
    agent = fresh("listed")
    assert agent not in await live_agents(gateway, user)
    async with agent_worker(redis_url, answering(agent), "agents", name=agent), \
            agent_worker(redis_url, answering(agent), "agents", name=agent):
        assert (await live_agents(gateway, user))[agent] == {"name": agent, "kind": "handler",
                                                             "workers": 2}
    assert agent not in await live_agents(gateway, user)


async def test_a_turn_with_no_worker_of_its_agent_times_out_saying_so(
        start_gateway: Any, user: str) -> None:
    gw = start_gateway(turn_timeout=1)
    agent, chat_id = fresh("nobody"), fresh("chat")
    assert (await create(gw, user, chat_id, agent=agent)).status_code == 201
    async with connect(gw.url(user)) as ws:
        await ws.subscribe(chat_id)
        await send_message(ws, chat_id, "anyone there?")
        end = (await until_turn_end(ws, chat_id, within=10))[-1]
    assert end["data"]["reason"] == "timeout"
    assert end["data"]["error"] == (
        f"No worker of the agent {agent!r} is running, so nothing answered.")


async def test_a_sub_task_goes_to_the_agent_its_parent_names(
        gateway: Any, redis_url: str, user: str) -> None:
    lead, helper = fresh("lead"), fresh("helper")
    parent = fresh("chat")
    children: list[str] = []
    done = asyncio.Event()

    async def lead_handle(turn: Turn) -> None:
        child = await turn.open_child("Book hotels", agent=helper)
        children.append(child)
        await turn.message("asked the helper")

    async def helper_handle(turn: Turn) -> None:
        await turn.message("booked")
        done.set()

    assert (await create(gateway, user, parent, agent=lead)).status_code == 201
    async with agent_worker(redis_url, lead_handle, "agents", name=lead), \
            agent_worker(redis_url, helper_handle, "agents", name=helper), \
            connect(gateway.url(user)) as ws:
        await ws.subscribe(parent)
        await send_message(ws, parent, "plan the trip")
        await until_turn_end(ws, parent)
        async with httpx.AsyncClient(base_url=gateway.http) as http:
            child = (await http.get(f"/v1/conversations/{children[0]}",
                                    headers=gateway.headers(user))).json()
            assert child["agent"] == helper and child["parent"] == parent
            # Over HTTP too: a sub-conversation names its agent, else it takes its parent's.
            named = await create(gateway, user, fresh("chat"), parent_chat_id=parent,
                                 agent=helper)
            inherited = await create(gateway, user, fresh("chat"), parent_chat_id=parent)
            assert named.json()["agent"] == helper and inherited.json()["agent"] == lead
        async with connect(gateway.url(user)) as other:
            await other.subscribe(children[0])
            await send_message(other, children[0], "go")
        await asyncio.wait_for(done.wait(), 10)
