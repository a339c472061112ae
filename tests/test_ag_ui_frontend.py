"""AG-UI for frontends (``POST /v1/ag-ui``, gateway/ag_ui_frontend.py).

Everything is real: the shared ``gateway serve`` process, an in-process ``AgentWorker``
whose handler streams and commits (the AI SDK tests' handler, and a few commands of its
own), HTTP for the AG-UI client. ``test_the_ag_ui_client_drives_the_gateway`` runs
``@ag-ui/client``'s ``HttpAgent`` itself (``tests/js/ag-ui-client.live.mjs``) under Node.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from gateway.sdk.agent import Turn

from .steps import history
from .test_agent import agent_worker
from .test_ai_sdk import JS, WORDS, slow_answer, until_idle
from .test_ai_sdk import handler as ai_sdk_handler

pytestmark = pytest.mark.anyio

Event = dict[str, Any]
PATH = "/v1/ag-ui"
STATE = {"todo": ["milk"], "n": 1}
PONDER = "".join(f"r{i} " for i in range(WORDS // 2))  # reasoning, word by word
LISTENING: dict[str, asyncio.Event] = {}  # by chat: set once the test's reply shows a turn


async def handler(turn: Turn) -> None:
    """The AI SDK tests' answers, and: ``state`` (a state, a step, a custom event),
    ``ask`` (a client tool's question, no text), ``ponder`` (slow reasoning, then text)."""
    words = turn.text.split()
    if words[:1] == ["ponder"]:
        for word in PONDER.split():
            await turn.reasoning(word + " ")
            if await turn.sleep(0.05):
                break
        await turn.event("reasoning", {})  # commits what streamed
        await turn.message("pondered")
        await turn.end()
        return
    if words[:1] == ["state"]:
        # Steps are ephemeral: only a reply that listens sees them. It listens once it
        # shows the turn's first (durable) reasoning.
        await turn.reasoning("planning")
        await turn.event("reasoning", {})
        async with asyncio.timeout(10):
            await LISTENING[turn.chat_id].wait()
        await turn.event("step", {"name": "plan", "status": "started"}, durable=False)
        await turn.event("state", {"snapshot": STATE})
        await turn.event("custom", {"name": "ping", "value": {"k": 1}})
        await turn.event("step", {"name": "plan", "status": "finished"}, durable=False)
        await turn.message("stated")
        await turn.end()
    elif words[:1] == ["ask"]:  # asks a person, with no text first
        await turn.ask("approve", {"amount": 9})
    else:
        await ai_sdk_handler(turn)


@pytest.fixture
async def agent(redis_url: str, group: str) -> AsyncIterator[None]:
    async with agent_worker(redis_url, handler, group):
        yield


def user_message(text: str, message_id: str | None = None) -> Event:
    return {"id": message_id or uuid.uuid4().hex[:16], "role": "user", "content": text}


def run_input(chat_id: str, messages: list[Event], **extra: Any) -> Event:
    """What ``HttpAgent`` sends."""
    return {"threadId": chat_id, "runId": "run-" + uuid.uuid4().hex[:8], "messages": messages,
            "state": {}, "tools": [], "context": [], "forwardedProps": {}, **extra}


def parse(lines: list[str]) -> list[Event]:
    return [json.loads(line[6:]) for line in lines if line.startswith("data: ")]


async def post(http: httpx.AsyncClient, gw: Any, user: str, payload: Event,
               until: Any = None) -> tuple[httpx.Response, list[Event]]:
    """POST a run; read its events to the end, or until ``until(events)`` holds."""
    lines: list[str] = []
    async with http.stream("POST", PATH, json=payload, headers=gw.headers(user)) as response:
        if response.status_code != 200:
            await response.aread()
            return response, []
        async with asyncio.timeout(20):
            async for line in response.aiter_lines():
                lines.append(line)
                if until is not None and line.startswith("data: ") and until(parse(lines)):
                    break
    return response, parse(lines)


def kinds(events: list[Event]) -> list[str]:
    return [e["type"] for e in events]


def text_of(events: list[Event], kind: str = "TEXT_MESSAGE_CONTENT") -> str:
    return "".join(e["delta"] for e in events if e["type"] == kind)


def has_text(n: int) -> Any:
    return lambda events: len(text_of(events)) >= n


def check_order(events: list[Event]) -> None:
    """What ``@ag-ui/client`` verifies: RUN_STARTED first, each message and tool call
    opened once before its content and closed once, nothing open at the end, and the run
    ends with RUN_FINISHED or RUN_ERROR."""
    assert events[0]["type"] == "RUN_STARTED"
    assert events[-1]["type"] in ("RUN_FINISHED", "RUN_ERROR")
    assert [e["type"] for e in events].count("RUN_STARTED") == 1
    open_: dict[str, set[str]] = {"text": set(), "reasoning": set(), "call": set(),
                                  "step": set()}
    for event in events:
        kind = event["type"]
        key = str(event.get("messageId") or event.get("toolCallId") or event.get("stepName"))
        group, _, phase = {
            "TEXT_MESSAGE_START": "text:start", "TEXT_MESSAGE_CONTENT": "text:in",
            "TEXT_MESSAGE_END": "text:end", "REASONING_MESSAGE_START": "reasoning:start",
            "REASONING_MESSAGE_CONTENT": "reasoning:in", "REASONING_MESSAGE_END":
            "reasoning:end", "TOOL_CALL_START": "call:start", "TOOL_CALL_ARGS": "call:in",
            "TOOL_CALL_END": "call:end", "STEP_STARTED": "step:start",
            "STEP_FINISHED": "step:end"}.get(kind, "::").partition(":")
        if not group:
            continue
        if phase == "start":
            assert key not in open_[group], event
            open_[group].add(key)
        elif phase == "in":
            assert key in open_[group], event
        else:
            assert key in open_[group], event
            open_[group].discard(key)
    assert not any(open_.values()), open_


# --- a run ----------------------------------------------------------------------------------


async def test_a_run_is_the_turn_as_ag_ui_events(gateway: Any, agent: None, user: str,
                                                 chat_id: str) -> None:
    payload = run_input(chat_id, [user_message("hi there", "agui-1")])
    async with httpx.AsyncClient(base_url=gateway.http) as http:
        response, events = await post(http, gateway, user, payload)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    check_order(events)
    assert kinds(events)[:2] == ["RUN_STARTED", "MESSAGES_SNAPSHOT"]
    assert events[0]["threadId"] == chat_id and events[0]["runId"] == payload["runId"]
    assert events[1]["messages"] == [{"id": "agui-1", "role": "user", "content": "hi there"}]
    assert "STATE_SNAPSHOT" not in kinds(events)  # the conversation has no agent state
    assert text_of(events) == "Hello world"
    assert text_of(events, "REASONING_MESSAGE_CONTENT") == "thinking"
    assert kinds(events).count("REASONING_START") == kinds(events).count("REASONING_END") == 1
    [start] = [e for e in events if e["type"] == "TOOL_CALL_START"]
    [args] = [e for e in events if e["type"] == "TOOL_CALL_ARGS"]
    [result] = [e for e in events if e["type"] == "TOOL_CALL_RESULT"]
    assert start["toolCallName"] == "search" and json.loads(args["delta"]) == {"q": "hi there"}
    assert result["toolCallId"] == start["toolCallId"] and result["role"] == "tool"
    assert json.loads(result["content"]) == {"hits": 3}
    custom = {e["name"]: e["value"] for e in events if e["type"] == "CUSTOM"}
    assert custom["gateway.title"]["title"] == "A greeting"
    assert custom["gateway.goal_state"]["objective"] == "greet"
    finished = events[-1]
    assert finished["type"] == "RUN_FINISHED" and finished["runId"] == payload["runId"]
    assert finished["usage"] == [{"inputTokens": 5, "outputTokens": 7}]
    assert "outcome" not in finished


async def test_the_messages_snapshot_is_the_active_path_with_the_streamed_ids(
    gateway: Any, agent: None, user: str, chat_id: str
) -> None:
    async with httpx.AsyncClient(base_url=gateway.http) as http:
        first = [user_message("hi", "agui-a")]
        _, one = await post(http, gateway, user, run_input(chat_id, first))
        # The body holds made-up earlier messages: the log is the truth, not an error.
        made_up = [user_message("zzz", "x1"), {"id": "x2", "role": "assistant", "content": "?"}]
        _, two = await post(http, gateway, user,
                            run_input(chat_id, [*made_up, user_message("two", "agui-b")]))
        _, idle = await post(http, gateway, user, run_input(chat_id, []))
    check_order(two)
    streamed = {e["type"]: e for e in one}
    text_id = streamed["TEXT_MESSAGE_START"]["messageId"]
    reasoning_id = streamed["REASONING_MESSAGE_START"]["messageId"]
    call = streamed["TOOL_CALL_START"]
    result = streamed["TOOL_CALL_RESULT"]
    answer = [
        {"id": reasoning_id, "role": "reasoning", "content": "thinking"},
        {"id": call["parentMessageId"], "role": "assistant", "toolCalls": [
            {"id": call["toolCallId"], "type": "function",
             "function": {"name": "search", "arguments": '{"q":"hi"}'}}]},
        {"id": result["messageId"], "role": "tool", "toolCallId": call["toolCallId"],
         "content": '{"hits":3}'},
        {"id": text_id, "role": "assistant", "content": "Hello world"},
    ]
    snapshot = two[1]["messages"]  # the log's order: the reasoning is committed last
    assert snapshot[0] == {"id": "agui-a", "role": "user", "content": "hi"}
    assert snapshot[-1] == {"id": "agui-b", "role": "user", "content": "two"}
    assert sorted(snapshot[1:-1], key=lambda m: m["id"]) == sorted(answer, key=lambda m: m["id"])
    # Nothing new, no turn running: where the conversation stands, and the run is over.
    assert kinds(idle) == ["RUN_STARTED", "MESSAGES_SNAPSHOT", "RUN_FINISHED"]
    assert idle[1]["messages"][:6] == snapshot
    assert sorted(m["role"] for m in idle[1]["messages"][6:]) == [
        "assistant", "assistant", "reasoning", "tool"]
    texts = [e["data"]["text"] for e in await history(gateway, user, chat_id)
             if e["type"] == "user_message"]
    assert texts == ["hi", "two"]


async def test_state_steps_and_custom_events(gateway: Any, agent: None, user: str,
                                             chat_id: str) -> None:
    listening = LISTENING[chat_id] = asyncio.Event()

    def shows_the_turn(events: list[Event]) -> bool:
        if "REASONING_MESSAGE_CONTENT" in kinds(events):
            listening.set()
        return False  # read on to the end

    async with httpx.AsyncClient(base_url=gateway.http) as http:
        _, events = await post(http, gateway, user, run_input(chat_id, [user_message("state")]),
                               until=shows_the_turn)
        _, idle = await post(http, gateway, user, run_input(chat_id, []))
    check_order(events)
    order = [e["type"] for e in events if e["type"] in (
        "STEP_STARTED", "STATE_SNAPSHOT", "CUSTOM", "STEP_FINISHED", "TEXT_MESSAGE_START")]
    assert order == ["STEP_STARTED", "STATE_SNAPSHOT", "CUSTOM", "STEP_FINISHED",
                     "TEXT_MESSAGE_START"]
    assert next(e for e in events if e["type"] == "STATE_SNAPSHOT")["snapshot"] == STATE
    [custom] = [e for e in events if e["type"] == "CUSTOM"]
    assert custom["name"] == "ping" and custom["value"] == {"k": 1}
    assert text_of(events) == "stated"
    # The next run starts from the conversation's state.
    assert kinds(idle) == ["RUN_STARTED", "MESSAGES_SNAPSHOT", "STATE_SNAPSHOT", "RUN_FINISHED"]
    assert idle[2]["snapshot"] == STATE


async def test_the_request_names_the_agent_and_forwarded_props_reach_it(
    gateway: Any, redis_url: str, group: str, user: str, chat_id: str
) -> None:
    name = "agui-" + uuid.uuid4().hex[:8]

    async def named(turn: Turn) -> None:
        await turn.message(f"{name}: {json.dumps(turn.data, sort_keys=True)}")

    async with agent_worker(redis_url, named, group, name=name), \
            httpx.AsyncClient(base_url=gateway.http) as http:
        props = {"agent": name, "model": "small"}
        _, events = await post(http, gateway, user,
                               run_input(chat_id, [user_message("hi")], forwardedProps=props))
        meta = (await http.get(f"/v1/conversations/{chat_id}",
                               headers=gateway.headers(user))).json()
    assert meta["agent"] == name and meta["owner"] == user
    assert text_of(events) == name + ': {"props": {"model": "small"}}'


# --- failures, resends, reconnects ------------------------------------------------------------


async def test_a_failed_turn_ends_with_run_error(gateway: Any, agent: None, user: str,
                                                 chat_id: str) -> None:
    async with httpx.AsyncClient(base_url=gateway.http) as http:
        _, events = await post(http, gateway, user, run_input(chat_id, [user_message("fail")]))
    check_order(events)
    assert text_of(events) == "about to"
    assert events[-1] == {"type": "RUN_ERROR", "code": "error",
                          "message": "The agent failed while answering (RuntimeError)."}
    assert "RUN_FINISHED" not in kinds(events)


async def test_a_resent_message_is_stored_once(gateway: Any, agent: None, user: str,
                                               chat_id: str) -> None:
    payload = run_input(chat_id, [user_message("slow please", "agui-again")])
    async with httpx.AsyncClient(base_url=gateway.http) as http:
        await post(http, gateway, user, payload, until=has_text(3))
        _, during = await post(http, gateway, user, payload)  # the same turn, whole
        await until_idle(gateway, user, chat_id)
        _, after = await post(http, gateway, user, payload)  # over: the snapshot has it
    check_order(during)
    assert text_of(during) == slow_answer()
    assert during[1]["messages"] == [{"id": "agui-again", "role": "user",
                                      "content": "slow please"}]
    assert kinds(after) == ["RUN_STARTED", "MESSAGES_SNAPSHOT", "RUN_FINISHED"]
    assert [m["content"] for m in after[1]["messages"]] == ["slow please", slow_answer()]
    events = await history(gateway, user, chat_id)
    assert [e["type"] for e in events].count("user_message") == 1
    assert [e["type"] for e in events].count("turn_start") == 1


async def test_a_reconnect_mid_answer_gets_each_character_once(
    gateway: Any, agent: None, user: str, chat_id: str
) -> None:
    """The client drops its reply mid-answer and runs again with what it holds (its
    partial answer included): the snapshot drops that partial, and the turn comes from its
    start, each piece once, live to its end; a second device at once gets the same."""
    sent = user_message("slow", "agui-slow")
    async with httpx.AsyncClient(base_url=gateway.http) as http:
        _, first = await post(http, gateway, user, run_input(chat_id, [sent]),
                              until=has_text(12))
        partial = next(e["messageId"] for e in first if e["type"] == "TEXT_MESSAGE_START")
        held = [sent, {"id": partial, "role": "assistant", "content": text_of(first)}]
        (_, again), (_, other) = await asyncio.gather(
            post(http, gateway, user, run_input(chat_id, held)),
            post(http, gateway, user, run_input(chat_id, [])))
    for events in (again, other):
        check_order(events)
        assert events[1]["messages"] == [{"id": "agui-slow", "role": "user", "content": "slow"}]
        assert text_of(events) == slow_answer()
        assert [e["messageId"] for e in events if e["type"] == "TEXT_MESSAGE_START"] == [partial]
        assert events[-1]["type"] == "RUN_FINISHED"
        assert events[-1]["usage"] == [{"outputTokens": WORDS}]


async def test_a_reconnect_mid_reasoning_empties_the_reasoning_it_replays(
    gateway: Any, agent: None, user: str, chat_id: str
) -> None:
    """AG-UI clients keep the reasoning they hold when a snapshot has none: the snapshot
    holds the running turn's reasoning emptied, so the replay fills it once."""
    sent = user_message("ponder", "agui-ponder")
    some = lambda events: len(text_of(events, "REASONING_MESSAGE_CONTENT")) >= 6  # noqa: E731
    async with httpx.AsyncClient(base_url=gateway.http) as http:
        _, first = await post(http, gateway, user, run_input(chat_id, [sent]), until=some)
        partial = next(e["messageId"] for e in first if e["type"] == "REASONING_START")
        held = [sent, {"id": partial, "role": "reasoning",
                       "content": text_of(first, "REASONING_MESSAGE_CONTENT")}]
        _, again = await post(http, gateway, user, run_input(chat_id, held))
    check_order(again)
    assert again[1]["messages"] == [{"id": "agui-ponder", "role": "user", "content": "ponder"},
                                    {"id": partial, "role": "reasoning", "content": ""}]
    assert text_of(again, "REASONING_MESSAGE_CONTENT") == PONDER
    assert text_of(again) == "pondered"


# --- client tools -------------------------------------------------------------------------------


async def test_a_client_tool_answered_with_a_tool_message_and_with_resume(
    gateway: Any, agent: None, user: str, chat_id: str
) -> None:
    async with httpx.AsyncClient(base_url=gateway.http) as http:
        headers = gateway.headers(user)
        await http.post("/v1/conversations", json={"chat_id": chat_id}, headers=headers)
        tools = [{"name": "approve", "parameters": {"type": "object"}}]
        (await http.patch(f"/v1/conversations/{chat_id}", json={"client_tools": tools},
                          headers=headers)).raise_for_status()
        asked_by = user_message("pay the bill", "agui-pay")
        _, asked = await post(http, gateway, user, run_input(chat_id, [asked_by]))
        [call] = [e for e in asked if e["type"] == "TOOL_CALL_START"]
        answer = {"id": "agui-answer", "role": "tool", "toolCallId": call["toolCallId"],
                  "content": '"yes"'}
        messages = [*asked[1]["messages"], answer]
        _, went_on = await post(http, gateway, user, run_input(chat_id, messages))
        # Sent again: answered already, and its turn is over: nothing new.
        _, again = await post(http, gateway, user, run_input(chat_id, messages))
        # Another question, answered with `resume` (the interrupt id: the call id).
        _, asked2 = await post(http, gateway, user, run_input(chat_id, [user_message("ask")]))
        [call2] = [e for e in asked2 if e["type"] == "TOOL_CALL_START"]
        resume = [{"interruptId": call2["toolCallId"], "status": "resolved",
                   "payload": {"ok": True}}]
        _, resumed = await post(http, gateway, user, run_input(chat_id, [], resume=resume))
        late = await http.post(PATH, headers=headers, json=run_input(chat_id, [], resume=[
            {"interruptId": "call_nope", "status": "resolved", "payload": 1}]))
    check_order(asked)
    assert call["toolCallName"] == "approve"
    assert asked[-1]["outcome"] == {"type": "success", "pendingToolCallIds": [call["toolCallId"]]}
    check_order(went_on)
    assert text_of(went_on) == "paid: yes"
    assert went_on[1]["messages"][-1]["role"] == "tool"
    assert went_on[1]["messages"][-1]["content"] == "yes"
    assert kinds(again) == ["RUN_STARTED", "MESSAGES_SNAPSHOT", "RUN_FINISHED"]
    assert asked2[-1]["outcome"]["pendingToolCallIds"] == [call2["toolCallId"]]
    assert text_of(resumed) == "paid: {'ok': True}"
    assert resumed[1]["messages"][-1]["content"] == '{"ok":true}'
    assert late.status_code == 409 and late.json()["error"]["code"] == "conflict"
    results = [e["data"] for e in await history(gateway, user, chat_id)
               if e["type"] == "tool_result"]
    assert [r["result"] for r in results] == ["yes", {"ok": True}]


# --- refusals, CORS, the document -----------------------------------------------------------


async def test_bad_bodies_get_the_apis_errors(gateway: Any, agent: None, user: str,
                                              chat_id: str) -> None:
    other = "u-other-" + uuid.uuid4().hex[:6]
    async with httpx.AsyncClient(base_url=gateway.http) as http:
        headers = gateway.headers(user)

        async def refused(status: int, code: str, content: bytes | None = None,
                          payload: Any = None, who: dict[str, str] | None = None) -> None:
            response = await http.post(PATH, content=content, json=payload,
                                       headers=headers if who is None else who)
            assert response.status_code == status, response.text
            assert response.json()["error"]["code"] == code, response.text
            assert set(response.json()) == {"error"}

        good = run_input(chat_id, [user_message("x")])
        await refused(400, "invalid_request", content=b"{not json")
        await refused(422, "unprocessable", payload=[1, 2])
        await refused(422, "unprocessable", payload={"runId": "r", "messages": []})
        await refused(422, "unprocessable", payload={**good, "threadId": "bad id!"})
        await refused(422, "unprocessable", payload={**good, "messages": [{"id": "m"}]})
        await refused(422, "unprocessable",
                      payload={**good, "messages": [{"id": "m", "role": "robot"}]})
        await refused(422, "unprocessable", payload={**good, "forwardedProps": {"agent": "Bad!"}})
        await refused(400, "invalid_request", payload={**good, "messages": [
            {"id": "m", "role": "user", "content": [
                {"type": "image", "source": {"type": "url", "value": "http://x/y.png"}}]}]})
        await refused(401, "unauthorized", payload=good, who={})
        await refused(413, "payload_too_large", content=b"x" * ((8 << 20) + 1))
        # Someone else's conversation.
        await http.post("/v1/conversations", json={"chat_id": chat_id},
                        headers=gateway.headers(other))
        await refused(403, "forbidden", payload=good)
        assert await history(gateway, other, chat_id) == []
        # A message while a turn runs.
        mine = "agui-busy-" + uuid.uuid4().hex[:6]
        await post(http, gateway, user, run_input(mine, [user_message("wait")]),
                   until=lambda events: "TEXT_MESSAGE_CONTENT" in kinds(events))
        busy = await http.post(PATH, json=run_input(mine, [user_message("hi")]), headers=headers)
        await http.post(f"/v1/ai-sdk/chat/{mine}/stop", headers=headers)
    assert busy.status_code == 409 and busy.json()["error"]["code"] == "turn_in_progress"


async def test_cors_for_the_origins_the_operator_allows(gateway: Any, user: str,
                                                        chat_id: str) -> None:
    async with httpx.AsyncClient(base_url=gateway.http) as http:
        asked = await http.options(PATH, headers={
            "Origin": "http://good.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"})
        assert asked.status_code == 204
        assert asked.headers["access-control-allow-origin"] == "http://good.example"
        bad = await http.options(PATH, headers={
            "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
        assert bad.status_code == 403 and "access-control-allow-origin" not in bad.headers
        good = {"Origin": "http://good.example", **gateway.headers(user)}
        async with http.stream("POST", PATH, json=run_input(chat_id, []), headers=good) as reply:
            assert reply.headers["access-control-allow-origin"] == "http://good.example"
            await reply.aread()
        refused = await http.post(PATH, content=b"{", headers=good)
        assert refused.status_code == 400
        assert refused.headers["access-control-allow-origin"] == "http://good.example"


# --- @ag-ui/client itself, under Node ---------------------------------------------------------


@pytest.mark.skipif(shutil.which("node") is None, reason="needs Node.js")
async def test_the_ag_ui_client_drives_the_gateway(gateway: Any, agent: None,
                                                   user: str) -> None:
    """``tests/js/ag-ui-client.live.mjs``: ``HttpAgent`` against this gateway (a run, a
    tool call, a client tool answered, a reconnect mid-answer and mid-reasoning)."""
    if not (JS / "node_modules" / "@ag-ui" / "client").is_dir():
        pytest.skip("tests/js needs `npm install` (scripts/test does it)")
    env = {**os.environ, "GATEWAY_HTTP": gateway.http, "GATEWAY_TOKEN": gateway.token(user),
           "SLOW_ANSWER": slow_answer(), "PONDER": PONDER}
    proc = await asyncio.create_subprocess_exec(
        "node", "--test", "--test-reporter=spec", "ag-ui-client.live.mjs", cwd=JS, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    async with asyncio.timeout(120):
        output, _ = await proc.communicate()
    assert proc.returncode == 0, output.decode()
    assert b"pass 4" in output and b"fail 0" in output, output.decode()
