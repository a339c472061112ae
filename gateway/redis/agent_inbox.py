"""The hand-off of turns to agents: the agent inbox, turn deadlines and the outbox.

Every accepted user message becomes an entry in the inbox stream of its chat's partition,
which agent workers read through consumer groups (:mod:`gateway.sdk.agent`); a cancel becomes
another entry of the same stream. The message is appended to its conversation in the
conversation's cluster slot, the inbox entry in the partition's: no one script can do
both. So the intended entry goes into the partition's outbox *before* the publish, and
after it the hand-off script runs, in the partition's slot: the publishing gateway runs it
at once; should that gateway die in between, a sweeper runs it once the entry is due and
the conversation shows the turn running. Whichever comes first hands off, exactly once: a
crash delays a turn by :data:`HANDOFF_GRACE`, it does not lose it.

Each agent name has its own inbox (a conversation names the agent that answers it), so a
worker of one agent never takes another's turns; the default agent keeps the plain key.

Key layout, per partition (one hash tag, so one cluster slot, per partition)::

    inbox:{<tag>}    stream: the default agent's messages and cancels, read by consumer
                     groups; inbox:<agent>:{<tag>} another agent's
    turns:{<tag>}    sorted set: running turns by timeout deadline ("chat turn_id")
    outbox:{<tag>}   sorted set: hand-offs to do (a :class:`Handoff` as JSON), by the time
                     a sweeper may do them
    handed:{<tag>}   sorted set: turns handed off (``HANDED_KEEP_MS``), by when

The tag of partition n of P has its slot in the n-th of P equal slot ranges, so on a
cluster whose primaries split the slots evenly the partitions spread evenly too.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import zlib
from dataclasses import dataclass
from importlib import resources
from typing import Any, NamedTuple

import msgspec
from redis.exceptions import ResponseError

from ..config import Settings
from .pipeline import Script
from .slots import spread_tags
from .store import Store

log = logging.getLogger("gateway.inbox")

HANDOFF_GRACE = 5.0  # seconds from staging a hand-off until a sweeper may do it itself
HANDED_KEEP_MS = 3_600_000  # how long a hand-off is remembered: far past any late publish
DEFAULT_PARTITIONS = Settings().inbox_partitions
DEFAULT_AGENT = "default"  # the agent of a conversation from before named agents


class InboxGroup(NamedTuple):
    """A consumer group of one inbox partition, as ``XINFO GROUPS`` tells it."""

    partition: int
    group: str
    lag: int | None  # entries the group has not read yet (None: the server cannot tell)
    pending: int  # read by a worker, not acknowledged yet


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


@dataclass(frozen=True)
class Partition:
    """One inbox partition's keys, all under its hash tag."""

    tag: str

    @property
    def inbox(self) -> str:
        return f"inbox:{{{self.tag}}}"

    def inbox_of(self, agent: str) -> str:
        """The inbox stream of the agent named ``agent`` (the default's: :attr:`inbox`)."""
        return self.inbox if agent == DEFAULT_AGENT else f"inbox:{agent}:{{{self.tag}}}"

    @property
    def turns(self) -> str:
        return f"turns:{{{self.tag}}}"

    @property
    def outbox(self) -> str:
        return f"outbox:{{{self.tag}}}"

    @property
    def handed(self) -> str:
        return f"handed:{{{self.tag}}}"


@functools.cache
def partitions(count: int) -> tuple[Partition, ...]:
    """The ``count`` partitions, their tags spread over the slot space (:mod:`.slots`)."""
    return tuple(Partition(tag) for tag in spread_tags(count))


def inbox_partition(chat_id: str, count: int) -> int:
    """Stable across processes and restarts, so one chat's entries stay in one ordered stream."""
    return zlib.crc32(chat_id.encode()) % count


def inbox_key(partition: int, count: int = DEFAULT_PARTITIONS,
              agent: str = DEFAULT_AGENT) -> str:
    """The inbox stream of partition ``partition`` of ``count``, of the agent ``agent``."""
    return partitions(count)[partition].inbox_of(agent)


class Handoff(msgspec.Struct, frozen=True):
    """A user message's inbox entry as the outbox keeps it: what is known before the
    publish (the seq and the start time come from the publish, or from the conversation)."""

    chat_id: str
    turn_id: str
    user_id: str
    text: str
    client_msg_id: str
    data: str = ""  # the message's data object as JSON; "" for none

    @property
    def member(self) -> bytes:
        return _encode(self)  # msgspec encodes a Struct the same way every time

    def entry(self, seq: int, started_at: int) -> list[str]:
        """The inbox entry's fields and values, flat."""
        return ["kind", "message", "chat_id", self.chat_id, "turn_id", self.turn_id,
                "seq", str(seq), "user_id", self.user_id, "text", self.text,
                "client_msg_id", self.client_msg_id, "data", self.data,
                "started_at", str(started_at)]


_encode = msgspec.json.encode
_decode_handoff = msgspec.json.Decoder(Handoff).decode
# Durable (GATEWAY_WAIT_REPLICAS): were the outbox entry lost to a failover, a gateway
# dying before its hand-off would lose the turn. The hand-off need not be: lost to a
# failover, it takes the outbox entry's removal with it, so the sweeper does it again.
_STAGE = Script("return redis.call('ZADD', KEYS[1], ARGV[1], ARGV[2])")


