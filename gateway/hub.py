"""This process's rooms: sharded pub/sub, each frame encoded once, gap repair.

Every published event reaches each gateway process once, over one pub/sub connection per
Redis node that owns a channel this process reads (one in all on a single server; see
:mod:`~gateway.pubsub`). The hub turns it into a :class:`Frame` (the JSON bytes as stored; the
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
the missing range from the stream and delivers it first. Members never see a hole. After
any resubscribe (a reconnect, a slot that moved to another node) the room checks the
store the same way, and a history that went backwards makes every member resync.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable
from typing import Any, Protocol

import msgspec
from redis.exceptions import AskError, RedisError, ResponseError

from .redis.backend import Backend, Node
from .redis.envelope import unpack
from .redis.keys import feed_channel, room_channel
from .redis.pubsub import ShardReader
from .redis.records import History
from .redis.store import Store
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
    """Owns every room and feed of this process and the pub/sub readers that feed them."""

    def __init__(self, backend: Backend, store: Store,
                 on_unavailable: Callable[[], None] | None = None) -> None:
        self._backend = backend
        self._store = store
        self._on_unavailable = on_unavailable
        self._readers: dict[Node, ShardReader] = {}
        self._owner: dict[bytes, ShardReader] = {}  # channel -> the reader subscribing it
        self._lost: set[bytes] = set()  # channels to check against the store once confirmed
        self._rooms: dict[str, Room] = {}
        self._rooms_by_channel: dict[bytes, Room] = {}
        self._feeds: dict[bytes, dict[Member, None]] = {}
        self._confirm: dict[bytes, asyncio.Future[None]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._subscribing: dict[bytes, None] = {}
        self._unsubscribing: dict[bytes, None] = {}
        self._flush_scheduled = False
        self._rerouting = 0  # reroutes under way (each reader's loss may start one)
        self._down_since: float | None = None
        self._up = asyncio.Event()  # set once every reader has connected
        self._reads_started = 0
        # In-flight history reads: (chat, after, limit) -> (the read's number, its task).
        self._reads: dict[tuple[str, int | None, int, str],
                          tuple[int, asyncio.Task[History]]] = {}

    # --- lifecycle --------------------------------------------------------------------

    async def start(self) -> None:
        """Connect to every primary, so that readiness means live frames can arrive."""
        for node in self._backend.primaries():
            self._reader(node)
        await asyncio.wait_for(self._up.wait(), timeout=self._backend.settings.redis_timeout * 3)

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for reader in list(self._readers.values()):
            await reader.stop()

    @property
    def connected(self) -> bool:
        """Live frames are arriving: every reader that has channels (or is the only one)
        is connected, and none of our channels waits to move to another node (readyz)."""
        readers = self._readers.values()
        return bool(readers) and all(r.connected for r in readers) and not self._rerouting

    def _reader(self, node: Node) -> ShardReader:
        reader = self._readers.get(node)
        if reader is None:
            reader = self._readers[node] = ShardReader(
                node, self, probe=self._backend.settings.redis_timeout)
            reader.start()
        return reader

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

    # Channels joined or left within one loop turn go out together, one write per node: a
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
        leaving: dict[ShardReader, list[bytes]] = {}
        for channel in unsubscribe:
            self._lost.discard(channel)
            reader = self._owner.pop(channel, None)
            if reader is not None:
                leaving.setdefault(reader, []).append(channel)
        for reader, channels in leaving.items():
            reader.remove(channels)
        joining: dict[ShardReader, list[bytes]] = {}
        for channel in subscribe:
            try:
                reader = self._reader(self._backend.node(channel))
            except Exception as exc:  # no node serves the slot: joiners fail (1013)
                self._fail(channel, exc)
                continue
            previous = self._owner.get(channel)
            if previous is not None and previous is not reader:
                previous.remove([channel])
            self._owner[channel] = reader
            joining.setdefault(reader, []).append(channel)
        for reader, channels in joining.items():
            reader.add(channels)

    def _fail(self, channel: bytes, error: Exception) -> None:
        future = self._confirm.get(channel)
        if future is not None and not future.done():
            future.set_exception(ConnectionError(f"subscribe failed: {error}"))
            future.add_done_callback(_retrieved)

    async def _confirmed(self, channel: bytes) -> None:
        future = self._confirm.get(channel)
        if future is not None and not future.done():
            await asyncio.wait_for(asyncio.shield(future), timeout=10)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # --- what the readers report (pubsub.Listener) ------------------------------------

    def on_subscribed(self, reader: ShardReader, channel: bytes) -> None:
        if self._owner.get(channel) is not reader:
            return  # a stale confirmation from a node the channel has left
        future = self._confirm.pop(channel, None)
        if future is not None and not future.done():
            future.set_result(None)
        if channel in self._lost:
            # Frames published while we were not subscribed never arrive: catch up.
            self._lost.discard(channel)
            room = self._rooms_by_channel.get(channel)
            if room is not None:
                self._spawn(self._resync(room))

    def on_dropped(self, reader: ShardReader, channel: bytes) -> None:
        log.info("node %s dropped channel %r (its slot moved); resubscribing",
                 reader.node.name, channel)
        self._lost.add(channel)
        self._spawn(self._reroute(refresh=True))

    def on_refused(self, reader: ShardReader, error: ResponseError) -> None:
        log.info("node %s refused a subscribe: %s", reader.node.name, error)
        if isinstance(error, AskError):
            self._spawn(self._reroute(moved=error))
        else:
            self._spawn(self._reroute(refresh=True))

    def on_up(self, reader: ShardReader) -> None:
        self._down_since = None
        if self.connected:
            self._up.set()

    def on_down(self, reader: ShardReader, error: BaseException) -> None:
        # Everything it had is lost until it is subscribed again, here or elsewhere.
        for channel, owner in self._owner.items():
            if owner is reader:
                self._lost.add(channel)
        loop = asyncio.get_running_loop()
        if self._down_since is None:
            self._down_since = loop.time()
        elif (all(not r.connected for r in self._readers.values())
              and loop.time() - self._down_since > self._backend.settings.redis_timeout):
            self._down_since = math.inf  # once per outage
            log.warning("Redis unreachable for over %.1fs: sessions are told to come back",
                        self._backend.settings.redis_timeout)
            if self._on_unavailable is not None:
                self._on_unavailable()
        if self._backend.cluster:
            self._spawn(self._reroute(refresh=True))

    async def _reroute(self, refresh: bool = False, moved: AskError | None = None) -> None:
        """Move every channel whose slot another node owns now; drop readers left idle."""
        self._rerouting += 1
        try:
            if moved is not None:
                await self._backend.moved(moved)
            elif refresh:
                await self._backend.refresh()
            moving = [c for c, r in self._owner.items() if self._backend.node(c) is not r.node]
            moving += [c for c in self._lost if c in self._owner and c not in moving]
            for channel in moving:
                self._lost.add(channel)
                new = self._reader(self._backend.node(channel))
                old = self._owner[channel]
                if old is not new:
                    old.remove([channel])
                    self._owner[channel] = new
                new.add([channel])
            owners = set(self._owner.values())
            primaries = set(self._backend.primaries())
            for node, reader in list(self._readers.items()):
                if reader not in owners and node not in primaries:
                    del self._readers[node]
                    await reader.stop()
        except (RedisError, OSError) as exc:
            log.warning("rerouting subscriptions: %s", exc)
        finally:
            self._rerouting -= 1

    def on_message(self, channel: bytes, data: bytes) -> None:
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
        epoch, seq, stream, json = unpack(data)
        frame = Frame(json, seq, stream)
        if room.repairing:
            room.backlog.append((epoch, seq, frame))
            return
        self._advance(room, epoch, frame)

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
        """After a resubscribe: catch up, or notice that the history went backwards."""
        try:
            meta = await self._store.meta(room.chat_id)
        except (RedisError, ConnectionError, OSError) as exc:
            log.warning("room %s: checking after a resubscribe failed (%s); again soon",
                        room.chat_id, exc)
            self._lost.add(room.channel.encode())
            self._spawn(self._reroute(refresh=True))
            return
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
