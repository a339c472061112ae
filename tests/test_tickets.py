"""Connection tickets (``POST /v1/ws-ticket``, ``GET /v1/ws?ticket=``): one connection each,
short-lived, the token's user and role, on any gateway process; and no token in the URL.

Real gateway processes on one real Redis-compatible server, real HTTP and WebSockets.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
import redis
from websockets.exceptions import ConnectionClosed

from gateway.tickets import TICKET_TTL, _key

from .faults import until
from .test_security import assert_error_body, assert_usable, refused
from .wsclient import connect

pytestmark = pytest.mark.anyio


async def issue(gw: Any, token: str) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=gw.http) as http:
        resp = await http.post("/v1/ws-ticket", headers={"Authorization": f"Bearer {token}"})
    assert resp.status_code == 200, resp.text
    assert resp.headers["cache-control"] == "no-store"
    body: dict[str, Any] = resp.json()
    assert set(body) == {"ticket", "expires_in"}, body
    return body


def with_ticket(gw: Any, ticket: str) -> str:
    return f"{gw.ws}?ticket={ticket}"


async def test_a_ticket_opens_one_connection_as_its_user(gateway: Any, user: str,
                                                         chat_id: str) -> None:
    body = await issue(gateway, gateway.token(user))
    assert body["expires_in"] == TICKET_TTL and len(body["ticket"]) >= 32
    async with connect(with_ticket(gateway, body["ticket"])) as ws:
        assert ws.hello["user_id"] == user and ws.hello["role"] == "user"
        assert (await ws.subscribe(chat_id))["seq"] == 0
        await assert_usable(ws)
        # Used once: the same ticket again, even while its connection is open, is refused.
        code, reason = await refused(with_ticket(gateway, body["ticket"]))
        assert code == 4001 and "ticket" in (reason or "")
    code, _ = await refused(with_ticket(gateway, body["ticket"]))
    assert code == 4001
    # Tokens keep working beside tickets: in the query and in the header.
    async with connect(gateway.url(user)) as ws:
        assert ws.hello["user_id"] == user
    async with connect(gateway.ws, additional_headers=gateway.headers(user)) as ws:
        assert ws.hello["user_id"] == user


async def test_a_ticket_is_the_user_and_role_it_was_issued_to(gateway: Any, user: str,
                                                              chat_id: str) -> None:
    other = user + "b"
    async with connect(gateway.url(other)) as ws:
        await ws.subscribe(chat_id)  # other's conversation
    mine = (await issue(gateway, gateway.token(user)))["ticket"]
    async with connect(with_ticket(gateway, mine)) as ws:
        assert ws.hello["user_id"] == user
        await ws.send({"type": "subscribe", "chat_id": chat_id, "id": "s"})
        await ws.expect("error", code="forbidden", id="s")
    # A header names who connects: a ticket beside it is neither used nor spent.
    ticket = (await issue(gateway, gateway.token(user)))["ticket"]
    async with connect(with_ticket(gateway, ticket),
                       additional_headers=gateway.headers(other)) as ws:
        assert ws.hello["user_id"] == other
    async with connect(with_ticket(gateway, ticket)) as ws:
        assert ws.hello["user_id"] == user
    # A service token's ticket is a service connection.
    service = (await issue(gateway, gateway.token("agent-" + user, "service")))["ticket"]
    async with connect(with_ticket(gateway, service)) as ws:
        assert ws.hello["role"] == "service"
        assert (await ws.subscribe(chat_id))["chat_id"] == chat_id


async def test_a_ticket_never_outlives_its_token_and_expires(gateway: Any, user: str,
                                                             redis_url: str) -> None:
    body = await issue(gateway, gateway.token(user, ttl=3))
    assert 1 <= body["expires_in"] <= 3
    client = redis.Redis.from_url(redis_url)
    try:
        key = _key(body["ticket"])
        assert 0 < client.pttl(key) <= 3000
        # Redis drops it when the token expires; then it opens nothing.
        assert await until(lambda: not client.exists(key), 6), "the ticket did not expire"
    finally:
        client.close()
    code, reason = await refused(with_ticket(gateway, body["ticket"]))
    assert code == 4001 and "ticket" in (reason or "")
    # A token about to expire gets no ticket at all.
    async with httpx.AsyncClient(base_url=gateway.http) as http:
        almost = {"Authorization": f"Bearer {gateway.token(user, ttl=0.5)}"}
        assert_error_body(await http.post("/v1/ws-ticket", headers=almost), 401,
                          "unauthorized")


async def test_a_ticket_works_once_across_gateway_processes(start_gateway: Any,
                                                            user: str) -> None:
    a, b = start_gateway(), start_gateway()
    ticket = (await issue(a, a.token(user)))["ticket"]
    async with connect(with_ticket(b, ticket)) as ws:  # issued by A, redeemed on B
        assert ws.hello["user_id"] == user
    assert (await refused(with_ticket(a, ticket)))[0] == 4001  # replayed on A
    # Redeemed on both at once: exactly one connection gets it.
    ticket = (await issue(b, b.token(user)))["ticket"]

    async def outcome(gw: Any) -> int | None:
        """None for a hello; the close code for a refusal."""
        async with connect(with_ticket(gw, ticket), hello=False) as ws:
            try:
                frame = await ws.recv(ignore=frozenset())
            except ConnectionClosed:
                return ws.ws.close_code
            assert frame["type"] == "hello", frame
            return None

    results = await asyncio.gather(outcome(a), outcome(b))
    assert sorted(results, key=str) == [4001, None], results


async def test_no_ticket_without_a_valid_bearer_token(gateway: Any, user: str) -> None:
    async with httpx.AsyncClient(base_url=gateway.http) as http:
        assert_error_body(await http.post("/v1/ws-ticket"), 401, "unauthorized")
        for bad in ("Bearer junk", "Basic abc", f"Bearer {gateway.token(user, ttl=-60)}"):
            assert_error_body(await http.post("/v1/ws-ticket", headers={"Authorization": bad}),
                              401, "unauthorized")
        assert (await http.get("/v1/ws-ticket")).status_code == 405
    # Tickets nobody issued: refused at the handshake like a bad token.
    for junk in ("x", "A" * 43, "A" * 500, ""):
        code, _ = await refused(with_ticket(gateway, junk))
        assert code == 4001, junk
