"""The publish path: coalesced store calls, and the cache of verified tokens.

Publishes that reach the store in the same event-loop turn go to Redis as one pipeline; each
must still get its own reply or its own error, and a refused or failing script call must
leave the others as they were. A token verified once is cached, and must be refused the
moment it expires all the same. Real processes, real Redis, real sockets.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from typing import Any

import anyio
import httpx
import jwt
import msgspec
import pytest
import redis.asyncio as aioredis

from gateway.redis.keys import index_key, log_key

from .steps import create, history, send_message
from .wsclient import connect

pytestmark = pytest.mark.anyio

Body = dict[str, Any]


class Job:
    """One HTTP publish and what it must get back."""

    def __init__(self, chat_id: str, body: Body, status: int = 200, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        self.chat_id = chat_id
        self.body = body
        self.status = status
        self.code = code
        self.headers = headers
        self.resp: httpx.Response | None = None

    @property
    def events(self) -> list[Body]:
        return list(self.body["events"]) if "events" in self.body else [self.body]


async def fire(gw: Any, jobs: list[Job]) -> None:
    """Every job at once, over as many connections: their publishes reach the gateway in a
    burst, so many of them share a loop turn (and a pipeline)."""
    limits = httpx.Limits(max_connections=len(jobs), max_keepalive_connections=len(jobs))
    service = gw.headers("agent", "service")
    async with httpx.AsyncClient(base_url=gw.http, limits=limits, timeout=30) as http:
        replies = await asyncio.gather(*(
            http.post(f"/v1/conversations/{job.chat_id}/events", json=job.body,
                      headers=job.headers or service)
            for job in jobs))
    for job, resp in zip(jobs, replies, strict=True):
        job.resp = resp


def check_reply(job: Job, epoch: str | None) -> None:
    """The job got its own status and body: an error with its code, or its seqs."""
    resp = job.resp
    assert resp is not None
    assert resp.status_code == job.status, (job.chat_id, job.body, resp.text)
    body = resp.json()
    if job.status != 200:
        assert set(body) == {"error"}, body
        assert body["error"]["code"] == job.code, (job.body, body)
        return
    assert body["chat_id"] == job.chat_id and body["epoch"] == epoch, body
    assert body["duplicate"] is False
    seqs = body["seqs"]
    # A batch gets consecutive seqs; its last is the reply's last_seq.
    assert len(seqs) == len(job.events), body
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))) and body["last_seq"] == seqs[-1]


async def test_one_refused_publish_in_a_burst_leaves_the_others_intact(
    gateway: Any, redis_url: str, user: str, chat_id: str
) -> None:
    chats = [f"{chat_id}-{k}" for k in "abc"]
    missing = f"{chat_id}-missing"  # never created: the script refuses with not_found
    broken = f"{chat_id}-broken"  # its stream key is not a stream: the script itself errors
    intruder = user + "x"
    redis = aioredis.from_url(redis_url)
    epochs = {chat: (await create(gateway, user, chat))["epoch"] for chat in [*chats, broken]}
    await redis.set(log_key(broken), "not a stream")

    jobs: list[Job] = []
    for chat in chats:
        for i in range(40):
            if i % 4 == 3:  # a batch of three
                jobs.append(Job(chat, {"events": [{"type": "note", "data": {"c": chat, "i": i,
                                                                             "j": j}}
                                                  for j in range(3)]}))
            else:
                jobs.append(Job(chat, {"type": "note", "data": {"c": chat, "i": i}}))
        # Refused by the script: no turn is running.
        jobs += [Job(chat, {"type": "turn_end", "data": {"reason": "complete"}}, 409,
                     "no_active_turn") for _ in range(6)]
        # A batch whose last event is refused writes nothing at all.
        jobs += [Job(chat, {"events": [{"type": "note", "data": {"c": chat, "doomed": k}},
                                       {"type": "turn_end", "data": {}}]},
                     409, "no_active_turn") for k in range(4)]
        # Refused before the store: a user token, a reserved type.
        jobs.append(Job(chat, {"type": "note", "data": {"c": chat, "user": True}}, 403,
                        "forbidden", gateway.headers(user)))
        jobs.append(Job(chat, {"type": "turn_start", "data": {}}, 400, "reserved_type"))
    jobs += [Job(missing, {"type": "note", "data": {}}, 404, "not_found") for _ in range(8)]
    jobs += [Job(broken, {"type": "note", "data": {"i": i}}, 503, "backend_unavailable")
             for i in range(8)]
    random.Random(11).shuffle(jobs)

    # Meanwhile another user's messages are refused by the script too, over a WebSocket.
    async def intrude() -> list[str]:
        codes = []
        async with connect(gateway.url(intruder)) as ws:
            for n in range(10):
                await send_message(ws, chats[n % 3], "hi", f"m{n}", id=n)
                err = await ws.expect("error", id=n, chat_id=chats[n % 3])
                codes.append(err["code"])
        return codes

    try:
        intruding = asyncio.create_task(intrude())
        await fire(gateway, jobs)
        assert await intruding == ["forbidden"] * 10

        for job in jobs:
            check_reply(job, epochs.get(job.chat_id))
        async with httpx.AsyncClient(base_url=gateway.http) as http:
            owner = gateway.headers(user)
            for chat in chats:
                valid = [job for job in jobs if job.chat_id == chat and job.status == 200]
                expected: dict[int, Body] = {}
                for job in valid:
                    assert job.resp is not None
                    for seq, event in zip(job.resp.json()["seqs"], job.events, strict=True):
                        assert seq not in expected, seq  # no seq handed out twice
                        expected[seq] = event["data"]
                total = sum(len(job.events) for job in valid)
                assert sorted(expected) == list(range(1, total + 1))  # consecutive from 1
                page = (await http.get(f"/v1/conversations/{chat}/events?after=0&limit=1000",
                                       headers=owner)).json()
                assert page["last_seq"] == total and page["next_after"] is None
                # History holds exactly the valid events, once each, each at its reply's seq.
                assert [(e["seq"], e["type"], e["data"]) for e in page["events"]] == [
                    (seq, "note", expected[seq]) for seq in range(1, total + 1)]
                conv = (await http.get(f"/v1/conversations/{chat}", headers=owner)).json()
                assert conv["status"] == "idle" and conv["last_seq"] == total
            assert (await http.get(f"/v1/conversations/{missing}", headers=owner)
                    ).status_code == 404

            # The failed script calls wrote nothing: repaired, the broken chat starts at 1.
            await redis.delete(log_key(broken))
            resp = await http.post(f"/v1/conversations/{broken}/events",
                                   json={"type": "note", "data": {"after": "repair"}},
                                   headers=gateway.headers("agent", "service"))
            assert resp.status_code == 200 and resp.json()["seqs"] == [1], resp.text
    finally:
        await redis.aclose()


async def test_idempotent_retries_in_one_burst_append_once(
    gateway: Any, user: str, chat_id: str
) -> None:
    epoch = (await create(gateway, user, chat_id))["epoch"]
    keys = [f"k{n}" for n in range(10)]
    jobs = [Job(chat_id, {"events": [{"type": "note", "data": {"key": key, "j": j}}
                                     for j in range(2)], "idempotency_key": key})
            for key in keys for _ in range(5)]
    random.Random(5).shuffle(jobs)
    await fire(gateway, jobs)
    firsts: Counter[str] = Counter()
    seqs_by_key: dict[str, set[tuple[int, ...]]] = {}
    for job in jobs:
        assert job.resp is not None and job.resp.status_code == 200, job.resp
        body = job.resp.json()
        assert body["epoch"] == epoch
        key = job.body["idempotency_key"]
        seqs_by_key.setdefault(key, set()).add(tuple(body["seqs"]))
        if not body["duplicate"]:
            firsts[key] += 1
    assert firsts == dict.fromkeys(keys, 1)  # each key appended by exactly one request
    assert all(len(s) == 1 for s in seqs_by_key.values())  # the others echo its seqs
    events = await history(gateway, user, chat_id)
    assert [e["seq"] for e in events] == list(range(1, 2 * len(keys) + 1))
    for key, replies in seqs_by_key.items():
        (seqs,) = replies
        assert [events[s - 1]["data"] for s in seqs] == [{"key": key, "j": j} for j in range(2)]


async def test_a_burst_after_the_script_cache_was_flushed_succeeds(
    gateway: Any, redis_url: str, user: str, chat_id: str
) -> None:
    """Every publish of the burst is stored, and the script's source goes to the server
    once (``SCRIPT LOAD``), not with each of the calls it refused."""
    epoch = (await create(gateway, user, chat_id))["epoch"]
    redis = aioredis.from_url(redis_url)
    try:
        await redis.script_flush()  # e.g. a restarted or failed-over server
        before = await _calls(redis, "script|load", "eval")
        jobs = [Job(chat_id, {"type": "note", "data": {"i": i}}) for i in range(60)]
        await fire(gateway, jobs)
        loads, evals = (after - was for after, was in zip(
            await _calls(redis, "script|load", "eval"), before, strict=True))
    finally:
        await redis.aclose()
    for job in jobs:
        check_reply(job, epoch)
    seqs = sorted(s for job in jobs for s in job.resp.json()["seqs"])  # type: ignore[union-attr]
    assert seqs == list(range(1, 61))
    # Batches already on the wire when the first refusal came back share its load, or
    # load again: a few loads at most, and no call sent with its source.
    assert 1 <= loads <= 3 and evals == 0, (loads, evals)


async def _calls(redis: aioredis.Redis, *commands: str) -> list[int]:
    """Calls of each command so far, by ``INFO commandstats``."""
    stats = await redis.info("commandstats")
    return [int(stats.get(f"cmdstat_{command}", {}).get("calls", 0)) for command in commands]


# --- the token cache ---------------------------------------------------------------------


async def test_a_cached_token_is_refused_once_it_expires(gateway: Any, user: str,
                                                         chat_id: str) -> None:
    # `exp` is whole seconds: 1.5 to 2.5 s from now, time enough to use the token first.
    token = gateway.token(user, ttl=2 if time.time() % 1 < 0.5 else 3)
    exp = jwt.decode(token, options={"verify_signature": False})["exp"]
    bearer = {"Authorization": f"Bearer {token}"}
    async with httpx.AsyncClient(base_url=gateway.http) as http:
        # Verified, and so cached, by both kinds of route, over both ways of sending it.
        assert (await http.get("/v1/conversations", headers=bearer)).status_code == 200
        assert (await http.get(f"/v1/conversations?token={token}")).status_code == 200
        async with connect(f"{gateway.ws}?token={token}") as ws:
            await ws.subscribe(chat_id)
            assert (await http.get(f"/v1/conversations/{chat_id}", headers=bearer)
                    ).status_code == 200
            # The session's own expiry timer is the event that says the time has come.
            assert await ws.close_code(timeout=6) == 4011
        # A timer may fire a hair early: make sure the wall clock is past `exp` too.
        for _ in range(100):
            if time.time() > exp:
                break
            await anyio.sleep(0.01)
        assert time.time() > exp

        for resp in (await http.get("/v1/conversations", headers=bearer),
                     await http.get(f"/v1/conversations?token={token}"),
                     await http.get(f"/v1/conversations/{chat_id}/events?after=0",
                                    headers=bearer)):
            assert resp.status_code == 401, resp.text
            error = resp.json()["error"]
            assert error["code"] == "unauthorized" and "expired" in error["message"], error
        # The same once more: a refusal is not cached as a success either.
        assert (await http.get("/v1/conversations", headers=bearer)).status_code == 401

    async with connect(f"{gateway.ws}?token={token}", hello=False) as ws:
        assert await ws.close_code() == 4001
        assert "expired" in (ws.ws.close_reason or "")
    async with connect(gateway.ws, hello=False, additional_headers=bearer) as ws:
        assert await ws.close_code() == 4001
    # A fresh token for the same user works, so what was refused was the token alone.
    async with connect(gateway.url(user)) as ws:
        assert (await ws.subscribe(chat_id))["chat_id"] == chat_id


async def test_a_publish_not_replicated_in_time_is_not_acknowledged(
        start_gateway: Any, redis_url: str, chat_id: str) -> None:
    """GATEWAY_WAIT_REPLICAS=1 on a server with no replica: the write happens, but the reply
    says it was not confirmed by a replica; a retry with the same key stores nothing twice.
    What was stored is told as usual: the owner's feed and list show the new title."""
    gw = start_gateway(wait_replicas=1, wait_timeout_ms=50)
    client = aioredis.from_url(redis_url)
    body = {"events": [{"type": "note", "data": {"n": 1}},
                       {"type": "title", "data": {"title": "Unconfirmed"}}],
            "idempotency_key": "w-" + chat_id}
    try:
        async with connect(gw.url("owner")) as ws, httpx.AsyncClient(
                base_url=gw.http, headers=gw.headers("agent", "service")) as http:
            await ws.subscribe(chat_id)  # creates it
            for _ in range(2):
                resp = await http.post(f"/v1/conversations/{chat_id}/events", json=body)
                assert resp.status_code == 503, resp.text
                error = resp.json()["error"]
                assert error["code"] == "replication_timeout"
                assert "stored, but 0 of 1 replicas" in error["message"]
            await ws.wait_for(lambda f: f["type"] == "conversation"
                              and f["title"] == "Unconfirmed" and f["last_seq"] == 2)
        assert await client.xlen(log_key(chat_id)) == 2
        assert await client.zscore(index_key("owner"), chat_id) is not None
    finally:
        await client.aclose()
        gw.stop()  # its turn sweeper would refuse every later test's timeouts


