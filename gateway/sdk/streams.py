"""A chat's open streams as a client holds them: the answer being written, resumable.

Pure bookkeeping, no I/O, shared by every client (the Python SDK here; the browser module
does the same in JavaScript). The rules, from ``protocol.md``:

- ``subscribed`` with ``snapshot.streams`` replaces every open stream: the listed ones hold
  exactly that text, and a stream not listed is gone;
- a streamed delta (a frame with ``"stream": {"id", "pos"}``) continues its stream when
  ``pos`` is the stream's next position; a lower ``pos`` is already in the text (skip it); a
  higher one, or an unknown stream past position 0, means something was missed: resubscribe
  with ``since`` to get a fresh snapshot;
- a durable event whose ``data.stream_id`` names a stream commits it (the event holds the
  whole text), and ``stream_discarded`` drops one (a redelivered turn starts over).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any


@dataclass(slots=True)
class StreamText:
    """One open stream: its text so far, and the position of the next delta."""

    id: str
    type: str
    turn_id: str | None
    text: str
    pos: int


class Applied(Enum):
    NOT_STREAMED = "not_streamed"  # the frame is not about a stream
    APPENDED = "appended"  # a delta continued (or opened) its stream
    DUPLICATE = "duplicate"  # a delta already in the text: skip it
    GAP = "gap"  # deltas were missed: resubscribe with since
    CLOSED = "closed"  # committed or discarded


class OpenStreams:
    """The open streams of one chat."""

    __slots__ = ("by_id",)

    def __init__(self) -> None:
        self.by_id: dict[str, StreamText] = {}

    def reset(self, listed: list[dict[str, Any]]) -> list[StreamText]:
        """Take a ``snapshot.streams`` list as the whole truth; returns the new streams."""
        self.by_id = {s["id"]: StreamText(s["id"], s["type"], s.get("turn_id"), s["text"],
                                          s["pos"]) for s in listed}
        return list(self.by_id.values())

    def apply(self, frame: dict[str, Any]) -> tuple[Applied, StreamText | None]:
        """Apply one event frame; returns what happened and the stream it touched."""
        position = frame.get("stream")
        data = frame.get("data")
        if isinstance(position, dict):
            stream_id, pos = position.get("id"), position.get("pos")
            if not isinstance(stream_id, str) or not isinstance(pos, int):
                return Applied.NOT_STREAMED, None
            stream = self.by_id.get(stream_id)
            if stream is None:
                if pos != 0:
                    return Applied.GAP, None
                stream = self.by_id[stream_id] = StreamText(stream_id, str(frame.get("type")),
                                                            None, "", 0)
            if pos < stream.pos:
                return Applied.DUPLICATE, stream
            if pos > stream.pos:
                return Applied.GAP, stream
            text = data.get("text") if isinstance(data, dict) else None
            stream.text += text if isinstance(text, str) else ""
            stream.pos += 1
            return Applied.APPENDED, stream
        if not isinstance(data, dict):
            return Applied.NOT_STREAMED, None
        if frame.get("type") == "stream_discarded" or (
                frame.get("seq") is not None and isinstance(data.get("stream_id"), str)):
            return Applied.CLOSED, self.by_id.pop(str(data.get("stream_id")), None)
        return Applied.NOT_STREAMED, None
