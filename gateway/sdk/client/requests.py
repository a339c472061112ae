"""Request tracking: the request ids (one counter for every request, messages and cancels
included) and the requests that wait for their reply: ``subscribe`` (answered by
``subscribed``), ``unsubscribe``, ``leave`` and ``ping``. Messages and cancels wait for their
``ack`` in the outbox (:mod:`.outbox`)."""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from .errors import ConnectionLost, GatewayError
from .outbox import Outbound

_encode = msgspec.json.Encoder().encode


@dataclass(slots=True)
class Request:
    kind: Literal["subscribe", "unsubscribe", "leave", "ping", "typing", "refresh"]
    chat_id: str | None
    since: dict[str, Any] | None = None
    future: asyncio.Future[Any] | None = None


class Requests:
    """The ids, and the requests waiting for their reply by id."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self.waiting: dict[int, Request] = {}

    def next_id(self) -> int:
        return next(self._ids)

    def add(self, req: Request) -> int:
        """Register a request that is answered by its reply frame; returns its id."""
        rid = self.next_id()
        self.waiting[rid] = req
        return rid

    def pop(self, rid: Any) -> Request | None:
        return self.waiting.pop(rid, None) if isinstance(rid, int) else None

    async def call(self, queue: asyncio.Queue[Outbound], req: Request,
                   frame: dict[str, Any]) -> Any:
        """Queue ``frame`` for writing as the request ``req``; return its reply frame."""
        req.future = asyncio.get_running_loop().create_future()
        rid = self.add(req)
        frame["id"] = rid
        queue.put_nowait((_encode(frame).decode(), None))
        try:
            return await req.future
        finally:
            self.waiting.pop(rid, None)

    def answer(self, rid: Any, frame: dict[str, Any]) -> None:
        """An ``unsubscribed``, ``left`` or ``pong`` reply."""
        req = self.waiting.get(rid) if isinstance(rid, int) else None
        if req is not None and req.future is not None and not req.future.done():
            req.future.set_result(frame)

    def on_disconnect(self) -> None:
        """The connection is lost: a new one starts with nothing subscribed, so unsubscribe
        and leave are done; a ping failed; a subscribe is sent again (its callers wait on
        the chat)."""
        for rid, req in list(self.waiting.items()):
            if req.future is None or req.future.done():
                continue
            if req.kind in ("unsubscribe", "leave"):
                req.future.set_result(None)
            elif req.kind in ("ping", "typing"):
                req.future.set_exception(ConnectionLost("connection lost"))
            else:
                del self.waiting[rid]

    def fail_all(self, error: GatewayError) -> None:
        for req in self.waiting.values():
            if req.future is not None and not req.future.done():
                req.future.set_exception(error)
        self.waiting.clear()
