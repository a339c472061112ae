"""The conversation's agent state: a durable ``state {snapshot}`` event per change, kept as
the conversation's, hydrated on subscribe like ``goal_state``, and handed to the next turn
(``Turn.state``; an AG-UI agent's ``RunAgentInput.state``)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from gateway.sdk.agent import Turn

from .steps import create, message_and_reply, post_events, publish
from .test_agent import agent_worker, until_turn_end
from .wsclient import connect

pytestmark = pytest.mark.anyio

SNAPSHOT = {"steps": ["search", "book"], "done": [], "prefs": {}, "budget": 1200.5}


async def test_a_state_event_is_kept_hydrated_and_replaced(gateway: Any, user: str,
                                                           chat_id: str) -> None:
    await create(gateway, user, chat_id)
    async with connect(gateway.url(user)) as ws:
        assert "state" not in (await ws.subscribe(chat_id))["snapshot"]
        reply = await publish(gateway, chat_id, {"type": "state", "data": {"snapshot": SNAPSHOT}})
        event = await ws.wait_for(lambda f: f.get("type") == "state")
        assert event["seq"] == reply["seqs"][0] and event["data"] == {"snapshot": SNAPSHOT}
        assert "node" not in event  # the conversation's, like goal_state
    for binary in (False, True):
        async with connect(gateway.url(user), binary=binary) as other:
            assert (await other.subscribe(chat_id))["snapshot"]["state"] == SNAPSHOT
    await publish(gateway, chat_id, {"type": "state", "data": {"snapshot": [1, "two"]}})
    async with connect(gateway.url(user)) as ws:
        assert (await ws.subscribe(chat_id))["snapshot"]["state"] == [1, "two"]
    async with httpx.AsyncClient(base_url=gateway.http, timeout=10) as http, \
            http.stream("GET", f"/v1/conversations/{chat_id}/stream",
                        headers=gateway.headers(user)) as sse:
        lines = sse.aiter_lines()
        assert await anext(lines) and await anext(lines) == "event: ready"
        assert '"state":[1,"two"]' in await anext(lines)


async def test_a_state_event_without_a_snapshot_is_refused_naming_it(
        gateway: Any, user: str, chat_id: str) -> None:
    await create(gateway, user, chat_id)
    resp = await post_events(gateway, chat_id, {"type": "state", "data": {"value": 1}})
    assert resp.status_code == 400 and "snapshot" in resp.json()["error"]["message"], resp.text


async def test_the_next_turn_starts_with_the_state_the_last_one_left(
        gateway: Any, redis_url: str, group: str, user: str, chat_id: str) -> None:
    seen: list[Any] = []

    async def handler(turn: Turn) -> None:
        seen.append(turn.state)
        await turn.event("state", {"snapshot": {"turns": len(seen)}})
        await turn.message(f"turn {len(seen)}")

    async with agent_worker(redis_url, handler, group), connect(gateway.url(user)) as ws:
        await ws.subscribe(chat_id)
        for _ in range(2):
            await message_and_reply(ws, chat_id, "again")
            await until_turn_end(ws, chat_id)
    assert seen == [None, {"turns": 1}]
