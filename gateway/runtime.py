"""One gateway process: its Redis client, store, hub, live sessions and background work.

The parts that serve clients (:mod:`~gateway.connect`, :mod:`~gateway.session`,
:mod:`~gateway.api`, :mod:`~gateway.sse`) use a :class:`Gateway`; :mod:`~gateway.app` wires
it into the Starlette app. Nothing here imports those parts back.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections.abc import Callable
from typing import Protocol

from starlette.datastructures import QueryParams
from starlette.requests import HTTPConnection

from .auth import AuthError, Principal, TokenCache, bearer
from .closecodes import BACKEND_UNAVAILABLE, DISCONNECTED, SERVER_RESTART, UNAUTHORIZED
from .config import ConfigError, Settings
from .conversations import Conversations
from .errors import Rejected
from .hub import Hub
from .presence import Presence
from .redis.backend import Backend
from .redis.presence import PresenceStore
from .redis.store import Store
from .retention import Retention
from .revocation import Revocations
from .tickets import Tickets
from .webhook import WebhookSender

log = logging.getLogger("gateway")

# The heap of a gateway is mostly long-lived connection state, and every request allocates:
# at CPython's default (700, 10, 10) the cyclic collector ran every few requests and
# rescanned that state, 17 % of the CPU of a busy publish path. Collect less often.
GC_THRESHOLDS = (20_000, 20, 50)


class Connection(Protocol):
    """What the runtime needs of a live WebSocket session."""

    principal: Principal

    def close(self, code: int, reason: str = "") -> None: ...


class Stream(Protocol):
    """What the runtime needs of a live HTTP stream (SSE, a turn's reply)."""

    principal: Principal | None

    def terminate(self, reason: str) -> None: ...


class Companion(Protocol):
    """Work that runs beside the gateway in its process, started after it and stopped before
    it (the CLI adds the in-process demo agent this way: the runtime knows no SDK)."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


class Gateway:
    """Everything one gateway process shares: Redis, the store, the hub, live sessions."""

    def __init__(self, settings: Settings) -> None:
        if not settings.redis_url:
            raise ConfigError("GATEWAY_REDIS_URL is not set: run `gateway serve`, which starts "
                              "the embedded default, or point it at a Redis server")
        if not settings.secret:
            raise ConfigError("GATEWAY_SECRET is not set (`gateway serve --dev` makes one)")
        self.settings = settings
        # Made by start(): which Redis it is (a single server, a cluster) must be asked.
        self.backend: Backend
        self.store: Store
        self.hub: Hub
        self.conversations: Conversations
        self.tickets: Tickets
        self.presence: Presence
        self.tokens = TokenCache(settings.secret)
        self.sessions: dict[str, set[Connection]] = {}
        self.streams: dict[str, set[Stream]] = {}  # live HTTP streams, by user
        self._sweeper: asyncio.Task[None] | None = None
        self._retention: asyncio.Task[None] | None = None
        # Each is made once the gateway has started (it may need the backend).
        self.companions: list[Callable[[Gateway], Companion]] = []
        self._running: list[Companion] = []

    async def start(self) -> None:
        self.backend = await Backend.connect(self.settings)
        self.store = Store(self.backend, self.settings)
        self.hub = Hub(self.backend, self.store, on_unavailable=self._backend_unavailable)
        self.conversations = Conversations(self.store, self.settings)
        self.tickets = Tickets(self.backend)
        self.presence = Presence(PresenceStore(self.store.pipeline, self.settings.presence_ttl),
                                 self.settings)
        self.revocations = Revocations(self.store.pipeline)
        self.tokens.revoked = self.revocations.revoked
        self.revocations.start(self._close_matching)
        await self.hub.start()
        await self.presence.start()
        moved = await self.store.migrate_lists()
        if moved:
            log.info("moved %d conversation lists to the per-user key layout", moved)
        self._sweeper = asyncio.create_task(self.conversations.run_turn_sweeper())
        if self.settings.conversation_ttl:
            self._retention = asyncio.create_task(Retention(self.store, self.settings).run())
        makers = list(self.companions)
        if self.settings.webhook_url:
            makers.append(lambda gateway: WebhookSender(
                gateway.store.notify, gateway.settings, gateway.store.user_present))
        for make in makers:
            companion = make(self)
            await companion.start()
            self._running.append(companion)
        gc.set_threshold(*GC_THRESHOLDS)
        gc.freeze()  # what start-up made lives as long as the process: never scan it again

    async def stop(self) -> None:
        self._close_all(SERVER_RESTART, "server restarting")
        await self.revocations.stop()
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._retention is not None:
            self._retention.cancel()
        for companion in reversed(self._running):
            await companion.stop()
        with contextlib.suppress(Exception):
            await self.presence.stop()
        # Give the close frames a moment to leave before the sockets go.
        with contextlib.suppress(Exception):
            await asyncio.sleep(0.05)
        await self.hub.stop()
        await self.backend.aclose()

    def _backend_unavailable(self) -> None:
        """Redis has been unreachable for a while: nothing a session does can work, and
        frames are not arriving. Tell every client to come back after a backoff (1013);
        they resume where they were once Redis is back."""
        self._close_all(BACKEND_UNAVAILABLE, "backend unavailable")

    def track_stream(self, who: Principal, stream: Stream) -> None:
        """A live HTTP stream of ``who``: an administrator may end it (revocation)."""
        stream.principal = who
        self.streams.setdefault(who.user_id, set()).add(stream)

    def untrack_stream(self, who: Principal, stream: Stream) -> None:
        mine = self.streams.get(who.user_id)
        if mine is not None:
            mine.discard(stream)
            if not mine:
                del self.streams[who.user_id]

    def _close_matching(self, match: Callable[[Principal], bool], reason: str,
                        revoked: bool) -> int:
        """Close this process's connections and streams whose principal ``match`` es: 4001
        for a revoked token, 4005 for an administrator's disconnection."""
        closed = 0
        code = UNAUTHORIZED if revoked else DISCONNECTED
        for sessions in list(self.sessions.values()):
            for session in list(sessions):
                if match(session.principal):
                    session.close(code, reason)
                    closed += 1
        for streams in list(self.streams.values()):
            for stream in list(streams):
                if stream.principal is not None and match(stream.principal):
                    stream.terminate(reason)
                    closed += 1
        if closed:
            log.info("closed %d connections and streams: %s", closed, reason)
        return closed

    def _close_all(self, code: int, reason: str) -> None:
        for sessions in list(self.sessions.values()):
            for session in list(sessions):
                session.close(code, reason)

    def authenticate(self, request: HTTPConnection) -> Principal:
        """Who an HTTP request comes from: its bearer token (header, else ``?token=``)."""
        return self.authenticate_raw(request.headers.get("authorization"),
                                     request.scope.get("query_string", b""))

    def authenticate_raw(self, authorization: str | None, query: bytes) -> Principal:
        """:meth:`authenticate`, given the request's ``Authorization`` header as found and
        its raw query string (the publish path reads its headers in one pass, without a
        Starlette request)."""
        query_token = QueryParams(query).get("token") if b"token=" in query else None
        token = bearer(authorization, query_token)
        try:
            return self.tokens.verify(token)
        except AuthError as exc:
            raise Rejected("unauthorized", str(exc)) from None

    def origin_allowed(self, origin: str | None) -> bool:
        allowed = self.settings.allowed_origins
        return origin is None or "*" in allowed or origin in allowed
