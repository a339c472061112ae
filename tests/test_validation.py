"""Bad input gets a clear error naming the problem, and costs nothing else.

WebSocket frames and HTTP requests, against a real gateway process and a real
Redis-compatible server.
"""

from __future__ import annotations

import asyncio
import os
import sys
import uuid
from typing import Any

import httpx
import msgspec
import pytest

from .steps import create, publish, send_message
from .wsclient import Client, connect

pytestmark = pytest.mark.anyio




def error_of(resp: httpx.Response, status: int, code: str | None = None) -> str:
    """Check an HTTP error response; return its message."""
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message"}, body
    if code is not None:
        assert body["error"]["code"] == code, body
    message: str = body["error"]["message"]
    assert message, body
    return message


# --- WebSocket frames -------------------------------------------------------------------

# (raw frame, expected error code, words the message must contain, echoed id, echoed chat_id)
BAD_FRAMES: list[tuple[str, str, tuple[str, ...], Any, Any]] = [
    ("this is not json", "malformed", ("malformed",), None, None),
    ("", "malformed", ("truncated",), None, None),
    ("[1, 2, 3]", "invalid_frame", ("object", "array"), None, None),
    ("42", "invalid_frame", ("object", "int"), None, None),
    ('"subscribe"', "invalid_frame", ("object", "str"), None, None),
    ('{"id": "r1", "chat_id": "c1"}', "unknown_type", ("type",), "r1", "c1"),
    ('{"type": "dance", "id": "r2"}', "unknown_type", ("dance", "$.type"), "r2", None),
    ('{"type": 7, "id": 3}', "unknown_type", ("$.type",), 3, None),
    ('{"type": "subscribe", "chat_id": 5, "id": "r3"}', "invalid_frame",
     ("str", "$.chat_id"), "r3", 5),
    ('{"type": "subscribe", "chat_id": "no spaces!", "id": "r4"}', "invalid_frame",
     ("regex", "$.chat_id"), "r4", "no spaces!"),
    ('{"type": "subscribe", "chat_id": "' + "c" * 129 + '", "id": "r5"}', "invalid_frame",
     ("$.chat_id",), "r5", None),  # too long to be echoed
    ('{"type": "subscribe", "id": "r6"}', "invalid_frame", ("missing", "chat_id"), "r6", None),
    ('{"type": "subscribe", "chat_id": "c1", "since": {"seq": -1, "epoch": "e"}, "id": "r7"}',
     "invalid_frame", (">= 0", "$.since.seq"), "r7", "c1"),
    ('{"type": "subscribe", "chat_id": "c1", "since": {"seq": 1}, "id": "r8"}',
     "invalid_frame", ("epoch", "$.since"), "r8", "c1"),
    ('{"type": "subscribe", "chat_id": "c1", "since": 4, "id": "r9"}',
     "invalid_frame", ("$.since",), "r9", "c1"),
    ('{"type": "message", "chat_id": "c1", "text": "hi", "id": "r10"}', "invalid_frame",
     ("missing", "client_msg_id"), "r10", "c1"),
    ('{"type": "message", "chat_id": "c1", "text": 5, "client_msg_id": "m", "id": 11}',
     "invalid_frame", ("str", "$.text"), 11, "c1"),
    ('{"type": "message", "chat_id": "c1", "client_msg_id": "m", "id": 12}', "invalid_frame",
     ("missing", "text"), 12, "c1"),
    ('{"type": "message", "chat_id": "c1", "text": "x", "client_msg_id": "", "id": 13}',
     "invalid_frame", ("$.client_msg_id",), 13, "c1"),
    ('{"type": "message", "chat_id": "c1", "text": "x", "client_msg_id": "m", "data": [1],'
     ' "id": 14}', "invalid_frame", ("object", "$.data"), 14, "c1"),
    ('{"type": "unsubscribe", "id": "r15"}', "invalid_frame", ("chat_id",), "r15", None),
    ('{"type": "ping", "id": -3}', "invalid_frame", (">= 0", "$.id"), -3, None),
    ('{"type": "ping", "id": {"nested": true}}', "invalid_frame", ("$.id",), None, None),
]


