"""Usage totals: what every turn cost (``billed``, it only grows) and what the active path
cost (``active``, it follows the head), counted once per turn whatever is replayed."""

from __future__ import annotations

from typing import Any

import pytest

from .steps import create, end_turn, exchange, message_and_reply, op, post_events, publish, read
from .wsclient import Frame, connect

pytestmark = pytest.mark.anyio


async def conversation(gw: Any, user: str, chat_id: str) -> Frame:
    found: Frame = await read(gw, user, f"/v1/conversations/{chat_id}")
    return found


async def answer(ws: Any, gw: Any, chat_id: str, text: str, usage: dict[str, Any]) -> str:
    """A message and its answer, ended with ``usage``; returns the turn id."""
    ack, _ = await message_and_reply(ws, chat_id, text)
    assert ack["type"] == "ack", ack
    await end_turn(gw, chat_id, usage=usage)
    await ws.wait_for(lambda f: f.get("type") == "turn_end")
    turn_id: str = ack["turn_id"]
    return turn_id


async def test_totals_follow_retry_switch_and_undo(gateway: Any, user: str,
                                                   chat_id: str) -> None:
    await create(gateway, user, chat_id)
    async with connect(gateway.url(user)) as ws:
        await ws.subscribe(chat_id)
        first = await answer(ws, gateway, chat_id, "one",
                             {"input_tokens": 10, "output_tokens": 5, "cost": 0.25})
        second = await answer(ws, gateway, chat_id, "two", {"input_tokens": 20, "cost": 0.5})
        c = await conversation(gateway, user, chat_id)
        assert c["usage"] == {"billed": {"input_tokens": 30, "output_tokens": 5, "cost": 0.75},
                              "active": {"input_tokens": 30, "output_tokens": 5, "cost": 0.75}}
        assert c["message_count"] == 4

        # A retry's answer was paid for as well: billed grows, active swaps the answers.
        reply, _ = await op(ws, chat_id, "retry")
        assert reply["type"] == "ack", reply
        await end_turn(gateway, chat_id, usage={"input_tokens": 100})
        await ws.wait_for(lambda f: f.get("type") == "turn_end")
        c = await conversation(gateway, user, chat_id)
        assert c["usage"]["billed"] == {"input_tokens": 130, "output_tokens": 5, "cost": 0.75}
        assert c["usage"]["active"] == {"input_tokens": 110, "output_tokens": 5, "cost": 0.25}
        assert c["message_count"] == 4

        reply, _ = await op(ws, chat_id, "switch", node_id=second)
        assert reply["type"] == "ack", reply
        c = await conversation(gateway, user, chat_id)
        assert c["usage"]["active"] == {"input_tokens": 30, "output_tokens": 5, "cost": 0.75}
        assert c["usage"]["billed"] == {"input_tokens": 130, "output_tokens": 5, "cost": 0.75}

        reply, _ = await op(ws, chat_id, "undo")
        assert reply["type"] == "ack", reply
        c = await conversation(gateway, user, chat_id)
        assert c["head"] == first
        assert c["usage"]["active"] == {"input_tokens": 10, "output_tokens": 5, "cost": 0.25}
        assert c["message_count"] == 2

        # A new subscriber's snapshot carries the same totals.
        async with connect(gateway.url(user)) as other:
            subscribed = await other.subscribe(chat_id)
            assert subscribed["snapshot"]["usage"] == c["usage"]
            assert subscribed["snapshot"]["message_count"] == 2


async def test_a_replayed_turn_end_is_counted_once(gateway: Any, user: str,
                                                   chat_id: str) -> None:
    await create(gateway, user, chat_id)
    async with connect(gateway.url(user)) as ws:
        await ws.subscribe(chat_id)
        await message_and_reply(ws, chat_id, "hi")
        end = {"type": "turn_end", "data": {"usage": {"output_tokens": 7}}}
        first = await publish(gateway, chat_id, end, key="end-1")
        again = await publish(gateway, chat_id, end, key="end-1")
        assert again["duplicate"] and again["seqs"] == first["seqs"]
        # Without its key, a second turn_end finds no running turn (and no turn to name).
        resp = await post_events(gateway, chat_id, end)
        assert resp.status_code == 409, resp.text
    c = await conversation(gateway, user, chat_id)
    assert c["usage"] == {"billed": {"output_tokens": 7}, "active": {"output_tokens": 7}}


