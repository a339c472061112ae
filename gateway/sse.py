"""Server-Sent Events: one conversation's durable events over plain HTTP.

``GET /v1/conversations/{chat_id}/stream`` is for clients that cannot hold a WebSocket (a
browser ``EventSource``, ``curl``, a serverless function). Every durable event is sent as::

    id: <epoch>:<seq>
    event: <type>
    data: <the frame JSON exactly as stored>

so the ``Last-Event-ID`` a client sends back on reconnect is the WebSocket ``since``, and the
resume is the WebSocket's own (:mod:`~gateway.sync`): join, read, plan, merge.

Streamed deltas (an answer being written) are sent too, with ids
``<epoch>:<seq>:<stream id>:<pos>``. Each open stream first arrives whole, as one
``event: stream`` (its text so far, ``pos`` the next position), unless the client's
``Last-Event-ID`` shows it holds that text already; live deltas continue from there, and
``stream_discarded`` drops one. Other ephemeral frames are not sent.

Each response is a room :class:`~gateway.rooms.Member` whose queue is bounded in bytes: fan-out
never waits for a slow reader. Past ``queue_max_bytes`` the stream ends and the client resumes
with ``Last-Event-ID``, exactly as a WebSocket closed with 4008 resumes with ``since``.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import msgspec
from redis.exceptions import RedisError
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from . import logs
from . import protocol as p
from .auth import Principal, check_access
from .errors import Rejected
from .frames import Frame
from .hub import Hub
from .redis.records import Meta, OpenStream
from .rooms import Cursor
from .streams import held
from .sync import catch_up

if TYPE_CHECKING:
    from .runtime import Gateway

log = logging.getLogger("gateway.sse")

HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
MEDIA_TYPE = "text/event-stream"
PING = b": ping\n\n"
CHUNK_BYTES = 64 * 1024  # a replay is written in chunks of about this size
# "<epoch>:<seq>", or "<epoch>:<seq>:<stream id>:<pos>" after a streamed delta; epochs and
# stream ids are hex-ish tokens, but any id-safe word is accepted.
LAST_EVENT_ID_RE = re.compile(
    r"^([A-Za-z0-9_.-]{1,64}):(0|[1-9][0-9]{0,17})(?::([A-Za-z0-9_.-]{1,80}):([0-9]{1,9}))?$")


_encode = msgspec.json.encode
_TYPE_PREFIX = b'{"type":"'

# A queue entry: the room's epoch when the frame was fanned out (None if not yet known) and
# the frame; None itself is the overflow marker.
Entry = tuple[str | None, Frame]


class SseMember:
    """One SSE response in a hub room: durable frames wait in a queue bounded in bytes.

    ``deliver`` never blocks. When the queue would pass ``max_bytes``, the member stops
    taking frames and queues the overflow marker: the response sends what it already has and
    ends, and the client resumes from the last id it received.
    """

    __slots__ = ("_hub", "_queue", "max_bytes", "overflowed", "principal", "queued_bytes",
                 "removal", "terminated")
    # Ephemeral frames (but streamed deltas) are not queued; a subclass that reads them (an
    # AG-UI reply's steps: gateway/turn_reader.py) says so.
    takes_ephemeral = False

    def __init__(self, hub: Hub, max_bytes: int) -> None:
        self._hub = hub
        self._queue: asyncio.Queue[Entry | None] = asyncio.Queue()
        self.max_bytes = max_bytes
        self.queued_bytes = 0
        self.overflowed = False
        self.principal: Principal | None = None  # whose stream (set while it is tracked)
        self.terminated: str | None = None  # why an administrator ended it
        self.removal: Frame | None = None  # the `removed` frame that ended it

    def deliver(self, chat_id: str, frame: Frame) -> None:
        if self.overflowed:
            return
        if (not self.takes_ephemeral and frame.seq is None and frame.stream is None
                and not frame.is_deleted and not frame.is_discard):
            return  # ephemeral: not sent over SSE
        size = frame.size
        if self.queued_bytes and self.queued_bytes + size > self.max_bytes:
            self.overflowed = True
            self._queue.put_nowait(None)
            return
        room = self._hub.room(chat_id)
        self._queue.put_nowait((room.epoch if room is not None else None, frame))
        self.queued_bytes += size

    def deliver_feed(self, frame: Frame) -> None:
        """Never joined to a feed: conversation-list frames are WebSocket-only."""

    def deliver_signal(self, chat_id: str, frame: Frame, skip: str, version: int) -> None:
        """Presence and typing are WebSocket-only."""

    def removed(self, chat_id: str, user_id: str, frame: Frame) -> None:
        """Its user was removed from the conversation: the stream ends with ``removed``."""
        if self.principal is not None and self.principal.user_id == user_id:
            self.removal = frame
            self.terminate("removed from the conversation")

    def resync(self, chat_id: str) -> None:
        """History lost: end the response; the reconnect gets ``event: reset``."""
        if not self.overflowed:
            self.overflowed = True
            self._queue.put_nowait(None)

    def terminate(self, reason: str) -> None:
        """An administrator ended the stream (a disconnection, a revoked token)."""
        if self.terminated is None:
            self.terminated = reason
            self._queue.put_nowait(None)

    async def next_batch(self, within: float) -> list[Entry | None] | None:
        """Everything queued, waiting up to ``within`` seconds for the first; None if none."""
        try:
            first = await asyncio.wait_for(self._queue.get(), within)
        except TimeoutError:
            return None
        batch = [first]
        while not self._queue.empty():
            batch.append(self._queue.get_nowait())
        for entry in batch:
            if entry is not None:
                self.queued_bytes -= entry[1].size
        return batch


# --- wire format ----------------------------------------------------------------------


def event_type(json: bytes) -> bytes:
    """The frame's ``type``: stored frames all start with it, so no decoding is needed."""
    if json.startswith(_TYPE_PREFIX):
        end = json.find(b'"', len(_TYPE_PREFIX))
        if end > 0:
            return json[len(_TYPE_PREFIX):end]
    try:
        kind = msgspec.json.decode(json, type=dict[str, Any]).get("type")
    except msgspec.DecodeError:
        kind = None
    text = kind if isinstance(kind, str) and kind else "message"
    return " ".join(text.split()).encode()


