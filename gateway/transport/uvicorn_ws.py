"""The gateway's WebSocket transport in uvicorn, and logs that hold no token.

:class:`GatewayHttpProtocol` is uvicorn's httptools protocol with one change: a WebSocket
upgrade goes to :mod:`gateway.transport.websocket` (the gateway's own protocol), with the
request as httptools parsed it. ``gateway serve`` passes it as ``http=``. Under any other
server, or plain uvicorn, the app runs as an ASGI app (only slower).

It also keeps bearer tokens out of the logs: uvicorn logs every accepted WebSocket with its
query string, and browsers can only send the token there; and under plain uvicorn it logs a
client's text frame that is not UTF-8 as one line at INFO, not as an error with a traceback.

This touches uvicorn internals (``handle_websocket_upgrade`` and the attributes it reads)
and websockets' (the parser's state between frames). :func:`check_compatible` verifies them
at start-up and the test suite runs it, so an upgrade that breaks them fails loudly;
``pyproject.toml`` pins the range.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, cast
from weakref import WeakKeyDictionary

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
    waits_for_frame,
)

__all__ = ["EXTENSION", "GatewayHttpProtocol", "GatewayWebSocketProtocol", "TransportListener",
           "check_compatible", "redact_request_logs", "redacting_logger"]

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


class GatewayHttpProtocol(HttpToolsProtocol):
    """``uvicorn.run(http=GatewayHttpProtocol)``: uvicorn's HTTP protocol, except that a
    WebSocket upgrade goes to the gateway's own protocol, with the request as httptools
    parsed it (uvicorn would print it back to bytes for a WebSocket library to parse), and
    that each loop turn's writes are joined (:class:`JoinedWrites`)."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.transport = cast(asyncio.Transport, JoinedWrites(transport, self.loop))

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
