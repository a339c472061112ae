"""uvicorn's websockets-sansio protocol, extended with the fast path the gateway writes through.

uvicorn sends each ASGI ``websocket.send`` through websockets' frame serializer, one
connection at a time. The gateway instead writes frames it built once per process straight
to each socket's transport (see :mod:`gateway.transport.outbound`). This subclass offers
that to the app as ``scope["extensions"]["gateway.transport"]`` (the protocol object
itself) and tells the app when the transport pauses, resumes or starts closing, so fan-out
never writes past backpressure or into a closed socket.

It also keeps bearer tokens out of the logs: uvicorn logs every accepted WebSocket with its
query string, and browsers can only send the token there.

This touches uvicorn internals (``transport``, ``writable``, ``close_sent``, ``scope`` and
the hooks below). :func:`check_compatible` verifies them at start-up and the test suite
runs it, so an upgrade that breaks them fails loudly; ``pyproject.toml`` pins the range.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol

from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

from ..logs import RedactSecrets

EXTENSION = "gateway.transport"


class TransportListener(Protocol):
    """What the protocol tells the connection's writer (called synchronously)."""

    def on_pause(self) -> None: ...

    def on_resume(self) -> None: ...

    def on_closing(self) -> None: ...


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
        # uvicorn compares ``self.logger.level`` against TRACE before formatting trace lines.
        _logger.setLevel(logging.getLogger("uvicorn.error").getEffectiveLevel())
    return _logger


class ReceivedMessages:
    """uvicorn's receive queue (one consumer) without ``asyncio.Queue``'s three deques.

    An idle connection holds its queue for hours: this one costs a list and a slot.
    """

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: list[Any] = []
        self._waiter: asyncio.Future[None] | None = None

    def put_nowait(self, item: Any) -> None:
        self._items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def get(self) -> Any:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.pop(0)

    def empty(self) -> bool:
        return not self._items


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


class GatewayWebSocketProtocol(WebSocketsSansIOProtocol):
    """``uvicorn.run(ws=GatewayWebSocketProtocol)``: the fast path plus token-free logs."""

    listener: TransportListener | None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.logger = redacting_logger()
        self.listener = None
        self.queue = ReceivedMessages()  # type: ignore[assignment]
        self.writable = Flag()  # type: ignore[assignment]

    async def run_asgi(self) -> None:
        # The scope exists once the handshake request was parsed; the app runs in here.
        self.scope["extensions"][EXTENSION] = self  # type: ignore[index,assignment]
        await super().run_asgi()

    async def send(self, message: Any) -> None:
        await super().send(message)
        if self.handshake_complete and getattr(self, "response", None) is not None:
            # The handshake's request and response are done with: a connection lives for
            # hours, and they are a good part of its memory.
            self.request = self.response = None  # type: ignore[assignment]

    # --- flow control: the transport's own buffer is the connection's queue -------------

    def pause_writing(self) -> None:
        super().pause_writing()
        if self.listener is not None:
            self.listener.on_pause()

    def resume_writing(self) -> None:
        super().resume_writing()
        if self.listener is not None:
            self.listener.on_resume()

    # --- every path on which uvicorn closes the transport by itself ---------------------

    def _closing(self) -> None:
        listener, self.listener = self.listener, None
        if listener is not None:
            listener.on_closing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._closing()
        super().connection_lost(exc)

    def handle_close(self, event: Any) -> None:
        self._closing()
        super().handle_close(event)

    def keepalive_timeout(self) -> None:
        self._closing()
        super().keepalive_timeout()

    def handle_parser_exception(self) -> None:
        self._closing()
        super().handle_parser_exception()

    def shutdown(self) -> None:
        self._closing()
        super().shutdown()


_REQUIRED = ("transport", "writable", "close_sent", "conn", "queue")
_HOOKS = ("run_asgi", "pause_writing", "resume_writing", "connection_lost", "handle_close",
          "keepalive_timeout", "handle_parser_exception", "shutdown", "send", "receive")


def check_compatible() -> None:
    """Raise ``RuntimeError`` if uvicorn's protocol no longer has what this class relies on."""
    missing = [name for name in _HOOKS if not callable(getattr(WebSocketsSansIOProtocol, name,
                                                                None))]
    source = WebSocketsSansIOProtocol.__init__.__code__.co_names
    missing += [name for name in _REQUIRED if name not in source]
    if "scope" not in WebSocketsSansIOProtocol.handle_connect.__code__.co_names:
        missing.append("scope")
    if missing:
        import uvicorn

        raise RuntimeError(f"uvicorn {uvicorn.__version__}: its websockets-sansio protocol "
                           f"lacks {', '.join(missing)}; pin a supported uvicorn")
