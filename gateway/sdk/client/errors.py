"""The client SDK's errors: what its calls and iterators raise."""

from __future__ import annotations


class GatewayError(Exception):
    """Base class of the SDK's errors."""


class RequestError(GatewayError):
    """The server answered a request with an ``error`` frame (or it was refused locally).

    A refused tree operation (``conflict``, ``turn_in_progress``, ``not_on_path``,
    ``nothing_to_retry``, ``nothing_to_undo``, ...) tells the conversation's head now:
    ``head`` (None for none), with ``has_head`` true."""

    def __init__(self, code: str, message: str, chat_id: str | None = None, *,
                 head: str | None = None, has_head: bool = False) -> None:
        super().__init__(f"{code}: {message}" + (f" (head: {head})" if has_head else ""))
        self.code = code
        self.message = message
        self.chat_id = chat_id
        self.head = head
        self.has_head = has_head


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