# --- publishes answered from the HTTP parser -------------------------------------------


async def raw_exchange(gw: Any, data: bytes, replies: int) -> list[tuple[int, dict[str, str],
                                                                          bytes]]:
    """``data`` written at once on one connection (pipelined requests); the first
    ``replies`` responses as (status, headers, body), read with their content-length."""
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    try:
        writer.write(data)
        await writer.drain()
        out = []
        with anyio.fail_after(10):
            for _ in range(replies):
                status_line = await reader.readline()
                headers: dict[str, str] = {}
                while (line := await reader.readline()) not in (b"\r\n", b""):
                    name, _, value = line.decode("latin-1").partition(":")
                    headers[name.strip().lower()] = value.strip()
                body = await reader.readexactly(int(headers["content-length"]))
                out.append((int(status_line.split()[1]), headers, body))
            if out and out[-1][1].get("connection") == "close":
                assert await reader.read() == b""  # and the server closed the connection
        return out
    finally:
        writer.close()


def post(gw: Any, chat_id: str, body: Body, *, token: str | None = None,
         extra: bytes = b"", chunked: bool = False) -> bytes:
    data = msgspec.json.encode(body)
    auth = token if token is not None else gw.token("agent", "service")
    framing = (b"transfer-encoding: chunked\r\n" if chunked
               else b"content-length: %d\r\n" % len(data))
    payload = b"%x\r\n%s\r\n0\r\n\r\n" % (len(data), data) if chunked else data
    return (b"POST /v1/conversations/%s/events HTTP/1.1\r\nhost: t\r\n"
            b"authorization: Bearer %s\r\ncontent-type: application/json\r\n%s%s\r\n%s"
            % (chat_id.encode(), auth.encode(), framing, extra, payload))


