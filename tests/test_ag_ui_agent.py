"""AG-UI agents driven by the gateway (gateway.sdk.drivers.ag_ui), end to end.

Everything is real: a real AG-UI agent (pydantic-ai's ``AGUIAdapter`` over a
``FunctionModel``, tests/agui_server.py) served by uvicorn in the test (a child process
where it is killed), the shared ``gateway serve`` process, the agent worker (in the test, or
as a ``gateway agent`` child process to SIGKILL), and WebSocket clients.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest

from gateway.sdk.agent import AgentWorker, Turn
from gateway.sdk.drivers.ag_ui import AgUiAgent

from .agui_server import Recorder, serving
from .conftest import free_port
from .steps import APPROVE, declare_tools, history, op, send_message
from .test_agent import ROOT, agent_process, agent_worker, of_type, until_turn_end
from .wsclient import Client, Frame, connect

pytestmark = pytest.mark.anyio

SECRET = "s3cret-header-value"


class _AgentFromEnv:
    """The AG-UI agent at ``$AGUI_TEST_URL``: a handler ``gateway agent`` imports by name
    (tests.test_ag_ui_agent:agent_from_env), the URL known only once the test runs."""

    async def __call__(self, turn: Turn) -> None:
        await AgUiAgent(os.environ["AGUI_TEST_URL"])(turn)


agent_from_env = _AgentFromEnv()


# --- helpers ------------------------------------------------------------------------------


@asynccontextmanager
async def driven(redis_url: str, group: str, agent: AgUiAgent,
                 **options: Any) -> AsyncIterator[AgentWorker]:
    async with agent_worker(redis_url, agent, group, **options) as worker:
        yield worker


@asynccontextmanager
async def chatting(gateway: Any, redis_url: str, group: str, user: str, chat_id: str,
                   route: str = "/agent") -> AsyncIterator[tuple[Client, Recorder]]:
    """The test agent served, a worker driving it, and a client subscribed to ``chat_id``:
    yields the client and what the agent was sent."""
    async with serving() as (base, agent), \
            driven(redis_url, group, AgUiAgent(f"{base}{route}")), \
            connect(gateway.url(user)) as ws:
        await ws.subscribe(chat_id)
        yield ws, agent


async def turn_frames(ws: Client, chat_id: str, text: str, within: float = 10.0,
                      **extra: Any) -> list[Frame]:
    await send_message(ws, chat_id, text, **extra)
    return await until_turn_end(ws, chat_id, within)


def outcome(frames: list[Frame]) -> list[tuple[str, Any]]:
    """What a turn published, streamed pieces and the message's own frames left out."""
    return [(f["type"], f["data"]) for f in frames
            if f["type"] not in ("ack", "user_message", "turn_start", "head", "delta",
                                 "reasoning_delta")]


def streamed(frames: list[Frame], kind: str = "delta") -> str:
    return "".join(f["data"]["text"] for f in frames if f["type"] == kind)


def words(n: int) -> str:
    return "".join(f"w{i} " for i in range(n))


