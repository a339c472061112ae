"""Who is connected to a conversation now, in the conversation's own slot.

One sorted set per conversation (``c:{chat}:presence``, :mod:`.keys`) holds an entry per
connection (``u:<user>:<connection>``) and per agent worker running a turn there
(``a:<agent>:<worker>``), scored by the time it lapses unless renewed. Every change is one
call of ``lua/presence.lua``: it drops what lapsed, applies the change, moves the version
on if the list changed, and may publish the whole list on the room's channel as a
``presence`` frame. When a frame may go out is the caller's to decide (the gateway's
:mod:`gateway.presence` throttles them per conversation; an agent worker publishes its own
arrival and departure).
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import Enum
from typing import NamedTuple

import msgspec

from ..protocol import PresenceList
from .keys import presence_key, presence_version_key, room_channel
from .pipeline import AutoPipeline
from .scripts import load


class Publish(Enum):
    """Whether the call sends the list to the room."""

    NEVER = "0"
    IF_CHANGED = "1"
    ALWAYS = "2"


class Presence(NamedTuple):
    changed: bool  # this call changed the list (and moved its version on)
    frame: bytes  # the ``presence`` frame of the list now (JSON)

    @property
    def list(self) -> PresenceList:
        return _decode(self.frame)


_decode = msgspec.json.Decoder(PresenceList).decode


def user_entry(user_id: str, connection_id: str) -> str:
    """A user id never holds ``:`` (protocol.md), so the entry splits back cleanly."""
    return f"u:{user_id}:{connection_id}"


def agent_entry(agent: str, worker: str) -> str:
    return f"a:{agent}:{worker}"


class PresenceStore:
    """Calls of ``presence.lua`` through the auto-pipeline (routed by the chat's slot)."""

    def __init__(self, pipeline: AutoPipeline, ttl: float) -> None:
        self.pipeline = pipeline
        self.ttl_ms = max(1, int(ttl * 1000))
        self._script = load("presence.lua")

    async def change(self, chat_id: str, add: Iterable[str] = (), remove: Iterable[str] = (),
                     publish: Publish = Publish.IF_CHANGED) -> Presence:
        """Add (or renew) and remove entries, drop the lapsed ones; the list as it is now."""
        added = list(add)
        reply = await self.pipeline.evalsha(
            self._script, [presence_key(chat_id), presence_version_key(chat_id)],
            [self.ttl_ms, room_channel(chat_id), chat_id, publish.value, len(added), *added,
             *remove])
        changed, frame = reply
        return Presence(bool(changed), bytes(frame))

    async def read(self, chat_id: str) -> PresenceList:
        """The list now; lapsed entries are dropped, and the room told if there were any."""
        return (await self.change(chat_id)).list
