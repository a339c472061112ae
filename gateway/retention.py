"""Retention: a conversation untouched for ``GATEWAY_CONVERSATION_TTL`` is deleted.

Finding old conversations without a scan: each one is in one of ``EXPIRY_BUCKETS`` sorted
sets (:func:`~gateway.redis.keys.expiry_key`), scored by the time of its last list change;
the store keeps them where it keeps the owner's list. A single key lives on one shard of a
cluster: a fixed number of them spreads the index and its writes over the shards, and a
conversation always maps to the same one. The list change time is never later than the
last time anything was stored in the conversation, so every conversation past the cutoff
there is a candidate, and the delete script decides, on the conversation's own server and
clock: nothing stored for the TTL and no turn running, or it is kept and its entry moved to
when it could expire next.

Every gateway process sweeps, at once if so: the script deletes a conversation once, and
only the process that deleted it tells its subscribers (the script) and its owner's list
and feed (the store); the others find it gone. A run looks at a bounded number of
conversations, the oldest of each bucket.
"""

from __future__ import annotations

import asyncio
import logging

from redis.exceptions import RedisError

from .config import Settings
from .errors import Rejected
from .events import now_ms
from .metrics import COUNTS
from .redis.keys import EXPIRY_BUCKETS
from .redis.store import Store

log = logging.getLogger("gateway.retention")

PER_RUN = 128  # conversations one run looks at, at most: the oldest 8 of each bucket


class Retention:
    """The sweeper of one gateway process."""

    def __init__(self, store: Store, settings: Settings) -> None:
        self.store = store
        self.ttl_ms = int(settings.conversation_ttl * 1000)
        # Often enough that a conversation goes within about a quarter TTL of its time,
        # rarely enough to cost nothing: 16 reads of empty ranges per run.
        self.interval = min(30.0, max(0.1, settings.conversation_ttl / 4))

    async def sweep(self) -> int:
        """One run: delete what has expired among the oldest of each bucket; returns how
        many this process deleted."""
        chats = await self.store.expiring(now_ms() - self.ttl_ms, PER_RUN // EXPIRY_BUCKETS)
        outcomes = await asyncio.gather(
            *(self.store.expire(chat, self.ttl_ms) for chat in chats),
            return_exceptions=True)
        expired = sum(isinstance(owner, str) for owner in outcomes)
        for failed in (o for o in outcomes if isinstance(o, BaseException)):
            if not isinstance(failed, (RedisError, OSError, Rejected)):
                raise failed
            log.warning("retention: %s", failed)  # looked at again next run
        COUNTS.conversations_expired += expired
        if expired:
            log.info("retention: deleted %d conversations untouched for %d s", expired,
                     self.ttl_ms // 1000)
        return expired

    async def run(self) -> None:
        while True:
            try:
                await self.sweep()
            except (RedisError, OSError) as exc:
                log.warning("retention: %s", exc)
            await asyncio.sleep(self.interval)
