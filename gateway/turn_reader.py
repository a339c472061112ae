"""Following one turn over HTTP, for the frontend protocols the gateway serves (the Vercel
AI SDK's chat transport, :mod:`gateway.ai_sdk`; AG-UI, :mod:`gateway.ag_ui_frontend`).

A turn's reply is read the way every reader reads a room (:mod:`~gateway.sync`): join,
read the log from just before the turn's ``turn_start`` with its open streams, then the live
frames merged by seq and stream position; a reader that falls behind, or a piece that shows
a gap, reads again from the last seq it sent, and the output goes on where it stopped.

What the reader makes of the events is a :class:`Translator`'s: it is given the turn's
durable events (:meth:`~Translator.event`), its streamed pieces (:meth:`~Translator.piece`),
open streams whole (:meth:`~Translator.snapshot`), discarded streams
(:meth:`~Translator.discard`) and other live frames (:meth:`~Translator.ephemeral`), each
once and in any mix a resume produces, and says how its items are rendered and how a
failure is told. :class:`TurnParts` does the bookkeeping both protocols share: which
text or reasoning part is open, how much of it was sent, which position comes next.

Also here: what both doors do with a request (its body, the conversation it names, errors
as every route gives them) and CORS for pages on another origin.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any

import msgspec
from redis.exceptions import RedisError
from starlette.requests import Request
from starlette.responses import Response
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

log = logging.getLogger("gateway.turn_reader")

# Durable events one read of a turn may replay (a turn's tool calls, commits, notes).
REPLAY_LIMIT = 10_000
PATH_PAGE = 1000  # events per page when reading the active path
PING = b": ping\n\n"
PREFLIGHT_MAX_AGE = "600"

_encode = msgspec.json.encode
_decode = msgspec.json.decode

STREAM_KINDS = {"delta": "text", "reasoning_delta": "reasoning"}  # streamed type -> part
COMMIT_KINDS = {"message": "text", "reasoning": "reasoning"}  # their commits


class Gap(Exception):
    """A streamed piece past the next position: something was lost; read again."""


class Part:
    """A text or reasoning part of the answer: a stream's, or a commit's without one."""

    __slots__ = ("id", "kind", "next_pos", "open", "text")

    def __init__(self, kind: str, part_id: str) -> None:
        self.kind = kind  # "text" | "reasoning"
        self.id = part_id  # the stream id, or e<seq> for a commit with no stream
        self.text = ""  # what was sent of it
        self.next_pos = 0  # the stream position of the next delta
        self.open = True


class Translator:
    """What a turn reader makes of a turn: the interface :func:`follow` drives."""

    turn_id: str
    done: bool  # the turn ended: nothing more comes, the reply ends
    trailer: bytes = b""  # what the reply ends with once the turn is done
    takes_ephemeral = False  # whether :meth:`ephemeral` is given the live ephemeral frames

    def begin(self) -> list[Any]:
        """What the reply starts with."""
        raise NotImplementedError

    def event(self, event: dict[str, Any], seq: int | None) -> list[Any]:
        """A durable event of the conversation (the turn's, or the conversation's)."""
        raise NotImplementedError

    def piece(self, kind: str, stream_id: str, pos: int, text: str) -> list[Any]:
        """A streamed delta at ``pos`` of its stream (:class:`Gap` past the next one)."""
        raise NotImplementedError

    def snapshot(self, stream: OpenStream) -> list[Any]:
        """An open stream whole: what of its text was not sent yet."""
        raise NotImplementedError

    def discard(self, data: dict[str, Any]) -> list[Any]:
        """``stream_discarded``: a redelivered turn streams anew."""
        raise NotImplementedError

    def ephemeral(self, event: dict[str, Any]) -> list[Any]:
        """Another live frame with no seq (a ``step``, say); most are not sent."""
        return []

    def failure(self, message: str) -> list[Any]:
        """The reply must end before the turn does: say why."""
        raise NotImplementedError

    def render(self, items: list[Any]) -> bytes:
        """Items as the bytes of the reply."""
        raise NotImplementedError


class TurnParts(Translator):
    """A turn's text and reasoning parts, from its commits, pieces and open streams, each
    given once whatever the mix; a subclass says what opening, writing and closing a part
    is, and what the turn's other events are."""

    def __init__(self, turn_id: str) -> None:
        self.turn_id = turn_id
        self.parts: dict[str, Part] = {}
        self.done = False

    # --- what a protocol says ------------------------------------------------------------

    def opened(self, part: Part) -> list[Any]:
        raise NotImplementedError

    def wrote(self, part: Part, delta: str) -> list[Any]:
        raise NotImplementedError

    def closed(self, part: Part) -> list[Any]:
        raise NotImplementedError

    def chat_event(self, kind: str, data: dict[str, Any]) -> list[Any]:
        """A conversation-level event (no ``node``: ``title``, ``state``, ...)."""
        return []

    def turn_event(self, kind: str, data: dict[str, Any], seq: int | None) -> list[Any]:
        """Another durable event of the turn (``tool_call``, ``tool_result``, ...)."""
        return []

    def ended(self, data: dict[str, Any]) -> list[Any]:
        """``turn_end``, once every open part was closed."""
        return []

    # --- the bookkeeping -----------------------------------------------------------------

    def event(self, event: dict[str, Any], seq: int | None) -> list[Any]:
        if self.done:
            return []
        kind = event.get("type")
        data = event.get("data")
        data = data if isinstance(data, dict) else {}
        node = event.get("node")
        if node is None:
            return self.chat_event(str(kind), data)
        if node != self.turn_id:
            return []
        if kind in COMMIT_KINDS:
            return self._commit(COMMIT_KINDS[kind], data, seq)
        if kind == "turn_end":
            out = self.close_all()
            out += self.ended(data)
            self.done = True
            return out
        return self.turn_event(str(kind), data, seq)

    def piece(self, kind: str, stream_id: str, pos: int, text: str) -> list[Any]:
        part_kind = STREAM_KINDS.get(kind)
        if part_kind is None or self.done:
            return []
        out: list[Any] = []
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
            out += self.wrote(part, text)
        return out

    def snapshot(self, stream: OpenStream) -> list[Any]:
        part_kind = STREAM_KINDS.get(stream.type)
        if part_kind is None or self.done or stream.turn_id != self.turn_id:
            return []
        out: list[Any] = []
        part = self.parts.get(stream.id)
        if part is None:
            part = self._start(part_kind, stream.id, out)
        if not part.open:
            return out
        if len(stream.text) > len(part.text) and stream.text.startswith(part.text):
            rest = stream.text[len(part.text):]
            part.text = stream.text
            out += self.wrote(part, rest)
        part.next_pos = max(part.next_pos, stream.pos)
        return out

    def discard(self, data: dict[str, Any]) -> list[Any]:
        """The old part ends (neither protocol can take text back)."""
        part = self.parts.get(str(data.get("stream_id")))
        if part is None or not part.open or self.done:
            return []
        part.open = False
        return self.closed(part)

    def close_all(self) -> list[Any]:
        out: list[Any] = []
        for part in self.parts.values():
            if part.open:
                part.open = False
                out += self.closed(part)
        return out

    def _start(self, kind: str, part_id: str, out: list[Any]) -> Part:
        part = self.parts[part_id] = Part(kind, part_id)
        out += self.opened(part)
        return part

    def _commit(self, kind: str, data: dict[str, Any], seq: int | None) -> list[Any]:
        stream_id = data.get("stream_id")
        text = data.get("text")
        text = text if isinstance(text, str) else ""
        part_id = stream_id if isinstance(stream_id, str) else f"e{seq}"
        out: list[Any] = []
        part = self.parts.get(part_id)
        if part is None:
            part = self._start(kind, part_id, out)
        elif not part.open:
            return []
        if len(text) > len(part.text) and text.startswith(part.text):
            rest = text[len(part.text):]
            part.text = text
            out += self.wrote(part, rest)
        part.open = False
        out += self.closed(part)
        return out


