"""This process's rooms and feeds: every published frame in, to each local member once.

Every published event reaches each gateway process once, over the pub/sub connection that
reads its channel (:mod:`~gateway.redis.channels` routes them). The hub unpacks it into a
:class:`~gateway.frames.Frame`, encoded once whatever the number of recipients, and hands
it to the room (:mod:`~gateway.rooms`), which fans it out.

Durable frames carry ``(epoch, seq)``. A room remembers the last seq it delivered; a frame
that jumps ahead means pub/sub lost something (a reconnect, a failover), so the hub fetches
the missing range from the store and delivers it first. Members never see a hole. After
any resubscribe the hub checks the store the same way, and a history that went backwards
makes every member resync.

Concurrent readers of one room from one position share one store read (:meth:`Hub.read`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from redis.exceptions import RedisError

from .frames import Frame
from .metrics import COUNTS
from .redis.backend import Backend
from .redis.channels import Channels
from .redis.envelope import signal_of, unpack
from .redis.keys import feed_channel
from .redis.records import History
from .redis.store import Store
from .rooms import Member, Room
from .transport.cork import corked

log = logging.getLogger("gateway.hub")


class Hub:
    """Owns every room and feed of this process; pub/sub feeds them through ``channels``."""

    def __init__(self, backend: Backend, store: Store,
                 on_unavailable: Callable[[], None] | None = None) -> None:
        self._store = store
        self.channels = Channels(backend, self, on_unavailable)
        self._rooms: dict[str, Room] = {}
        self._rooms_by_channel: dict[bytes, Room] = {}
        self._feeds: dict[bytes, dict[Member, None]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._reads_started = 0
        # In-flight history reads: (chat, after, limit, creator, agent) -> (its number, its task).
        self._reads: dict[tuple[str, int | None, int, str, str],
                          tuple[int, asyncio.Task[History]]] = {}

    async def start(self) -> None:
        await self.channels.start()

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await self.channels.stop()

    @property
    def connected(self) -> bool:
        return self.channels.connected

    def census(self) -> tuple[int, int, int]:
        """Rooms, their members and the answers streaming in them (``/metrics``)."""
        rooms = self._rooms.values()
        return (len(rooms), sum(len(r.members) for r in rooms),
                sum(len(r.streams) for r in rooms))

    # --- rooms ------------------------------------------------------------------------

    def room(self, chat_id: str) -> Room | None:
        return self._rooms.get(chat_id)

    async def join(self, chat_id: str, member: Member) -> Room:
        """Add ``member``; returns once this process receives the room's live frames."""
        room = self._rooms.get(chat_id)
        if room is None:
            room = self._rooms[chat_id] = Room(chat_id)
            self._rooms_by_channel[room.channel] = room
            self.channels.subscribe(room.channel)
        room.add(member)
        await self.channels.confirmed(room.channel)
        return room

    def leave(self, chat_id: str, member: Member) -> None:
        room = self._rooms.get(chat_id)
        if room is None:
            return
        room.remove(member)
        if not room.members:
            del self._rooms[chat_id]
            del self._rooms_by_channel[room.channel]
            self.channels.unsubscribe(room.channel)

    def mark(self) -> int:
        """Call once joined: reads numbered above the mark started after the join."""
        return self._reads_started

    async def read(self, chat_id: str, after: int | None, limit: int, joined: int,
                   create_owner: str = "", create_agent: str = "") -> History:
        """The store's atomic read, shared by concurrent joiners of the same room asking
        from the same position (a reconnect storm after a deploy, a network blip).

        A joiner may only share a read that started after it joined (``joined`` is its
        :meth:`mark`): frames published before that read are in it, and frames published
        after it reach the joiner live, so the merge by seq stays gapless.
        """
        key = (chat_id, after, limit, create_owner, create_agent)
        shared = self._reads.get(key)
        if shared is not None and shared[0] > joined:
            return await asyncio.shield(shared[1])
        self._reads_started += 1
        number = self._reads_started
        task = asyncio.ensure_future(self._store.read(chat_id, after, limit, create_owner,
                                                      create_agent))
        self._reads[key] = (number, task)

        def forget(_: object) -> None:
            if self._reads.get(key, (0,))[0] == number:
                del self._reads[key]

        task.add_done_callback(forget)
        return await asyncio.shield(task)

    def observe(self, room: Room, epoch: str, seq: int) -> None:
        """Record the position a member's read established, if the room has none yet.

        Frames fanned out before the first read count too: they may be newer than it.
        """
        if room.last_seq is None:
            room.epoch, room.last_seq = epoch, max(seq, room.unread_max)
        elif room.epoch != epoch:  # the others hold positions of another history
            room.history_lost("a read found another epoch")
            room.epoch, room.last_seq = epoch, seq

    # --- feeds ------------------------------------------------------------------------

    def join_feed(self, user_id: str, member: Member) -> asyncio.Future[None] | None:
        """Add ``member`` to the user's feed at once; returns the future that completes once
        this process receives the feed (None if it already does)."""
        channel = feed_channel(user_id).encode()
        members = self._feeds.get(channel)
        if members is None:
            members = self._feeds[channel] = {}
            self.channels.subscribe(channel)
        members[member] = None
        return self.channels.pending(channel)

    def leave_feed(self, user_id: str, member: Member) -> None:
        channel = feed_channel(user_id).encode()
        members = self._feeds.get(channel)
        if members is None:
            return
        members.pop(member, None)
        if not members:
            del self._feeds[channel]
            self.channels.unsubscribe(channel)

    # --- frames in (channels.Receiver) ------------------------------------------------

    def on_message(self, channel: bytes, data: bytes) -> None:
        room = self._rooms_by_channel.get(channel)
        if room is not None:
            epoch, seq, stream, json = unpack(data)
            frame = Frame(json, seq, stream)
            if seq is None and epoch:  # a `presence`, `typing` or `removed` (envelope.py)
                if epoch[0] == "-":
                    room.remove_user(epoch[1:], frame)
                else:
                    room.fan_out_signal(frame, *signal_of(epoch))
            elif room.repairing:
                room.backlog.append((epoch, frame))
            else:
                self._advance(room, epoch, frame)
            return
        members = self._feeds.get(channel)
        if members:
            frame = Frame(data)
            for member in list(members):
                member.deliver_feed(frame)

    def on_messages(self, messages: list[tuple[bytes, bytes]]) -> None:
        """Several messages from one read: every socket gets what they hold for it in one
        write (a client watching many rooms an agent streams into, a burst)."""
        with corked():
            for channel, data in messages:
                self.on_message(channel, data)

    def on_resubscribed(self, channel: bytes) -> None:
        room = self._rooms_by_channel.get(channel)
        if room is not None:
            self._spawn(self._recheck(room))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _advance(self, room: Room, epoch: str, frame: Frame) -> None:
        seq = frame.seq
        if seq is None:
            room.fan_out(frame)
            if frame.is_deleted:
                room.epoch, room.last_seq = None, 0
            return
        if room.last_seq is not None and epoch != room.epoch:
            # Recreated, or its history was lost: members resync before this frame.
            room.history_lost("a frame of another epoch arrived")
        if room.last_seq is None:  # no member has read yet: they merge by seq themselves
            room.unread_max = max(room.unread_max, seq)
            room.fan_out(frame)
            return
        if seq <= room.last_seq:
            return
        if seq > room.last_seq + 1:
            COUNTS.gap_repairs += 1
            room.repairing = True
            room.backlog.append((epoch, frame))
            self._spawn(self._repair(room))
            return
        room.last_seq = seq
        room.fan_out(frame)

    # --- gap repair -------------------------------------------------------------------

    async def _repair(self, room: Room) -> None:
        """Deliver the durable frames pub/sub skipped, then the frames held meanwhile."""
        try:
            start = room.last_seq or 0
            end = room.backlog[0][1].seq if room.backlog else None
            history = await self._store.read(room.chat_id, start, limit=100_000)
            meta = history.meta
            if meta is None or meta.epoch != room.epoch:
                room.history_lost("its history is gone or was replaced")
                return
            # Up to the first frame held back, or else up to the conversation's last seq.
            target = end - 1 if end is not None else meta.seq
            for seq, json in history.frames:
                if seq > target:
                    break
                if room.last_seq is not None and seq == room.last_seq + 1:
                    room.last_seq = seq
                    room.fan_out(Frame(json, seq))
            if room.last_seq is not None and room.last_seq < target:
                room.history_lost(f"seqs {room.last_seq + 1}..{target} are gone from the log")
        except (RedisError, ConnectionError, OSError):
            log.exception("room %s: gap repair failed", room.chat_id)
        finally:
            room.repairing = False
            backlog, room.backlog = room.backlog, []
            for epoch, frame in backlog:
                if room.repairing:
                    room.backlog.append((epoch, frame))
                else:
                    self._advance(room, epoch, frame)

    async def _recheck(self, room: Room) -> None:
        """After a resubscribe: catch up, or notice that the history went backwards."""
        # What the room had delivered before the read: the store held it then. Frames that
        # arrive while the read is in flight may pass the state it returns.
        delivered = room.last_seq
        try:
            meta = await self._store.meta(room.chat_id)
        except (RedisError, ConnectionError, OSError) as exc:
            log.warning("room %s: checking after a resubscribe failed (%s); again soon",
                        room.chat_id, exc)
            self.channels.recheck(room.channel)
            return
        if room.last_seq is None or room.repairing or self._rooms.get(room.chat_id) is not room:
            return
        if meta is None or meta.epoch != room.epoch:
            room.history_lost("its history is gone or was replaced")
        elif delivered is not None and meta.seq < delivered:
            # The same epoch, yet behind what was delivered (a failover to a replica that
            # lagged): one seq would name two events. A new epoch tells every client.
            await self._store.rotate_epoch(room.chat_id, meta.epoch)
            room.history_lost(f"history went back from {delivered} to {meta.seq}; "
                              "new epoch")
        elif meta.seq > room.last_seq:
            COUNTS.gap_repairs += 1
            room.repairing = True
            self._spawn(self._repair(room))
