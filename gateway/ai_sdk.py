"""The Vercel AI SDK's chat transport, on the gateway's durable conversations.

A ``useChat`` page (``DefaultChatTransport`` from the ``ai`` package) pointed at
``/v1/ai-sdk/chat`` gets the same conversations the WebSocket protocol serves: answers that
survive reloads and network loss, every device in step, history, branches and usage.

* ``POST /v1/ai-sdk/chat``: the body ``DefaultChatTransport`` sends (``id``, ``messages``,
  ``trigger``, ``messageId`` and the app's own fields). ``submit-message`` posts the last
  user message as a ``message`` (its UI message id is the ``client_msg_id``, so a resent
  request stores nothing twice); ``regenerate-message`` is a tree ``retry``. The reply is
  the turn as the AI SDK's *UI message stream* over SSE.
* ``GET /v1/ai-sdk/chat/{id}/stream``: the running turn from its start (``resume: true``),
  or 204 when none runs.
* ``GET /v1/ai-sdk/chat/{id}/messages``: the active path as ``UIMessage[]``.
* ``POST /v1/ai-sdk/chat/{id}/stop``: cancels the running turn (a closed response never
  does).

A turn's reply is read the way every reader reads a room (:func:`gateway.turn_reader.follow`,
which the AG-UI door shares): join, read the log from just before the turn's ``turn_start``
with its open streams, then the live frames merged by seq and stream position.
:class:`TurnChunks` turns those events into UI message chunks; :class:`MessageBuilder`
folds chunks into a ``UIMessage`` as the AI SDK does, so ``/messages`` shows what the
stream showed.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Annotated, Any, Literal

import msgspec
from msgspec import UNSET, UnsetType
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import BaseRoute

from . import logs
from . import protocol as p
from . import turn_reader as tr
from .auth import Principal, check_access
from .errors import Rejected
from .request_parts import chat_id_of, gateway_of, principal_of
from .turn_reader import Part, TurnParts

if TYPE_CHECKING:
    from .runtime import Gateway

PREFIX = "/v1/ai-sdk/chat"
# DefaultChatTransport sends every message of the chat each time: a long chat's body passes
# the API's usual 1 MiB. Only the last message is read.
MAX_BODY_BYTES = 8 << 20
HEADERS = {
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
    "x-vercel-ai-ui-message-stream": "v1",
}
MEDIA_TYPE = "text/event-stream"
DONE = b"data: [DONE]\n\n"
EXPOSE = "x-vercel-ai-ui-message-stream"  # the reply header a page on another origin reads

Chunk = dict[str, Any]
_encode = msgspec.json.encode


# --- what the routes take and answer ---------------------------------------------------


class UIPart(msgspec.Struct, frozen=True):
    """A part of a UI message; only text parts (and answered tool parts) are read."""

    type: Annotated[str, msgspec.Meta(min_length=1)]
    text: str | UnsetType = UNSET  # a `text` part's
    toolCallId: str | UnsetType = UNSET  # the AI SDK's names
    state: str | UnsetType = UNSET
    output: Any = UNSET


class UIMessage(msgspec.Struct, frozen=True):
    """A message as the AI SDK holds it (``UIMessage``)."""

    id: p.ClientMsgId  # a user message's: its idempotency key
    role: Literal["system", "user", "assistant"]
    parts: list[UIPart]
    metadata: Any = None


class ChatRequest(msgspec.Struct, frozen=True):
    """``DefaultChatTransport``'s body. Other fields are the app's own: they reach the
    agent as the message's ``data.props``."""

    id: p.ChatId  # the chat: a conversation, created for the caller if it does not exist
    messages: list[UIMessage]
    trigger: Literal["submit-message", "regenerate-message"] = "submit-message"
    messageId: str | None = None  # the message to answer again (not read)
    agent: p.AgentName | None = None  # the agent that answers a conversation this creates


KNOWN_FIELDS = frozenset({"id", "messages", "trigger", "messageId", "agent"})

_CHUNK_DATA = msgspec.Meta(extra_json_schema={
    "description": "one line of JSON: a UI message stream chunk (`start`, `start-step`, "
                   "`text-start`/`text-delta`/`text-end`, `reasoning-start`/`-delta`/`-end`, "
                   "`tool-input-available`, `tool-output-available`, `data-goal_state`, "
                   "`data-title`, `data-state`, `data-usage`, `finish-step`, `error`, "
                   "`abort`, `finish`), then `[DONE]`; protocol.md, \"The Vercel AI SDK\"",
})


