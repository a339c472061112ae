"""A server frame, encoded once per process whatever the number of recipients."""

from __future__ import annotations

import logging
from typing import Any

import msgspec

from .transport.frames import binary_frame, text_frame

log = logging.getLogger("gateway.frames")

_json_decode = msgspec.json.decode
_msgpack_encode = msgspec.msgpack.encode
_MSGPACK_INTS = range(-(2**63), 2**64)


def json_to_msgpack(json: bytes) -> bytes:
    """Stored JSON as MessagePack: the one conversion, for frames and snapshots alike.

    An integer past 64 bits, which MessagePack cannot hold, goes as a float, the value a
    JavaScript client reads from the JSON: the gateway refuses such data, but a log written
    before it did may hold some, and a frame that cannot be encoded must still reach its
    MessagePack recipients (a gap they resume into would fail the same way every time).
    """
    value = _json_decode(json)
    try:
        return _msgpack_encode(value)
    except OverflowError:
        log.warning("an integer past 64 bits sent to MessagePack clients as a float")
        return _msgpack_encode(_wide_ints_as_floats(value))


def _wide_ints_as_floats(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _wide_ints_as_floats(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_wide_ints_as_floats(item) for item in value]
    if isinstance(value, int) and value not in _MSGPACK_INTS:
        try:
            return float(value)
        except OverflowError:  # past a double's range too
            return float("inf") if value > 0 else float("-inf")
    return value


class Frame:
    """One frame as stored (its JSON bytes); the MessagePack form and the complete
    WebSocket frames are made on first use and kept for every later recipient."""

    __slots__ = ("_msgpack", "_text", "_wire_binary", "_wire_text", "json", "seq", "stream")

    def __init__(self, json: bytes, seq: int | None = None,
                 stream: tuple[str, int] | None = None) -> None:
        self.json = json
        self.seq = seq  # a durable frame's seq
        self.stream = stream  # (stream id, position) of a streamed delta
        self._text: str | None = None
        self._msgpack: bytes | None = None
        self._wire_text: bytes | None = None
        self._wire_binary: bytes | None = None

    @property
    def text(self) -> str:
        if self._text is None:
            self._text = self.json.decode()
        return self._text

    @property
    def msgpack(self) -> bytes:
        if self._msgpack is None:
            self._msgpack = json_to_msgpack(self.json)
        return self._msgpack

    @property
    def wire_text(self) -> bytes:
        """The complete WebSocket text frame, for every JSON connection."""
        if self._wire_text is None:
            self._wire_text = text_frame(self.json)
        return self._wire_text

    @property
    def wire_binary(self) -> bytes:
        """The complete WebSocket binary frame, for every MessagePack connection."""
        if self._wire_binary is None:
            self._wire_binary = binary_frame(self.msgpack)
        return self._wire_binary

    @property
    def size(self) -> int:
        return len(self.json)

    @property
    def is_deleted(self) -> bool:
        return self.json.startswith(b'{"type":"deleted"')

    @property
    def is_discard(self) -> bool:
        """``stream_discarded``: an open stream is dropped."""
        return self.json.startswith(b'{"type":"stream_discarded"')
