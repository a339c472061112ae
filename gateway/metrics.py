"""What this process counts, and the metric families built from the counts on scrape.

Modules count in plain integers: ``COUNTS.x += 1`` on :data:`COUNTS` here (the Redis layer
has its own, :data:`~gateway.redis.counters.REDIS`). Nothing on a hot path touches a
metric object: fan-out adds the size of its sets once per frame, never per recipient.
On scrape, :func:`families` reads every count, and the state worth a gauge, into
:class:`Family` values; :mod:`gateway.scrape` samples that state from the runtime and turns
the families into the Prometheus exposition. Nothing here knows the runtime: every module
counts into this one, so it imports none of them.

Every label takes a value from a small fixed set (a close code, an error code, a frame
type, an inbox partition's index, a consumer group, a Redis node), never a chat or a user.
"""

from __future__ import annotations

import typing
from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, NamedTuple

from . import closecodes
from . import protocol as p
from .errors import HTTP_STATUS
from .redis.counters import REDIS

if TYPE_CHECKING:
    from .redis.agent_inbox import InboxGroup

PREFIX = "gateway_"


class Counts:
    """This process's counts outside the Redis layer (see each module for where)."""

    __slots__ = ("agents", "bytes_out", "closed", "connections", "conversations_expired",
                 "direct", "discarded", "fanouts", "frames_in", "gap_repairs", "handed",
                 "handoffs_swept", "history_lost", "opened", "replayed", "replays", "replies",
                 "resyncs", "sent", "snapshots", "turn_timeouts")

    def __init__(self) -> None:
        self.opened = 0  # WebSocket handshakes (connect.py)
        self.connections = 0  # WebSocket sessions running now (connect.py)
        self.closed: Counter[int] = Counter()  # by close code (connect.py, session.py)
        self.frames_in: Counter[type | None] = Counter()  # by client frame class; None: invalid
        self.replies = 0  # frames a session writes of its own: hello, ack, error... (session.py)
        self.sent = 0  # live frames a session writes: room events, the feed (session.py)
        self.replayed = 0  # frames a session writes from history or held back (session.py)
        self.bytes_out = 0  # bytes of the frames above and of the direct lane's
        self.fanouts = 0  # frames a room fanned out (rooms.py)
        self.direct = 0  # deliveries written straight to sockets by fan-out (rooms.py)
        self.handed = 0  # deliveries handed to members (sessions, SSE) by fan-out (rooms.py)
        self.replays: Counter[tuple[bool, bool]] = Counter()  # (recovered, overflowed)
        self.gap_repairs = 0  # gaps pub/sub left, read back from the log (hub.py)
        self.history_lost = 0  # rooms whose history was lost or replaced (rooms.py)
        self.resyncs = 0  # members told so: `subscribed` with recovered false (rooms.py)
        self.snapshots = 0  # open streams sent whole in `subscribed` (session.py)
        self.discarded = 0  # open streams dropped by stream_discarded (rooms.py)
        self.turn_timeouts = 0  # turns the sweeper ended with reason timeout
        self.handoffs_swept = 0  # hand-offs the sweeper did for a gateway that did not
        self.conversations_expired = 0  # deleted by retention (retention.py)
        self.agents: list[dict[str, int]] = []  # stats of the agent workers in this process


COUNTS = Counts()


class Family(NamedTuple):
    """One metric family's samples. ``samples`` pairs label values with a number (a
    counter's total, a gauge's value) or, for a histogram, a :class:`Histogram`.
    ``aggregate`` says how a gauge sums over ``--workers`` processes (prometheus-client's
    multiprocess modes)."""

    name: str
    kind: str  # "counter", "gauge" or "histogram"
    help: str
    labels: tuple[str, ...]
    samples: list[tuple[tuple[str, ...], Any]]
    aggregate: str = "livesum"


def _one(value: float) -> list[tuple[tuple[str, ...], Any]]:
    return [((), value)]


def _by(counts: Iterable[tuple[str, int]]) -> list[tuple[tuple[str, ...], Any]]:
    """Label values summed (two keys may map to one value, e.g. ``other``)."""
    summed: dict[str, int] = {}
    for label, count in counts:
        summed[label] = summed.get(label, 0) + count
    return [((label,), count) for label, count in sorted(summed.items())]