# --- following a turn ----------------------------------------------------------------------


class EphemeralMember(SseMember):
    """A reply's room member that takes ephemeral frames too."""

    __slots__ = ()
    takes_ephemeral = True



async def follow(request: Request, gateway: Gateway, who: Principal, chat_id: str,
                 since: p.Since, turn: Translator) -> AsyncIterator[bytes]:
    """The turn as ``turn`` renders it: its events after ``since`` (the log, then live),
    until its ``turn_end``; then ``turn.trailer``."""
    logs.bind(user_id=who.user_id, chat_id=chat_id)
    hub, settings = gateway.hub, gateway.settings
    yield turn.render(turn.begin())
    try:
        while not turn.done:
            member = (EphemeralMember if turn.takes_ephemeral else SseMember)(
                hub, settings.queue_max_bytes)
            gateway.track_stream(who, member)
            try:
                await hub.join(chat_id, member)
                try:
                    caught = await catch_up(hub, chat_id, who, since, REPLAY_LIMIT, hub.mark())
                except Rejected as exc:
                    yield turn.render(turn.failure(exc.message))
                    return
                epoch = caught.meta.epoch
                if not caught.recovered:
                    yield turn.render(turn.failure(
                        "This answer can no longer be read from the history."))
                    return
                out: list[Any] = []
                for frame in caught.replay:
                    out += turn.event(_decode(frame.json), frame.seq)
                for stream in caught.streams:
                    out += turn.snapshot(stream)
                if out:
                    yield turn.render(out)
                cursor = caught.cursor
                async for piece in _live(request, member, turn, cursor, who.expires_at,
                                         settings.heartbeat):
                    if piece is None:
                        return  # the stream must end (token expired, deleted, left)
                    yield piece
                since = p.Since(cursor.last_seq, epoch)  # fell behind: read on from here
            finally:
                hub.leave(chat_id, member)
                gateway.untrack_stream(who, member)
        if turn.trailer:
            yield turn.trailer
    except (RedisError, ConnectionError, OSError, TimeoutError) as exc:
        log.warning("turn reply %s: backend failure (%s); ending the stream", chat_id, exc)


