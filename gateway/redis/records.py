"""What the store writes and reads, typed: events to append, results, a conversation's state.

These are the values that cross between the gateway and its Lua scripts. How each one is
put into a script's arguments, or read out of its reply, is :mod:`.scripts`'s business.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec


class OutEvent(msgspec.Struct, frozen=True, kw_only=True):
    """One event to append. ``data`` is a JSON object (the raw text for ``title``).

    The named fields below apply to some types only; the store's script completes those
    types where the conversation's state lives (``publish.lua`` documents each).
    """

    type: str
    data: bytes
    durable: bool = True
    preview: str = ""  # user_message: the conversation list's preview
    turn_id: str = ""  # turn_start: the new turn; turn_end, cancel_requested: the expected
    title_source: str = ""  # title: who set it ("user", "agent")
    attempt: str = ""  # a streamed delta or its commit: which run of the turn sent it
    fill: bool = False  # a commit without text: it takes the stream's text
    child: str = ""  # child: the sub-conversation's chat id
    state: bytes = b""  # state: the agent state's snapshot (JSON), kept as the conversation's
    tools: bytes = b""  # client_tools: the conversation's client tools (JSON)
    awaiting: str = ""  # tool_call: "<call id> <name>" when it asks a person (a client tool)


class TreeOp(msgspec.Struct, frozen=True, kw_only=True):
    """A batch that changes the conversation tree (``publish.lua`` documents each kind)."""

    kind: str  # message | retry | edit | undo | switch
    by: str  # who asks: the head event's "by"
    expected_head: str | msgspec.UnsetType | None = msgspec.UNSET  # None: no head expected
    cancel: bool = False  # end a running turn first, instead of being refused
    node: str = ""  # edit: the message it replaces; switch: the node it goes to
    msg_id: str = ""  # message, edit: the new user message's id


class TakenMessage(msgspec.Struct, frozen=True):
    """The user message a retry answers again, or that an undo takes back."""

    msg_id: str
    seq: int
    text: str
    client_msg_id: str
    data: Any = None  # the message's own data object, if it had one


class Published(msgspec.Struct, frozen=True):
    """What one publish did (``publish.lua``'s reply)."""

    epoch: str
    last_seq: int
    owner: str
    duplicate: bool
    ts: int
    seqs: list[int | None] = []  # one per event: its seq, or None for an ephemeral one
    turn_id: str | None = None  # the turn this batch started, or cancelled
    created: bool = False  # this batch created the conversation
    listed: bool = False  # the owner's conversation list and feed must hear of it
    feed: str | None = None  # the feed frame that tells them
    head: str = ""  # the conversation's head after the batch ("" for none)
    cancelled: str | None = None  # the running turn a tree operation ended first
    message: TakenMessage | None = None  # retry, undo: the message answered again, taken back
    msg_id: str | None = None  # the user message the batch added
    filed: str | None = None  # the turn the batch's other durable events belong to
    agent: str = "default"  # the agent that answers the conversation
    members: list[str] = []  # listed: the others whose list and feed must hear of it too


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
    head: str | None = None  # the node the next message follows
    usage_billed: bytes = b"{}"  # JSON: every turn's usage, on every branch
    usage_active: bytes = b"{}"  # JSON: the usage of the turns on the active path
    message_count: int = 0  # nodes on the active path: user messages and turns
    parent: str | None = None  # a sub-conversation: its parent's chat id
    state: bytes | None = None  # JSON: the agent's state (a `state` event's snapshot)
    agent: str = "default"  # the agent that answers it
    tools: bytes | None = None  # JSON: the client tools (protocol ClientTool list)
    awaiting: bytes | None = None  # JSON: {call id: tool name} awaiting a person's answer
    # The people it is shared with, besides its owner: user -> "member" | "viewer" (meta
    # fields "role:<user>", lua/members.lua).
    members: dict[str, str] = msgspec.field(default_factory=dict)

    def role_of(self, user_id: str) -> str | None:
        """``owner``, ``member``, ``viewer``, or None for someone it is not shared with."""
        return "owner" if user_id == self.owner else self.members.get(user_id)

    @classmethod
    def from_fields(cls, fields: Mapping[str, str]) -> Meta | None:
        """The state from the hash's fields (empty strings are unset); None without one."""
        if "epoch" not in fields:
            return None
        get = fields.get

        def text(name: str) -> str | None:
            return get(name) or None

        def number(name: str) -> int | None:
            value = get(name)
            return int(value) if value else None

        goal = get("goal")
        return cls(
            owner=fields["owner"],
            epoch=fields["epoch"],
            seq=int(fields["seq"]),
            status=fields["status"],
            title=text("title"),
            turn_id=text("turn_id"),
            started_at=number("started_at"),
            goal=goal.encode() if goal else None,
            preview=text("preview"),
            created_at=number("created_at") or 0,
            updated_at=number("updated_at") or number("created_at") or 0,
            head=text("head"),
            usage_billed=(get("usage_billed") or "{}").encode(),
            usage_active=(get("usage_active") or "{}").encode(),
            message_count=number("msgs") or 0,
            parent=text("parent"),
            state=(get("state") or "").encode() or None,
            agent=get("agent") or "default",
            tools=(get("tools") or "").encode() or None,
            awaiting=(get("awaiting") or "").encode() or None,
            members={k[5:]: v for k, v in fields.items() if k.startswith("role:")},
        )


class OpenStream(msgspec.Struct, frozen=True):
    """A streamed answer not yet committed: its text so far and its next position."""

    id: str
    type: str
    turn_id: str
    text: str
    pos: int


class Fork(msgspec.Struct, frozen=True):
    """A node on the active path that has siblings: all of them, and where it stands."""

    siblings: list[str]
    index: int


class PathPage(msgspec.Struct, frozen=True):
    """A page of the active path's events (``history.lua``'s reply)."""

    meta: Meta
    events: list[bytes]  # the frames, as stored
    scanned: int  # the last seq looked at: the next page starts after it
    forks: dict[str, Fork]
    trimmed: bool = False  # history was trimmed past the path's start: it begins later


class TreeNode(msgspec.Struct, frozen=True):
    """One node of the conversation tree: a user message or a turn."""

    id: str
    kind: str  # "user" | "turn"
    parent_id: str | None
    seq: int  # the seq of its first event (user_message, turn_start)
    preview: str | None  # a user message's text, or a turn's answer, as the list shows it
    children: list[str]
    last_child: str | None  # the child last on the active path
    usage: dict[str, int | float] | None = None  # a turn's, as its turn_end reported it
    trimmed: bool = False  # its events are gone from the log (history trimmed past them)


class Tree(msgspec.Struct, frozen=True):
    """The whole conversation tree (``tree_read.lua``'s reply, decoded)."""

    head: str | None
    nodes: list[TreeNode]  # by seq
    roots: list[str]  # the first messages (siblings when the first was edited)
    last_root: str | None  # the first message on the last active path

    def forks(self) -> list[tuple[str | None, str]]:
        """Every fork (a node with several children; None for the first messages) and the
        leaf last active below it: where a switch to it goes."""
        by_id = {n.id: n for n in self.nodes}

        def leaf(node_id: str) -> str:
            node = by_id.get(node_id)
            while node is not None and node.last_child:
                node_id = node.last_child
                node = by_id.get(node_id)
            return node_id

        found: list[tuple[str | None, str]] = []
        if len(self.roots) > 1 and self.last_root:
            found.append((None, leaf(self.last_root)))
        found += [(n.id, leaf(n.id)) for n in self.nodes if len(n.children) > 1]
        return found


class History(msgspec.Struct, frozen=True):
    """A conversation's state, open streams and the durable frames after some seq, read
    atomically (``read.lua``'s reply)."""

    meta: Meta | None
    frames: list[tuple[int, bytes]]
    streams: list[OpenStream] = []
    created: bool = False
    feed: str | None = None  # when created: the feed frame that announces it
    children: list[str] = []  # the ids of its sub-conversations, oldest first
