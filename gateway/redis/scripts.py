"""The Lua scripts' contracts: each script's keys and arguments are built, and its reply
decoded, here and nowhere else.

A script's arguments stay positional on the wire (``ARGV``; each script's header lists
them), but only the ``args`` method of its class here writes them. Every script replies
with one JSON object, decoded into a typed struct of :mod:`.records`.
"""

from __future__ import annotations

from importlib import resources
from typing import Any

import msgspec

from ..config import Settings
from ..errors import Rejected
from .keys import (
    children_key,
    idem_key,
    index_key,
    log_key,
    meta_key,
    room_channel,
    starts_key,
    text_key,
    tree_key,
)
from .pipeline import Script
from .records import (
    Fork,
    History,
    Meta,
    OpenStream,
    OutEvent,
    PathPage,
    Published,
    TakenMessage,
    Tree,
    TreeNode,
    TreeOp,
)


def load(*names: str) -> Script:
    """Scripts joined, with ``lua/lib.lua`` (what every script needs first) in front of them.

    Lua defines a script's functions anew on every call, so a script's short paths come
    before the definitions only its general path needs: ``publish.lua``, then ``meta.lua``
    (the conversation's state) and ``tree.lua``, then ``publish_batch.lua``.
    """
    lua = resources.files(__package__).joinpath("lua")
    return Script("".join(lua.joinpath(name).read_text() for name in ("lib.lua", *names)))


Call = tuple[Script, list[str], list[Any]]  # a script, its keys and its arguments


def _conversation_keys(chat_id: str, settings: Settings) -> list[str]:
    """The keys every conversation script gets: meta, log, tree, starts, the text keys, and
    the sub-conversations last."""
    return [meta_key(chat_id), log_key(chat_id), tree_key(chat_id), starts_key(chat_id),
            *(text_key(chat_id, kind) for kind in settings.stream_types), children_key(chat_id)]


class _ErrorBody(msgspec.Struct, frozen=True):
    code: str
    message: str
    head: str | None = None


class _Refusal(msgspec.Struct, frozen=True):
    error: _ErrorBody
    owner: str | None = None  # a refused late turn_end whose usage was counted:
    feed: str | None = None  # the feed frame that tells its owner
    members: list[str] = []  # and its members


class Refused(Rejected):
    """A refusal that still changed what the owner's feed shows (a late turn_end's usage)."""

    def __init__(self, code: str, message: str, owner: str, feed: str,
                 members: list[str] | None = None) -> None:
        super().__init__(code, message)
        self.owner, self.feed, self.members = owner, feed, members or []


def script_arg(event: OutEvent) -> str:
    """The one argument ``publish.lua`` takes per event beside type, durable and data;
    what it means depends on the type."""
    kind = event.type
    if kind == "user_message":
        return event.preview
    if kind in ("turn_start", "turn_end", "cancel_requested"):
        return event.turn_id
    if kind == "title":
        return event.title_source
    if kind == "child":
        return event.child
    if kind == "state":
        return event.state.decode()
    if kind == "client_tools":
        return event.tools.decode()
    if kind == "tool_call" and event.awaiting:
        return "?" + event.awaiting
    if kind == "tool_result" and event.preview:
        return event.preview
    if event.durable and event.fill:
        return f"{event.attempt} fill"
    return event.attempt


def _op_args(op: TreeOp | None) -> list[str]:
    """ARGV[11..16] of ``publish.lua``: the tree operation, or none."""
    if op is None:
        return ["", "", "0", "", "", ""]
    expected = op.expected_head
    return [op.kind, "" if expected is msgspec.UNSET else "^" if expected is None else expected,
            "1" if op.cancel else "0", op.node, op.by, op.msg_id]


class _Taken(msgspec.Struct, frozen=True):
    msg_id: str
    seq: int
    frame: str


class _UserMessageData(msgspec.Struct, frozen=True):
    text: str = ""
    client_msg_id: str = ""
    data: Any = None


class _UserMessage(msgspec.Struct, frozen=True):
    data: _UserMessageData = _UserMessageData()


class _PublishReply(Published, frozen=True):
    message: _Taken | None = None  # type: ignore[assignment]


