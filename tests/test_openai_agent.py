"""OpenAI-compatible agents (gateway.sdk.drivers.openai) against a model server in the test.

The model server is a small Starlette app run by uvicorn in the test's own event loop. It
follows the documented streaming format of ``POST /v1/chat/completions``: ``data:
{chat.completion.chunk}`` lines (a role chunk, ``reasoning_content`` as vLLM sends it,
``content``, tool calls whose arguments are split over chunks, a finish chunk, the usage
chunk when ``stream_options.include_usage`` asks for it) and ``data: [DONE]``. It records
every request, and each request follows a :class:`Plan`: answer, fail with a status, send a
chunk that does not parse, go silent, or stream slowly so a cancel lands mid-answer (it
notes the disconnect). The gateway, Redis, the worker and the WebSocket client are real.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import uvicorn
from openai.types.chat import ChatCompletionChunk
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from gateway.sdk.agent import AgentWorker, Turn
from gateway.sdk.drivers.openai import (
    UNANSWERED,
    ModelError,
    OpenAIAgent,
    _read,
    chat_messages,
)

from .conftest import free_port
from .steps import APPROVE, declare_tools, op, read, send_message
from .test_agent import agent_worker, of_type, until_turn_end
from .wsclient import Client, Frame, connect

pytestmark = pytest.mark.anyio

KEY = "sk-test-0123456789abcdef"
MODEL = "test-model"


# --- the model server ---------------------------------------------------------------------


@dataclass
class Plan:
    """How the server answers one request."""
    reasoning: list[str] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    # (id, name, argument pieces), streamed one after the other
    calls: list[tuple[str, str, list[str]]] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    delay: float = 0.0  # seconds between chunks
    status: int = 200  # not 200: this status with ``body``, and no stream
    body: Any = None
    # after the text: "done", "garbage", "error", "drop" or "silent"; "hang": no response
    then: str = "done"


class ModelServer:
    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []  # the JSON bodies, in order
        self.headers: list[dict[str, str]] = []
        self.paths: list[str] = []
        self.plans: list[Plan] = []  # one per request; an empty list answers "ok"
        self.disconnected = asyncio.Event()  # a client left before the stream ended
        self.port = 0
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task[None] | None = None
        app = Starlette(routes=[Route("/v1/chat/completions", self.completions,
                                      methods=["POST"])])
        self.app = app

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    async def completions(self, request: Request) -> Response:
        body = await request.json()
        self.requests.append(body)
        self.headers.append(dict(request.headers))
        self.paths.append(request.url.path)
        plan = self.plans.pop(0) if self.plans else Plan(text=["ok"])
        if plan.then == "hang":  # no status line at all, until the client leaves
            while (await request.receive())["type"] != "http.disconnect":
                pass
            self.disconnected.set()
            return Response(status_code=499)
        if plan.status != 200:
            if isinstance(plan.body, str):
                return PlainTextResponse(plan.body, status_code=plan.status)
            return JSONResponse(plan.body, status_code=plan.status)
        return StreamingResponse(self.stream(plan, body), media_type="text/event-stream")

    async def stream(self, plan: Plan, body: dict[str, Any]) -> AsyncIterator[bytes]:
        def chunk(delta: dict[str, Any] | None, finish: str | None = None,
                  usage: dict[str, Any] | None = None) -> bytes:
            data: dict[str, Any] = {
                "id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1,
                "model": body["model"],
                "choices": [] if delta is None else [
                    {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
            if usage is not None:
                data["usage"] = usage
            return b"data: " + json.dumps(data).encode() + b"\n\n"

        pieces = [chunk({"role": "assistant", "content": ""})]
        pieces += [chunk({"reasoning_content": r}) for r in plan.reasoning]
        pieces += [chunk({"content": t}) for t in plan.text]
        for index, (call_id, name, parts) in enumerate(plan.calls):
            pieces.append(chunk({"tool_calls": [{"index": index, "id": call_id,
                                                 "type": "function",
                                                 "function": {"name": name,
                                                              "arguments": ""}}]}))
            pieces += [chunk({"tool_calls": [{"index": index,
                                              "function": {"arguments": part}}]})
                       for part in parts]
        finished = False
        try:
            for piece in pieces:
                yield piece
                if plan.delay:
                    await asyncio.sleep(plan.delay)
            if plan.then == "garbage":
                yield b'data: {"id": "chatcmpl-1", "choices": [{"delta": \n\n'
                await asyncio.Event().wait()  # the client must leave by itself
            if plan.then == "error":
                yield b'data: {"error": {"message": "the GPU fell over", "code": 500}}\n\n'
                await asyncio.Event().wait()
            if plan.then == "drop":
                raise ConnectionAbortedError("the model server died")  # uvicorn cuts it
            if plan.then == "silent":
                await asyncio.Event().wait()  # until the client leaves
            yield chunk({}, "tool_calls" if plan.calls else "stop")
            if (body.get("stream_options") or {}).get("include_usage") and plan.usage:
                yield chunk(None, usage=plan.usage)
            yield b"data: [DONE]\n\n"
            finished = True
        finally:
            if not finished:
                self.disconnected.set()

    async def start(self, port: int = 0) -> ModelServer:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        sock.listen(64)  # connections wait in the backlog until uvicorn accepts them
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_level="warning", lifespan="off",
                                timeout_graceful_shutdown=1)
        self._server = _QuietServer(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        return self

    async def stop(self) -> None:
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            async with asyncio.timeout(10):
                await self._task


class _QuietServer(uvicorn.Server):
    """uvicorn in the test's loop: pytest keeps its signal handlers."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@contextlib.asynccontextmanager