async def test_pipelined_publishes_are_answered_in_order(gateway: Any, user: str,
                                                         chat_id: str) -> None:
    epoch = (await create(gateway, user, chat_id))["epoch"]
    requests = [post(gateway, chat_id, {"type": "note", "data": {"i": i}}) for i in range(5)]
    # A refused one and a Starlette route in the middle: their answers keep their place.
    requests.insert(2, post(gateway, chat_id, {"type": "turn_start", "data": {}}))
    requests.insert(4, b"GET /v1/conversations/%s HTTP/1.1\r\nhost: t\r\n"
                       b"authorization: Bearer %s\r\n\r\n"
                    % (chat_id.encode(), gateway.token(user).encode()))
    replies = await raw_exchange(gateway, b"".join(requests), len(requests))
    statuses = [status for status, _, _ in replies]
    assert statuses == [200, 200, 400, 200, 200, 200, 200], replies
    assert msgspec.json.decode(replies[2][2])["error"]["code"] == "reserved_type"
    assert msgspec.json.decode(replies[4][2])["chat_id"] == chat_id
    published = [msgspec.json.decode(body) for status, _, body in replies
                 if status == 200 and b'"seqs"' in body]
    assert [r["epoch"] for r in published] == [epoch] * 5
    seqs = [r["seqs"][0] for r in published]
    assert seqs == list(range(seqs[0], seqs[0] + 5))  # in the order they were sent
    events = await history(gateway, user, chat_id)
    assert [e["data"]["i"] for e in events if e["type"] == "note"] == list(range(5))
    assert all(h["content-type"] == "application/json" for s, h, _ in replies if s == 200)


