"""The webhook outbox: notifications for people who are away, kept until delivered.

When a turn ends, or an agent asks a client tool, its publisher (a gateway or an agent
worker: :meth:`Store.publish`) puts a :class:`Notification` for the conversation's owner
here, if some gateway delivers webhooks (``notify:on``). Gateways with
``GATEWAY_WEBHOOK_URL`` take the due ones (:mod:`gateway.webhook`), each under a lease, so a
gateway killed mid-delivery leaves it to another once the lease lapses: at least once.

Keys, per partition (a user's notifications all in one, chosen by the user's id)::

    notify:{<tag>}      sorted set: a notification (JSON) -> when it is due (ms)
    notify:n:{<tag>}    hash: user -> notifications pending (the bound per user)
    notify:on           set (with a TTL) while a gateway delivers webhooks

Their tags spread over the slot space like the inbox's (:mod:`gateway.redis.slots`).
"""

from __future__ import annotations

import time
import zlib

import msgspec

from .pipeline import AutoPipeline, Script
from .slots import spread_tags

ON_KEY = "notify:on"
PER_USER_MAX = 50  # notifications pending per user; past it new ones are dropped
# A notification is due this long after its event: a person who just left (their presence
# is written within GATEWAY_PRESENCE_WINDOW) or comes right back is not pushed.
DELAY_MS = 2000
_ON_CACHE_S = 5.0


class Notification(msgspec.Struct, frozen=True):
    """One webhook to send: ``id`` is the same on every attempt (the receiver dedups)."""

    id: str
    user: str
    chat_id: str
    kind: str  # "turn_end" or "awaiting_input"
    seq: int
    ts: int  # ms: when it happened
    preview: str | None = None
    title: str | None = None
    attempt: int = 0

    def member(self) -> bytes:
        return msgspec.json.encode(self)


_decode = msgspec.json.Decoder(Notification).decode

# KEYS[1] outbox, KEYS[2] counts; ARGV[1] member, ARGV[2] due, ARGV[3] user, ARGV[4] bound.
# Returns 1 when kept, 0 when the user has as many pending as the bound.
_ENQUEUE = Script("""
if tonumber(redis.call('HGET', KEYS[2], ARGV[3]) or '0') >= tonumber(ARGV[4]) then return 0 end
if redis.call('ZADD', KEYS[1], 'NX', ARGV[2], ARGV[1]) == 1 then
  redis.call('HINCRBY', KEYS[2], ARGV[3], 1)
end
return 1
""")
# KEYS[1] outbox; ARGV[1] now, ARGV[2] lease until, ARGV[3] most. The due ones, leased.
_CLAIM = Script("""
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, ARGV[3])
for _, member in ipairs(due) do redis.call('ZADD', KEYS[1], 'XX', ARGV[2], member) end
return due
""")
# KEYS[1] outbox, KEYS[2] counts; ARGV[1] member, ARGV[2] user: delivered (or given up).
_DONE = Script("""
if redis.call('ZREM', KEYS[1], ARGV[1]) == 1 and
    redis.call('HINCRBY', KEYS[2], ARGV[2], -1) <= 0 then
  redis.call('HDEL', KEYS[2], ARGV[2])
end
return 1
""")
# KEYS[1] outbox; ARGV[1] member, ARGV[2] the next attempt's member, ARGV[3] its due time.
_RETRY = Script("""
if redis.call('ZREM', KEYS[1], ARGV[1]) == 1 then redis.call('ZADD', KEYS[1], ARGV[3], ARGV[2]) end
return 1
""")


def _now_ms() -> int:
    return int(time.time() * 1000)


class NotifyOutbox:
    """The outbox over every partition."""

    def __init__(self, pipeline: AutoPipeline, count: int) -> None:
        self.pipeline = pipeline
        self.partitions = spread_tags(count)
        self._on, self._on_at = False, -_ON_CACHE_S

    def _keys(self, user: str) -> tuple[str, str]:
        tag = self.partitions[zlib.crc32(user.encode()) % len(self.partitions)]
        return _outbox(tag), _counts(tag)

    async def enabled(self) -> bool:
        """Whether some gateway delivers webhooks now (read at most every few seconds)."""
        now = time.monotonic()
        if now - self._on_at > _ON_CACHE_S:
            self._on, self._on_at = bool(await self.pipeline.execute("EXISTS", ON_KEY)), now
        return self._on

    async def announce(self, ttl_s: int) -> None:
        """This gateway delivers: publishers enqueue for the next ``ttl_s`` seconds."""
        await self.pipeline.execute("SET", ON_KEY, "1", "EX", ttl_s)

    async def enqueue(self, note: Notification) -> bool:
        """Keep ``note`` until delivered; False when its user has too many pending."""
        outbox, counts = self._keys(note.user)
        return bool(await self.pipeline.evalsha(
            _ENQUEUE, [outbox, counts],
            [note.member(), _now_ms() + DELAY_MS, note.user, PER_USER_MAX]))

    async def claim(self, tag: str, lease_ms: int, most: int) -> list[Notification]:
        """The due notifications of the partition ``tag``, each leased to the caller for
        ``lease_ms``."""
        now = _now_ms()
        members = await self.pipeline.evalsha(_CLAIM, [_outbox(tag)], [now, now + lease_ms, most])
        return [_decode(member) for member in members]

    async def done(self, note: Notification) -> None:
        outbox, counts = self._keys(note.user)
        await self.pipeline.evalsha(_DONE, [outbox, counts], [note.member(), note.user])

    async def retry(self, note: Notification, due_ms: int) -> None:
        """Try ``note`` again at ``due_ms``, as its next attempt (same id)."""
        outbox, _ = self._keys(note.user)
        again = msgspec.structs.replace(note, attempt=note.attempt + 1)
        await self.pipeline.evalsha(_RETRY, [outbox], [note.member(), again.member(), due_ms])


def _outbox(tag: str) -> str:
    return f"notify:{{{tag}}}"


def _counts(tag: str) -> str:
    return f"notify:n:{{{tag}}}"