class PublishScript:
    """``publish.lua``: append a batch of events to one conversation."""

    def __init__(self, settings: Settings) -> None:
        self.script = load("publish.lua", "meta.lua", "tree.lua", "publish_batch.lua")
        self._settings = settings
        self._types = ",".join(settings.stream_types)
        self._decode = msgspec.json.Decoder(_PublishReply).decode
        self._message = msgspec.json.Decoder(_UserMessage).decode
        self._refusal = msgspec.json.Decoder(_Refusal).decode

    def call(self, chat_id: str, events: list[OutEvent], *, fresh: str, create_owner: str,
             writer: str, idempotency_key: str | None, op: TreeOp | None = None,
             turn: str = "", agent: str = "") -> Call:
        s = self._settings
        keys = _conversation_keys(chat_id, s)
        if idempotency_key is not None:
            keys.append(idem_key(chat_id, idempotency_key))
        args: list[Any] = [room_channel(chat_id), s.history_maxlen, s.idempotency_ttl,
                           create_owner, fresh, chat_id, len(events), writer, self._types,
                           s.stream_max_bytes, *_op_args(op), turn,
                           agent or s.default_agent]
        for event in events:
            args += [event.type, "1" if event.durable else "0", event.data, script_arg(event)]
        return self.script, keys, args

    def decode(self, reply: bytes) -> Published:
        """The result; raises :class:`Rejected` when the script refused the batch."""
        try:
            r = self._decode(reply)
        except msgspec.ValidationError:
            refusal = self._refusal(reply)
            error = refusal.error
            if refusal.feed is not None and refusal.owner is not None:
                raise Refused(error.code, error.message, refusal.owner, refusal.feed,
                              refusal.members) from None
            raise Rejected(error.code, error.message, error.head) from None
        taken = None
        if r.message is not None:
            data = self._message(r.message.frame).data
            taken = TakenMessage(r.message.msg_id, r.message.seq, data.text, data.client_msg_id,
                                 data.data)
        return Published(**{**msgspec.structs.asdict(r), "message": taken})


class _ReadReply(msgspec.Struct, frozen=True):
    meta: dict[str, str] | None = None
    created: bool = False
    feed: str | None = None
    streams: list[OpenStream] = []
    children: list[str] = []
    frames: list[tuple[int, msgspec.Raw]] = []


class ReadScript:
    """``read.lua``: state, open streams and frames after a seq, creating if asked."""

    def __init__(self, settings: Settings) -> None:
        self.script = load("meta.lua", "read.lua")
        self._settings = settings
        self._types = ",".join(settings.stream_types)
        self._decode = msgspec.json.Decoder(_ReadReply).decode

    def call(self, chat_id: str, after: int | None, limit: int, *, create_owner: str,
             fresh: str, create_agent: str = "") -> Call:
        return self.script, _conversation_keys(chat_id, self._settings), [
            "" if after is None else after, limit, create_owner, fresh, chat_id, self._types,
            create_agent or self._settings.default_agent]

    def decode(self, reply: bytes) -> History:
        r = self._decode(reply)
        return History(
            meta=Meta.from_fields(r.meta) if r.meta is not None else None,
            frames=[(seq, bytes(frame)) for seq, frame in r.frames],
            streams=r.streams, created=r.created, feed=r.feed, children=r.children)


class Deleted(msgspec.Struct, frozen=True):
    owner: str | None = None  # None: there was no such conversation
    feed: str | None = None  # the feed frame that tells the owner's devices
    members: list[str] = []  # the others it was shared with: their lists drop it too
    parent: str = ""  # a sub-conversation's parent
    children: list[str] = []  # the sub-conversations it had (the store deletes them)
    kept: int | None = None  # retention kept it: when (ms) it could expire next


class DeleteScript:
    """``delete.lua``: delete a conversation and tell its room."""

    def __init__(self, settings: Settings) -> None:
        self.script = load("delete.lua")
        self._settings = settings
        self._decode = msgspec.json.Decoder(Deleted).decode

    def call(self, chat_id: str, untouched_ms: int = 0) -> Call:
        return self.script, _conversation_keys(chat_id, self._settings), [
            room_channel(chat_id), chat_id, untouched_ms]

    def decode(self, reply: bytes) -> Deleted:
        deleted: Deleted = self._decode(reply)
        return deleted


class MembersChanged(msgspec.Struct, frozen=True):
    """What ``members.lua`` did."""

    owner: str
    updated_at: int
    feed: str  # the feed frame for the owner and the members after the change
    gone: str  # the feed frame for the removed: gone from their list
    members: dict[str, str] = {}  # user -> role, after
    users: list[str] = []  # the members after, sorted
    removed: list[str] = []  # the users no longer members


class _MembersReply(msgspec.Struct, frozen=True):
    error: _ErrorBody | None = None


class MembersScript:
    """``members.lua``: set or remove a conversation's members' roles."""

    def __init__(self) -> None:
        self.script = load("meta.lua", "members.lua")
        self._decode = msgspec.json.Decoder(MembersChanged).decode
        self._refusal = msgspec.json.Decoder(_MembersReply).decode

    def call(self, chat_id: str, writer: str, set_roles: dict[str, str],
             remove: list[str], most: int) -> Call:
        args: list[Any] = [room_channel(chat_id), chat_id, writer, most, len(set_roles)]
        for user, role in set_roles.items():
            args += [user, role]
        return self.script, [meta_key(chat_id)], [*args, *remove]

    def decode(self, reply: bytes) -> MembersChanged:
        error = self._refusal(reply).error
        if error is not None:
            raise Rejected(error.code, error.message)
        changed: MembersChanged = self._decode(reply)
        return changed


