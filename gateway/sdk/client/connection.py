"""The connection loop: connect (with a fresh token for every attempt), read ``hello``,
resubscribe and write the outbox again, dispatch every frame received, ping a silent
connection and drop it when nothing answers, and reconnect with backoff until a terminal
close. :class:`ConnectionLoop` is the part of :class:`~.GatewayClient` that does it."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any
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
    DISCONNECTED,
    FORBIDDEN,
    PROTOCOL_ABUSE,
    TOKEN_EXPIRED,
    TOO_MANY,
    UNAUTHORIZED,
)
from ..streams import Applied
from .chats import Chat
from .errors import GatewayError, RequestError, TerminalError
from .item_queue import ItemQueue
from .items import Ended, Event, PresenceChange, Recovery, StreamReset, SubscribeResult, Typing
from .outbox import DEFAULT_LIMITS, Outbound, Outbox, write_loop
from .requests import Request, Requests

log = logging.getLogger("gateway.client")

TERMINAL = frozenset({UNAUTHORIZED, FORBIDDEN, DISCONNECTED, PROTOCOL_ABUSE})
"""Close codes after which reconnecting cannot help."""
KEEP_BACKING_OFF = frozenset({TOO_MANY, BACKEND_UNAVAILABLE})
"""Close codes that keep growing the backoff even after a healthy connection."""

TokenFactory = Callable[[], Awaitable[str] | str]

TREE_OPS = frozenset({"message", "retry", "edit", "undo", "switch"})
"""Requests whose ack carries the conversation's new head."""

_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder(dict[str, Any]).decode


class Conn:
    """One connection that reached ``hello``: its write queue, when it was last heard, and
    the watchdog's ping waiting for an answer."""

    __slots__ = ("gen", "heard", "hello", "pinged", "queue", "ws")

    def __init__(self, ws: ClientConnection, gen: int, hello: dict[str, Any]) -> None:
        self.ws = ws
        self.gen = gen
        self.hello = hello
        self.queue: asyncio.Queue[Outbound] = asyncio.Queue()
        self.heard = time.monotonic()  # when the last frame arrived
        self.pinged: float | None = None  # when the watchdog pinged, until a frame arrives


class _Stop(Exception):
    """Internal: stop the connection loop with a terminal error."""

    def __init__(self, error: GatewayError) -> None:
        self.error = error


