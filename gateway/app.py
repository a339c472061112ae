"""The Starlette app factory, the WebSocket endpoint and lifespan wiring."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import redis.asyncio as aioredis
from starlette.applications import Starlette
from starlette.routing import WebSocketRoute
from starlette.websockets import WebSocket

from . import api, web
from . import protocol as p
from .agent import AgentWorker, run_in_process
from .auth import AuthError, bearer, verify_token
from .closecodes import FORBIDDEN, SERVER_RESTART, TOO_MANY, UNAUTHORIZED
from .config import ConfigError, Settings, load_settings
from .conversations import Conversations
from .hub import Hub
from .session import Session
from .store import Store

log = logging.getLogger("gateway")

REDIS_MAX_CONNECTIONS = 100  # per process, the pub/sub connection included


class Gateway:
    """Everything one gateway process shares: Redis, the store, the hub, live sessions."""

    def __init__(self, settings: Settings) -> None:
        if not settings.redis_url:
            raise ConfigError("GATEWAY_REDIS_URL is not set: run `gateway serve`, which starts "
                              "the embedded default, or point it at a Redis server")
        if not settings.secret:
            raise ConfigError("GATEWAY_SECRET is not set (`gateway serve --dev` makes one)")
        self.settings = settings
        # redis-py's default pool raises MaxConnectionsError once 100 commands are in flight
        # (e.g. a burst of subscribes after a restart), which would close those sessions with
        # 1013. A blocking pool makes the burst wait for a free connection instead.
        pool = aioredis.BlockingConnectionPool.from_url(
            settings.redis_url, max_connections=REDIS_MAX_CONNECTIONS, timeout=10,
            decode_responses=False, health_check_interval=30,
        )
        self.redis = aioredis.Redis.from_pool(pool)
        self.store = Store(self.redis, settings)
        self.hub = Hub(self.redis, self.store)
        self.conversations = Conversations(self.store, settings)
        self.sessions: dict[str, set[Session]] = {}
        self._sweeper: asyncio.Task[None] | None = None
        self.agent: AgentWorker | None = None

    async def start(self) -> None:
        await self.redis.ping()
        await self.hub.start()
        self._sweeper = asyncio.create_task(self.conversations.run_turn_sweeper())
        if self.settings.demo_agent:
            self.agent = await run_in_process(self)

    async def stop(self) -> None:
        for sessions in list(self.sessions.values()):
            for session in list(sessions):
                session.close(SERVER_RESTART, "server restarting")
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self.agent is not None:
            await self.agent.stop(grace=3)
        # Give the close frames a moment to leave before the sockets go.
        with contextlib.suppress(Exception):
            await asyncio.sleep(0.05)
        await self.hub.stop()
        await self.redis.aclose()

    def origin_allowed(self, origin: str | None) -> bool:
        allowed = self.settings.allowed_origins
        return origin is None or "*" in allowed or origin in allowed

    async def serve_socket(self, ws: WebSocket) -> None:
        if not self.origin_allowed(ws.headers.get("origin")):
            await ws.close(FORBIDDEN)  # before accept: the client sees HTTP 403
            return
        offered = ws.scope.get("subprotocols") or []
        chosen = p.MSGPACK_SUBPROTOCOL if p.MSGPACK_SUBPROTOCOL in offered else (
            p.JSON_SUBPROTOCOL if p.JSON_SUBPROTOCOL in offered else None)
        await ws.accept(subprotocol=chosen)
        token = bearer(ws.headers.get("authorization"), ws.query_params.get("token"))
        try:
            principal = verify_token(self.settings.secret, token)
        except AuthError as exc:
            await ws.close(UNAUTHORIZED, str(exc)[:120])
            return
        mine = self.sessions.setdefault(principal.user_id, set())
        if len(mine) >= self.settings.max_connections_per_user:
            await ws.close(TOO_MANY, "too many connections")
            return
        session = Session(self, ws, principal, p.Codec(chosen or p.JSON_SUBPROTOCOL))
        mine.add(session)
        try:
            await session.run()
        finally:
            mine.discard(session)
            if not mine:
                self.sessions.pop(principal.user_id, None)


def create_app(settings: Settings | None = None) -> Starlette:
    settings = settings or load_settings()
    gateway = Gateway(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await gateway.start()
        try:
            yield
        finally:
            await gateway.stop()

    async def websocket_endpoint(ws: WebSocket) -> None:
        await gateway.serve_socket(ws)

    handlers: Any = api.exception_handlers
    app = Starlette(
        routes=[*api.routes, WebSocketRoute("/v1/ws", websocket_endpoint),
                *web.web_routes(dev=settings.dev)],
        exception_handlers=handlers,
        lifespan=lifespan,
    )
    app.state.gateway = gateway
    return app