@functools.cache
def _handoff_script() -> Script:
    return Script(resources.files("gateway.redis").joinpath("lua", "handoff.lua").read_text())


def _now_ms() -> int:
    return int(time.time() * 1000)


class AgentInbox:
    """The inbox, outbox and turn deadlines of every partition."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.settings = store.settings
        self.partitions = partitions(store.settings.inbox_partitions)
        self.grace = HANDOFF_GRACE

    def partition(self, chat_id: str) -> Partition:
        return self.partitions[inbox_partition(chat_id, len(self.partitions))]

    def keys(self, agent: str = DEFAULT_AGENT) -> list[str]:
        """Every partition's inbox stream of ``agent``, in partition order."""
        return [p.inbox_of(agent) for p in self.partitions]

    async def stage(self, handoff: Handoff) -> None:
        """Record a hand-off before the message's publish; a sweeper may do it after
        ``grace`` seconds if nobody has."""
        due = _now_ms() + int(self.grace * 1000)
        _, replicas = await self.store.pipeline.evalsha_durable(
            _STAGE, [self.partition(handoff.chat_id).outbox], [due, handoff.member])
        self.store.check_replicated(replicas)  # refused: nothing was published yet

    async def hand_off(self, handoff: Handoff, seq: int, started_at: int,
                       deadline_ms: int, agent: str = DEFAULT_AGENT) -> bool:
        """Append the turn's entry to ``agent``'s inbox and arm its timeout unless that was
        done already; returns whether this call did it."""
        part = self.partition(handoff.chat_id)
        reply = await self.store.pipeline.evalsha(
            _handoff_script(), [part.handed, part.outbox, part.inbox_of(agent), part.turns],
            [f"{handoff.chat_id} {handoff.turn_id}", handoff.member, deadline_ms,
             self.settings.inbox_maxlen, _now_ms(), HANDED_KEEP_MS,
             *handoff.entry(seq, started_at)])
        return bool(reply)

    async def discard(self, handoff: Handoff) -> None:
        """Forget a hand-off whose message was not published (refused, or a duplicate)."""
        await self.store.pipeline.execute(
            "ZREM", self.partition(handoff.chat_id).outbox, handoff.member)

    async def due_handoffs(self, now_ms: int, limit: int = 100) -> list[Handoff]:
        """Hand-offs a sweeper may do now, up to ``limit`` per partition."""
        replies = await self._each("ZRANGEBYSCORE", "outbox", "-inf", now_ms, "LIMIT", 0, limit)
        due = []
        for part, members in zip(self.partitions, replies, strict=True):
            for member in members:
                try:
                    due.append(_decode_handoff(member))
                except msgspec.DecodeError:
                    log.warning("dropping an unreadable outbox entry of %s", part.outbox)
                    await self.store.pipeline.execute("ZREM", part.outbox, member)
        return due

    async def to_inbox(self, chat_id: str, entry: dict[str, str],
                       agent: str = DEFAULT_AGENT) -> None:
        """Append an entry that needs no outbox to ``agent``'s inbox (a cancel: a turn also
        looks for one in its conversation when it starts)."""
        fields = [item for pair in entry.items() for item in pair]
        await self.store.pipeline.execute(
            "XADD", self.partition(chat_id).inbox_of(agent), "MAXLEN", "~",
            self.settings.inbox_maxlen, "*", *fields)

    async def due_turns(self, now_ms: int, limit: int = 100) -> list[tuple[str, str]]:
        """Running turns past their deadline, as (chat, turn), up to ``limit`` per partition."""
        replies = await self._each("ZRANGEBYSCORE", "turns", "-inf", now_ms, "LIMIT", 0, limit)
        due = []
        for rows in replies:
            for row in rows:
                chat_id, _, turn_id = row.decode().rpartition(" ")
                due.append((chat_id, turn_id))
        return due

    async def untrack_turn(self, chat_id: str, turn_id: str) -> None:
        await self.store.pipeline.execute(
            "ZREM", self.partition(chat_id).turns, f"{chat_id} {turn_id}")

    # --- what /metrics samples ---------------------------------------------------------

    async def groups(self) -> list[InboxGroup]:
        """Every consumer group of every partition: its lag and pending entries."""
        replies = await asyncio.gather(*(self.store.backend.client.xinfo_groups(p.inbox)
                                         for p in self.partitions), return_exceptions=True)
        found = []
        for n, reply in enumerate(replies):
            if isinstance(reply, ResponseError):
                continue  # no such key: no message yet, and no group
            if isinstance(reply, BaseException):
                raise reply
            for group in reply:
                lag = group.get("lag")
                found.append(InboxGroup(n, _text(group["name"]), None if lag is None
                                        else int(lag), int(group.get("pending") or 0)))
        return found

    async def running(self) -> list[int]:
        """How many turns run (have a deadline), per partition."""
        return [int(count) for count in await self._each("ZCARD", "turns")]

    async def _each(self, command: str, key: str, *args: Any) -> list[Any]:
        """``command`` on one kind of key of every partition: one call per key (each in
        its own slot), issued together so the auto-pipeline batches them per node."""
        return list(await asyncio.gather(*(
            self.store.pipeline.execute(command, getattr(part, key), *args)
            for part in self.partitions)))