async def test_a_turn_ended_before_its_agent_still_bills_once(gateway: Any, user: str,
                                                              chat_id: str) -> None:
    """A retry with ``cancel: true`` ends the running turn at once; the agent's own
    turn_end comes later, is refused, and its usage still counts in billed (only)."""
    await create(gateway, user, chat_id)
    async with connect(gateway.url(user)) as ws:
        await ws.subscribe(chat_id)
        await exchange(ws, gateway, chat_id, "warm up")
        ack, _ = await message_and_reply(ws, chat_id, "long task")
        running = ack["turn_id"]
        reply, _ = await op(ws, chat_id, "retry", cancel=True)
        assert reply["type"] == "ack", reply

        late = {"type": "turn_end", "data": {"turn_id": running, "usage": {"output_tokens": 40}}}
        resp = await post_events(gateway, chat_id, late)
        assert resp.status_code == 409, resp.text
        assert "usage was counted" in resp.json()["error"]["message"]
        feed = await ws.wait_for(lambda f: f.get("type") == "conversation"
                                 and f["usage"]["billed"].get("output_tokens") == 40)
        assert feed["usage"]["active"] == {}

        # The same late report again (a redelivery) counts nothing more.
        resp = await post_events(gateway, chat_id, late)
        assert resp.status_code == 409, resp.text
        assert "usage was counted" not in resp.json()["error"]["message"]
    c = await conversation(gateway, user, chat_id)
    assert c["usage"] == {"billed": {"output_tokens": 40}, "active": {}}


async def test_the_feed_carries_the_totals(gateway: Any, user: str, chat_id: str) -> None:
    await create(gateway, user, chat_id)
    async with connect(gateway.url(user)) as ws:
        await ws.subscribe(chat_id)
        await answer(ws, gateway, chat_id, "hi", {"input_tokens": 3})
        feed = await ws.wait_for(lambda f: f.get("type") == "conversation"
                                 and f["status"] == "idle" and f["message_count"] == 2)
        assert feed["usage"] == {"billed": {"input_tokens": 3}, "active": {"input_tokens": 3}}


async def test_an_error_ends_the_turn_with_its_message(gateway: Any, user: str,
                                                       chat_id: str) -> None:
    """``turn_end`` with ``reason: error`` carries ``error``, what went wrong in words,
    cut to 2000 characters; other reasons may carry none."""
    await create(gateway, user, chat_id)
    async with connect(gateway.url(user)) as ws:
        await ws.subscribe(chat_id)
        await message_and_reply(ws, chat_id, "hi")
        resp = await post_events(gateway, chat_id, {"type": "turn_end", "data": {
            "reason": "error", "error": "The model server is down. " + "x" * 3000}})
        assert resp.status_code == 200, resp.text
        end = await ws.wait_for(lambda f: f.get("type") == "turn_end")
    assert end["data"]["reason"] == "error"
    assert end["data"]["error"].startswith("The model server is down.")
    assert len(end["data"]["error"]) == 2000


OPENAI_USAGE = {"prompt_tokens": 9, "completion_tokens": 12, "total_tokens": 21,
                "prompt_tokens_details": {"cached_tokens": 3, "audio_tokens": 0},
                "completion_tokens_details": {"reasoning_tokens": 4}}


@pytest.mark.parametrize("usage, counted", [
    (OPENAI_USAGE, {"prompt_tokens": 9, "completion_tokens": 12, "total_tokens": 21,
                    "prompt_tokens_details.cached_tokens": 3,
                    "prompt_tokens_details.audio_tokens": 0,
                    "completion_tokens_details.reasoning_tokens": 4}),
    ({"model": "gpt-4o", "output_tokens": 5, "cached": True, "ids": [1, 2], "x": None},
     {"output_tokens": 5}),
    ({"input_tokens": -1, "cost": 10**16, "big": 2**70, "output_tokens": 2},
     {"output_tokens": 2}),
    ({"bad name!": 1, "n" * 65: 1, "ok": 1.5}, {"ok": 1.5}),
    ({f"n{i}": 1 for i in range(33)}, {f"n{i}": 1 for i in range(32)}),
    ({"a": {"b": {"c": {"d": 1, "e": {"f": 1}}}}}, {"a.b.c.d": 1}),
])
async def test_usage_as_providers_send_it_ends_the_turn_and_counts_its_numbers(
        gateway: Any, user: str, chat_id: str, usage: dict[str, Any],
        counted: dict[str, Any]) -> None:
    """Agents pass their provider's usage object as it comes: text, booleans and nested
    objects never keep the turn running. Its numbers are counted, nested ones under a
    dotted name; the rest is dropped, from the event too."""
    await create(gateway, user, chat_id)
    async with connect(gateway.url(user)) as ws:
        await ws.subscribe(chat_id)
        await message_and_reply(ws, chat_id, "hi")
        resp = await post_events(gateway, chat_id, {"type": "turn_end", "data": {"usage": usage}})
        assert resp.status_code == 200, resp.text
        end = await ws.wait_for(lambda f: f.get("type") == "turn_end")
    assert end["data"]["usage"] == counted
    c = await conversation(gateway, user, chat_id)
    assert c["status"] == "idle" and c["usage"]["billed"] == counted