@asynccontextmanager
async def agent_server_process() -> AsyncIterator[tuple[asyncio.subprocess.Process, str]]:
    """The AG-UI agent as a child process (to kill): yields it and its base URL."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.agui_server", cwd=ROOT, stdout=asyncio.subprocess.PIPE)
    try:
        assert proc.stdout is not None
        async with asyncio.timeout(20):
            port = int(await proc.stdout.readline())
        yield proc, f"http://127.0.0.1:{port}"
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()


# --- the mapping, event by event -------------------------------------------------------------


async def test_text_and_a_tool_call_then_a_turn_that_sees_them(
    gateway: Any, redis_url: str, group: str, user: str, chat_id: str
) -> None:
    async with chatting(gateway, redis_url, group, user, chat_id) as (ws, agent):
        first = await turn_frames(ws, chat_id, "tool please",
                                  data={"props": {"units": "metric"}})
        second = await turn_frames(ws, chat_id, "and now?")

    ack = of_type(first, "ack")[0]
    run = agent.inputs[0]
    assert run["threadId"] == chat_id and run["runId"].startswith(ack["turn_id"] + ".")
    assert run["messages"] == [{"id": ack["msg_id"], "role": "user", "content": "tool please"}]
    assert (run["state"], run["tools"], run["context"]) == ({}, [], [])
    assert run["forwardedProps"] == {"units": "metric"}
    assert run["protocolVersion"] == "1.0"
    assert agent.headers[0]["accept"] == "text/event-stream"

    call = {"call_id": "call_forecast", "name": "forecast", "args": {"city": "Lisbon"}}
    result = '{"city":"Lisbon","sky":"sunny"}'  # the content as the agent sent it
    message = of_type(first, "message")[0]
    # The empty message pydantic-ai opens before its tool call commits nothing.
    assert outcome(first) == [
        ("tool_call", call), ("tool_result", {"call_id": "call_forecast", "result": result}),
        ("message", {"text": "It is sunny in Lisbon.", "stream_id": message["data"]["stream_id"]}),
        ("turn_end", first[-1]["data"])]
    assert streamed(first) == "It is sunny in Lisbon."
    assert first[-1]["data"]["reason"] == "complete"
    # RUN_FINISHED's usage (a report per model), summed under the gateway's names.
    usage = first[-1]["data"]["usage"]
    assert set(usage) == {"input_tokens", "output_tokens", "total_tokens"}, usage
    assert usage["output_tokens"] > 0
    assert usage["input_tokens"] + usage["output_tokens"] == usage["total_tokens"]
    assert all(f["node"] == ack["turn_id"] for f in first
               if f["type"] in ("tool_call", "tool_result", "message", "turn_end"))

    # The second run gets the whole path, with the ids history gives every message.
    seq = {f["type"]: f["seq"] for f in first if f.get("seq") is not None}
    ack2 = of_type(second, "ack")[0]
    assert agent.inputs[1]["messages"] == [
        {"id": ack["msg_id"], "role": "user", "content": "tool please"},
        {"id": f"e{seq['tool_call']}", "role": "assistant", "toolCalls": [
            {"id": "call_forecast", "type": "function",
             "function": {"name": "forecast", "arguments": '{"city": "Lisbon"}'}}]},
        {"id": f"e{seq['tool_result']}", "role": "tool", "toolCallId": "call_forecast",
         "content": result},
        {"id": f"e{seq['message']}", "role": "assistant", "content": "It is sunny in Lisbon."},
        {"id": ack2["msg_id"], "role": "user", "content": "and now?"}]
    assert agent.inputs[1]["forwardedProps"] == {}
    assert of_type(second, "message")[0]["data"]["text"] == "You said: and now?"


async def test_reasoning_steps_custom_events_and_chunks(
    gateway: Any, redis_url: str, group: str, user: str, chat_id: str
) -> None:
    async with chatting(gateway, redis_url, group, user, chat_id) as (ws, _):
        frames = await turn_frames(ws, chat_id, "everything")

    def sid(n: int) -> str:
        return str(of_type(frames, "message")[n]["data"]["stream_id"])

    reasoning = of_type(frames, "reasoning")[0]["data"]
    # RAW and MESSAGES_SNAPSHOT publish nothing; steps are ephemeral (no seq).
    assert outcome(frames) == [
        ("reasoning", {"text": "Let me think hard.", "stream_id": reasoning["stream_id"]}),
        ("message", {"text": "Checking. ", "stream_id": sid(0)}),
        ("tool_call", {"call_id": "call_extras", "name": "extras", "args": {}}),
        ("tool_result", {"call_id": "call_extras", "result": "extras sent"}),
        ("step", {"name": "search", "status": "started"}),
        ("custom", {"name": "card", "value": {"title": "Lisbon", "stars": 5}}),
        ("step", {"name": "search", "status": "finished"}),
        # TEXT_MESSAGE_CHUNK and TOOL_CALL_CHUNK: a message and a call like any other
        ("message", {"text": "chunk one, chunk two", "stream_id": sid(1)}),
        ("tool_call", {"call_id": "call_chunk", "name": "lookup", "args": {"q": "hotels"}}),
        ("message", {"text": "All done.", "stream_id": sid(2)}),
        ("turn_end", frames[-1]["data"])]
    assert streamed(frames, "reasoning_delta") == "Let me think hard."
    assert streamed(frames) == "Checking. chunk one, chunk twoAll done."
    assert [f["seq"] for f in of_type(frames, "step")] == [None, None]
    assert frames[-1]["data"]["reason"] == "complete"
    stored = [e["type"] for e in await history(gateway, user, chat_id)]
    assert "step" not in stored and stored.count("message") == 3


async def test_legacy_thinking_events_are_reasoning(
    gateway: Any, redis_url: str, group: str, user: str, chat_id: str
) -> None:
    """An agent on AG-UI 0.1.10 sends THINKING_* (no message ids): read as REASONING_*."""
    async with chatting(gateway, redis_url, group, user, chat_id, "/legacy") as (ws, _):
        frames = await turn_frames(ws, chat_id, "think")
    assert [(t, d.get("text")) for t, d in outcome(frames)] == [
        ("reasoning", "Let me think hard."), ("message", "Thought."), ("turn_end", None)]


async def test_state_is_kept_hydrated_and_given_to_the_next_run(
    gateway: Any, redis_url: str, group: str, user: str, chat_id: str
) -> None:
    async with chatting(gateway, redis_url, group, user, chat_id) as (ws, agent):
        first = await turn_frames(ws, chat_id, "state")
        async with connect(gateway.url(user)) as other:  # a new device
            hydrated = (await other.subscribe(chat_id))["snapshot"]["state"]
        second = await turn_frames(ws, chat_id, "state again")

    # STATE_SNAPSHOT as it came, then STATE_DELTA applied to it: one event per change.
    after = {"runs": 1, "steps": ["search", "book"], "done": False}
    assert [f["data"] for f in of_type(first, "state")] == [
        {"snapshot": {"runs": 1, "steps": ["search"]}}, {"snapshot": after}]
    assert all("node" not in f for f in of_type(first, "state"))  # the conversation's
    assert hydrated == after
    assert agent.inputs[0]["state"] == {} and agent.inputs[1]["state"] == after
    assert [f["data"]["snapshot"] for f in of_type(second, "state")] == [
        {"runs": 2, "steps": ["search"], "done": False},
        {"runs": 2, "steps": ["search", "book"], "done": False}]
    assert [f["data"]["reason"] for f in (first[-1], second[-1])] == ["complete", "complete"]


async def test_run_error_ends_the_turn_with_the_agents_message(
    gateway: Any, redis_url: str, group: str, user: str, chat_id: str
) -> None:
    async with chatting(gateway, redis_url, group, user, chat_id) as (ws, _):
        frames = await turn_frames(ws, chat_id, "fail")
    end = frames[-1]["data"]
    assert (end["reason"], end["error"]) == ("error", "the model is out of coffee")
    assert [m["data"]["text"] for m in of_type(frames, "message")] == ["Let me "]


# --- the conversation tree ----------------------------------------------------------------


async def test_a_retry_and_an_edit_see_the_right_path(
    gateway: Any, redis_url: str, group: str, user: str, chat_id: str
) -> None:
    async with chatting(gateway, redis_url, group, user, chat_id) as (ws, agent):
        first = await turn_frames(ws, chat_id, "first")
        second = await turn_frames(ws, chat_id, "second")
        retried, _ = await op(ws, chat_id, "retry")
        await until_turn_end(ws, chat_id)
        m1 = of_type(first, "ack")[0]["msg_id"]
        edited, _ = await op(ws, chat_id, "edit", msg_id=m1, text="first, edited")
        await until_turn_end(ws, chat_id)

    path = agent.inputs[1]["messages"]
    assert [m["content"] for m in path] == ["first", "You said: first", "second"]
    assert path[0]["id"] == m1 and path[2]["id"] == of_type(second, "ack")[0]["msg_id"]
    # The retry sees what the turn it replaces saw, ids included; it is a run of its own.
    assert agent.inputs[2]["messages"] == path
    assert agent.inputs[2]["runId"].startswith(retried["turn_id"] + ".")
    assert agent.inputs[2]["runId"] != agent.inputs[1]["runId"]
    assert agent.inputs[3]["messages"] == [
        {"id": edited["msg_id"], "role": "user", "content": "first, edited"}]


# --- stop -----------------------------------------------------------------------------------


async def test_stop_mid_answer_closes_the_request_and_keeps_the_partial(
    gateway: Any, redis_url: str, group: str, user: str, chat_id: str
) -> None:
    async with chatting(gateway, redis_url, group, user, chat_id) as (ws, agent):
        await send_message(ws, chat_id, "slow 1000")  # 10 s of words
        frames = [await ws.wait_for(lambda f: f["type"] == "delta")]
        await ws.send({"type": "cancel", "chat_id": chat_id})
        frames += await until_turn_end(ws, chat_id, within=3)
        async with asyncio.timeout(3):
            await agent.gone.wait()  # the agent saw its client go away
    assert agent.disconnects == 1
    assert frames[-1]["data"]["reason"] == "cancelled"
    [partial] = of_type(frames, "message")
    assert partial["data"]["partial"] is True
    assert partial["data"]["text"] == streamed(frames)
    assert words(1000).startswith(partial["data"]["text"]) and partial["data"]["text"]


async def test_a_turn_ended_under_the_run_stops_it(
    gateway: Any, redis_url: str, group: str, user: str, chat_id: str
) -> None:
    """An edit with ``cancel: true`` ends the turn mid-answer. Here the worker does not
    hear the cancel, so the run's next publish is refused as the turn is over (TurnOver,
    met by the Turn's background flush): that stops the run and closes the request too,
    and nothing lands in the edit's turn."""
    async with serving() as (base, agent):
        driver = AgUiAgent(f"{base}/agent")

        async def deaf(turn: Turn) -> None:
            turn.cancel = lambda: None  # type: ignore[method-assign]
            await driver(turn)

        async with agent_worker(redis_url, deaf, group, concurrency=2) as worker, \
                connect(gateway.url(user)) as ws:
            await ws.subscribe(chat_id)
            await send_message(ws, chat_id, "slow 1000")
            ack = await ws.wait_for(lambda f: f["type"] == "ack")
            first = await ws.wait_for(lambda f: f["type"] == "delta")
            edited, _ = await op(ws, chat_id, "edit", msg_id=ack["msg_id"], text="short",
                                 cancel=True)
            frames = await until_turn_end(ws, chat_id)  # the edit's turn
            async with asyncio.timeout(3):
                await agent.gone.wait()
    assert worker.stats["handled"] == 2 and worker.stats["failed"] == 0
    assert [f["data"]["turn_id"] for f in of_type(frames, "turn_end")] == [edited["turn_id"]]
    assert [m["data"]["text"] for m in of_type(frames, "message")] == ["You said: short"]
    assert all(f["stream"]["id"] != first["stream"]["id"] for f in of_type(frames, "delta"))