# --- bounded label values ------------------------------------------------------------------

CLOSE_CODES = frozenset({1000, 1001, 1005, 1006, 1009, 1011, 1012, 1013} | {
    value for name, value in vars(closecodes).items() if name.isupper()})
ERROR_CODES = frozenset(HTTP_STATUS)
FRAME_TYPES: dict[type, str] = {cls: str(cls.__struct_config__.tag)
                                for cls in typing.get_args(p.ClientFrame)}


def close_label(code: int) -> str:
    """A close code as a label: one the gateway or the WebSocket standard uses, or other
    (a client may close with any code from 1000 to 4999)."""
    return str(code) if code in CLOSE_CODES else "other"


def frame_label(cls: type | None) -> str:
    if cls is None:
        return "invalid"
    return FRAME_TYPES.get(cls, "other")


# --- state sampled from Redis ----------------------------------------------------------------


class Sampled:
    """What a scrape asks Redis: readiness as ``/readyz`` reports it, the agent inbox's
    consumer groups and running turns. :func:`gateway.scrape.sample` refreshes it before
    each scrape (and each write of this process's multiprocess files), not on any
    request's path."""

    def __init__(self) -> None:
        self.ready: dict[str, bool] = {}
        self.groups: list[InboxGroup] = []
        self.running: list[int] = []  # turns running, per inbox partition


# --- the families --------------------------------------------------------------------------


