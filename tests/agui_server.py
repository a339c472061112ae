"""A real AG-UI agent for tests/test_ag_ui_agent.py: pydantic-ai's AG-UI adapter
(``AGUIAdapter``) over a ``FunctionModel``, so no network and no model, served by uvicorn in
the test's own event loop (:func:`serving`) or as a child process to kill
(``python -m tests.agui_server``, which prints its port once it listens).

What the model does depends on the last user message:

- ``tool``: calls the server-side tool ``forecast`` (its arguments streamed in two pieces),
  then says what it returned;
- ``state``: calls ``plan``, which sets the agent state (``StateDeps``: a ``STATE_SNAPSHOT``
  from the state it was given, then a ``STATE_DELTA``), then answers;
- ``everything``: thinks, writes, calls ``extras``, whose result carries a step, a custom
  event, a raw event, a messages snapshot and chunked text and tool call events;
- ``fail``: writes a little, then fails (``RUN_ERROR``);
- ``slow N``: N words, 10 ms apart; a client that goes away is noted (``disconnected``);
- anything else: ``You said: <text>``.

Other routes answer badly on purpose: ``/down`` (HTTP 503), ``/garbage`` (an event that is
not JSON), ``/json`` (not an event stream), ``/silent`` (an event stream that never sends).
``/legacy`` is the agent speaking AG-UI 0.1.10 (``THINKING_*`` events).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from ag_ui.core import (
    CustomEvent,
    MessagesSnapshotEvent,
    RawEvent,
    StateDeltaEvent,
    StateSnapshotEvent,
    StepFinishedEvent,
    StepStartedEvent,
    TextMessageChunkEvent,
    ToolCallChunkEvent,
)
from pydantic_ai import Agent, RunContext, ToolReturn
from pydantic_ai.messages import ModelMessage, ModelRequest, ToolReturnPart, UserPromptPart
from pydantic_ai.models.function import (
    AgentInfo,
    DeltaThinkingCalls,
    DeltaThinkingPart,
    DeltaToolCall,
    DeltaToolCalls,
    FunctionModel,
)
from pydantic_ai.ui import StateDeps
from pydantic_ai.ui.ag_ui import AGUIAdapter
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

Deps = StateDeps[dict[str, Any]]


@dataclass
class Recorder:
    """What the agent was sent, and which runs lost their client mid-stream."""

    inputs: list[dict[str, Any]] = field(default_factory=list)  # RunAgentInput, as JSON
    headers: list[dict[str, str]] = field(default_factory=list)
    disconnects: int = 0  # runs whose client went away mid-stream
    gone: asyncio.Event = field(default_factory=asyncio.Event)


def _prompt(messages: list[ModelMessage]) -> str:
    for message in reversed(messages):
        if isinstance(message, ModelRequest):
            for part in message.parts:
                if isinstance(part, UserPromptPart) and isinstance(part.content, str):
                    return part.content
    return ""


def _after_tool(messages: list[ModelMessage]) -> bool:
    last = messages[-1]
    return isinstance(last, ModelRequest) and any(
        isinstance(p, ToolReturnPart) for p in last.parts)


def make_agent(recorder: Recorder) -> Agent[Deps, str]:
    async def stream(messages: list[ModelMessage], info: AgentInfo
                     ) -> AsyncIterator[str | DeltaToolCalls | DeltaThinkingCalls]:
        prompt = _prompt(messages)
        command, _, rest = prompt.partition(" ")
        if command == "tool":
            if _after_tool(messages):
                yield "It is sunny "
                yield "in Lisbon."
                return
            yield {0: DeltaToolCall(name="forecast", json_args='{"city": ',
                                    tool_call_id="call_forecast")}
            yield {0: DeltaToolCall(json_args='"Lisbon"}')}
        elif command == "state":
            if _after_tool(messages):
                yield "Planned."
                return
            yield {0: DeltaToolCall(name="plan", json_args='{"step": "search"}',
                                    tool_call_id="call_plan")}
        elif command in ("everything", "think"):
            if _after_tool(messages):
                yield "All done."
                return
            yield {0: DeltaThinkingPart(content="Let me think")}
            yield {0: DeltaThinkingPart(content=" hard.")}
            if command == "think":
                yield "Thought."
                return
            yield "Checking. "
            yield {1: DeltaToolCall(name="extras", json_args="{}", tool_call_id="call_extras")}
        elif command == "ask":  # a client tool: the frontend (a person) answers it
            if _after_tool(messages):
                answer = next(part.content for part in messages[-1].parts  # type: ignore[union-attr]
                              if isinstance(part, ToolReturnPart))
                yield f"The person said {answer}."
                return
            yield {0: DeltaToolCall(name="approve_payment", json_args='{"amount": 42.5}',
                                    tool_call_id="call_ask")}
        elif command == "fail":
            yield "Let me "
            raise RuntimeError("the model is out of coffee")
        elif command == "slow":
            finished = False
            try:
                for n in range(int(rest or 100)):
                    yield f"w{n} "
                    await asyncio.sleep(0.01)
                finished = True
            finally:
                if not finished:
                    recorder.disconnects += 1
                    recorder.gone.set()
        else:
            yield "You said: "
            yield prompt

    agent: Agent[Deps, str] = Agent(FunctionModel(stream_function=stream), deps_type=Deps)

    @agent.tool
    async def forecast(ctx: RunContext[Deps], city: str) -> dict[str, str]:
        return {"city": city, "sky": "sunny"}

    @agent.tool
    async def plan(ctx: RunContext[Deps], step: str) -> ToolReturn:
        state = dict(ctx.deps.state or {})
        snapshot = {**state, "runs": int(state.get("runs", 0)) + 1, "steps": [step]}
        return ToolReturn(return_value=f"planned {step}", metadata=[
            StateSnapshotEvent(snapshot=snapshot),
            StateDeltaEvent(delta=[{"op": "add", "path": "/steps/-", "value": "book"},
                                   {"op": "add", "path": "/done", "value": False}]),
        ])

    @agent.tool
    async def extras(ctx: RunContext[Deps]) -> ToolReturn:
        return ToolReturn(return_value="extras sent", metadata=[
            StepStartedEvent(step_name="search"),
            CustomEvent(name="card", value={"title": "Lisbon", "stars": 5}),
            RawEvent(event={"vendor": "native"}),
            MessagesSnapshotEvent(messages=[]),
            StepFinishedEvent(step_name="search"),
            TextMessageChunkEvent(message_id="chunky", delta="chunk one, "),
            TextMessageChunkEvent(delta="chunk two"),
            ToolCallChunkEvent(tool_call_id="call_chunk", tool_call_name="lookup",
                               delta='{"q": '),
            ToolCallChunkEvent(delta='"hotels"}'),
        ])

    return agent


def make_app(recorder: Recorder) -> Starlette:
    agent = make_agent(recorder)

    async def record(request: Request) -> None:
        recorder.inputs.append(json.loads(await request.body()))
        recorder.headers.append(dict(request.headers))

    async def run(request: Request, **options: Any) -> Response:
        await record(request)
        return await AGUIAdapter.dispatch_request(request, agent=agent, deps=Deps(state={}),
                                                  **options)

    async def main(request: Request) -> Response:
        return await run(request, include_usage=True)  # RUN_FINISHED.usage

    async def legacy(request: Request) -> Response:
        return await run(request, ag_ui_version="0.1.10")

    async def down(request: Request) -> Response:
        await record(request)
        return JSONResponse({"detail": "overloaded"}, status_code=503)

    async def garbage(request: Request) -> Response:
        async def body() -> AsyncIterator[bytes]:
            yield b'data: {"type": "RUN_STARTED", "threadId": "t", "runId": "r"}\n\n'
            yield b"data: {this is not json\n\n"
        return StreamingResponse(body(), media_type="text/event-stream")

    async def as_json(request: Request) -> Response:
        return JSONResponse({"answer": "not a stream"})

    async def silent(request: Request) -> Response:
        async def body() -> AsyncIterator[bytes]:
            yield b'data: {"type": "RUN_STARTED", "threadId": "t", "runId": "r"}\n\n'
            await asyncio.Event().wait()
        return StreamingResponse(body(), media_type="text/event-stream")

    return Starlette(routes=[
        Route("/agent", main, methods=["POST"]), Route("/legacy", legacy, methods=["POST"]),
        Route("/down", down, methods=["POST"]), Route("/garbage", garbage, methods=["POST"]),
        Route("/json", as_json, methods=["POST"]), Route("/silent", silent, methods=["POST"]),
    ])


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # the test's process keeps its own signal handlers


def listening_socket(port: int = 0) -> socket.socket:
    """A socket bound to ``port`` (0: a free one) and listening: a client may connect at
    once."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(64)
    return sock


@contextlib.asynccontextmanager
async def serving(port: int = 0) -> AsyncIterator[tuple[str, Recorder]]:
    """The agent served in this event loop (on ``port``, else a free one): yields its base
    URL and its recorder."""
    recorder = Recorder()
    sock = listening_socket(port)
    config = uvicorn.Config(make_app(recorder), log_level="warning", lifespan="off",
                            timeout_graceful_shutdown=1)
    server = _Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", recorder
    finally:
        server.should_exit = True
        await task
        sock.close()


def main() -> None:
    sock = listening_socket()
    print(sock.getsockname()[1], flush=True)
    config = uvicorn.Config(make_app(Recorder()), log_level="warning", lifespan="off")
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    sys.exit(main())
