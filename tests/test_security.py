"""Who may read and write which conversation, and every close code the gateway sends.

Everything runs against real gateway processes and a real Redis-compatible server; a close
code is read off the client's socket, never inferred.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from gateway.auth import issue_token
from gateway.embedded import EmbeddedRedis

from .steps import publish, send_message
from .wsclient import Client, connect

pytestmark = pytest.mark.anyio

OTHER_SECRET = "not-the-gateway-secret-" + "0" * 32




def assert_error_body(resp: httpx.Response, status: int, code: str) -> None:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    body = resp.json()
    assert set(body) == {"error"}, body
    assert body["error"]["code"] == code, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"], body


async def assert_usable(ws: Client, req_id: str = "alive") -> None:
    """The connection still answers: a ping gets its pong (and nothing comes before it)."""
    await ws.send({"type": "ping", "id": req_id})
    await ws.expect("pong", id=req_id)


async def refused(url: str, **kwargs: Any) -> tuple[int | None, str | None]:
    """Connect, expect no hello, and return the close code and reason the server sends."""
    async with connect(url, hello=False, **kwargs) as ws:
        code = await ws.close_code()
        return code, ws.ws.close_reason


# --- ACL --------------------------------------------------------------------------------


async def test_another_user_can_neither_read_nor_write_a_conversation(
    gateway: Any, user: str, chat_id: str
) -> None:
    intruder = user + "x"
    async with connect(gateway.url(user)) as owner, connect(gateway.url(intruder)) as other:
        sub = await owner.subscribe(chat_id)  # auto-created: the owner is `user`
        assert sub["seq"] == 0

        await other.send({"type": "subscribe", "chat_id": chat_id, "id": "s1"})
        err = await other.expect("error", code="forbidden", id="s1", chat_id=chat_id)
        assert err["message"]
        await assert_usable(other, "after-subscribe")

        # A refused subscribe must not leave the intruder in the room.
        await publish(gateway, chat_id, {"type": "note", "data": {"secret": 1}})
        assert (await owner.events(chat_id, 1))[0]["data"] == {"secret": 1}
        await assert_usable(other, "no-leak")  # the event would have been queued first

        await send_message(other, chat_id, "hi", "m1", id="m1")
        await other.expect("error", code="forbidden", id="m1", chat_id=chat_id)
        await other.send({"type": "cancel", "chat_id": chat_id, "id": "c1"})
        await other.expect("error", code="forbidden", id="c1", chat_id=chat_id)
        await assert_usable(other, "after-writes")

    async with httpx.AsyncClient(base_url=gateway.http) as http:
        base = f"/v1/conversations/{chat_id}"
        bad = gateway.headers(intruder)
        assert_error_body(await http.patch(base, json={"title": "pwned"}, headers=bad),
                          403, "forbidden")
        assert_error_body(await http.delete(base, headers=bad), 403, "forbidden")
        assert_error_body(await http.get(base, headers=bad), 403, "forbidden")
        assert_error_body(await http.get(base + "/events", headers=bad), 403, "forbidden")
        assert_error_body(await http.get(base + "/events?after=0", headers=bad),
                          403, "forbidden")
        # Creating it again cannot take it over.
        assert_error_body(await http.post("/v1/conversations", json={"chat_id": chat_id},
                                          headers=bad), 409, "conflict")
        listed = (await http.get("/v1/conversations", headers=bad)).json()
        assert chat_id not in [c["chat_id"] for c in listed["conversations"]]

        # Nothing the intruder tried left a trace.
        mine = gateway.headers(user)
        conv = (await http.get(base, headers=mine)).json()
        assert conv["owner"] == user and conv["title"] is None
        assert conv["last_seq"] == 1 and conv["status"] == "idle"
        page = (await http.get(base + "/events?after=0", headers=mine)).json()
        assert [(e["seq"], e["type"]) for e in page["events"]] == [(1, "note")]


async def test_service_token_may_subscribe_to_any_conversation(
    gateway: Any, user: str, chat_id: str
) -> None:
    async with connect(gateway.url(user)) as owner:
        await owner.subscribe(chat_id)
    await publish(gateway, chat_id, {"type": "note", "data": {"n": 1}})
    async with connect(gateway.url("agent-" + user, "service")) as agent:
        assert agent.hello["role"] == "service"
        sub = await agent.subscribe(chat_id, since={"seq": 0, "epoch": "x"})
        assert sub["seq"] == 1
        await agent.send({"type": "subscribe", "chat_id": chat_id,
                          "since": {"seq": 0, "epoch": sub["epoch"]}})
        again = await agent.expect("subscribed", chat_id=chat_id)
        assert again["recovered"] is True and again["replayed"] == 1
        assert (await agent.events(chat_id, 1))[0]["data"] == {"n": 1}


# --- 4001 -------------------------------------------------------------------------------


async def test_missing_or_invalid_token_closes_4001(gateway: Any, user: str) -> None:
    assert (await refused(gateway.ws))[0] == 4001
    code, reason = await refused(gateway.ws + "?token=not.a.jwt")
    assert code == 4001 and "invalid" in (reason or "")
    forged = issue_token(OTHER_SECRET, user)
    assert (await refused(f"{gateway.ws}?token={forged}"))[0] == 4001
    code, reason = await refused(f"{gateway.ws}?token={gateway.token(user, ttl=-60)}")
    assert code == 4001 and "expired" in (reason or "")
    # The Authorization header is checked the same way.
    code, _ = await refused(gateway.ws, additional_headers={"Authorization": "Bearer junk"})
    assert code == 4001
    # A service role cannot be granted by a token signed with another key either.
    forged = issue_token(OTHER_SECRET, user, "service")
    assert (await refused(f"{gateway.ws}?token={forged}"))[0] == 4001
    # ...while the right token, in the header, is accepted.
    async with connect(gateway.ws, additional_headers=gateway.headers(user)) as ws:
        assert ws.hello["user_id"] == user and ws.hello["role"] == "user"


async def test_http_without_a_valid_token_is_401(gateway: Any, user: str, chat_id: str) -> None:
    async with httpx.AsyncClient(base_url=gateway.http) as http:
        assert_error_body(await http.get("/v1/conversations"), 401, "unauthorized")
        assert_error_body(await http.post(f"/v1/conversations/{chat_id}/events",
                                          json={"type": "note", "data": {}}),
                          401, "unauthorized")
        junk = {"Authorization": "Bearer junk"}
        assert_error_body(await http.get(f"/v1/conversations/{chat_id}", headers=junk),
                          401, "unauthorized")
        expired = {"Authorization": f"Bearer {gateway.token(user, ttl=-60)}"}
        assert_error_body(await http.get("/v1/conversations", headers=expired),
                          401, "unauthorized")


# --- 4003 / 403 -------------------------------------------------------------------------


async def test_origin_not_allowed_is_refused_at_the_handshake(gateway: Any, user: str) -> None:
    with pytest.raises(InvalidStatus) as info:
        async with ws_connect(gateway.url(user), origin="http://evil.example"):  # type: ignore[arg-type]
            pass
    assert info.value.response.status_code == 403
    async with connect(gateway.url(user), origin="http://good.example") as ws:  # type: ignore[arg-type]
        assert ws.hello["user_id"] == user
    async with connect(gateway.url(user)) as ws:  # no Origin header at all
        assert ws.hello["user_id"] == user
        await assert_usable(ws)


# --- 4004 -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def strict_gateway(start_gateway: Any) -> Any:
    return start_gateway(max_bad_frames=3)


async def test_invalid_frames_in_a_row_close_4004(strict_gateway: Any, user: str) -> None:
    async with connect(strict_gateway.url(user)) as ws:
        for i in range(3):
            await ws.send_raw(f"garbage {i}")
            await ws.expect("error", code="malformed")
        await ws.send({"type": "nope", "id": 4})
        assert await ws.close_code() == 4004
        assert ws.ws.close_reason == "too many invalid frames"


async def test_a_valid_frame_resets_the_invalid_frame_count(
    strict_gateway: Any, user: str, chat_id: str
) -> None:
    async with connect(strict_gateway.url(user)) as ws:
        for round_ in range(3):
            for i in range(3):
                await ws.send({"type": "subscribe", "chat_id": "bad id!", "id": i})
                await ws.expect("error", code="invalid_frame", id=i)
            await assert_usable(ws, f"round-{round_}")
        await ws.subscribe(chat_id)
        await publish(strict_gateway, chat_id, {"type": "note", "data": {"ok": True}})
        assert (await ws.events(chat_id, 1))[0]["data"] == {"ok": True}


# --- 4008 -------------------------------------------------------------------------------


def kernel_send_buffer_max() -> int:
    """How much the kernel may buffer toward a peer that does not read (sndbuf autotuning)."""
    try:
        return int(Path("/proc/sys/net/ipv4/tcp_wmem").read_text().split()[2])
    except (OSError, ValueError, IndexError):
        return 4 << 20


def tiny_receive_socket(port: int) -> socket.socket:
    """A connected socket with a small receive buffer, so a stalled reader stalls the sender."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.setblocking(False)
    return sock


