"""Which agents have a live worker: each worker renews its entry in one sorted set.

A worker (:class:`gateway.sdk.agent.AgentWorker`) announces itself every few seconds as
``"<agent> <kind> <consumer>"`` with the time its entry lapses as the score; one that dies
drops out within :data:`LIVE_TTL_MS`. ``GET /v1/agents`` lists the agents with a worker
now, and the turn timeout says when a conversation's agent had none.

One key for the whole deployment (``agents:live``, one cluster slot): a worker writes it
once per :data:`RENEW_EVERY` seconds, so it stays far from any hot path.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Literal

import msgspec

from .pipeline import AutoPipeline

LIVE_KEY = "agents:live"
RENEW_EVERY = 3.0  # seconds between a worker's announcements
LIVE_TTL_MS = 10_000  # a worker not heard from for this long is gone

AgentKind = Literal["handler", "ag-ui", "openai"]


class LiveAgent(msgspec.Struct, frozen=True):
    """An agent name with live workers, as ``GET /v1/agents`` lists it."""

    name: str
    kind: AgentKind
    workers: int


def _now_ms() -> int:
    return int(time.time() * 1000)


class AgentRegistry:
    """The live workers of every agent."""

    def __init__(self, pipeline: AutoPipeline) -> None:
        self.pipeline = pipeline

    async def announce(self, agent: str, kind: AgentKind, consumer: str) -> None:
        """This worker is alive for :data:`LIVE_TTL_MS` more; the lapsed go."""
        now = _now_ms()
        await self.pipeline.execute("ZADD", LIVE_KEY, now + LIVE_TTL_MS,
                                    f"{agent} {kind} {consumer}")
        await self.pipeline.execute("ZREMRANGEBYSCORE", LIVE_KEY, "-inf", now)

    async def withdraw(self, agent: str, kind: AgentKind, consumer: str) -> None:
        """A worker that stops says so: its agent drops out at once."""
        await self.pipeline.execute("ZREM", LIVE_KEY, f"{agent} {kind} {consumer}")

    async def live(self) -> list[LiveAgent]:
        """The agents with a live worker, by name."""
        members = await self.pipeline.execute("ZRANGEBYSCORE", LIVE_KEY, _now_ms(), "+inf")
        counts: dict[str, int] = {}
        kinds: dict[str, AgentKind] = {}
        for member in members:
            name, kind, _ = (member.decode() if isinstance(member, bytes)
                             else str(member)).split(" ", 2)
            counts[name] = counts.get(name, 0) + 1
            kinds[name] = _kind(kind, kinds.get(name))
        return [LiveAgent(name, kinds[name], counts[name]) for name in sorted(counts)]

    async def has_worker(self, agent: str) -> bool:
        return any(found.name == agent for found in await self.live())


_KINDS: Mapping[str, AgentKind] = {"handler": "handler", "ag-ui": "ag-ui", "openai": "openai"}


def _kind(kind: str, seen: AgentKind | None) -> AgentKind:
    """One agent name's kind (its workers normally agree; the first one heard wins)."""
    return seen or _KINDS.get(kind, "handler")
