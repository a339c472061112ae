"""Connection tickets: a short-lived, single-use stand-in for a token in the WebSocket URL.

Browsers cannot set headers on a WebSocket, so a token would ride in ``?token=`` and land in
address bars, proxy logs and consoles. Instead a client trades its token for a ticket over
HTTP (``POST /v1/ws-ticket``, the token in the ``Authorization`` header) and opens
``/v1/ws?ticket=...``: the ticket is good for one connection within ``TICKET_TTL`` seconds,
on any gateway process (it lives in Redis), and stands for the token's user, role and expiry.
"""

from __future__ import annotations

import hashlib
import math
import secrets
import time

import msgspec

from .auth import AuthError, Principal
from .redis.backend import Backend
from .redis.keys import ticket_key

TICKET_TTL = 30  # seconds: a connection attempt, with room for a slow network
MAX_TICKET_CHARS = 128  # what a ticket parameter may be before it is even looked up


def _key(ticket: str) -> str:
    return ticket_key(hashlib.sha256(ticket.encode()).hexdigest())


class Tickets:
    """Issue tickets and redeem them, once, on any process that shares the Redis."""

    def __init__(self, backend: Backend) -> None:
        self._backend = backend

    async def issue(self, who: Principal) -> tuple[str, int]:
        """A new ticket for ``who`` and its lifetime in seconds: ``TICKET_TTL``, or less when
        the token expires sooner (a ticket never outlives its token)."""
        ttl = float(TICKET_TTL)
        if who.expires_at is not None:
            ttl = min(ttl, who.expires_at - time.time())
        if ttl < 1:
            raise AuthError("token expired")
        ticket = secrets.token_urlsafe(32)
        await self._backend.client.set(_key(ticket), msgspec.json.encode(who),
                                       px=int(ttl * 1000))
        return ticket, math.floor(ttl)

    async def redeem(self, ticket: str) -> Principal:
        """Who ``ticket`` stands for; it is gone afterwards (GETDEL: of two processes
        redeeming one ticket at once, exactly one gets it)."""
        if not ticket or len(ticket) > MAX_TICKET_CHARS:
            raise AuthError("invalid ticket")
        raw = await self._backend.client.getdel(_key(ticket))
        if raw is None:
            raise AuthError("invalid ticket: unknown, expired or already used")
        who = msgspec.json.decode(raw, type=Principal)
        if who.expires_at is not None and who.expires_at <= time.time():
            raise AuthError("token expired")
        return who
