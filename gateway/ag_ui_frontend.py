"""AG-UI for frontends: ``POST /v1/ag-ui`` on the gateway's durable conversations.

An AG-UI client (``@ag-ui/client``'s ``HttpAgent``, CopilotKit, assistant-ui) POSTs
``RunAgentInput`` and reads AG-UI events over SSE. Here the agent it runs is the
conversation: ``threadId`` is the chat id (created for the caller if it does not exist,
answered by ``forwardedProps.agent``).

* A new trailing ``user`` message becomes a ``message`` (its AG-UI id the
  ``client_msg_id``); one already stored is not stored again.
* ``resume`` (``interruptId``: the call id) or a trailing ``tool`` message answers the
  conversation's client tool that awaits a person (:meth:`Conversations.answer
  <gateway.conversations.Conversations.answer>`).
* Otherwise nothing is stored: the reply follows the running turn (a reconnect), or, when
  none runs, only tells the client where the conversation stands.

The reply is ``RUN_STARTED``, a ``MESSAGES_SNAPSHOT`` of the active path before the turn
(the gateway's log is the truth: the client's copy is replaced), ``STATE_SNAPSHOT`` of the
conversation's agent state, then the turn from its start as AG-UI events
(:class:`AgUiRun`, driven by :func:`gateway.turn_reader.follow` as the AI SDK's replies
are), then ``RUN_FINISHED`` or ``RUN_ERROR``. Messages keep the same ids in the snapshot as
in the events that streamed them: a stream's id (or ``e<seq>`` for a commit without one)
for text and reasoning, ``e<seq>`` for a tool call's message and a tool result.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

import msgspec
import pydantic
from ag_ui.core import (
    AssistantMessage,
    BaseEvent,
    CustomEvent,
    FunctionCall,
    Message,
    MessagesSnapshotEvent,
    ReasoningEndEvent,
    ReasoningMessage,
    ReasoningMessageContentEvent,
    ReasoningMessageEndEvent,
    ReasoningMessageStartEvent,
    ReasoningStartEvent,
    RunAgentInput,
    RunErrorEvent,
    RunFinishedEvent,
    RunStartedEvent,
    StateSnapshotEvent,
    StepFinishedEvent,
    StepStartedEvent,
    TextMessageContentEvent,
    TextMessageEndEvent,
    TextMessageStartEvent,
    TextPart,
    ToolCall,
    ToolCallArgsEvent,
    ToolCallEndEvent,
    ToolCallResultEvent,
    ToolCallStartEvent,
    ToolMessage,
    UserMessage,
)
from ag_ui.core.events import (
    RunFinishedCancelledOutcome,
    RunFinishedSuccessOutcome,
    TokenUsage,
)
from ag_ui.encoder import EventEncoder
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import BaseRoute

from . import logs
from . import protocol as p
from . import turn_reader as tr
from .errors import Rejected
from .redis.records import OpenStream
from .turn_reader import Part, TurnParts

if TYPE_CHECKING:
    from .runtime import Gateway

PATH = "/v1/ag-ui"
# An AG-UI client sends every message of the thread each time: a long thread's body passes
# the API's usual 1 MiB. Only the trailing messages are read.
MAX_BODY_BYTES = 8 << 20
MEDIA_TYPE = "text/event-stream"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
USAGE_COUNTS = ("input_tokens", "output_tokens", "total_tokens", "reasoning_tokens",
                "cached_input_tokens")

_encode = msgspec.json.encode
_decode = msgspec.json.decode
_encoder = EventEncoder()


# --- what the route takes and answers (for the OpenAPI document) --------------------------


class AgUiMessage(msgspec.Struct, frozen=True):
    """An AG-UI message (``ag_ui.core.Message``): only trailing ``user`` and ``tool``
    messages are read."""

    id: str
    role: str  # user, assistant, tool, system, developer, reasoning, activity
    content: Any = None  # a user message: text, or parts (their `text` parts are read)
    toolCallId: str | None = None  # a tool message: the call it answers


class AgUiResume(msgspec.Struct, frozen=True):
    interruptId: str  # the client tool call this answers
    status: str  # "resolved" answers it; "cancelled" leaves it unanswered
    payload: Any = None  # the answer


class AgUiRunInput(msgspec.Struct, frozen=True):
    """``RunAgentInput``, as AG-UI clients send it."""

    threadId: p.ChatId  # the chat: a conversation, created for the caller if need be
    runId: str  # echoed in RUN_STARTED and RUN_FINISHED
    messages: list[AgUiMessage]
    state: Any = None  # not read: the agent state is the conversation's
    tools: list[Any] | None = None  # not read: client tools are declared with PATCH
    context: list[Any] | None = None  # not read
    forwardedProps: Any = None  # `agent` names the agent; the rest reach it as data.props
    resume: list[AgUiResume] | None = None


_EVENT_DATA = msgspec.Meta(extra_json_schema={
    "description": "one line of JSON: an AG-UI event (`RUN_STARTED`, `MESSAGES_SNAPSHOT`, "
                   "`STATE_SNAPSHOT`, `TEXT_MESSAGE_START/CONTENT/END`, `REASONING_*`, "
                   "`TOOL_CALL_START/ARGS/END`, `TOOL_CALL_RESULT`, `STEP_STARTED/FINISHED`, "
                   "`CUSTOM`, then `RUN_FINISHED` or `RUN_ERROR`); protocol.md, \"AG-UI\"",
})


class AgUiEvent(msgspec.Struct, frozen=True):
    """One event of the reply, as an SSE client parses it."""

    data: Annotated[str, _EVENT_DATA]


# --- the active path as AG-UI messages ------------------------------------------------------


def _args_text(args: Any) -> str:
    """A tool call's arguments as AG-UI carries them: JSON text (text kept as it is)."""
    return args if isinstance(args, str) else _encode(args).decode()


