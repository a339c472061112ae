"""``/v1/ws``: the handshake (origin, subprotocol, token or ticket, limits), then a
:class:`Session`.

:meth:`SocketEndpoint.admit` makes every decision of the handshake, for both ways in:

- ``gateway serve`` runs the gateway's own WebSocket protocol
  (:mod:`gateway.transport.websocket`), which asks :meth:`~SocketEndpoint.admit` with the
  request httptools already parsed and then drives the session by callbacks;
- under any other ASGI server, :meth:`SocketEndpoint.__call__` is a plain ASGI endpoint.
"""

from __future__ import annotations

import logging
import secrets
from typing import Any, NamedTuple

from redis.exceptions import RedisError
from starlette.datastructures import Headers, QueryParams

from . import logs
from . import protocol as p
from .auth import AuthError, Principal, bearer
from .closecodes import BACKEND_UNAVAILABLE, FORBIDDEN, TOO_MANY, TOO_MANY_REASON, UNAUTHORIZED
from .metrics import COUNTS
from .runtime import Gateway
from .session import Receive, Send, Session

log = logging.getLogger("gateway.connect")


class Admission(NamedTuple):
    """What the handshake decided. Not ``allowed``: HTTP 403. Else accepted with
    ``subprotocol``, then closed at once with ``refusal`` (code, reason) if there is one.
    A ``ticket`` is still to be redeemed (:meth:`SocketEndpoint.redeem`, after the
    accept) before the connection has its ``principal``."""

    allowed: bool
    subprotocol: str | None = None
    refusal: tuple[int, str] | None = None
    principal: Principal | None = None
    ticket: str | None = None


class SocketEndpoint:
    """The handshake's decisions, and the ASGI app of ``/v1/ws``."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        # Codecs hold no per-connection state: one of each per process.
        self.codecs = {name: p.Codec(name) for name in (p.JSON_SUBPROTOCOL,
                                                        p.MSGPACK_SUBPROTOCOL)}

    def admit(self, origin: str | None, authorization: str | None, query_string: bytes,
              offered: list[str]) -> Admission:
        """Check the Origin, pick the subprotocol, verify the token and the per-user limit.

        Counts the attempt and any refusal; the caller logs under the connection's id."""
        gateway = self.gateway
        COUNTS.opened += 1
        if not gateway.origin_allowed(origin):
            COUNTS.closed[FORBIDDEN] += 1
            return Admission(False)
        chosen = p.MSGPACK_SUBPROTOCOL if p.MSGPACK_SUBPROTOCOL in offered else (
            p.JSON_SUBPROTOCOL if p.JSON_SUBPROTOCOL in offered else None)
        query = QueryParams(query_string) if query_string else None
        ticket = query.get("ticket") if query is not None else None
        if ticket is not None and not authorization:
            return Admission(True, chosen, ticket=ticket)
        try:
            principal = gateway.tokens.verify(
                bearer(authorization, query.get("token") if query is not None else None))
        except AuthError as exc:
            log.info("token refused: %s", exc)
            COUNTS.closed[UNAUTHORIZED] += 1
            return Admission(True, chosen, (UNAUTHORIZED, str(exc)[:120]))
        return Admission(True, chosen, None, principal)

    async def redeem(self, admission: Admission) -> Admission:
        """``admission`` with its ticket redeemed: with its principal, or with a refusal
        (4001, or 1013 when Redis cannot say)."""
        assert admission.ticket is not None
        try:
            principal = await self.gateway.tickets.redeem(admission.ticket)
        except (RedisError, ConnectionError) as exc:
            log.warning("ticket not redeemed: redis: %s", exc)
            COUNTS.closed[BACKEND_UNAVAILABLE] += 1
            return admission._replace(ticket=None,
                                      refusal=(BACKEND_UNAVAILABLE, "backend unavailable"))
        except AuthError as exc:
            log.info("token refused: %s", exc)
            COUNTS.closed[UNAUTHORIZED] += 1
            return admission._replace(ticket=None, refusal=(UNAUTHORIZED, str(exc)[:120]))
        if self.gateway.revocations.revoked(principal):  # revoked since it was issued
            COUNTS.closed[UNAUTHORIZED] += 1
            return admission._replace(ticket=None, refusal=(UNAUTHORIZED, "token revoked"))
        return admission._replace(ticket=None, principal=principal)

    def session(self, admission: Admission, scope: dict[str, Any], send: Send,
                connection_id: str) -> Session | None:
        """The session of an accepted connection, or None past the per-user limit (the
        caller closes with 4029). ``scope`` only lends the session its transport; the
        session counts itself in from its ``start``, which the caller calls next."""
        principal = admission.principal
        assert principal is not None
        mine = self.gateway.sessions.get(principal.user_id)
        if mine is not None and len(mine) >= self.gateway.settings.max_connections_per_user:
            COUNTS.closed[TOO_MANY] += 1
            return None
        codec = self.codecs[admission.subprotocol or p.JSON_SUBPROTOCOL]
        return Session(self.gateway, principal, codec, scope, send, connection_id=connection_id)

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        # Named before the handshake, so that uvicorn's line for it carries the id too.
        connection_id = secrets.token_hex(8)
        logs.bind(connection_id=connection_id)
        await receive()  # websocket.connect
        headers = Headers(scope=scope)
        admission = self.admit(headers.get("origin"), headers.get("authorization"),
                               scope.get("query_string", b""), scope.get("subprotocols") or [])
        if not admission.allowed:
            await send({"type": "websocket.close", "code": FORBIDDEN})  # HTTP 403
            return
        await send({"type": "websocket.accept", "subprotocol": admission.subprotocol,
                    "headers": []})
        if admission.ticket is not None:
            admission = await self.redeem(admission)
        if admission.refusal is not None:
            code, reason = admission.refusal
            await send({"type": "websocket.close", "code": code, "reason": reason})
            return
        assert admission.principal is not None
        logs.bind(user_id=admission.principal.user_id)
        session = self.session(admission, scope, send, connection_id)
        if session is None:
            await send({"type": "websocket.close", "code": TOO_MANY,
                        "reason": TOO_MANY_REASON})
            return
        await session.run(receive)
