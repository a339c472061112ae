"""AG-UI agents: each turn one ``POST`` of ``RunAgentInput``, its event stream read live.

Any agent served over AG-UI (pydantic-ai's ``AGUIAdapter``, LangGraph, CrewAI, Mastra,
Agno, ...) answers a conversation through the gateway with :class:`AgUiAgent`, a handler for
:class:`gateway.sdk.agent.AgentWorker`::

    agent = AgUiAgent("http://127.0.0.1:9000/agent", headers={"Authorization": "Bearer ..."})
    worker = AgentWorker(redis, settings, agent)

The ``ag-ui-protocol`` package's types build the input and read the events; nothing of the
event schema is written here. One turn:

- **Input** (``RunAgentInput``): ``threadId`` the chat id; ``runId`` the turn and its attempt
  (``<turn_id>.<attempt>``: a redelivered turn is a new run); ``messages`` the conversation
  so far (:meth:`Turn.history`) with its stable ids: user and assistant messages, assistant
  ``toolCalls`` (arguments as JSON text) and ``tool`` messages with their ``toolCallId``;
  ``state`` the conversation's agent state (``{}`` when it has none); ``tools`` and
  ``context`` empty; ``forwardedProps`` the ``props`` object of the message's ``data``
  (``{}`` when none); ``protocolVersion`` the package's.
- **Output**, event by event, all through the :class:`Turn` (so a redelivered run replaces
  its stream and nothing shows twice):

  ==========================================  ===========================================
  AG-UI                                       the conversation
  ==========================================  ===========================================
  ``TEXT_MESSAGE_START/CONTENT/END``, CHUNK   ``delta`` pieces, then one committed
                                              ``message`` per AG-UI message
  ``REASONING_*`` (and legacy ``THINKING_*``) ``reasoning_delta``, then one ``reasoning``
  ``TOOL_CALL_START/ARGS/END``, CHUNK         one durable ``tool_call {call_id, name,
                                              args}`` once complete (``args`` parsed as
                                              JSON; kept as text when they do not parse)
  ``TOOL_CALL_RESULT``                        ``tool_result {call_id, result}`` (the
                                              content as sent: text, or a list of parts)
  ``STATE_SNAPSHOT``, ``STATE_DELTA``         one durable ``state {snapshot}`` per change:
                                              a delta (JSON Patch) is applied to the state
                                              so far (one that does not apply is skipped)
  ``STEP_STARTED/FINISHED``                   ephemeral ``step {name, status}``
  ``CUSTOM``                                  durable ``custom {name, value}``
  ``RUN_FINISHED``                            ``turn_end`` (its token ``usage`` summed)
  ``RUN_ERROR``                               ``turn_end`` ``reason: error``, the agent's
                                              message as ``error``
  ==========================================  ===========================================

  ``RUN_STARTED``, ``MESSAGES_SNAPSHOT`` (the conversation's log is the record, not the
  agent's copy), ``RAW``, ``ACTIVITY_*``, ``REASONING_ENCRYPTED_VALUE`` and ``SUBAGENT_*``
  publish nothing, nor does an event of a type this package does not know (a newer
  protocol's). A chunked message or call ends at the next event of another kind; a message
  or call still open at ``RUN_FINISHED`` is committed then. Streamed text still open at
  ``RUN_ERROR`` or a failure stays as the gateway's partial answer.
- **Stop.** A cancel closes the HTTP request at once; what streamed stays as the partial
  answer (the turn ends ``cancelled``). A publish refused because the turn is over
  (:class:`~gateway.sdk.agent.TurnOver`) stops the run too.
- **Failures** end the turn with ``reason: error`` and a sentence a person can read in
  ``turn_end.data.error``: the agent unreachable, a non-2xx answer, an answer that is not
  an event stream, an event that does not parse, a stream that ends or breaks before
  ``RUN_FINISHED``, or nothing for ``idle_timeout`` seconds. A connection that cannot be made
  is tried again after ``retry_delays`` (a few seconds in all); once the request was sent it
  never is, since the run may have had effects. Header values are in no message and no log.
- **A crashed worker**: the turn is redelivered and runs again as a new run (a new
  ``runId``), which replaces the partial stream (:mod:`gateway.sdk.agent`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import httpx
import jsonpatch
import jsonpointer
from ag_ui.core import (
    PROTOCOL_VERSION,
    AssistantMessage,
    BaseEvent,
    CustomEvent,
    Event,
    EventType,
    FunctionCall,
    ReasoningEndEvent,
    ReasoningMessageChunkEvent,
    ReasoningMessageContentEvent,
    ReasoningMessageEndEvent,
    ReasoningMessageStartEvent,
    RunAgentInput,
    RunErrorEvent,
    RunFinishedEvent,
    StateDeltaEvent,
    StateSnapshotEvent,
    StepFinishedEvent,
    StepStartedEvent,
    TextMessageChunkEvent,
    TextMessageContentEvent,
    TextMessageEndEvent,
    TextMessageStartEvent,
    Tool,
    ToolCall,
    ToolCallArgsEvent,
    ToolCallChunkEvent,
    ToolCallEndEvent,
    ToolCallResultEvent,
    ToolCallStartEvent,
    ToolMessage,
    UserMessage,
)
from ag_ui.core import Message as AgUiMessage
from pydantic import TypeAdapter, ValidationError

from ...errors import Rejected
from ..agent import Turn, TurnOver
from ..context import Message
from . import call_tool

log = logging.getLogger("gateway.agent.ag_ui")

T = TypeVar("T")

RETRY_DELAYS = (0.25, 0.5, 1.0, 2.0)  # a connection refused: five tries, 3.75 s in all
ERROR_MAX = 2000  # turn_end.data.error's bound
KNOWN_TYPES = frozenset(t.value for t in EventType)
# The THINKING_* events left the protocol in 1.0 for REASONING_*; older agents still send
# them. Renamed on the way in, as AG-UI's own client does.
LEGACY_TYPES = {
    "THINKING_START": "REASONING_START",
    "THINKING_END": "REASONING_END",
    "THINKING_TEXT_MESSAGE_START": "REASONING_MESSAGE_START",
    "THINKING_TEXT_MESSAGE_CONTENT": "REASONING_MESSAGE_CONTENT",
    "THINKING_TEXT_MESSAGE_END": "REASONING_MESSAGE_END",
}
USAGE_NAMES = {"input_tokens": "input_tokens", "output_tokens": "output_tokens",
               "total_tokens": "total_tokens", "reasoning_tokens": "reasoning_tokens",
               "cached_input_tokens": "cached_tokens",
               "cache_write_input_tokens": "cache_write_tokens"}

_EVENT: TypeAdapter[Any] = TypeAdapter(Event)


class AgentError(Exception):
    """The agent failed the turn; the message is for a person to read."""


class AgUiAgent:
    """A turn handler that runs each turn on an AG-UI agent at ``url``.

    - ``url``: the agent's endpoint, which takes the ``POST`` of ``RunAgentInput``.
    - ``headers``: sent with every request (``Authorization``, an API key...). Their values
      are never logged nor put in a message.
    - ``request_timeout``: seconds to connect and get the response's status.
    - ``idle_timeout``: seconds of silence allowed between events (and before the first).
    - ``retry_delays``: the waits between tries of a connection that cannot be made.
    - ``history_messages``, ``history_tokens``: the budgets of :meth:`Turn.history`.
    """

    kind = "ag-ui"

    def __init__(self, url: str, *, headers: Mapping[str, str] | None = None,
                 request_timeout: float = 30.0, idle_timeout: float = 120.0,
                 retry_delays: Sequence[float] = RETRY_DELAYS, history_messages: int = 120,
                 history_tokens: int = 0) -> None:
        if not url:
            raise ValueError("url is required")
        if request_timeout <= 0 or idle_timeout <= 0:
            raise ValueError("timeouts must be positive")
        self.url = url
        self._client: httpx.AsyncClient | None = None
        self._client_loop: asyncio.AbstractEventLoop | None = None
        self._headers = {"Accept": "text/event-stream", "Content-Type": "application/json",
                         **dict(headers or {})}
        self.request_timeout = float(request_timeout)
        self.idle_timeout = float(idle_timeout)
        self.retry_delays = tuple(float(d) for d in retry_delays)
        self.history_messages = history_messages
        self.history_tokens = history_tokens
        self.where = _display_url(url)

    def client(self) -> httpx.AsyncClient:
        """The HTTP client, kept for the next turns (one per event loop: its connections
        belong to one). A new one per turn cost about 22 ms of CPU (TLS certificates)."""
        loop = asyncio.get_running_loop()
        if self._client is None or self._client_loop is not loop:
            self._client = httpx.AsyncClient(
                timeout=httpx.Timeout(self.request_timeout, read=self.idle_timeout))
            self._client_loop = loop
        return self._client

    async def aclose(self) -> None:
        """Close the HTTP connections kept for the next turns."""
        if self._client is not None:
            client, self._client = self._client, None
            await client.aclose()

    def __repr__(self) -> str:  # no headers
        return f"<AgUiAgent at {self.where}>"

    async def __call__(self, turn: Turn) -> None:
        history = await turn.history(self.history_messages, self.history_tokens)
        body = self.run_input(turn, history).model_dump_json(by_alias=True).encode()
        run = _Run(self, turn)
        try:
            ending = await _unless_cancelled(turn, run.run(body))
        except AgentError as exc:
            log.warning("%r on %r: %s", turn, self, exc)
            await turn.end(reason="error", error=str(exc)[:ERROR_MAX])
            return
        if ending is None:  # cancelled: the request is closed, what streamed stays
            await turn.end(reason="cancelled")
        elif ending.error is not None:
            log.info("%r: the agent reported an error: %s", turn, ending.error)
            await turn.end(usage=ending.usage, reason="error", error=ending.error[:ERROR_MAX])
        else:
            await turn.end(usage=ending.usage)

    def run_input(self, turn: Turn, history: list[Message]) -> RunAgentInput:
        """The ``RunAgentInput`` of ``turn``, its conversation being ``history``."""
        props: Any = {}
        if isinstance(turn.data, dict) and isinstance(turn.data.get("props"), dict):
            props = turn.data["props"]
        state = turn.state
        return RunAgentInput(
            thread_id=turn.chat_id, run_id=f"{turn.turn_id}.{turn.attempt}",
            protocol_version=PROTOCOL_VERSION, state={} if state is None else state,
            messages=agui_messages(history), context=[], forwarded_props=props,
            tools=[Tool(name=tool.name, description=tool.description,
                        parameters=tool.parameters) for tool in turn.client_tools])


def agui_messages(history: list[Message]) -> list[AgUiMessage]:
    """:meth:`Turn.history`'s messages as AG-UI messages, with their stable ids."""
    out: list[AgUiMessage] = []
    for n, message in enumerate(history):
        ident = str(message.get("id") or f"m{n}")
        role = message.get("role")
        if role == "user":
            out.append(UserMessage(id=ident, content=_as_text(message.get("content"))))
        elif role == "assistant":
            calls = [ToolCall(id=str(call.get("id")),
                              function=FunctionCall(name=str(call.get("name") or ""),
                                                    arguments=_as_json_text(call.get("args"))))
                     for call in message.get("tool_calls") or ()]
            out.append(AssistantMessage(id=ident, content=message.get("content") or None,
                                        tool_calls=calls or None))
        elif role == "tool":
            out.append(ToolMessage(id=ident, tool_call_id=str(message.get("tool_call_id")),
                                   content=_as_text(message.get("content"))))
    return out