class ChunkEvent(msgspec.Struct, frozen=True):
    """One event of a UI message stream, as an SSE client parses it."""

    data: Annotated[str, _CHUNK_DATA]


class OutMessage(msgspec.Struct, frozen=True):
    """A ``UIMessage`` of the active path."""

    id: str  # a user message's client_msg_id; an answer's turn id
    role: Literal["user", "assistant"]
    parts: list[dict[str, Any]]


class Stopped(msgspec.Struct, frozen=True):
    chat_id: p.ChatId
    turn_id: str | None  # the turn told to stop; null when none was running


# --- events -> UI message chunks -------------------------------------------------------


CHAT_DATA = ("goal_state", "title", "state")  # conversation-level events sent as data parts
FINISH_REASONS = {"complete": "stop", "awaiting_input": "tool-calls", "cancelled": "other",
                  "error": "error", "timeout": "error"}


class TurnChunks(TurnParts):
    """One turn as UI message chunks, from its events in log order: durable events
    (:meth:`event`), streamed pieces (:meth:`piece`) and open streams whole
    (:meth:`snapshot`), each given once and in any mix a resume produces."""

    trailer = DONE

    def begin(self) -> list[Chunk]:
        return [{"type": "start", "messageId": self.turn_id}, {"type": "start-step"}]

    def render(self, items: list[Chunk]) -> bytes:
        return _sse(items)

    def failure(self, message: str) -> list[Chunk]:
        return [{"type": "error", "errorText": message}]

    def opened(self, part: Part) -> list[Chunk]:
        return [{"type": f"{part.kind}-start", "id": part.id}]

    def wrote(self, part: Part, delta: str) -> list[Chunk]:
        return [{"type": f"{part.kind}-delta", "id": part.id, "delta": delta}]

    def closed(self, part: Part) -> list[Chunk]:
        return [{"type": f"{part.kind}-end", "id": part.id}]

    def chat_event(self, kind: str, data: dict[str, Any]) -> list[Chunk]:
        if kind in CHAT_DATA:
            return [{"type": f"data-{kind}", "id": kind, "data": data}]
        return []

    def turn_event(self, kind: str, data: dict[str, Any], seq: int | None) -> list[Chunk]:
        if kind == "tool_call" and isinstance(data.get("call_id"), str):
            return [{"type": "tool-input-available", "toolCallId": data["call_id"],
                     "toolName": str(data.get("name") or "tool"),
                     "input": data.get("args")}]
        if kind == "tool_result" and isinstance(data.get("call_id"), str):
            return [{"type": "tool-output-available", "toolCallId": data["call_id"],
                     "output": data.get("result")}]
        return []

    def ended(self, data: dict[str, Any]) -> list[Chunk]:
        out: list[Chunk] = []
        usage = data.get("usage")
        out.append({"type": "data-usage", "id": "usage",
                    "data": usage if isinstance(usage, dict) else {}})
        out.append({"type": "finish-step"})
        reason = str(data.get("reason") or "complete")
        if reason in ("error", "timeout"):
            error = data.get("error")
            out.append({"type": "error", "errorText": error if isinstance(error, str) and error
                        else "The agent did not answer in time." if reason == "timeout"
                        else "The agent failed while answering."})
        elif reason == "cancelled":
            out.append({"type": "abort", "reason": "cancelled"})
        out.append({"type": "finish", "finishReason": FINISH_REASONS.get(reason, "other")})
        return out


class MessageBuilder:
    """A ``UIMessage`` folded from UI message chunks, as the AI SDK's client builds it."""

    def __init__(self, message_id: str) -> None:
        self.parts: list[dict[str, Any]] = []
        self.id = message_id
        self._active: dict[tuple[str, str], dict[str, Any]] = {}

    def apply(self, chunks: list[Chunk]) -> None:
        for chunk in chunks:
            kind = chunk["type"]
            if kind in ("text-start", "reasoning-start"):
                part = {"type": kind[:-6], "text": "", "state": "streaming"}
                self.parts.append(part)
                self._active[(kind[:-6], chunk["id"])] = part
            elif kind in ("text-delta", "reasoning-delta"):
                found = self._active.get((kind[:-6], chunk["id"]))
                if found is not None:
                    found["text"] += chunk["delta"]
            elif kind in ("text-end", "reasoning-end"):
                found = self._active.pop((kind[:-4], chunk["id"]), None)
                if found is not None:
                    found["state"] = "done"
            elif kind == "start-step":
                self.parts.append({"type": "step-start"})
            elif kind == "tool-input-available":
                self.parts.append({"type": "tool-" + chunk["toolName"],
                                   "toolCallId": chunk["toolCallId"],
                                   "state": "input-available", "input": chunk["input"]})
            elif kind == "tool-output-available":
                self.answer(chunk["toolCallId"], chunk["output"])
            elif kind.startswith("data-"):
                part = {"type": kind, "id": chunk["id"], "data": chunk["data"]}
                for i, old in enumerate(self.parts):
                    if old["type"] == kind and old.get("id") == chunk["id"]:
                        self.parts[i] = part
                        break
                else:
                    self.parts.append(part)

    def answer(self, call_id: str, output: Any) -> bool:
        """A tool call's result: its part becomes ``output-available``."""
        for part in self.parts:
            if part.get("toolCallId") == call_id:
                part["state"] = "output-available"
                part["output"] = output
                return True
        return False