# --- failures -------------------------------------------------------------------------------


async def test_the_agent_killed_mid_stream_ends_the_turn_with_an_error(
    gateway: Any, redis_url: str, group: str, user: str, chat_id: str
) -> None:
    async with agent_server_process() as (proc, base), \
            driven(redis_url, group, AgUiAgent(f"{base}/agent")), \
            connect(gateway.url(user)) as ws:
        await ws.subscribe(chat_id)
        await send_message(ws, chat_id, "slow 1000")
        frames = [await ws.wait_for(lambda f: f["type"] == "delta", timeout=10)]
        proc.send_signal(signal.SIGKILL)
        started = time.monotonic()
        frames += await until_turn_end(ws, chat_id, within=5)
        took = time.monotonic() - started
    end = frames[-1]["data"]
    assert end["reason"] == "error" and took < 3, (end, took)
    assert end["error"] == ("The connection to the agent broke off before its answer was "
                            "finished.")
    [partial] = of_type(frames, "message")  # what streamed stays, as the partial answer
    assert partial["data"]["partial"] is True and partial["data"]["text"]


async def test_an_agent_that_is_down_ends_the_turn_within_seconds(
    gateway: Any, redis_url: str, group: str, user: str, chat_id: str
) -> None:
    agent = AgUiAgent(f"http://127.0.0.1:{free_port()}/agent", retry_delays=(0.2, 0.4))
    async with driven(redis_url, group, agent), connect(gateway.url(user)) as ws:
        await ws.subscribe(chat_id)
        started = time.monotonic()
        frames = await turn_frames(ws, chat_id, "hello?", within=5)
        took = time.monotonic() - started
    end = frames[-1]["data"]
    assert end["reason"] == "error"
    assert end["error"] == "The agent could not be reached: nothing answers at its address."
    assert 0.6 <= took < 3, took  # tried three times, 0.2 s then 0.4 s apart