async def model_server(port: int = 0) -> AsyncIterator[ModelServer]:
    server = await ModelServer().start(port)
    try:
        yield server
    finally:
        await server.stop()


# --- helpers ------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def driven(redis_url: str, group: str, agent: OpenAIAgent,
                 **options: Any) -> AsyncIterator[AgentWorker]:
    """A worker running ``agent`` (no coalescing, so the partial text is exact)."""
    async with agent_worker(redis_url, agent, group, delta_window_ms=0, **options) as worker:
        try:
            yield worker
        finally:
            await agent.aclose()


async def turn_frames(ws: Client, chat_id: str, text: str, within: float = 10.0) -> list[Frame]:
    await send_message(ws, chat_id, text)
    return await until_turn_end(ws, chat_id, within)


def kinds(frames: list[Frame]) -> list[str]:
    """The types of the turn's own frames, a run of one streamed type counted once."""
    out: list[str] = []
    for frame in frames:
        kind = frame["type"]
        if kind in ("ack", "user_message", "turn_start", "head"):
            continue
        if not (out and out[-1] == kind and kind.endswith("delta")):
            out.append(kind)
    return out


def streamed(frames: list[Frame], kind: str) -> str:
    return "".join(f["data"]["text"] for f in of_type(frames, kind))


# --- the messages a model takes (pure) ------------------------------------------------------


def test_history_maps_to_chat_messages() -> None:
    history = [
        {"role": "user", "content": "weather in Lisbon?", "msg_id": "m1"},
        {"role": "assistant", "content": "Let me look.", "partial": True},
        {"role": "assistant", "content": "",
         "tool_calls": [{"id": "c1", "name": "weather", "args": {"city": "Lisbon"}},
                        {"id": "c2", "name": "clock", "args": "not json"}]},
        {"role": "tool", "tool_call_id": "c1", "content": {"temp": 21}},
        {"role": "user", "content": "thanks", "msg_id": "m2"},
    ]
    assert chat_messages(history, "Be brief.") == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "weather in Lisbon?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "weather", "arguments": '{"city": "Lisbon"}'}},
            {"id": "c2", "type": "function",
             "function": {"name": "clock", "arguments": "not json"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 21}'},
        {"role": "tool", "tool_call_id": "c2", "content": UNANSWERED},
        {"role": "user", "content": "thanks"},
    ]
    assert chat_messages([]) == []


def test_a_chunk_is_read_for_what_the_turn_publishes() -> None:
    def chunk(delta: dict[str, Any], usage: dict[str, Any] | None = None) -> Any:
        return ChatCompletionChunk.model_validate({
            "id": "c", "object": "chat.completion.chunk", "created": 1, "model": MODEL,
            "choices": [{"index": 0, "delta": delta, "finish_reason": None}],
            "usage": usage})

    piece = _read(chunk({"reasoning": "hmm", "refusal": "I can't help with that."},
                        {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3,
                         "model": "x"}))
    assert (piece.reasoning, piece.content) == ("hmm", "I can't help with that.")
    assert piece.usage == {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3,
                           "model": "x"}
    piece = _read(chunk({"tool_calls": [{"index": 1, "id": "c1", "type": "function",
                                         "function": {"name": "f", "arguments": "{"}}]}))
    assert piece.calls == [(1, "c1", "f", "{")]
    with pytest.raises(ModelError, match="could not be read"):
        _read(42)


