"""The gateway's own WebSocket protocol: one small object per connection, no ASGI.

uvicorn's WebSocket protocols re-parse the upgrade request httptools already parsed, keep
the ASGI scope (every header) and run one ASGI task per connection for its whole life. Here
:meth:`Host.upgrade` answers the handshake from the request as httptools parsed it, asks
the app's :class:`Endpoint` (:class:`gateway.connect.SocketEndpoint`: Origin, subprotocol,
token, limits), writes the 101 and hands the socket to a :class:`GatewayWebSocketProtocol`,
which drives the endpoint's :class:`SocketSession` (:class:`gateway.session.Session`) by
callbacks. The transport knows both only by the protocols declared here: it imports nothing
above it. An idle connection is that protocol object,
its session and the transport: no task, no scope, no parser.

RFC 6455 framing (unmasking, fragmentation, control frames, close handshake, UTF-8 of close
reasons, size limits) is websockets' sans-I/O :class:`~websockets.protocol.Protocol`. It is
made when bytes arrive and dropped again once they were all parsed into whole messages and
the connection is open, so it holds memory only while a client is talking. Text messages are
checked for UTF-8 here (websockets leaves that to its higher layers).

Frames to the client are complete frames written straight to the transport
(:mod:`gateway.transport.outbound`); only close and ping frames are framed here.
"""

from __future__ import annotations

import asyncio
import binascii
import logging
import secrets
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

from websockets.frames import Opcode
from websockets.protocol import OPEN, Side
from websockets.protocol import Protocol as Framing
from websockets.streams import StreamReader
from websockets.utils import accept_key

from .. import logs
from ..closecodes import INTERNAL_ERROR, SERVER_RESTART, TOO_MANY, TOO_MANY_REASON

EXTENSION = "gateway.transport"
# The lifespan state key under which the app offers its /v1/ws endpoint (see gateway.app).
ENDPOINT_STATE = "gateway.sockets"
WEBSOCKET_PATH = b"/v1/ws"
CLOSE_TIMEOUT = 10.0  # seconds the peer has to answer our close frame
EARLY_MAX = 4  # client messages held while a ticket is redeemed before reading stops
SPARE_FRAMINGS = 64  # parsers kept for reuse: enough for the connections of one loop turn
PING = b"\x89\x00"  # an unmasked ping with no payload: the same bytes for every connection
_AT_EOF = StreamReader.at_eof.__code__
_TEXT, _BINARY, _CONT, _PONG = Opcode.TEXT, Opcode.BINARY, Opcode.CONT, Opcode.PONG


class TransportListener(Protocol):
    """What the protocol tells the connection's writer (called synchronously)."""

    def on_pause(self) -> None: ...

    def on_resume(self) -> None: ...

    def on_closing(self) -> None: ...


class Decision(Protocol):
    """What the transport reads of an endpoint's handshake decision (see
    :class:`gateway.connect.Admission`): not ``allowed`` is HTTP 403; else accepted with
    ``subprotocol``, then closed at once with ``refusal`` (code, reason) if there is one; a
    ``ticket`` is still to be redeemed."""

    @property
    def allowed(self) -> bool: ...

    @property
    def subprotocol(self) -> str | None: ...

    @property
    def refusal(self) -> tuple[int, str] | None: ...

    @property
    def ticket(self) -> str | None: ...


class SocketSession(Protocol):
    """What the protocol drives of an accepted connection's session (called synchronously)."""

    def start(self, head: bytes = b"") -> None: ...

    def received(self, data: bytes, resume_reading: Callable[[], None] | None = None) -> bool: ...

    def ended(self, code: int) -> None: ...


D = TypeVar("D", bound=Decision)


class Endpoint(Protocol[D]):
    """What the transport needs of the app's ``/v1/ws`` endpoint, offered in the lifespan
    state under :data:`ENDPOINT_STATE` (:class:`gateway.connect.SocketEndpoint`)."""

    def admit(self, origin: str | None, authorization: str | None, query_string: bytes,
              offered: list[str]) -> D: ...

    def redeem(self, admission: D) -> Awaitable[D]: ...

    def session(self, admission: D, scope: dict[str, Any],
                send: Callable[[dict[str, Any]], Awaitable[None]],
                connection_id: str) -> SocketSession | None: ...


