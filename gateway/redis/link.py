"""A connection to one Redis node read by a protocol of our own: hiredis parses every reply
a read brought, in one synchronous pass, with no await per reply.

redis-py's asyncio connection pays, on every round trip, for a pool checkout (a lock and a
timer), a health check, a timeout task for the write and an await and a timer per reply:
on the publish path that cost more than the round trip itself. redis-py still makes the
connection here (TCP or a unix socket, TLS, AUTH, SELECT: whatever the URL asks), and then
its transport is handed to a :class:`Link`, which owns it from then on.

Two kinds: :class:`PipelinedLink` carries the auto-pipeline's batches back to back, each
batch's replies handed to its sender by the read that completes it (in order: Redis answers
in order); the pub/sub reader subclasses :class:`Link` to take pushes a whole read at a time.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from typing import Any

import hiredis
import redis.asyncio as aioredis
from redis._parsers.base import BaseParser
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import InvalidResponse
from redis.exceptions import TimeoutError as RedisTimeoutError

_MORE = object()  # hiredis's "no complete reply yet", unlike any reply (RESP3 has False)

log = logging.getLogger("gateway.link")

# What a batch's sender is told: every reply (an error reply as its exception object), or
# the error that ended the connection first.
Then = Callable[[list[Any] | BaseException], None]


class Link(asyncio.Protocol):
    """Our end of a connection redis-py made: writes, and replies parsed a read at a time."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.transport: asyncio.Transport | None = None
        self._streams: tuple[Any, Any] | None = None
        self._reader = hiredis.Reader(protocolError=InvalidResponse,
                                      replyError=BaseParser.parse_error, notEnoughData=_MORE)
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def take_over(self, connection: aioredis.Connection) -> None:
        """Connect ``connection`` (redis-py does the handshake), then own its socket."""
        await connection.connect()
        writer = connection._writer  # redis-py keeps its stream there
        assert writer is not None
        transport: Any = writer.transport
        # redis-py read every reply of its handshake: nothing is left in its buffer. It must
        # not close or read the socket again; the link closes it. The streams are kept: a
        # StreamWriter closes its transport when it is collected.
        self._streams = (connection._reader, writer)
        connection._reader = connection._writer = None
        self.transport = transport
        transport.set_protocol(self)

    @property
    def open(self) -> bool:
        return not self.closed.done()

    def write(self, data: bytes) -> None:
        if self.closed.done() or self.transport is None:
            raise RedisConnectionError(f"Connection to {self.name} is closed")
        self.transport.write(data)

    def close(self, error: BaseException | None = None) -> None:
        """Close the connection; whatever waits on it gets ``error`` (default: closed)."""
        self._lost(error or RedisConnectionError(f"Connection to {self.name} closed"))
        if self.transport is not None:
            self.transport.close()

    # --- asyncio.Protocol ----------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        reader = self._reader
        reader.feed(data)
        replies = []
        try:
            while (reply := reader.gets()) is not _MORE:
                replies.append(reply)
        except InvalidResponse as exc:  # the stream is garbage from here on
            if replies:
                self.on_replies(replies)
            self.close(RedisConnectionError(f"Protocol error from {self.name}: {exc}"))
            return
        if replies:
            self.on_replies(replies)

    def eof_received(self) -> bool | None:
        return None  # close the transport: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost(RedisConnectionError(
            f"Error while reading from {self.name}: {exc or 'connection closed by server'}"))

    # --- for subclasses ------------------------------------------------------------------

    def on_replies(self, replies: list[Any]) -> None:
        """Every complete reply one read brought, in order."""
        raise NotImplementedError

    def _lost(self, error: BaseException) -> None:
        if not self.closed.done():
            self.closed.set_exception(error)
            self.closed.exception()  # retrieved: a link nobody waits on is no error


class _Batch:
    __slots__ = ("count", "replies", "sent_at", "then")

    def __init__(self, then: Then, count: int, sent_at: float) -> None:
        self.then = then
        self.count = count
        self.sent_at = sent_at
        self.replies: list[Any] = []

    def end(self, outcome: list[Any] | BaseException) -> None:
        try:
            self.then(outcome)
        except Exception:  # a sender's bug must not cost the batches after it their replies
            log.exception("a batch's callback failed")


class PipelinedLink(Link):
    """Batches of commands written back to back on one connection; each batch's caller
    gets its replies (an error reply as its exception object, in its place).

    A reply timeout without a timer per batch: one watchdog looks at the oldest batch
    still unanswered, and a batch older than ``timeout`` fails the connection, and with it
    every batch in flight (as a timed-out read did with redis-py).
    """

    def __init__(self, name: str, timeout: float | None) -> None:
        super().__init__(name)
        self._loop = asyncio.get_running_loop()
        self._timeout = timeout
        self._batches: deque[_Batch] = deque()
        self._watchdog: asyncio.TimerHandle | None = None

    def send(self, packed: bytes, count: int, then: Then) -> None:
        """Send ``count`` packed commands; ``then`` gets their replies from the very read
        that completes them (a loop turn sooner than a future's callback would), or the
        error that ends the connection first."""
        self.write(packed)
        loop = self._loop
        batch = _Batch(then, count, loop.time())
        self._batches.append(batch)
        if self._watchdog is None and self._timeout:
            self._watchdog = loop.call_at(batch.sent_at + self._timeout, self._watch)

    def request(self, packed: bytes, count: int) -> asyncio.Future[list[Any]]:
        """:meth:`send`, for a caller that awaits the replies."""
        future: asyncio.Future[list[Any]] = self._loop.create_future()

        def then(outcome: list[Any] | BaseException) -> None:
            if future.done():  # its caller went away
                return
            if isinstance(outcome, BaseException):
                future.set_exception(outcome)
            else:
                future.set_result(outcome)

        self.send(packed, count, then)
        return future

    def on_replies(self, replies: list[Any]) -> None:
        for reply in replies:
            # Looked up per reply: a callback run below may close the link, which swaps in
            # a fresh deque and ends every batch of the old one; those must not get replies.
            batches = self._batches
            if not batches:
                self.close(RedisConnectionError(f"Unexpected reply from {self.name}"))
                return
            batch = batches[0]
            batch.replies.append(reply)
            if len(batch.replies) == batch.count:
                batches.popleft()
                batch.end(batch.replies)

    def _watch(self) -> None:
        self._watchdog = None
        if not self._batches or self.closed.done() or not self._timeout:
            return
        due = self._batches[0].sent_at + self._timeout
        if self._loop.time() >= due:
            self.close(RedisTimeoutError(f"Timeout reading from {self.name}"))
        else:
            self._watchdog = self._loop.call_at(due, self._watch)

    def _lost(self, error: BaseException) -> None:
        super()._lost(error)
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        batches, self._batches = self._batches, deque()
        for batch in batches:
            batch.end(error)
