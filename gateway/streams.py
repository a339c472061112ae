"""The server's rules for open streams: the answers being written, resumable.

An open stream's text lives in Redis (``lua/publish.lua`` appends each delta and keeps its
next position). A reader that joins mid-answer gets each open stream whole, in a snapshot,
then the deltas after it. Pub/sub does not know where the snapshot was read, so a delta
published before the read may still arrive after it: :class:`Floor` says which deltas the
snapshot holds already. The client's side of the same rules is :mod:`gateway.sdk.streams`.
"""

from __future__ import annotations

from . import protocol as p
from .frames import Frame
from .redis.records import OpenStream


class Floor:
    """The positions a snapshot held its open streams at: a delta below one is in the
    snapshot's text already. A frame published after the read ends the need for it (the
    channel delivers in publish order); :class:`~gateway.rooms.Cursor` drops it then."""

    __slots__ = ("_next",)

    def __init__(self, streams: list[OpenStream]) -> None:
        self._next = {s.id: s.pos for s in streams}

    def covers(self, frame: Frame) -> bool:
        """``frame`` is a delta the snapshot holds already."""
        stream = frame.stream
        return stream is not None and stream[1] < self._next.get(stream[0], 0)

    def __bool__(self) -> bool:
        return bool(self._next)


def snapshot(streams: list[OpenStream]) -> list[p.StreamSnapshot]:
    """``subscribed.snapshot.streams``: every open stream, whole."""
    return [p.StreamSnapshot(s.id, s.type, s.turn_id, s.text, s.pos) for s in streams]


def held(stream: OpenStream, last: tuple[str, int] | None) -> bool:
    """The client holds the whole text already: the last delta it got (its SSE
    ``Last-Event-ID``) is the stream's latest."""
    return last == (stream.id, stream.pos - 1)