async def test_bad_frames_get_clear_errors_and_lose_nothing(
    gateway: Any, user: str, chat_id: str
) -> None:
    async with connect(gateway.url(user)) as ws, connect(gateway.url(user)) as other:
        await other.subscribe(chat_id)
        for raw, code, words, req_id, chat in BAD_FRAMES:
            await ws.send_raw(raw)
            err = await ws.expect("error", code=code)
            for word in words:
                assert word.lower() in err["message"].lower(), (raw, err)
            assert err.get("id") == req_id, (raw, err)
            assert err.get("chat_id") == chat, (raw, err)
            # An error is not fatal: the same socket still answers.
            await ws.send({"type": "ping", "id": "after"})
            await ws.expect("pong", id="after")

        # Over the text limit, in a frame under the frame limit: refused, not stored.
        limit = ws.hello["limits"]["max_text_bytes"]
        assert limit == 32 * 1024
        await send_message(ws, chat_id, "é" * (limit // 2 + 1), "long", id="too-long")
        err = await ws.expect("error", code="text_too_long", id="too-long", chat_id=chat_id)
        assert str(limit) in err["message"]

        # After all of it, the connection subscribes and gets live events like any other.
        sub = await ws.subscribe(chat_id, id="sub")
        assert sub["id"] == "sub" and sub["seq"] == 0  # the refused message left nothing
        await publish(gateway, chat_id, {"type": "note", "data": {"n": 1}})
        mine, theirs = await ws.events(chat_id, 1), await other.events(chat_id, 1)
        assert mine == theirs and mine[0]["seq"] == 1 and mine[0]["data"] == {"n": 1}
        # ...and a message of exactly the limit is accepted.
        await send_message(ws, chat_id, "a" * limit, "exact", id="ok")
        ack = await ws.wait_for(lambda f: f["type"] == "ack")
        assert ack["id"] == "ok" and ack["seq"] == 2 and ack["duplicate"] is False
        message = await other.events(chat_id, 1)
        assert message[0]["type"] == "user_message" and len(message[0]["data"]["text"]) == limit


async def test_unknown_fields_are_ignored(gateway: Any, user: str, chat_id: str) -> None:
    async with connect(gateway.url(user)) as ws:
        await ws.send({"type": "subscribe", "chat_id": chat_id, "id": 1, "future": {"x": [1]},
                       "priority": "high"})
        sub = await ws.expect("subscribed", chat_id=chat_id, id=1)
        assert sub["seq"] == 0
        await send_message(ws, chat_id, "hello", "m1", id=2, attachments=[], since="whenever")
        ack = await ws.wait_for(lambda f: f["type"] == "ack")
        assert ack["id"] == 2 and ack["client_msg_id"] == "m1" and ack["seq"] == 1
        await ws.send({"type": "ping", "id": "p", "extra": None})
        await ws.wait_for(lambda f: f["type"] == "pong" and f["id"] == "p")


async def test_a_since_past_the_largest_seq_is_refused(gateway: Any, user: str,
                                                       chat_id: str) -> None:
    """A seq no conversation can reach used to go to Redis as a stream id, which it refused:
    the session closed with 1013 (backend unavailable), and the client's resume met it again."""
    epoch = (await create(gateway, user, chat_id))["epoch"]
    async with connect(gateway.url(user)) as ws:
        for seq in (2**53, 2**64, 2**70):
            await ws.send({"type": "subscribe", "chat_id": chat_id, "id": str(seq),
                           "since": {"seq": seq, "epoch": epoch}})
            err = await ws.expect("error", code="invalid_frame", id=str(seq), chat_id=chat_id)
            assert "$.since.seq" in err["message"], err
        sub = await ws.subscribe(chat_id, since={"seq": 2**53 - 1, "epoch": epoch}, id="max")
        assert sub["recovered"] is False and sub["seq"] == 0  # ahead of the log: a reset


async def test_ping_gets_pong_with_id_and_timestamp(gateway: Any, user: str) -> None:
    async with connect(gateway.url(user)) as ws:
        for req_id in ("abc", 0, 12345):
            await ws.send({"type": "ping", "id": req_id})
            pong = await ws.expect("pong", id=req_id)
            assert isinstance(pong["ts"], int) and pong["ts"] > 1_600_000_000_000
            assert set(pong) == {"type", "id", "ts"}
        await ws.send({"type": "ping"})
        assert set(await ws.expect("pong")) == {"type", "ts"}


# --- MessagePack ------------------------------------------------------------------------


async def raw_frame(ws: Client) -> str | bytes:
    """The next frame that is not a feed frame, undecoded (to see text vs binary)."""
    async with asyncio.timeout(5):
        while True:
            raw = await ws.ws.recv()
            decode = msgspec.msgpack.decode if isinstance(raw, bytes) else msgspec.json.decode
            if decode(raw).get("type") != "conversation":
                return raw


async def test_msgpack_subprotocol_speaks_the_same_schema(
    gateway: Any, user: str, chat_id: str
) -> None:
    async with connect(gateway.url(user), binary=True, hello=False) as mp, \
            connect(gateway.url(user), hello=False, subprotocols=["gateway.v1.json"]) as js, \
            connect(gateway.url(user)) as plain:
        assert mp.ws.subprotocol == "gateway.v1.msgpack"
        assert js.ws.subprotocol == "gateway.v1.json"
        assert plain.ws.subprotocol is None

        mp_hello, js_hello = await raw_frame(mp), await raw_frame(js)
        assert isinstance(mp_hello, bytes) and isinstance(js_hello, str)
        mp_hello_d, js_hello_d = msgspec.msgpack.decode(mp_hello), msgspec.json.decode(js_hello)
        assert mp_hello_d["type"] == "hello" and mp_hello_d["user_id"] == user
        assert set(mp_hello_d) == set(js_hello_d) and mp_hello_d["limits"] == js_hello_d["limits"]

        await mp.send({"type": "subscribe", "chat_id": chat_id, "id": 1})
        mp_sub = await raw_frame(mp)
        assert isinstance(mp_sub, bytes)
        mp_sub_d = msgspec.msgpack.decode(mp_sub)
        await js.send({"type": "subscribe", "chat_id": chat_id, "id": 1})
        js_sub_d = msgspec.json.decode(await raw_frame(js))
        assert mp_sub_d["type"] == "subscribed" and mp_sub_d["id"] == 1
        # The second connection's list has both (a newer version): the same shape.
        mp_present, js_present = (d["snapshot"].pop("presence") for d in (mp_sub_d, js_sub_d))
        assert mp_present["users"] == [{"user_id": user, "connections": 1}]
        assert js_present["users"] == [{"user_id": user, "connections": 2}]
        assert js_present["v"] > mp_present["v"] and mp_present.keys() == js_present.keys()
        assert mp_sub_d == js_sub_d
        await plain.subscribe(chat_id)

        await publish(gateway, chat_id, {"type": "note", "data": {"text": "héllo", "n": [1, 2.5],
                                                                  "ok": True, "none": None}})
        mp_event = await raw_frame(mp)
        assert isinstance(mp_event, bytes)
        event = msgspec.msgpack.decode(mp_event)
        assert event == msgspec.json.decode(await raw_frame(js))
        assert event == (await plain.events(chat_id, 1))[0]
        assert event["seq"] == 1 and event["data"]["text"] == "héllo"

        # Errors come back in MessagePack too, with the same fields.
        await mp.send_raw(b"\xc1")  # a byte MessagePack never uses
        err = await raw_frame(mp)
        assert isinstance(err, bytes)
        assert msgspec.msgpack.decode(err)["code"] == "malformed"
        await mp.send({"type": "subscribe", "chat_id": "no spaces!", "id": 9})
        err_d = msgspec.msgpack.decode(await raw_frame(mp))
        assert err_d["code"] == "invalid_frame" and err_d["id"] == 9
        assert err_d["chat_id"] == "no spaces!" and "$.chat_id" in err_d["message"]

        # A message sent as MessagePack reaches the JSON client.
        await send_message(mp, chat_id, "from msgpack", "mp1", id=2)
        ack = await mp.wait_for(lambda f: f["type"] == "ack")
        assert ack["id"] == 2 and ack["seq"] == 2
        got = await plain.events(chat_id, 1)
        assert got[0]["type"] == "user_message" and got[0]["data"]["text"] == "from msgpack"


# --- HTTP -------------------------------------------------------------------------------


async def test_http_publish_validation(gateway: Any, user: str, chat_id: str) -> None:
    service = gateway.headers("agent", "service")
    url = f"/v1/conversations/{chat_id}/events"
    async with connect(gateway.url(user)) as ws, \
            httpx.AsyncClient(base_url=gateway.http) as http:
        await ws.subscribe(chat_id)

        message = error_of(await http.post(url, content=b"{not json", headers=service),
                           400, "invalid_request")
        assert "json" in message.lower()
        cases: list[tuple[Any, str]] = [
            ({"type": "Bad Type", "data": {}}, "$.type"),
            ({"type": "note", "data": [1, 2]}, "$.data"),
            ({"type": "note", "data": "text"}, "$.data"),
            ({"data": {}}, "type"),
            ({"type": "note", "durable": "yes"}, "$.durable"),
            ({"events": []}, "$.events"),
            ({"events": [{"type": "ok"}, {"type": "Not-OK"}]}, "$.events[1].type"),
            ({"events": [{"type": "x"}] * 501}, "$.events"),
            ([{"type": "note"}], "array"),
            ({"type": "note\n", "data": {}}, "$.type"),  # `$` matched before a final newline
        ]
        for body, field in cases:
            resp = await http.post(url, json=body, headers=service)
            assert resp.status_code in (400, 422), (body, resp.text)
            assert field in error_of(resp, resp.status_code), (body, resp.text)
        reserved = await http.post(url, json={"type": "user_message", "data": {}},
                                   headers=service)
        assert "user_message" in error_of(reserved, 400, "reserved_type")
        bad_title = await http.post(url, json={"type": "title", "data": {"name": "x"}},
                                    headers=service)
        assert "title" in error_of(bad_title, 400, "invalid_request")

        # Over 1 MiB: refused by its declared length, and when streamed without one.
        big = b'{"type":"note","data":{"b":"' + b"x" * (1 << 20) + b'"}}'
        error_of(await http.post(url, content=big, headers=service), 413, "payload_too_large")

        async def chunks() -> Any:
            for start in range(0, len(big), 65536):
                yield big[start:start + 65536]

        error_of(await http.post(url, content=chunks(), headers=service),
                 413, "payload_too_large")

        error_of(await http.post("/v1/conversations/no%20spaces!/events",
                                 json={"type": "note"}, headers=service), 400, "invalid_request")
        error_of(await http.post(f"/v1/conversations/{'c' * 129}/events",
                                 json={"type": "note"}, headers=service), 400, "invalid_request")
        error_of(await http.post(f"/v1/conversations/{chat_id}-nobody/events",
                                 json={"type": "note"}, headers=service), 404, "not_found")
        error_of(await http.post(url, json={"type": "note"}, headers=gateway.headers(user)),
                 403, "forbidden")

        # None of it reached the room or the history: the next event is seq 1.
        await publish(gateway, chat_id, {"type": "note", "data": {"first": True}})
        got = await ws.events(chat_id, 1)
        assert got[0]["seq"] == 1 and got[0]["data"] == {"first": True}
        page = (await http.get(url + "?after=0", headers=gateway.headers(user))).json()
        assert [e["seq"] for e in page["events"]] == [1]
        absent = await http.get(f"/v1/conversations/{chat_id}-nobody",
                                headers=gateway.headers(user))
        error_of(absent, 404, "not_found")


async def test_http_publish_refuses_data_messagepack_cannot_carry(
    gateway: Any, user: str, chat_id: str
) -> None:
    """An integer past 64 bits in a published event's data was stored, and then never
    reached MessagePack subscribers (its frame cannot be encoded): it broke the fan-out and
    the process's pub/sub connection with it. Refused up front now, as a WebSocket
    ``message``'s data is (protocol.uncarried), naming where it is, and nothing is stored."""
    service, owner = gateway.headers("agent", "service"), gateway.headers(user)
    url = f"/v1/conversations/{chat_id}/events"
    big = 123456789012345678901234567890
    async with connect(gateway.url(user), binary=True) as mp, connect(gateway.url(user)) as js, \
            httpx.AsyncClient(base_url=gateway.http) as http:
        await mp.subscribe(chat_id)
        await js.subscribe(chat_id)
        await publish(gateway, chat_id, {"type": "note", "data": {"n": 1}})
        for ws in (mp, js):
            await ws.expect("note", seq=1)
        key = "k-" + uuid.uuid4().hex
        cases: list[tuple[Any, str]] = [
            ({"type": "note", "data": {"n": big}}, "$.data"),
            ({"type": "note", "data": {"deep": [{"n": -big}]}, "durable": False}, "$.data"),
            ({"events": [{"type": "note", "data": {"ok": 1}},
                         {"type": "note", "data": {"n": 2**64}}], "idempotency_key": key},
             "$.events[1].data"),
            ({"events": [{"type": "note", "data": {"n": -(2**63) - 1}, "durable": False},
                         {"type": "note", "data": {"ok": 2}}]}, "$.events[0].data"),
        ]
        for body, where in cases:
            message = error_of(await http.post(url, json=body, headers=service),
                               422, "unprocessable")
            assert f"`{where}`" in message and "2**64" in message, (body, message)

        # Nothing was stored, not even the refused batch's idempotency key.
        page = (await http.get(url + "?after=0", headers=owner)).json()
        assert page["last_seq"] == 1 and [e["seq"] for e in page["events"]] == [1], page
        edges = {"max": 2**64 - 1, "min": -(2**63)}  # the last integers both formats carry
        retried = await publish(gateway, chat_id, {"type": "note", "data": {"ok": 1}},
                                {"type": "note", "data": edges}, key=key)
        assert retried["seqs"] == [2, 3] and retried["duplicate"] is False, retried
        # And nothing was sent: both subscribers' next frames are those, MessagePack's too.
        for ws in (mp, js):
            got = [(f["type"], f["seq"], f["data"]) for f in (await ws.recv(), await ws.recv())]
            assert got == [("note", 2, {"ok": 1}), ("note", 3, edges)], got
        page = (await http.get(url + "?after=0", headers=owner)).json()
        assert page["last_seq"] == 3 and [e["data"] for e in page["events"]] == [
            {"n": 1}, {"ok": 1}, edges]


async def test_cli_publish_refuses_data_messagepack_cannot_carry(
    gateway: Any, redis_url: str, user: str, chat_id: str, tmp_path: Any
) -> None:
    """``gateway publish`` writes straight to Redis, past the HTTP route, and stored such
    data. Refused now where every publisher's events pass (events.to_out_event): exit status
    1 and the refusal on stderr, nothing stored or sent; the next good publish goes out."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    env.update(GATEWAY_REDIS_URL=redis_url, GATEWAY_DATA_DIR=str(tmp_path))

    async def cli(*args: str) -> tuple[int | None, str, str]:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gateway", "publish", chat_id, *args, env=env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), 30)
        return proc.returncode, out.decode(), err.decode()

    big = 123456789012345678901234567890
    async with connect(gateway.url(user), binary=True) as mp, connect(gateway.url(user)) as js:
        for ws in (mp, js):
            await ws.subscribe(chat_id)  # creates it
        for args in (("note", f'{{"n": {big}}}'),
                     ("note", f'{{"deep": [{{"n": {-big}}}]}}', "--ephemeral"),
                     ("tool_result", f'{{"hits": [{2**64}]}}')):
            status, out, err = await cli(*args)
            assert status == 1 and not out, (args, status, out, err)
            assert err.startswith("gateway publish: unprocessable: "), err
            assert "`$.data`" in err and "2**64" in err and "Traceback" not in err, err

        edges = {"max": 2**64 - 1, "min": -(2**63)}  # the last integers both formats carry
        status, out, err = await cli("note", msgspec.json.encode({"edges": edges}).decode())
        assert status == 0 and msgspec.json.decode(out)["seqs"] == [1], (status, out, err)
        # Nothing was sent before it: both subscribers' next frame is that, MessagePack's too.
        for ws in (mp, js):
            frame = await ws.recv()
            assert (frame["type"], frame["seq"], frame["data"]) == ("note", 1, {"edges": edges})
    async with httpx.AsyncClient(base_url=gateway.http) as http:
        page = (await http.get(f"/v1/conversations/{chat_id}/events?after=0",
                               headers=gateway.headers(user))).json()
    assert page["last_seq"] == 1 and [e["data"] for e in page["events"]] == [{"edges": edges}]


async def test_http_path_and_query_validation(gateway: Any, user: str, chat_id: str) -> None:
    headers = gateway.headers(user)
    await create(gateway, user, chat_id)
    async with httpx.AsyncClient(base_url=gateway.http) as http:
        url = f"/v1/conversations/{chat_id}/events"
        for query, field in [("limit=0", "limit"), ("after=-1", "after"),
                             ("limit=1001", "limit"), ("limit=abc", "limit")]:
            message = error_of(await http.get(f"{url}?{query}", headers=headers),
                               400, "invalid_request")
            assert field in message, (query, message)
        ok = await http.get(f"{url}?after=0&limit=1000", headers=headers)
        assert ok.status_code == 200 and ok.json()["events"] == []

        error_of(await http.get("/v1/conversations/bad*id", headers=headers),
                 400, "invalid_request")
        error_of(await http.get("/v1/conversations?limit=0", headers=headers),
                 400, "invalid_request")
        error_of(await http.patch(f"/v1/conversations/{chat_id}", json={"title": "   "},
                                  headers=headers), 422, "unprocessable")
        error_of(await http.patch(f"/v1/conversations/{chat_id}", json={"name": "x"},
                                  headers=headers), 422, "unprocessable")
        error_of(await http.post("/v1/conversations", json={"chat_id": "no spaces!"},
                                 headers=headers), 422, "unprocessable")
        error_of(await http.post("/v1/conversations", content=b"{oops", headers=headers),
                 400, "invalid_request")
        error_of(await http.put(f"/v1/conversations/{chat_id}", json={}, headers=headers),
                 405, "method_not_allowed")
        error_of(await http.get("/v1/nowhere", headers=headers), 404, "not_found")


async def test_creating_the_same_conversation_twice_conflicts(gateway: Any, user: str,
                                                              chat_id: str) -> None:
    headers = gateway.headers(user)
    async with httpx.AsyncClient(base_url=gateway.http) as http:
        first = await http.post("/v1/conversations", json={"chat_id": chat_id, "title": "One"},
                                headers=headers)
        assert first.status_code == 201, first.text
        assert first.json()["chat_id"] == chat_id and first.json()["title"] == "One"
        again = await http.post("/v1/conversations", json={"chat_id": chat_id, "title": "Two"},
                                headers=headers)
        assert chat_id in error_of(again, 409, "conflict")
        conv = (await http.get(f"/v1/conversations/{chat_id}", headers=headers)).json()
        assert conv["title"] == "One" and conv["last_seq"] == first.json()["last_seq"]


async def test_idempotent_publish_returns_the_first_result(gateway: Any, user: str,
                                                           chat_id: str) -> None:
    service = gateway.headers("agent", "service")
    url = f"/v1/conversations/{chat_id}/events"
    key = "k-" + uuid.uuid4().hex
    batch = {"events": [{"type": "note", "data": {"n": 1}}, {"type": "note", "data": {"n": 2}}],
             "idempotency_key": key}
    async with connect(gateway.url(user)) as ws, \
            httpx.AsyncClient(base_url=gateway.http) as http:
        await ws.subscribe(chat_id)
        first = await http.post(url, json=batch, headers=service)
        assert first.status_code == 200, first.text
        assert first.json()["seqs"] == [1, 2] and first.json()["duplicate"] is False
        for _ in range(2):
            again = await http.post(url, json=batch, headers=service)
            assert again.status_code == 200, again.text
            body = again.json()
            assert body["seqs"] == [1, 2] and body["duplicate"] is True
            assert body["epoch"] == first.json()["epoch"]
        # The single-event form carries its key on the event.
        single = {"type": "note", "data": {"n": 3}, "idempotency_key": key + "-single"}
        one = (await http.post(url, json=single, headers=service)).json()
        two = (await http.post(url, json=single, headers=service)).json()
        assert one["seqs"] == two["seqs"] == [3]
        assert (one["duplicate"], two["duplicate"]) == (False, True)

        # A fresh event after the retries is seq 4: the retries were never delivered.
        await publish(gateway, chat_id, {"type": "note", "data": {"n": 4}})
        got = await ws.events(chat_id, 4)
        assert [(e["seq"], e["data"]["n"]) for e in got] == [(1, 1), (2, 2), (3, 3), (4, 4)]
        page = (await http.get(url + "?after=0", headers=gateway.headers(user))).json()
        assert [e["data"]["n"] for e in page["events"]] == [1, 2, 3, 4]
        assert page["last_seq"] == 4


async def test_health_endpoints(gateway: Any) -> None:
    async with httpx.AsyncClient(base_url=gateway.http) as http:
        health = await http.get("/healthz")
        assert health.status_code == 200 and health.json() == {"status": "ok"}
        ready = await http.get("/readyz")
        assert ready.status_code == 200 and ready.json() == {
            "status": "ready", "dependencies": {"redis": "ok", "pubsub": "ok"}}


async def test_a_stored_integer_past_64_bits_still_reaches_messagepack_clients(
    gateway: Any, user: str, chat_id: str, redis_url: str
) -> None:
    """A log written before the gateway refused integers past 64 bits may hold some. Their
    frame could not be encoded for MessagePack: the exception closed the pub/sub connection
    of every conversation, and a MessagePack resume over it closed with 1011 each time. It
    now reaches MessagePack clients with that integer as a float (what a JavaScript client
    reads from the JSON), live and on resume, and JSON clients get it exactly."""
    import redis.asyncio as aioredis

    from gateway.config import Settings
    from gateway.redis.backend import Backend
    from gateway.redis.records import OutEvent
    from gateway.redis.store import Store

    big, other = 123456789012345678901234567890, chat_id + "-other"
    conversation = await create(gateway, user, chat_id)
    await create(gateway, user, other)
    settings = Settings(redis_url=redis_url, secret="x")
    store = Store(Backend.of(aioredis.from_url(redis_url), settings), settings)
    stored = b'{"n":%d,"deep":[{"m":%d}],"ok":1}' % (big, -big)
    try:
        async with connect(gateway.url(user), binary=True) as mp, \
                connect(gateway.url(user)) as js:
            for ws in (mp, js):
                await ws.subscribe(chat_id)
                await ws.subscribe(other)
            # As an older gateway stored it: straight to the store, past today's checks.
            await store.publish(chat_id, [OutEvent(type="note", data=stored)])
            await publish(gateway, other, {"type": "note", "data": {"k": 1}})
            live = [await mp.recv(), await mp.recv()]
            exact = [await js.recv(), await js.recv()]
            assert [(f["chat_id"], f["seq"]) for f in live] == [(chat_id, 1), (other, 1)]
            assert live[0]["data"] == {"n": float(big), "deep": [{"m": -float(big)}], "ok": 1}
            assert isinstance(live[0]["data"]["n"], float)
            assert exact[0]["data"] == {"n": big, "deep": [{"m": -big}], "ok": 1}
            assert exact[1]["data"] == {"k": 1}
        async with connect(gateway.url(user), binary=True) as late:
            await late.subscribe(chat_id, since={"seq": 0, "epoch": conversation["epoch"]})
            replayed = await late.events(chat_id, 1)
            assert replayed[0]["data"]["n"] == float(big)
            await publish(gateway, chat_id, {"type": "note", "data": {"after": 1}})
            assert (await late.events(chat_id, 1))[0]["seq"] == 2  # the connection is fine
    finally:
        await store.backend.aclose()
