"""The item queue: what was received and not consumed yet, per chat in arrival order, and the
last conversation feed frames; read through :class:`ItemIterator` iterators. Each item is
consumed once, by whichever iterator reads it."""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from .items import AnyItem, ChatItem, Ended, Signal

T = TypeVar("T")


class ItemQueue:
    """Received items per chat, with a global arrival order, and the conversation feed."""

    def __init__(self, feed_max: int) -> None:
        self.chats: dict[str, deque[tuple[int, AnyItem]]] = {}
        self.feed: deque[dict[str, Any]] = deque(maxlen=feed_max)
        self.signals: deque[Signal] = deque(maxlen=feed_max)
        self._order = itertools.count()
        self._waiters: list[asyncio.Future[None]] = []
        self.done = False
        self.error: BaseException | None = None

    def put(self, chat_id: str, item: AnyItem) -> None:
        self.chats.setdefault(chat_id, deque()).append((next(self._order), item))
        self._wake()

    def put_feed(self, frame: dict[str, Any]) -> None:
        self.feed.append(frame)
        self._wake()

    def put_signal(self, signal: Signal) -> None:
        self.signals.append(signal)
        self._wake()

    def finish(self, error: BaseException | None) -> None:
        if not self.done:
            self.done, self.error = True, error
        self._wake()

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def wait(self) -> None:
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        finally:
            if waiter in self._waiters:
                self._waiters.remove(waiter)

    def end(self) -> None:
        """Raise what an exhausted iterator raises once the client is done."""
        if self.error is not None:
            raise self.error
        raise StopAsyncIteration

    def pop_chat(self, chat_id: str) -> AnyItem | None:
        queue = self.chats.get(chat_id)
        if not queue:
            return None
        item = queue.popleft()[1]
        if not queue:
            del self.chats[chat_id]
        return item

    def drop_ended(self, chat_id: str) -> None:
        queue = self.chats.get(chat_id)
        if queue:
            kept = deque(entry for entry in queue if not isinstance(entry[1], Ended))
            if kept:
                self.chats[chat_id] = kept
            else:
                del self.chats[chat_id]

    def pop_any(self) -> AnyItem | None:
        if not self.chats:
            return None
        chat_id = min(self.chats, key=lambda c: self.chats[c][0][0])
        return self.pop_chat(chat_id)

    # --- the next item of an iterator, waiting for it -----------------------------------

    async def next_of_chat(self, chat_id: str) -> ChatItem:
        """The chat's next item; at its :class:`Ended` marker, stop (or raise its error)."""
        while True:
            item = self.pop_chat(chat_id)
            if isinstance(item, Ended):
                if item.error is not None:
                    raise item.error
                raise StopAsyncIteration
            if item is not None:
                return item
            if self.done:
                self.end()
            await self.wait()

    async def next_of_any(self) -> AnyItem:
        """The next item of any chat, in arrival order, :class:`Ended` markers included."""
        while True:
            item = self.pop_any()
            if item is not None:
                return item
            if self.done:
                self.end()
            await self.wait()

    async def next_of_signals(self) -> Signal:
        """The oldest presence change or typing kept."""
        while True:
            if self.signals:
                return self.signals.popleft()
            if self.done:
                self.end()
            await self.wait()

    async def next_of_feed(self) -> dict[str, Any]:
        """The oldest feed frame kept."""
        while True:
            if self.feed:
                return self.feed.popleft()
            if self.done:
                self.end()
            await self.wait()


class ItemIterator(AsyncIterator[T]):
    """An async iterator over what ``next_item`` returns, one awaited call per item."""

    def __init__(self, next_item: Callable[[], Awaitable[T]]) -> None:
        self._next = next_item

    def __aiter__(self) -> ItemIterator[T]:
        return self

    async def __anext__(self) -> T:
        return await self._next()