class Flag:
    """``asyncio.Event`` for ``writable``, with no deque until someone waits."""

    __slots__ = ("_set", "_waiters")

    def __init__(self) -> None:
        self._set = True
        self._waiters: list[asyncio.Future[None]] | None = None

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        self._set = True
        waiters, self._waiters = self._waiters, None
        for waiter in waiters or ():
            if not waiter.done():
                waiter.set_result(None)

    def clear(self) -> None:
        self._set = False

    async def wait(self) -> None:
        if self._set:
            return
        waiter = asyncio.get_running_loop().create_future()
        if self._waiters is None:
            self._waiters = []
        self._waiters.append(waiter)
        await waiter


def response_head(status: bytes, extra: bytes,
                  default_headers: list[tuple[bytes, bytes]]) -> bytes:
    """An HTTP/1.1 response's status line and headers: ``extra`` (complete header lines),
    then the server's default ones (date, server)."""
    lines = [b"HTTP/1.1 ", status, b"\r\n", extra]
    for name, value in default_headers:
        lines += [name, b": ", value, b"\r\n"]
    lines.append(b"\r\n")
    return b"".join(lines)


def _refuse(transport: asyncio.Transport, status: bytes, default_headers: Any,
            extra: bytes = b"") -> None:
    transport.write(response_head(status, b"content-type: text/plain; charset=utf-8\r\n"
                                  b"content-length: 0\r\nconnection: close\r\n" + extra,
                                  default_headers))
    transport.close()


