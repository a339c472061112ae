"""The app factory: routes and lifespan wired to one :class:`Gateway`.

The two hot paths skip Starlette: ``/v1/ws`` goes straight to
:class:`~gateway.connect.SocketEndpoint` (a WebSocket lives for hours, and the middleware a
request needs for its milliseconds would sit in every connection's task all that time; under
``gateway serve`` it does not even reach the app, see :mod:`gateway.transport.websocket`), and
``POST /v1/conversations/{chat_id}/events`` to :class:`~gateway.api.PublishEndpoint` (its
routing and middleware cost as much as the publish; under ``gateway serve`` most publishes
are answered from the HTTP parser, see :mod:`gateway.transport.uvicorn_ws`). Everything else
goes through Starlette.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.types import Receive, Scope, Send

from . import api, scrape, web
from .config import Settings, load_settings
from .connect import Admission, SocketEndpoint
from .runtime import Gateway
from .transport.uvicorn_ws import FAST_POST, redact_request_logs
from .transport.websocket import ENDPOINT_STATE, Endpoint

WEBSOCKET_PATH = "/v1/ws"


class GatewayApp:
    """The ASGI app: the WebSocket endpoint, or Starlette for the rest."""

    def __init__(self, starlette: Starlette, sockets: SocketEndpoint,
                 publish: api.PublishEndpoint) -> None:
        self.starlette = starlette
        self.sockets = sockets
        self.publish = publish
        self.state = starlette.state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "websocket" and scope["path"] == WEBSOCKET_PATH:
            await self.sockets(scope, receive, send)  # type: ignore[arg-type]
        elif kind == "http" and api.PublishEndpoint.matches(scope):
            await self.publish(scope, receive, send)
        else:
            await self.starlette(scope, receive, send)


def create_app(settings: Settings | None = None) -> GatewayApp:
    settings = settings or load_settings()
    redact_request_logs()  # the server has configured its logging by now
    gateway = Gateway(settings)
    exporter = scrape.Exporter(gateway)
    gateway.companions.append(lambda _: exporter)  # started once the gateway is

    sockets = SocketEndpoint(gateway)
    publish = api.PublishEndpoint(gateway)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[dict[str, Any]]:
        await gateway.start()
        try:
            # The gateway's own protocols find their endpoints here (lifespan state reaches
            # the server's protocols without going through a request).
            endpoint: Endpoint[Admission] = sockets  # what the transport may ask of it
            yield {ENDPOINT_STATE: endpoint, FAST_POST: publish}
        finally:
            await gateway.stop()

    handlers: Any = api.exception_handlers
    app = Starlette(
        routes=[*api.routes, *scrape.routes(exporter), *web.web_routes(dev=settings.dev)],
        exception_handlers=handlers,
        lifespan=lifespan,
    )
    app.state.gateway = gateway
    return GatewayApp(app, sockets, publish)