def _as_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    return "" if value is None else json.dumps(value)


def _as_json_text(args: Any) -> str:
    return args if isinstance(args, str) else json.dumps({} if args is None else args)


def parse_event(data: str) -> BaseEvent | None:
    """One SSE ``data`` payload as an AG-UI event; None for a type this package does not
    know (a newer protocol's). Raises :class:`AgentError` when it does not parse."""
    try:
        raw = json.loads(data)
    except ValueError:
        raise AgentError("The agent sent an event that is not JSON.") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("type"), str):
        raise AgentError("The agent sent an event without a type.")
    kind = LEGACY_TYPES.get(raw["type"], raw["type"])
    if kind != raw["type"]:
        raw = {**raw, "type": kind}
        raw.setdefault("messageId", "thinking")  # the legacy events name no message
    if kind not in KNOWN_TYPES:
        log.debug("skipping an AG-UI event of unknown type %r", kind)
        return None
    try:
        event: BaseEvent = _EVENT.validate_python(raw)
    except ValidationError as exc:
        log.warning("an AG-UI %s event that does not parse: %s", kind,
                    exc.errors(include_url=False, include_input=False))
        raise AgentError(f"The agent sent a {kind} event that does not parse.") from None
    return event


@dataclass
class Ending:
    """How a run ended: ``RUN_FINISHED`` (``error`` None) or ``RUN_ERROR``."""

    usage: dict[str, int] | None = None
    error: str | None = None


