"""The outbox: messages and cancels kept from the call until their reply, written in call
order and written again after a reconnect; and the connection's writer, which paces every
frame under the server's rate limit (:class:`Bucket`) and refuses frames over its size
limit."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import msgspec
from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed

from ... import protocol as p
from .errors import ConnectionLost, GatewayError, RequestError

DEFAULT_LIMITS = {"max_frame_bytes": 65536, "rate_limit": 50.0}
"""The server's limits, until its ``hello`` tells them."""

_encode = msgspec.json.Encoder().encode


class Outgoing:
    """A message or cancel: kept until its reply, re-sent after a reconnect."""

    __slots__ = ("chat_id", "frame", "future", "id", "retry_safe", "written")

    def __init__(self, rid: int, frame: dict[str, Any], retry_safe: bool,
                 future: asyncio.Future[p.Ack]) -> None:
        self.id = rid
        self.chat_id: str = frame["chat_id"]
        self.frame = frame
        self.retry_safe = retry_safe
        self.future = future
        self.written = False

    def outbound(self) -> Outbound:
        return _encode(self.frame).decode(), self


Outbound = tuple[str, Outgoing | None]
"""A frame waiting in a connection's write queue: its text, and the outbox entry it carries
(None for subscribes, pings and the like)."""


class Outbox:
    """The messages and cancels not answered yet, in call order, by request id."""

    def __init__(self) -> None:
        self.entries: list[Outgoing] = []
        self.by_id: dict[int, Outgoing] = {}

    @property
    def pending(self) -> int:
        return sum(1 for entry in self.entries if not entry.future.done())

    def add(self, entry: Outgoing, limits: dict[str, Any]) -> None:
        """Keep ``entry`` until its future is done; raise :class:`RequestError` when its frame
        is over the server's size limit."""
        limit = int(limits["max_frame_bytes"])
        if len(_encode(entry.frame)) > limit:
            raise RequestError("frame_too_big", f"the frame is over {limit} bytes",
                               entry.chat_id)
        self.entries.append(entry)
        self.by_id[entry.id] = entry
        entry.future.add_done_callback(lambda _: self._forget(entry))

    def _forget(self, entry: Outgoing) -> None:
        self.by_id.pop(entry.id, None)
        with contextlib.suppress(ValueError):
            self.entries.remove(entry)

    def get(self, rid: Any) -> Outgoing | None:
        """The entry a reply with id ``rid`` answers, if any."""
        return self.by_id.get(rid) if isinstance(rid, int) else None

    def to_resend(self) -> list[Outgoing]:
        """On a new connection: the entries to write again, in order. A cancel already
        written is not repeated (it is not idempotent): it fails with :class:`ConnectionLost`."""
        resend: list[Outgoing] = []
        for entry in list(self.entries):
            if entry.future.done():
                continue
            if entry.written and not entry.retry_safe:
                entry.future.set_exception(ConnectionLost(
                    f"{entry.frame['type']} may or may not have reached the server"))
                continue
            resend.append(entry)
        return resend

    def fail_all(self, error: GatewayError) -> None:
        for entry in self.entries:
            if not entry.future.done():
                entry.future.set_exception(error)
        self.entries.clear()
        self.by_id.clear()


class Bucket:
    """Client-side pacing so the server's inbound rate limit is never hit."""

    def __init__(self, rate: float) -> None:
        self.rate = max(1.0, rate)
        self.tokens = self.rate
        self.stamp = time.monotonic()

    async def take(self) -> None:
        while True:
            now = time.monotonic()
            self.tokens = min(self.rate, self.tokens + (now - self.stamp) * self.rate)
            self.stamp = now
            if self.tokens >= 1:
                self.tokens -= 1
                return
            await asyncio.sleep((1 - self.tokens) / self.rate)


async def write_loop(ws: ClientConnection, queue: asyncio.Queue[Outbound],
                     limits: dict[str, Any]) -> None:
    """Write the connection's queued frames in order, paced, until the connection closes.
    An entry answered meanwhile is skipped; one over the size limit fails."""
    bucket = Bucket(float(limits.get("rate_limit", 50.0)))
    max_frame = int(limits.get("max_frame_bytes", 65536))
    try:
        while True:
            text, entry = await queue.get()
            if entry is not None:
                if entry.future.done():
                    continue
                if len(text.encode()) > max_frame:
                    entry.future.set_exception(RequestError(
                        "frame_too_big", f"the frame is over {max_frame} bytes",
                        entry.chat_id))
                    continue
            await bucket.take()
            if entry is not None:
                entry.written = True
            await ws.send(text)
    except ConnectionClosed:
        pass