def format_event(event: bytes, data: bytes, event_id: bytes | None = None) -> bytes:
    """One SSE event. ``data`` that spans lines becomes several ``data:`` lines, which the
    client joins back with ``\\n`` (stored frames are single-line JSON, so this is a guard)."""
    head = b"id: " + event_id + b"\n" if event_id is not None else b""
    head += b"event: " + event + b"\n"
    if b"\n" in data or b"\r" in data:
        return head + b"".join(b"data: " + line + b"\n" for line in data.splitlines()) + b"\n"
    return head + b"data: " + data + b"\n\n"


def event_id(epoch: str, seq: int, stream: tuple[str, int] | None = None) -> bytes:
    if stream is None:
        return f"{epoch}:{seq}".encode()
    return f"{epoch}:{seq}:{stream[0]}:{stream[1]}".encode()


class LastEventId(msgspec.Struct, frozen=True):
    since: p.Since
    stream: tuple[str, int] | None = None  # the last streamed delta the client holds


def parse_last_event_id(value: str) -> LastEventId:
    match = LAST_EVENT_ID_RE.match(value.strip())
    if match is None:
        raise Rejected("invalid_request", "Last-Event-ID must be '<epoch>:<seq>' or "
                       "'<epoch>:<seq>:<stream>:<pos>', as sent in an event's id")
    stream = (match.group(3), int(match.group(4))) if match.group(3) else None
    return LastEventId(p.Since(int(match.group(2)), match.group(1)), stream)


def stream_event(chat_id: str, epoch: str, seq: int, stream: OpenStream) -> bytes:
    """An open stream, whole: the client shows ``text`` and continues at ``pos``."""
    data = _encode({"chat_id": chat_id, "id": stream.id, "type": stream.type,
                    "turn_id": stream.turn_id, "text": stream.text, "pos": stream.pos})
    return format_event(b"stream", data, event_id(epoch, seq, (stream.id, stream.pos - 1)))


def state_event(kind: bytes, chat_id: str, meta: Meta, recovered: bool) -> bytes:
    """``ready`` (a fresh stream) or ``reset`` (the resume failed): where the stream starts."""
    data = _encode({
        "chat_id": chat_id, "epoch": meta.epoch, "seq": meta.seq, "recovered": recovered,
        "status": "running" if meta.status == "running" else "idle", "title": meta.title,
        "turn_id": meta.turn_id, "started_at": meta.started_at,
        "goal_state": msgspec.Raw(meta.goal) if meta.goal else None,
        "state": msgspec.Raw(meta.state) if meta.state else None,
        "usage": {"billed": msgspec.Raw(meta.usage_billed),
                  "active": msgspec.Raw(meta.usage_active)},
        "message_count": meta.message_count,
    })
    return format_event(kind, data, event_id(meta.epoch, meta.seq))


def _deleted_epoch(frame: Frame) -> str | None:
    try:
        data = msgspec.json.decode(frame.json, type=dict[str, Any]).get("data")
    except msgspec.DecodeError:
        return None
    epoch = data.get("epoch") if isinstance(data, dict) else None
    return epoch if isinstance(epoch, str) else None


# --- the endpoint ---------------------------------------------------------------------


