"""Python client SDK for the gateway's WebSocket protocol (``protocol.md``), for server-side
subscribers and apps.

::

    async with GatewayClient("ws://127.0.0.1:8000", token_factory=get_token) as client:
        await client.subscribe("trip")
        ack = await client.send_message("trip", "plan a day in Lisbon")
        async for item in client.events("trip"):
            if isinstance(item, Recovery):      # continuity broken: reload history over HTTP
                await reload_history(item.chat_id, item.epoch)
                continue
            print(item.type, item.seq, item.data)

What it does for you
--------------------

* **Connection.** One WebSocket (``compression=None``, JSON frames), the token sent as
  ``?token=``. With a ``token_factory`` (an async, or plain, callable returning a token) a
  fresh token is fetched for every connection attempt, so a close with 4011 (token expired)
  reconnects with a new one. With a static ``token``, 4011 is terminal.
* **Reconnect.** Network drops and the resumable close codes (4008, 4011, 4029, 1012, 1013,
  and anything else that is not terminal) reconnect with exponential backoff and full
  jitter: ``uniform(0, min(backoff_max, backoff_base * 2 ** attempt))``. The attempt count
  restarts after a connection that reached ``hello``, except after 4029/1013, which keep
  backing off. The terminal codes 4001, 4003, 4004 (and an HTTP refusal of the handshake,
  say 403 for a bad ``Origin``) stop the client: pending calls and iterators raise
  :class:`TerminalError`.
* **Liveness.** After ``idle_ping`` seconds (5) with nothing received, the client sends a
  protocol ``ping``; when nothing arrives within ``pong_timeout`` (5) more, the connection
  is taken for dead and replaced: a silent network loss is noticed within about 10 s.
* **Resume.** The client remembers ``{seq, epoch}`` per chat (from ``subscribed`` and from
  every durable event) and, after a reconnect, resubscribes every chat with ``since``, so
  the server replays exactly what was missed. Durable events are de-duplicated by seq as a
  defence (never delivered twice, even if the server were to re-send).
* **Outbox.** :meth:`GatewayClient.send_message` and :meth:`GatewayClient.cancel` are queued
  at call time (in call order) and sent as soon as a connection is up; after a reconnect,
  every message not acknowledged yet is sent again, once and in order, with the *same*
  ``client_msg_id`` (generated once per message), so a first attempt that did land is
  answered with the original ack (``duplicate: true``) instead of a second message. A
  ``cancel`` that was already written when the connection dropped is not repeated (it is not
  idempotent): it fails with :class:`ConnectionLost`. Both return futures resolved by the
  ``ack`` (or failed by the ``error``) reply.

Answers being written (streams)
-------------------------------

The client keeps each chat's open streams (``protocol.md``, "Streams"): :meth:`streams`
returns them with their text so far. A streamed delta arrives as an :class:`Event` whose
``stream_text`` is the stream's whole text so far; a delta already held is skipped, and one
that skips a position makes the client resubscribe with ``since`` for a fresh snapshot.
After every (re)subscribe that reports the open streams, a :class:`StreamReset` per stream
gives its exact text: show it as is. A durable event whose ``data.stream_id`` names a
stream (``message``, ``reasoning``) commits it, and ``stream_discarded`` drops it.

How ``recovered: false`` reaches the application
-----------------------------------------------

It is **not** hidden, and it does not stop the stream. When a (re)subscribe answers
``recovered: false`` (the conversation was deleted and recreated so the epoch changed,
history was trimmed, more than ``replay_limit`` events were missed, ...) or the epoch
changed under the client, a :class:`Recovery` item is put into the chat's event stream, in
order: everything before it came from the old position, everything after it is live from the
new ``epoch``/``seq`` (nothing was replayed). The application should then reload the
conversation over HTTP (``GET /v1/conversations/{chat_id}/events``) and carry on iterating.
A :class:`Recovery` item is only ever produced for a broken continuity; a successful resume
is silent (the missed events simply arrive).

Streams
-------

Received items are kept in an in-memory inbox until consumed. Each item is consumed once,
by whichever iterator reads it: :meth:`GatewayClient.events` (one chat: :class:`Event` and
:class:`Recovery` items; it stops after ``leave``, after a ``deleted`` event, and raises
:class:`RequestError` when an automatic resubscribe is refused) or
:meth:`GatewayClient.all_events` (every chat, in arrival order, also yielding :class:`Ended`
markers). Use one style per chat. :meth:`GatewayClient.feed` yields the conversation feed
frames (as dicts); the last ``feed_max`` are kept until read. When the client closes, the
iterators drain what was received and then stop (or raise the terminal error).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import itertools
import logging
import random
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Literal, TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import msgspec
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import (
    ConnectionClosed,
    InvalidHandshake,
    InvalidStatus,
    InvalidURI,
)

from ... import protocol as p
from ...closecodes import (
    BACKEND_UNAVAILABLE,
    FORBIDDEN,
    PROTOCOL_ABUSE,
    TOKEN_EXPIRED,
    TOO_MANY,
    UNAUTHORIZED,
)
from ..streams import Applied, OpenStreams, StreamText

__all__ = [
    "Ack",
    "ClientClosed",
    "ConnectionLost",
    "Ended",
    "Event",
    "GatewayClient",
    "GatewayError",
    "Recovery",
    "RequestError",
    "StreamReset",
    "StreamText",
    "SubscribeResult",
    "TerminalError",
]

log = logging.getLogger("gateway.client")

TERMINAL = frozenset({UNAUTHORIZED, FORBIDDEN, PROTOCOL_ABUSE})
"""Close codes after which reconnecting cannot help."""
KEEP_BACKING_OFF = frozenset({TOO_MANY, BACKEND_UNAVAILABLE})
"""Close codes that keep growing the backoff even after a healthy connection."""

Ack = p.Ack
TokenFactory = Callable[[], Awaitable[str] | str]
T = TypeVar("T")

_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder(dict[str, Any]).decode
_DEFAULT_LIMITS = {"max_frame_bytes": 65536, "rate_limit": 50.0}


# --- errors -----------------------------------------------------------------------------


class GatewayError(Exception):
    """Base class of the SDK's errors."""