async def test_a_refused_connection_is_tried_again_until_the_agent_is_up(
    gateway: Any, redis_url: str, group: str, user: str, chat_id: str
) -> None:
    port = free_port()
    refused = asyncio.Event()

    class Note(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "trying again" in record.getMessage():
                refused.set()

    note = Note()
    logging.getLogger("gateway.agent.ag_ui").addHandler(note)
    logging.getLogger("gateway.agent.ag_ui").setLevel(logging.INFO)
    agent = AgUiAgent(f"http://127.0.0.1:{port}/agent", retry_delays=(0.5, 1.0, 2.0))
    try:
        async with driven(redis_url, group, agent), connect(gateway.url(user)) as ws:
            await ws.subscribe(chat_id)
            await send_message(ws, chat_id, "are you up?")
            async with asyncio.timeout(5):
                await refused.wait()  # the first try was refused
            async with serving(port) as (_, server):
                frames = await until_turn_end(ws, chat_id)
    finally:
        logging.getLogger("gateway.agent.ag_ui").removeHandler(note)
        logging.getLogger("gateway.agent.ag_ui").setLevel(logging.NOTSET)
    assert frames[-1]["data"]["reason"] == "complete"
    assert of_type(frames, "message")[0]["data"]["text"] == "You said: are you up?"
    assert len(server.inputs) == 1


@pytest.mark.parametrize(("route", "error"), [
    ("down", "The agent answered with HTTP 503 (Service Unavailable)."),
    ("garbage", "The agent sent an event that is not JSON."),
    ("json", "The agent did not answer with an event stream (its answer was "
             "application/json)."),
    ("silent", "The agent sent nothing for 0.5 s, so its answer was stopped."),
])
async def test_a_bad_answer_ends_the_turn_with_a_readable_error(
    gateway: Any, redis_url: str, group: str, user: str, chat_id: str, route: str, error: str,
    caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    async with serving() as (base, server):
        agent = AgUiAgent(f"{base}/{route}", idle_timeout=0.5, headers={"X-Api-Key": SECRET})
        async with driven(redis_url, group, agent), connect(gateway.url(user)) as ws:
            await ws.subscribe(chat_id)
            started = time.monotonic()
            frames = await turn_frames(ws, chat_id, "hi", within=5)
            took = time.monotonic() - started
    end = frames[-1]["data"]
    assert (end["reason"], end["error"]) == ("error", error)
    assert took < 3, took
    if server.headers:
        assert server.headers[0]["x-api-key"] == SECRET  # sent, and never shown
    assert SECRET not in caplog.text and SECRET not in repr(agent)


# --- crashes and devices ---------------------------------------------------------------------


async def test_a_worker_killed_mid_run_is_replaced_without_showing_the_partial_twice(
    gateway: Any, redis_url: str, group: str, user: str, chat_id: str,
    monkeypatch: pytest.MonkeyPatch
) -> None:
    async with serving() as (base, agent), connect(gateway.url(user)) as ws:
        await ws.subscribe(chat_id)
        monkeypatch.setenv("AGUI_TEST_URL", f"{base}/agent")
        spec = "tests.test_ag_ui_agent:agent_from_env"
        async with agent_process(redis_url, spec, group) as proc:
            await send_message(ws, chat_id, "slow 120")
            frames = [await ws.wait_for(lambda f: f["type"] == "delta", timeout=10)]
            proc.send_signal(signal.SIGKILL)
            async with asyncio.timeout(5):
                assert await proc.wait() == -signal.SIGKILL
                await agent.gone.wait()  # the agent saw the dead worker's request go
        async with driven(redis_url, group, AgUiAgent(f"{base}/agent"), claim_idle=0.5):
            frames += await until_turn_end(ws, chat_id, within=10)

    first = frames[0]["stream"]["id"]
    kinds = [f["type"] for f in frames]
    [discarded] = of_type(frames, "stream_discarded")
    assert discarded["data"]["stream_id"] == first  # every device drops the old partial
    later = [f for f in frames[kinds.index("stream_discarded"):] if f["type"] == "delta"]
    assert later and all(f["stream"]["id"] != first for f in later)
    assert "".join(f["data"]["text"] for f in later) == words(120)
    [message] = of_type(frames, "message")
    assert message["data"]["text"] == words(120) and "partial" not in message["data"]
    assert frames[-1]["data"]["reason"] == "complete"
    stored = [e for e in await history(gateway, user, chat_id) if e["type"] == "message"]
    assert [e["data"]["text"] for e in stored] == [words(120)]  # once, whole
    # Two runs of one turn: the same thread and input, a run id per attempt.
    [one, two] = agent.inputs
    assert one["messages"] == two["messages"] and one["threadId"] == two["threadId"]
    turn_id = frames[-1]["data"]["turn_id"]
    assert one["runId"].startswith(turn_id + ".") and two["runId"].startswith(turn_id + ".")
    assert one["runId"] != two["runId"]


async def test_a_second_device_resumes_mid_answer(
    gateway: Any, redis_url: str, group: str, user: str, chat_id: str
) -> None:
    async with chatting(gateway, redis_url, group, user, chat_id) as (ws, _):
        await send_message(ws, chat_id, "slow 150")
        await ws.wait_for(lambda f: f["type"] == "delta" and "w5 " in f["data"]["text"])
        async with connect(gateway.url(user)) as phone:
            [stream] = (await phone.subscribe(chat_id))["snapshot"]["streams"]
            assert stream["type"] == "delta" and "w5 " in stream["text"], stream
            text, pos = stream["text"], stream["pos"]
            for frame in await until_turn_end(phone, chat_id):
                if frame["type"] == "delta" and frame["stream"]["pos"] == pos:
                    text, pos = text + frame["data"]["text"], pos + 1
                elif frame["type"] == "message":
                    message = frame["data"]
        await until_turn_end(ws, chat_id)
    assert text == message["text"] == words(150)


async def test_a_client_tool_asks_the_person_and_the_answer_goes_back_to_the_agent(
    gateway: Any, redis_url: str, group: str, user: str, chat_id: str
) -> None:
    """The conversation's client tools reach the agent as ``RunAgentInput.tools``; its
    call of one asks the person, and the answer starts a run whose messages end with the
    call and its result, so the agent goes on."""
    approve = APPROVE
    resp = await declare_tools(gateway, user, chat_id, approve)
    assert resp.status_code == 200, resp.text
    async with chatting(gateway, redis_url, group, user, chat_id) as (ws, agent):
        asked = await turn_frames(ws, chat_id, "ask")
        assert asked[-1]["data"]["reason"] == "awaiting_input", asked[-1]
        call = of_type(asked, "tool_call")[0]["data"]
        assert call == {"call_id": "call_ask", "name": "approve_payment",
                        "args": {"amount": 42.5}, "awaiting": True}
        await ws.send({"type": "tool_result", "chat_id": chat_id, "call_id": "call_ask",
                       "result": {"approved": True}})
        after = await until_turn_end(ws, chat_id)
    assert agent.inputs[0]["tools"] == [{"name": "approve_payment",
                                         "description": "Ask to approve a payment",
                                         "parameters": approve["parameters"]}]
    tail = agent.inputs[1]["messages"][-2:]
    assert tail[0]["toolCalls"][0]["id"] == "call_ask"
    assert tail[1]["role"] == "tool" and tail[1]["toolCallId"] == "call_ask"
    assert of_type(after, "message")[0]["data"]["text"].startswith("The person said")
    assert after[-1]["data"]["reason"] == "complete"
