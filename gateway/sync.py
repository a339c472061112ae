"""Resume: how a reader joins a room and goes live with no gap and no duplicate.

The one path for every reader, a WebSocket subscription or an SSE response:

1. **join** the room first: from then on every frame published reaches the reader live
   (it holds them back while it reads);
2. **read** the conversation after the reader's ``since``, atomically with its state and
   its open streams (:meth:`Hub.read <gateway.hub.Hub.read>`, shared by concurrent readers);
3. **check** the reader may see it (:func:`~gateway.auth.check_access`) and tell the room
   the position the read established;
4. **plan** the replay (:func:`~gateway.recovery.plan_replay`): every missed durable event,
   or none and ``recovered: false``;
5. **merge** the frames held back meanwhile through the reader's
   :class:`~gateway.rooms.Cursor`: durable ones after the read's last seq, deltas after the
   snapshot's positions. The overlap goes, nothing is missed.

The reader sends the replay, then the merged frames, then goes live.
"""

from __future__ import annotations

from typing import NamedTuple

from . import protocol as p
from .auth import Principal, check_access
from .frames import Frame
from .hub import Hub
from .recovery import plan_replay
from .redis.records import Meta, OpenStream
from .rooms import Cursor
from .streams import Floor


class CaughtUp(NamedTuple):
    """A reader's read of a room, planned."""

    meta: Meta
    recovered: bool  # the replay closes the gap exactly (or none was asked for)
    replay: list[Frame]  # the durable frames after ``since``, in order
    streams: list[OpenStream]  # every open stream, whole
    cursor: Cursor  # where the reader stands once the replay is sent
    children: list[str]  # the ids of its sub-conversations


async def catch_up(hub: Hub, chat_id: str, who: Principal, since: p.Since | None,
                   limit: int, joined: int, create_owner: str = "",
                   create_agent: str = "") -> CaughtUp:
    """Steps 2-4 for a reader that joined the room (``joined`` is the hub's mark then).

    Raises :class:`~gateway.errors.Rejected` (``not_found``, ``forbidden``) when the reader
    may not have it; with ``create_owner``, a conversation that does not exist is created,
    answered by ``create_agent`` (else the default agent).
    """
    after = since.seq if since is not None else None
    history = await hub.read(chat_id, after, limit + 1, joined, create_owner, create_agent)
    meta = check_access(who, history.meta, chat_id)
    room = hub.room(chat_id)
    if room is not None:
        hub.observe(room, meta.epoch, meta.seq)
    plan = plan_replay(since, meta.epoch, meta.seq, history.frames, limit)
    return CaughtUp(meta, plan.recovered, [Frame(json, seq) for seq, json in plan.frames],
                    history.streams, Cursor(meta.epoch, meta.seq, Floor(history.streams)),
                    history.children)


def merge(cursor: Cursor, held: list[Frame]) -> list[Frame]:
    """Step 5: the frames held back during the read that the reader does not have yet."""
    return [frame for frame in held if cursor.admit(frame)]