def _result_text(result: Any) -> str:
    """A tool result as AG-UI's ``content``: text as it is, anything else as JSON."""
    return result if isinstance(result, str) else _encode(result).decode()


def _answer_of(content: Any) -> Any:
    """A ``tool`` message's content as a client tool's answer: its JSON when it parses,
    else the text (parts: their text, joined)."""
    if isinstance(content, list):
        content = "".join(getattr(part, "text", "") or "" for part in content)
    if not isinstance(content, str):
        return content
    try:
        return _decode(content)
    except msgspec.DecodeError:
        return content


def snapshot_messages(events: list[dict[str, Any]], before_turn: str | None = None
                      ) -> list[Message]:
    """The AG-UI messages of the active path's events, up to the ``turn_start`` of
    ``before_turn`` (that turn's own come as events)."""
    out: list[Message] = []
    for event in events:
        kind, node, seq = event.get("type"), event.get("node"), event.get("seq")
        raw = event.get("data")
        data: dict[str, Any] = raw if isinstance(raw, dict) else {}
        if kind == "turn_start" and before_turn is not None and node == before_turn:
            break
        if kind == "user_message":
            message_id = data.get("client_msg_id") or data.get("msg_id") or node
            out.append(UserMessage(id=str(message_id), content=str(data.get("text") or "")))
        elif kind in ("message", "reasoning") and node is not None:
            text = data.get("text")
            if not isinstance(text, str) or not text:
                continue
            stream_id = data.get("stream_id")
            message_id = stream_id if isinstance(stream_id, str) else f"e{seq}"
            out.append(AssistantMessage(id=message_id, content=text) if kind == "message"
                       else ReasoningMessage(id=message_id, content=text))
        elif kind == "tool_call" and isinstance(data.get("call_id"), str):
            call = ToolCall(id=data["call_id"], function=FunctionCall(
                name=str(data.get("name") or "tool"), arguments=_args_text(data.get("args"))))
            out.append(AssistantMessage(id=f"e{seq}", tool_calls=[call]))
        elif kind == "tool_result" and isinstance(data.get("call_id"), str):
            out.append(ToolMessage(id=f"e{seq}", tool_call_id=data["call_id"],
                                   content=_result_text(data.get("result"))))
    return out


# --- events -> AG-UI events -----------------------------------------------------------------


