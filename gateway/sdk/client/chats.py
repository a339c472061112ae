"""What the client keeps per chat: whether the application wants it subscribed, the position
it resumes from (``seq``, ``epoch``), on which connection the server has it live or
buffered, whether a turn runs, whether it may be created, its open streams, its tree (nodes,
head, active path), and the callers waiting for its ``subscribed``."""

from __future__ import annotations

import asyncio

from ... import protocol as p
from ..streams import OpenStreams
from ..tree import ConversationTree
from .items import SubscribeResult


class Chat:
    __slots__ = ("agent", "buffered_gen", "create", "desired", "dropping", "epoch", "live_gen",
                 "presence", "resyncing", "running", "seq", "streams", "tree", "typed_at",
                 "typing", "waiters")

    def __init__(self) -> None:
        self.desired = False  # the application wants it subscribed (resubscribed on reconnect)
        self.dropping = False  # left: drop frames still in flight
        self.epoch: str | None = None
        self.seq: int | None = None  # last durable seq handed to the application
        self.live_gen: int | None = None  # connection on which the server has it live
        self.buffered_gen: int | None = None  # connection on which the server buffers it
        self.waiters: list[asyncio.Future[SubscribeResult]] = []
        self.streams = OpenStreams()
        self.tree = ConversationTree()
        self.resyncing = False  # a gap in a stream: waiting for a fresh snapshot
        self.create = True  # False: subscribe with create: false (not_found, never created)
        self.agent: str | None = None  # the agent that answers it, when a subscribe creates it
        self.running = False  # a turn runs: frames are expected (the watchdog listens closer)
        self.presence: p.PresenceList | None = None  # who is connected: the highest v seen
        self.typing: dict[str, float] = {}  # user id -> when (monotonic) their typing was heard
        self.typed_at = -1e18  # when (monotonic) this client last sent `typing` here


def check_chat_id(chat_id: str) -> None:
    if not p.CHAT_ID_RE.match(chat_id):
        raise ValueError(f"invalid chat_id {chat_id!r}")
