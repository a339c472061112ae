"""What the store writes and reads, typed: events to append, results, a conversation's state.

These are the values that cross between the gateway and its Lua scripts. How each one is
put into a script's arguments, or read out of its reply, is :mod:`.scripts`'s business.
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec


class OutEvent(msgspec.Struct, frozen=True, kw_only=True):
    """One event to append. ``data`` is a JSON object (the raw text for ``title``).

    The named fields below apply to some types only; the store's script completes those
    types where the conversation's state lives (``publish.lua`` documents each).
    """

    type: str
    data: bytes
    durable: bool = True
    preview: str = ""  # user_message: the conversation list's preview
    turn_id: str = ""  # turn_start: the new turn; turn_end, cancel_requested: the expected
    title_source: str = ""  # title: who set it ("user", "agent")
    attempt: str = ""  # a streamed delta or its commit: which run of the turn sent it
    fill: bool = False  # a commit without text: it takes the stream's text


class Published(msgspec.Struct, frozen=True):
    """What one publish did (``publish.lua``'s reply)."""

    epoch: str
    last_seq: int
    owner: str
    duplicate: bool
    ts: int
    seqs: list[int | None] = []  # one per event: its seq, or None for an ephemeral one
    turn_id: str | None = None  # the turn this batch started, or cancelled
    created: bool = False  # this batch created the conversation
    listed: bool = False  # the owner's conversation list and feed must hear of it
    feed: str | None = None  # the feed frame that tells them


class Meta(msgspec.Struct, frozen=True):
    """A conversation's state as stored in its meta hash."""

    owner: str
    epoch: str
    seq: int
    status: str
    title: str | None
    turn_id: str | None
    started_at: int | None
    goal: bytes | None
    preview: str | None
    created_at: int
    updated_at: int

    @classmethod
    def from_fields(cls, fields: Mapping[str, str]) -> Meta | None:
        """The state from the hash's fields (empty strings are unset); None without one."""
        if "epoch" not in fields:
            return None
        get = fields.get

        def text(name: str) -> str | None:
            return get(name) or None

        def number(name: str) -> int | None:
            value = get(name)
            return int(value) if value else None

        goal = get("goal")
        return cls(
            owner=fields["owner"],
            epoch=fields["epoch"],
            seq=int(fields["seq"]),
            status=fields["status"],
            title=text("title"),
            turn_id=text("turn_id"),
            started_at=number("started_at"),
            goal=goal.encode() if goal else None,
            preview=text("preview"),
            created_at=number("created_at") or 0,
            updated_at=number("updated_at") or number("created_at") or 0,
        )


class OpenStream(msgspec.Struct, frozen=True):
    """A streamed answer not yet committed: its text so far and its next position."""

    id: str
    type: str
    turn_id: str
    text: str
    pos: int


class History(msgspec.Struct, frozen=True):
    """A conversation's state, open streams and the durable frames after some seq, read
    atomically (``read.lua``'s reply)."""

    meta: Meta | None
    frames: list[tuple[int, bytes]]
    streams: list[OpenStream] = []
    created: bool = False
    feed: str | None = None  # when created: the feed frame that announces it