class Host:
    """What every connection of one server shares: settings, the endpoint, the keepalive.

    One per uvicorn server (per ``ServerState``), made on its first upgrade."""

    __slots__ = ("_sweep", "app_state", "connections", "default_headers", "logger", "loop",
                 "max_size", "ping_interval", "spare_framings")

    def __init__(self, config: Any, server_state: Any, app_state: dict[str, Any],
                 logger: logging.Logger) -> None:
        self.app_state = app_state
        # uvicorn's set of live connections: it calls ``shutdown`` on each when stopping
        # and waits for them to leave it.
        self.connections: set[Any] = server_state.connections
        self.default_headers: list[tuple[bytes, bytes]] = server_state.default_headers
        self.logger = logger
        self.loop = asyncio.get_running_loop()
        self.max_size: int | None = config.ws_max_size
        self.ping_interval: float | None = config.ws_ping_interval or None
        self._sweep: asyncio.TimerHandle | None = None
        self.spare_framings: list[Framing] = []  # parsers idle connections gave back

    @property
    def endpoint(self) -> Endpoint[Any] | None:
        return self.app_state.get(ENDPOINT_STATE)

    # --- the handshake --------------------------------------------------------------

    def upgrade(self, transport: asyncio.Transport, scope: dict[str, Any], url: bytes,
                client: tuple[str, int] | None) -> None:
        """Answer an upgrade request httptools parsed (``scope`` holds its method, version
        and headers, ``url`` its raw target), and take over the socket if it is accepted."""
        connection_id = secrets.token_hex(8)
        # Lines logged while admitting (a refused token) name the connection. This runs in
        # a callback, not a task: the binding is undone before it returns.
        bound = logs.bind(connection_id=connection_id)
        try:
            self._upgrade(transport, scope, url, client, connection_id)
        finally:
            logs.unbind(bound)

    def _upgrade(self, transport: asyncio.Transport, scope: dict[str, Any], url: bytes,
                 client: tuple[str, int] | None, connection_id: str) -> None:
        default_headers = server_headers = self.default_headers
        key = version = origin = authorization = None
        connection = b""
        offered: list[str] = []
        keys = 0
        for name, value in scope["headers"]:
            if name == b"sec-websocket-key":
                key, keys = value, keys + 1
            elif name == b"sec-websocket-version":
                version = value
            elif name == b"origin":
                origin = value.decode("latin-1")
            elif name == b"authorization":
                authorization = value.decode("latin-1")
            elif name == b"sec-websocket-protocol":
                offered += [t.strip() for t in value.decode("latin-1").split(",")]
            elif name == b"connection":
                connection += b"," + value.lower()
        if version != b"13":
            # RFC 6455 section 4.4: say which version this server speaks.
            _refuse(transport, b"426 Upgrade Required", server_headers,
                    b"sec-websocket-version: 13\r\n")
            return
        if (scope["method"] != "GET" or scope.get("http_version", "1.1") != "1.1"
                or b"upgrade" not in [t.strip() for t in connection.split(b",")]
                or keys != 1 or not _valid_key(key)):
            _refuse(transport, b"400 Bad Request", server_headers)
            return
        assert key is not None
        path, _, query_string = url.partition(b"?")
        endpoint = self.endpoint
        where = "%s:%d" % client if client else ""  # noqa: UP031 (uvicorn's own format)
        line = (where, (path + b"?" + query_string if query_string else path).decode("latin-1"))
        ids = {"connection_id": connection_id}
        if path != WEBSOCKET_PATH or endpoint is None:
            if endpoint is None:
                self.logger.error("no WebSocket endpoint in the app's lifespan state")
            self.logger.info('%s - "WebSocket %s" 403', *line, extra=ids)
            _refuse(transport, b"403 Forbidden", default_headers)
            return
        admission = endpoint.admit(origin, authorization, query_string, offered)
        if not admission.allowed:
            self.logger.info('%s - "WebSocket %s" 403', *line, extra=ids)
            _refuse(transport, b"403 Forbidden", default_headers)
            return
        extra = [b"upgrade: websocket\r\nconnection: Upgrade\r\nsec-websocket-accept: ",
                 accept_key(key.decode("latin-1")).encode(), b"\r\n"]
        if admission.subprotocol:
            extra += [b"sec-websocket-protocol: ", admission.subprotocol.encode(), b"\r\n"]
        # DEBUG, not uvicorn's INFO: a line per connection is a flood in a reconnect storm
        # (about a fifth of a handshake's CPU, measured with bench/connect.py), as a line per
        # HTTP request would be (the access log is off). Refusals stay at INFO.
        self.logger.debug('%s - "WebSocket %s" [accepted]', *line, extra=ids)
        head = response_head(b"101 Switching Protocols", b"".join(extra), default_headers)
        protocol = GatewayWebSocketProtocol(self, transport)
        transport.set_protocol(protocol)
        self.connections.add(protocol)
        if self._sweep is None and self.ping_interval:
            self._sweep = self.loop.call_later(self.ping_interval, self.keepalive)
        if admission.ticket is None:
            self._open(protocol, endpoint, admission, connection_id, head)
            return
        # A ticket is redeemed in Redis, after the accept as a token is checked after it:
        # what the client sends meanwhile waits for the session.
        transport.write(head)
        protocol.early = []
        task = self.loop.create_task(self._redeem(protocol, endpoint, admission, connection_id))
        protocol.redeeming = task

    async def _redeem(self, protocol: GatewayWebSocketProtocol, endpoint: Endpoint[D],
                      admission: D, connection_id: str) -> None:
        logs.bind(connection_id=connection_id)
        admission = await endpoint.redeem(admission)
        protocol.redeeming = None
        if not protocol.lost:
            self._open(protocol, endpoint, admission, connection_id, b"")

    def _open(self, protocol: GatewayWebSocketProtocol, endpoint: Endpoint[D],
              admission: D, connection_id: str, head: bytes) -> None:
        """Start the session of an accepted connection, or close it with its refusal.
        ``head`` is the 101 if it is still to be written."""
        session = None
        if admission.refusal is None:
            session = endpoint.session(admission, {"extensions": {EXTENSION: protocol}},
                                       protocol.send, connection_id)
        if session is None:
            if head:
                protocol.transport.write(head)
            protocol.close(*(admission.refusal or (TOO_MANY, TOO_MANY_REASON)))
        else:
            protocol.session = session
            session.start(head)  # the 101 and hello leave in one write
        protocol.deliver_early()

    # --- keepalive: one timer for every connection ----------------------------------

    def keepalive(self) -> None:
        """Ping every connection that sent no message since the last round; close those
        that did not answer the previous ping (any pong will do) with 1011. A connection
        that went silent is pinged within ``ping_interval`` and has until the next round to
        answer."""
        self._sweep = None
        alive = False
        for protocol in list(self.connections):
            if type(protocol) is GatewayWebSocketProtocol:
                alive = True
                protocol.ping()
        if alive and self.ping_interval:
            self._sweep = self.loop.call_later(self.ping_interval, self.keepalive)


