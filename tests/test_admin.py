"""Cross-node disconnection and revocation: ``POST /v1/admin/disconnect`` and
``/v1/admin/revoke`` take effect on every gateway process within a second.

Real parts: two gateway processes on the session's Redis, WebSockets, an SSE stream, HTTP.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import httpx
import jwt
import pytest

from .steps import create
from .wsclient import connect

pytestmark = pytest.mark.anyio

WITHIN = 1.5  # the promise is a second; the rest is the test's own round trips


def token(gw: Any, sub: str, *, iat: float | None = None, jti: str | None = None,
          ttl: float = 3600) -> str:
    now = int(time.time())
    claims: dict[str, Any] = {"sub": sub, "iat": int(iat if iat is not None else now),
                              "exp": now + int(ttl)}
    if jti is not None:
        claims["jti"] = jti
    return jwt.encode(claims, gw.secret, algorithm="HS256")


async def admin(gw: Any, path: str, body: dict[str, Any], role: str = "service") -> Any:
    async with httpx.AsyncClient(base_url=gw.http) as http:
        return await http.post(path, json=body, headers=gw.headers("ops", role))


async def test_a_disconnect_closes_every_connection_and_stream_of_the_user_everywhere(
        start_gateway: Any, user: str, chat_id: str) -> None:
    first, second = start_gateway(), start_gateway()
    await create(first, user, chat_id)
    bystander = "u" + uuid.uuid4().hex[:10]
    async with connect(first.url(user)) as a, connect(second.url(user)) as b, \
            connect(second.url(bystander)) as c, \
            httpx.AsyncClient(base_url=second.http, timeout=10) as http, \
            http.stream("GET", f"/v1/conversations/{chat_id}/stream",
                        headers=second.headers(user)) as sse:
        lines = sse.aiter_lines()
        while await anext(lines) != "event: ready":
            pass
        refused = await admin(first, "/v1/admin/disconnect", {"user_id": user}, role="user")
        assert refused.status_code == 403
        started = time.monotonic()
        resp = await admin(first, "/v1/admin/disconnect",
                           {"user_id": user, "reason": "account suspended"})
        assert resp.status_code == 202 and resp.json() == {"within_ms": 1000}
        for ws in (a, b):
            assert await ws.close_code(timeout=WITHIN) == 4005
            assert ws.ws.close_reason == "account suspended"
        async with asyncio.timeout(WITHIN):
            rest = [line async for line in lines]
        assert ": disconnected: account suspended" in rest
        assert time.monotonic() - started < WITHIN + 0.5
        await c.send({"type": "ping", "id": "still"})
        await c.expect("pong", id="still")  # another user's connection is untouched
    # Their token stays good: a disconnection is not a revocation.
    async with connect(first.url(user)) as again:
        await again.send({"type": "ping", "id": 1})
        await again.expect("pong", id=1)


async def test_revoking_a_user_refuses_their_older_tokens_and_tickets_everywhere(
        start_gateway: Any, user: str) -> None:
    first, second = start_gateway(), start_gateway()
    old = token(first, user, iat=time.time() - 30)
    async with httpx.AsyncClient(base_url=second.http) as http:
        bearer = {"Authorization": f"Bearer {old}"}
        assert (await http.get("/v1/conversations", headers=bearer)).status_code == 200
        ticket = (await http.post("/v1/ws-ticket", headers=bearer)).json()["ticket"]
        async with connect(f"{second.ws}?token={old}") as ws:
            resp = await admin(first, "/v1/admin/revoke",
                               {"user_id": user, "until": int(time.time() * 1000) + 60_000})
            assert resp.status_code == 202
            assert await ws.close_code(timeout=WITHIN) == 4001
            assert ws.ws.close_reason == "token revoked"
        # The token cache had it: refused all the same, and so is the ticket made from it.
        resp = await http.get("/v1/conversations", headers=bearer)
        assert resp.status_code == 401 and "revoked" in resp.json()["error"]["message"]
        async with connect(f"{second.ws}?ticket={ticket}", hello=False) as refused:
            assert await refused.close_code() == 4001
            assert refused.ws.close_reason == "token revoked"
    # A token issued from now on is good.
    fresh = token(first, user)
    async with connect(f"{first.ws}?token={fresh}") as ws:
        await ws.send({"type": "ping", "id": 1})
        await ws.expect("pong", id=1)


async def test_revoking_one_token_by_jti_leaves_the_users_others(
        start_gateway: Any, user: str) -> None:
    gw = start_gateway()
    lost, kept = token(gw, user, jti="lost-phone"), token(gw, user, jti="laptop")
    async with connect(f"{gw.ws}?token={lost}") as phone, \
            connect(f"{gw.ws}?token={kept}") as laptop:
        resp = await admin(gw, "/v1/admin/revoke",
                           {"jti": "lost-phone", "until": int(time.time() * 1000) + 60_000})
        assert resp.status_code == 202
        assert await phone.close_code(timeout=WITHIN) == 4001
        await laptop.send({"type": "ping", "id": 1})
        await laptop.expect("pong", id=1)
    bad = await admin(gw, "/v1/admin/revoke", {"until": 1})
    assert bad.status_code == 422 and "jti" in bad.json()["error"]["message"]
    both = await admin(gw, "/v1/admin/revoke", {"jti": "x", "user_id": user, "until": 1})
    assert both.status_code == 422