async def test_publishes_any_http_client_may_send(gateway: Any, user: str,
                                                  chat_id: str) -> None:
    """Chunked, large, with a query string, or asking to close: each gets its answer (the
    parser's fast path or uvicorn's ASGI path, the same replies)."""
    await create(gateway, user, chat_id)
    cases = [
        post(gateway, chat_id, {"type": "note", "data": {"k": "chunked"}}, chunked=True),
        post(gateway, chat_id, {"type": "note", "data": {"k": "large", "x": "y" * 100_000}}),
        post(gateway, chat_id, {"type": "note", "data": {"k": "query"}}).replace(
            b"/events HTTP", b"/events?x=1 HTTP"),
        post(gateway, chat_id, {"type": "note", "data": {"k": "bad token"}}, token="x.y.z"),
        post(gateway, chat_id + "-none", {"type": "note", "data": {}}),
        post(gateway, chat_id, {"type": "note", "data": {"k": "close"}},
             extra=b"connection: close\r\n"),
    ]
    statuses = []
    for request in cases:  # one connection each
        [(status, headers, body)] = await raw_exchange(gateway, request, 1)
        statuses.append((status, msgspec.json.decode(body).get("error", {}).get("code")))
        if b"connection: close" in request:
            assert headers["connection"] == "close"
    assert statuses == [(200, None), (200, None), (200, None), (401, "unauthorized"),
                        (404, "not_found"), (200, None)]
    events = await history(gateway, user, chat_id)
    assert [e["data"]["k"] for e in events if e["type"] == "note"] == [
        "chunked", "large", "query", "close"]