class ChildCreated(msgspec.Struct, frozen=True):
    created: bool
    epoch: str  # the conversation's, new or existing
    ts: int = 0
    feed: str | None = None  # created: the feed frame that announces it
    parent: str = ""  # not created: the existing conversation's parent ("" for none)


class ChildScript:
    """``child.lua``: create a sub-conversation, its meta naming its parent."""

    def __init__(self) -> None:
        self.script = load("meta.lua", "child.lua")
        self._decode = msgspec.json.Decoder(ChildCreated).decode

    def call(self, chat_id: str, owner: str, parent: str, fresh: str, agent: str) -> Call:
        return self.script, [meta_key(chat_id)], [owner, fresh, chat_id, parent, agent]

    def decode(self, reply: bytes) -> ChildCreated:
        created: ChildCreated = self._decode(reply)
        return created


class RotateScript:
    """A new epoch for a conversation that still has the given one (its history went
    backwards, so old positions must stop meaning anything). Replies nothing."""

    def __init__(self) -> None:
        self.script = Script("if redis.call('HGET', KEYS[1], 'epoch') == ARGV[1] then "
                             "redis.call('HSET', KEYS[1], 'epoch', ARGV[2]) end")

    def call(self, chat_id: str, epoch: str, fresh: str) -> Call:
        return self.script, [meta_key(chat_id)], [epoch, fresh]


class _PathReply(msgspec.Struct, frozen=True):
    meta: dict[str, str] | None = None
    scanned: str = "0"  # a string: cjson would round a large number
    forks: dict[str, Fork] = {}
    events: list[msgspec.Raw] = []
    trimmed: bool = False


class HistoryScript:
    """``history.lua``: a page of the active path's events, and its forks."""

    def __init__(self) -> None:
        self.script = load("meta.lua", "tree.lua", "history.lua")
        self._decode = msgspec.json.Decoder(_PathReply).decode

    def call(self, chat_id: str, after: int, limit: int, tip: str = "") -> Call:
        return self.script, [meta_key(chat_id), log_key(chat_id), tree_key(chat_id)], [
            after, limit, tip]

    def decode(self, reply: bytes) -> PathPage | None:
        r = self._decode(reply)
        meta = Meta.from_fields(r.meta) if r.meta is not None else None
        if meta is None:
            return None
        return PathPage(meta, [bytes(e) for e in r.events], int(r.scanned), r.forks,
                        r.trimmed)


class _NodeRecord(msgspec.Struct, frozen=True):
    k: str = ""
    p: str = ""
    s: int = 0
    c: str = ""
    l: str = ""  # noqa: E741 (tree.lua's field name)
    v: str = ""
    u: dict[str, int | float] | None = None


class _TreeReply(msgspec.Struct, frozen=True):
    head: str | None = None
    nodes: dict[str, str] = {}
    first: str | None = None  # a string: cjson would round a large number


class TreeScript:
    """``tree_read.lua``: every node of the tree, and the head."""

    ROOT = "^"  # tree.lua's root record: the first messages

    def __init__(self) -> None:
        self.script = load("meta.lua", "tree_read.lua")
        self._decode = msgspec.json.Decoder(_TreeReply).decode
        self._record = msgspec.json.Decoder(_NodeRecord).decode

    def call(self, chat_id: str) -> Call:
        return self.script, [meta_key(chat_id), tree_key(chat_id), log_key(chat_id)], []

    def decode(self, reply: bytes) -> Tree | None:
        r = self._decode(reply)
        if r.head is None:
            return None
        records = {node_id: self._record(raw) for node_id, raw in r.nodes.items()}
        root = records.pop(self.ROOT, _NodeRecord())
        first = int(r.first) if r.first is not None else 0
        nodes = sorted((TreeNode(
            id=node_id, kind=rec.k, parent_id=rec.p or None, seq=rec.s,
            preview=rec.v or None, children=[c for c in rec.c.split(",") if c],
            last_child=rec.l or None, usage=rec.u, trimmed=rec.s < first)
            for node_id, rec in records.items()),
            key=lambda n: n.seq)
        return Tree(head=r.head or None, nodes=nodes,
                    roots=[c for c in root.c.split(",") if c], last_root=root.l or None)


class _ListReply(msgspec.Struct, frozen=True):
    rows: list[tuple[str, str]] = []


class ListScript:
    """``list.lua``: a run of a user's conversation list after a place in its walk."""

    def __init__(self) -> None:
        self.script = load("list.lua")
        self._decode = msgspec.json.Decoder(_ListReply).decode

    def call(self, user_id: str, place: tuple[int, str] | None, low: int | None,
             count: int) -> Call:
        """The entries after ``place`` (score, chat id; None: from the top) with scores
        of at least ``low``."""
        at, after = ("", "") if place is None else (str(place[0]), place[1])
        return self.script, [index_key(user_id)], [
            at, after, "-inf" if low is None else low, count]

    def decode(self, reply: bytes) -> list[tuple[str, int]]:
        return [(chat, int(float(score))) for chat, score in self._decode(reply).rows]
