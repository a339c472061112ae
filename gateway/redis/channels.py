"""Which pub/sub connection reads which channel: subscription routing across nodes.

A gateway process reads each channel it needs (a room, a user's feed) once, on the node
that owns the channel's slot: one :class:`~.pubsub.ShardReader` per node (one in all on a
single server). :class:`Channels` keeps that routing right as it changes:

- channels asked for or given up within one loop turn leave together, one write per node:
  a burst of connects costs one round trip, not one each;
- a subscription waits for the server's confirmation (:meth:`Channels.confirmed`);
- when a slot moves (the server drops a subscription unasked, or answers ``MOVED``/``ASK``),
  or a connection dies, the channel is subscribed again where its slot lives now, and the
  receiver is told (``on_resubscribed``): frames published meanwhile never arrive, so it
  checks the store;
- Redis unreachable for longer than ``GATEWAY_REDIS_TIMEOUT`` is reported once per outage.

Messages themselves go from the readers straight to the receiver: nothing here is on the
path of a published frame.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable
from typing import Any, Protocol

from redis.exceptions import AskError, RedisError, ResponseError

from .backend import Backend, Node
from .counters import REDIS
from .pubsub import ShardReader

log = logging.getLogger("gateway.channels")


CONFIRM_TIMEOUT = 10.0  # seconds a joiner waits for its subscription's confirmation


async def wait_shared(future: asyncio.Future[None], timeout: float) -> None:
    """Wait for a confirmation other joiners share: ``TimeoutError`` after ``timeout``, and
    a cancelled waiter leaves it to the others. ``wait_for(shield(future))`` without the
    extra futures and callbacks: every connection of a reconnect storm waits twice."""
    if future.done():
        return future.result()
    waiter = future.get_loop().create_future()

    def wake(_: object = None) -> None:
        if not waiter.done():
            waiter.set_result(None)

    future.add_done_callback(wake)
    timer = future.get_loop().call_later(timeout, wake)
    try:
        await waiter
    finally:
        timer.cancel()
        future.remove_done_callback(wake)
    if not future.done():
        raise TimeoutError(f"no confirmation within {timeout:g} s")
    return future.result()


class Receiver(Protocol):
    """What the channels' user (the hub) hears."""

    def on_message(self, channel: bytes, data: bytes) -> None: ...

    def on_messages(self, messages: list[tuple[bytes, bytes]]) -> None:
        """Several messages that arrived together, in order."""

    def on_resubscribed(self, channel: bytes) -> None:
        """Subscribed again after a loss: frames published meanwhile never arrive."""


def _retrieved(future: asyncio.Future[None]) -> None:
    future.exception()  # marks it retrieved: the waiters got it, or nobody was left


class Channels:
    """This process's channel subscriptions, one reader per node that owns some."""

    def __init__(self, backend: Backend, receiver: Receiver,
                 on_unavailable: Callable[[], None] | None = None) -> None:
        self._backend = backend
        self._receiver = receiver
        self._on_unavailable = on_unavailable
        self._readers: dict[Node, ShardReader] = {}
        self._wanted: set[bytes] = set()
        self._owner: dict[bytes, ShardReader] = {}  # channel -> the reader subscribing it
        self._lost: set[bytes] = set()  # channels to check against the store once confirmed
        self._confirm: dict[bytes, asyncio.Future[None]] = {}
        self._subscribing: dict[bytes, None] = {}
        self._unsubscribing: dict[bytes, None] = {}
        self._flush_scheduled = False
        self._rerouting = 0  # reroutes under way (each reader's loss may start one)
        self._down_since: float | None = None
        self._up = asyncio.Event()  # set once every reader has connected
        self._tasks: set[asyncio.Task[Any]] = set()

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
                node, self, self._receiver.on_message, self._receiver.on_messages,
                probe=self._backend.settings.redis_timeout)
            reader.start()
        return reader

    # --- what to read -----------------------------------------------------------------

    def subscribe(self, channel: bytes) -> None:
        """Read ``channel`` from the next loop turn on; :meth:`confirmed` waits for it."""
        self._wanted.add(channel)
        future = self._confirm.get(channel)
        if future is None or (future.done() and future.exception() is not None):
            self._confirm[channel] = asyncio.get_running_loop().create_future()
        self._unsubscribing.pop(channel, None)
        self._subscribing[channel] = None
        self._schedule_flush()

    def unsubscribe(self, channel: bytes) -> None:
        self._wanted.discard(channel)
        self._confirm.pop(channel, None)
        self._subscribing.pop(channel, None)
        self._unsubscribing[channel] = None
        self._schedule_flush()

    def pending(self, channel: bytes) -> asyncio.Future[None] | None:
        """The confirmation still awaited for ``channel``, or None once it is read."""
        future = self._confirm.get(channel)
        return None if future is None or future.done() else future

    async def confirmed(self, channel: bytes) -> None:
        future = self.pending(channel)
        if future is not None:
            await wait_shared(future, CONFIRM_TIMEOUT)

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        subscribe, self._subscribing = list(self._subscribing), {}
        # Someone may have asked for it again since the leave was asked for.
        unsubscribe = [c for c in self._unsubscribing if c not in self._wanted]
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
            self._lost.discard(channel)
            self._receiver.on_resubscribed(channel)

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

    def recheck(self, channel: bytes) -> None:
        """Checking after a resubscribe failed: check again once the routing is fresh."""
        self._lost.add(channel)
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
                    REDIS.pubsub_reroutes += 1
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