class RequestError(GatewayError):
    """The server answered a request with an ``error`` frame (or it was refused locally)."""

    def __init__(self, code: str, message: str, chat_id: str | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.chat_id = chat_id


class TerminalError(GatewayError):
    """The client stopped for good: a terminal close code, a refused handshake, or a failing
    token factory. ``code`` is the close code (or the HTTP status of a refused handshake)."""

    def __init__(self, code: int | None, reason: str) -> None:
        super().__init__(f"connection closed for good ({code}): {reason}")
        self.code = code
        self.reason = reason


class ConnectionLost(GatewayError):
    """A request that is not safe to repeat was in flight when the connection dropped."""


class ClientClosed(GatewayError):
    """The client was closed by the application."""


# --- items ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Event:
    """One event frame of a chat: durable (``seq`` set) or ephemeral (``seq`` None)."""

    chat_id: str
    type: str
    seq: int | None
    ts: int | None
    data: Any
    frame: dict[str, Any] = field(repr=False)
    """The whole frame as received."""
    stream_text: str | None = None
    """For a streamed delta: its stream's whole text so far, this delta included."""

    @property
    def durable(self) -> bool:
        return self.seq is not None

    @property
    def stream_id(self) -> str | None:
        """The stream a delta belongs to, or that a commit (``message``...) closes."""
        position = self.frame.get("stream")
        if isinstance(position, dict):
            return str(position.get("id"))
        data = self.data
        return data.get("stream_id") if isinstance(data, dict) else None


@dataclass(frozen=True, slots=True)
class StreamReset:
    """A (re)subscribe told the whole text of an open stream: show ``stream.text`` as is,
    replacing whatever partial text of that stream was shown. Streams of the chat not reset
    by the same ``subscribed`` are gone (committed or discarded meanwhile)."""

    chat_id: str
    stream: StreamText


@dataclass(frozen=True, slots=True)
class Recovery:
    """Continuity of a chat's history is broken: reload it over HTTP.

    Put into the chat's stream when a (re)subscribe answered ``recovered: false`` or the
    epoch changed; events after it are live from ``epoch``/``seq``.
    """

    chat_id: str
    epoch: str
    seq: int
    previous_epoch: str | None
    previous_seq: int | None
    frame: dict[str, Any] = field(repr=False)
    """The ``subscribed`` frame that reported it."""
    recovered: bool = False


@dataclass(frozen=True, slots=True)
class Ended:
    """The end of a chat's subscription (only yielded by :meth:`GatewayClient.all_events`)."""

    chat_id: str
    reason: Literal["left", "deleted", "error"]
    error: RequestError | None = None


@dataclass(frozen=True, slots=True)
class SubscribeResult:
    """The ``subscribed`` reply."""

    chat_id: str
    epoch: str
    seq: int
    recovered: bool
    replayed: int
    snapshot: dict[str, Any]
    buffered: int | None
    overflowed: bool | None
    frame: dict[str, Any] = field(repr=False)

    @classmethod
    def from_frame(cls, frame: dict[str, Any]) -> SubscribeResult:
        return cls(frame["chat_id"], frame["epoch"], frame["seq"], frame.get("recovered", True),
                   frame.get("replayed", 0), frame.get("snapshot") or {},
                   frame.get("buffered"), frame.get("overflowed"), frame)


ChatItem = Event | Recovery | StreamReset
AnyItem = Event | Recovery | StreamReset | Ended


# --- inbox ------------------------------------------------------------------------------


class _Inbox:
    """Received items per chat, with a global arrival order, and the conversation feed."""

    def __init__(self, feed_max: int) -> None:
        self.chats: dict[str, deque[tuple[int, AnyItem]]] = {}
        self.feed: deque[dict[str, Any]] = deque(maxlen=feed_max)
        self._order = itertools.count()
        self._waiters: list[asyncio.Future[None]] = []
        self.done = False
        self.error: BaseException | None = None

    def put(self, chat_id: str, item: AnyItem) -> None:
        self.chats.setdefault(chat_id, deque()).append((next(self._order), item))
        self._wake()

    def put_feed(self, frame: dict[str, Any]) -> None:
        self.feed.append(frame)
        self._wake()

    def finish(self, error: BaseException | None) -> None:
        if not self.done:
            self.done, self.error = True, error
        self._wake()

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def wait(self) -> None:
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        finally:
            if waiter in self._waiters:
                self._waiters.remove(waiter)

    def end(self) -> None:
        """Raise what an exhausted iterator raises once the client is done."""
        if self.error is not None:
            raise self.error
        raise StopAsyncIteration

    def pop_chat(self, chat_id: str) -> AnyItem | None:
        queue = self.chats.get(chat_id)
        if not queue:
            return None
        item = queue.popleft()[1]
        if not queue:
            del self.chats[chat_id]
        return item

    def drop_ended(self, chat_id: str) -> None:
        queue = self.chats.get(chat_id)
        if queue:
            kept = deque(entry for entry in queue if not isinstance(entry[1], Ended))
            if kept:
                self.chats[chat_id] = kept
            else:
                del self.chats[chat_id]

    def pop_any(self) -> AnyItem | None:
        if not self.chats:
            return None
        chat_id = min(self.chats, key=lambda c: self.chats[c][0][0])
        return self.pop_chat(chat_id)


class _Stream(AsyncIterator[T]):
    def __init__(self, next_item: Callable[[], Awaitable[T]]) -> None:
        self._next = next_item

    def __aiter__(self) -> _Stream[T]:
        return self

    async def __anext__(self) -> T:
        return await self._next()


# --- bookkeeping ------------------------------------------------------------------------


class _Chat:
    __slots__ = ("buffered_gen", "desired", "dropping", "epoch", "live_gen", "resyncing", "seq",
                 "streams", "waiters")

    def __init__(self) -> None:
        self.desired = False  # the application wants it subscribed (resubscribed on reconnect)
        self.dropping = False  # left: drop frames still in flight
        self.epoch: str | None = None
        self.seq: int | None = None  # last durable seq handed to the application
        self.live_gen: int | None = None  # connection on which the server has it live
        self.buffered_gen: int | None = None  # connection on which the server buffers it
        self.waiters: list[asyncio.Future[SubscribeResult]] = []
        self.streams = OpenStreams()
        self.resyncing = False  # a gap in a stream: waiting for a fresh snapshot


class _Outgoing:
    """A message or cancel: kept until its reply, re-sent after a reconnect."""

    __slots__ = ("chat_id", "frame", "future", "id", "retry_safe", "written")

    def __init__(self, rid: int, frame: dict[str, Any], retry_safe: bool,
                 future: asyncio.Future[p.Ack]) -> None:
        self.id = rid
        self.chat_id: str = frame["chat_id"]
        self.frame = frame
        self.retry_safe = retry_safe
        self.future = future
        self.written = False


@dataclass(slots=True)
class _Request:
    kind: Literal["subscribe", "unsubscribe", "leave", "ping"]
    chat_id: str | None
    since: dict[str, Any] | None = None
    future: asyncio.Future[Any] | None = None


class _Conn:
    __slots__ = ("gen", "heard", "hello", "queue", "ws")

    def __init__(self, ws: ClientConnection, gen: int, hello: dict[str, Any]) -> None:
        self.ws = ws
        self.gen = gen
        self.hello = hello
        self.queue: asyncio.Queue[tuple[str, _Outgoing | None]] = asyncio.Queue()
        self.heard = time.monotonic()  # when the last frame arrived


class _Bucket:
    """Client-side pacing so the server's inbound rate limit is never hit."""

    def __init__(self, rate: float) -> None:
        self.rate = max(1.0, rate)
        self.tokens = self.rate
        self.stamp = time.monotonic()

    async def take(self) -> None:
        while True:
            now = time.monotonic()
            self.tokens = min(self.rate, self.tokens + (now - self.stamp) * self.rate)
            self.stamp = now
            if self.tokens >= 1:
                self.tokens -= 1
                return
            await asyncio.sleep((1 - self.tokens) / self.rate)


class _Stop(Exception):
    """Internal: stop the connection loop with a terminal error."""

    def __init__(self, error: GatewayError) -> None:
        self.error = error


# --- the client -------------------------------------------------------------------------


class GatewayClient:
    """A reconnecting, resuming client of one gateway.

    ``url`` is ``ws://host:port`` (``/v1/ws`` is added) or the full ``ws://host:port/v1/ws``.
    Give either ``token`` or ``token_factory``. Extra keyword arguments go to
    :func:`websockets.asyncio.client.connect`.
    """

    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        token_factory: TokenFactory | None = None,
        backoff_base: float = 0.5,
        backoff_max: float = 30.0,
        open_timeout: float = 10.0,
        feed_max: int = 1000,
        idle_ping: float = 5.0,
        pong_timeout: float = 5.0,
        **connect_kwargs: Any,
    ) -> None:
        if (token is None) == (token_factory is None):
            raise ValueError("give exactly one of token and token_factory")
        self.url = url
        self._token = token
        self._token_factory = token_factory
        self.backoff_base = backoff_base
        self.backoff_max = backoff_max
        self.open_timeout = open_timeout
        # A connection that died silently (a phone changing networks, a laptop waking up) is
        # noticed within idle_ping + pong_timeout: a ping after idle_ping seconds of silence,
        # and a reconnect when nothing answers it.
        self.idle_ping = idle_ping
        self.pong_timeout = pong_timeout
        self._connect_kwargs = connect_kwargs
        self._chats: dict[str, _Chat] = {}
        self._outbox: list[_Outgoing] = []
        self._entries: dict[int, _Outgoing] = {}
        self._requests: dict[int, _Request] = {}
        self._ids = itertools.count(1)
        self._inbox = _Inbox(feed_max)
        self._conn: _Conn | None = None
        self._gen = 0
        self._task: asyncio.Task[None] | None = None
        self._connected = asyncio.Event()
        self._disconnected = asyncio.Event()
        self._disconnected.set()
        self._stopped = asyncio.Event()
        self._error: GatewayError | None = None
        self.hello: dict[str, Any] = {}
        """The last ``hello`` frame."""
        self.connections = 0
        """How many connections reached ``hello`` so far."""
        self.last_close: tuple[int | None, str] | None = None
        """Close code (None: no WebSocket) and reason of the last lost connection."""

    # --- lifecycle --------------------------------------------------------------------

    async def __aenter__(self) -> GatewayClient:
        await self.connect()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    def start(self) -> None:
        """Start connecting in the background (idempotent)."""
        self._check_open()
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="gateway-client")

    async def connect(self) -> None:
        """Start, and wait for the first connection (transient failures are retried; wrap
        this in ``asyncio.timeout`` to bound it). Raises :class:`TerminalError`."""
        self.start()
        await self.wait_connected()

    async def wait_connected(self) -> None:
        """Wait until a connection is up (hello received, resubscribes and outbox sent)."""
        while not self._connected.is_set():
            self._check_open()
            waiters = {asyncio.ensure_future(self._connected.wait()),
                       asyncio.ensure_future(self._stopped.wait())}
            try:
                await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for waiter in waiters:
                    waiter.cancel()
        self._check_open()

    async def wait_disconnected(self) -> None:
        """Wait until the current connection, if any, is lost."""
        await self._disconnected.wait()

    @property
    def connected(self) -> bool:
        return self._conn is not None

    @property
    def pending(self) -> int:
        """Messages and cancels not acknowledged yet (queued or in flight)."""
        return sum(1 for entry in self._outbox if not entry.future.done())

    def streams(self, chat_id: str) -> list[StreamText]:
        """The chat's open streams (answers being written) with their text so far."""
        chat = self._chats.get(chat_id)
        if chat is None:
            return []
        return [dataclasses.replace(s) for s in chat.streams.by_id.values()]

    def position(self, chat_id: str) -> tuple[int | None, str | None]:
        """The ``(seq, epoch)`` the client would resume ``chat_id`` from."""
        chat = self._chats.get(chat_id)
        return (chat.seq, chat.epoch) if chat is not None else (None, None)

    async def close(self) -> None:
        """Close the connection; pending calls fail with :class:`ClientClosed`, iterators
        drain what was received and stop."""
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._finish(ClientClosed("client closed"), terminal=False)

    def _check_open(self) -> None:
        if self._error is not None:
            raise self._error

    def _finish(self, error: GatewayError, terminal: bool) -> None:
        if self._error is not None:
            return
        self._error = error
        for entry in self._outbox:
            if not entry.future.done():
                entry.future.set_exception(error)
        self._outbox.clear()
        self._entries.clear()
        for req in self._requests.values():
            if req.future is not None and not req.future.done():
                req.future.set_exception(error)
        self._requests.clear()
        for chat in self._chats.values():
            for waiter in chat.waiters:
                if not waiter.done():
                    waiter.set_exception(error)
            chat.waiters.clear()
        self._inbox.finish(error if terminal else None)
        self._connected.clear()
        self._disconnected.set()
        self._stopped.set()

    # --- requests ---------------------------------------------------------------------

    async def subscribe(self, chat_id: str, *, seq: int | None = None,
                        epoch: str | None = None) -> SubscribeResult:
        """Subscribe (and keep subscribed across reconnects). ``seq``/``epoch`` resume from
        an explicit position, as ``since``. Waits for the ``subscribed`` reply (which may come
        after a reconnect); raises :class:`RequestError` (``forbidden``, ...)."""
        self._check_open()
        _check_chat_id(chat_id)
        if (seq is None) != (epoch is None):
            raise ValueError("seq and epoch go together")
        chat = self._chat(chat_id)
        if seq is not None:
            chat.seq, chat.epoch, chat.live_gen, chat.buffered_gen = seq, epoch, None, None
        chat.desired, chat.dropping = True, False
        self._inbox.drop_ended(chat_id)  # a new subscription: a new stream
        waiter: asyncio.Future[SubscribeResult] = asyncio.get_running_loop().create_future()
        chat.waiters.append(waiter)
        if self._conn is not None:
            self._send_subscribe(self._conn, chat_id, chat)
        return await waiter

    async def unsubscribe(self, chat_id: str) -> None:
        """Stop receiving a chat; the server buffers its frames, and the next
        :meth:`subscribe` delivers what was missed (from the buffer, or replayed)."""
        self._check_open()
        chat = self._chat(chat_id)
        chat.desired, chat.live_gen = False, None
        conn = self._conn
        if conn is None:
            return
        chat.buffered_gen = conn.gen
        await self._request(conn, _Request("unsubscribe", chat_id),
                            {"type": "unsubscribe", "chat_id": chat_id})

    async def leave(self, chat_id: str) -> None:
        """Stop receiving a chat and forget its position; its :meth:`events` stream ends."""
        self._check_open()
        chat = self._chat(chat_id)
        chat.desired, chat.dropping = False, True
        chat.seq = chat.epoch = chat.live_gen = chat.buffered_gen = None
        self._inbox.put(chat_id, Ended(chat_id, "left"))
        conn = self._conn
        if conn is not None:
            await self._request(conn, _Request("leave", chat_id),
                                {"type": "leave", "chat_id": chat_id})

    async def ping(self) -> int:
        """Round trip to the server; returns its clock (ms)."""
        self._check_open()
        await self.wait_connected()
        assert self._conn is not None
        pong: dict[str, Any] = await self._request(self._conn, _Request("ping", None),
                                                   {"type": "ping"})
        return int(pong["ts"])

    def send_message(self, chat_id: str, text: str, client_msg_id: str | None = None,
                     data: dict[str, Any] | None = None) -> asyncio.Future[p.Ack]:
        """Queue a user message now; await the result for its ``ack``.

        Retry-safe: the ``client_msg_id`` (generated here when not given) is reused for
        every attempt. Fails with :class:`RequestError` (``turn_in_progress``, ...).
        """
        _check_chat_id(chat_id)
        if client_msg_id is None:
            client_msg_id = "m-" + uuid.uuid4().hex
        elif not 1 <= len(client_msg_id) <= 128:
            raise ValueError("client_msg_id must be 1-128 characters")
        frame: dict[str, Any] = {"type": "message", "chat_id": chat_id, "text": text,
                                 "client_msg_id": client_msg_id}
        if data is not None:
            frame["data"] = data
        return self._submit(frame, retry_safe=True)

    def cancel(self, chat_id: str, turn_id: str | None = None) -> asyncio.Future[p.Ack]:
        """Queue a ``cancel`` of the running turn; await the result for its ``ack``."""
        _check_chat_id(chat_id)
        frame: dict[str, Any] = {"type": "cancel", "chat_id": chat_id}
        if turn_id is not None:
            frame["turn_id"] = turn_id
        return self._submit(frame, retry_safe=False)

    def _submit(self, frame: dict[str, Any], retry_safe: bool) -> asyncio.Future[p.Ack]:
        self._check_open()
        rid = next(self._ids)
        frame["id"] = rid
        future: asyncio.Future[p.Ack] = asyncio.get_running_loop().create_future()
        entry = _Outgoing(rid, frame, retry_safe, future)
        limit = int((self.hello.get("limits") or _DEFAULT_LIMITS)["max_frame_bytes"])
        if len(_encode(frame)) > limit:
            raise RequestError("frame_too_big", f"the frame is over {limit} bytes",
                               frame["chat_id"])
        self._outbox.append(entry)
        self._entries[rid] = entry
        future.add_done_callback(lambda _: self._forget(entry))
        if self._conn is not None:
            self._write(self._conn, entry)
        return future

    def _forget(self, entry: _Outgoing) -> None:
        self._entries.pop(entry.id, None)
        with contextlib.suppress(ValueError):
            self._outbox.remove(entry)

    async def _request(self, conn: _Conn, req: _Request, frame: dict[str, Any]) -> Any:
        rid = next(self._ids)
        req.future = asyncio.get_running_loop().create_future()
        self._requests[rid] = req
        frame["id"] = rid
        conn.queue.put_nowait((_encode(frame).decode(), None))
        try:
            return await req.future
        finally:
            self._requests.pop(rid, None)

    # --- iteration --------------------------------------------------------------------

    def events(self, chat_id: str) -> AsyncIterator[ChatItem]:
        """The chat's :class:`Event` and :class:`Recovery` items, in order."""

        async def next_item() -> ChatItem:
            while True:
                item = self._inbox.pop_chat(chat_id)
                if isinstance(item, Ended):
                    if item.error is not None:
                        raise item.error
                    raise StopAsyncIteration
                if item is not None:
                    return item
                if self._inbox.done:
                    self._inbox.end()
                await self._inbox.wait()

        return _Stream(next_item)

    def all_events(self) -> AsyncIterator[AnyItem]:
        """Every chat's items, in arrival order, :class:`Ended` markers included."""

        async def next_item() -> AnyItem:
            while True:
                item = self._inbox.pop_any()
                if item is not None:
                    return item
                if self._inbox.done:
                    self._inbox.end()
                await self._inbox.wait()

        return _Stream(next_item)

    def feed(self) -> AsyncIterator[dict[str, Any]]:
        """The conversation feed: ``conversation`` frames for the user's conversations."""

        async def next_item() -> dict[str, Any]:
            while True:
                if self._inbox.feed:
                    return self._inbox.feed.popleft()
                if self._inbox.done:
                    self._inbox.end()
                await self._inbox.wait()

        return _Stream(next_item)

    # --- connection loop --------------------------------------------------------------

    async def _run(self) -> None:
        attempt = 0
        try:
            while True:
                code, reason, healthy = await self._connect_once()
                self.last_close = (code, reason)
                if code in TERMINAL:
                    raise _Stop(TerminalError(code, reason or "closed by the server"))
                if code == TOKEN_EXPIRED and self._token_factory is None:
                    raise _Stop(TerminalError(code, "token expired and no token_factory to "
                                                    "get a fresh one"))
                attempt = 0 if healthy and code not in KEEP_BACKING_OFF else attempt + 1
                cap = min(self.backoff_max, self.backoff_base * 2 ** min(attempt, 30))
                delay = random.uniform(0, cap)
                log.info("disconnected (%s %s); reconnecting in %.2fs", code, reason, delay)
                await asyncio.sleep(delay)
        except _Stop as stop:
            log.warning("gateway client stopped: %s", stop.error)
            self._finish(stop.error, terminal=True)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug: do not leave callers hanging
            log.exception("gateway client failed")
            error = TerminalError(None, f"client failure: {exc!r}")
            error.__cause__ = exc
            self._finish(error, terminal=True)

    async def _fresh_token(self) -> str:
        if self._token_factory is None:
            assert self._token is not None
            return self._token
        try:
            token = self._token_factory()
            if inspect.isawaitable(token):
                token = await token
        except Exception as exc:
            raise _Stop(TerminalError(None, f"token_factory failed: {exc!r}")) from exc
        return str(token)

    async def _connect_once(self) -> tuple[int | None, str, bool]:
        """One connection: ``(close code or None, reason, reached hello)``."""
        url = _ws_url(self.url, await self._fresh_token())
        kwargs: dict[str, Any] = {"max_size": None, "open_timeout": self.open_timeout,
                                  "close_timeout": 2.0, **self._connect_kwargs}
        try:
            ws = await connect(url, compression=None, **kwargs)
        except InvalidStatus as exc:
            status = exc.response.status_code
            if 400 <= status < 500 and status not in (408, 429):
                raise _Stop(TerminalError(status, f"handshake refused: HTTP {status}")) from exc
            return None, f"handshake refused: HTTP {status}", False
        except InvalidURI as exc:
            raise _Stop(TerminalError(None, str(exc))) from exc
        except (OSError, TimeoutError, InvalidHandshake) as exc:
            return None, f"cannot connect: {exc!r}", False
        healthy = False
        try:
            healthy = await self._session(ws)
        finally:
            with contextlib.suppress(Exception):
                await ws.close()
        return ws.close_code, ws.close_reason or "", healthy

    async def _session(self, ws: ClientConnection) -> bool:
        try:
            async with asyncio.timeout(self.open_timeout):
                hello = _decode(await ws.recv())
        except (ConnectionClosed, TimeoutError):
            return False
        if hello.get("type") != "hello":
            log.warning("expected hello, got %r", hello.get("type"))
            return False
        conn = self._on_hello(ws, hello)
        writer = asyncio.get_running_loop().create_task(self._write_loop(conn))
        watchdog = asyncio.get_running_loop().create_task(self._watch(conn))
        try:
            async for raw in ws:
                conn.heard = time.monotonic()
                try:
                    frame = _decode(raw)
                except msgspec.DecodeError:
                    log.warning("undecodable frame from the server")
                    continue
                self._dispatch(conn, frame)
        except ConnectionClosed:
            pass
        finally:
            writer.cancel()
            watchdog.cancel()
            self._on_disconnect(conn)
        return True

    async def _watch(self, conn: _Conn) -> None:
        """Ping a silent connection; drop it (and so reconnect) when the ping goes unheard."""
        pinged = False
        while True:
            silent = time.monotonic() - conn.heard
            if silent < self.idle_ping:
                pinged = False
                await asyncio.sleep(self.idle_ping - silent)
            elif not pinged:
                pinged = True
                conn.queue.put_nowait((_encode({"type": "ping"}).decode(), None))
                await asyncio.sleep(self.pong_timeout)
            else:
                log.warning("no answer for %.1fs: the connection is dead; reconnecting", silent)
                conn.ws.transport.abort()
                return

    def _on_hello(self, ws: ClientConnection, hello: dict[str, Any]) -> _Conn:
        self._gen += 1
        self.hello = hello
        self.connections += 1
        conn = _Conn(ws, self._gen, hello)
        # Resubscribe first, then the outbox in order: the server handles frames in order,
        # so every chat is live again before any queued message lands.
        for chat_id, chat in self._chats.items():
            chat.live_gen = chat.buffered_gen = None
            if chat.desired:
                self._send_subscribe(conn, chat_id, chat)
        for entry in list(self._outbox):
            if entry.future.done():
                continue
            if entry.written and not entry.retry_safe:
                entry.future.set_exception(ConnectionLost(
                    f"{entry.frame['type']} may or may not have reached the server"))
                continue
            self._write(conn, entry)
        self._conn = conn
        self._disconnected.clear()
        self._connected.set()
        log.info("connected (%s) as %s", hello.get("connection_id"), hello.get("user_id"))
        return conn

    def _on_disconnect(self, conn: _Conn) -> None:
        if self._conn is conn:
            self._conn = None
        self._connected.clear()
        self._disconnected.set()
        for rid, req in list(self._requests.items()):
            if req.future is None or req.future.done():
                continue
            if req.kind in ("unsubscribe", "leave"):
                req.future.set_result(None)  # a new connection starts with nothing
            elif req.kind == "ping":
                req.future.set_exception(ConnectionLost("connection lost"))
            else:  # subscribe: resent on reconnect; its callers wait on the chat
                del self._requests[rid]

    def _write(self, conn: _Conn, entry: _Outgoing) -> None:
        conn.queue.put_nowait((_encode(entry.frame).decode(), entry))

    def _send_subscribe(self, conn: _Conn, chat_id: str, chat: _Chat,
                        resync: bool = False) -> None:
        frame: dict[str, Any] = {"type": "subscribe", "chat_id": chat_id}
        since = None
        if not resync and (chat.buffered_gen == conn.gen or chat.live_gen == conn.gen):
            pass  # the server has our buffer, or it is live: no replay needed
        elif chat.epoch is not None and chat.seq is not None:
            since = frame["since"] = {"seq": chat.seq, "epoch": chat.epoch}
        chat.buffered_gen = None
        rid = next(self._ids)
        frame["id"] = rid
        self._requests[rid] = _Request("subscribe", chat_id, since)
        conn.queue.put_nowait((_encode(frame).decode(), None))

    async def _write_loop(self, conn: _Conn) -> None:
        limits = conn.hello.get("limits") or _DEFAULT_LIMITS
        bucket = _Bucket(float(limits.get("rate_limit", 50.0)))
        max_frame = int(limits.get("max_frame_bytes", 65536))
        try:
            while True:
                text, entry = await conn.queue.get()
                if entry is not None:
                    if entry.future.done():
                        continue
                    if len(text.encode()) > max_frame:
                        entry.future.set_exception(RequestError(
                            "frame_too_big", f"the frame is over {max_frame} bytes",
                            entry.chat_id))
                        continue
                await bucket.take()
                if entry is not None:
                    entry.written = True
                await conn.ws.send(text)
        except ConnectionClosed:
            pass

    # --- inbound ----------------------------------------------------------------------

    def _dispatch(self, conn: _Conn, frame: dict[str, Any]) -> None:
        kind = frame.get("type")
        rid = frame.get("id")
        if kind == "conversation":
            self._inbox.put_feed(frame)
        elif kind == "subscribed":
            req = self._requests.pop(rid, None) if isinstance(rid, int) else None
            self._on_subscribed(conn, frame, req)
        elif kind == "ack":
            entry = self._entries.get(rid) if isinstance(rid, int) else None
            if entry is not None and not entry.future.done():
                entry.future.set_result(msgspec.convert(frame, p.Ack))
        elif kind == "error":
            self._on_error(frame)
        elif kind in ("unsubscribed", "left", "pong"):
            req = self._requests.get(rid) if isinstance(rid, int) else None
            if req is not None and req.future is not None and not req.future.done():
                req.future.set_result(frame)
        elif isinstance(kind, str) and isinstance(frame.get("chat_id"), str):
            self._on_event(conn, frame)

    def _on_subscribed(self, conn: _Conn, frame: dict[str, Any], req: _Request | None) -> None:
        result = SubscribeResult.from_frame(frame)
        chat_id = result.chat_id
        chat = self._chat(chat_id)
        since = req.since if req is not None else None
        resumed_from_buffer = result.buffered is not None or bool(result.overflowed)
        previous_epoch, previous_seq = chat.epoch, chat.seq
        broken = not result.recovered or (previous_epoch is not None
                                          and previous_epoch != result.epoch)
        if broken:
            chat.epoch, chat.seq = result.epoch, result.seq
            self._inbox.put(chat_id, Recovery(chat_id, result.epoch, result.seq, previous_epoch,
                                              previous_seq, frame))
        else:
            chat.epoch = result.epoch
            if chat.seq is None and not resumed_from_buffer:
                # Live from here; a replay (if any) starts right after since.seq.
                chat.seq = since["seq"] if since is not None else result.seq
        chat.live_gen = conn.gen
        listed = result.snapshot.get("streams")
        if listed is not None:  # omitted when we hold every open stream already
            chat.resyncing = False
            for stream in chat.streams.reset(listed):
                # A copy: the chat's own state goes on growing with the deltas behind it.
                self._inbox.put(chat_id, StreamReset(chat_id, dataclasses.replace(stream)))
        waiters, chat.waiters = chat.waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(result)

    def _on_error(self, frame: dict[str, Any]) -> None:
        rid = frame.get("id")
        chat_id = frame.get("chat_id")
        error = RequestError(str(frame.get("code")), str(frame.get("message")),
                             chat_id if isinstance(chat_id, str) else None)
        if not isinstance(rid, int):
            log.warning("gateway error: %s", error)
            return
        entry = self._entries.get(rid)
        if entry is not None:
            if not entry.future.done():
                entry.future.set_exception(error)
            return
        req = self._requests.pop(rid, None)
        if req is None:
            log.warning("gateway error for an unknown request: %s", error)
            return
        if req.kind == "subscribe" and req.chat_id is not None:
            chat = self._chat(req.chat_id)
            chat.desired = False
            chat.live_gen = None
            waiters, chat.waiters = chat.waiters, []
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_exception(error)
            if not waiters:  # an automatic resubscribe: tell the stream
                self._inbox.put(req.chat_id, Ended(req.chat_id, "error", error))
        elif req.future is not None and not req.future.done():
            req.future.set_exception(error)

    def _on_event(self, conn: _Conn, frame: dict[str, Any]) -> None:
        chat_id: str = frame["chat_id"]
        chat = self._chats.get(chat_id)
        if chat is None or chat.dropping:
            return
        stream_text = None
        if "stream" in frame and chat.resyncing:
            return  # the snapshot on its way holds it
        applied, stream = chat.streams.apply(frame)
        if applied is Applied.DUPLICATE:
            return
        if applied is Applied.GAP:
            log.warning("%s: a stream skipped a position; resubscribing", chat_id)
            chat.resyncing = True
            self._send_subscribe(conn, chat_id, chat, resync=True)
            return
        if applied is Applied.APPENDED and stream is not None:
            stream_text = stream.text
        seq = frame.get("seq")
        kind: str = frame["type"]
        if isinstance(seq, int):
            if chat.seq is not None and seq <= chat.seq:
                log.debug("dropping duplicate %s seq %d", chat_id, seq)
                return
            if chat.seq is not None and seq > chat.seq + 1:
                log.warning("%s: seq jumped from %d to %d", chat_id, chat.seq, seq)
            chat.seq = seq
        else:
            seq = None
        self._inbox.put(chat_id, Event(chat_id, kind, seq, frame.get("ts"), frame.get("data"),
                                       frame, stream_text))
        if kind == "deleted":
            # The server ended the subscription; resubscribing would recreate the chat.
            chat.desired = False
            chat.seq = chat.epoch = chat.live_gen = chat.buffered_gen = None
            self._inbox.put(chat_id, Ended(chat_id, "deleted"))

    def _chat(self, chat_id: str) -> _Chat:
        chat = self._chats.get(chat_id)
        if chat is None:
            chat = self._chats[chat_id] = _Chat()
        return chat


def _check_chat_id(chat_id: str) -> None:
    if not p.CHAT_ID_RE.match(chat_id):
        raise ValueError(f"invalid chat_id {chat_id!r}")


def _ws_url(base: str, token: str) -> str:
    """``base`` with the WebSocket path (when missing) and ``?token=``."""
    parts = urlsplit(base)
    scheme = {"http": "ws", "https": "wss"}.get(parts.scheme, parts.scheme)
    path = parts.path if parts.path not in ("", "/") else "/v1/ws"
    query = [(k, v) for k, v in parse_qsl(parts.query, keep_blank_values=True) if k != "token"]
    query.append(("token", token))
    return urlunsplit((scheme, parts.netloc, path, urlencode(query), ""))