def _usage(usage: Any) -> list[TokenUsage] | None:
    """A turn's usage as AG-UI's (the counts it names; the others are not carried)."""
    if not isinstance(usage, dict):
        return None
    counts = {name: int(usage[name]) for name in USAGE_COUNTS
              if isinstance(usage.get(name), int | float) and usage[name] >= 0}
    return [TokenUsage.model_validate(counts)] if counts else None


class AgUiRun(TurnParts):
    """One run of an AG-UI client: where the conversation stands, then one turn as AG-UI
    events (``turn_id`` None: no turn, the run finishes at once)."""

    takes_ephemeral = True  # steps

    def __init__(self, thread_id: str, run_id: str, turn_id: str | None,
                 messages: list[Message], state: Any) -> None:
        super().__init__(turn_id or "")
        self.thread_id, self.run_id = thread_id, run_id
        self.messages, self.state = messages, state
        self.steps: list[str] = []  # steps started and not finished
        self.awaiting: list[str] = []  # client tool calls that wait for a person
        self.done = turn_id is None

    def begin(self) -> list[BaseEvent]:
        out: list[BaseEvent] = [
            RunStartedEvent(thread_id=self.thread_id, run_id=self.run_id),
            MessagesSnapshotEvent(messages=self.messages)]
        if self.state is not None:
            out.append(StateSnapshotEvent(snapshot=self.state))
        if self.done:
            out.append(RunFinishedEvent(thread_id=self.thread_id, run_id=self.run_id))
        return out

    def render(self, items: list[BaseEvent]) -> bytes:
        return "".join(_encoder.encode(event) for event in items).encode()

    def failure(self, message: str) -> list[BaseEvent]:
        return [RunErrorEvent(message=message, code="gateway")]

    def opened(self, part: Part) -> list[BaseEvent]:
        if part.kind == "reasoning":
            return [ReasoningStartEvent(message_id=part.id),
                    ReasoningMessageStartEvent(message_id=part.id)]
        return [TextMessageStartEvent(message_id=part.id, role="assistant")]

    def wrote(self, part: Part, delta: str) -> list[BaseEvent]:
        if part.kind == "reasoning":
            return [ReasoningMessageContentEvent(message_id=part.id, delta=delta)]
        return [TextMessageContentEvent(message_id=part.id, delta=delta)]

    def closed(self, part: Part) -> list[BaseEvent]:
        if part.kind == "reasoning":
            return [ReasoningMessageEndEvent(message_id=part.id),
                    ReasoningEndEvent(message_id=part.id)]
        return [TextMessageEndEvent(message_id=part.id)]

    def chat_event(self, kind: str, data: dict[str, Any]) -> list[BaseEvent]:
        if kind == "state" and "snapshot" in data:
            self.state = data["snapshot"]
            return [StateSnapshotEvent(snapshot=self.state)]
        if kind in ("title", "goal_state"):
            return [CustomEvent(name=f"gateway.{kind}", value=data)]
        return []

    def turn_event(self, kind: str, data: dict[str, Any], seq: int | None) -> list[BaseEvent]:
        call_id = data.get("call_id")
        if kind == "tool_call" and isinstance(call_id, str):
            if data.get("awaiting") is True:
                self.awaiting.append(call_id)
            args = _args_text(data.get("args"))
            out: list[BaseEvent] = [ToolCallStartEvent(
                tool_call_id=call_id, tool_call_name=str(data.get("name") or "tool"),
                parent_message_id=f"e{seq}")]
            if args:
                out.append(ToolCallArgsEvent(tool_call_id=call_id, delta=args))
            out.append(ToolCallEndEvent(tool_call_id=call_id))
            return out
        if kind == "tool_result" and isinstance(call_id, str):
            if call_id in self.awaiting:
                self.awaiting.remove(call_id)
            return [ToolCallResultEvent(message_id=f"e{seq}", tool_call_id=call_id,
                                        content=_result_text(data.get("result")), role="tool")]
        if kind == "custom" and isinstance(data.get("name"), str):
            return [CustomEvent(name=data["name"], value=data.get("value"))]
        return []

    def ephemeral(self, event: dict[str, Any]) -> list[BaseEvent]:
        raw = event.get("data")
        data: dict[str, Any] = raw if isinstance(raw, dict) else {}
        name = data.get("name")
        if event.get("type") != "step" or not isinstance(name, str) or not name or self.done:
            return []
        if data.get("status") == "started" and name not in self.steps:
            self.steps.append(name)
            return [StepStartedEvent(step_name=name)]
        if data.get("status") == "finished" and name in self.steps:
            self.steps.remove(name)
            return [StepFinishedEvent(step_name=name)]
        return []  # a step that started before this reply: not told

    def ended(self, data: dict[str, Any]) -> list[BaseEvent]:
        out: list[BaseEvent] = [StepFinishedEvent(step_name=name) for name in self.steps]
        self.steps = []
        usage = _usage(data.get("usage"))
        reason = str(data.get("reason") or "complete")
        if reason in ("error", "timeout"):
            error = data.get("error")
            message = (error if isinstance(error, str) and error
                       else "The agent did not answer in time." if reason == "timeout"
                       else "The agent failed while answering.")
            out.append(RunErrorEvent(message=message, code=reason, usage=usage))
        elif reason == "cancelled":
            out.append(RunFinishedEvent(thread_id=self.thread_id, run_id=self.run_id,
                                        outcome=RunFinishedCancelledOutcome(), usage=usage))
        else:
            outcome = (RunFinishedSuccessOutcome(pending_tool_call_ids=list(self.awaiting))
                       if self.awaiting else None)
            out.append(RunFinishedEvent(thread_id=self.thread_id, run_id=self.run_id,
                                        outcome=outcome, usage=usage))
        return out


