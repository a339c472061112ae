"""A room: the local members of one conversation, and the two lanes frames reach them by.

A member that is live in a room, at the room's position, with nothing held back, sits in
the room's *direct set*: fan-out writes the prebuilt WebSocket frame straight to its
transport, one ``write`` call per member and nothing else. Every other member (syncing,
buffering, paused by backpressure, SSE, the ASGI fallback) gets ``deliver`` and decides
for itself.

The room alone decides who is direct. A member asks to join the direct set with its
:class:`Seat` (:meth:`Room.go_direct`: only at exactly the room's position) and asks to
leave it (:meth:`Room.leave_direct`). When the room must take everyone off the fast lane
(a deletion, a history lost), it writes its position into each seat as it does: the member
finds its seat up to date, and is never called back.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

from .frames import Frame
from .metrics import COUNTS
from .redis.keys import room_channel
from .streams import Floor
from .transport import cork

log = logging.getLogger("gateway.rooms")

Write = Callable[[bytes], None]


class Member(Protocol):
    """What a room needs of a connection: non-blocking delivery."""

    def deliver(self, chat_id: str, frame: Frame) -> None: ...

    def deliver_feed(self, frame: Frame) -> None: ...

    def deliver_signal(self, chat_id: str, frame: Frame, skip: str, version: int) -> None:
        """A ``presence`` (``version`` > 0) or ``typing`` frame (not for the connection
        ``skip``): not events of the log, so neither buffered nor replayed."""

    def removed(self, chat_id: str, user_id: str, frame: Frame) -> None:
        """``user_id`` was removed from the conversation (``frame``, ``removed``, says so):
        a connection or stream of theirs ends its subscription and drops its buffer."""

    def resync(self, chat_id: str) -> None:
        """The conversation's history was lost or forked (Redis restarted empty, FLUSHALL,
        a failover to a replica that lagged, a gap already trimmed): positions held so far
        mean nothing; resync from the store and tell the client (``recovered: false``)."""


class Cursor:
    """How far a reader has got in a room: the last durable seq it was sent and, until a
    frame published after its snapshot goes by, the snapshot's stream positions."""

    __slots__ = ("epoch", "floor", "last_seq")

    def __init__(self, epoch: str = "", last_seq: int = 0, floor: Floor | None = None) -> None:
        self.epoch = epoch
        self.last_seq = last_seq
        self.floor = floor or None

    def admit(self, frame: Frame) -> bool:
        """Whether ``frame`` is new to this reader (and move past it if so): a durable
        frame after ``last_seq``, a delta the snapshot did not hold, anything else."""
        seq = frame.seq
        if seq is not None:
            if seq <= self.last_seq:
                return False  # sent already (a replay overlapped live frames)
            self.last_seq = seq
            self.floor = None  # published after the snapshot's read
            return True
        if self.floor is not None and frame.stream is not None:
            if self.floor.covers(frame):
                return False  # in the snapshot's text already
            self.floor = None  # published after the snapshot's read
        return True


class Seat(Cursor):
    """A member's place in one room: its cursor, and whether it is on the fast lane
    (while ``direct``, its position is the room's, which the room writes back on leaving)."""

    __slots__ = ("binary", "direct", "member", "write")

    def __init__(self, member: Member, write: Write | None, binary: bool) -> None:
        super().__init__()
        self.member = member
        self.write = write  # the transport's write, None when there is no fast lane
        self.binary = binary
        self.direct = False


