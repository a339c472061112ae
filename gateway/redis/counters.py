"""The Redis layer's counters: plain integers of this process, bumped where things happen.

The modules of :mod:`gateway.redis` add to :data:`REDIS` (an attribute increment, no lock,
no metric object) and :mod:`gateway.metrics` reads it when ``/metrics`` is scraped. It lives
here, not there, because the worker SDK shares the Redis layer and must not load the
server's modules: in a ``gateway agent`` process the counts are kept and never read.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter

# Seconds. A publish is one script round trip (plus a second write when the conversation
# list changes); a turn is an agent's answer.
PUBLISH_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
TURN_BUCKETS = (0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class Histogram:
    """Observations counted into fixed buckets: ``counts[i]`` holds the values at most
    ``bounds[i]`` and above the bound before it; the last slot, those above every bound."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def cumulative(self) -> list[int]:
        """Counts at or below each bound, then the total (Prometheus' ``le`` buckets)."""
        total, out = 0, []
        for count in self.counts:
            total += count
            out.append(total)
        return out


class RedisCounts:
    """What the Redis layer of this process did. Labelled counts are ``Counter``s keyed by a
    bounded value (an error code, an exception class), never by a chat or a user."""

    __slots__ = ("command_errors", "publish_errors", "publish_seconds", "pubsub_reconnects",
                 "pubsub_reroutes", "redirects", "replication_timeouts", "slot_map_reloads",
                 "streamed_bytes", "turn_seconds", "wait_met", "wait_short")

    def __init__(self) -> None:
        self.publish_seconds = Histogram(PUBLISH_BUCKETS)
        self.publish_errors: Counter[str] = Counter()  # by the refusal's wire code
        self.turn_seconds = Histogram(TURN_BUCKETS)  # turn_start to turn_end, server clock
        self.streamed_bytes = 0  # data of streamed deltas accepted by publishes
        self.command_errors: Counter[str] = Counter()  # "connection", "timeout", "reply"
        self.redirects: Counter[str] = Counter()  # "moved", "ask", "tryagain", "clusterdown"
        self.slot_map_reloads = 0
        self.wait_met = 0  # WAITs that reached GATEWAY_WAIT_REPLICAS
        self.wait_short = 0  # and those that did not in time
        self.replication_timeouts = 0  # writes refused with replication_timeout
        self.pubsub_reconnects = 0  # pub/sub connections lost (each is reconnected)
        self.pubsub_reroutes = 0  # channels moved to the node that owns their slot now


REDIS = RedisCounts()
