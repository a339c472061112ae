"""What a conversation-list request asks for: its filter, and the place its walk resumes.

The list is the sorted set ``{u:<user>}:convs`` (:func:`.keys.index_key`), each
conversation scored by the time of its last list change. A walk goes newest first, and
within one millisecond by chat id descending: a :class:`Place`, (score, chat id), names a
point of that order that stays where it is while other entries move. A score only grows
(the store adds with ``GT``), so a changed conversation moves up, behind every walk under
way; ``lua/list.lua`` reads the entries after a place. protocol.md states what a walk
then sees.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import NamedTuple

import msgspec

from ..protocol import CHAT_ID_PATTERN

# "<score>:<chat id>", or a bare score: every entry of that millisecond is past (the
# cursor's form before it named a chat).
CURSOR_PATTERN = r"^[0-9]{1,15}(:" + CHAT_ID_PATTERN[1:-2] + r")?\Z"
_CURSOR_RE = re.compile(CURSOR_PATTERN)


class Place(NamedTuple):
    """A point of the walk: entries after it are older, or as old with a smaller chat id.
    As tuples, a smaller place is further along."""

    score: int
    chat_id: str  # "": past every entry of ``score``

    def cursor(self) -> str:
        return f"{self.score}:{self.chat_id}"

    @classmethod
    def of_cursor(cls, cursor: str) -> Place:
        assert _CURSOR_RE.match(cursor), cursor  # the query's pattern checked it
        score, _, chat_id = cursor.partition(":")
        return cls(int(score), chat_id)


class ListFilter(msgspec.Struct, frozen=True, kw_only=True):
    """Which conversations a list request wants (every field optional)."""

    status: str | None = None  # "running" or "idle"
    q: str | None = None  # a piece of the title, any case
    updated_after: int | None = None  # list time (score) > this, ms
    updated_before: int | None = None  # list time (score) < this, ms
    include_children: bool = False  # conversations with a parent too
    agent: str | None = None  # the agent that answers it

    # Meta fields :meth:`matches` reads: what a selective filter fetches of each entry.
    FIELDS = ("epoch", "status", "title", "parent", "agent")

    @property
    def selective(self) -> bool:
        """Whether it likely passes over many entries (status, title, agent): then the walk
        reads :attr:`FIELDS` of each entry first, and whole meta hashes only of those kept."""
        return self.status is not None or self.q is not None or self.agent is not None

    def start(self, cursor: Place | None) -> Place | None:
        """Where the walk resumes: after the cursor, and after ``updated_before``."""
        if self.updated_before is None:
            return cursor
        bound = Place(self.updated_before, "")
        return bound if cursor is None or bound < cursor else cursor

    @property
    def low(self) -> int | None:
        """The lowest list time kept."""
        return None if self.updated_after is None else self.updated_after + 1

    def matches(self, fields: Mapping[str, str]) -> bool:
        """Whether a conversation, by its meta fields, is wanted (the time range is the
        walk's bounds)."""
        if "epoch" not in fields:
            return False  # deleted since it was listed
        if not self.include_children and fields.get("parent"):
            return False
        if self.status is not None and \
                (fields.get("status") == "running") != (self.status == "running"):
            return False
        if self.agent is not None and (fields.get("agent") or "default") != self.agent:
            return False
        return self.q is None or self.q.casefold() in (fields.get("title") or "").casefold()