# --- requests --------------------------------------------------------------------------


_gateway, _who, _chat_id = gateway_of, principal_of, chat_id_of


async def _read_body(request: Request) -> bytes:
    return await tr.read_body(request, MAX_BODY_BYTES)


def parse_request(body: bytes) -> tuple[ChatRequest, dict[str, Any]]:
    """The request and the app's own fields."""
    raw = tr.json_object(body)
    try:
        chat = msgspec.convert(raw, ChatRequest)
    except msgspec.ValidationError as exc:
        raise Rejected("unprocessable", str(exc)) from None
    return chat, {k: v for k, v in raw.items() if k not in KNOWN_FIELDS}


def user_text(message: UIMessage) -> str:
    """A user message's text: its text parts, joined by newlines."""
    texts = [part.text for part in message.parts
             if part.type == "text" and isinstance(part.text, str)]
    return "\n".join(texts)


async def _answered(request: Request, work: Callable[[], Awaitable[Response]]) -> Response:
    """``work``'s response, or its refusal as every route gives it, with CORS headers."""
    return await tr.answered(request, work, EXPOSE)


# --- the routes ------------------------------------------------------------------------


async def chat(request: Request) -> Response:
    """``POST /v1/ai-sdk/chat``."""

    async def work() -> Response:
        gateway = _gateway(request)
        who = _who(request)
        try:
            body = await _read_body(request)
        except ClientDisconnect:
            return Response(status_code=400)
        req, extra = parse_request(body)
        logs.about_chat(req.id)
        conversations = gateway.conversations
        if req.trigger == "regenerate-message":  # an answer to regenerate: it must exist
            meta = check_access(who, await gateway.store.meta(req.id), req.id)
            ack = await conversations.retry(who, p.Retry(req.id))
            assert ack.turn_id is not None and ack.seq is not None
            after = ack.seq - 1  # the new turn_start's
        else:
            if not req.messages or req.messages[-1].role != "user":
                raise Rejected("invalid_request",
                               "submit-message: the last message must be the user's")
            last = req.messages[-1]
            text = user_text(last)
            if not text:
                raise Rejected("invalid_request", "the last message has no text part")
            data = tr.props_data(gateway, extra, "the app's own fields")
            meta = await tr.open_conversation(gateway, who, req.id, req.agent)
            ack = await conversations.post_message(who, p.Message(req.id, text, last.id, data))
            assert ack.turn_id is not None and ack.seq is not None
            after = ack.seq  # the user message's; a resend: the first one's
        return _stream(request, gateway, who, req.id, ack.turn_id,
                       p.Since(after, meta.epoch))

    return await _answered(request, work)


async def resume(request: Request) -> Response:
    """``GET /v1/ai-sdk/chat/{chat_id}/stream``: the running turn from its start, or 204."""

    async def work() -> Response:
        gateway = _gateway(request)
        who, chat_id = _who(request), _chat_id(request)
        meta = await gateway.store.meta(chat_id)
        if meta is None:
            return Response(status_code=204)  # a chat made up by the page, not posted yet
        check_access(who, meta, chat_id)
        started = await tr.running_turn_start(gateway, chat_id, meta)
        if started is None or not meta.turn_id:
            return Response(status_code=204)  # none runs (or it ended and is gone meanwhile)
        if request.method == "HEAD":
            return Response(media_type=MEDIA_TYPE, headers=HEADERS)
        return _stream(request, gateway, who, chat_id, meta.turn_id,
                       p.Since(started - 1, meta.epoch))

    return await _answered(request, work)