async def endpoint(request: Request) -> Response:
    """``GET /v1/conversations/{chat_id}/stream``: every check answers before the stream."""
    gateway: Gateway = request.app.state.gateway
    who = gateway.authenticate(request)
    chat_id: str = request.path_params["chat_id"]
    if not p.CHAT_ID_RE.match(chat_id):
        raise Rejected("invalid_request", f"chat_id must match {p.CHAT_ID_PATTERN}")
    # The header wins: an EventSource reconnecting to a URL that carries ?last_event_id=
    # sends the newer position in the header.
    raw = request.headers.get("last-event-id") or request.query_params.get("last_event_id")
    last_id = parse_last_event_id(raw) if raw else None
    check_access(who, await gateway.store.meta(chat_id), chat_id)
    if request.method == "HEAD":
        return Response(media_type=MEDIA_TYPE, headers=HEADERS)
    return StreamingResponse(_events(request, gateway, who, chat_id, last_id),
                             media_type=MEDIA_TYPE, headers=HEADERS)


async def _events(request: Request, gateway: Gateway, who: Principal, chat_id: str,
                  last_id: LastEventId | None) -> AsyncIterator[bytes]:
    logs.bind(user_id=who.user_id, chat_id=chat_id)  # the task that streams the response
    hub, settings = gateway.hub, gateway.settings
    since = last_id.since if last_id is not None else None
    member = SseMember(hub, settings.queue_max_bytes)
    gateway.track_stream(who, member)
    try:
        await hub.join(chat_id, member)
        try:
            caught = await catch_up(hub, chat_id, who, since, settings.replay_limit, hub.mark())
        except Rejected:
            return  # deleted (or recreated by someone else) since the check: reconnect
        meta = caught.meta
        epoch = meta.epoch
        if since is None:
            yield state_event(b"ready", chat_id, meta, True)
        else:
            if not caught.recovered:
                yield state_event(b"reset", chat_id, meta, False)
            chunk = bytearray()
            for frame in caught.replay:
                assert frame.seq is not None
                chunk += format_event(event_type(frame.json), frame.json,
                                      event_id(epoch, frame.seq))
                if len(chunk) >= CHUNK_BYTES:
                    yield bytes(chunk)
                    chunk.clear()
            if chunk:
                yield bytes(chunk)
        last = last_id.stream if last_id is not None and last_id.since.epoch == epoch else None
        for open_stream in caught.streams:
            if not held(open_stream, last):
                yield stream_event(chat_id, epoch, meta.seq, open_stream)
        async for piece in _live(request, member, chat_id, caught.cursor, who.expires_at,
                                  settings.heartbeat):
            yield piece
    except (RedisError, ConnectionError, OSError, TimeoutError) as exc:
        log.warning("sse %s: backend failure (%s); ending the stream", chat_id, exc)
    finally:
        hub.leave(chat_id, member)
        gateway.untrack_stream(who, member)


async def _live(request: Request, member: SseMember, chat_id: str, cursor: Cursor,
                expires_at: float | None, heartbeat: float) -> AsyncIterator[bytes]:
    """Live frames the ``cursor`` admits (the merge of :mod:`~gateway.sync`), a ping
    comment when idle, until the stream must end."""
    epoch = cursor.epoch
    while True:
        timeout = heartbeat
        if expires_at is not None:
            left = expires_at - time.time()
            if left <= 0:
                yield b": token expired\n\n"
                return
            timeout = min(timeout, left)
        batch = await member.next_batch(timeout)
        if batch is None:
            if await request.is_disconnected():
                return
            yield PING
            continue
        out = bytearray()
        end = False
        for entry in batch:
            if entry is None and member.removal is not None:
                out += format_event(b"removed", member.removal.json)
                end = True
                break
            if entry is None and member.terminated is not None:
                out += b": disconnected: " + member.terminated.encode() + b"\n\n"
                end = True
                break
            if entry is None:  # overflowed: send what came before, then let it reconnect
                out += b": slow consumer\n\n"
                end = True
                break
            tagged, frame = entry
            if frame.is_deleted:
                if _deleted_epoch(frame) not in (None, epoch):
                    continue  # the end of an earlier incarnation, read past already
                out += format_event(b"deleted", frame.json)
                end = True
                break
            seq = frame.seq
            if seq is not None:
                if tagged is not None and tagged != epoch:
                    end = True  # recreated under us: the reconnect gets an explicit reset
                    break
                if seq > cursor.last_seq + 1:
                    end = True  # a hole the hub could not fill: the reconnect replays or resets
                    break
            if cursor.admit(frame):
                out += format_event(event_type(frame.json), frame.json,
                                    event_id(epoch, cursor.last_seq, frame.stream))
        if out:
            yield bytes(out)
        if end:
            log.info("sse %s: stream ended at seq %d", chat_id, cursor.last_seq)
            return
