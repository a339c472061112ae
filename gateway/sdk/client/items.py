"""What the application receives: the items of a chat's stream (:class:`Event`,
:class:`StreamReset`, :class:`Recovery`, :class:`Ended`), who is here and typing
(:class:`PresenceChange`, :class:`Typing`), and the replies to its calls
(:class:`SubscribeResult`, :data:`Ack`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from ... import protocol as p
from ..streams import StreamText
from .errors import RequestError

Ack = p.Ack
"""The ``ack`` reply to a message, a cancel or a tree operation."""


@dataclass(frozen=True, slots=True)
class Event:
    """One event frame of a chat: durable (``seq`` set) or ephemeral (``seq`` None)."""

    chat_id: str
    type: str
    seq: int | None
    ts: int | None
    data: Any
    frame: dict[str, Any] = field(repr=False)
    """The whole frame as received."""
    stream_text: str | None = None
    """For a streamed delta: its stream's whole text so far, this delta included."""

    @property
    def durable(self) -> bool:
        return self.seq is not None

    @property
    def node(self) -> str | None:
        """The tree node a durable event belongs to (a ``msg_id`` or a ``turn_id``), or None
        for a conversation-level event."""
        node = self.frame.get("node")
        return node if isinstance(node, str) else None

    @property
    def stream_id(self) -> str | None:
        """The stream a delta belongs to, or that a commit (``message``...) closes."""
        position = self.frame.get("stream")
        if isinstance(position, dict):
            return str(position.get("id"))
        data = self.data
        return data.get("stream_id") if isinstance(data, dict) else None


@dataclass(frozen=True, slots=True)
class StreamReset:
    """A (re)subscribe told the whole text of an open stream: show ``stream.text`` as is,
    replacing whatever partial text of that stream was shown. Streams of the chat not reset
    by the same ``subscribed`` are gone (committed or discarded meanwhile)."""

    chat_id: str
    stream: StreamText


@dataclass(frozen=True, slots=True)
class Recovery:
    """Continuity of a chat's history is broken: reload it over HTTP.

    Put into the chat's stream when a (re)subscribe answered ``recovered: false`` or the
    epoch changed; events after it are live from ``epoch``/``seq``.
    """

    chat_id: str
    epoch: str
    seq: int
    previous_epoch: str | None
    previous_seq: int | None
    frame: dict[str, Any] = field(repr=False)
    """The ``subscribed`` frame that reported it."""
    recovered: bool = False


@dataclass(frozen=True, slots=True)
class Ended:
    """The end of a chat's subscription (only yielded by :meth:`GatewayClient.all_events`)."""

    chat_id: str
    reason: Literal["left", "deleted", "removed", "error"]
    error: RequestError | None = None


@dataclass(frozen=True, slots=True)
class SubscribeResult:
    """The ``subscribed`` reply."""

    chat_id: str
    epoch: str
    seq: int
    recovered: bool
    replayed: int
    snapshot: dict[str, Any]
    buffered: int | None
    overflowed: bool | None
    frame: dict[str, Any] = field(repr=False)

    @classmethod
    def from_frame(cls, frame: dict[str, Any]) -> SubscribeResult:
        return cls(frame["chat_id"], frame["epoch"], frame["seq"], frame.get("recovered", True),
                   frame.get("replayed", 0), frame.get("snapshot") or {},
                   frame.get("buffered"), frame.get("overflowed"), frame)


@dataclass(frozen=True, slots=True)
class PresenceChange:
    """Who is connected to a chat changed: ``presence`` is the whole list now (a newer
    ``v`` than any before it)."""

    chat_id: str
    presence: p.PresenceList


@dataclass(frozen=True, slots=True)
class Typing:
    """Another connection's person is typing in a chat (``user_id``: who; may be this
    client's own user on another device)."""

    chat_id: str
    user_id: str
    ts: int


Signal = PresenceChange | Typing
ChatItem = Event | Recovery | StreamReset
AnyItem = Event | Recovery | StreamReset | Ended