def test_the_options_are_checked_and_the_key_is_never_shown() -> None:
    with pytest.raises(ValueError, match="messages"):
        OpenAIAgent("http://x/v1", MODEL, params={"messages": []})
    with pytest.raises(ValueError, match="model"):
        OpenAIAgent("http://x/v1", "")
    agent = OpenAIAgent("http://user:pw@example.com:8080/v1/?k=v", MODEL, api_key=KEY)
    assert agent.where == "http://example.com:8080/v1"
    assert KEY not in repr(agent) and "pw" not in repr(agent)
    assert agent.scrub(f"bad key {KEY}") == "bad key ***"


# --- answers ----------------------------------------------------------------------------------


async def test_an_answer_streams_with_reasoning_and_its_usage_is_billed(
    gateway: Any, redis_url: str, group: str, user: str, chat_id: str
) -> None:
    usage = {"prompt_tokens": 9, "completion_tokens": 12, "total_tokens": 21,
             "prompt_tokens_details": {"cached_tokens": 3}}
    async with model_server() as model:
        model.plans = [Plan(reasoning=["The user ", "greets."], text=["Hel", "lo ", "there!"],
                            usage=usage)]
        agent = OpenAIAgent(model.url, MODEL, api_key=KEY, system="Be brief.",
                            temperature=0.2, params={"max_tokens": 50, "top_p": 0.9})
        async with driven(redis_url, group, agent), connect(gateway.url(user)) as ws:
            await ws.subscribe(chat_id)
            frames = await turn_frames(ws, chat_id, "hello")

    assert kinds(frames) == ["reasoning_delta", "reasoning", "delta", "message", "turn_end"]
    assert streamed(frames, "reasoning_delta") == "The user greets."
    assert streamed(frames, "delta") == "Hello there!"
    [reasoning] = of_type(frames, "reasoning")
    [message] = of_type(frames, "message")
    assert reasoning["data"]["text"] == "The user greets." and "partial" not in reasoning["data"]
    assert message["data"]["text"] == "Hello there!" and "partial" not in message["data"]
    end = frames[-1]["data"]
    assert end["reason"] == "complete" and "error" not in end
    counted = {"prompt_tokens": 9, "completion_tokens": 12, "total_tokens": 21,
               "prompt_tokens_details.cached_tokens": 3}
    assert end["usage"] == counted

    # What the model was asked, on the documented path.
    assert model.paths == ["/v1/chat/completions"]
    [request] = model.requests
    assert request["model"] == MODEL and request["stream"] is True
    assert request["stream_options"] == {"include_usage": True}
    assert (request["temperature"], request["max_tokens"], request["top_p"]) == (0.2, 50, 0.9)
    assert request["messages"] == [{"role": "system", "content": "Be brief."},
                                   {"role": "user", "content": "hello"}]
    assert model.headers[0]["authorization"] == f"Bearer {KEY}"

    conversation = await read(gateway, user, f"/v1/conversations/{chat_id}")
    assert conversation["usage"]["billed"] == counted


async def test_the_next_turn_and_a_retry_see_the_right_path(
    gateway: Any, redis_url: str, group: str, user: str, chat_id: str
) -> None:
    async with model_server() as model:
        model.plans = [Plan(text=["4"]), Plan(text=["6"]), Plan(text=["Six."])]
        async with driven(redis_url, group, OpenAIAgent(model.url, MODEL)), \
                connect(gateway.url(user)) as ws:
            await ws.subscribe(chat_id)
            first = await turn_frames(ws, chat_id, "2+2?")
            second = await turn_frames(ws, chat_id, "and 3+3?")
            answer, _ = await op(ws, chat_id, "retry")
            assert answer["type"] == "ack", answer
            retried = await until_turn_end(ws, chat_id)
    for frames, text in ((first, "4"), (second, "6"), (retried, "Six.")):
        assert of_type(frames, "message")[0]["data"]["text"] == text
        assert frames[-1]["data"]["reason"] == "complete"
    exchange = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
                {"role": "user", "content": "and 3+3?"}]
    assert [r["messages"] for r in model.requests] == [exchange[:1], exchange, exchange]
    assert "authorization" not in model.headers[0]  # no key: none sent