class ConnectionLoop:
    """The connection loop and the dispatch of what it receives, as methods of
    :class:`~.GatewayClient`, whose ``__init__`` sets the state declared here."""

    url: str
    backoff_base: float
    backoff_max: float
    open_timeout: float
    idle_ping: float
    pong_timeout: float
    active_ping: float
    active_pong_timeout: float
    hello: dict[str, Any]
    connections: int
    last_close: tuple[int | None, str] | None
    _token: str | None
    _token_factory: TokenFactory | None
    _connect_kwargs: dict[str, Any]
    _refreshes: set[asyncio.Task[None]]  # in-band token refreshes under way
    _chats: dict[str, Chat]
    _outbox: Outbox
    _requests: Requests
    _items: ItemQueue
    _conn: Conn | None
    _gen: int
    _connected: asyncio.Event
    _disconnected: asyncio.Event
    _stopped: asyncio.Event
    _error: GatewayError | None

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

    def _finish(self, error: GatewayError, terminal: bool) -> None:
        """Stop for good: fail every pending call; iterators drain, then stop (or raise
        ``error`` when ``terminal``)."""
        if self._error is not None:
            return
        self._error = error
        self._outbox.fail_all(error)
        self._requests.fail_all(error)
        for chat in self._chats.values():
            for waiter in chat.waiters:
                if not waiter.done():
                    waiter.set_exception(error)
            chat.waiters.clear()
        self._items.finish(error if terminal else None)
        self._connected.clear()
        self._disconnected.set()
        self._stopped.set()

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

    async def _refresh(self, conn: Conn) -> None:
        """The token expires soon: send a fresh one from the token factory, in band. The
        connection and its subscriptions stay; if it is refused, the 4011 at the old
        token's expiry reconnects with a fresh token as before."""
        try:
            token = await self._fresh_token()
            await self._requests.call(conn.queue, Request("refresh", None),
                                      {"type": "refresh", "token": token})
        except (_Stop, GatewayError) as exc:
            log.warning("in-band token refresh failed: %s", getattr(exc, "error", exc))

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
        limits = conn.hello.get("limits") or DEFAULT_LIMITS
        writer = asyncio.get_running_loop().create_task(write_loop(ws, conn.queue, limits))
        watchdog = asyncio.get_running_loop().create_task(self._watch(conn))
        try:
            async for raw in ws:
                conn.heard = time.monotonic()
                conn.pinged = None  # any frame answers the watchdog's ping
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

    async def _watch(self, conn: Conn) -> None:
        """Ping a connection silent for ``idle_ping`` seconds; drop it (and so reconnect) when
        nothing arrives within ``pong_timeout`` of the ping. While frames are expected (a
        subscribed chat streams or runs a turn) the shorter ``active_ping`` and
        ``active_pong_timeout`` apply. Any frame received clears the ping
        (``conn.pinged``), the pong or any other."""
        # Woken often enough to notice that a stream opened while it slept.
        tick = min(self.active_ping, self.active_pong_timeout, self.idle_ping) / 4
        while True:
            now = time.monotonic()
            active = self._expecting()
            ping_after = min(self.idle_ping, self.active_ping) if active else self.idle_ping
            pong_wait = (min(self.pong_timeout, self.active_pong_timeout) if active
                         else self.pong_timeout)
            if conn.pinged is not None:
                wait = conn.pinged + pong_wait - now
                if wait <= 0:
                    log.warning("no answer for %.1fs: the connection is dead; reconnecting",
                                now - conn.heard)
                    conn.ws.transport.abort()
                    return
            else:
                wait = conn.heard + ping_after - now
                if wait <= 0:
                    conn.pinged = now
                    conn.queue.put_nowait((_encode({"type": "ping"}).decode(), None))
                    wait = pong_wait
            await asyncio.sleep(min(wait, tick))

    def _expecting(self) -> bool:
        """Frames are expected: a chat the application wants has an open stream or a
        running turn."""
        return any(chat.desired and (chat.running or chat.streams.by_id)
                   for chat in self._chats.values())

    def _on_hello(self, ws: ClientConnection, hello: dict[str, Any]) -> Conn:
        self._gen += 1
        self.hello = hello
        self.connections += 1
        conn = Conn(ws, self._gen, hello)
        # Resubscribe first, then the outbox in order: the server handles frames in order,
        # so every chat is live again before any queued message lands.
        for chat_id, chat in self._chats.items():
            chat.live_gen = chat.buffered_gen = None
            if chat.desired:
                self._send_subscribe(conn, chat_id, chat)
        for entry in self._outbox.to_resend():
            conn.queue.put_nowait(entry.outbound())
        self._conn = conn
        self._disconnected.clear()
        self._connected.set()
        log.info("connected (%s) as %s", hello.get("connection_id"), hello.get("user_id"))
        return conn

    def _on_disconnect(self, conn: Conn) -> None:
        if self._conn is conn:
            self._conn = None
        self._connected.clear()
        self._disconnected.set()
        self._requests.on_disconnect()

    def _send_subscribe(self, conn: Conn, chat_id: str, chat: Chat,
                        resync: bool = False) -> None:
        frame: dict[str, Any] = {"type": "subscribe", "chat_id": chat_id}
        if not chat.create:
            frame["create"] = False
        elif chat.agent is not None:
            frame["agent"] = chat.agent
        since = None
        if not resync and (chat.buffered_gen == conn.gen or chat.live_gen == conn.gen):
            pass  # the server has our buffer, or it is live: no replay needed
        elif chat.epoch is not None and chat.seq is not None:
            since = frame["since"] = {"seq": chat.seq, "epoch": chat.epoch}
        chat.buffered_gen = None
        frame["id"] = self._requests.add(Request("subscribe", chat_id, since))
        conn.queue.put_nowait((_encode(frame).decode(), None))

    # --- inbound ----------------------------------------------------------------------

    def _dispatch(self, conn: Conn, frame: dict[str, Any]) -> None:
        kind = frame.get("type")
        rid = frame.get("id")
        if kind == "conversation":
            self._items.put_feed(frame)
        elif kind == "subscribed":
            self._on_subscribed(conn, frame, self._requests.pop(rid))
        elif kind == "ack":
            entry = self._outbox.get(rid)
            if entry is not None and not entry.future.done():
                self._on_ack_head(conn, entry.frame, frame)
                entry.future.set_result(msgspec.convert(frame, p.Ack))
        elif kind == "error":
            self._on_error(frame)
        elif kind in ("unsubscribed", "left", "pong", "typed", "refreshed"):
            self._requests.answer(rid, frame)
        elif kind == "token_expiring" and self._token_factory is not None:
            task = asyncio.get_running_loop().create_task(self._refresh(conn))
            self._refreshes.add(task)
            task.add_done_callback(self._refreshes.discard)
        elif kind == "presence":
            self._on_presence(frame)
        elif kind == "typing":
            chat = self._chats.get(str(frame.get("chat_id")))
            if chat is not None and chat.desired and isinstance(frame.get("user_id"), str):
                chat.typing[frame["user_id"]] = time.monotonic()
                self._items.put_signal(Typing(frame["chat_id"], frame["user_id"],
                                              int(frame.get("ts") or 0)))
        elif isinstance(kind, str) and isinstance(frame.get("chat_id"), str):
            self._on_event(conn, frame)

    def _on_subscribed(self, conn: Conn, frame: dict[str, Any], req: Request | None) -> None:
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
            chat.tree.reset()  # the application reloads the history, and the tree with it
            self._items.put(chat_id, Recovery(chat_id, result.epoch, result.seq, previous_epoch,
                                              previous_seq, frame))
        else:
            chat.epoch = result.epoch
            if chat.seq is None and not resumed_from_buffer:
                # Live from here; a replay (if any) starts right after since.seq.
                chat.seq = since["seq"] if since is not None else result.seq
        chat.live_gen = conn.gen
        chat.running = result.snapshot.get("status") == "running"
        if "presence" in result.snapshot:
            self._on_presence({"chat_id": chat_id, **result.snapshot["presence"]}, snapshot=True)
        if "head" in result.snapshot:  # the head now, as of the reply's seq
            head = result.snapshot["head"]
            chat.tree.set_head(head if isinstance(head, str) else None, result.seq)
        listed = result.snapshot.get("streams")
        if listed is not None:  # omitted when we hold every open stream already
            chat.resyncing = False
            for stream in chat.streams.reset(listed):
                # A copy: the chat's own state goes on growing with the deltas behind it.
                self._items.put(chat_id, StreamReset(chat_id, dataclasses.replace(stream)))
        waiters, chat.waiters = chat.waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(result)

    def _on_presence(self, frame: dict[str, Any], snapshot: bool = False) -> None:
        """A list newer than the one held (a snapshot's is the server's word now)."""
        chat = self._chats.get(str(frame.get("chat_id")))
        if chat is None or not chat.desired:
            return
        try:
            listed = msgspec.convert(frame, p.PresenceList)
        except msgspec.ValidationError:
            log.warning("ignoring a malformed presence frame: %r", frame)
            return
        if not snapshot and chat.presence is not None and listed.v <= chat.presence.v:
            return
        chat.presence = listed
        present = {user.user_id for user in listed.users}
        for user_id in [u for u in chat.typing if u not in present]:
            del chat.typing[user_id]
        self._items.put_signal(PresenceChange(frame["chat_id"], listed))

    def _on_error(self, frame: dict[str, Any]) -> None:
        rid = frame.get("id")
        chat_id = frame.get("chat_id")
        head = frame.get("head")
        error = RequestError(str(frame.get("code")), str(frame.get("message")),
                             chat_id if isinstance(chat_id, str) else None,
                             head=head if isinstance(head, str) else None,
                             has_head="head" in frame)
        if not isinstance(rid, int):
            log.warning("gateway error: %s", error)
            return
        entry = self._outbox.get(rid)
        if entry is not None:
            if not entry.future.done():
                entry.future.set_exception(error)
            return
        req = self._requests.pop(rid)
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
                self._items.put(req.chat_id, Ended(req.chat_id, "error", error))
        elif req.future is not None and not req.future.done():
            req.future.set_exception(error)

    def _on_event(self, conn: Conn, frame: dict[str, Any]) -> None:
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
            chat.tree.apply(frame)
            if kind in ("turn_start", "turn_end"):
                chat.running = kind == "turn_start"
            elif kind == "user_message" and isinstance(frame.get("data"), dict):
                chat.typing.pop(str(frame["data"].get("user_id")), None)  # it was sent
        else:
            seq = None
        self._items.put(chat_id, Event(chat_id, kind, seq, frame.get("ts"), frame.get("data"),
                                       frame, stream_text))
        if kind in ("deleted", "removed"):
            # The server ended the subscription; resubscribing would recreate the chat (or,
            # for a user removed from a shared one, be refused).
            chat.desired = False
            chat.seq = chat.epoch = chat.live_gen = chat.buffered_gen = None
            chat.tree.reset()
            self._items.put(chat_id, Ended(chat_id, "removed" if kind == "removed" else "deleted"))

    def _on_ack_head(self, conn: Conn, request: dict[str, Any], frame: dict[str, Any]) -> None:
        """A message's or tree operation's ack tells the head after it, as of its seq: taken
        for a chat this connection does not get live. A live one gets the ``head`` event,
        after the events that made its node, so the tree never points at a node whose
        events are still on their way."""
        seq = frame.get("seq")
        if "head" not in frame or not isinstance(seq, int) or request["type"] not in TREE_OPS:
            return
        chat = self._chat(request["chat_id"])
        if chat.live_gen == conn.gen:
            return
        head = frame["head"]
        chat.tree.set_head(head if isinstance(head, str) else None, seq)

    def _chat(self, chat_id: str) -> Chat:
        chat = self._chats.get(chat_id)
        if chat is None:
            chat = self._chats[chat_id] = Chat()
        return chat


def _ws_url(base: str, token: str) -> str:
    """``base`` with the WebSocket path (when missing) and ``?token=``."""
    parts = urlsplit(base)
    scheme = {"http": "ws", "https": "wss"}.get(parts.scheme, parts.scheme)
    path = parts.path if parts.path not in ("", "/") else "/v1/ws"
    query = [(k, v) for k, v in parse_qsl(parts.query, keep_blank_values=True) if k != "token"]
    query.append(("token", token))
    return urlunsplit((scheme, parts.netloc, path, urlencode(query), ""))