async def _live(request: Request, member: SseMember, turn: Translator, cursor: Any,
                expires_at: float | None, heartbeat: float
                ) -> AsyncIterator[bytes | None]:
    """Live frames rendered until the turn ends (returns), the reader must read again
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
        out: list[Any] = []
        again = False
        for entry in batch:
            if entry is None and member.terminated is not None:
                yield turn.render(out + turn.failure(member.terminated))
                yield None
                return
            if entry is None:  # fell behind, or the history was lost: read again
                again = True
                break
            tagged, frame = entry
            if frame.is_deleted:
                out += turn.failure("The conversation was deleted.")
                yield turn.render(out)
                yield None
                return
            if frame.seq is not None and (
                    (tagged is not None and tagged != epoch) or frame.seq > cursor.last_seq + 1):
                again = True  # another history, or a hole: the read tells which
                break
            if not cursor.admit(frame):
                continue
            try:
                out += frame_items(turn, frame)
            except Gap:
                again = True
                break
            if turn.done:
                break
        if out:
            yield turn.render(out)
        if again:
            return


def frame_items(turn: Translator, frame: Frame) -> list[Any]:
    """One live frame, given to the translator as what it is."""
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
    return turn.ephemeral(event)


# --- requests ------------------------------------------------------------------------------


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused (413) past ``limit`` bytes, declared or read."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise Rejected("payload_too_large", f"body is over {limit} bytes")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise Rejected("payload_too_large", f"body is over {limit} bytes")
    return bytes(body)


def json_object(body: bytes) -> dict[str, Any]:
    """A request body that must be one JSON object, refused with a clear reason if not."""
    try:
        raw = _decode(body)
    except msgspec.DecodeError as exc:
        raise Rejected("invalid_request", f"body is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise Rejected("unprocessable", "Expected `object`, got `" + type(raw).__name__ + "`")
    return raw


def props_data(gateway: Gateway, props: dict[str, Any], what: str) -> dict[str, Any] | None:
    """The app's own fields as a message's ``data`` (``{"props": ...}``), or None when
    there are none; refused past a frame (``what`` names them in the error)."""
    if not props:
        return None
    data = {"props": props}
    limit = gateway.settings.max_frame_bytes
    if len(_encode(data)) > limit:
        raise Rejected("payload_too_large", f"{what} are over {limit} bytes")
    return data


async def open_conversation(gateway: Gateway, who: Principal, chat_id: str,
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


async def running_turn_start(gateway: Gateway, chat_id: str, meta: Meta) -> int | None:
    """The seq of the running turn's ``turn_start``, or None when no turn runs."""
    if meta.status != "running" or not meta.turn_id:
        return None
    tree = await gateway.store.tree(chat_id)
    node = next((n for n in tree.nodes if n.id == meta.turn_id), None) if tree else None
    return node.seq if node is not None else None  # None: ended and gone meanwhile


