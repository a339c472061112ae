"""One WebSocket connection: reader, subscriptions and their buffers.

The reader handles one client frame at a time, in order. Everything the connection sends
goes through its :mod:`outbound <gateway.transport.outbound>`: on the fast path, straight to
the socket's transport, in program order, so a reply never overtakes a frame fanned out
before it. A slow socket only ever holds up itself: past ``queue_max_bytes`` of unsent
bytes it is closed with 4008.

A subscription is in one of three states:

``syncing``    joined the room, reading history; live frames wait in ``pending``
``live``       frames go straight out; at the room's position, the hub writes them itself
               (the room's direct set) and this session is not even called
``buffering``  unsubscribed: frames wait in a bounded ``buffer`` for the next subscribe
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import secrets
import time
from collections.abc import Awaitable, Callable
from enum import Enum
from typing import TYPE_CHECKING, Any

import msgspec
from redis.exceptions import RedisError

from . import logs
from . import protocol as p
from .auth import AuthError, Principal
from .closecodes import (
    BACKEND_UNAVAILABLE,
    INTERNAL_ERROR,
    PROTOCOL_ABUSE,
    SLOW_CONSUMER,
    TOKEN_EXPIRED,
    TOO_MANY,
)
from .errors import Rejected
from .events import now_ms
from .frames import Frame, json_to_msgpack
from .metrics import COUNTS
from .redis.channels import CONFIRM_TIMEOUT, wait_shared
from .redis.envelope import except_connection
from .redis.keys import room_channel
from .redis.records import Meta
from .rooms import Seat
from .streams import snapshot
from .sync import catch_up, merge
from .transport.frames import binary_frame, text_frame
from .transport.outbound import outbound_for

if TYPE_CHECKING:
    from .runtime import Gateway

log = logging.getLogger("gateway.session")

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
CHUNK_BYTES = 64 * 1024  # a replay or buffer drain is written in chunks of about this size
PAUSE_ABOVE = 64 * 1024  # unsent bytes at which writes pause (at most half the 4008 bound)
INBOX_MAX = 4  # client messages waiting to be handled before the socket stops being read


class State(Enum):
    SYNCING = "syncing"
    LIVE = "live"
    BUFFERING = "buffering"


class Subscription(Seat):
    """One chat of this connection: its seat in the room (its cursor: the last durable seq
    sent, stale while direct), its state, and the frames it holds back."""

    __slots__ = ("buffer", "buffer_bytes", "create", "overflowed", "pending", "presence_held",
                 "presence_v", "present", "resync", "state", "typed_at", "unsubscribed_at")

    def __init__(self, session: Session) -> None:
        super().__init__(session, session.out.write, session.binary)
        self.state = State.SYNCING
        self.pending: list[Frame] = []
        self.buffer: list[Frame] = []
        self.buffer_bytes = 0
        self.unsubscribed_at = 0.0
        self.overflowed = False
        self.resync = False  # the history changed under a read in flight: read again
        self.create = True  # subscribed with create: a resync may create it again too
        self.present = False  # in the conversation's presence list (gateway.presence)
        # The version of the last presence list sent (0: none since the last subscribe),
        # and the newest presence frame held until the snapshot goes out.
        self.presence_v = 0
        self.presence_held: tuple[int, Frame] | None = None
        self.typed_at = -math.inf  # when the last `typing` of this chat went out


class Session:
    """Drives one accepted WebSocket until it closes.

    Callback-driven, so that an idle connection holds no task: :meth:`start` once accepted,
    :meth:`received` for each client message, :meth:`ended` once the socket closed. Messages
    are handled one at a time, in order, by a task that lives only while there are some.
    Under a plain ASGI server, :meth:`run` drives the same methods from ASGI ``receive``.
    """

    __slots__ = ("_bad_frames", "_closer", "_closing", "_ended", "_expiring", "_expiry",
                 "_feed_ready",
                 "_inbox", "_limited", "_refilled", "_resume_reading", "_resyncs", "_tokens",
                 "_worker", "binary", "codec", "gateway", "hub", "id", "out", "principal",
                 "settings", "subs")

    def __init__(self, gateway: Gateway, principal: Principal, codec: p.Codec,
                 scope: dict[str, Any], send: Send, *,
                 connection_id: str | None = None) -> None:
        self.gateway = gateway
        self.hub = gateway.hub
        self.settings = gateway.settings
        self.principal = principal
        self.codec = codec
        self.binary = codec.binary
        self.id = connection_id or secrets.token_hex(8)
        self.subs: dict[str, Subscription] = {}
        pause_above = min(PAUSE_ABOVE, self.settings.queue_max_bytes // 2)
        self.out = outbound_for(scope, send, codec.binary, self, pause_above)
        self._closer: asyncio.Task[None] | None = None
        self._closing = False
        self._ended = False
        self._expiry: asyncio.TimerHandle | None = None  # 4011 at the token's exp
        self._expiring: asyncio.TimerHandle | None = None  # token_expiring, some time before
        self._feed_ready: asyncio.Future[None] | None = None
        self._resyncs: set[asyncio.Task[None]] | None = None  # made on the first resync
        self._inbox: list[bytes] | None = None  # client messages not handled yet
        self._worker: asyncio.Task[None] | None = None
        self._resume_reading: Callable[[], None] | None = None
        self._tokens = float(self.settings.rate_burst)
        self._refilled = time.monotonic()
        self._limited = 0
        self._bad_frames = 0

    # --- lifecycle --------------------------------------------------------------------

    def start(self, head: bytes = b"") -> None:
        """The connection was accepted: count it in, join the user's feed, say hello.

        ``head`` (the handshake's response, on the fast path) leaves in the same write as
        hello: one syscall less per connection."""
        self.gateway.sessions.setdefault(self.principal.user_id, set()).add(self)
        COUNTS.connections += 1
        self._arm_expiry()
        # The feed subscription is confirmed before the first client frame is handled,
        # not before hello: nothing the client does can tell the difference.
        self._feed_ready = self.hub.join_feed(self.principal.user_id, self)
        s = self.settings
        hello = p.Hello(
            connection_id=self.id, user_id=self.principal.user_id, role=self.principal.role,
            heartbeat_interval=s.heartbeat,
            limits=p.Limits(s.max_frame_bytes, s.max_text_bytes, s.max_subscriptions,
                            s.replay_limit, s.rate_limit, s.buffer_max_frames,
                            s.buffer_max_bytes, s.buffer_ttl, s.typing_interval),
        )
        write = self.out.write
        if head and write is not None:
            payload = self.codec.encode(hello)
            write(head + (binary_frame if self.binary else text_frame)(payload))
            COUNTS.replies += 1
            COUNTS.bytes_out += len(payload)
        else:
            self._send(hello)

    def _arm_expiry(self) -> None:
        """Close with 4011 at the token's ``exp``; say ``token_expiring`` some time before
        (GATEWAY_TOKEN_REFRESH_BEFORE), so the client can ``refresh`` in band."""
        for timer in (self._expiry, self._expiring):
            if timer is not None:
                timer.cancel()
        self._expiry = self._expiring = None
        expires_at = self.principal.expires_at
        if expires_at is None:
            return
        loop = asyncio.get_running_loop()
        left = max(0.0, expires_at - time.time())
        self._expiry = loop.call_later(left, self.close, TOKEN_EXPIRED, "token expired")
        self._expiring = loop.call_later(
            max(0.0, left - self.settings.token_refresh_before), self._send,
            p.TokenExpiring(int(expires_at * 1000)))

    def _refresh(self, req: p.Refresh) -> None:
        """A fresh token for the same user and role: the connection goes on, on it. Any
        other token is refused and changes nothing."""
        try:
            fresh = self.gateway.tokens.verify(req.token)
        except AuthError as exc:
            self._error("unauthorized", f"refresh refused: {exc}", req)
            return
        if (fresh.user_id, fresh.role) != (self.principal.user_id, self.principal.role):
            self._error("forbidden", "refresh refused: the token is for another user or "
                        "role than this connection's", req)
            return
        self.principal = fresh
        self._arm_expiry()
        assert fresh.expires_at is not None  # a token without exp is refused
        self._send(p.Refreshed(int(fresh.expires_at * 1000), req.id))

    def received(self, data: bytes, resume_reading: Callable[[], None] | None = None) -> bool:
        """A client message (a text one as its UTF-8 bytes). Returns False when enough are
        waiting that the caller should stop reading; ``resume_reading`` is then called
        once they were handled."""
        if self._closing or self._ended:
            # Closed by us (4008, 4011, 4029...) but the close frame has not reached the
            # peer yet: what it still sends must not act (no writes after 4011 or 4008).
            return True
        if self._worker is None and self._feed_ready is None:
            # Nothing waits before it: a message answered without I/O (a ping, a refusal)
            # is answered now. A task per message would cost more than the answer.
            try:
                frame = self._take(data)
                if frame is None or self._answer_now(frame):
                    return True
            except Exception:
                self._failed()
                return True
            self._inbox = []
            self._worker = asyncio.get_running_loop().create_task(self._work(frame))
            return True
        inbox = self._inbox
        if inbox is None:
            inbox = self._inbox = []
        inbox.append(data)
        if self._worker is None:
            self._worker = asyncio.get_running_loop().create_task(self._work())
        if len(inbox) < INBOX_MAX:
            return True
        self._resume_reading = resume_reading
        return False

    def ended(self, code: int) -> None:
        """The socket is closed (``code`` from the peer's close frame, or 1005/1006/1012).

        The message being handled, if any, finishes first; then the session leaves its
        rooms and its feed."""
        if self._ended:
            return
        self._ended = True
        self._closing = True
        if self._closer is None:  # closed by the peer, or lost: not by us
            COUNTS.closed[code] += 1
        self._leave_all_direct()
        if self._worker is None:
            self._finish()

    def _finish(self) -> None:
        for timer in (self._expiry, self._expiring):
            if timer is not None:
                timer.cancel()
        for task in self._resyncs or ():
            task.cancel()
        for chat_id in list(self.subs):
            self._drop(chat_id)
        self.hub.leave_feed(self.principal.user_id, self)
        COUNTS.connections -= 1
        mine = self.gateway.sessions.get(self.principal.user_id)
        if mine is not None:
            mine.discard(self)
            if not mine:
                del self.gateway.sessions[self.principal.user_id]

    async def _work(self, first: p.ClientFrame | None = None) -> None:
        """Handle ``first`` (a message taken already), then the waiting messages in order;
        the task ends when there are none."""
        logs.bind(connection_id=self.id, user_id=self.principal.user_id)
        inbox = self._inbox
        try:
            if first is not None and not self._ended:
                await self._handle_frame(first)
            while inbox and not self._ended:
                await self._handle_message(inbox.pop(0))
        except Exception:
            self._failed()
        finally:
            self._worker = None
            self._inbox = None
            resume, self._resume_reading = self._resume_reading, None
            if self._ended:
                self._finish()
            elif resume is not None:
                resume()

    async def run(self, receive: Receive) -> None:
        """Drive the session from ASGI ``receive`` (servers without the gateway's protocol):
        one message at a time, as the server's own receive queue holds the rest."""
        self.start()
        code = 1006
        try:
            while True:
                message = await receive()
                if message["type"] == "websocket.disconnect":
                    code = message.get("code", 1005)
                    return
                if not self._closing:
                    await self._handle_message(
                        message.get("bytes") or (message.get("text") or "").encode())
        finally:
            self.ended(code)
            if self._closer is not None:
                # The server drops the socket as soon as this returns: let the close frame
                # (e.g. 1013 after a backend failure) leave first.
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(asyncio.shield(self._closer), timeout=5)

    def close(self, code: int, reason: str = "") -> None:
        """Close the connection now, dropping whatever is still unsent."""
        if self._closing:
            return
        self._closing = True
        self._leave_all_direct()
        self._closer = self.out.close(code, reason)
        COUNTS.closed[code] += 1

    # --- transport events (the fast path's listener; called synchronously) ------------

    def on_pause(self) -> None:
        """The socket's buffer is past the pause mark: no more direct writes for now."""
        self._leave_all_direct()

    def on_resume(self) -> None:
        for chat_id, sub in self.subs.items():
            self._try_direct(chat_id, sub)

    def on_closing(self) -> None:
        """uvicorn is closing the socket (peer close, keepalive timeout, shutdown)."""
        self._closing = True
        self._leave_all_direct()

    # --- the room's direct set (the room decides) -------------------------------------

    def _try_direct(self, chat_id: str, sub: Subscription) -> None:
        if sub.direct or sub.state is not State.LIVE or self._closing or self.out.paused:
            return
        room = self.hub.room(chat_id)
        if room is not None:
            room.go_direct(sub)

    def _leave_direct(self, chat_id: str, sub: Subscription) -> None:
        if sub.direct:
            room = self.hub.room(chat_id)
            if room is not None:
                room.leave_direct(sub)
            sub.direct = False

    def _leave_all_direct(self) -> None:
        for chat_id, sub in self.subs.items():
            self._leave_direct(chat_id, sub)

    def resync(self, chat_id: str) -> None:
        """The chat's history was lost or forked: the client gets an unasked ``subscribed``
        with ``recovered: false`` and the new epoch, then live frames (protocol.md)."""
        sub = self.subs.get(chat_id)
        if sub is None or self._closing:
            return
        if sub.state is State.SYNCING:
            sub.resync = True  # its read may predate the change: _sync reads again
        elif sub.state is State.BUFFERING:
            sub.overflowed = True  # the buffer is of the old history: resume from the store
            sub.buffer.clear()
            sub.buffer_bytes = 0
        else:
            since = p.Since(sub.last_seq, sub.epoch)
            self._reset_to_syncing(chat_id, sub)
            task = asyncio.get_running_loop().create_task(
                self._resync_live(p.Subscribe(chat_id, since, create=sub.create), sub))
            if self._resyncs is None:
                self._resyncs = set()
            self._resyncs.add(task)
            task.add_done_callback(self._resyncs.discard)

    async def _resync_live(self, req: p.Subscribe, sub: Subscription) -> None:
        logs.bind(connection_id=self.id, user_id=self.principal.user_id, chat_id=req.chat_id)
        try:
            await self._sync(req, sub, req.since, overflowed=None)
        except (RedisError, ConnectionError, OSError, TimeoutError):
            log.exception("session %s: resync of %s failed", self.id, req.chat_id)
            self.close(BACKEND_UNAVAILABLE, "backend unavailable")

    # --- outbound ---------------------------------------------------------------------

    def _send(self, frame: msgspec.Struct) -> None:
        if self._closing:
            return
        payload = self.codec.encode(frame)
        if not self._over_bound(len(payload)):
            self.out.send_payload(payload)
            COUNTS.replies += 1
            COUNTS.bytes_out += len(payload)

    def _send_frame(self, frame: Frame) -> None:
        if not self._closing and not self._over_bound(frame.size):
            self.out.send_frame(frame)
            COUNTS.sent += 1
            COUNTS.bytes_out += frame.size

    def _over_bound(self, size: int) -> bool:
        """Close with 4008 if ``size`` more bytes would pass the bound of unsent bytes."""
        buffered = self.out.buffered()
        if buffered and buffered + size > self.settings.queue_max_bytes:
            log.info("session %s: slow consumer, %d bytes unsent", self.id, buffered)
            self.close(SLOW_CONSUMER, "slow consumer")
            return True
        return False

    async def _send_paced(self, frames: list[Frame]) -> None:
        """Send many frames (a replay, a buffer) in chunks, each after the socket drained."""
        i, count = 0, len(frames)
        while i < count:
            while self.out.paused and not self._closing:
                await self.out.wait_writable()
            if self._closing:
                return
            chunk: list[Frame] = []
            size = 0
            while i < count and size < CHUNK_BYTES:
                chunk.append(frames[i])
                size += frames[i].size
                i += 1
            if self._over_bound(size):
                return
            self.out.send_frames(chunk)
            COUNTS.replayed += len(chunk)
            COUNTS.bytes_out += size

    # --- inbound ----------------------------------------------------------------------

    async def _handle_message(self, data: bytes) -> None:
        """One client message: rate limit, decode, handle; a backend failure closes."""
        ready = self._feed_ready
        if ready is not None:
            try:  # raises if the feed could not be subscribed
                await wait_shared(ready, CONFIRM_TIMEOUT)
            except (RedisError, ConnectionError, OSError, TimeoutError):
                self._backend_failed()
                return
            self._feed_ready = None
        frame = self._take(data)
        if frame is not None:
            await self._handle_frame(frame)

    def _take(self, data: bytes) -> p.ClientFrame | None:
        """Rate limit and decode one client message; None when it was refused (and the
        refusal sent)."""
        if not self._admit():
            return None
        try:
            return self.codec.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            COUNTS.frames_in[None] += 1
            code, text = p.error_message(exc)
            env = self.codec.envelope(data)
            self._bad(code, text, env.id, env.chat_id)
            return None

    async def _handle_frame(self, frame: p.ClientFrame) -> None:
        """Handle one client frame; a refusal is the reply, a backend failure closes."""
        try:
            about = logs.about_chat(getattr(frame, "chat_id", None))
            try:
                await self._handle(frame)
            except Rejected as exc:
                self._error(exc.code, exc.message, frame, exc.head)
            finally:
                logs.unbind(about)
        except (RedisError, ConnectionError, OSError, TimeoutError):
            self._backend_failed()

    def _backend_failed(self) -> None:
        log.exception("session %s: backend failure", self.id)
        self.close(BACKEND_UNAVAILABLE, "backend unavailable")

    def _failed(self) -> None:
        """A bug met while handling a client message: logged, and 1011 to the client."""
        log.exception("session %s: failed", self.id)
        self.close(INTERNAL_ERROR, "internal error")

    def _admit(self) -> bool:
        """Token-bucket rate limit on inbound frames."""
        now = time.monotonic()
        s = self.settings
        refill = (now - self._refilled) * s.rate_limit
        self._tokens = min(float(s.rate_burst), self._tokens + refill)
        self._refilled = now
        if self._tokens >= 1:
            self._tokens -= 1
            self._limited = 0
            return True
        self._limited += 1
        if self._limited > s.rate_burst:
            self.close(TOO_MANY, "too many requests")
        else:
            self._send(p.Error("rate_limited", f"over {s.rate_limit:g} frames/s; slow down"))
        return False

    def _bad(self, code: str, message: str, req_id: Any = None, chat_id: Any = None) -> None:
        # Not its content: it may hold message text. The ids are given, as a refusal can be
        # sent from the socket's callback, outside the session's task.
        log.debug("invalid frame: %s", code,
                  extra={"connection_id": self.id, "user_id": self.principal.user_id})
        self._bad_frames += 1
        if self._bad_frames > self.settings.max_bad_frames:
            self.close(PROTOCOL_ABUSE, "too many invalid frames")
            return
        self._send(p.Error(code, message, _echo(req_id), _echo(chat_id)))

    def _error(self, code: str, message: str, frame: p.ClientFrame,
               head: str | None = None) -> None:
        log.debug("%s refused: %s", type(frame).__name__.lower(), code)
        self._send(p.Error(code, message, frame.id, getattr(frame, "chat_id", None),
                           msgspec.UNSET if head is None else head or None))

    def _answer_now(self, frame: p.ClientFrame) -> bool:
        """Answer ``frame`` if that needs no I/O (a ping); returns whether it did."""
        if type(frame) is not p.Ping:
            return False
        COUNTS.frames_in[p.Ping] += 1
        self._send(p.Pong(now_ms(), frame.id))
        self._bad_frames = 0
        return True

    async def _handle(self, frame: p.ClientFrame) -> None:
        if self._answer_now(frame):
            return
        COUNTS.frames_in[type(frame)] += 1
        match frame:
            case p.Subscribe():
                await self._subscribe(frame)
            case p.Message():
                await self._message(frame)
            case p.Unsubscribe():
                self._unsubscribe(frame)
            case p.Leave():
                if self.subs.get(frame.chat_id) is not None:
                    self._drop(frame.chat_id)
                self._send(p.Left(frame.chat_id, frame.id))
            case p.Cancel():
                await self._cancel(frame)
            case p.Refresh():
                self._refresh(frame)
            case p.Retry():
                self._send(await self.gateway.conversations.retry(self.principal, frame))
            case p.Edit():
                self._send(await self.gateway.conversations.edit(self.principal, frame))
            case p.Undo():
                self._send(await self.gateway.conversations.undo(self.principal, frame))
            case p.Switch():
                self._send(await self.gateway.conversations.switch(self.principal, frame))
            case p.ToolResult():
                self._send(await self.gateway.conversations.answer(self.principal, frame))
            case p.Typing():
                await self._typing(frame)
        self._bad_frames = 0

    # --- subscriptions ----------------------------------------------------------------

    async def _subscribe(self, req: p.Subscribe) -> None:
        chat_id = req.chat_id
        sub = self.subs.get(chat_id)
        if sub is None:
            if len(self.subs) >= self.settings.max_subscriptions:
                self._error("too_many_subscriptions",
                            f"at most {self.settings.max_subscriptions} subscriptions", req)
                return
            sub = self.subs[chat_id] = Subscription(self)
            sub.create = req.create
            try:
                await self.hub.join(chat_id, self)
            except BaseException:
                self.subs.pop(chat_id, None)
                self.hub.leave(chat_id, self)
                raise
            await self._sync(req, sub, req.since, overflowed=None, joined=self.hub.mark())
            return
        if sub.state is State.BUFFERING:
            expired = time.monotonic() - sub.unsubscribed_at > self.settings.buffer_ttl
            if req.since is None and not sub.overflowed and not expired:
                await self._drain_buffer(req, sub)
                return
            since = req.since or p.Since(sub.last_seq, sub.epoch)
            self._reset_to_syncing(chat_id, sub)
            await self._sync(req, sub, since, overflowed=True if req.since is None else None)
            return
        if sub.state is State.LIVE and req.since is not None:
            self._reset_to_syncing(chat_id, sub)
            await self._sync(req, sub, req.since, overflowed=None)
            return
        # Already live and no resume asked for: confirm with the current state.
        meta, children = await self._state(chat_id)
        if meta is None:
            self._drop(chat_id)
            self._error("not_found", "conversation was deleted", req)
            return
        presence = await self._present(chat_id, sub)
        self._send(p.Subscribed(chat_id, meta.epoch, meta.seq, True, 0,
                                _snapshot(meta, self.codec.binary, children=children,
                                          presence=presence), req.id))
        self._presence_sent(sub, presence.v)

    async def _state(self, chat_id: str) -> tuple[Meta | None, list[p.ChildSummary]]:
        """The conversation's state and its children, read in one batch."""
        return await asyncio.gather(self.gateway.store.meta(chat_id),
                                    self.gateway.conversations.children(chat_id))

    async def _present(self, chat_id: str, sub: Subscription) -> p.PresenceList:
        """Join the conversation's presence (once the subscriber may read it); the list.
        A service's connection reads it without joining."""
        presence = self.gateway.presence
        if self.principal.role == "service":
            return await presence.read(chat_id)
        sub.present = True
        return await presence.join(chat_id, self.principal.user_id, self.id)

    def _absent(self, chat_id: str, sub: Subscription) -> None:
        if sub.present:
            sub.present = False
            self.gateway.presence.leave(chat_id, self.principal.user_id, self.id)

    def _reset_to_syncing(self, chat_id: str, sub: Subscription) -> None:
        self._leave_direct(chat_id, sub)
        sub.state = State.SYNCING
        sub.floor = None
        sub.pending = []
        sub.buffer.clear()
        sub.buffer_bytes = 0
        sub.overflowed = False

    async def _sync(self, req: p.Subscribe, sub: Subscription, since: p.Since | None,
                    overflowed: bool | None, joined: int | None = None) -> None:
        """Read history after ``since`` and go live with no gap and no duplicate
        (:mod:`~gateway.sync`). The connection is already a member of the room, so every
        frame published from now on lands in ``sub.pending`` until it is merged.
        ``joined`` is the hub's mark taken when the room was joined."""
        chat_id = req.chat_id
        create = self.principal.user_id if self.settings.auto_create and req.create else ""
        try:
            caught = await catch_up(self.hub, chat_id, self.principal, since,
                                    self.settings.replay_limit,
                                    self.hub.mark() if joined is None else joined, create,
                                    req.agent or "")
            children = await self.gateway.conversations.children(
                chat_id, caught.children) if caught.children else []
        except Rejected as exc:
            self._drop(chat_id)
            self._error(exc.code, exc.message, req)
            return
        if self.subs.get(chat_id) is not sub:
            return  # removed from it (or deleted) while reading: `removed` said so
        presence = await self._present(chat_id, sub)
        if self.subs.get(chat_id) is not sub:
            self._absent(chat_id, sub)
            return
        meta, cursor = caught.meta, caught.cursor
        log.debug("subscribed at seq %d, %d replayed, recovered: %s", meta.seq,
                  len(caught.replay), caught.recovered)
        if since is not None:
            COUNTS.replays[caught.recovered, bool(overflowed)] += 1
        COUNTS.snapshots += len(caught.streams)
        self._send(p.Subscribed(
            chat_id, meta.epoch, meta.seq, caught.recovered, len(caught.replay),
            _snapshot(meta, self.codec.binary, snapshot(caught.streams), children, presence),
            req.id, overflowed=overflowed,
        ))
        self._presence_sent(sub, presence.v)
        await self._send_paced(caught.replay)
        while sub.pending:  # frames that arrived while we awaited
            held, sub.pending = sub.pending, []
            await self._send_paced(merge(cursor, held))
        if self.subs.get(chat_id) is not sub:
            return  # deleted or left while we were replaying
        if sub.resync:  # the history changed while we read it: read it again
            sub.resync = False
            since = p.Since(cursor.last_seq, meta.epoch)  # unasked: no request id
            await self._sync(p.Subscribe(chat_id, since, create=req.create), sub, since,
                             overflowed=None)
            return
        sub.state = State.LIVE
        sub.epoch, sub.last_seq, sub.floor = cursor.epoch, cursor.last_seq, cursor.floor
        self._try_direct(chat_id, sub)

    async def _drain_buffer(self, req: p.Subscribe, sub: Subscription) -> None:
        """Send the intact buffer, then go live. The buffer's bounds stop applying now:
        frames arriving while we read the state queue behind it instead."""
        sub.state = State.SYNCING
        sub.pending, sub.buffer = sub.buffer, []
        sub.buffer_bytes = 0
        meta, children = await self._state(req.chat_id)
        if self.subs.get(req.chat_id) is not sub:
            return  # removed from it while reading: `removed` said so
        if meta is None:
            self._drop(req.chat_id)
            self._error("not_found", "conversation was deleted", req)
            return
        presence = await self._present(req.chat_id, sub)
        if self.subs.get(req.chat_id) is not sub:
            self._absent(req.chat_id, sub)
            return
        COUNTS.replays[True, False] += 1
        self._send(p.Subscribed(req.chat_id, meta.epoch, meta.seq, True, 0,
                                _snapshot(meta, self.codec.binary, children=children,
                                          presence=presence), req.id,
                                buffered=len(sub.pending), overflowed=False))
        self._presence_sent(sub, presence.v)
        while sub.pending:
            frames, sub.pending = sub.pending, []
            for frame in frames:
                if frame.seq is not None:
                    sub.last_seq = frame.seq
            await self._send_paced(frames)
        if self.subs.get(req.chat_id) is sub:
            sub.state = State.LIVE
            self._try_direct(req.chat_id, sub)

    def _unsubscribe(self, req: p.Unsubscribe) -> None:
        sub = self.subs.get(req.chat_id)
        if sub is not None and sub.state is State.LIVE:
            self._leave_direct(req.chat_id, sub)
            sub.state = State.BUFFERING
            sub.unsubscribed_at = time.monotonic()
            sub.presence_v, sub.presence_held = 0, None
            self._absent(req.chat_id, sub)
        self._send(p.Unsubscribed(req.chat_id, req.id))

    def _drop(self, chat_id: str) -> None:
        sub = self.subs.get(chat_id)
        if sub is not None:
            self._leave_direct(chat_id, sub)
            self._absent(chat_id, sub)
            del self.subs[chat_id]
            self.hub.leave(chat_id, self)

    # --- delivery (called by the hub; must not block) ---------------------------------

    def deliver(self, chat_id: str, frame: Frame) -> None:
        sub = self.subs.get(chat_id)
        if sub is None:
            return
        if frame.is_deleted:
            self._send_frame(frame)
            self._drop(chat_id)
            return
        state = sub.state
        if state is State.LIVE:
            if not sub.admit(frame):
                return  # sent already, or in the snapshot's text
            self._send_frame(frame)
            self._try_direct(chat_id, sub)
        elif state is State.SYNCING:
            sub.pending.append(frame)
        elif not sub.overflowed:
            s = self.settings
            if (len(sub.buffer) >= s.buffer_max_frames
                    or sub.buffer_bytes + frame.size > s.buffer_max_bytes
                    or time.monotonic() - sub.unsubscribed_at > s.buffer_ttl):
                sub.overflowed = True
                sub.buffer.clear()
                sub.buffer_bytes = 0
                return
            sub.buffer.append(frame)
            sub.buffer_bytes += frame.size

    def deliver_feed(self, frame: Frame) -> None:
        self._send_frame(frame)

    def deliver_signal(self, chat_id: str, frame: Frame, skip: str, version: int) -> None:
        """A presence list newer than the last one sent (held until the snapshot is out),
        or another connection's ``typing``; nothing while unsubscribed."""
        sub = self.subs.get(chat_id)
        if sub is None or sub.state is State.BUFFERING or skip == self.id:
            return
        if not version:  # typing: to subscriptions the client has heard of
            if sub.presence_v:
                self._send_frame(frame)
        elif not sub.presence_v:
            if sub.presence_held is None or version > sub.presence_held[0]:
                sub.presence_held = (version, frame)
        elif version > sub.presence_v:
            sub.presence_v = version
            self._send_frame(frame)

    def removed(self, chat_id: str, user_id: str, frame: Frame) -> None:
        """This user was removed from the conversation: the subscription ends (live,
        syncing or buffering), its buffer dropped, with ``removed`` saying why."""
        if user_id != self.principal.user_id or self.subs.get(chat_id) is None:
            return
        self._send_frame(frame)
        self._drop(chat_id)

    def _presence_sent(self, sub: Subscription, version: int) -> None:
        """The snapshot with presence ``version`` went out: a newer list held goes next."""
        sub.presence_v = max(sub.presence_v, version, 1)
        held, sub.presence_held = sub.presence_held, None
        if held is not None and held[0] > sub.presence_v:
            sub.presence_v = held[0]
            self._send_frame(held[1])

    # --- writes -----------------------------------------------------------------------

    async def _message(self, req: p.Message) -> None:
        self._send(await self.gateway.conversations.post_message(self.principal, req))

    async def _cancel(self, req: p.Cancel) -> None:
        self._send(await self.gateway.conversations.cancel(self.principal, req))

    async def _typing(self, req: p.Typing) -> None:
        """``typing`` to the conversation's other subscribers, on every process: at most
        one per ``typing_interval`` per chat from this connection (the reply says whether
        it went out), never stored."""
        sub = self.subs.get(req.chat_id)
        if sub is None or sub.state is State.BUFFERING:
            self._error("not_subscribed", "subscribe to the conversation first", req)
            return
        now = time.monotonic()
        if now - sub.typed_at < self.settings.typing_interval:
            self._send(p.Typed(req.chat_id, False, req.id))
            return
        sub.typed_at = now
        frame = _encode_json(p.TypingFrame(req.chat_id, self.principal.user_id, now_ms()))
        await self.gateway.store.pipeline.execute(
            "SPUBLISH", room_channel(req.chat_id), except_connection(self.id, frame))
        self._send(p.Typed(req.chat_id, True, req.id))


_encode_json = msgspec.json.Encoder().encode


def _snapshot(meta: Meta, binary: bool, streams: list[p.StreamSnapshot] | None = None,
              children: list[p.ChildSummary] | None = None,
              presence: p.PresenceList | None = None) -> p.Snapshot:
    goal = None
    if meta.goal:
        # The goal is stored as JSON; a Raw is spliced into the output as is, so a
        # MessagePack frame needs it re-encoded as MessagePack.
        goal = msgspec.Raw(json_to_msgpack(meta.goal) if binary else meta.goal)
    state: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET
    if meta.state:
        state = msgspec.Raw(json_to_msgpack(meta.state) if binary else meta.state)
    return p.Snapshot(
        title=meta.title,
        status="running" if meta.status == "running" else "idle",
        turn_id=meta.turn_id,
        started_at=meta.started_at,
        goal_state=goal,
        head=meta.head,
        streams=streams,
        usage=p.UsageTotals.of(meta.usage_billed, meta.usage_active),
        message_count=meta.message_count,
        children=children or msgspec.UNSET,
        state=state,
        awaiting=msgspec.json.decode(meta.awaiting) if meta.awaiting else msgspec.UNSET,
        agent=meta.agent,
        presence=msgspec.UNSET if presence is None else presence,
    )


def _echo(value: Any) -> Any:
    """Echo a request's ``id``/``chat_id`` only when it is a plain, short scalar."""
    if isinstance(value, (int, str)) and not isinstance(value, bool) and len(str(value)) <= 128:
        return value
    return None

