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

import logging
import re
from typing import Any, Protocol

from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

EXTENSION = "gateway.transport"
_TOKEN_RE = re.compile(r"(token=)[^&\s\"']*")


class TransportListener(Protocol):
    """What the protocol tells the connection's writer (called synchronously)."""

    def on_pause(self) -> None: ...

    def on_resume(self) -> None: ...

    def on_closing(self) -> None: ...


class RedactTokens(logging.Filter):
    """Replace the value of every ``token=`` query parameter in a log line."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "token=" in message:
            record.msg = _TOKEN_RE.sub(r"\1[redacted]", message)
            record.args = None
        return True


def redacting_logger(name: str, like: str) -> logging.Logger:
    """A child of ``like`` (same handlers, same level) whose lines never carry a token."""
    logger = logging.getLogger(f"{like}.{name}")
    if not any(isinstance(f, RedactTokens) for f in logger.filters):
        logger.addFilter(RedactTokens())
    # uvicorn compares ``self.logger.level`` against TRACE before formatting trace lines.
    logger.setLevel(logging.getLogger(like).getEffectiveLevel())
    return logger


class GatewayWebSocketProtocol(WebSocketsSansIOProtocol):
    """``uvicorn.run(ws=GatewayWebSocketProtocol)``: the fast path plus token-free logs."""

    listener: TransportListener | None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.logger = redacting_logger("gateway", "uvicorn.error")
        self.listener = None

    async def run_asgi(self) -> None:
        # The scope exists once the handshake request was parsed; the app runs in here.
        self.scope["extensions"][EXTENSION] = self  # type: ignore[index,assignment]
        await super().run_asgi()

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


_REQUIRED = ("transport", "writable", "close_sent", "conn")
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