def waits_for_frame(framing: Framing) -> bool:
    """True when websockets' parser waits for the first byte of a frame (not inside one)."""
    waiting = getattr(framing.parser, "gi_yieldfrom", None)
    return getattr(waiting, "gi_code", None) is _AT_EOF


def _valid_key(key: bytes | None) -> bool:
    """RFC 6455 section 4.2.1: the key is 16 bytes, base64-encoded."""
    if key is None or len(key) != 24:
        return False
    try:
        return len(binascii.a2b_base64(key, strict_mode=True)) == 16
    except binascii.Error:
        return False


class GatewayWebSocketProtocol(asyncio.Protocol):
    """One accepted WebSocket: framing in, close and ping out, flow control to its writer.

    ``transport``, ``writable`` and ``listener`` are what the fast path
    (:class:`~gateway.transport.outbound.DirectOutbound`) uses."""

    __slots__ = ("_close_timer", "_framing", "_heard", "_host", "_parts", "_pinged", "_text",
                 "early", "listener", "lost", "redeeming", "session", "transport", "writable")

    def __init__(self, host: Host, transport: asyncio.Transport) -> None:
        self._host = host
        self.transport = transport
        self.writable = Flag()
        self.listener: TransportListener | None = None
        self.session: SocketSession | None = None  # once accepted
        self._framing: Framing | None = None  # while bytes are being parsed, or closing
        self._parts: list[bytes] | None = None  # a fragmented message's frames so far
        self._text = False
        self._pinged = False  # pinged, and no pong since
        self._heard = False  # a message arrived since the last keepalive round
        self._close_timer: asyncio.TimerHandle | None = None
        self.lost = False
        # While a ticket is redeemed: the task, and the client messages that wait for it.
        self.redeeming: asyncio.Task[None] | None = None
        self.early: list[bytes] | None = None

    def _framer(self) -> Framing:
        framing = self._framing
        if framing is None:
            spare = self._host.spare_framings
            framing = self._framing = spare.pop() if spare else Framing(
                Side.SERVER, max_size=self._host.max_size, logger=self._host.logger)
        return framing

    def _flush(self, framing: Framing) -> None:
        """Write what the framing produced. An empty chunk means the closing handshake is
        over for us: half-close, and keep reading (and discarding) until the peer closes
        too, or ``CLOSE_TIMEOUT``. Closing at once would reset a connection whose peer is
        still sending (a frame over the limit), and the reset can destroy our close frame
        before the peer reads it."""
        eof = False
        for chunk in framing.data_to_send():
            if chunk:
                self.transport.write(chunk)
            else:
                eof = True
        if eof and not self.lost:
            transport = self.transport
            if transport.can_write_eof():
                transport.write_eof()
                if self._close_timer is None:
                    self._close_timer = self._host.loop.call_later(CLOSE_TIMEOUT,
                                                                   transport.close)
            else:
                transport.close()

    # --- inbound --------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        framing = self._framer()
        framing.receive_data(data)
        frames: list[Any] = framing.events_received()  # Frames: the handshake was ours
        for frame in frames:
            opcode = frame.opcode
            if opcode is _TEXT or opcode is _BINARY:
                self._text = opcode is _TEXT
                if frame.fin:
                    self._message(frame.data)
                else:
                    self._parts = [frame.data]
            elif opcode is _CONT:
                assert self._parts is not None  # the framing refuses a stray continuation
                self._parts.append(frame.data)
                if frame.fin:
                    data, self._parts = b"".join(self._parts), None
                    self._message(data)
            elif opcode is _PONG:
                self._pinged = False
            # A ping was answered by the framing; a close is seen in its state below.
        self._flush(framing)
        if framing.state is OPEN:
            if (self._parts is None and not framing.reader.buffer
                    and waits_for_frame(framing)):
                # At a frame boundary with nothing buffered: an idle connection keeps no
                # parser. One in this state is as good as new, and making one costs about
                # 35 µs (a uuid4 among others): the next connection to get bytes reuses it.
                self._framing = None
                spare = self._host.spare_framings
                if len(spare) < SPARE_FRAMINGS:
                    spare.append(framing)
            return
        # The peer's close frame (echoed by the framing), or a protocol error (the framing
        # sent 1002, 1007 or 1009): the connection ends here.
        code = 1005
        if framing.close_rcvd is not None and framing.close_sent is not None:
            code = framing.close_rcvd.code if framing.close_rcvd_then_sent else (
                framing.close_sent.code)
        elif framing.close_sent is not None:
            code = framing.close_sent.code
        self._end(code)

    def _message(self, data: bytes) -> None:
        self._heard = True
        if self._text:
            try:
                data.decode()
            except UnicodeDecodeError:
                self._host.logger.info("a text frame that is not UTF-8: closing with 1007")
                self._fail(1007, "invalid UTF-8")
                return
        if self.early is not None:
            self.early.append(data)
            if len(self.early) >= EARLY_MAX:
                self.transport.pause_reading()  # resumed by the session, or closed
            return
        self.deliver(data)

    def deliver_early(self) -> None:
        """The session started (or the connection was refused): hand it what waited."""
        early, self.early = self.early, None
        if early is None:
            return
        reading = True
        for data in early:
            reading = self.deliver(data)
        if len(early) >= EARLY_MAX and reading and not self.lost:
            self.transport.resume_reading()

    def deliver(self, data: bytes) -> bool:
        """Hand a client message to the session; stop reading while it has enough."""
        session = self.session
        if session is not None and not session.received(data, self.transport.resume_reading):
            self.transport.pause_reading()
            return False
        return True

    def _fail(self, code: int, reason: str) -> None:
        framing = self._framer()
        if framing.state is OPEN:
            framing.fail(code, reason)
            self._flush(framing)
        self._end(code)

    def _end(self, code: int) -> None:
        """The connection is over for the session (its socket closes now or soon)."""
        listener, self.listener = self.listener, None
        if listener is not None:
            listener.on_closing()
        session, self.session = self.session, None
        if session is not None:
            session.ended(code)

    def eof_received(self) -> bool | None:
        # The peer is done sending: once we are too, the transport closes itself and
        # connection_lost follows. A peer that half-closes mid-conversation is gone anyway.
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self._host.connections.discard(self)
        if self._close_timer is not None:
            self._close_timer.cancel()
            self._close_timer = None
        # asyncio never resumes writing on a transport lost while paused: wake the waiters.
        self.writable.set()
        self._end(1006)
        self._framing = None

    # --- outbound -------------------------------------------------------------------

    def pause_writing(self) -> None:
        self.writable.clear()
        if self.listener is not None:
            self.listener.on_pause()

    def resume_writing(self) -> None:
        self.writable.set()
        if self.listener is not None:
            self.listener.on_resume()

    async def send(self, message: dict[str, Any]) -> None:
        """The ASGI ``send`` the writer closes with (``websocket.close`` only)."""
        if message["type"] != "websocket.close":
            raise RuntimeError(f"unexpected {message['type']!r}: frames go to the transport")
        self.close(message.get("code", 1000), message.get("reason") or "")

    def close(self, code: int, reason: str = "") -> None:
        """Send a close frame; the socket closes when the peer answers, or after
        ``CLOSE_TIMEOUT``. What is already in the transport's buffer leaves first."""
        if self.lost:
            return
        framing = self._framer()
        if framing.state is not OPEN:
            return
        framing.send_close(code, reason)
        self._flush(framing)
        self._close_timer = self._host.loop.call_later(CLOSE_TIMEOUT, self.transport.close)

    def ping(self) -> None:
        """A keepalive round (:meth:`Host.keepalive`): a connection that sent a message
        since the last round is alive, and is not pinged (a client that pings on silence,
        as the SDKs do, is then never pinged: half the frames, and no wake-up of a phone's
        radio for them)."""
        if self.lost or self._close_timer is not None:
            return
        if self._heard:
            self._heard = self._pinged = False
            return
        if self._pinged:
            self._host.logger.info("keepalive ping not answered: closing with 1011")
            self._fail(INTERNAL_ERROR, "keepalive ping timeout")
            return
        self._pinged = True
        self.transport.write(PING)

    def shutdown(self) -> None:
        """uvicorn is stopping: 1012 to everyone, then the socket closes."""
        if self._close_timer is None and not self.lost:
            framing = self._framer()
            if framing.state is OPEN:
                framing.send_close(SERVER_RESTART)
                self._flush(framing)
        self._end(SERVER_RESTART)
        self.transport.close()


