"""Presence on one gateway process: its connections in each conversation, kept in Redis
with heartbeats, and the ``presence`` frames that tell the rooms, coalesced.

- **Join** (a subscribe) writes the connection's entry at once and returns the list with
  it, for ``subscribed.snapshot.presence``. **Leave** (unsubscribe, leave, close) is
  written with the next call for that conversation.
- **Frames.** Per conversation, this process sends at most one ``presence`` frame per
  ``GATEWAY_PRESENCE_WINDOW``: a change in a quiet conversation goes out at once, with
  the call that makes it; changes within the window after a frame are applied and then
  sent together when the window ends, as one frame with the whole list. A reconnect storm
  of N connections into one conversation costs N writes and at most one frame per window
  per process, whatever N.
- **Heartbeats.** Every third of ``GATEWAY_PRESENCE_TTL`` each conversation with entries
  here gets them renewed in one call, which also drops entries that lapsed (a killed
  gateway's) and, if it dropped some, tells the room. So a killed gateway's connections
  leave the list within 4/3 TTL plus the window.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Coroutine
from typing import Any

from redis.exceptions import RedisError

from .config import Settings
from .protocol import PresenceList
from .redis.presence import Presence as Listed
from .redis.presence import PresenceStore, Publish, user_entry

log = logging.getLogger("gateway.presence")


class _Local:
    """One conversation's presence on this process."""

    __slots__ = ("dirty", "entries", "gone", "last", "timer")

    def __init__(self) -> None:
        self.entries: set[str] = set()  # this process's connections in it
        self.gone: set[str] = set()  # connections that left, not written yet
        self.last = -math.inf  # loop time of the last call that could send a frame
        self.timer: asyncio.TimerHandle | None = None  # the end of the window, if awaited
        self.dirty = False  # a change was written that no frame has told yet


class Presence:
    """This process's presence entries and the throttle of its frames."""

    def __init__(self, store: PresenceStore, settings: Settings) -> None:
        self.store = store
        self.window = settings.presence_window
        self.renew_every = settings.presence_ttl / 3
        self._local: dict[str, _Local] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._renewer: asyncio.Task[None] | None = None
        self._stopped = False

    async def start(self) -> None:
        self._renewer = asyncio.create_task(self._run())

    async def stop(self) -> None:
        """Take every entry of this process out (a graceful stop: no one waits a TTL)."""
        self._stopped = True
        if self._renewer is not None:
            self._renewer.cancel()
        for local in self._local.values():
            if local.timer is not None:
                local.timer.cancel()
        calls = [self.store.change(chat_id, remove=local.entries | local.gone)
                 for chat_id, local in self._local.items() if local.entries or local.gone]
        self._local.clear()
        await asyncio.gather(*calls, return_exceptions=True)
        for task in list(self._tasks):
            task.cancel()

    # --- what sessions call ------------------------------------------------------------

    async def join(self, chat_id: str, user_id: str, connection_id: str) -> PresenceList:
        """The connection is in the conversation; the list now, with it."""
        entry = user_entry(user_id, connection_id)
        local = self._local.get(chat_id)
        if local is None:
            local = self._local[chat_id] = _Local()
        local.entries.add(entry)
        local.gone.discard(entry)
        return (await self._change(chat_id, local, [entry])).list

    def leave(self, chat_id: str, user_id: str, connection_id: str) -> None:
        local = self._local.get(chat_id)
        if local is None or self._stopped:
            return
        entry = user_entry(user_id, connection_id)
        local.entries.discard(entry)
        local.gone.add(entry)
        if self._take_slot(local):
            self._spawn(self._flush(chat_id, local))
        else:
            self._schedule(chat_id, local)

    async def read(self, chat_id: str) -> PresenceList:
        """The list now (lapsed entries dropped, within the throttle)."""
        local = self._local.get(chat_id)
        if local is None:
            local = self._local[chat_id] = _Local()
        return (await self._change(chat_id, local, [])).list

    # --- the throttle ------------------------------------------------------------------

    def _take_slot(self, local: _Local) -> bool:
        """Whether a frame may go out now; if so, the window starts now."""
        now = asyncio.get_running_loop().time()
        if local.timer is None and now - local.last >= self.window:
            local.last = now
            return True
        return False

    def _schedule(self, chat_id: str, local: _Local) -> None:
        if local.timer is None and not self._stopped:
            loop = asyncio.get_running_loop()
            delay = max(0.0, local.last + self.window - loop.time())
            local.timer = loop.call_later(delay, self._window_ended, chat_id, local)

    def _window_ended(self, chat_id: str, local: _Local) -> None:
        local.timer = None
        local.last = asyncio.get_running_loop().time()
        self._spawn(self._flush(chat_id, local))

    async def _change(self, chat_id: str, local: _Local, add: list[str]) -> Listed:
        may = self._take_slot(local)
        return await self._call(chat_id, local, add, may)

    async def _flush(self, chat_id: str, local: _Local) -> None:
        """The slot is taken: write what waits, and send the list if anything changed."""
        try:
            await self._call(chat_id, local, [], True)
        except (RedisError, ConnectionError, OSError) as exc:
            log.warning("presence of %s: %s; again with the next heartbeat", chat_id, exc)

    async def _call(self, chat_id: str, local: _Local, add: list[str], may: bool) -> Listed:
        dirty = local.dirty
        mode = Publish.NEVER
        if may:
            mode = Publish.ALWAYS if dirty else Publish.IF_CHANGED
            local.dirty = False
        gone = list(local.gone)
        local.gone.clear()
        try:
            result = await self.store.change(chat_id, add, gone, mode)
        except BaseException:
            local.gone.update(g for g in gone if g not in local.entries)
            local.dirty = local.dirty or dirty
            raise
        if result.changed and not may:
            local.dirty = True
            self._schedule(chat_id, local)
        return result

    # --- heartbeats --------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.renew_every)
            try:
                await self.renew()
            except Exception:  # the next round tries again
                log.exception("presence heartbeat failed")

    async def renew(self) -> None:
        """Renew every entry of this process; drop what lapsed, and tell the rooms."""
        calls: list[Coroutine[Any, Any, Listed]] = []
        now = asyncio.get_running_loop().time()
        for chat_id, local in list(self._local.items()):
            if local.entries or local.gone:
                calls.append(self._change(chat_id, local, list(local.entries)))
            elif local.timer is None and not local.dirty and now - local.last >= self.window:
                del self._local[chat_id]
        for result in await asyncio.gather(*calls, return_exceptions=True):
            if isinstance(result, BaseException):
                log.warning("presence heartbeat: %s", result)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
