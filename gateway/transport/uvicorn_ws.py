"""The gateway's transport in uvicorn, and logs that hold no token.

:class:`GatewayHttpProtocol` is uvicorn's httptools protocol with three changes: a
WebSocket upgrade goes to :mod:`gateway.transport.websocket` (the gateway's own protocol),
with the request as httptools parsed it; a publish (the app's :class:`FastPost`) is
answered from the parser's callbacks, without an ASGI cycle; and a reply's head and body
leave in one write. ``gateway serve`` passes it as ``http=``. Under any other server, or
plain uvicorn, the app runs as an ASGI app (only slower).

It also keeps bearer tokens out of the logs: uvicorn logs every accepted WebSocket with its
query string, and browsers can only send the token there; and under plain uvicorn it logs a
client's text frame that is not UTF-8 as one line at INFO, not as an error with a traceback.

This touches uvicorn internals (``handle_websocket_upgrade``, the parser callbacks and the
attributes they read) and websockets' (the parser's state between frames).
:func:`check_compatible` verifies them at start-up and the test suite runs it, so an
upgrade that breaks them fails loudly; ``pyproject.toml`` pins the range.
"""

from __future__ import annotations

import asyncio
import logging
from http import HTTPStatus
from typing import Any, Protocol, cast
from weakref import WeakKeyDictionary

from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState
from websockets.protocol import Protocol as Framing
from websockets.protocol import Side

from ..logs import RedactSecrets
from .websocket import (
    EXTENSION,
    GatewayWebSocketProtocol,
    Host,
    TransportListener,
    response_head,
    waits_for_frame,
)

__all__ = ["EXTENSION", "FAST_POST", "FastPost", "GatewayHttpProtocol",
           "GatewayWebSocketProtocol", "TransportListener", "check_compatible",
           "redact_request_logs", "redacting_logger"]

