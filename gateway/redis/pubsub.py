"""One pub/sub connection to one Redis node: the sharded channels this process reads there.

A :class:`ShardReader` owns a raw connection in pub/sub mode. It subscribes with
``SSUBSCRIBE`` (one command per slot, as a cluster requires, all in one write), hands each
``smessage`` push to ``deliver`` (the hub) and reports everything else to its
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
import math
from collections.abc import Callable
from typing import Any, Protocol

import hiredis
from redis.crc import key_slot
from redis.exceptions import ResponseError

from .backend import Node
from .counters import REDIS

log = logging.getLogger("gateway.pubsub")


Deliver = Callable[[bytes, bytes], None]  # (channel, message): a published message


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

    def __init__(self, node: Node, listener: Listener, deliver: Deliver, probe: float) -> None:
        self.node = node
        self._deliver = deliver
        self.wanted: dict[bytes, None] = {}
        self.connected = False
        self._listener = listener
        self._probe = probe
        self._connection: Any = None
        self._task: asyncio.Task[None] | None = None
        self._prober: asyncio.Task[None] | None = None
        self._last_heard = 0.0
        self._closing = False
        self._writes: set[asyncio.Future[None]] = set()

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
        await self._drop()

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
        in one write. Commands leave in the order asked: each write task writes at its first
        step (the connection has no send timeout to wrap it), and tasks start in order."""
        if not channels or not self.connected:
            return  # the next connect subscribes to everything wanted
        by_slot: dict[int, list[bytes]] = {}
        for channel in channels:
            by_slot.setdefault(key_slot(channel), []).append(channel)
        packed = b"".join(hiredis.pack_command((command, *group))  # type: ignore[arg-type]
                          for group in by_slot.values())
        self._spawn(self._write(packed))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def _write(self, packed: bytes) -> None:
        connection = self._connection
        try:
            await connection.send_packed_command(packed, check_health=False)
        except (ConnectionError, OSError) as exc:  # the reader notices and reconnects
            log.debug("pub/sub write to %s failed: %s", self.node.name, exc)
            await self._drop()

    # --- reading -------------------------------------------------------------------------

    async def _run(self) -> None:
        backoff = 0.05
        while not self._closing:
            try:
                self._connection = self.node.new_connection()
                await self._connection.connect()
                self._heard()
                self.connected = True
                backoff = 0.05
                self._listener.on_up(self)
                self._send("SSUBSCRIBE", list(self.wanted))
                await self._read()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                was_connected, self.connected = self.connected, False
                await self._drop()
                if self._closing:
                    return
                self._listener.on_down(self, exc)
                if was_connected:
                    REDIS.pubsub_reconnects += 1
                    log.warning("pub/sub connection to %s lost (%s); reconnecting",
                                self.node.name, exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 1.0)

    async def _read(self) -> None:
        listener, deliver = self._listener, self._deliver
        connection = self._connection
        while True:
            try:
                message = await connection.read_response(timeout=math.inf,
                                                         disconnect_on_error=False)
            except ResponseError as exc:  # an error reply to one of our commands
                self._heard()
                listener.on_refused(self, exc)
                continue
            self._heard()
            kind = message[0]
            if kind == b"smessage":
                deliver(message[1], message[2])
            elif kind == b"ssubscribe":
                listener.on_subscribed(self, message[1])
            elif kind == b"sunsubscribe" and message[1] in self.wanted:
                # Not asked for (we dropped it from ``wanted`` before asking): the slot moved.
                listener.on_dropped(self, message[1])

    async def _drop(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            with contextlib.suppress(Exception):
                await connection.disconnect()

    # --- liveness ------------------------------------------------------------------------

    def _heard(self) -> None:
        self._last_heard = asyncio.get_running_loop().time()

    async def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        probe = self._probe
        while True:
            await asyncio.sleep(probe / 2)
            if not self.connected or self._connection is None:
                continue
            silent = loop.time() - self._last_heard
            if silent > 2 * probe:
                log.warning("pub/sub connection to %s silent for %.1fs; dropping it",
                            self.node.name, silent)
                await self._drop()  # the reader's pending read fails: it reconnects
            elif silent > probe:
                self._spawn(self._write(hiredis.pack_command(("PING",))))
