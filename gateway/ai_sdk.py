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

A turn's reply is read the way every reader reads a room (:mod:`~gateway.sync`): join,
read the log from just before the turn's ``turn_start`` with its open streams, then the live
frames merged by seq and stream position. :class:`TurnChunks` turns those events into UI
message chunks; :class:`MessageBuilder` folds chunks into a ``UIMessage`` as the AI SDK
does, so ``/messages`` shows what the stream showed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Annotated, Any, Literal

import msgspec
from msgspec import UNSET, UnsetType
from redis.exceptions import RedisError
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import BaseRoute, Route

from . import logs
from . import protocol as p
from .auth import Principal, check_access
from .errors import ErrorBody, ErrorDetail, Rejected
from .frames import Frame
from .redis.records import Meta, OpenStream
from .sse import SseMember
from .sync import catch_up

if TYPE_CHECKING:
    from .runtime import Gateway

log = logging.getLogger("gateway.ai_sdk")

PREFIX = "/v1/ai-sdk/chat"
# DefaultChatTransport sends every message of the chat each time: a long chat's body passes
# the API's usual 1 MiB. Only the last message is read.
MAX_BODY_BYTES = 8 << 20
# Durable events one read of a turn may replay (a turn's tool calls, commits, notes).
REPLAY_LIMIT = 10_000
PATH_PAGE = 1000  # events per page when reading the active path
HEADERS = {
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
    "x-vercel-ai-ui-message-stream": "v1",
}
MEDIA_TYPE = "text/event-stream"
DONE = b"data: [DONE]\n\n"
PING = b": ping\n\n"
PREFLIGHT_MAX_AGE = "600"

Chunk = dict[str, Any]
_encode = msgspec.json.encode
_decode = msgspec.json.decode


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


STREAM_KINDS = {"delta": "text", "reasoning_delta": "reasoning"}  # streamed type -> part
COMMIT_KINDS = {"message": "text", "reasoning": "reasoning"}  # their commits
CHAT_DATA = ("goal_state", "title", "state")  # conversation-level events sent as data parts
FINISH_REASONS = {"complete": "stop", "awaiting_input": "tool-calls", "cancelled": "other",
                  "error": "error", "timeout": "error"}


class Gap(Exception):
    """A streamed piece past the next position: something was lost; read again."""


class _Part:
    __slots__ = ("id", "kind", "next_pos", "open", "text")

    def __init__(self, kind: str, part_id: str) -> None:
        self.kind = kind  # "text" | "reasoning"
        self.id = part_id
        self.text = ""  # what was sent of it
        self.next_pos = 0  # the stream position of the next delta
        self.open = True