async def test_slow_consumer_is_closed_4008_without_holding_up_the_room(
    start_gateway: Any, user: str, chat_id: str
) -> None:
    gw = start_gateway(queue_max_bytes=65536)
    blob = "x" * 16384
    # Far more than the kernel can buffer toward the stalled client, so its queue overflows.
    count = max(200, (2 * kernel_send_buffer_max() + (1 << 20)) // len(blob))
    async with connect(gw.url(user)) as fast, \
            connect(gw.url(user), max_queue=1, sock=tiny_receive_socket(gw.port)) as slow:
        await fast.subscribe(chat_id)
        await slow.subscribe(chat_id)  # and from now on `slow` reads nothing

        async def publisher() -> None:
            async with httpx.AsyncClient(base_url=gw.http) as http:
                headers = gw.headers("agent", "service")
                for i in range(count):
                    resp = await http.post(f"/v1/conversations/{chat_id}/events",
                                           json={"type": "blob", "data": {"i": i, "b": blob}},
                                           headers=headers)
                    assert resp.status_code == 200, resp.text

        task = asyncio.create_task(publisher())
        try:
            got = await fast.events(chat_id, count, timeout=45)
        finally:
            await task
        assert [f["data"]["i"] for f in got] == list(range(count))
        assert [f["seq"] for f in got] == list(range(1, count + 1))
        await assert_usable(fast)

        # Closed, even if it does not know yet: what it still sends is ignored.
        await send_message(slow, chat_id, "too late", "late")
        # Its close must arrive after the frames already in flight, once it reads again.
        seen: list[int] = []
        with pytest.raises(ConnectionClosed):
            while True:
                frame = await slow.recv(timeout=15)
                if frame.get("chat_id") == chat_id and "seq" in frame:
                    seen.append(frame["seq"])
        assert slow.ws.close_code == 4008
        assert slow.ws.close_reason == "slow consumer"
        assert seen == list(range(1, len(seen) + 1))  # a gapless prefix, then the close
        assert len(seen) < count
    async with httpx.AsyncClient(base_url=gw.http) as http:
        page = await http.get(f"/v1/conversations/{chat_id}/events?after={count}",
                              headers=gw.headers(user))
    assert page.json()["events"] == [] and page.json()["last_seq"] == count


# --- 4011 -------------------------------------------------------------------------------


async def test_token_expiry_closes_4011(gateway: Any, user: str, chat_id: str) -> None:
    token = gateway.token(user, ttl=2)  # expires 1-2 s from now
    async with connect(f"{gateway.ws}?token={token}") as ws:
        await ws.subscribe(chat_id)
        await assert_usable(ws)
        assert await ws.close_code(timeout=6) == 4011
        assert ws.ws.close_reason == "token expired"


async def test_a_token_is_refreshed_in_band_and_the_connection_goes_on(
        gateway: Any, user: str, chat_id: str) -> None:
    """token_expiring comes GATEWAY_TOKEN_REFRESH_BEFORE (60 s) ahead of exp, here at once;
    a refresh for the same user gets refreshed, and the connection outlives the first
    token with its subscription, no reconnect, no replay."""
    token = gateway.token(user, ttl=2)
    expires = time.time() + 2
    async with connect(f"{gateway.ws}?token={token}") as ws:
        notice = await ws.recv(ignore=frozenset())
        while notice["type"] != "token_expiring":
            notice = await ws.recv(ignore=frozenset())
        await ws.subscribe(chat_id)
        assert abs(notice["expires_at"] / 1000 - expires) < 2
        fresh = gateway.token(user, ttl=3600)
        await ws.send({"type": "refresh", "token": fresh, "id": "r1"})
        refreshed = await ws.expect("refreshed", id="r1")
        assert refreshed["expires_at"] / 1000 > time.time() + 3000
        with pytest.raises(TimeoutError):  # past the first token's exp: still open
            await ws.close_code(timeout=max(0.5, expires + 1 - time.time()))
        await publish(gateway, chat_id, {"type": "note", "data": {"after": True}})
        assert (await ws.wait_for(lambda f: f.get("type") == "note"))["data"] == {
            "after": True}


async def test_a_refresh_for_another_user_or_a_bad_token_changes_nothing(
        gateway: Any, user: str, chat_id: str) -> None:
    token = gateway.token(user, ttl=2)
    async with connect(f"{gateway.ws}?token={token}") as ws:
        await ws.subscribe(chat_id)
        for bad, code in ((gateway.token(user + "x", ttl=3600), "forbidden"),
                          (gateway.token(user, "service", ttl=3600), "forbidden"),
                          ("not-a-token", "unauthorized"),
                          (gateway.token(user, ttl=-60), "unauthorized")):
            await ws.send({"type": "refresh", "token": bad, "id": code})
            error = await ws.expect("error", id=code)
            assert error["code"] == code and "refresh refused" in error["message"]
        assert await ws.close_code(timeout=6) == 4011  # the first token's exp, as before


# --- 4029 -------------------------------------------------------------------------------


async def test_flooding_is_rate_limited_then_closed_4029(start_gateway: Any, user: str) -> None:
    gw = start_gateway(rate_limit=5, rate_burst=5)
    async with connect(gw.url(user)) as ws:
        # A burst over the bucket: the first frames are served, then the client is warned.
        for i in range(10):
            await ws.send({"type": "ping", "id": i})
        pongs = []
        while (frame := await ws.recv())["type"] == "pong":
            pongs.append(frame["id"])
        assert pongs == list(range(len(pongs))) and 5 <= len(pongs) < 10
        assert frame["type"] == "error" and frame["code"] == "rate_limited", frame
        assert "slow down" in frame["message"]
        # Keeping on flooding gets the connection closed.
        with contextlib.suppress(ConnectionClosed):
            for i in range(10, 60):
                await ws.send({"type": "ping", "id": i})
        assert await ws.close_code() == 4029
        assert ws.ws.close_reason == "too many requests"
    async with connect(gw.url(user)) as ws:  # a new connection has a full bucket again
        await assert_usable(ws)


async def test_connection_limit_per_user_closes_4029(
    start_gateway: Any, user: str, chat_id: str
) -> None:
    gw = start_gateway(max_connections_per_user=2)
    async with connect(gw.url(user)) as one, connect(gw.url(user)) as two:
        code, reason = await refused(gw.url(user))
        assert code == 4029 and reason == "too many connections"
        async with connect(gw.url(user + "z")) as other_user:  # the limit is per user
            await assert_usable(other_user)
        await one.subscribe(chat_id)
        await two.subscribe(chat_id)
        await publish(gw, chat_id, {"type": "note", "data": {"n": 1}})
        assert (await one.events(chat_id, 1))[0]["data"] == {"n": 1}
        assert (await two.events(chat_id, 1))[0]["data"] == {"n": 1}


# --- 1012 -------------------------------------------------------------------------------


async def test_sigterm_closes_open_connections_1012(
    start_gateway: Any, user: str, chat_id: str
) -> None:
    gw = start_gateway()
    async with connect(gw.url(user)) as idle, connect(gw.url(user)) as subscribed:
        await subscribed.subscribe(chat_id)
        stopping = asyncio.create_task(asyncio.to_thread(gw.stop, signal.SIGTERM))
        codes = await asyncio.gather(idle.close_code(timeout=10),
                                     subscribed.close_code(timeout=10))
        await stopping
    assert codes == [1012, 1012]
    assert gw.proc.returncode == 0


# --- 1009 -------------------------------------------------------------------------------


async def test_frame_over_the_limit_closes_1009(gateway: Any, user: str) -> None:
    limit = 64 * 1024
    async with connect(gateway.url(user)) as ws:
        assert ws.hello["limits"]["max_frame_bytes"] == limit
        # Just under the limit is fine (unknown fields are ignored).
        padded = {"type": "ping", "id": "big", "pad": "x" * (limit - 100)}
        await ws.send(padded)
        await ws.expect("pong", id="big")
        await ws.send({"type": "ping", "id": "too-big", "pad": "x" * limit})
        assert await ws.close_code() == 1009


# --- 1013 -------------------------------------------------------------------------------


async def test_backend_loss_closes_1013(
    start_gateway: Any, user: str, chat_id: str, tmp_path: Path
) -> None:
    redis = EmbeddedRedis(tmp_path / "redis", persistent=False)
    gw = start_gateway(redis_url=redis.start())
    try:
        async with connect(gw.url(user)) as ws:
            await ws.subscribe(chat_id)
            await assert_usable(ws)
            redis.stop()
            await ws.send({"type": "subscribe", "chat_id": chat_id + "-2", "id": "s"})
            assert await ws.close_code(timeout=15) == 1013
            assert ws.ws.close_reason == "backend unavailable"
        async with httpx.AsyncClient(base_url=gw.http) as http:
            assert_error_body(await http.get("/readyz"), 503, "backend_unavailable")
    finally:
        redis.stop()
        gw.stop(signal.SIGKILL)
