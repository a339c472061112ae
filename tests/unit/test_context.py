"""An agent's context window: legal suffixes within budgets."""

from __future__ import annotations

from typing import Any

from gateway.sdk.context import messages_of, tokens, window


def ev(kind: str, **data: Any) -> dict[str, Any]:
    return {"type": kind, "data": data}


EXCHANGE = [{**event, "seq": seq} for seq, event in enumerate([
    ev("user_message", text="weather?", msg_id="m1"),
    ev("turn_start", turn_id="t1"),
    ev("tool_call", call_id="c1", name="forecast", args={"city": "Lisbon"}),
    ev("tool_result", call_id="c1", result="sunny"),
    ev("message", text="Sunny."),
    ev("turn_end", reason="complete"),
    ev("user_message", text="and tomorrow?", msg_id="m2"),
    ev("message", text="Rain, then", partial=True),
    ev("message", text=""),  # nothing in it: dropped
    ev("title", title="Weather"),
], 1)]


def test_events_become_chat_messages_with_roles_and_stable_ids() -> None:
    # ids: a user message's msg_id, else "e" + the seq of the event it comes from.
    assert messages_of(EXCHANGE) == [
        {"role": "user", "content": "weather?", "msg_id": "m1", "id": "m1"},
        {"role": "assistant", "content": "", "id": "e3",
         "tool_calls": [{"id": "c1", "name": "forecast", "args": {"city": "Lisbon"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny", "id": "e4"},
        {"role": "assistant", "content": "Sunny.", "id": "e5"},
        {"role": "user", "content": "and tomorrow?", "msg_id": "m2", "id": "m2"},
        {"role": "assistant", "content": "Rain, then", "partial": True, "id": "e8"},
    ]
    assert messages_of(EXCHANGE) == messages_of(EXCHANGE)  # the same ids on every read


def test_the_message_budget_never_starts_mid_turn() -> None:
    messages = messages_of(EXCHANGE)
    # The last 5 would start at the tool result, an orphan: the window starts at m2.
    assert [m["role"] for m in window(messages, max_messages=5)] == ["user", "assistant"]
    assert window(messages, max_messages=6) == messages
    assert window(messages, max_messages=0) == messages  # 0: no message budget


def test_the_token_budget_applies_from_the_tail_after_the_message_budget() -> None:
    messages = [{"role": "user", "content": "x" * 400, "msg_id": "a"},
                {"role": "assistant", "content": "y" * 400},
                {"role": "user", "content": "short", "msg_id": "b"},
                {"role": "assistant", "content": "ok"}]
    tail = tokens(messages[2]) + tokens(messages[3])
    assert window(messages, max_tokens=tail) == messages[2:]
    assert window(messages, max_tokens=tail - 1) == []  # the last exchange alone is over
    assert window(messages, max_messages=3, max_tokens=10_000) == messages[2:]