@dataclass
class _Call:
    name: str
    args: list[str] = field(default_factory=list)


class _Run:
    """One run of one turn: the HTTP request and the events it streams back."""

    def __init__(self, agent: AgUiAgent, turn: Turn) -> None:
        self.agent = agent
        self.turn = turn
        self.state: Any = turn.state if turn.state is not None else {}
        self.sent = False  # the request went out: never tried again
        # The open text message (its AG-UI id), and whether it came as chunks / has text.
        self.text: str | None = None
        self.text_chunked = False
        self.text_streamed = False
        self.reasoning: str | None = None
        self.reasoning_chunked = False
        self.reasoning_streamed = False
        self.calls: dict[str, _Call] = {}  # tool calls whose arguments are still coming
        self.chunk_call: str | None = None
        self._refused: set[str] = set()

    # --- the request ---------------------------------------------------------------------

    async def run(self, body: bytes) -> Ending:
        delays = iter(self.agent.retry_delays)
        while True:
            try:
                return await self._post(body)
            except httpx.ConnectError as exc:
                delay = next(delays, None)
                if self.sent or delay is None:
                    log.warning("%r: cannot connect to %s: %s", self.turn, self.agent.where,
                                type(exc).__name__)
                    raise AgentError("The agent could not be reached: nothing answers at its "
                                     "address.") from None
                log.info("%r: cannot connect to %s; trying again in %gs", self.turn,
                         self.agent.where, delay)
                await asyncio.sleep(delay)

    async def _post(self, body: bytes) -> Ending:
        agent = self.agent
        client = agent.client()
        request = client.build_request("POST", agent.url, content=body,
                                       headers=agent._headers)
        try:
            async with asyncio.timeout(agent.request_timeout):
                response = await client.send(request, stream=True)
        except (TimeoutError, httpx.TimeoutException):
            raise AgentError(f"The agent did not answer within "
                             f"{agent.request_timeout:g} s.") from None
        except httpx.ConnectError:
            raise
        except httpx.HTTPError as exc:
            log.warning("%r: requesting %s: %s", self.turn, agent.where, exc)
            raise AgentError("The connection to the agent failed before it "
                             "answered.") from None
        self.sent = True
        try:
            return await self._answer(response)
        except httpx.ReadTimeout:
            raise AgentError(f"The agent sent nothing for {agent.idle_timeout:g} s, "
                             "so its answer was stopped.") from None
        except httpx.HTTPError as exc:
            log.warning("%r: reading %s: %s", self.turn, agent.where, exc)
            raise AgentError("The connection to the agent broke off before its answer "
                             "was finished.") from None
        finally:
            await response.aclose()

    async def _answer(self, response: httpx.Response) -> Ending:
        if not response.is_success:
            detail = (await response.aread())[:300].decode(errors="replace")
            log.warning("%r: %s answered HTTP %d: %s", self.turn, self.agent.where,
                        response.status_code, detail)
            raise AgentError(f"The agent answered with HTTP {response.status_code} "
                             f"({response.reason_phrase or 'an error'}).")
        kind = response.headers.get("content-type", "").partition(";")[0].strip()
        if kind != "text/event-stream":
            raise AgentError(f"The agent did not answer with an event stream "
                             f"(its answer was {kind or 'untyped'}).")
        data: list[str] = []
        async for line in response.aiter_lines():
            if line:
                name, _, value = line.partition(":")
                if name == "data":
                    data.append(value[1:] if value.startswith(" ") else value)
                continue  # comments (":"), "event:", "id:", "retry:" carry nothing for us
            if not data:
                continue
            payload, data = "\n".join(data), []
            event = parse_event(payload)
            if event is not None:
                ending = await self.on(event)
                if ending is not None:
                    return ending
        if data:  # the last event, with no blank line after it
            event = parse_event("\n".join(data))
            if event is not None and (ending := await self.on(event)) is not None:
                return ending
        raise AgentError("The agent's answer ended before it was finished.")

    # --- the events ----------------------------------------------------------------------

    async def on(self, event: BaseEvent) -> Ending | None:
        """Publish what ``event`` means; an :class:`Ending` for the last one."""
        try:
            return await self._on(event)
        except TurnOver:
            raise
        except Rejected as exc:  # this event only: the run goes on
            if exc.code not in self._refused:
                self._refused.add(exc.code)
                log.warning("%r: the gateway refused the agent's %s: %s %s", self.turn,
                            event.type.value, exc.code, exc.message)
            return None

    async def _on(self, event: BaseEvent) -> Ending | None:
        turn = self.turn
        if isinstance(event, RunErrorEvent):  # what is open stays the partial answer
            return Ending(usage=_usage(event.usage),
                          error=event.message.strip() or "The agent reported an error.")
        # A run of chunks ends at the next event of another kind.
        if self.text_chunked and not isinstance(event, TextMessageChunkEvent):
            await self.commit_text()
        if self.reasoning_chunked and not isinstance(event, ReasoningMessageChunkEvent):
            await self.commit_reasoning()
        if self.chunk_call is not None and not isinstance(event, ToolCallChunkEvent):
            await self.finish_call(self.chunk_call)

        if isinstance(event, TextMessageStartEvent):
            await self.open_text(event.message_id)
        elif isinstance(event, TextMessageContentEvent):
            await self.open_text(event.message_id)
            await self.text_delta(event.delta)
        elif isinstance(event, TextMessageEndEvent):
            if self.text == event.message_id:
                await self.commit_text()
        elif isinstance(event, TextMessageChunkEvent):
            await self.open_text(event.message_id or self.text or "")
            self.text_chunked = True
            await self.text_delta(event.delta or "")

        elif isinstance(event, ReasoningMessageStartEvent):
            await self.open_reasoning(event.message_id)
        elif isinstance(event, ReasoningMessageContentEvent):
            await self.open_reasoning(event.message_id)
            await self.reasoning_delta(event.delta)
        elif isinstance(event, ReasoningMessageEndEvent):
            if self.reasoning == event.message_id:
                await self.commit_reasoning()
        elif isinstance(event, ReasoningMessageChunkEvent):
            await self.open_reasoning(event.message_id or self.reasoning or "")
            self.reasoning_chunked = True
            await self.reasoning_delta(event.delta or "")
        elif isinstance(event, ReasoningEndEvent):
            await self.commit_reasoning()

        elif isinstance(event, ToolCallStartEvent):
            self.calls[event.tool_call_id] = _Call(event.tool_call_name)
        elif isinstance(event, ToolCallArgsEvent):
            self.calls.setdefault(event.tool_call_id, _Call("")).args.append(event.delta)
        elif isinstance(event, ToolCallEndEvent):
            await self.finish_call(event.tool_call_id)
        elif isinstance(event, ToolCallChunkEvent):
            call_id = event.tool_call_id or self.chunk_call or ""
            if self.chunk_call is not None and call_id != self.chunk_call:
                await self.finish_call(self.chunk_call)
            call = self.calls.setdefault(call_id, _Call(event.tool_call_name or ""))
            call.name = call.name or event.tool_call_name or ""
            if event.delta:
                call.args.append(event.delta)
            self.chunk_call = call_id
        elif isinstance(event, ToolCallResultEvent):
            if event.tool_call_id in self.calls:  # its END never came
                await self.finish_call(event.tool_call_id)
            content = event.content
            result = content if isinstance(content, str) else [
                part.model_dump(mode="json", by_alias=True) for part in content]
            await turn.tool_result(event.tool_call_id, result)

        elif isinstance(event, StateSnapshotEvent):
            self.state = event.snapshot
            await turn.event("state", {"snapshot": self.state})
        elif isinstance(event, StateDeltaEvent):
            patch = [op.model_dump(mode="json", by_alias=True) for op in event.delta]
            try:
                self.state = jsonpatch.apply_patch(self.state, patch)
            except (jsonpatch.JsonPatchException, jsonpointer.JsonPointerException) as exc:
                log.warning("%r: the agent's STATE_DELTA does not apply (%s); skipped",
                            turn, exc)
                return None
            await turn.event("state", {"snapshot": self.state})

        elif isinstance(event, StepStartedEvent | StepFinishedEvent):
            status = "started" if isinstance(event, StepStartedEvent) else "finished"
            await turn.event("step", {"name": event.step_name, "status": status},
                             durable=False)
        elif isinstance(event, CustomEvent):
            await turn.event("custom", {"name": event.name, "value": event.value})

        elif isinstance(event, RunFinishedEvent):
            await self.commit_text()
            await self.commit_reasoning()
            for call_id in list(self.calls):
                await self.finish_call(call_id)
            return Ending(usage=_usage(event.usage))
        # RUN_STARTED, MESSAGES_SNAPSHOT, RAW, ACTIVITY_*, REASONING_START,
        # REASONING_ENCRYPTED_VALUE, SUBAGENT_*: nothing to publish.
        return None

    async def open_text(self, message_id: str) -> None:
        if self.text is not None and self.text != message_id:
            await self.commit_text()  # one committed message per AG-UI message
        self.text = message_id

    async def text_delta(self, text: str) -> None:
        if text:
            await self.turn.delta(text)
            self.text_streamed = True

    async def commit_text(self) -> None:
        streamed, self.text, self.text_chunked, self.text_streamed = \
            self.text_streamed, None, False, False
        if streamed:
            await self.turn.message()  # the stream's text

    async def open_reasoning(self, message_id: str) -> None:
        if self.reasoning is not None and self.reasoning != message_id:
            await self.commit_reasoning()
        self.reasoning = message_id

    async def reasoning_delta(self, text: str) -> None:
        if text:
            await self.turn.reasoning(text)
            self.reasoning_streamed = True

    async def commit_reasoning(self) -> None:
        streamed, self.reasoning, self.reasoning_chunked, self.reasoning_streamed = \
            self.reasoning_streamed, None, False, False
        if streamed:
            await self.turn.event("reasoning", {})

    async def finish_call(self, call_id: str) -> None:
        if self.chunk_call == call_id:
            self.chunk_call = None
        call = self.calls.pop(call_id, None)
        if call is None:
            return
        text = "".join(call.args)
        args: Any = {}
        if text.strip():
            try:
                args = json.loads(text)
            except ValueError:
                args = text  # kept as the agent sent it
        await call_tool(self.turn, call.name, args, call_id)


def _usage(reports: Sequence[Any] | None) -> dict[str, int] | None:
    """``RUN_FINISHED.usage`` (one report per provider and model) summed under the
    gateway's usual names."""
    if not reports:
        return None
    total: dict[str, int] = {}
    for report in reports:
        for name, ours in USAGE_NAMES.items():
            value = getattr(report, name, None)
            if isinstance(value, int):
                total[ours] = total.get(ours, 0) + value
    return total or None


async def _unless_cancelled(turn: Turn, work: Awaitable[T]) -> T | None:
    """``work``'s result, or None once ``turn`` is cancelled (``work`` is cancelled then,
    which closes its HTTP request at once)."""
    task = asyncio.ensure_future(work)
    waiter = asyncio.ensure_future(turn.cancel_event.wait())
    try:
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
    if task.cancelled():
        return None
    return task.result()


def _display_url(url: str) -> str:
    """``url`` with no user, password or query: fit for a log line."""
    with contextlib.suppress(ValueError):
        parts = urlsplit(url)
        host = parts.hostname or ""
        if parts.port:
            host = f"{host}:{parts.port}"
        return urlunsplit((parts.scheme, host, parts.path, "", ""))
    return "the configured address"