# --- the route ------------------------------------------------------------------------------


def parse_input(body: bytes) -> tuple[RunAgentInput, str | None, dict[str, Any]]:
    """The run, the agent it names and the app's own props."""
    raw = tr.json_object(body)
    try:
        run = RunAgentInput.model_validate(raw)
    except pydantic.ValidationError as exc:
        where = "; ".join(
            "$" + "".join(f"[{part}]" if isinstance(part, int) else f".{part}"
                          for part in error["loc"]) + ": " + error["msg"]
            for error in exc.errors()[:3])
        raise Rejected("unprocessable", where) from None
    if not p.CHAT_ID_RE.match(run.thread_id):
        raise Rejected("unprocessable", f"$.threadId must match {p.CHAT_ID_PATTERN}")
    props = dict(run.forwarded_props) if isinstance(run.forwarded_props, dict) else {}
    agent = props.pop("agent", None)
    if agent is not None:
        try:
            agent = msgspec.convert(agent, p.AgentName)
        except msgspec.ValidationError:
            raise Rejected("unprocessable", "$.forwardedProps.agent must match "
                           f"{p.AGENT_NAME_PATTERN}") from None
    return run, agent, props


def _text_of(message: UserMessage) -> str:
    content = message.content
    if isinstance(content, str):
        return content
    return "\n".join(part.text for part in content if isinstance(part, TextPart))


def _answers(run: RunAgentInput) -> list[tuple[str, Any]]:
    """The client tool answers the run carries: its ``resume`` entries that resolve one,
    then its trailing ``tool`` messages."""
    out = [(entry.interrupt_id, entry.payload) for entry in run.resume or ()
           if entry.status == "resolved"]
    trailing: list[tuple[str, Any]] = []
    for message in reversed(run.messages):
        if not isinstance(message, ToolMessage):
            break
        trailing.insert(0, (message.tool_call_id, _answer_of(message.content)))
    return out + trailing


