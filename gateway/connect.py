"""``/v1/ws``: the handshake (origin, subprotocol, token or ticket, limits), then a
:class:`Session`.

A plain ASGI endpoint rather than a Starlette ``WebSocket``: the session reads ASGI
``receive`` itself and writes through :mod:`gateway.transport.outbound`, so a connection
holds no wrapper it does not use.
"""

from __future__ import annotations

import logging
import secrets
from typing import Any

from redis.exceptions import RedisError
from starlette.datastructures import Headers, QueryParams

from . import logs
from . import protocol as p
from .auth import AuthError, bearer
from .closecodes import BACKEND_UNAVAILABLE, FORBIDDEN, TOO_MANY, UNAUTHORIZED
from .metrics import COUNTS
from .runtime import Gateway
from .session import Receive, Send, Session

log = logging.getLogger("gateway.connect")


class SocketEndpoint:
    """The ASGI app of ``/v1/ws``."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        # Codecs hold no per-connection state: one of each per process.
        self.codecs = {name: p.Codec(name) for name in (p.JSON_SUBPROTOCOL,
                                                        p.MSGPACK_SUBPROTOCOL)}

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        gateway = self.gateway
        # Named before the handshake, so that uvicorn's line for it carries the id too.
        connection_id = secrets.token_hex(8)
        logs.bind(connection_id=connection_id)
        await receive()  # websocket.connect
        COUNTS.opened += 1
        headers = Headers(scope=scope)
        if not gateway.origin_allowed(headers.get("origin")):
            await send({"type": "websocket.close", "code": FORBIDDEN})  # HTTP 403
            COUNTS.closed[FORBIDDEN] += 1
            return
        offered = scope.get("subprotocols") or []
        chosen = p.MSGPACK_SUBPROTOCOL if p.MSGPACK_SUBPROTOCOL in offered else (
            p.JSON_SUBPROTOCOL if p.JSON_SUBPROTOCOL in offered else None)
        await send({"type": "websocket.accept", "subprotocol": chosen, "headers": []})
        query = QueryParams(scope.get("query_string", b""))
        authorization, ticket = headers.get("authorization"), query.get("ticket")
        try:
            if ticket is not None and not authorization:
                principal = await gateway.tickets.redeem(ticket)
            else:
                principal = gateway.tokens.verify(bearer(authorization, query.get("token")))
        except (RedisError, ConnectionError) as exc:
            log.warning("ticket not redeemed: redis: %s", exc)
            await send({"type": "websocket.close", "code": BACKEND_UNAVAILABLE,
                        "reason": "backend unavailable"})
            COUNTS.closed[BACKEND_UNAVAILABLE] += 1
            return
        except AuthError as exc:
            log.info("token refused: %s", exc)
            await send({"type": "websocket.close", "code": UNAUTHORIZED,
                        "reason": str(exc)[:120]})
            COUNTS.closed[UNAUTHORIZED] += 1
            return
        logs.bind(user_id=principal.user_id)
        mine = gateway.sessions.setdefault(principal.user_id, set())
        if len(mine) >= gateway.settings.max_connections_per_user:
            await send({"type": "websocket.close", "code": TOO_MANY,
                        "reason": "too many connections"})
            COUNTS.closed[TOO_MANY] += 1
            return
        session = Session(gateway, principal, self.codecs[chosen or p.JSON_SUBPROTOCOL],
                          scope, receive, send, connection_id=connection_id)
        mine.add(session)
        COUNTS.connections += 1
        try:
            await session.run()
        finally:
            COUNTS.connections -= 1
            mine.discard(session)
            if not mine:
                gateway.sessions.pop(principal.user_id, None)