class ClientFaults(logging.Filter):
    """A text frame that is not UTF-8 is the client's fault: uvicorn logs it as an error with
    a traceback (a log flood any client can cause); one line at INFO says it instead, and
    the client has its 1007."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg == NOT_UTF8:
            record.levelno, record.levelname = logging.INFO, "INFO"
            record.exc_info, record.exc_text = None, None
            return logging.getLogger("uvicorn.error").isEnabledFor(logging.INFO)
        return True


NOT_UTF8 = "Invalid UTF-8 sequence received from client."

# Every logger that can print a request line, an ASGI scope or a frame: uvicorn's own
# (accepts, errors, access, and at trace level each scope) and the one websockets' protocol
# is given (at debug level it prints the request line, headers and every frame).
_REQUEST_LOGGERS = ("uvicorn.error", "uvicorn.access", "uvicorn.asgi")
_logger: logging.Logger | None = None


def redact_request_logs() -> None:
    """Keep tokens and frame payloads out of every uvicorn log line; safe to call again."""
    for name in _REQUEST_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, RedactSecrets) for f in logger.filters):
            logger.addFilter(RedactSecrets())


def redacting_logger() -> logging.Logger:
    """A child of ``uvicorn.error`` (same handlers, same level) whose lines carry no token.

    Made on the first connection, once uvicorn has configured its loggers.
    """
    global _logger
    if _logger is None:
        _logger = logging.getLogger("uvicorn.error.gateway")
        _logger.addFilter(RedactSecrets())
        _logger.addFilter(ClientFaults())
        # uvicorn compares ``self.logger.level`` against TRACE before formatting trace lines.
        _logger.setLevel(logging.getLogger("uvicorn.error").getEffectiveLevel())
    return _logger


def _host(http: HttpToolsProtocol) -> Host:
    host = _hosts.get(http.server_state)
    if host is None:
        host = _hosts[http.server_state] = Host(http.config, http.server_state, http.app_state,
                                                redacting_logger())
    return host


_hosts: WeakKeyDictionary[Any, Host] = WeakKeyDictionary()


class JoinedWrites:
    """The transport as uvicorn's HTTP protocol sees it: what it writes in one loop turn
    leaves in one write. uvicorn writes a reply's head and its body separately; joined,
    a publish's reply costs one system call, not two. Closing writes what is held first."""

    __slots__ = ("_held", "_loop", "transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self.transport = transport
        self._loop = loop
        self._held: list[bytes] | None = None

    def write(self, data: bytes) -> None:
        held = self._held
        if held is None:
            self._held = [data]
            self._loop.call_soon(self.flush)
        else:
            held.append(data)

    def write_whole(self, data: bytes) -> None:
        """A reply made in one piece (the fast POST's): it has nothing to be joined with, so
        it leaves now, a loop turn sooner, unless earlier writes are held (order first)."""
        if self._held is not None:
            self._held.append(data)
        elif not self.transport.is_closing():
            self.transport.write(data)

    def flush(self) -> None:
        held, self._held = self._held, None
        if held and not self.transport.is_closing():
            self.transport.write(held[0] if len(held) == 1 else b"".join(held))

    def close(self) -> None:
        self.flush()
        self.transport.close()

    def is_closing(self) -> bool:
        return self.transport.is_closing()

    def __getattr__(self, name: str) -> Any:  # everything else is the transport's
        return getattr(self.transport, name)


# The lifespan state key under which the app offers a FastPost (the publish endpoint).
FAST_POST = "gateway.fast_post"


class FastPost(Protocol):
    """A POST route answered straight from the parser: no ASGI scope, cycle or messages."""

    max_body: int

    def routes(self, path: str) -> bool:
        """Whether a POST to ``path`` (no query string, no escapes) is answered here."""

    async def answer(self, authorization: str | None, path: str, body: bytes
                     ) -> tuple[int, bytes]:
        """The status and JSON body for a request and its whole body."""


class _Unwaited:
    """``message_event`` of a fast request: nobody waits on it."""

    __slots__ = ()

    def set(self) -> None:
        pass


_UNWAITED = _Unwaited()


class FastRequest:
    """A fast POST being read and answered. It stands where uvicorn keeps its
    ``RequestResponseCycle``, with the attributes uvicorn's own callbacks touch: ``on_body``
    adds to ``body``, ``connection_lost`` sets ``disconnected``, ``shutdown`` clears
    ``keep_alive``, and a pipelined request queues behind it until ``response_complete``."""

    __slots__ = ("authorization", "body", "disconnected", "keep_alive", "more_body", "path",
                 "response_complete")

    message_event = _UNWAITED

    def __init__(self, authorization: str | None, path: str, keep_alive: bool) -> None:
        self.authorization = authorization
        self.path = path
        self.keep_alive = keep_alive
        self.body = bytearray()
        self.more_body = True
        self.disconnected = False
        self.response_complete = False


def _head(status: int, length: int, default_headers: list[tuple[bytes, bytes]],
          keep_alive: bool) -> bytes:
    extra = b"content-type: application/json\r\ncontent-length: %d\r\n" % length
    if not keep_alive:
        extra += b"connection: close\r\n"
    return response_head(b"%d %s" % (status, HTTPStatus(status).phrase.encode()), extra,
                         default_headers)


_INTERNAL_ERROR = b'{"error":{"code":"internal_error","message":"internal error"}}'


class GatewayHttpProtocol(HttpToolsProtocol):
    """``uvicorn.run(http=GatewayHttpProtocol)``: uvicorn's HTTP protocol, except that

    * a WebSocket upgrade goes to the gateway's own protocol, with the request as httptools
      parsed it (uvicorn would print it back to bytes for a WebSocket library to parse);
    * a POST the app's :class:`FastPost` routes, with a ``content-length`` body that fits
      in uvicorn's read buffer, is answered straight from the parser's callbacks
      (:class:`FastRequest`); everything else (a query string, ``expect``, a chunked or
      larger body, a request pipelined behind another) is uvicorn's, through ASGI;
    * each loop turn's writes are joined (:class:`JoinedWrites`).
    """

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.transport = cast(asyncio.Transport, JoinedWrites(transport, self.loop))

    def on_headers_complete(self) -> None:
        fast = self._fast_request()
        if fast is None:
            super().on_headers_complete()
        else:
            self.cycle = cast(Any, fast)

    def _fast_request(self) -> FastRequest | None:
        route: FastPost | None = self.app_state.get(FAST_POST)
        url = self.url
        parser = self.parser
        if (route is None or parser.get_method() != b"POST" or b"?" in url or b"%" in url
                or not route.routes(path := url.decode("ascii")) or self.expect_100_continue
                or parser.get_http_version() != "1.1" or parser.should_upgrade()
                or self.limit_concurrency is not None
                or (self.cycle is not None and not self.cycle.response_complete)):
            return None
        authorization = length = None
        for name, value in self.headers:
            if name == b"content-length":
                if length is not None:
                    return None
                length = value
            elif name == b"authorization":
                if authorization is None:
                    authorization = value.decode("latin-1")
            elif name == b"transfer-encoding":
                return None
        if length is None or not length.isdigit() or int(length) > min(route.max_body,
                                                                      HIGH_WATER_LIMIT):
            return None  # uvicorn reads it (and pauses reading past its high-water mark)
        self.scope["method"] = "POST"
        return FastRequest(authorization, path, parser.should_keep_alive())

    def on_message_complete(self) -> None:
        request: Any = self.cycle
        if type(request) is not FastRequest:
            super().on_message_complete()
            return
        request.more_body = False
        task = self.loop.create_task(self._answer(request, self.app_state[FAST_POST]))
        task.add_done_callback(self.tasks.discard)
        self.tasks.add(task)

    async def _answer(self, request: FastRequest, route: FastPost) -> None:
        try:
            status, body = await route.answer(request.authorization, request.path,
                                              bytes(request.body))
        except Exception:
            self.logger.exception("Exception in a fast POST")
            status, body, request.keep_alive = 500, _INTERNAL_ERROR, False
        if request.disconnected:
            return  # the client is gone: nobody to answer
        cast(JoinedWrites, self.transport).write_whole(
            _head(status, len(body), self.server_state.default_headers, request.keep_alive)
            + body)
        request.response_complete = True
        if not request.keep_alive:
            self.transport.close()
        self.on_response_complete()

    def handle_websocket_upgrade(self) -> None:
        self.connections.discard(self)
        joined = cast(JoinedWrites, self.transport)
        joined.flush()  # nothing is held before a request is answered; to be sure
        _host(self).upgrade(joined.transport, cast(dict[str, Any], self.scope), self.url,
                            self.client)


def check_compatible() -> None:
    """Raise ``RuntimeError`` if uvicorn or websockets no longer have what this relies on."""
    missing = [] if callable(getattr(HttpToolsProtocol, "handle_websocket_upgrade", None)) else [
        "HttpToolsProtocol.handle_websocket_upgrade"]
    names = HttpToolsProtocol.handle_websocket_upgrade.__code__.co_names + (
        HttpToolsProtocol.__init__.__code__.co_names
        + HttpToolsProtocol.connection_made.__code__.co_names)
    missing += [name for name in ("connections", "scope", "url", "transport", "client",
                                  "config", "server_state", "app_state") if name not in names]
    # The fast POST: the callbacks it overrides or calls, the state it reads.
    missing += [f"HttpToolsProtocol.{name}" for name in (
        "on_headers_complete", "on_message_complete", "on_response_complete", "on_body")
        if not callable(getattr(HttpToolsProtocol, name, None))]
    fast = (HttpToolsProtocol.__init__.__code__.co_names
            + HttpToolsProtocol.on_body.__code__.co_names)
    missing += [name for name in ("cycle", "tasks", "headers", "parser", "limit_concurrency",
                                  "expect_100_continue", "loop", "logger") if name not in fast]
    state = ServerState()
    missing += [name for name in ("connections", "default_headers") if not hasattr(state, name)]
    framing = Framing(Side.SERVER)
    missing += [f"websockets Protocol.{name}" for name in ("current_size", "reader", "parser",
                                                           "close_rcvd_then_sent")
                if not hasattr(framing, name)]
    if not waits_for_frame(framing):
        missing.append("websockets Protocol.parse waiting in StreamReader.at_eof")
    if missing:
        import uvicorn
        from websockets.version import version

        raise RuntimeError(f"uvicorn {uvicorn.__version__}, websockets {version}:"
                           f" missing {', '.join(missing)}; pin a supported version")
