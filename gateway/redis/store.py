"""The gateway's Redis reads and writes: publish, history reads, state, lists.

Each conversation change is one Lua script on the conversation's slot (:mod:`.scripts`
builds its arguments and decodes its reply); the hot calls go through the auto-pipeline
(:mod:`.pipeline`). Where keys live is :mod:`.keys`'s.
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
from time import perf_counter, time
from typing import Any

import msgspec
from redis.exceptions import RedisError

from ..config import Settings
from ..errors import Rejected
from .backend import Backend
from .counters import REDIS
from .keys import (
    EXPIRY_BUCKETS,
    children_key,
    expiry_bucket,
    expiry_key,
    feed_channel,
    index_key,
    meta_key,
    presence_key,
)
from .listing import ListFilter, Place
from .notify_outbox import Notification, NotifyOutbox
from .pipeline import AutoPipeline, settled
from .records import History, Meta, OutEvent, PathPage, Published, Tree, TreeOp
from .scripts import (
    ChildScript,
    Deleted,
    DeleteScript,
    HistoryScript,
    ListScript,
    MembersChanged,
    MembersScript,
    PublishScript,
    ReadScript,
    Refused,
    RotateScript,
    TreeScript,
)


class _Reason(msgspec.Struct):
    reason: str = "complete"


class _Feed(msgspec.Struct):
    preview: str | None = None
    title: str | None = None


_decode_reason = msgspec.json.Decoder(_Reason).decode
_decode_feed = msgspec.json.Decoder(_Feed).decode

class NotReplicated(Rejected):
    """Stored and published, but fewer replicas than ``GATEWAY_WAIT_REPLICAS`` confirmed it
    in time: not acknowledged, yet it stands (``result``); a retry with the same idempotency
    key returns that result."""

    def __init__(self, message: str, result: Published | None = None) -> None:
        super().__init__("replication_timeout", message)
        self.result = result


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


def _observe_turn(ended_at: int, started_at: asyncio.Future[Any]) -> None:
    """A turn ended at ``ended_at`` (ms, the server's clock): observe how long it ran."""
    if started_at.done() and not started_at.cancelled() and started_at.exception() is None \
            and started_at.result():
        REDIS.turn_seconds.observe(max(0, ended_at - int(started_at.result())) / 1000)


def _text_fields(reply: Any) -> dict[str, str]:
    """A hash as HGETALL gives it (a flat list in RESP2, a map in RESP3), as text."""
    if not isinstance(reply, dict):
        reply = dict(zip(reply[::2], reply[1::2], strict=True))
    return {k.decode(): v.decode() for k, v in reply.items()}


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
        self._publish = PublishScript(settings)
        self._read = ReadScript(settings)
        self._delete = DeleteScript(settings)
        self._child = ChildScript()
        self._members = MembersScript()
        self._rotate = RotateScript()
        self._path = HistoryScript()
        self._tree = TreeScript()
        self._list = ListScript()
        self._streamed = frozenset(settings.stream_types)
        self.notify = NotifyOutbox(self.pipeline, settings.inbox_partitions)

    async def publish(
        self,
        chat_id: str,
        events: list[OutEvent],
        *,
        create_owner: str = "",
        create_agent: str = "",
        idempotency_key: str | None = None,
        writer: str = "",
        op: TreeOp | None = None,
        turn: str = "",
    ) -> Published:
        """Append ``events`` in order, as the tree operation ``op`` if given; raise
        :class:`Rejected` if the state refuses them. ``turn``: the turn they are written
        for; refused (``no_active_turn``, ``turn_mismatch``) unless it is the running one.
        ``create_owner`` creates a conversation that does not exist, answered by
        ``create_agent`` (else the default agent)."""
        began = perf_counter()
        streamed, started_at = 0, None
        for event in events:  # what the counters need of the batch
            if not event.durable and event.type in self._streamed:
                streamed += len(event.data)
            elif event.type == "turn_end" and started_at is None:
                # Read in the same batch, just ahead of the script that clears it.
                started_at = self.pipeline.issue("HGET", meta_key(chat_id), "started_at")
        try:
            reply, replicas = await self.pipeline.evalsha_durable(*self._publish.call(
                chat_id, events, fresh=self._new_epoch(), create_owner=create_owner,
                writer=writer, idempotency_key=idempotency_key, op=op, turn=turn,
                agent=create_agent))
            result = self._publish.decode(reply)
            if not result.duplicate:
                REDIS.streamed_bytes += streamed
                if started_at is not None:
                    _observe_turn(result.ts, started_at)
            if result.listed and result.feed is not None:
                await self._tell_owner([result.owner, *result.members], result.feed, "ZADD",
                                       result.ts, chat_id)
                if not result.duplicate:
                    await self._notify_owner(chat_id, events, result)
            self.check_replicated(replicas, result)  # stored either way: list and feed tell it
            return result
        except Rejected as exc:
            REDIS.publish_errors[exc.code] += 1
            if isinstance(exc, Refused):  # the list's order stands: only the totals moved
                await settled([self.pipeline.issue("SPUBLISH", feed_channel(user), exc.feed)
                               for user in (exc.owner, *exc.members)])
            raise
        except (RedisError, OSError):
            REDIS.publish_errors["backend_unavailable"] += 1
            raise
        finally:
            REDIS.publish_seconds.observe(perf_counter() - began)
            if started_at is not None and started_at.done() and not started_at.cancelled():
                started_at.exception()  # retrieved: a failed read is the publish's failure

    def check_replicated(self, replicas: int | None, result: Published | None = None) -> None:
        """Acknowledged means as durable as configured: so many replicas have it."""
        wanted = self.settings.wait_replicas
        if replicas is not None and replicas < wanted:
            REDIS.replication_timeouts += 1
            raise NotReplicated(f"stored, but {replicas} of {wanted} replicas confirmed within "
                                f"{self.settings.wait_timeout_ms} ms; retry with the same "
                                "idempotency key", result)

    async def _notify_owner(self, chat_id: str, events: list[OutEvent],
                            result: Published) -> None:
        """A turn ended (or asks a person): a webhook for its owner, who may be away
        (:mod:`gateway.webhook` checks), when some gateway delivers webhooks."""
        ended = next((i for i, e in enumerate(events) if e.type == "turn_end"), None)
        if ended is None or result.feed is None or not await self.notify.enabled():
            return
        if await self.user_present(chat_id, result.owner):
            return  # they saw it live
        seq = result.seqs[ended] if ended < len(result.seqs) else None
        if seq is None:
            return
        reason = _decode_reason(events[ended].data).reason
        feed = _decode_feed(result.feed)
        await self.notify.enqueue(Notification(
            f"{chat_id}:{result.epoch}:{seq}", result.owner, chat_id,
            "awaiting_input" if reason == "awaiting_input" else "turn_end", seq, result.ts,
            feed.preview, feed.title))

    async def user_present(self, chat_id: str, user_id: str) -> bool:
        """Whether ``user_id`` has a live connection to ``chat_id`` on any gateway process
        (an entry of its presence list that has not lapsed)."""
        prefix = f"u:{user_id}:".encode()
        members = await self.pipeline.execute(
            "ZRANGEBYSCORE", presence_key(chat_id), int(time() * 1000), "+inf")
        return any(bytes(member).startswith(prefix) for member in members)

    async def _tell_owner(self, users: str | list[str], feed: str, *list_change: Any) -> None:
        """Change the owner's conversation list (``ZADD``/``ZREM`` and its arguments) and
        announce ``feed`` on the owner's feed, and the same for each member when ``users``
        lists them after the owner. Both live in each user's slot, not the
        conversation's, so they cannot join its script: only list-visible changes pay this
        second write (one round trip: both go out in the same batch). The same change goes
        to the conversation's retention bucket (:mod:`gateway.retention`), in that batch."""
        command, *args = list_change
        if command == "ZADD":  # a late, older change never moves it back: list walks rely on it
            args = ["GT", *args]
        issue = self.pipeline.issue
        everyone = [users] if isinstance(users, str) else users
        await settled([issue(command, expiry_key(expiry_bucket(args[-1])), *args),
                       *(issue(command, index_key(user), *args) for user in everyone),
                       *(issue("SPUBLISH", feed_channel(user), feed) for user in everyone)])

    async def read(self, chat_id: str, after: int | None, limit: int,
                   create_owner: str = "", create_agent: str = "") -> History:
        """The state plus up to ``limit`` durable frames with seq > ``after``, atomically;
        with ``create_owner``, a conversation that does not exist is created first."""
        history = self._read.decode(await self.pipeline.evalsha(*self._read.call(
            chat_id, after, limit, create_owner=create_owner, fresh=self._new_epoch(),
            create_agent=create_agent)))
        meta = history.meta
        if history.created and meta is not None and history.feed is not None:
            await self._tell_owner(meta.owner, history.feed, "ZADD", meta.created_at, chat_id)
        return history

    async def active_path(self, chat_id: str, after: int, limit: int,
                          tip: str = "") -> PathPage | None:
        """A page of the active path, or of the path to ``tip`` (None if the conversation
        does not exist)."""
        return self._path.decode(await self.pipeline.evalsha(
            *self._path.call(chat_id, after, limit, tip)))

    async def tree(self, chat_id: str) -> Tree | None:
        """The whole tree and the head (None if the conversation does not exist)."""
        return self._tree.decode(await self.pipeline.evalsha(*self._tree.call(chat_id)))

    async def rotate_epoch(self, chat_id: str, epoch: str) -> None:
        """Give the conversation a new epoch if it still has ``epoch``: its history went
        backwards, so old positions must stop meaning anything."""
        await self.pipeline.evalsha(*self._rotate.call(chat_id, epoch, self._new_epoch()))

    async def meta(self, chat_id: str) -> Meta | None:
        reply = await self.pipeline.execute("HGETALL", meta_key(chat_id))
        return Meta.from_fields(_text_fields(reply))

    async def delete(self, chat_id: str) -> str | None:
        """Delete a conversation and its sub-conversations, theirs too; returns its former
        owner, or None if it did not exist.

        Children go first, then the parent: a crash part-way leaves the parent, listing the
        children not yet deleted, and the same delete again finishes it. A child opened
        while this runs is in the parent's last reply: it goes right after.
        """
        deleted = await self._delete_family(chat_id)
        if deleted.parent:  # a child deleted on its own: its parent stops listing it
            await self.pipeline.execute("ZREM", children_key(deleted.parent), chat_id)
        return deleted.owner

    async def _delete_family(self, chat_id: str, untouched_ms: int = 0) -> Deleted:
        # Retention decides on the parent first: then its children follow it.
        first = [] if untouched_ms else await self._child_ids(chat_id)
        await asyncio.gather(*(self._delete_family(child) for child in first))
        reply, replicas = await self.pipeline.evalsha_durable(
            *self._delete.call(chat_id, untouched_ms))
        deleted = self._delete.decode(reply)
        if deleted.owner is not None and deleted.feed is not None:
            await self._tell_owner([deleted.owner, *deleted.members], deleted.feed, "ZREM",
                                   chat_id)
            self.check_replicated(replicas)
        late = set(deleted.children) - set(first)
        await asyncio.gather(*(self._delete_family(child) for child in late))
        return deleted

    async def expire(self, chat_id: str, untouched_ms: int) -> str | None:
        """Retention: delete a conversation and its sub-conversations if nothing was stored
        in it for ``untouched_ms`` and no turn runs in it (its delete script decides,
        atomically), nor in any of theirs (read just before); returns its former owner.
        Else None, and its retention entry moves to when it could expire (ZADD XX: unless
        it was deleted meanwhile), or goes if the conversation is gone (a deletion whose
        list change was lost).

        The parent goes first, then its children: a crash in between leaves children
        without a parent, which expire on their own.
        """
        bucket = expiry_key(expiry_bucket(chat_id))
        below = await self._descendants_touched(chat_id)
        if below is not None and below > int(time() * 1000) - untouched_ms:
            await self.pipeline.execute("ZADD", bucket, "XX", "GT", below, chat_id)
            return None
        deleted = await self._delete_family(chat_id, untouched_ms)
        if deleted.kept is not None:
            await self.pipeline.execute("ZADD", bucket, "XX", "GT", deleted.kept, chat_id)
        elif deleted.owner is None:
            await self.pipeline.execute("ZREM", bucket, chat_id)
        elif deleted.parent:  # an expired child: its parent stops listing it
            await self.pipeline.execute("ZREM", children_key(deleted.parent), chat_id)
        return deleted.owner

    async def _descendants_touched(self, chat_id: str) -> int | None:
        """The last change (ms) among the conversation's sub-conversations, theirs too: now
        while a turn runs in one; None when it has none."""
        found = await self.children(chat_id)
        if not found:
            return None
        now = int(time() * 1000)
        deeper = await asyncio.gather(*(self._descendants_touched(child) for child, _ in found))
        return max([*(now if meta.status == "running" else meta.updated_at for _, meta in found),
                    *(d for d in deeper if d is not None)])

    async def _child_ids(self, chat_id: str) -> list[str]:
        ids: list[bytes] = await self.pipeline.execute("ZRANGE", children_key(chat_id), 0, -1)
        return [child.decode() for child in ids]

    async def children(self, chat_id: str,
                       ids: list[str] | None = None) -> list[tuple[str, Meta]]:
        """``chat_id``'s sub-conversations, oldest first (one already deleted is left out:
        its parent may list it until then); ``ids``: their ids, when read already."""
        if ids is None:
            ids = await self._child_ids(chat_id)
        metas = await asyncio.gather(*(self.meta(child) for child in ids))
        return [(child, meta) for child, meta in zip(ids, metas, strict=True) if meta is not None]

    async def open_child(self, parent: str, chat_id: str, title: str | None, *,
                         writer: str = "", title_source: str = "user",
                         existing_ok: bool = False, agent: str = "") -> None:
        """Create ``chat_id`` as a sub-conversation of ``parent``, owned by the parent's
        owner, and record it in the parent: a durable ``child`` event. ``writer`` is the
        user who must own the parent (``":<user>"``; "" for a service); ``title`` is clean
        already.

        The child is written first, then the parent (two slots): a crash in between leaves
        a child its parent does not list, never a parent listing a child that does not
        exist. A parent deleted meanwhile (``not_found``; ``forbidden`` if another user
        recreated it): the new child is deleted and the refusal raised. With
        ``existing_ok``, a ``chat_id`` that is ``parent``'s child already is no conflict:
        what is left is done, once (a redelivered turn opening its child again).
        ``agent`` answers the child; by default the parent's does.
        """
        found = await self.meta(parent)
        if found is None:
            raise Rejected("not_found", f"conversation {parent!r} does not exist")
        if writer and writer.removeprefix(":") != found.owner:
            raise Rejected("forbidden", "only the owner may open a sub-conversation"
                           if found.role_of(writer.removeprefix(":")) else
                           "conversation belongs to another user")
        made = self._child.decode(await self.pipeline.evalsha(
            *self._child.call(chat_id, found.owner, parent, self._new_epoch(),
                              agent or found.agent)))
        if made.created and made.feed is not None:
            await self._tell_owner(found.owner, made.feed, "ZADD", made.ts, chat_id)
        elif not (existing_ok and made.parent == parent):
            raise Rejected("conflict", f"conversation {chat_id!r} already exists")
        # Keyed by the child's epoch: once per child, and again for a child recreated later
        # under the same id (idempotency keys outlive a deletion).
        try:
            if title is not None:
                await self.publish(chat_id, [OutEvent(type="title", data=title.encode(),
                                                      title_source=title_source)],
                                   idempotency_key=f"child:{made.epoch}")
            await self.publish(parent, [OutEvent(
                type="child", data=msgspec.json.encode({"chat_id": chat_id, "title": title}),
                child=chat_id)], writer=writer, idempotency_key=f"child:{chat_id}:{made.epoch}")
        except Rejected as exc:
            if exc.code in ("not_found", "forbidden"):  # the parent went meanwhile
                await self.delete(chat_id)
            raise

    async def set_members(self, chat_id: str, writer: str, set_roles: dict[str, str],
                          remove: list[str], most: int) -> MembersChanged:
        """Share the conversation: ``set_roles`` (user -> ``member``/``viewer``) and
        ``remove``, atomically, by ``writer`` (``":<owner>"``; "" for a service); at most
        ``most`` members after. The room hears it from the script (``members``, and
        ``removed`` to each user removed); then the owner's and every member's list and feed
        get the conversation, and each removed user's lose it."""
        changed = self._members.decode(await self.pipeline.evalsha(*self._members.call(
            chat_id, writer, set_roles, remove, most)))
        issue = self.pipeline.issue
        await settled([
            *(issue("ZADD", index_key(user), "GT", changed.updated_at, chat_id)
              for user in changed.users),
            *(issue("SPUBLISH", feed_channel(user), changed.feed)
              for user in (changed.owner, *changed.users)),
            *(issue("ZREM", index_key(user), chat_id) for user in changed.removed),
            *(issue("SPUBLISH", feed_channel(user), changed.gone) for user in changed.removed),
        ])
        return changed

    async def expiring(self, before: int, per_bucket: int) -> list[str]:
        """Conversations whose last list change is older than ``before`` (ms): the oldest
        ``per_bucket`` of each retention bucket, all read in one batch."""
        replies = await asyncio.gather(*(
            self.pipeline.execute("ZRANGEBYSCORE", expiry_key(bucket), "-inf", f"({before}",
                                  "LIMIT", 0, per_bucket)
            for bucket in range(EXPIRY_BUCKETS)))
        return [chat.decode() for reply in replies for chat in reply]

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
        self, user_id: str, cursor: Place | None, limit: int, wanted: ListFilter | None = None
    ) -> tuple[list[tuple[str, Meta]], Place | None]:
        """Up to ``limit`` of the user's conversations that ``wanted`` keeps, in the walk's
        order (:mod:`.listing`) after ``cursor``, and the place to go on from (None when
        the walk is over).

        A request reads at most ``GATEWAY_LIST_SCAN`` entries of the list: a filter that
        passes over them all returns fewer than ``limit``, or none, with the place it
        reached. Entries are read in runs, each run's meta hashes in one batch.
        """
        wanted = wanted or ListFilter()
        place, low = wanted.start(cursor), wanted.low
        run = max(limit + 1, 100) if wanted.selective else limit + 1
        fetch = ListFilter.FIELDS if wanted.selective else None
        found: list[tuple[str, dict[str, str]]] = []
        scanned = 0
        while True:
            want = min(run, self.settings.list_scan - scanned)
            rows = self._list.decode(await self.pipeline.evalsha(
                *self._list.call(user_id, place, low, want)))
            fields = await asyncio.gather(*(self._meta_fields(chat, fetch) for chat, _ in rows))
            for i, ((chat, score), got) in enumerate(zip(rows, fields, strict=True)):
                place = Place(score, chat)
                if wanted.matches(got):
                    found.append((chat, got))
                    if len(found) == limit:  # done; the walk goes on unless nothing followed
                        more = i + 1 < len(rows) or len(rows) == want
                        return await self._listed(found, wanted, fetch), place if more else None
            scanned += len(rows)
            if len(rows) < want:
                return await self._listed(found, wanted, fetch), None
            if scanned >= self.settings.list_scan:
                return await self._listed(found, wanted, fetch), place

    async def _meta_fields(self, chat_id: str, fields: tuple[str, ...] | None) -> dict[str, str]:
        """The conversation's meta hash, or only ``fields`` of it, as text ({} if gone)."""
        if fields is None:
            return _text_fields(await self.pipeline.execute("HGETALL", meta_key(chat_id)))
        values = await self.pipeline.execute("HMGET", meta_key(chat_id), *fields)
        return {k: v.decode() for k, v in zip(fields, values, strict=True) if v is not None}

    async def _listed(self, found: list[tuple[str, dict[str, str]]], wanted: ListFilter,
                      fetched: tuple[str, ...] | None) -> list[tuple[str, Meta]]:
        """The kept conversations' states; when only some fields were read, the whole
        hashes now, each checked again (one that changed in between no longer fits)."""
        if fetched is not None:
            whole = await asyncio.gather(*(self._meta_fields(chat, None) for chat, _ in found))
            found = [(chat, got) for (chat, _), got in zip(found, whole, strict=True)
                     if wanted.matches(got)]
        listed = []
        for chat, got in found:
            meta = Meta.from_fields(got)
            if meta is not None:
                listed.append((chat, meta))
        return listed
