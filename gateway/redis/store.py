"""Redis Streams storage: publish (one Lua call), history ranges, conversation state.

Every key of a conversation carries the hash tag ``{chat_id}`` so each script touches one
cluster slot, and its pub/sub channel is a sharded channel in that slot: on a cluster,
its traffic goes only to the shard that owns it. A user's keys share ``{u:<user>}``.
Key layout::

    c:{chat}:meta        hash: owner, title, status, turn_id, started_at, goal, epoch, seq, ...
    c:{chat}:stream      durable events, entry id "<seq>-0", field "f" = the encoded frame
    c:{chat}:text:<type> the text of the conversation's open stream of a streamed type
                         (its id, turn, next position and attempt: meta field st:<type>)
    c:{chat}:idem:<key>  first result of an idempotent publish or message (TTL)
    c:{chat}:ev          sharded pub/sub channel of the room
    {u:<user>}:feed      sharded pub/sub channel of a user's conversation feed
    {u:<user>}:convs     sorted set: the user's conversations by last change

The agent inbox, turn deadlines and the hand-off outbox are :mod:`gateway.inbox`'s.
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
from importlib import resources
from typing import Any

import msgspec

from ..config import Settings
from ..errors import Rejected
from .backend import Backend
from .pipeline import AutoPipeline, Script


def meta_key(chat_id: str) -> str:
    return f"c:{{{chat_id}}}:meta"


def stream_key(chat_id: str) -> str:
    return f"c:{{{chat_id}}}:stream"


def text_key(chat_id: str, stream_type: str) -> str:
    return f"c:{{{chat_id}}}:text:{stream_type}"


def idem_key(chat_id: str, key: str) -> str:
    return f"c:{{{chat_id}}}:idem:{key}"


def room_channel(chat_id: str) -> str:
    return f"c:{{{chat_id}}}:ev"


def feed_channel(user_id: str) -> str:
    return f"{{u:{user_id}}}:feed"


def index_key(user_id: str) -> str:
    return f"{{u:{user_id}}}:convs"


class OutEvent(msgspec.Struct, frozen=True):
    """One event to append. ``data`` is a JSON object (raw text for ``title``)."""

    type: str
    data: bytes
    durable: bool = True
    extra: str = ""


class Published(msgspec.Struct, frozen=True):
    epoch: str
    seqs: list[int | None]
    last_seq: int
    owner: str
    duplicate: bool
    ts: int
    note: str
    created: bool = False


class NotReplicated(Rejected):
    """Stored and published, but fewer replicas than ``GATEWAY_WAIT_REPLICAS`` confirmed it
    in time: not acknowledged, yet it stands (``result``); a retry with the same idempotency
    key returns that result."""

    def __init__(self, message: str, result: Published | None = None) -> None:
        super().__init__("replication_timeout", message)
        self.result = result


class Meta(msgspec.Struct, frozen=True):
    """A conversation's state as stored in its meta hash."""

    owner: str
    epoch: str
    seq: int
    status: str
    title: str | None
    turn_id: str | None
    started_at: int | None
    goal: bytes | None
    preview: str | None
    created_at: int
    updated_at: int

    @classmethod
    def from_hash(cls, raw: dict[bytes, bytes]) -> Meta | None:
        if not raw or b"epoch" not in raw:
            return None
        get = raw.get

        def text(name: bytes) -> str | None:
            value = get(name, b"")
            return value.decode() if value else None

        def number(name: bytes) -> int | None:
            value = get(name, b"")
            return int(value) if value else None

        return cls(
            owner=raw[b"owner"].decode(),
            epoch=raw[b"epoch"].decode(),
            seq=int(raw[b"seq"]),
            status=raw[b"status"].decode(),
            title=text(b"title"),
            turn_id=text(b"turn_id"),
            started_at=number(b"started_at"),
            goal=get(b"goal") or None,
            preview=text(b"preview"),
            created_at=number(b"created_at") or 0,
            updated_at=number(b"updated_at") or number(b"created_at") or 0,
        )


class OpenStream(msgspec.Struct, frozen=True):
    """A streamed answer not yet committed: its text so far and its next position."""

    id: str
    type: str
    turn_id: str
    text: str
    pos: int

    @classmethod
    def parse(cls, kind: bytes, header: bytes, text: bytes) -> OpenStream:
        stream_id, turn_id, pos, _attempt = header.decode().split(" ")
        return cls(stream_id, kind.decode(), turn_id, text.decode(errors="replace"), int(pos))


