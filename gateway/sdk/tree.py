"""A conversation's tree as a client holds it: the nodes, the head, the active path.

Pure bookkeeping, no I/O, shared by every client (the Python SDK here; the browser module
keeps the same ``ConversationTree`` in JavaScript). The rules, from ``protocol.md`` ("The
conversation tree"):

- nodes are user messages (``user_message.data.msg_id``, parent ``data.parent_id``: the turn
  it follows, or null for a first message) and turns (``turn_start.data.turn_id``, parent
  ``data.parent_id``: the message it answers); siblings, in creation order, are versions
  (edits of a message, retries of an answer);
- the head moves only by durable ``head`` events ``{head_id, prev_head_id, cause, by}``; a
  ``subscribed`` snapshot, an ``ack`` and a history page also tell the head, each as of a seq.
  The tree keeps the seq its head is known at, so older news never moves it back (a replay
  after a resume carries every old move, and the snapshot already told the last one);
- a history page of the active path (``GET .../events``) gives that path's events and its
  ``forks`` (``{node_id: {siblings, index}}``): siblings the client has not seen are kept as
  placeholders (``seen`` false) under the same parent;
- ``recovered: false`` means the history cannot be bridged: :meth:`ConversationTree.reset`,
  then reload.

The tree does not keep events: :meth:`ConversationTree.visible` tells whether an event
belongs on the active path (its ``node`` is on it, or it has none).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

NodeKind = Literal["user", "turn"]


@dataclass(slots=True)
class TreeNode:
    """One node: a user message or a turn."""

    id: str
    kind: NodeKind
    parent_id: str | None
    seq: int | None
    """The seq of the event that created it (None for a placeholder)."""
    seen: bool
    """Its creating event was applied (else it is known from a page's ``forks``), so the
    events of it the client received are all there are."""
    children: list[str] = field(default_factory=list)
    """Its children, in creation order."""


@dataclass(frozen=True, slots=True)
class HeadMove:
    """The head changed: to ``head`` from ``previous`` (None for no node)."""

    head: str | None
    previous: str | None
    seq: int | None
    """The seq the new head is known at (None when not told)."""
    cause: str | None = None
    """``message``, ``retry``, ``edit``, ``undo``, ``switch`` (from a ``head`` event), or
    None when a snapshot, a page or an ack told it."""
    by: str | None = None


@dataclass(frozen=True, slots=True)
class Siblings:
    """A node's versions (itself included), in creation order, and its place among them."""

    ids: list[str]
    index: int

    @property
    def count(self) -> int:
        return len(self.ids)


class ConversationTree:
    """The nodes of one conversation, its head and the active path."""

    __slots__ = ("_path", "head", "head_known", "head_seq", "nodes", "roots")

    def __init__(self) -> None:
        self.nodes: dict[str, TreeNode] = {}
        self.roots: list[str] = []  # the first messages (and their edits), in creation order
        self.head: str | None = None
        self.head_known = False  # told the head at all (None is a head: an empty chat's)
        self.head_seq = -1  # the seq the head is known at
        self._path: list[str] | None = None  # the active path, computed on demand

    def reset(self) -> None:
        """Forget everything (``recovered: false``: the history must be reloaded)."""
        self.nodes.clear()
        self.roots.clear()
        self.head, self.head_known, self.head_seq = None, False, -1
        self._path = None

    # --- what the client receives -----------------------------------------------------

    def apply(self, frame: Mapping[str, Any]) -> HeadMove | None:
        """Apply one durable event frame (live, replayed, or from a history page); returns
        the head's move when it moved. Events of no concern to the tree are ignored, and so
        is a frame applied twice."""
        seq = frame.get("seq")
        data = frame.get("data")
        if not isinstance(seq, int) or not isinstance(data, Mapping):
            return None
        kind = frame.get("type")
        if kind == "user_message" or (kind == "tool_result" and "msg_id" in data):
            # a person's answer to a client tool is a node of their side too
            self._add(data.get("msg_id"), "user", data.get("parent_id"), seq)
        elif kind == "turn_start":
            self._add(data.get("turn_id"), "turn", data.get("parent_id"), seq)
        elif kind == "head":
            head = data.get("head_id")
            if head is None or isinstance(head, str):
                return self._move(head, seq, _str(data.get("cause")), _str(data.get("by")))
        return None

    def set_head(self, head: str | None, seq: int | None) -> HeadMove | None:
        """The head as of ``seq`` (a ``subscribed`` snapshot's or a page's ``last_seq``, an
        ack's ``seq``); None for a seq nobody told: taken only when no head is known yet."""
        if seq is None:
            if self.head_known:
                return None
            seq = -1
        return self._move(head, seq, None, None)

    def load_page(self, page: Mapping[str, Any]) -> HeadMove | None:
        """A page of ``GET /v1/conversations/{chat_id}/events``: its events, its ``forks``
        (``view=active``) and its ``head`` as of its ``last_seq``."""
        moves = [self.apply(event) for event in page.get("events") or ()]
        forks = page.get("forks")
        if isinstance(forks, Mapping):
            self.load_forks(forks)
        move = None
        if "head" in page:
            last_seq = page.get("last_seq")
            move = self.set_head(page.get("head"), last_seq if isinstance(last_seq, int) else None)
        # One move for the page: from where it was before to where it is now.
        done = [m for m in [*moves, move] if m is not None]
        if not done:
            return None
        return HeadMove(done[-1].head, done[0].previous, done[-1].seq, done[-1].cause,
                        done[-1].by)

    def load_forks(self, forks: Mapping[str, Any]) -> None:
        """``forks`` of a history page: ``{node_id: {siblings, index}}`` for the path's nodes
        that have siblings. Apply the page's events first: a sibling is placed under its
        node's parent, which the node's event told."""
        for node_id, fork in forks.items():
            node = self.nodes.get(node_id)
            siblings = fork.get("siblings") if isinstance(fork, Mapping) else None
            if node is None or not isinstance(siblings, list):
                continue
            for sibling in siblings:
                if isinstance(sibling, str) and sibling not in self.nodes:
                    self.nodes[sibling] = TreeNode(sibling, node.kind, node.parent_id, None, False)
            listed = [s for s in siblings if isinstance(s, str)]
            group = self._children_of(node.parent_id, node.kind)
            # The page's order is the creation order; children it does not list are newer.
            group[:] = listed + [c for c in group if c not in listed]
        self._path = None

    # --- what the application asks ----------------------------------------------------

    def path(self) -> list[str]:
        """The active path's node ids, from the first message to the head. It starts at
        the oldest node whose parent the client knows of (a client that subscribed live
        and loaded no history knows only the nodes made since)."""
        if self._path is None:
            path: list[str] = []
            node_id = self.head
            while node_id is not None and len(path) <= len(self.nodes):
                path.append(node_id)
                node = self.nodes.get(node_id)
                node_id = node.parent_id if node is not None else None
            path.reverse()
            self._path = path
        return list(self._path)

    def on_path(self, node_id: str | None) -> bool:
        return node_id is not None and node_id in self._path_set()

    def visible(self, frame: Mapping[str, Any]) -> bool:
        """Whether an event belongs on the active path: its ``node`` is on it, or it has
        none (conversation-level events, ephemeral frames)."""
        node = frame.get("node")
        return node is None or (isinstance(node, str) and node in self._path_set())

    def siblings(self, node_id: str) -> Siblings:
        """The versions of ``node_id`` (itself included) and its index among them; a node
        whose siblings the client does not know is alone (``[node_id]``, 0)."""
        node = self.nodes.get(node_id)
        if node is None:
            return Siblings([node_id], 0)
        parent = self.nodes.get(node.parent_id) if node.parent_id is not None else None
        group = self.roots if node.parent_id is None else parent.children if parent else []
        if node_id not in group:
            return Siblings([node_id], 0)
        return Siblings(list(group), group.index(node_id))

    def forks(self) -> dict[str, Siblings]:
        """The siblings of every node on the active path that has some."""
        found = {}
        for node_id in self.path():
            siblings = self.siblings(node_id)
            if siblings.count > 1:
                found[node_id] = siblings
        return found

    def missing(self) -> list[str]:
        """Nodes of the active path whose events the client may not hold (placeholders, and
        nodes it never heard of): reload the path's history to show it."""
        return [n for n in self.path() if not (node := self.nodes.get(n)) or not node.seen]

    # --- internals --------------------------------------------------------------------

    def _path_set(self) -> frozenset[str]:
        return frozenset(self.path())

    def _children_of(self, parent_id: str | None, child_kind: NodeKind) -> list[str]:
        """The list a node of ``child_kind`` under ``parent_id`` belongs to."""
        if parent_id is None:
            return self.roots
        parent = self.nodes.get(parent_id)
        if parent is None:
            # A parent not known yet (a client that joined live): a placeholder holds its
            # children until it comes. A message's parent is a turn, a turn's a message.
            kind: NodeKind = "turn" if child_kind == "user" else "user"
            parent = self.nodes[parent_id] = TreeNode(parent_id, kind, None, None, False)
        return parent.children

    def _add(self, node_id: Any, kind: NodeKind, parent_id: Any, seq: int) -> None:
        if not isinstance(node_id, str) or not (parent_id is None or isinstance(parent_id, str)):
            return
        node = self.nodes.get(node_id)
        if node is not None and node.seen:
            return
        if node is None:
            node = self.nodes[node_id] = TreeNode(node_id, kind, parent_id, seq, True)
        else:  # a placeholder (a page's fork, or a parent its children came before)
            node.kind, node.parent_id, node.seq, node.seen = kind, parent_id, seq, True
        self._path = None
        group = self._children_of(parent_id, kind)
        if node_id in group:
            return
        # Creation order: before the first sibling created later (placeholders keep their
        # places; a node applied out of order, say from an older page, finds its own).
        at = len(group)
        for i, other in enumerate(group):
            other_seq = self.nodes[other].seq if other in self.nodes else None
            if other_seq is not None and other_seq > seq:
                at = i
                break
        group.insert(at, node_id)

    def _move(self, head: str | None, seq: int, cause: str | None,
              by: str | None) -> HeadMove | None:
        if self.head_known and seq < self.head_seq:
            return None  # older news: a later move is known already
        previous, was_known = self.head, self.head_known
        self.head, self.head_known, self.head_seq = head, True, max(seq, self.head_seq)
        self._path = None
        if was_known and previous == head:
            return None
        return HeadMove(head, previous, seq if seq >= 0 else None, cause, by)


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) else None

