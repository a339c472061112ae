"""The one error type for a request the gateway refuses, with its wire code."""

from __future__ import annotations

# Wire error code -> HTTP status, for the HTTP API. WebSocket clients get the code itself.
HTTP_STATUS = {
    "invalid_request": 400,
    "invalid_frame": 400,
    "malformed": 400,
    "reserved_type": 400,
    "text_too_long": 413,
    "payload_too_large": 413,
    "stream_too_large": 413,
    "unauthorized": 401,
    "forbidden": 403,
    "not_found": 404,
    "turn_in_progress": 409,
    "no_active_turn": 409,
    "turn_mismatch": 409,
    "conflict": 409,
    "not_on_path": 409,
    "nothing_to_retry": 409,
    "nothing_to_undo": 409,
    "unprocessable": 422,
    "backend_unavailable": 503,
    "replication_timeout": 503,
}


class Rejected(Exception):
    """A request refused for a reason the client can act on (``code`` goes on the wire)."""

    def __init__(self, code: str, message: str, head: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        # A tree operation refused: the conversation's head now ("" for none), so the
        # client can tell what it raced with.
        self.head = head

    @property
    def http_status(self) -> int:
        return HTTP_STATUS.get(self.code, 400)
