"""A server frame, encoded once per process whatever the number of recipients."""

from __future__ import annotations

import msgspec

from .transport.frames import binary_frame, text_frame

_json_decode = msgspec.json.decode
_msgpack_encode = msgspec.msgpack.encode


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
            self._msgpack = _msgpack_encode(_json_decode(self.json))
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
