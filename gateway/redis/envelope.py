"""The pub/sub envelope of a room frame, read back.

Every frame the scripts publish on a room's channel is wrapped by ``envelope()`` in
``lua/lib.lua`` (the one writer) as ``<epoch>|<seq>|<stream id>:<pos>|<frame>``, the parts
that do not apply left empty: a durable frame has an epoch and a seq, a streamed delta its
stream position, anything else neither. :func:`unpack` is the one reader.

Two ephemeral frames are not the log's, and say so where the epoch goes (with no seq):
a ``presence`` frame ``!<version>`` (``lua/presence.lua`` writes it), a ``typing`` frame
``~<connection id>``, the connection it must not reach (:func:`except_connection`).
Sessions take these themselves (:meth:`Room.fan_out_signal <gateway.rooms.Room.fan_out_signal>`).
A ``removed`` frame is marked ``-<user id>`` (``lua/members.lua`` writes it): only that
user's connections and streams take it, and end their subscription
(:meth:`Room.remove_user <gateway.rooms.Room.remove_user>`).
"""

from __future__ import annotations

from typing import NamedTuple


class Envelope(NamedTuple):
    epoch: str  # "" unless durable
    seq: int | None  # a durable frame's seq
    stream: tuple[str, int] | None  # a streamed delta's (stream id, position)
    frame: bytes  # the frame's JSON, exactly as stored


def except_connection(connection_id: str, frame: bytes) -> bytes:
    """The envelope of an ephemeral frame for every member of the room but one connection."""
    return b"~" + connection_id.encode() + b"|||" + frame


def signal_of(mark: str) -> tuple[str, int]:
    """A presence or typing envelope's mark: (the connection to skip, the presence
    version); ("", version) for presence, (connection id, 0) for typing."""
    if mark[0] == "!":
        return "", int(mark[1:])
    return mark[1:], 0


def unpack(data: bytes) -> Envelope:
    epoch, seq, stream, frame = data.split(b"|", 3)
    position = None
    if stream:
        stream_id, _, pos = stream.rpartition(b":")
        position = (stream_id.decode(), int(pos))
    return Envelope(epoch.decode(), int(seq) if seq else None, position, frame)
