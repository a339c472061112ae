"""One pub/sub connection to one Redis node: the sharded channels this process reads there.

A :class:`ShardReader` owns a raw connection in pub/sub mode, read by a
:class:`~.link.Link`: every push a read brought is parsed in one pass. It subscribes with
``SSUBSCRIBE`` (one command per slot, as a cluster requires, all in one write), hands each
``smessage`` push to ``deliver`` (the hub), several that came in one read to
``deliver_many`` together (so frames for one socket can leave in one write), and reports
everything else to its
:class:`Listener` (:mod:`.channels`), which decides what it means: a confirmation, a
subscription the server dropped unasked (a slot moved away, a failover), a ``MOVED`` reply,
a lost connection.

Nothing here waits on a reply with a timeout: a pub/sub connection is silent when nothing
is published. Instead a prober sends ``PING`` after ``probe`` seconds of silence and drops
the connection when nothing at all comes back within ``probe`` more; a frozen server or a
half-open TCP connection is noticed in at most twice that.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any, Protocol

import hiredis
from redis.crc import key_slot
from redis.exceptions import RedisError, ResponseError

from .backend import Node
from .counters import REDIS
from .link import Link

log = logging.getLogger("gateway.pubsub")


Deliver = Callable[[bytes, bytes], None]  # (channel, message): a published message
DeliverMany = Callable[[list[tuple[bytes, bytes]]], None]  # several, in order


class Listener(Protocol):
    def on_subscribed(self, reader: ShardReader, channel: bytes) -> None: ...

    def on_dropped(self, reader: ShardReader, channel: bytes) -> None:
        """The server ended a subscription we did not end (its slot is elsewhere now)."""

    def on_refused(self, reader: ShardReader, error: ResponseError) -> None:
        """A subscribe was refused (``MOVED``: this node does not own the slot)."""

    def on_up(self, reader: ShardReader) -> None: ...

    def on_down(self, reader: ShardReader, error: BaseException) -> None: ...


class ShardReader:
    """Subscribes ``wanted`` on ``node`` and keeps doing so across reconnects."""

    def __init__(self, node: Node, listener: Listener, deliver: Deliver,
                 deliver_many: DeliverMany, probe: float) -> None:
        self.node = node
        self._deliver = deliver
        self._deliver_many = deliver_many
        self.wanted: dict[bytes, None] = {}
        self.connected = False
        self._listener = listener
        self._probe = probe
        self._link: _PubSubLink | None = None
        self._task: asyncio.Task[None] | None = None
        self._prober: asyncio.Task[None] | None = None
        self._last_heard = 0.0
        self._loop = asyncio.get_running_loop()  # looked up once: on 3.11 it calls getpid()
        self._closing = False

    def __repr__(self) -> str:
        return f"ShardReader({self.node.name}, {len(self.wanted)} channels)"

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"pubsub-{self.node.name}")
        self._prober = asyncio.create_task(self._watch(), name=f"probe-{self.node.name}")

    async def stop(self) -> None:
        self._closing = True
        for task in (self._task, self._prober):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._drop()

    # --- what to read --------------------------------------------------------------------

    def add(self, channels: list[bytes]) -> None:
        for channel in channels:
            self.wanted[channel] = None
        self._send("SSUBSCRIBE", channels)

    def remove(self, channels: list[bytes]) -> None:
        for channel in channels:
            self.wanted.pop(channel, None)
        self._send("SUNSUBSCRIBE", channels)

    def _send(self, command: str, channels: list[bytes]) -> None:
        """One command per slot (a cluster refuses channels of several slots in one), all
        in one write, made now: commands leave in the order asked."""
        if not channels or not self.connected:
            return  # the next connect subscribes to everything wanted
        by_slot: dict[int, list[bytes]] = {}
        for channel in channels:
            by_slot.setdefault(key_slot(channel), []).append(channel)
        self._write(b"".join(hiredis.pack_command((command, *group))  # type: ignore[arg-type]
                             for group in by_slot.values()))

    def _write(self, packed: bytes) -> None:
        link = self._link
        if link is None:
            return
        try:
            link.write(packed)
        except (ConnectionError, OSError, RedisError) as exc:  # the reader reconnects
            log.debug("pub/sub write to %s failed: %s", self.node.name, exc)
            self._drop()

    # --- reading -------------------------------------------------------------------------

    async def _run(self) -> None:
        backoff = 0.05
        while not self._closing:
            try:
                link = _PubSubLink(self)
                await link.take_over(self.node.new_connection())
                self._link = link
                self._heard()
                self.connected = True
                backoff = 0.05
                self._listener.on_up(self)
                self._send("SSUBSCRIBE", list(self.wanted))
                await link.closed  # the link reads: it raises once the connection is lost
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                was_connected, self.connected = self.connected, False
                self._drop()
                if self._closing:
                    return
                self._listener.on_down(self, exc)
                if was_connected:
                    REDIS.pubsub_reconnects += 1
                    log.warning("pub/sub connection to %s lost (%s); reconnecting",
                                self.node.name, exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 1.0)

    def on_replies(self, replies: list[Any]) -> None:
        """Every push one read brought, in order. Published messages go out together (one
        ``deliver_many``) between the other pushes, which the listener hears in place."""
        self._heard()
        listener = self._listener
        messages: list[tuple[bytes, bytes]] = []
        for message in replies:
            if isinstance(message, ResponseError):  # an error reply to one of our commands
                self._hand_out(messages)
                listener.on_refused(self, message)
                continue
            kind = message[0]
            if kind == b"smessage":
                messages.append((message[1], message[2]))
                continue
            self._hand_out(messages)
            if kind == b"ssubscribe":
                listener.on_subscribed(self, message[1])
            elif kind == b"sunsubscribe" and message[1] in self.wanted:
                # Not asked for (we dropped it from ``wanted`` before asking): the slot moved.
                listener.on_dropped(self, message[1])
        self._hand_out(messages)

    def _hand_out(self, messages: list[tuple[bytes, bytes]]) -> None:
        if len(messages) == 1:
            self._deliver(*messages[0])
        elif messages:
            self._deliver_many(messages)
        messages.clear()

    def _drop(self) -> None:
        link, self._link = self._link, None
        if link is not None:
            link.close()

    # --- liveness ------------------------------------------------------------------------

    def _heard(self) -> None:
        self._last_heard = self._loop.time()

    async def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        probe = self._probe
        while True:
            await asyncio.sleep(probe / 2)
            if not self.connected or self._link is None:
                continue
            silent = loop.time() - self._last_heard
            if silent > 2 * probe:
                log.warning("pub/sub connection to %s silent for %.1fs; dropping it",
                            self.node.name, silent)
                self._drop()  # the reader's wait on the link ends: it reconnects
            elif silent > probe:
                self._write(hiredis.pack_command(("PING",)))


class _PubSubLink(Link):
    """The link of one reader: what it reads goes to the reader."""

    def __init__(self, reader: ShardReader) -> None:
        super().__init__(reader.node.name)
        self._shard = reader

    def on_replies(self, replies: list[Any]) -> None:
        self._shard.on_replies(replies)