class Room:
    """The local members of one conversation and the position this process has reached."""

    __slots__ = ("backlog", "binary_writers", "channel", "chat_id", "epoch", "last_seq",
                 "members", "repairing", "slow", "streams", "text_writers", "unread_max")

    def __init__(self, chat_id: str) -> None:
        self.chat_id = chat_id
        self.channel = room_channel(chat_id).encode()
        self.members: dict[Member, None] = {}
        self.slow: dict[Member, None] = {}  # members outside the direct sets
        self.text_writers: dict[Write, Seat] = {}  # the direct sets: transport.write
        self.binary_writers: dict[Write, Seat] = {}
        self.epoch: str | None = None
        self.last_seq: int | None = None  # None until a member's first read tells us
        self.unread_max = 0  # highest seq fanned out while last_seq was still None
        self.repairing = False
        self.backlog: list[tuple[str, Frame]] = []  # (epoch, frame) held while repairing
        self.streams: dict[str, None] = {}  # ids of the answers streaming (a gauge's count)

    def add(self, member: Member) -> None:
        self.members[member] = None
        self.slow[member] = None

    def remove(self, member: Member) -> None:
        self.members.pop(member, None)
        self.slow.pop(member, None)

    # --- the fast lane ----------------------------------------------------------------

    def go_direct(self, seat: Seat) -> bool:
        """Put ``seat``'s member in a direct set if it is at exactly the room's position
        and has nothing held back; returns whether it is direct now."""
        if seat.direct:
            return True
        write = seat.write
        if (write is None or seat.floor is not None or self.last_seq is None
                or seat.last_seq != self.last_seq or seat.epoch != self.epoch
                or seat.member not in self.slow):
            return False
        del self.slow[seat.member]
        (self.binary_writers if seat.binary else self.text_writers)[write] = seat
        seat.direct = True
        return True

    def leave_direct(self, seat: Seat) -> None:
        """Back to ``deliver``, with the room's position written into the seat."""
        if not seat.direct:
            return
        writers = self.binary_writers if seat.binary else self.text_writers
        if seat.write is not None:
            writers.pop(seat.write, None)
        self._demoted(seat)

    def demote_all(self) -> None:
        """Every direct member back to ``deliver``, before the room's position jumps."""
        for writers in (self.text_writers, self.binary_writers):
            demoted = list(writers.values())
            writers.clear()
            for seat in demoted:
                self._demoted(seat)

    def _demoted(self, seat: Seat) -> None:
        seat.direct = False
        if self.epoch is not None and self.last_seq is not None:
            seat.epoch, seat.last_seq = self.epoch, self.last_seq
        if seat.member in self.members:
            self.slow[seat.member] = None

    # --- delivery ---------------------------------------------------------------------

    def history_lost(self, why: str) -> None:
        """Every member resyncs; the room's position is unknown until one has read."""
        log.warning("room %s: %s; members resync", self.chat_id, why)
        COUNTS.history_lost += 1
        COUNTS.resyncs += len(self.members)
        self.demote_all()
        self.epoch, self.last_seq, self.unread_max = None, None, 0
        for member in list(self.members):
            member.resync(self.chat_id)

    def fan_out(self, frame: Frame) -> None:
        counts = COUNTS  # counted once per frame, by the size of each set: never per member
        counts.fanouts += 1
        if frame.stream is not None:
            self.streams[frame.stream[0]] = None
        elif self.streams:
            self._streams_settled(frame)
        if frame.is_deleted:  # every member must act on it: take them all off the fast lane
            self.demote_all()
        if self.text_writers:
            _write_all(self.text_writers, frame.wire_text)
        if self.binary_writers:
            _write_all(self.binary_writers, frame.wire_binary)
        if self.slow:
            counts.handed += len(self.slow)
            chat_id = self.chat_id
            for member in list(self.slow):
                member.deliver(chat_id, frame)

    def fan_out_signal(self, frame: Frame, skip: str, version: int) -> None:
        """A ``presence`` frame (its ``version``) or a ``typing`` one (not to the connection
        ``skip``): each member decides (a stale list, a buffering member, the typist).
        Rare and coalesced, so every member is called; the fan-out of every other frame
        pays nothing for it."""
        COUNTS.fanouts += 1
        COUNTS.handed += len(self.members)
        chat_id = self.chat_id
        for member in list(self.members):
            member.deliver_signal(chat_id, frame, skip, version)

    def remove_user(self, user_id: str, frame: Frame) -> None:
        """A member removed from the conversation (lua/members.lua): each of this room's
        members decides whether it is theirs. Rare, so every member is called."""
        COUNTS.fanouts += 1
        chat_id = self.chat_id
        for member in list(self.members):
            member.removed(chat_id, user_id, frame)

    def _streams_settled(self, frame: Frame) -> None:
        """An answer stops streaming with the frame that names it (its commit, a partial
        commit at turn_end, ``stream_discarded``), or when the turn ends or the room goes."""
        if frame.is_deleted or frame.json.startswith(b'{"type":"turn_end"'):
            self.streams.clear()
            return
        for stream_id in [s for s in self.streams if s.encode() in frame.json]:
            del self.streams[stream_id]
            if frame.is_discard:
                COUNTS.discarded += 1


def _write_all(writers: dict[Write, Seat], data: bytes) -> None:
    """``write(data)`` for every writer: the whole per-recipient cost of the fast lane
    (counted once, by the size of the set); held while corked (:mod:`.transport.cork`).

    Iterates over a snapshot: a write can pause its transport, which takes that member out
    of the set at once. A transport that died without telling us yet raises; it is dropped
    (its session is closing) and the loop goes on with the next writer.
    """
    n = len(writers)
    COUNTS.direct += n
    COUNTS.bytes_out += n * len(data)
    if cork.CORK.active:  # several frames are going out: held, then one write per socket
        cork.hold_all(tuple(writers), data)
        return
    pending = iter(tuple(writers))
    while True:
        try:
            for write in pending:
                write(data)
            return
        except (RuntimeError, OSError):
            seat = writers.pop(write, None)  # the writer that just failed
            if seat is not None:
                seat.direct = False
            log.debug("dropped a direct writer of %r after a failed write", seat)
