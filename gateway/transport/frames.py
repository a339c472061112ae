"""Complete, unmasked server-to-client WebSocket frames (RFC 6455 section 5.2).

A server frame is never masked, and uvicorn negotiates no extension here (deflate is off),
so one frame built for a payload is valid for every connection: it is built once per
process and written as is to each socket.
"""

from __future__ import annotations

import struct

TEXT = 0x81  # FIN + text opcode
BINARY = 0x82  # FIN + binary opcode


def frame(first_byte: int, payload: bytes) -> bytes:
    """The whole frame: header, then ``payload`` (one unfragmented message)."""
    size = len(payload)
    if size < 126:
        return bytes((first_byte, size)) + payload
    if size < 65536:
        return struct.pack("!BBH", first_byte, 126, size) + payload
    return struct.pack("!BBQ", first_byte, 127, size) + payload


def text_frame(payload: bytes) -> bytes:
    """A text message; ``payload`` must be UTF-8 (JSON from msgspec always is)."""
    return frame(TEXT, payload)


def binary_frame(payload: bytes) -> bytes:
    return frame(BINARY, payload)