class TurnChunks:
    """One turn as UI message chunks, from its events in log order: durable events
    (:meth:`event`), streamed pieces (:meth:`piece`) and open streams whole
    (:meth:`snapshot`), each given once and in any mix a resume produces."""

    def __init__(self, turn_id: str) -> None:
        self.turn_id = turn_id
        self.parts: dict[str, _Part] = {}
        self.done = False

    def begin(self) -> list[Chunk]:
        return [{"type": "start", "messageId": self.turn_id}, {"type": "start-step"}]

    def event(self, event: dict[str, Any], seq: int | None) -> list[Chunk]:
        """A durable event of the conversation."""
        if self.done:
            return []
        kind = event.get("type")
        data = event.get("data")
        data = data if isinstance(data, dict) else {}
        node = event.get("node")
        if node is None:
            if kind in CHAT_DATA:
                return [{"type": f"data-{kind}", "id": kind, "data": data}]
            return []
        if node != self.turn_id:
            return []
        if kind in COMMIT_KINDS:
            return self._commit(COMMIT_KINDS[kind], data, seq)
        if kind == "tool_call" and isinstance(data.get("call_id"), str):
            return [{"type": "tool-input-available", "toolCallId": data["call_id"],
                     "toolName": str(data.get("name") or "tool"),
                     "input": data.get("args")}]
        if kind == "tool_result" and isinstance(data.get("call_id"), str):
            return [{"type": "tool-output-available", "toolCallId": data["call_id"],
                     "output": data.get("result")}]
        if kind == "turn_end":
            return self._end(data)
        return []

    def piece(self, kind: str, stream_id: str, pos: int, text: str) -> list[Chunk]:
        """A streamed delta at ``pos`` of its stream (:class:`Gap` past the next one)."""
        part_kind = STREAM_KINDS.get(kind)
        if part_kind is None or self.done:
            return []
        out: list[Chunk] = []
        part = self.parts.get(stream_id)
        if part is None:
            if pos != 0:
                raise Gap(stream_id)
            part = self._start(part_kind, stream_id, out)
        if not part.open or pos < part.next_pos:
            return out
        if pos > part.next_pos:
            raise Gap(stream_id)
        part.next_pos += 1
        if text:
            part.text += text
            out.append({"type": f"{part.kind}-delta", "id": part.id, "delta": text})
        return out

    def snapshot(self, stream: OpenStream) -> list[Chunk]:
        """An open stream whole: what of its text was not sent yet."""
        part_kind = STREAM_KINDS.get(stream.type)
        if part_kind is None or self.done or stream.turn_id != self.turn_id:
            return []
        out: list[Chunk] = []
        part = self.parts.get(stream.id)
        if part is None:
            part = self._start(part_kind, stream.id, out)
        if not part.open:
            return out
        if len(stream.text) > len(part.text) and stream.text.startswith(part.text):
            rest = stream.text[len(part.text):]
            part.text = stream.text
            out.append({"type": f"{part.kind}-delta", "id": part.id, "delta": rest})
        part.next_pos = max(part.next_pos, stream.pos)
        return out

    def discard(self, data: dict[str, Any]) -> list[Chunk]:
        """``stream_discarded``: a redelivered turn streams anew; the old part ends."""
        part = self.parts.get(str(data.get("stream_id")))
        if part is None or not part.open or self.done:
            return []
        part.open = False
        return [{"type": f"{part.kind}-end", "id": part.id}]

    def _start(self, kind: str, part_id: str, out: list[Chunk]) -> _Part:
        part = self.parts[part_id] = _Part(kind, part_id)
        out.append({"type": f"{kind}-start", "id": part_id})
        return part

    def _commit(self, kind: str, data: dict[str, Any], seq: int | None) -> list[Chunk]:
        stream_id = data.get("stream_id")
        text = data.get("text")
        text = text if isinstance(text, str) else ""
        part_id = stream_id if isinstance(stream_id, str) else f"e{seq}"
        out: list[Chunk] = []
        part = self.parts.get(part_id)
        if part is None:
            part = self._start(kind, part_id, out)
        elif not part.open:
            return []
        if len(text) > len(part.text) and text.startswith(part.text):
            out.append({"type": f"{kind}-delta", "id": part_id,
                        "delta": text[len(part.text):]})
            part.text = text
        part.open = False
        out.append({"type": f"{kind}-end", "id": part_id})
        return out

    def _end(self, data: dict[str, Any]) -> list[Chunk]:
        out: list[Chunk] = []
        for part in self.parts.values():
            if part.open:
                part.open = False
                out.append({"type": f"{part.kind}-end", "id": part.id})
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
        self.done = True
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


def _gateway(request: Request) -> Gateway:
    gateway: Gateway = request.app.state.gateway
    return gateway


def _who(request: Request) -> Principal:
    who = _gateway(request).authenticate(request)
    logs.bind(user_id=who.user_id)
    return who


def _chat_id(request: Request) -> str:
    chat_id: str = request.path_params["chat_id"]
    if not p.CHAT_ID_RE.match(chat_id):
        raise Rejected("invalid_request", f"chat_id must match {p.CHAT_ID_PATTERN}")
    logs.about_chat(chat_id)
    return chat_id


async def _read_body(request: Request) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise Rejected("payload_too_large", f"body is over {MAX_BODY_BYTES} bytes")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise Rejected("payload_too_large", f"body is over {MAX_BODY_BYTES} bytes")
    return bytes(body)