def families(census: tuple[int, int, int], sampled: Sampled, tasks: int) -> list[Family]:
    """Every metric of this process, read now (on the event loop's thread). ``census`` is
    the hub's rooms, members and open streams (:meth:`gateway.hub.Hub.census`); ``tasks``
    is how many asyncio tasks the process has (counting them costs about a microsecond
    each)."""
    c, r = COUNTS, REDIS
    rooms, members, streams = census
    agent = Counter[str]()
    for stats in c.agents:
        agent.update(stats)
    groups = [((str(g.partition), g.group), g) for g in sampled.groups]
    return [
        # connections
        Family("gateway_connections", "gauge", "WebSocket sessions open", (),
               _one(c.connections)),
        Family("gateway_connections_opened", "counter", "WebSocket handshakes", (),
               _one(c.opened)),
        Family("gateway_connections_closed", "counter",
               "WebSocket connections ended, by close code (4008: slow consumer)", ("code",),
               _by((close_label(code), n) for code, n in c.closed.items())),
        Family("gateway_subscriptions", "gauge",
               "Room memberships: WebSocket subscriptions (buffering ones too) and SSE readers",
               (), _one(members)),
        Family("gateway_rooms", "gauge", "Conversations with members in this process", (),
               _one(rooms)),
        # frames
        Family("gateway_frames_in", "counter", "Client frames received, by type", ("type",),
               _by((frame_label(cls), n) for cls, n in c.frames_in.items())),
        Family("gateway_frames_out", "counter",
               "Frames written to WebSockets: live events (rooms, the conversation feed), "
               "replayed (history, buffers, frames held during a read), replies", ("class",),
               [(("event",), c.direct + c.sent), (("replay",), c.replayed),
                (("reply",), c.replies)]),
        Family("gateway_bytes_out", "counter", "Bytes of the frames written to WebSockets",
               (), _one(c.bytes_out)),
        Family("gateway_fanouts", "counter", "Frames fanned out by rooms", (), _one(c.fanouts)),
        Family("gateway_deliveries", "counter",
               "Room frames delivered: written straight to sockets by fan-out (direct), or "
               "handed to members that send, hold or buffer them (handed)", ("lane",),
               [(("direct",), c.direct), (("handed",), c.handed)]),
        # publishing
        Family("gateway_publish_seconds", "histogram",
               "Publishes through this process, Redis round trips included", (),
               [((), r.publish_seconds)]),
        Family("gateway_publish_errors", "counter", "Publishes refused or failed, by error code",
               ("code",), _by((code if code in ERROR_CODES else "other", n)
                              for code, n in r.publish_errors.items())),
        # resume
        Family("gateway_replays", "counter",
               "Resumes: recovered false when the gap could not be replayed whole; "
               "overflowed when an unsubscribed chat's buffer had overflowed",
               ("recovered", "overflowed"),
               [((_bool(recovered), _bool(overflowed)), n)
                for (recovered, overflowed), n in sorted(c.replays.items())]),
        Family("gateway_gap_repairs", "counter", "Gaps pub/sub left, read back from the log",
               (), _one(c.gap_repairs)),
        Family("gateway_history_lost", "counter",
               "Rooms whose history was lost or replaced (members resync)", (),
               _one(c.history_lost)),
        Family("gateway_resyncs", "counter",
               "Subscriptions told their history was lost (recovered false, unasked)", (),
               _one(c.resyncs)),
        # Redis
        Family("gateway_redis_errors", "counter",
               "Redis commands failed: connection, timeout, or an error reply", ("kind",),
               _by(r.command_errors.items())),
        Family("gateway_pubsub_reconnects", "counter", "Pub/sub connections lost and reopened",
               (), _one(r.pubsub_reconnects)),
        Family("gateway_pubsub_reroutes", "counter",
               "Sharded pub/sub channels moved to the node that owns their slot now", (),
               _one(r.pubsub_reroutes)),
        Family("gateway_cluster_slot_map_reloads", "counter", "Cluster slot map reloads", (),
               _one(r.slot_map_reloads)),
        Family("gateway_cluster_redirects", "counter",
               "Commands sent again elsewhere: MOVED, ASK, TRYAGAIN, CLUSTERDOWN", ("kind",),
               _by(r.redirects.items())),
        Family("gateway_replica_waits", "counter",
               "WAITs for GATEWAY_WAIT_REPLICAS: met, or short when the timeout passed first",
               ("result",), [(("met",), r.wait_met), (("short",), r.wait_short)]),
        Family("gateway_replication_timeouts", "counter",
               "Writes answered replication_timeout (stored, not on enough replicas)", (),
               _one(r.replication_timeouts)),
        Family("gateway_ready", "gauge",
               "Dependencies as /readyz reports them: 1 ok, 0 not", ("dependency",),
               [((name,), int(ok)) for name, ok in sorted(sampled.ready.items())], "livemin"),
        # the agent inbox and turns
        Family("gateway_inbox_lag", "gauge",
               "Inbox entries a consumer group has not read yet, per partition",
               ("partition", "group"),
               [(labels, g.lag) for labels, g in groups if g.lag is not None],
               "livemostrecent"),
        Family("gateway_inbox_pending", "gauge",
               "Inbox entries read by a worker and not acknowledged yet, per partition",
               ("partition", "group"), [(labels, g.pending) for labels, g in groups],
               "livemostrecent"),
        Family("gateway_turns_running", "gauge", "Turns running, per inbox partition",
               ("partition",),
               [((str(n),), count) for n, count in enumerate(sampled.running)],
               "livemostrecent"),
        Family("gateway_inbox_reclaimed", "counter",
               "Inbox entries taken over from stalled workers by this process's agents", (),
               _one(agent["reclaimed"])),
        Family("gateway_handoffs_swept", "counter",
               "Turns handed to the agents by the sweeper for a gateway that did not", (),
               _one(c.handoffs_swept)),
        Family("gateway_turn_seconds", "histogram",
               "Turns ended through this process, turn_start to turn_end (timeouts included)",
               (), [((), r.turn_seconds)]),
        Family("gateway_turn_timeouts", "counter", "Turns ended by the gateway with reason "
               "timeout", (), _one(c.turn_timeouts)),
        Family("gateway_conversations_expired", "counter", "Conversations this process "
               "deleted for GATEWAY_CONVERSATION_TTL", (), _one(c.conversations_expired)),
        # resumable answers
        Family("gateway_streams_open", "gauge",
               "Answers streaming in this process's rooms", (), _one(streams)),
        Family("gateway_streamed_bytes", "counter",
               "Data bytes of streamed deltas published through this process", (),
               _one(r.streamed_bytes)),
        Family("gateway_stream_snapshots", "counter",
               "Open streams sent whole in subscribed (a resume mid-answer)", (),
               _one(c.snapshots)),
        Family("gateway_streams_discarded", "counter",
               "Open streams dropped (stream_discarded) in this process's rooms", (),
               _one(c.discarded)),
        # the process
        Family("gateway_event_loop_tasks", "gauge", "asyncio tasks in the process", (),
               _one(tasks)),
    ]


def _bool(value: bool) -> str:
    return "true" if value else "false"

