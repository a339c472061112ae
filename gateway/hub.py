"""This process's rooms: one pub/sub connection, each frame encoded once, gap repair.

Every published event reaches each gateway process once, over a single Redis pub/sub
connection. The hub turns it into a :class:`Frame` (the JSON bytes as stored; the
MessagePack form and the complete WebSocket frames made on first use) and hands the same
object to every local member.

Fan-out has two lanes. A connection that is live in a room, at the room's position, with
nothing held back, sits in the room's *direct set*: the hub writes the prebuilt WebSocket
frame straight to its transport, one ``write`` call per member and nothing else. Every
other member (syncing, buffering, paused by backpressure, SSE, the ASGI fallback) gets
``deliver`` and decides for itself. A member leaves the direct set before anything that
would make a direct write wrong (a pause, an unsubscribe, a close) and takes the room's
position with it; it rejoins only at the room's current position.

Durable frames carry ``(epoch, seq)``. A room remembers the last seq it delivered; a frame
that jumps ahead means pub/sub lost something (a reconnect, a failover), so the room fetches
the missing range from the stream and delivers it first. Members never see a hole.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable
from typing import Any, Protocol

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from .store import History, Store, feed_channel, room_channel
from .transport.frames import binary_frame, text_frame

log = logging.getLogger("gateway.hub")

_json_decode = msgspec.json.decode
_msgpack_encode = msgspec.msgpack.encode


class Frame:
    """One server frame, encoded once per process whatever the number of recipients."""

    __slots__ = ("_msgpack", "_text", "_wire_binary", "_wire_text", "json", "seq", "stream")

    def __init__(self, json: bytes, seq: int | None = None,
                 stream: tuple[str, int] | None = None) -> None:
        self.json = json
        self.seq = seq
        self.stream = stream  # (stream id, position) of a streamed delta
        self._text: str | None = None
        self._msgpack: bytes | None = None
        self._wire_text: bytes | None = None
        self._wire_binary: bytes | None = None

    @property
    def text(self) -> str:
        if self._text is None:
            self._text = self.json.decode()
        return self._text

    @property
    def msgpack(self) -> bytes:
        if self._msgpack is None:
            self._msgpack = _msgpack_encode(_json_decode(self.json))
        return self._msgpack

    @property
    def wire_text(self) -> bytes:
        """The complete WebSocket text frame, for every JSON connection."""
        if self._wire_text is None:
            self._wire_text = text_frame(self.json)
        return self._wire_text

    @property
    def wire_binary(self) -> bytes:
        """The complete WebSocket binary frame, for every MessagePack connection."""
        if self._wire_binary is None:
            self._wire_binary = binary_frame(self.msgpack)
        return self._wire_binary

    @property
    def size(self) -> int:
        return len(self.json)

    @property
    def is_deleted(self) -> bool:
        return self.json.startswith(b'{"type":"deleted"')


Write = Callable[[bytes], None]


class Member(Protocol):
    """What the hub needs of a connection: non-blocking delivery."""

    def deliver(self, chat_id: str, frame: Frame) -> None: ...

    def deliver_feed(self, frame: Frame) -> None: ...

    def demote(self, chat_id: str) -> None:
        """Taken out of the room's direct set (its position is the room's, right now)."""

    def resync(self, chat_id: str) -> None:
        """The conversation's history was lost or forked (Redis restarted empty, FLUSHALL,
        a failover to a replica that lagged, a gap already trimmed): positions held so far
        mean nothing; resync from the store and tell the client (``recovered: false``)."""


class Room:
    """The local members of one conversation and the position this process has reached."""

    __slots__ = ("backlog", "binary_writers", "channel", "chat_id", "epoch", "last_seq",
                 "members", "repairing", "slow", "text_writers", "unread_max")

    def __init__(self, chat_id: str) -> None:
        self.chat_id = chat_id
        self.channel = room_channel(chat_id)
        self.members: dict[Member, None] = {}
        self.slow: dict[Member, None] = {}  # members outside the direct sets
        self.text_writers: dict[Write, Member] = {}  # the direct sets: transport.write
        self.binary_writers: dict[Write, Member] = {}
        self.epoch: str | None = None
        self.last_seq: int | None = None  # None until a member's first read tells us
        self.unread_max = 0  # highest seq fanned out while last_seq was still None
        self.repairing = False
        self.backlog: list[tuple[str, int | None, Frame]] = []

    def add(self, member: Member) -> None:
        self.members[member] = None
        self.slow[member] = None

    def remove(self, member: Member) -> None:
        self.members.pop(member, None)
        self.slow.pop(member, None)

    def go_direct(self, member: Member, write: Write, binary: bool) -> None:
        """Put a member that is live at exactly (``epoch``, ``last_seq``) in a direct set."""
        if member in self.slow:
            del self.slow[member]
            (self.binary_writers if binary else self.text_writers)[write] = member

    def leave_direct(self, member: Member, write: Write, binary: bool) -> None:
        if (self.binary_writers if binary else self.text_writers).pop(write, None) is not None:
            self.slow[member] = None

    def history_lost(self, why: str) -> None:
        """Every member resyncs; the room's position is unknown until one has read."""
        log.warning("room %s: %s; members resync", self.chat_id, why)
        self.demote_all()
        self.epoch, self.last_seq, self.unread_max = None, None, 0
        for member in list(self.members):
            member.resync(self.chat_id)

    def demote_all(self) -> None:
        """Every direct member back to ``deliver``, before the room's position jumps."""
        for writers in (self.text_writers, self.binary_writers):
            demoted = list(writers.values())
            writers.clear()
            for member in demoted:
                self.slow[member] = None
                member.demote(self.chat_id)

    def fan_out(self, frame: Frame) -> None:
        if frame.is_deleted:  # every member must act on it: take them all off the fast lane
            self.demote_all()
        if self.text_writers:
            _write_all(self.text_writers, frame.wire_text)
        if self.binary_writers:
            _write_all(self.binary_writers, frame.wire_binary)
        if self.slow:
            chat_id = self.chat_id
            for member in list(self.slow):
                member.deliver(chat_id, frame)