async def run_endpoint(request: Request) -> Response:
    """``POST /v1/ag-ui``."""

    async def work() -> Response:
        gateway: Gateway = request.app.state.gateway
        who = gateway.authenticate(request)
        logs.bind(user_id=who.user_id)
        try:
            body = await tr.read_body(request, MAX_BODY_BYTES)
        except ClientDisconnect:
            return Response(status_code=400)
        run, agent, props = parse_input(body)
        chat_id = run.thread_id
        logs.about_chat(chat_id)
        last = run.messages[-1] if run.messages else None
        text = _text_of(last) if isinstance(last, UserMessage) else ""
        if isinstance(last, UserMessage) and not text:
            raise Rejected("invalid_request", "the last message has no text")
        data = tr.props_data(gateway, props, "forwardedProps")
        meta = await tr.open_conversation(gateway, who, chat_id, agent)
        events = [event async for event in tr.path_events(gateway, chat_id)]
        answered = {str(e["data"].get("call_id")) for e in events
                    if e.get("type") == "tool_result" and isinstance(e.get("data"), dict)}
        stored = {str(e["data"].get("client_msg_id")) for e in events
                  if e.get("type") == "user_message" and isinstance(e.get("data"), dict)}
        conversations = gateway.conversations
        new: list[Message] = []
        answers = [(call, result) for call, result in _answers(run) if call not in answered]
        if answers:  # the first answer resumes the turn; the rest stand unanswered
            call_id, result = answers[0]
            ack = await conversations.answer(who, p.ToolResult(chat_id, call_id, result))
            assert ack.turn_id is not None and ack.seq is not None
            new = [ToolMessage(id=f"e{ack.seq}", tool_call_id=call_id,
                               content=_result_text(result))]
            turn_id, since = ack.turn_id, ack.seq  # the tool_result's; its turn_start next
        elif isinstance(last, UserMessage) and last.id not in stored:
            if len(last.id) > 128:
                raise Rejected("unprocessable", "$.messages[-1].id: at most 128 characters")
            ack = await conversations.post_message(
                who, p.Message(chat_id, text, last.id, data))
            assert ack.turn_id is not None and ack.seq is not None
            new = [UserMessage(id=last.id, content=text)]
            turn_id, since = ack.turn_id, ack.seq  # the user message's (a resend: the first)
        else:  # nothing new: the running turn from its start (a reconnect), or none
            started = await tr.running_turn_start(gateway, chat_id, meta)
            if started is None or not meta.turn_id:
                return _reply(request, gateway, who, AgUiRun(
                    chat_id, run.run_id, None, snapshot_messages(events),
                    _state(meta.state)), None)
            turn_id, since = meta.turn_id, started - 1
            streams = (await gateway.store.read(chat_id, None, 0)).streams
            new = _reasoning_so_far(events, streams, turn_id)
        messages = snapshot_messages(events, turn_id)
        for message in new:
            if all(m.id != message.id for m in messages):
                messages.append(message)
        translator = AgUiRun(chat_id, run.run_id, turn_id, messages, _state(meta.state))
        return _reply(request, gateway, who, translator, p.Since(since, meta.epoch))

    return await tr.answered(request, work)


def _reasoning_so_far(events: list[dict[str, Any]], streams: list[OpenStream],
                      turn_id: str) -> list[Message]:
    """The running turn's reasoning so far, each as an empty message: a client that
    reconnects holds it partly, and AG-UI clients keep the reasoning they hold when a
    snapshot has none, then append the replayed text to it. Emptied here, it is replayed
    whole, once."""
    ids = [str(e["data"].get("stream_id") or f"e{e.get('seq')}") for e in events
           if e.get("type") == "reasoning" and e.get("node") == turn_id
           and isinstance(e.get("data"), dict)]
    ids += [s.id for s in streams if s.type == "reasoning_delta" and s.turn_id == turn_id]
    return [ReasoningMessage(id=message_id, content="") for message_id in dict.fromkeys(ids)]


def _state(raw: bytes | None) -> Any:
    return _decode(raw) if raw else None


def _reply(request: Request, gateway: Gateway, who: Any, run: AgUiRun,
           since: p.Since | None) -> Response:
    if since is None:  # no turn: where the conversation stands, and the run is over
        async def once() -> Any:
            yield run.render(run.begin())
        return StreamingResponse(once(), media_type=MEDIA_TYPE, headers=HEADERS)
    return StreamingResponse(tr.follow(request, gateway, who, run.thread_id, since, run),
                             media_type=MEDIA_TYPE, headers=HEADERS)


def preflight_routes() -> list[BaseRoute]:
    """``OPTIONS /v1/ag-ui`` for a page on another origin (not in the OpenAPI document)."""
    return tr.preflight_routes("ag-ui", (PATH,))