def parse_request(body: bytes) -> tuple[ChatRequest, dict[str, Any]]:
    """The request and the app's own fields."""
    try:
        raw = _decode(body)
    except msgspec.DecodeError as exc:
        raise Rejected("invalid_request", f"body is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise Rejected("unprocessable", "Expected `object`, got `" + type(raw).__name__ + "`")
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


async def _conversation(gateway: Gateway, who: Principal, chat_id: str,
                        agent: str | None) -> Meta:
    """The conversation, created for ``who`` (answered by ``agent``) if it does not exist."""
    meta = await gateway.store.meta(chat_id)
    if meta is None:
        try:
            await gateway.conversations.create(who, chat_id, None, agent or "")
        except Rejected as exc:
            if exc.code != "conflict":  # made meanwhile, by this user or another
                raise
        meta = await gateway.store.meta(chat_id)
    return check_access(who, meta, chat_id)


def _error(status: int, code: str, message: str) -> Response:
    return Response(_encode(ErrorBody(ErrorDetail(code, message))), status_code=status,
                    media_type="application/json")


async def _answered(request: Request, work: Callable[[], Awaitable[Response]]) -> Response:
    """``work``'s response, or its refusal as every route gives it; with CORS headers
    either way, so that a page on another origin can read the error too."""
    try:
        response = await work()
    except Rejected as exc:
        response = _error(exc.http_status, exc.code, exc.message)
    except (RedisError, ConnectionError) as exc:
        response = _error(503, "backend_unavailable", f"redis: {exc}")
    allow_origin(request, response)
    return response


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
            data = {"props": extra} if extra else None
            if data is not None and len(_encode(data)) > gateway.settings.max_frame_bytes:
                raise Rejected("payload_too_large", "the app's own fields are over "
                               f"{gateway.settings.max_frame_bytes} bytes")
            meta = await _conversation(gateway, who, req.id, req.agent)
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
        if meta.status != "running" or not meta.turn_id:
            return Response(status_code=204)
        tree = await gateway.store.tree(chat_id)
        node = next((n for n in tree.nodes if n.id == meta.turn_id), None) if tree else None
        if node is None:
            return Response(status_code=204)  # ended and gone meanwhile
        if request.method == "HEAD":
            return Response(media_type=MEDIA_TYPE, headers=HEADERS)
        return _stream(request, gateway, who, chat_id, meta.turn_id,
                       p.Since(node.seq - 1, meta.epoch))

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
    after = 0
    while True:
        page = await store.active_path(chat_id, after, PATH_PAGE)
        if page is None:
            break
        for raw in page.events:
            event = _decode(raw)
            kind, node = event.get("type"), event.get("node")
            data = event.get("data") if isinstance(event.get("data"), dict) else {}
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
        if not page.events or page.scanned >= page.meta.seq:
            break
        after = page.scanned
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
    return StreamingResponse(turn_stream(request, gateway, who, chat_id, turn_id, since),
                             media_type=MEDIA_TYPE, headers=HEADERS)


async def turn_stream(request: Request, gateway: Gateway, who: Principal, chat_id: str,
                      turn_id: str, since: p.Since) -> AsyncIterator[bytes]:
    """The turn ``turn_id`` as UI message chunks: its events after ``since`` (the log, then
    live), until its ``turn_end``. A reader that falls behind, or a piece that shows a
    gap, reads again from the last seq it sent: the chunks go on where they stopped."""
    logs.bind(user_id=who.user_id, chat_id=chat_id)
    hub, settings = gateway.hub, gateway.settings
    turn = TurnChunks(turn_id)
    yield _sse(turn.begin())
    try:
        while not turn.done:
            member = SseMember(hub, settings.queue_max_bytes)
            try:
                await hub.join(chat_id, member)
                try:
                    caught = await catch_up(hub, chat_id, who, since, REPLAY_LIMIT, hub.mark())
                except Rejected as exc:
                    yield _sse([{"type": "error", "errorText": exc.message}])
                    return
                epoch = caught.meta.epoch
                if not caught.recovered:
                    yield _sse([{"type": "error", "errorText":
                                 "This answer can no longer be read from the history."}])
                    return
                out: list[Chunk] = []
                for frame in caught.replay:
                    out += turn.event(_decode(frame.json), frame.seq)
                for stream in caught.streams:
                    out += turn.snapshot(stream)
                if out:
                    yield _sse(out)
                cursor = caught.cursor
                async for piece in _live(request, member, turn, cursor, who.expires_at,
                                         settings.heartbeat):
                    if piece is None:
                        return  # the stream must end (token expired, deleted, left)
                    yield piece
                since = p.Since(cursor.last_seq, epoch)  # fell behind: read on from here
            finally:
                hub.leave(chat_id, member)
        yield DONE
    except (RedisError, ConnectionError, OSError, TimeoutError) as exc:
        log.warning("ai-sdk stream %s: backend failure (%s); ending the stream", chat_id, exc)


async def _live(request: Request, member: SseMember, turn: TurnChunks, cursor: Any,
                expires_at: float | None, heartbeat: float
                ) -> AsyncIterator[bytes | None]:
    """Live frames as chunks until the turn ends (returns), the reader must read again
    (returns), or the stream must end (yields None)."""
    epoch = cursor.epoch
    while not turn.done:
        timeout = heartbeat
        if expires_at is not None:
            left = expires_at - time.time()
            if left <= 0:
                yield b": token expired\n\n"
                yield None
                return
            timeout = min(timeout, left)
        batch = await member.next_batch(timeout)
        if batch is None:
            if await request.is_disconnected():
                yield None
                return
            yield PING
            continue
        out: list[Chunk] = []
        again = False
        for entry in batch:
            if entry is None:  # fell behind, or the history was lost: read again
                again = True
                break
            tagged, frame = entry
            if frame.is_deleted:
                out.append({"type": "error", "errorText": "The conversation was deleted."})
                yield _sse(out)
                yield None
                return
            if frame.seq is not None and (
                    (tagged is not None and tagged != epoch) or frame.seq > cursor.last_seq + 1):
                again = True  # another history, or a hole: the read tells which
                break
            if not cursor.admit(frame):
                continue
            try:
                out += _frame_chunks(turn, frame)
            except Gap:
                again = True
                break
            if turn.done:
                break
        if out:
            yield _sse(out)
        if again:
            return


def _frame_chunks(turn: TurnChunks, frame: Frame) -> list[Chunk]:
    event = _decode(frame.json)
    if frame.stream is not None:
        data = event.get("data")
        text = data.get("text") if isinstance(data, dict) else None
        return turn.piece(str(event.get("type")), frame.stream[0], frame.stream[1],
                          text if isinstance(text, str) else "")
    if frame.is_discard:
        data = event.get("data")
        return turn.discard(data if isinstance(data, dict) else {})
    if frame.seq is not None:
        return turn.event(event, frame.seq)
    return []


# --- CORS ------------------------------------------------------------------------------


def _allowed(request: Request) -> str | None:
    """The request's ``Origin`` when the operator allows it (GATEWAY_ALLOWED_ORIGINS)."""
    origin = request.headers.get("origin")
    if origin is None:
        return None
    allowed = _gateway(request).settings.allowed_origins
    return origin if "*" in allowed or origin in allowed else None


def allow_origin(request: Request, response: Response) -> None:
    """CORS headers on a reply to a page of an allowed origin."""
    origin = _allowed(request)
    response.headers.append("Vary", "Origin")
    if origin is not None:
        response.headers["Access-Control-Allow-Origin"] = origin
        response.headers["Access-Control-Allow-Credentials"] = "true"
        response.headers["Access-Control-Expose-Headers"] = "x-vercel-ai-ui-message-stream"


async def preflight(request: Request) -> Response:
    """``OPTIONS``: a browser asks before a cross-origin request with a token or JSON."""
    origin = _allowed(request)
    if origin is None:
        response = _error(403, "forbidden", "this origin is not allowed "
                          "(GATEWAY_ALLOWED_ORIGINS)")
        response.headers["Vary"] = "Origin"
        return response
    asked = request.headers.get("access-control-request-headers")
    response = Response(status_code=204, headers={
        "Access-Control-Allow-Origin": origin,
        "Access-Control-Allow-Credentials": "true",
        "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
        "Access-Control-Allow-Headers": asked or "authorization, content-type",
        "Access-Control-Max-Age": PREFLIGHT_MAX_AGE,
        "Vary": "Origin, Access-Control-Request-Headers",
    })
    return response


def preflight_routes() -> list[BaseRoute]:
    """``OPTIONS`` on every route of the transport (not in the OpenAPI document: browsers
    send it, not clients)."""
    return [Route(path, preflight, methods=["OPTIONS"], name=f"ai-sdk-preflight:{path}")
            for path in (PREFIX, PREFIX + "/{chat_id}/stream", PREFIX + "/{chat_id}/messages",
                         PREFIX + "/{chat_id}/stop")]
