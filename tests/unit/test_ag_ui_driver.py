"""The AG-UI driver's pure parts: messages in, events read, what each event publishes."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from gateway.sdk.drivers.ag_ui import AgentError, AgUiAgent, _Run, agui_messages, parse_event


class FakeTurn:
    """What a run publishes, in order, as (kind, data)."""

    def __init__(self, state: Any = None) -> None:
        self.state = state
        self.cancel_event = asyncio.Event()
        self.published: list[tuple[str, Any]] = []
        self.client_tools: list[Any] = []  # none: every call is a plain tool_call

    async def delta(self, text: str) -> None:
        self.published.append(("delta", text))

    async def reasoning(self, text: str) -> None:
        self.published.append(("reasoning_delta", text))

    async def message(self) -> None:
        self.published.append(("message", None))

    async def event(self, kind: str, data: dict[str, Any], durable: bool = True) -> None:
        self.published.append((kind, data))

    async def tool_call(self, name: str, args: Any, call_id: str | None = None) -> None:
        self.published.append(("tool_call", {"call_id": call_id, "name": name, "args": args}))

    async def tool_result(self, call_id: str, result: Any) -> None:
        self.published.append(("tool_result", {"call_id": call_id, "result": result}))


def run_events(events: list[dict[str, Any]], state: Any = None) -> tuple[list[Any], Any]:
    turn = FakeTurn(state)
    run = _Run(AgUiAgent("http://agent.test/run"), turn)  # type: ignore[arg-type]

    async def go() -> Any:
        ending = None
        for raw in events:
            event = parse_event(json.dumps(raw))
            if event is not None:
                ending = await run.on(event) or ending
        return ending

    return turn.published, asyncio.run(go())


def test_history_becomes_agui_messages_with_their_ids() -> None:
    history = [
        {"role": "user", "content": "weather?", "msg_id": "m1", "id": "m1"},
        {"role": "assistant", "content": "", "id": "e3",
         "tool_calls": [{"id": "c1", "name": "forecast", "args": {"city": "Lisbon"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": {"sky": "sunny"}, "id": "e4"},
        {"role": "assistant", "content": "Sunny.", "id": "e5", "partial": True},
    ]
    dumped = [m.model_dump(mode="json", by_alias=True) for m in agui_messages(history)]
    assert dumped == [
        {"id": "m1", "role": "user", "content": "weather?"},
        {"id": "e3", "role": "assistant", "toolCalls": [
            {"id": "c1", "type": "function",
             "function": {"name": "forecast", "arguments": '{"city": "Lisbon"}'}}]},
        {"id": "e4", "role": "tool", "toolCallId": "c1", "content": '{"sky": "sunny"}'},
        {"id": "e5", "role": "assistant", "content": "Sunny."},
    ]


def test_events_are_parsed_with_the_packages_types() -> None:
    assert parse_event('{"type": "SOMETHING_NEWER", "x": 1}') is None  # skipped
    legacy = parse_event('{"type": "THINKING_TEXT_MESSAGE_CONTENT", "delta": "hm"}')
    assert legacy is not None and legacy.type.value == "REASONING_MESSAGE_CONTENT"
    for bad, why in [("{nope", "not JSON"), ("[1]", "without a type"),
                     ('{"type": "TEXT_MESSAGE_CONTENT"}', "TEXT_MESSAGE_CONTENT event that "
                                                          "does not parse")]:
        with pytest.raises(AgentError, match=why):
            parse_event(bad)


def test_the_options_are_checked_and_headers_never_shown() -> None:
    with pytest.raises(ValueError):
        AgUiAgent("")
    with pytest.raises(ValueError):
        AgUiAgent("http://x", idle_timeout=0)
    agent = AgUiAgent("https://user:pw@agent.test:8443/run?key=k", headers={"K": "secret"})
    assert repr(agent) == "<AgUiAgent at https://agent.test:8443/run>"
    assert agent.kind == "ag-ui"


def test_messages_calls_and_state_at_their_edges() -> None:
    published, ending = run_events([
        {"type": "TEXT_MESSAGE_START", "messageId": "a"},
        {"type": "TEXT_MESSAGE_CONTENT", "messageId": "a", "delta": "one"},
        {"type": "TEXT_MESSAGE_CONTENT", "messageId": "b", "delta": "two"},  # a new message
        {"type": "TOOL_CALL_START", "toolCallId": "c1", "toolCallName": "f"},
        {"type": "TOOL_CALL_ARGS", "toolCallId": "c1", "delta": "not json"},
        {"type": "TOOL_CALL_END", "toolCallId": "c1"},
        {"type": "TOOL_CALL_RESULT", "messageId": "r", "toolCallId": "c1",
         "content": [{"type": "text", "text": "ok"}]},
        {"type": "STATE_DELTA", "delta": [{"op": "replace", "path": "/missing", "value": 1}]},
        {"type": "STATE_DELTA", "delta": [{"op": "add", "path": "/n", "value": 1}]},
        {"type": "TOOL_CALL_START", "toolCallId": "c2", "toolCallName": "g"},
        {"type": "TOOL_CALL_ARGS", "toolCallId": "c2", "delta": '{"x": 1}'},
        {"type": "RUN_FINISHED", "threadId": "t", "runId": "r",
         "usage": [{"inputTokens": 3, "outputTokens": 4, "cachedInputTokens": 1},
                   {"inputTokens": 1, "outputTokens": 1}]},
    ], state={"k": "v"})
    assert published == [
        ("delta", "one"), ("message", None),  # message a, committed as b starts
        ("delta", "two"),  # b stays open across the call: committed at RUN_FINISHED
        ("tool_call", {"call_id": "c1", "name": "f", "args": "not json"}),  # kept as text
        ("tool_result", {"call_id": "c1", "result": [{"type": "text", "text": "ok"}]}),
        # the patch that does not apply is skipped; the next applies to the state so far
        ("state", {"snapshot": {"k": "v", "n": 1}}),
        ("message", None),
        ("tool_call", {"call_id": "c2", "name": "g", "args": {"x": 1}}),  # never ENDed
    ]
    assert ending.error is None
    assert ending.usage == {"input_tokens": 4, "output_tokens": 5, "cached_tokens": 1}


def test_run_error_leaves_open_text_to_the_gateway() -> None:
    published, ending = run_events([
        {"type": "TEXT_MESSAGE_CHUNK", "messageId": "a", "delta": "par"},
        {"type": "TEXT_MESSAGE_CHUNK", "delta": "tial"},
        {"type": "RUN_ERROR", "message": "  "},
    ])
    # Not committed: the gateway keeps it as the partial answer when the turn ends.
    assert published == [("delta", "par"), ("delta", "tial")]
    assert ending.error == "The agent reported an error."