class History(msgspec.Struct, frozen=True):
    """A conversation's state, open streams and the durable frames after some seq, read
    atomically."""

    meta: Meta | None
    frames: list[tuple[int, bytes]]
    streams: list[OpenStream] = []


class Epochs:
    """Fresh epoch names: a random prefix per process and a counter.

    Unique like a random token, without a ``getrandom`` call on every publish (a publish
    passes one in case it has to create the conversation).
    """

    def __init__(self) -> None:
        self._prefix = secrets.token_hex(5)
        self._count = itertools.count(1)

    def __call__(self) -> str:
        return f"{self._prefix}{next(self._count):x}"


def _as_dict(reply: Any) -> dict[bytes, bytes]:
    """A hash as a raw reply gives it: a flat list (RESP2) or a map (RESP3)."""
    if isinstance(reply, dict):
        return reply
    return dict(zip(reply[::2], reply[1::2], strict=True))


def _script(name: str) -> str:
    """A script's source with ``lua/lib.lua`` (the shared functions) in front of it."""
    lua = resources.files("gateway.redis").joinpath("lua")
    return lua.joinpath("lib.lua").read_text() + lua.joinpath(name).read_text()


class Store:
    """All of the gateway's Redis reads and writes."""

    def __init__(self, backend: Backend, settings: Settings) -> None:
        self.backend = backend
        self.redis = backend.client
        self.settings = settings
        # The hot paths (publish, read, state) go through the auto-pipeline; the rare ones
        # (conversation lists) use the client directly, which routes by key itself.
        self.pipeline = AutoPipeline(backend)
        self._new_epoch = Epochs()
        self._publish = Script(_script("publish.lua"))
        self._read = Script(_script("read.lua"))
        self._delete = Script(_script("delete.lua"))
        self._rotate = Script(
            "if redis.call('HGET', KEYS[1], 'epoch') == ARGV[1] then "
            "redis.call('HSET', KEYS[1], 'epoch', ARGV[2]) end")
        self._stream_types = ",".join(settings.stream_types)

    def _keys(self, chat_id: str) -> list[str]:
        """The keys every script of a conversation gets: meta, stream, the text keys."""
        return [meta_key(chat_id), stream_key(chat_id),
                *(text_key(chat_id, kind) for kind in self.settings.stream_types)]

    async def publish(
        self,
        chat_id: str,
        events: list[OutEvent],
        *,
        create_owner: str = "",
        idempotency_key: str | None = None,
        note: str = "",
        writer: str = "",
    ) -> Published:
        """Append ``events`` in order; raise :class:`Rejected` if the state refuses them."""
        keys = self._keys(chat_id)
        if idempotency_key is not None:
            keys.append(idem_key(chat_id, idempotency_key))
        args: list[Any] = [
            room_channel(chat_id), self.settings.history_maxlen,
            self.settings.idempotency_ttl, create_owner, self._new_epoch(), chat_id,
            len(events), note, writer, self._stream_types, self.settings.stream_max_bytes,
        ]
        for event in events:
            args += [event.type, "1" if event.durable else "0", event.data, event.extra]
        reply, replicas = await self.pipeline.evalsha_durable(self._publish, keys, args)
        status = reply[0].decode() if isinstance(reply[0], bytes) else reply[0]
        fields = [v.decode() if isinstance(v, bytes) else str(v) for v in reply]
        if status == "err":
            raise Rejected(fields[1], fields[2])
        result = Published(
            epoch=fields[1],
            seqs=[int(s) if s else None for s in fields[2].split(",")] if events else [],
            last_seq=int(fields[3]),
            owner=fields[4],
            duplicate=fields[5] == "1",
            ts=int(fields[6]),
            note=fields[8] if len(fields) > 8 else "",
            created=len(fields) > 9 and fields[9] == "1" and fields[5] != "1",
        )
        if fields[7] == "1" and not result.duplicate:
            await self._tell_owner(result.owner, reply[10], "ZADD", result.ts, chat_id)
        self.check_replicated(replicas, result)  # stored either way: list and feed tell it
        return result

    def check_replicated(self, replicas: int | None, result: Published | None = None) -> None:
        """Acknowledged means as durable as configured: so many replicas have it."""
        wanted = self.settings.wait_replicas
        if replicas is not None and replicas < wanted:
            raise NotReplicated(f"stored, but {replicas} of {wanted} replicas confirmed within "
                                f"{self.settings.wait_timeout_ms} ms; retry with the same "
                                "idempotency key", result)

    async def _tell_owner(self, owner: str, feed: bytes, *list_change: Any) -> None:
        """Change the owner's conversation list (``ZADD``/``ZREM`` and its arguments) and
        announce ``feed`` on the owner's feed. Both live in the owner's slot, not the
        conversation's, so they cannot join its script: only list-visible changes pay this
        second write (one round trip: both go out in the same batch)."""
        command, *args = list_change
        await asyncio.gather(self.pipeline.execute(command, index_key(owner), *args),
                             self.pipeline.execute("SPUBLISH", feed_channel(owner), feed))

    async def read(self, chat_id: str, after: int | None, limit: int,
                   create_owner: str = "") -> History:
        """The state plus up to ``limit`` durable frames with seq > ``after``, atomically;
        with ``create_owner``, a conversation that does not exist is created first."""
        flat, entries, created, open_streams, *feed = await self.pipeline.evalsha(
            self._read, self._keys(chat_id),
            ["" if after is None else after, limit, create_owner, self._new_epoch(),
             chat_id, self._stream_types])
        meta = Meta.from_hash(_as_dict(flat))
        if created and meta is not None:
            await self._tell_owner(meta.owner, feed[0], "ZADD", meta.created_at, chat_id)
        frames = [(int(entry_id.split(b"-")[0]), fields[1]) for entry_id, fields in entries]
        streams = [OpenStream.parse(*open_streams[i:i + 3])
                   for i in range(0, len(open_streams), 3)]
        return History(meta, frames, streams)

    async def rotate_epoch(self, chat_id: str, epoch: str) -> None:
        """Give the conversation a new epoch if it still has ``epoch``: its history went
        backwards, so old positions must stop meaning anything."""
        await self.pipeline.evalsha(self._rotate, [meta_key(chat_id)], [epoch, self._new_epoch()])

    async def meta(self, chat_id: str) -> Meta | None:
        return Meta.from_hash(_as_dict(await self.pipeline.execute("HGETALL", meta_key(chat_id))))

    async def delete(self, chat_id: str) -> str | None:
        """Delete a conversation; returns its former owner, or None if it did not exist."""
        reply, replicas = await self.pipeline.evalsha_durable(
            self._delete, self._keys(chat_id), [room_channel(chat_id), chat_id])
        if not reply:
            return None
        owner = str(reply[0].decode())
        await self._tell_owner(owner, reply[1], "ZREM", chat_id)
        self.check_replicated(replicas)
        return owner

    async def migrate_lists(self) -> int:
        """Move conversation lists kept under the layout before per-user hash tags
        (``convs:<user>``) to ``{u:<user>}:convs``; returns how many moved. Only a single
        server can hold the old layout (it could not run on a cluster)."""
        if self.backend.cluster:
            return 0
        moved = 0
        async for key in self.redis.scan_iter(match="convs:*", count=1000):
            user = key[len(b"convs:"):].decode()
            await self.redis.zunionstore(index_key(user), [index_key(user), key],
                                         aggregate="MAX")
            await self.redis.delete(key)
            moved += 1
        return moved

    async def conversations(
        self, user_id: str, before: int | None, limit: int
    ) -> tuple[list[tuple[str, Meta]], int | None]:
        """The user's conversations, newest change first, strictly older than ``before``,
        and the cursor of the next page (None after the last one).

        The cursor is the last row's change time (its score, not ``updated_at``, which
        events that do not reorder the list also move). A page never splits conversations
        changed in the same millisecond, so it may hold more than ``limit``: the next page
        starts strictly older and would skip the rest of them.
        """
        key = index_key(user_id)
        top = f"({before}" if before is not None else "+inf"
        rows: list[Any] = await self.redis.zrevrangebyscore(
            key, top, "-inf", start=0, num=limit + 1, withscores=True
        )
        next_cursor = None
        if len(rows) > limit:
            last = rows[limit - 1][1]
            if rows[limit][1] == last:
                tied: list[Any] = await self.redis.zrevrangebyscore(key, last, last)
                rows = [r for r in rows[:limit] if r[1] != last] + [(c, last) for c in tied]
                if await self.redis.zcount(key, "-inf", f"({int(last)}"):
                    next_cursor = int(last)
            else:
                rows = rows[:limit]
                next_cursor = int(last)
        if not rows:
            return [], None
        async with self.redis.pipeline(transaction=False) as pipe:
            for chat, _ in rows:
                pipe.hgetall(meta_key(chat.decode()))
            metas = await pipe.execute()
        found = []
        for (chat, _), raw in zip(rows, metas, strict=True):
            meta = Meta.from_hash(raw)
            if meta is not None:
                found.append((chat.decode(), meta))
        return found, next_cursor

