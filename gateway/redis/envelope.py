"""The pub/sub envelope of a room frame, read back.

Every frame the scripts publish on a room's channel is wrapped by ``envelope()`` in
``lua/lib.lua`` (the one writer) as ``<epoch>|<seq>|<stream id>:<pos>|<frame>``, the parts
that do not apply left empty: a durable frame has an epoch and a seq, a streamed delta its
stream position, anything else neither. :func:`unpack` is the one reader.
"""

from __future__ import annotations

from typing import NamedTuple


class Envelope(NamedTuple):
    epoch: str  # "" unless durable
    seq: int | None  # a durable frame's seq
    stream: tuple[str, int] | None  # a streamed delta's (stream id, position)
    frame: bytes  # the frame's JSON, exactly as stored


def unpack(data: bytes) -> Envelope:
    epoch, seq, stream, frame = data.split(b"|", 3)
    position = None
    if stream:
        stream_id, _, pos = stream.rpartition(b":")
        position = (stream_id.decode(), int(pos))
    return Envelope(epoch.decode(), int(seq) if seq else None, position, frame)