async def messages(request: Request) -> Response:
    """``GET /v1/ai-sdk/chat/{chat_id}/messages``: the active path as ``UIMessage[]``."""

    async def work() -> Response:
        gateway = _gateway(request)
        who, chat_id = _who(request), _chat_id(request)
        meta = await gateway.store.meta(chat_id)
        if meta is None:
            return Response(b"[]", media_type="application/json")
        check_access(who, meta, chat_id)
        return Response(_encode(await active_messages(gateway, chat_id)),
                        media_type="application/json")

    return await _answered(request, work)


async def stop(request: Request) -> Response:
    """``POST /v1/ai-sdk/chat/{chat_id}/stop``: cancel the running turn, if any."""

    async def work() -> Response:
        gateway = _gateway(request)
        who, chat_id = _who(request), _chat_id(request)
        meta = check_access(who, await gateway.store.meta(chat_id), chat_id)
        stopped = None
        if meta.status == "running" and meta.turn_id:
            try:
                ack = await gateway.conversations.cancel(who, p.Cancel(chat_id, meta.turn_id))
                stopped = ack.turn_id
            except Rejected as exc:
                if exc.code not in ("no_active_turn", "turn_mismatch"):
                    raise  # else it ended meanwhile: nothing to stop
        return Response(_encode(Stopped(chat_id, stopped)), media_type="application/json")

    return await _answered(request, work)


# --- the active path as UI messages ----------------------------------------------------


async def active_messages(gateway: Gateway, chat_id: str) -> list[OutMessage]:
    """Every message of the active path: user messages, and each turn's answer folded
    from its events as its stream showed it (a running turn's open streams included)."""
    store = gateway.store
    # Open streams first: one committed between the two reads is then in both, and the
    # commit completes it; read the other way round, it would be in neither.
    streams = (await store.read(chat_id, None, 0)).streams
    out: list[OutMessage] = []
    builders: dict[str, tuple[MessageBuilder, TurnChunks]] = {}
    current: tuple[MessageBuilder, TurnChunks] | None = None
    async for event in tr.path_events(gateway, chat_id):
        kind, node, raw = event.get("type"), event.get("node"), event.get("data")
        data: dict[str, Any] = raw if isinstance(raw, dict) else {}
        if kind == "user_message":
            text = data.get("text") if isinstance(data.get("text"), str) else ""
            message_id = data.get("client_msg_id") or data.get("msg_id") or node
            out.append(OutMessage(str(message_id), "user",
                                  [{"type": "text", "text": text}]))
        elif kind == "turn_start" and isinstance(node, str):
            builder, turn = MessageBuilder(node), TurnChunks(node)
            builder.apply(turn.begin())
            current = builders[node] = (builder, turn)
            out.append(OutMessage(node, "assistant", builder.parts))
        elif kind == "tool_result" and node is not None and node not in builders:
            # A person's answer to a client tool: the asking turn's part gets it.
            call_id = data.get("call_id")
            for builder, _ in builders.values():
                if isinstance(call_id, str) and builder.answer(call_id, data.get("result")):
                    break
        elif current is not None and (node is None or node == current[1].turn_id):
            current[0].apply(current[1].event(event, event.get("seq")))
            if current[1].done:
                current = None
    if current is not None:
        builder, turn = current
        for stream in streams:
            builder.apply(turn.snapshot(stream))
    return out


# --- a turn as a UI message stream ------------------------------------------------------


def _sse(chunks: list[Chunk]) -> bytes:
    return b"".join(b"data: " + _encode(chunk) + b"\n\n" for chunk in chunks)


def _stream(request: Request, gateway: Gateway, who: Principal, chat_id: str, turn_id: str,
            since: p.Since) -> Response:
    return StreamingResponse(tr.follow(request, gateway, who, chat_id, since,
                                       TurnChunks(turn_id)),
                             media_type=MEDIA_TYPE, headers=HEADERS)


# --- CORS (gateway/turn_reader.py) ----------------------------------------------------------


def allow_origin(request: Request, response: Response) -> None:
    """CORS headers on a reply to a page of an allowed origin."""
    tr.allow_origin(request, response, EXPOSE)


def preflight_routes() -> list[BaseRoute]:
    """``OPTIONS`` on every route of the transport (not in the OpenAPI document: browsers
    send it, not clients)."""
    return tr.preflight_routes("ai-sdk", (PREFIX, PREFIX + "/{chat_id}/stream",
                                          PREFIX + "/{chat_id}/messages",
                                          PREFIX + "/{chat_id}/stop"))
