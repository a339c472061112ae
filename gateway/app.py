"""The Starlette app factory: routes and lifespan wired to one :class:`Gateway`."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.routing import WebSocketRoute

from . import api, web
from .config import Settings, load_settings
from .connect import SocketEndpoint
from .runtime import Gateway


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

    handlers: Any = api.exception_handlers
    app = Starlette(
        routes=[*api.routes, WebSocketRoute("/v1/ws", SocketEndpoint(gateway)),
                *web.web_routes(dev=settings.dev)],
        exception_handlers=handlers,
        lifespan=lifespan,
    )
    app.state.gateway = gateway
    return app
