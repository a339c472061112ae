"""History trimmed at turn boundaries: what is kept starts with a user message, within one
turn's events of ``GATEWAY_HISTORY_MAXLEN``; no reader is shown an answer whose question
was trimmed."""

from __future__ import annotations

from typing import Any

import pytest
import redis.asyncio as aioredis

from gateway.config import Settings
from gateway.redis.backend import Backend
from gateway.redis.store import Store
from gateway.sdk.agent import Turn

from .steps import create, end_turn, history, message_and_reply, op, publish, read
from .wsclient import Client, Frame, connect

pytestmark = pytest.mark.anyio

MAXLEN = 20


@pytest.fixture(scope="module")
def small(start_gateway: Any) -> Any:
    return start_gateway(history_maxlen=MAXLEN, turn_timeout=600)


async def turn(ws: Client, gw: Any, chat_id: str, text: str, steps: int) -> str:
    """A message and an answer of ``steps`` tool events, a message and its turn_end: 5 +
    ``steps`` durable events (user_message, turn_start, head, ..., message, turn_end).
    Returns the turn id."""
    ack, _ = await message_and_reply(ws, chat_id, text)
    assert ack["type"] == "ack", ack
    await work(ws, gw, chat_id, steps)
    turn_id: str = ack["turn_id"]
    return turn_id


async def work(ws: Client, gw: Any, chat_id: str, steps: int) -> None:
    """The running turn's answer: ``steps`` tool calls, a message, and its end."""
    for i in range(steps):
        await publish(gw, chat_id, {"type": "tool_call", "data": {"call_id": f"c{i}"}})
    await publish(gw, chat_id, {"type": "message", "data": {"text": "done"}})
    await end_turn(gw, chat_id)
    await ws.wait_for(lambda f: f.get("type") == "turn_end")


async def tree(gw: Any, user: str, chat_id: str) -> dict[str, Frame]:
    return {n["id"]: n for n in (await read(gw, user, f"/v1/conversations/{chat_id}/tree"))
            ["nodes"]}


async def active_page(gw: Any, user: str, chat_id: str) -> Frame:
    page: Frame = await read(gw, user, f"/v1/conversations/{chat_id}/events")
    return page


@pytest.mark.parametrize("steps", [0, 3, 9])
async def test_kept_history_starts_at_a_user_message_within_one_turn(
        small: Any, user: str, chat_id: str, steps: int) -> None:
    await create(small, user, chat_id)
    per_turn = 5 + steps
    async with connect(small.url(user)) as ws:
        await ws.subscribe(chat_id)
        for n in range(12):
            await turn(ws, small, chat_id, f"q{n}", steps)
            kept = await history(small, user, chat_id)
            assert kept[0]["type"] == "user_message", kept[:3]
            assert kept[-1]["seq"] == (n + 1) * per_turn
            seqs = [e["seq"] for e in kept]
            assert seqs == list(range(seqs[0], seqs[-1] + 1)), "a hole in what is kept"
            total = (n + 1) * per_turn
            assert len(kept) <= MAXLEN
            assert len(kept) >= min(total, MAXLEN - per_turn + 1)


async def test_a_turn_longer_than_the_bound_is_kept_whole(small: Any, user: str,
                                                          chat_id: str) -> None:
    await create(small, user, chat_id)
    async with connect(small.url(user)) as ws:
        epoch = (await ws.subscribe(chat_id))["epoch"]
        await turn(ws, small, chat_id, "short", 0)
        await message_and_reply(ws, chat_id, "long")
        await work(ws, small, chat_id, 2 * MAXLEN)
        kept = await history(small, user, chat_id)
        assert kept[0]["type"] == "user_message" and kept[0]["data"]["text"] == "long"
        assert len(kept) == 5 + 2 * MAXLEN  # the whole long turn, and nothing before it

        # A resume from before the cut is told it cannot recover: nothing is replayed.
        async with connect(small.url(user)) as late:
            sub = await late.subscribe(chat_id, since={"epoch": epoch, "seq": 2})
            assert sub["recovered"] is False and sub["replayed"] == 0


async def test_no_reader_gets_an_answer_whose_question_was_trimmed(
        small: Any, redis_url: str, user: str, chat_id: str) -> None:
    """An undo and a retry answer an old message anew; once that message is trimmed, its
    new answer is not shown (nor given to an agent) as if it were a whole exchange."""
    await create(small, user, chat_id)
    async with connect(small.url(user)) as ws:
        await ws.subscribe(chat_id)
        first = await turn(ws, small, chat_id, "old question", 0)  # seqs 1..5
        await turn(ws, small, chat_id, "second", 0)  # 6..10, its message the next cut
        reply, _ = await op(ws, chat_id, "undo")  # 11: back to the first answer
        assert reply["type"] == "ack", reply
        reply, _ = await op(ws, chat_id, "retry")  # 12, 13: a new answer to the old question
        assert reply["type"] == "ack", reply
        retried = reply["turn_id"]
        await work(ws, small, chat_id, 8)  # 14..23: trimmed up to "second" (seq 6)

        nodes = await tree(small, user, chat_id)
        user_nodes = {n["preview"]: n for n in nodes.values() if n["kind"] == "user"}
        assert user_nodes["old question"]["trimmed"] is True and nodes[first]["trimmed"] is True
        assert user_nodes["second"]["trimmed"] is False and nodes[retried]["trimmed"] is False

        page = await active_page(small, user, chat_id)
        assert page["trimmed"] is True
        assert not [e for e in page["events"] if e.get("node") == retried], page["events"]

        # The next exchange is whole: the path is shown from its question on.
        latest = await turn(ws, small, chat_id, "new question", 0)
        page = await active_page(small, user, chat_id)
        assert page["trimmed"] is True
        texts = [e["data"]["text"] for e in page["events"]
                 if e["type"] in ("user_message", "message")]
        assert texts == ["new question", "done"]

    # An agent's context is the same legal suffix: it starts at a whole exchange.
    settings = Settings(redis_url=redis_url)
    client = aioredis.from_url(redis_url)
    try:
        store = Store(Backend.of(client, settings), settings)
        context = await Turn(store, {"chat_id": chat_id, "turn_id": latest}).history()
        assert [m["content"] for m in context] == ["new question"]
        context = await Turn(store, {"chat_id": chat_id, "turn_id": retried}).history()
        assert context == []
    finally:
        await client.aclose()