async def path_events(gateway: Gateway, chat_id: str) -> AsyncIterator[dict[str, Any]]:
    """The events of the active path, in seq order (nothing for a conversation that does
    not exist)."""
    after = 0
    while True:
        page = await gateway.store.active_path(chat_id, after, PATH_PAGE)
        if page is None:
            return
        for raw in page.events:
            yield _decode(raw)
        if not page.events or page.scanned >= page.meta.seq:
            return
        after = page.scanned


def error_response(status: int, code: str, message: str) -> Response:
    return Response(_encode(ErrorBody(ErrorDetail(code, message))), status_code=status,
                    media_type="application/json")


async def answered(request: Request, work: Callable[[], Awaitable[Response]],
                   expose: str = "") -> Response:
    """``work``'s response, or its refusal as every route gives it; with CORS headers
    either way, so that a page on another origin can read the error too."""
    try:
        response = await work()
    except Rejected as exc:
        response = error_response(exc.http_status, exc.code, exc.message)
    except (RedisError, ConnectionError) as exc:
        response = error_response(503, "backend_unavailable", f"redis: {exc}")
    allow_origin(request, response, expose)
    return response


# --- CORS ----------------------------------------------------------------------------------


def _allowed(request: Request) -> str | None:
    """The request's ``Origin`` when the operator allows it (GATEWAY_ALLOWED_ORIGINS)."""
    origin = request.headers.get("origin")
    if origin is None:
        return None
    gateway: Gateway = request.app.state.gateway
    allowed = gateway.settings.allowed_origins
    return origin if "*" in allowed or origin in allowed else None


def allow_origin(request: Request, response: Response, expose: str = "") -> None:
    """CORS headers on a reply to a page of an allowed origin (``expose``: the reply's
    headers the page may read)."""
    origin = _allowed(request)
    response.headers.append("Vary", "Origin")
    if origin is not None:
        response.headers["Access-Control-Allow-Origin"] = origin
        response.headers["Access-Control-Allow-Credentials"] = "true"
        if expose:
            response.headers["Access-Control-Expose-Headers"] = expose


async def preflight(request: Request) -> Response:
    """``OPTIONS``: a browser asks before a cross-origin request with a token or JSON."""
    origin = _allowed(request)
    if origin is None:
        response = error_response(403, "forbidden", "this origin is not allowed "
                                  "(GATEWAY_ALLOWED_ORIGINS)")
        response.headers["Vary"] = "Origin"
        return response
    asked = request.headers.get("access-control-request-headers")
    return Response(status_code=204, headers={
        "Access-Control-Allow-Origin": origin,
        "Access-Control-Allow-Credentials": "true",
        "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
        "Access-Control-Allow-Headers": asked or "authorization, content-type",
        "Access-Control-Max-Age": PREFLIGHT_MAX_AGE,
        "Vary": "Origin, Access-Control-Request-Headers",
    })


def preflight_routes(name: str, paths: Iterable[str]) -> list[BaseRoute]:
    """``OPTIONS`` on each of ``paths`` (not in the OpenAPI document: browsers send it,
    not clients)."""
    return [Route(path, preflight, methods=["OPTIONS"], name=f"{name}-preflight:{path}")
            for path in paths]
