"""The tree operations' frames (``retry``, ``edit``, ``undo``, ``switch``; protocol.md, "Tree
operations"), and which head they expect: by default the head the client knows, so that of
two devices racing from the same head, one gets a clean ``conflict``."""

from __future__ import annotations

from enum import Enum
from typing import Any

from ..tree import ConversationTree


class HeadChoice(Enum):
    """What a tree operation sends as ``expected_head``, when not a node id (or None)."""

    KNOWN = "known"
    """The head the client knows for the chat (nothing when it knows none)."""
    ANY = "any"
    """No ``expected_head``: the operation applies to whatever the head is."""


KNOWN_HEAD = HeadChoice.KNOWN
ANY_HEAD = HeadChoice.ANY

ExpectedHead = str | None | HeadChoice
"""A node id, None (the chat has no head: nothing was said yet), or a :class:`HeadChoice`."""


def op_frame(kind: str, chat_id: str, tree: ConversationTree, expected_head: ExpectedHead,
             cancel: bool, **fields: Any) -> dict[str, Any]:
    """The frame of a tree operation (or a message), its ``expected_head`` resolved now."""
    frame: dict[str, Any] = {"type": kind, "chat_id": chat_id, **fields}
    if expected_head is KNOWN_HEAD:
        if tree.head_known:
            frame["expected_head"] = tree.head
    elif expected_head is not ANY_HEAD:
        frame["expected_head"] = expected_head
    if cancel:
        frame["cancel"] = True
    return frame