async def test_tool_calls_become_tool_call_events(
    gateway: Any, redis_url: str, group: str, user: str, chat_id: str
) -> None:
    async with model_server() as model:
        model.plans = [
            Plan(text=["Checking."],
                 calls=[("call_w", "weather", ['{"city":', ' "Lis', 'bon"}']),
                        ("call_t", "clock", [])],
                 usage={"prompt_tokens": 5, "completion_tokens": 7}),
            Plan(text=["Sunny."]),
        ]
        async with driven(redis_url, group, OpenAIAgent(model.url, MODEL)), \
                connect(gateway.url(user)) as ws:
            await ws.subscribe(chat_id)
            frames = await turn_frames(ws, chat_id, "weather?")
            await turn_frames(ws, chat_id, "well?")

    assert kinds(frames) == ["delta", "message", "tool_call", "tool_call", "turn_end"]
    assert of_type(frames, "message")[0]["data"]["text"] == "Checking."
    assert [c["data"] for c in of_type(frames, "tool_call")] == [
        {"call_id": "call_w", "name": "weather", "args": {"city": "Lisbon"}},
        {"call_id": "call_t", "name": "clock", "args": {}}]
    assert all(isinstance(c["seq"], int) for c in of_type(frames, "tool_call"))  # durable
    assert frames[-1]["data"]["usage"] == {"prompt_tokens": 5, "completion_tokens": 7}
    # The next turn's request carries the calls, each answered (here: not answered).
    assert model.requests[1]["messages"] == [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "call_w", "type": "function",
             "function": {"name": "weather", "arguments": '{"city": "Lisbon"}'}},
            {"id": "call_t", "type": "function",
             "function": {"name": "clock", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_w", "content": UNANSWERED},
        {"role": "tool", "tool_call_id": "call_t", "content": UNANSWERED},
        {"role": "user", "content": "well?"},
    ]


async def test_a_client_tool_call_asks_the_person_and_the_answer_goes_back_to_the_model(
    gateway: Any, redis_url: str, group: str, user: str, chat_id: str
) -> None:
    """The conversation's client tools reach the model as ``tools``; its call of one asks
    the person (the turn ends awaiting_input), and the answer starts a turn whose request
    ends with the call and its result."""
    approve = APPROVE
    resp = await declare_tools(gateway, user, chat_id, approve)
    assert resp.status_code == 200, resp.text
    async with model_server() as model:
        model.plans = [Plan(text=["Let me ask."],
                            calls=[("call_p", "approve_payment", ['{"amount": 4', '2.5}'])]),
                       Plan(text=["Paid."])]
        async with driven(redis_url, group, OpenAIAgent(model.url, MODEL)), \
                connect(gateway.url(user)) as ws:
            await ws.subscribe(chat_id)
            frames = await turn_frames(ws, chat_id, "pay the hotel")
            assert frames[-1]["data"]["reason"] == "awaiting_input"
            call = of_type(frames, "tool_call")[0]["data"]
            assert call == {"call_id": "call_p", "name": "approve_payment",
                            "args": {"amount": 42.5}, "awaiting": True}
            await ws.send({"type": "tool_result", "chat_id": chat_id, "call_id": "call_p",
                           "result": {"approved": True}})
            after = await until_turn_end(ws, chat_id)
    assert of_type(after, "message")[0]["data"]["text"] == "Paid."
    assert model.requests[0]["tools"] == [{"type": "function", "function": {
        "name": "approve_payment", "description": "Ask to approve a payment",
        "parameters": approve["parameters"]}}]
    assert model.requests[1]["messages"][-2:] == [
        {"role": "assistant", "content": "Let me ask.", "tool_calls": [
            {"id": "call_p", "type": "function",
             "function": {"name": "approve_payment", "arguments": '{"amount": 42.5}'}}]},
        {"role": "tool", "tool_call_id": "call_p", "content": '{"approved": true}'}]


# --- stop -------------------------------------------------------------------------------------


async def test_a_cancel_mid_answer_closes_the_request_and_keeps_the_partial(
    gateway: Any, redis_url: str, group: str, user: str, chat_id: str
) -> None:
    words = [f"w{n} " for n in range(200)]  # 0.05 s apart: ten seconds if never stopped
    async with model_server() as model:
        model.plans = [Plan(text=words, delay=0.05)]
        async with driven(redis_url, group, OpenAIAgent(model.url, MODEL)), \
                connect(gateway.url(user)) as ws:
            await ws.subscribe(chat_id)
            await send_message(ws, chat_id, "talk a lot")
            frames = [await ws.wait_for(lambda f: f["type"] == "delta"
                                        and f["data"]["text"].startswith("w2 "))]
            await ws.send({"type": "cancel", "chat_id": chat_id})
            asked = time.monotonic()
            frames += await until_turn_end(ws, chat_id, within=5)
            ended = time.monotonic() - asked
            async with asyncio.timeout(2):
                await model.disconnected.wait()  # the server saw the request closed
    assert frames[-1]["data"]["reason"] == "cancelled"
    assert ended < 2, ended
    [partial] = of_type(frames, "message")
    text = partial["data"]["text"]
    assert partial["data"]["partial"] is True
    assert text.startswith("w0 w1 w2 ") and "".join(words).startswith(text)
    assert len(text) < len("".join(words))


# --- failures -----------------------------------------------------------------------------------


async def test_the_model_server_down_ends_the_turn_with_an_error_within_seconds(
    gateway: Any, redis_url: str, group: str, user: str, chat_id: str
) -> None:
    url = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    async with driven(redis_url, group, OpenAIAgent(url, MODEL, api_key=KEY)), \
            connect(gateway.url(user)) as ws:
        await ws.subscribe(chat_id)
        started = time.monotonic()
        frames = await turn_frames(ws, chat_id, "anyone there?")
        took = time.monotonic() - started
    end = frames[-1]["data"]
    assert end["reason"] == "error"
    assert end["error"] == "The model server cannot be reached (connection refused)."
    assert 3 < took < 8, took  # tried again with backoff, then gave up: seconds, not minutes


async def test_a_refused_connection_is_tried_again_until_the_server_is_up(
    gateway: Any, redis_url: str, group: str, user: str, chat_id: str
) -> None:
    port = free_port()
    servers: list[ModelServer] = []

    class Starting(OpenAIAgent):
        async def wait_to_retry(self, turn: Turn, delay: float) -> bool:
            if not servers:  # refused once: the server comes up during the backoff
                servers.append(await ModelServer().start(port))
                servers[0].plans = [Plan(text=["up now"])]
            return await super().wait_to_retry(turn, delay)

    agent = Starting(f"http://127.0.0.1:{port}/v1", MODEL, retry_delays=(0.05, 0.05))
    try:
        async with driven(redis_url, group, agent), connect(gateway.url(user)) as ws:
            await ws.subscribe(chat_id)
            frames = await turn_frames(ws, chat_id, "hello?")
    finally:
        for server in servers:
            await server.stop()
    assert frames[-1]["data"]["reason"] == "complete"
    assert of_type(frames, "message")[0]["data"]["text"] == "up now"
    assert len(servers[0].requests) == 1


@pytest.mark.parametrize(("plan", "error"), [
    pytest.param(Plan(status=404, body={"error": {
        "message": f"The model `nope` does not exist (key {KEY})",
        "type": "invalid_request_error", "code": "model_not_found"}}),
        "answered 404 Not Found: The model `nope` does not exist (key ***)", id="404-json"),
    pytest.param(Plan(status=503, body="overloaded, try later"),
                 "answered 503 Service Unavailable: overloaded, try later", id="503-text"),
    pytest.param(Plan(status=502, body="<html><body>Bad gateway</body></html>"),
                 "answered 502 Bad Gateway.", id="502-html"),
    pytest.param(Plan(text=["Hel"], then="garbage"),
                 "sent a chunk that could not be read.", id="bad-chunk"),
    pytest.param(Plan(text=["Hel"], then="error"),
                 "The model server reported an error: the GPU fell over", id="error-event"),
    pytest.param(Plan(text=["Hel"], then="drop"),
                 "The connection to the model server was lost mid-answer.", id="dropped"),
])
async def test_a_failing_model_server_ends_the_turn_with_a_readable_error(
    gateway: Any, redis_url: str, group: str, user: str, chat_id: str, plan: Plan, error: str
) -> None:
    async with model_server() as model:
        model.plans = [plan]
        agent = OpenAIAgent(model.url, MODEL, api_key=KEY)
        async with driven(redis_url, group, agent), connect(gateway.url(user)) as ws:
            await ws.subscribe(chat_id)
            frames = await turn_frames(ws, chat_id, "hi", within=5)
            if plan.then != "done":
                async with asyncio.timeout(2):
                    await model.disconnected.wait()  # the request was closed
    end = frames[-1]["data"]
    assert end["reason"] == "error" and error in end["error"], end
    assert KEY not in end["error"]
    assert len(model.requests) == 1  # not tried again: the request was sent
    if plan.text:  # what streamed before the failure stays, as partial
        [partial] = of_type(frames, "message")
        assert partial["data"] == {"text": "Hel", "partial": True,
                                   "stream_id": partial["data"]["stream_id"]}


async def test_silence_past_the_idle_timeout_ends_the_turn(
    gateway: Any, redis_url: str, group: str, user: str, chat_id: str
) -> None:
    async with model_server() as model:
        model.plans = [Plan(text=["Thinking"], then="silent")]
        agent = OpenAIAgent(model.url, MODEL, idle_timeout=0.5)
        async with driven(redis_url, group, agent), connect(gateway.url(user)) as ws:
            await ws.subscribe(chat_id)
            started = time.monotonic()
            frames = await turn_frames(ws, chat_id, "hi", within=5)
            took = time.monotonic() - started
            async with asyncio.timeout(2):
                await model.disconnected.wait()
    end = frames[-1]["data"]
    assert end["reason"] == "error"
    assert end["error"] == "The model server sent nothing for 0.5 seconds."
    assert took < 3, took
    assert of_type(frames, "message")[0]["data"]["text"] == "Thinking"


# --- a crashed worker ---------------------------------------------------------------------------


async def test_a_worker_lost_mid_answer_is_replaced_by_a_fresh_attempt(
    gateway: Any, redis_url: str, group: str, user: str, chat_id: str
) -> None:
    """The worker stops mid-stream without ending the turn (its handler cancelled, as a
    crash leaves it): another worker takes the turn over, and its new attempt replaces the
    partial stream on every device; history keeps one whole answer."""
    words = [f"w{n} " for n in range(200)]
    async with model_server() as model:
        model.plans = [Plan(text=words, delay=0.05), Plan(text=["a ", "fresh ", "answer"])]
        async with connect(gateway.url(user)) as ws:
            await ws.subscribe(chat_id)
            frames: list[Frame] = []
            async with driven(redis_url, group, OpenAIAgent(model.url, MODEL)) \
                    as crashed:
                await send_message(ws, chat_id, "talk a lot")
                frames.append(await ws.wait_for(lambda f: f["type"] == "delta"
                                                and f["data"]["text"].startswith("w2 ")))
                await crashed.stop(grace=0)  # the handler is cancelled mid-stream
                async with asyncio.timeout(2):
                    await model.disconnected.wait()  # and its request closed
            async with driven(redis_url, group, OpenAIAgent(model.url, MODEL),
                              claim_idle=0.3):
                frames += await until_turn_end(ws, chat_id)
    types = kinds(frames)
    assert types[0] == "delta" and "stream_discarded" in types, types
    assert types[-2:] == ["message", "turn_end"], types
    assert frames[-1]["data"]["reason"] == "complete"
    assert of_type(frames, "message")[0]["data"]["text"] == "a fresh answer"
    assert "partial" not in of_type(frames, "message")[0]["data"]
    assert len(model.requests) == 2 and model.requests[0] == model.requests[1]


async def test_no_response_within_the_request_timeout_ends_the_turn(
    gateway: Any, redis_url: str, group: str, user: str, chat_id: str
) -> None:
    async with model_server() as model:
        model.plans = [Plan(then="hang")]
        agent = OpenAIAgent(model.url, MODEL, request_timeout=0.5)
        async with driven(redis_url, group, agent), connect(gateway.url(user)) as ws:
            await ws.subscribe(chat_id)
            frames = await turn_frames(ws, chat_id, "hi", within=5)
            async with asyncio.timeout(2):
                await model.disconnected.wait()  # the request was given up
    end = frames[-1]["data"]
    assert end["reason"] == "error"
    assert end["error"] == "The model server did not answer within 0.5 seconds."
    assert len(model.requests) == 1
