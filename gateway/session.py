"""One WebSocket connection: reader, writer queue, subscriptions and their buffers.

The reader handles one client frame at a time, in order. Everything the connection sends
goes through one bounded queue drained by one writer task, so a slow socket only ever
holds up itself: past ``queue_max_bytes`` it is closed with 4008.

A subscription is in one of three states:

``syncing``    joined the room, reading history; live frames wait in ``pending``
``live``       frames go straight to the queue
``buffering``  unsubscribed: frames wait in a bounded ``buffer`` for the next subscribe
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections import deque
from enum import Enum
from typing import TYPE_CHECKING, Any

import msgspec
from redis.exceptions import RedisError
from starlette.websockets import WebSocket, WebSocketDisconnect

from . import protocol as p
from .auth import Principal
from .closecodes import (
    BACKEND_UNAVAILABLE,
    PROTOCOL_ABUSE,
    SLOW_CONSUMER,
    TOKEN_EXPIRED,
    TOO_MANY,
)
from .conversations import now_ms
from .errors import Rejected
from .hub import Frame
from .recovery import plan_replay
from .store import Meta

if TYPE_CHECKING:
    from .app import Gateway

log = logging.getLogger("gateway.session")


class State(Enum):
    SYNCING = "syncing"
    LIVE = "live"
    BUFFERING = "buffering"


class Subscription:
    __slots__ = ("buffer", "buffer_bytes", "epoch", "last_seq", "overflowed", "pending",
                 "state", "unsubscribed_at")

    def __init__(self) -> None:
        self.state = State.SYNCING
        self.pending: list[Frame] = []
        self.buffer: deque[Frame] = deque()
        self.buffer_bytes = 0
        self.unsubscribed_at = 0.0
        self.overflowed = False
        self.epoch = ""
        self.last_seq = 0  # last durable seq this connection was sent


class Session:
    """Drives one accepted WebSocket until it closes."""

    def __init__(self, gateway: Gateway, ws: WebSocket, principal: Principal,
                 codec: p.Codec) -> None:
        self.gateway = gateway
        self.settings = gateway.settings
        self.ws = ws
        self.principal = principal
        self.codec = codec
        self.id = secrets.token_hex(8)
        self.subs: dict[str, Subscription] = {}
        self._queue: deque[str | bytes] = deque()
        self._queued_bytes = 0
        self._wake = asyncio.Event()
        self._drained = asyncio.Event()
        self._writer: asyncio.Task[None] | None = None
        self._closer: asyncio.Task[None] | None = None
        self._closing = False
        self._tokens = float(self.settings.rate_burst)
        self._refilled = time.monotonic()
        self._limited = 0
        self._bad_frames = 0

    # --- lifecycle --------------------------------------------------------------------

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        self._writer = asyncio.create_task(self._write_loop(), name=f"writer-{self.id}")
        expiry = None
        if self.principal.expires_at is not None:
            delay = max(0.0, self.principal.expires_at - time.time())
            expiry = loop.call_later(delay, self.close, TOKEN_EXPIRED, "token expired")
        try:
            await self.gateway.hub.join_feed(self.principal.user_id, self)
            s = self.settings
            self._send(p.Hello(
                connection_id=self.id, user_id=self.principal.user_id, role=self.principal.role,
                heartbeat_interval=s.heartbeat,
                limits=p.Limits(s.max_frame_bytes, s.max_text_bytes, s.max_subscriptions,
                                s.replay_limit, s.rate_limit, s.buffer_max_frames,
                                s.buffer_max_bytes, s.buffer_ttl),
            ))
            await self._read_loop()
        except (RedisError, ConnectionError, OSError, TimeoutError):
            log.exception("session %s: backend failure", self.id)
            self.close(BACKEND_UNAVAILABLE, "backend unavailable")
        finally:
            if expiry is not None:
                expiry.cancel()
            for chat_id in list(self.subs):
                self._drop(chat_id)
            self.gateway.hub.leave_feed(self.principal.user_id, self)
            if self._writer is not None:
                self._writer.cancel()
            if self._closer is not None:
                # The server drops the socket as soon as this returns: let the close frame
                # (e.g. 1013 after a backend failure) leave first.
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(asyncio.shield(self._closer), timeout=5)

    def close(self, code: int, reason: str = "") -> None:
        """Close the connection now, dropping whatever is still queued."""
        if self._closing:
            return
        self._closing = True
        self._queue.clear()
        self._queued_bytes = 0
        if self._writer is not None:
            self._writer.cancel()
        self._closer = asyncio.get_running_loop().create_task(self._send_close(code, reason))

    async def _send_close(self, code: int, reason: str) -> None:
        # No timeout: the close frame of a peer that stopped reading (4008) can only leave
        # once it drains what is already in flight. Giving up would leave that peer on a
        # silent connection that never closes; if the peer goes away, the send fails.
        with contextlib.suppress(Exception):
            await self.ws.close(code, reason)

    # --- outbound ---------------------------------------------------------------------

    def _send(self, frame: msgspec.Struct) -> None:
        data = self.codec.encode(frame)
        self._enqueue(data if self.codec.binary else data.decode())

    def _send_frame(self, frame: Frame) -> None:
        self._enqueue(frame.msgpack if self.codec.binary else frame.text)

    def _enqueue(self, payload: str | bytes) -> None:
        if self._closing:
            return
        size = len(payload)
        if self._queue and self._queued_bytes + size > self.settings.queue_max_bytes:
            log.info("session %s: slow consumer, %d bytes queued", self.id, self._queued_bytes)
            self.close(SLOW_CONSUMER, "slow consumer")
            return
        self._queue.append(payload)
        self._queued_bytes += size
        self._drained.clear()
        self._wake.set()

    async def _send_paced(self, frames: list[Frame]) -> None:
        """Send many frames (a replay, a buffer) without tripping the slow-consumer bound."""
        limit = self.settings.queue_max_bytes // 2
        for frame in frames:
            while self._queued_bytes > limit and not self._closing:
                await self._drained.wait()
            self._send_frame(frame)

    async def _write_loop(self) -> None:
        send = self.ws.send
        queue = self._queue
        key = "bytes" if self.codec.binary else "text"
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                while queue:
                    payload = queue.popleft()
                    self._queued_bytes -= len(payload)
                    await send({"type": "websocket.send", key: payload})
                self._drained.set()
        except (WebSocketDisconnect, RuntimeError, OSError):
            pass

    # --- inbound ----------------------------------------------------------------------

    async def _read_loop(self) -> None:
        receive = self.ws.receive
        while True:
            message = await receive()
            if message["type"] == "websocket.disconnect":
                return
            if self._closing:
                # Closed by us (4008, 4011, 4029...) but the close frame has not reached the
                # peer yet: what it still sends must not act (no writes after 4011 or 4008).
                continue
            data = message.get("bytes") or (message.get("text") or "").encode()
            if not self._admit():
                continue
            try:
                frame = self.codec.decode(data)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                code, text = p.error_message(exc)
                env = self.codec.envelope(data)
                self._bad(code, text, env.id, env.chat_id)
                continue
            try:
                await self._handle(frame)
            except Rejected as exc:
                self._error(exc.code, exc.message, frame)

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
        self._bad_frames += 1
        if self._bad_frames > self.settings.max_bad_frames:
            self.close(PROTOCOL_ABUSE, "too many invalid frames")
            return
        self._send(p.Error(code, message, _echo(req_id), _echo(chat_id)))

    def _error(self, code: str, message: str, frame: p.ClientFrame) -> None:
        self._send(p.Error(code, message, frame.id, getattr(frame, "chat_id", None)))

    async def _handle(self, frame: p.ClientFrame) -> None:
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
            case p.Ping():
                self._send(p.Pong(now_ms(), frame.id))
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
            sub = self.subs[chat_id] = Subscription()
            try:
                await self.gateway.hub.join(chat_id, self)
            except BaseException:
                self.subs.pop(chat_id, None)
                self.gateway.hub.leave(chat_id, self)
                raise
            await self._sync(req, sub, req.since, overflowed=None)
            return
        if sub.state is State.BUFFERING:
            expired = time.monotonic() - sub.unsubscribed_at > self.settings.buffer_ttl
            if req.since is None and not sub.overflowed and not expired:
                await self._drain_buffer(req, sub)
                return
            since = req.since or p.Since(sub.last_seq, sub.epoch)
            self._reset_to_syncing(sub)
            await self._sync(req, sub, since, overflowed=True if req.since is None else None)
            return
        if sub.state is State.LIVE and req.since is not None:
            self._reset_to_syncing(sub)
            await self._sync(req, sub, req.since, overflowed=None)
            return
        # Already live and no resume asked for: confirm with the current state.
        meta = await self.gateway.store.meta(chat_id)
        if meta is None:
            self._drop(chat_id)
            self._error("not_found", "conversation was deleted", req)
            return
        self._send(p.Subscribed(chat_id, meta.epoch, meta.seq, True, 0,
                                _snapshot(meta, self.codec.binary), req.id))

    def _reset_to_syncing(self, sub: Subscription) -> None:
        sub.state = State.SYNCING
        sub.pending = []
        sub.buffer.clear()
        sub.buffer_bytes = 0
        sub.overflowed = False

    async def _sync(self, req: p.Subscribe, sub: Subscription, since: p.Since | None,
                    overflowed: bool | None) -> None:
        """Read history after ``since`` and go live with no gap and no duplicate.

        The connection is already a member of the room, so every frame published from now on
        lands in ``sub.pending``; history read afterwards overlaps it, and merging by seq
        removes the overlap.
        """
        store, chat_id = self.gateway.store, req.chat_id
        after = since.seq if since is not None else None
        history = await store.read(chat_id, after, self.settings.replay_limit + 1)
        if history.meta is None and self.settings.auto_create:
            await store.publish(chat_id, [], create_owner=self.principal.user_id)
            history = await store.read(chat_id, after, self.settings.replay_limit + 1)
        meta = history.meta
        if meta is None or not self.principal.may_access(meta.owner):
            self._drop(chat_id)
            if meta is None:
                self._error("not_found", "conversation does not exist", req)
            else:
                self._error("forbidden", "you may not read this conversation", req)
            return
        room = self.gateway.hub.room(chat_id)
        if room is not None:
            self.gateway.hub.observe(room, meta.epoch, meta.seq)
        plan = plan_replay(since, meta.epoch, meta.seq, history.frames, self.settings.replay_limit)
        self._send(p.Subscribed(
            chat_id, meta.epoch, meta.seq, plan.recovered, len(plan.frames),
            _snapshot(meta, self.codec.binary), req.id, overflowed=overflowed,
        ))
        await self._send_paced([Frame(json, seq) for seq, json in plan.frames])
        last = meta.seq
        # Frames that arrived while we awaited: keep the ones history did not cover.
        while sub.pending:
            pending, sub.pending = sub.pending, []
            fresh = [f for f in pending if f.seq is None or f.seq > last]
            for frame in fresh:
                if frame.seq is not None:
                    last = frame.seq
            await self._send_paced(fresh)
        if self.subs.get(chat_id) is not sub:
            return  # deleted or left while we were replaying
        sub.state, sub.epoch, sub.last_seq = State.LIVE, meta.epoch, last

    async def _drain_buffer(self, req: p.Subscribe, sub: Subscription) -> None:
        """Send the intact buffer, then go live. The buffer's bounds stop applying now:
        frames arriving while we read the state queue behind it instead."""
        sub.state = State.SYNCING
        sub.pending = list(sub.buffer)
        sub.buffer.clear()
        sub.buffer_bytes = 0
        meta = await self.gateway.store.meta(req.chat_id)
        if meta is None:
            self._drop(req.chat_id)
            self._error("not_found", "conversation was deleted", req)
            return
        self._send(p.Subscribed(req.chat_id, meta.epoch, meta.seq, True, 0,
                                _snapshot(meta, self.codec.binary), req.id,
                                buffered=len(sub.pending), overflowed=False))
        while sub.pending:
            frames, sub.pending = sub.pending, []
            for frame in frames:
                if frame.seq is not None:
                    sub.last_seq = frame.seq
            await self._send_paced(frames)
        if self.subs.get(req.chat_id) is sub:
            sub.state = State.LIVE

    def _unsubscribe(self, req: p.Unsubscribe) -> None:
        sub = self.subs.get(req.chat_id)
        if sub is not None and sub.state is State.LIVE:
            sub.state = State.BUFFERING
            sub.unsubscribed_at = time.monotonic()
        self._send(p.Unsubscribed(req.chat_id, req.id))

    def _drop(self, chat_id: str) -> None:
        if self.subs.pop(chat_id, None) is not None:
            self.gateway.hub.leave(chat_id, self)

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
            if frame.seq is not None:
                if frame.seq <= sub.last_seq:
                    return  # already sent (a replay overlapped a gap repair)
                sub.last_seq = frame.seq
            self._send_frame(frame)
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

    # --- writes -----------------------------------------------------------------------

    async def _message(self, req: p.Message) -> None:
        self._send(await self.gateway.conversations.post_message(self.principal, req))

    async def _cancel(self, req: p.Cancel) -> None:
        self._send(await self.gateway.conversations.cancel(self.principal, req))


def _snapshot(meta: Meta, binary: bool) -> p.Snapshot:
    goal = None
    if meta.goal:
        # The goal is stored as JSON; a Raw is spliced into the output as is, so a
        # MessagePack frame needs it re-encoded as MessagePack.
        goal = msgspec.Raw(_to_msgpack(meta.goal) if binary else meta.goal)
    return p.Snapshot(
        title=meta.title,
        status="running" if meta.status == "running" else "idle",
        turn_id=meta.turn_id,
        started_at=meta.started_at,
        goal_state=goal,
    )


def _to_msgpack(json: bytes) -> bytes:
    return msgspec.msgpack.encode(msgspec.json.decode(json))


def _echo(value: Any) -> Any:
    """Echo a request's ``id``/``chat_id`` only when it is a plain, short scalar."""
    if isinstance(value, (int, str)) and not isinstance(value, bool) and len(str(value)) <= 128:
        return value
    return None