def _retrieved(future: asyncio.Future[None]) -> None:
    future.exception()  # marks it retrieved: the waiters got it, or nobody was left


def _write_all(writers: dict[Write, Member], data: bytes) -> None:
    """``write(data)`` for every writer: the whole per-recipient cost of the fast lane.

    Iterates over a snapshot: a write can pause its transport, which takes that member out
    of the set at once. A transport that died without telling us yet raises; it is dropped
    and the loop goes on with the next writer.
    """
    pending = iter(tuple(writers))
    while True:
        try:
            for write in pending:
                write(data)
            return
        except (RuntimeError, OSError):
            member = writers.pop(write, None)  # the writer that just failed
            log.debug("dropped a direct writer of %r after a failed write", member)


class Hub:
    """Owns the pub/sub connection and every room and feed of this process."""

    def __init__(self, redis: aioredis.Redis, store: Store) -> None:
        self._redis = redis
        self._store = store
        self._pubsub = redis.pubsub()
        self._rooms: dict[str, Room] = {}
        self._rooms_by_channel: dict[bytes, Room] = {}
        self._feeds: dict[bytes, dict[Member, None]] = {}
        self._confirm: dict[bytes, asyncio.Future[None]] = {}
        self._task: asyncio.Task[None] | None = None
        self._control = f"gateway:hub:{os.getpid()}:{id(self)}".encode()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._subscribing: dict[bytes, None] = {}
        self._unsubscribing: dict[bytes, None] = {}
        self._flush_scheduled = False
        # False while the pub/sub connection is down: live frames are not arriving (readyz).
        self.connected = False
        self._pubsub_order = asyncio.Lock()
        self._reads_started = 0
        # In-flight history reads: (chat, after, limit) -> (the read's number, its task).
        self._reads: dict[tuple[str, int | None, int, str],
                          tuple[int, asyncio.Task[History]]] = {}

    # --- lifecycle --------------------------------------------------------------------

    async def start(self) -> None:
        # A permanent subscription keeps the connection in pub/sub mode with no rooms.
        self._confirm[self._control] = asyncio.get_running_loop().create_future()
        await self._pubsub.subscribe(self._control)
        assert self._pubsub.connection is not None
        self._pubsub.connection.register_connect_callback(self._on_connect)
        self._task = asyncio.create_task(self._run(), name="hub-reader")
        await self._confirmed(self._control)
        self.connected = True

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for task in list(self._tasks):
            task.cancel()
        with contextlib.suppress(Exception):
            await self._pubsub.aclose()

    # --- rooms ------------------------------------------------------------------------

    def room(self, chat_id: str) -> Room | None:
        return self._rooms.get(chat_id)

    async def join(self, chat_id: str, member: Member) -> Room:
        """Add ``member``; returns once this process receives the room's live frames."""
        room = self._rooms.get(chat_id)
        if room is None:
            room = Room(chat_id)
            self._rooms[chat_id] = room
            channel = room.channel.encode()
            self._rooms_by_channel[channel] = room
            self._subscribe(channel)
        room.add(member)
        await self._confirmed(room.channel.encode())
        return room

    def leave(self, chat_id: str, member: Member) -> None:
        room = self._rooms.get(chat_id)
        if room is None:
            return
        room.remove(member)
        if not room.members:
            del self._rooms[chat_id]
            channel = room.channel.encode()
            del self._rooms_by_channel[channel]
            self._confirm.pop(channel, None)
            self._unsubscribe(channel)

    def mark(self) -> int:
        """Call once joined: reads numbered above the mark started after the join."""
        return self._reads_started

    async def read(self, chat_id: str, after: int | None, limit: int, joined: int,
                   create_owner: str = "") -> History:
        """The store's atomic read, shared by concurrent joiners of the same room asking
        from the same position (a reconnect storm after a deploy, a network blip).

        A joiner may only share a read that started after it joined (``joined`` is its
        :meth:`mark`): frames published before that read are in it, and frames published
        after it reach the joiner live, so the merge by seq stays gapless.
        """
        key = (chat_id, after, limit, create_owner)
        shared = self._reads.get(key)
        if shared is not None and shared[0] > joined:
            return await asyncio.shield(shared[1])
        self._reads_started += 1
        number = self._reads_started
        task = asyncio.ensure_future(self._store.read(chat_id, after, limit, create_owner))
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
            self._subscribe(channel)
        members[member] = None
        future = self._confirm.get(channel)
        return None if future is None or future.done() else future

    def leave_feed(self, user_id: str, member: Member) -> None:
        channel = feed_channel(user_id).encode()
        members = self._feeds.get(channel)
        if members is None:
            return
        members.pop(member, None)
        if not members:
            del self._feeds[channel]
            self._confirm.pop(channel, None)
            self._unsubscribe(channel)

    # --- pub/sub plumbing -------------------------------------------------------------

    # Channels joined or left within one loop turn go out as one SUBSCRIBE / UNSUBSCRIBE: a
    # burst of connects costs one round trip, not one each.

    def _subscribe(self, channel: bytes) -> None:
        future = self._confirm.get(channel)
        if future is None or (future.done() and future.exception() is not None):
            self._confirm[channel] = asyncio.get_running_loop().create_future()
        self._unsubscribing.pop(channel, None)
        self._subscribing[channel] = None
        self._schedule_flush()

    def _unsubscribe(self, channel: bytes) -> None:
        self._subscribing.pop(channel, None)
        self._unsubscribing[channel] = None
        self._schedule_flush()

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        subscribe, self._subscribing = list(self._subscribing), {}
        # Someone may have joined again since the leave was asked for.
        unsubscribe = [c for c in self._unsubscribing
                       if c not in self._rooms_by_channel and c not in self._feeds]
        self._unsubscribing = {}
        if unsubscribe:
            self._spawn(self._send_unsubscribe(unsubscribe))
        if subscribe:
            self._spawn(self._send_subscribe(subscribe))

    # The lock keeps the commands in the order they were asked for (its waiters are FIFO):
    # an UNSUBSCRIBE must never overtake the SUBSCRIBE of a room joined again after it.

    async def _send_subscribe(self, channels: list[bytes]) -> None:
        try:
            async with self._pubsub_order:
                await self._pubsub.subscribe(*channels)
        except (RedisError, ConnectionError, OSError) as exc:
            # Whoever waits for these channels fails (their sessions close with 1013); the
            # next join of an abandoned channel subscribes anew.
            for channel in channels:
                future = self._confirm.get(channel)
                if future is not None and not future.done():
                    future.set_exception(ConnectionError(f"subscribe failed: {exc}"))
                    future.add_done_callback(_retrieved)

    async def _send_unsubscribe(self, channels: list[bytes]) -> None:
        with contextlib.suppress(RedisError, ConnectionError, OSError):
            async with self._pubsub_order:
                await self._pubsub.unsubscribe(*channels)

    async def _confirmed(self, channel: bytes) -> None:
        future = self._confirm.get(channel)
        if future is not None and not future.done():
            await asyncio.wait_for(asyncio.shield(future), timeout=10)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self) -> None:
        while True:
            try:
                if self._pubsub.connection is None or not self._pubsub.connection.is_connected:
                    await self._pubsub.connect()  # its callback resubscribes every channel
                self.connected = True
                while True:
                    message = await self._pubsub.parse_response(block=True)
                    if message is None:
                        continue
                    if message[0] == b"message":
                        self._dispatch(message[1], message[2])
                    else:  # subscribe confirmations: let redis-py keep its own books too
                        await self._pubsub.handle_message(message)
                        if message[0] == b"subscribe":  # no future left: confirmed
                            future = self._confirm.pop(message[1], None)
                            if future is not None and not future.done():
                                future.set_result(None)
            except asyncio.CancelledError:
                raise
            except (RedisError, ConnectionError, OSError) as exc:
                self.connected = False
                log.warning("pub/sub connection lost (%s); reconnecting", exc)
                with contextlib.suppress(Exception):
                    await self._pubsub.connection.disconnect()  # type: ignore[union-attr,attr-defined]
                await asyncio.sleep(0.5)

    async def _on_connect(self, connection: Any) -> None:
        """Runs on every (re)connect: frames published while we were away never arrive."""
        for room in list(self._rooms.values()):
            self._spawn(self._resync(room))

    def _dispatch(self, channel: bytes, data: bytes) -> None:
        room = self._rooms_by_channel.get(channel)
        if room is not None:
            self._on_room_message(room, data)
            return
        members = self._feeds.get(channel)
        if members:
            frame = Frame(data)
            for member in list(members):
                member.deliver_feed(frame)

    def _on_room_message(self, room: Room, data: bytes) -> None:
        # "<epoch>|<seq>|<stream id>:<pos>|<frame>", the parts that do not apply empty.
        epoch, seq_text, stream, json = data.split(b"|", 3)
        seq = int(seq_text) if seq_text else None
        position = None
        if stream:
            stream_id, _, pos = stream.rpartition(b":")
            position = (stream_id.decode(), int(pos))
        frame = Frame(json, seq, position)
        if room.repairing:
            room.backlog.append((epoch.decode(), seq, frame))
            return
        self._advance(room, epoch.decode() if seq is not None else "", frame)

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
            room.repairing = True
            room.backlog.append((epoch, seq, frame))
            self._spawn(self._repair(room))
            return
        room.last_seq = seq
        room.fan_out(frame)

    async def _repair(self, room: Room) -> None:
        """Deliver the durable frames pub/sub skipped, then the frames held meanwhile."""
        try:
            start = room.last_seq or 0
            end = room.backlog[0][1] if room.backlog else None
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
                room.history_lost(f"seqs {room.last_seq + 1}..{target} are gone from the stream")
        except (RedisError, ConnectionError, OSError):
            log.exception("room %s: gap repair failed", room.chat_id)
        finally:
            room.repairing = False
            backlog, room.backlog = room.backlog, []
            for epoch, _seq, frame in backlog:
                if room.repairing:
                    room.backlog.append((epoch, frame.seq, frame))
                else:
                    self._advance(room, epoch, frame)

    async def _resync(self, room: Room) -> None:
        """After a reconnect: catch up, or notice that the history went backwards."""
        meta = await self._store.meta(room.chat_id)
        if room.last_seq is None or room.repairing or self._rooms.get(room.chat_id) is not room:
            return
        if meta is None or meta.epoch != room.epoch:
            room.history_lost("its history is gone or was replaced")
        elif meta.seq < room.last_seq:
            # The same epoch, yet behind what was delivered (a failover to a replica that
            # lagged): one seq would name two events. A new epoch tells every client.
            await self._store.rotate_epoch(room.chat_id, meta.epoch)
            room.history_lost(f"history went back from {room.last_seq} to {meta.seq}; "
                              "new epoch")
        elif meta.seq > room.last_seq:
            room.repairing = True
            self._spawn(self._repair(room))
