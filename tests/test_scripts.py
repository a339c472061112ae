"""The Lua scripts' contracts, run on a real server: what ``lua/lib.lua`` writes is what
:mod:`gateway.redis.envelope` and :mod:`gateway.redis.scripts` read."""

from __future__ import annotations

import asyncio
from importlib import resources
from typing import Any

import msgspec
import pytest
import redis.asyncio as aioredis

from gateway.config import Settings
from gateway.errors import Rejected
from gateway.redis.envelope import Envelope, unpack
from gateway.redis.keys import log_key, meta_key, room_channel
from gateway.redis.records import OutEvent
from gateway.redis.scripts import Call, PublishScript, ReadScript

pytestmark = pytest.mark.anyio

LIB = resources.files("gateway.redis").joinpath("lua", "lib.lua").read_text()
PACK = LIB + """
local seq = ARGV[2] ~= '' and tonumber(ARGV[2]) or nil
local stream_id = ARGV[3] ~= '' and ARGV[3] or nil
return envelope(ARGV[1], seq, stream_id, ARGV[4], ARGV[5])
"""

MS_TEXT = LIB + "return ms_text(ARGV[1], ARGV[2])"


@pytest.mark.parametrize(("micros", "ms"), [
    ("0", "000"), ("7", "000"), ("999", "000"), ("1000", "001"), ("45678", "045"),
    ("999999", "999"), ("123456", "123")])
async def test_the_lua_clock_is_time_in_ms_without_formatting_a_number(
        redis_url: str, micros: str, ms: str) -> None:
    client = aioredis.from_url(redis_url)
    try:
        text = await client.eval(MS_TEXT, 0, "1795670297", micros)  # type: ignore[misc]
        now = await client.eval(LIB + "local n, t = now_ms() return {n, t}", 0)  # type: ignore[misc]
        seconds, _ = await client.time()
    finally:
        await client.aclose()
    assert text == b"1795670297" + ms.encode()
    assert str(now[0]).encode() == now[1]  # the number and its text agree
    assert abs(int(now[1]) - seconds * 1000) < 5000


@pytest.mark.parametrize(("args", "expected"), [
    (("e7", "12", "", "", '{"type":"note","seq":12}'),
     Envelope("e7", 12, None, b'{"type":"note","seq":12}')),
    (("e7", "", "se7.1", "3", '{"type":"delta","data":{"text":"a|b"}}'),
     Envelope("", None, ("se7.1", 3), b'{"type":"delta","data":{"text":"a|b"}}')),
    (("e7", "", "", "", '{"type":"typing","data":{"x":"|||"}}'),
     Envelope("", None, None, b'{"type":"typing","data":{"x":"|||"}}')),
])
async def test_the_lua_envelope_is_what_python_unpacks(
        redis_url: str, args: tuple[str, ...], expected: Envelope) -> None:
    client = aioredis.from_url(redis_url)
    try:
        packed = await client.eval(PACK, 0, *args)  # type: ignore[misc]
    finally:
        await client.aclose()
    assert unpack(packed) == expected


async def test_publish_and_read_replies_decode_into_their_structs(
        redis_url: str, chat_id: str) -> None:
    settings = Settings(redis_url=redis_url)
    publish, read = PublishScript(settings), ReadScript(settings)
    client = aioredis.from_url(redis_url)

    async def run(call: Call) -> bytes:
        script, keys, args = call
        reply: bytes = await client.eval(script.source, len(keys), *keys, *args)  # type: ignore[misc]
        return reply

    try:
        created = publish.decode(await run(publish.call(
            chat_id, [OutEvent(type="note", data=b'{"n":1}'),
                      OutEvent(type="typing", data=b"{}", durable=False)],
            fresh="e1", create_owner="alice", writer="", idempotency_key="k")))
        assert (created.epoch, created.seqs, created.last_seq, created.owner) == (
            "e1", [1, None], 1, "alice")
        assert created.created and created.listed and not created.duplicate
        assert created.feed is not None and '"created":true' in created.feed
        again = publish.decode(await run(publish.call(
            chat_id, [OutEvent(type="note", data=b'{"n":1}')], fresh="e2", create_owner="",
            writer="", idempotency_key="k")))
        assert again.duplicate and again.seqs == [1, None] and not again.created
        started = publish.decode(await run(publish.call(
            chat_id, [OutEvent(type="turn_start", data=b"{}", turn_id="t1")], fresh="e3",
            create_owner="", writer="", idempotency_key=None)))
        assert started.turn_id == "t1" and started.seqs == [2]
        with pytest.raises(Rejected) as refused:
            publish.decode(await run(publish.call(
                chat_id, [OutEvent(type="note", data=b"{}")], fresh="e4", create_owner="",
                writer="bob", idempotency_key=None)))
        assert refused.value.code == "forbidden"

        history = read.decode(await run(read.call(chat_id, 0, 10, create_owner="",
                                                  fresh="e5")))
        assert history.meta is not None and history.meta.owner == "alice"
        assert history.meta.status == "running" and history.meta.turn_id == "t1"
        assert [seq for seq, _ in history.frames] == [1, 2, 3]  # the note, turn_start, head
        assert history.frames[0][1].startswith(b'{"type":"note"')
        assert history.frames[2][1].startswith(b'{"type":"head"')
        assert history.meta.head == "t1"
        missing = read.decode(await run(read.call(chat_id + "-none", None, 10,
                                                  create_owner="", fresh="e6")))
        assert missing.meta is None and missing.frames == [] and not missing.created
    finally:
        await client.aclose()


async def test_a_plain_event_alone_leaves_what_it_leaves_in_a_batch(
        redis_url: str, chat_id: str) -> None:
    """``publish.lua`` answers one plain durable event by a short path of its own; it must
    store, publish and answer what the general path (any batch of two) does."""
    settings = Settings(redis_url=redis_url)
    publish = PublishScript(settings)
    client = aioredis.from_url(redis_url)
    typing = OutEvent(type="typing", data=b"{}", durable=False)  # makes a batch, stores nothing

    async def run(chat: str, events: list[OutEvent], owner: str = "", writer: str = "",
                  key: str | None = None) -> Any:
        script, keys, args = publish.call(chat, events, fresh="e1", create_owner=owner,
                                          writer=writer, idempotency_key=key)
        return publish.decode(await client.eval(script.source, len(keys), *keys, *args))  # type: ignore[misc]

    async def stored(chat: str) -> list[tuple[dict[str, Any], bytes]]:
        entries = await client.xrange(log_key(chat))
        frames = []
        for _, fields in entries:
            frame = msgspec.json.decode(fields[b"f"])
            assert frame.pop("chat_id") == chat and isinstance(frame.pop("ts"), int)
            frame["data"].pop("started_at", None)  # a time, like ts
            frames.append((frame, fields[b"n"]))
        return frames

    try:
        alone, batched = chat_id + "-alone", chat_id + "-batched"
        for chat in (alone, batched):
            await run(chat, [OutEvent(type="note", data=b'{"first":1}')], owner="alice")
        note = OutEvent(type="tool_call", data=b'{"name":"search","args":{"q":"x"}}')
        def fields(r: Any) -> tuple[Any, ...]:
            return (r.epoch, r.last_seq, r.owner, r.head, r.duplicate, r.listed, r.created,
                    r.turn_id)

        for running, key in ((False, None), (True, None), (True, "k1")):
            if running and key is None:
                for chat in (alone, batched):
                    await run(chat, [OutEvent(type="turn_start", data=b"{}", turn_id="t1")])
            await client.hset(meta_key(alone), "updated_at", "0")  # to see it move
            one = await run(alone, [note], writer="alice", key=key)
            two = await run(batched, [note, typing], writer="alice", key=key)
            assert fields(one) == fields(two)
            assert one.seqs == two.seqs[:1] and two.seqs[1:] == [None]
            if key is not None:  # replayed: the first result, nothing written
                again = [await run(alone, [note], writer="alice", key=key),
                         await run(batched, [note, typing], writer="alice", key=key)]
                assert [fields(r) for r in again] == [
                    (*fields(r)[:4], True, False, False, None) for r in (one, two)]
                assert again[0].seqs == one.seqs and again[1].seqs == two.seqs
        assert await stored(alone) == await stored(batched)
        last, node = (await stored(alone))[-1]
        assert last["type"] == "tool_call" and last["node"] == "t1" and node == b"t1"
        meta = [await client.hmget(meta_key(chat), "seq", "status", "turn_id", "head", "owner")
                for chat in (alone, batched)]
        assert meta[0] == meta[1] and meta[0][:3] == [b"6", b"running", b"t1"]
        assert meta[0][4] == b"alice"
        [(_, fields)] = await client.xrevrange(log_key(alone), count=1)
        ts = msgspec.json.decode(fields[b"f"])["ts"]  # the list's order: updated with it
        assert await client.hget(meta_key(alone), "updated_at") == str(ts).encode()
        with pytest.raises(Rejected) as refused:  # another writer: refused as ever
            await run(alone, [note], writer="bob")
        assert refused.value.code == "forbidden"
        with pytest.raises(Rejected) as missing:
            await run(chat_id + "-none", [note])
        assert missing.value.code == "not_found"
    finally:
        await client.aclose()


async def test_a_delta_alone_leaves_what_it_leaves_in_a_batch(
        redis_url: str, chat_id: str) -> None:
    """A delta that goes on with its open stream takes a short path of its own in
    ``publish.lua``; it must append, publish, move the stream and answer as the general path
    (a batch of two) does, and leave opening, another attempt and the size bound to it."""
    settings = Settings(redis_url=redis_url, stream_max_bytes=40)
    publish = PublishScript(settings)
    client = aioredis.from_url(redis_url)
    alone, batched = chat_id + "-alone", chat_id + "-batched"
    typing = OutEvent(type="typing", data=b"{}", durable=False)  # makes a batch, stores nothing
    pubsub = client.pubsub()
    await pubsub.ssubscribe(room_channel(alone), room_channel(batched))

    async def run(chat: str, events: list[OutEvent], owner: str = "") -> Any:
        script, keys, args = publish.call(chat, events, fresh="e1", create_owner=owner,
                                          writer="alice" if not owner else "",
                                          idempotency_key=None)
        return publish.decode(await client.eval(script.source, len(keys), *keys, *args))  # type: ignore[misc]

    async def both(event: OutEvent) -> tuple[Any, Any]:
        one = await run(alone, [event])
        two = await run(batched, [event, typing])
        assert (one.epoch, one.last_seq, one.owner, one.head, one.duplicate, one.listed,
                one.turn_id) == (two.epoch, two.last_seq, two.owner, two.head, two.duplicate,
                                 two.listed, two.turn_id)
        assert one.seqs == [None] and two.seqs == [None, None]
        return one, two

    def delta(text: str, attempt: str = "a1") -> OutEvent:
        return OutEvent(type="delta", data=msgspec.json.encode({"text": text}), durable=False,
                        attempt=attempt)

    try:
        for chat in (alone, batched):
            await run(chat, [OutEvent(type="note", data=b"{}")], owner="alice")
            await run(chat, [OutEvent(type="turn_start", data=b"{}", turn_id="t1")])
        for text in ("Hel", "lo, ", "world"):  # opens the stream, then goes on with it
            await both(delta(text))
        await both(delta("again", attempt="a2"))  # another attempt: the old one discarded
        await both(delta(" and on", attempt="a2"))
        for text in ("x" * 40, "y"):  # past the bound: refused, and every later delta too
            for chat, events in ((alone, [delta(text, "a2")]),
                                 (batched, [delta(text, "a2"), typing])):
                with pytest.raises(Rejected) as refused:
                    await run(chat, events)
                assert refused.value.code == "stream_too_large"
        for chat in (alone, batched):  # the stream ends as the same partial message
            await run(chat, [OutEvent(type="turn_end", data=b'{"reason":"complete"}')])
        published: dict[str, list[dict[str, Any]]] = {alone: [], batched: []}

        def ended(chat: str) -> bool:  # turn_end is the last frame each conversation sends
            return bool(published[chat]) and published[chat][-1]["type"] == "turn_end"

        async with asyncio.timeout(10):
            while not (ended(alone) and ended(batched)):
                message = await pubsub.get_message(timeout=None)
                if message is None or message["type"] != "smessage":
                    continue
                frame = msgspec.json.decode(unpack(message["data"]).frame)
                if frame["type"] != "typing":
                    chat = frame.pop("chat_id")
                    frame.pop("ts")
                    for moment in ("latency_ms", "started_at"):
                        frame["data"].pop(moment, None)
                    published[chat].append(frame)
        assert published[alone] == published[batched]
        types = [f["type"] for f in published[alone]]
        assert types.count("delta") == 5 and "stream_discarded" in types, types
        pieces = [(f["stream"]["pos"], f["data"]["text"]) for f in published[alone]
                  if f["type"] == "delta"]
        assert pieces == [(0, "Hel"), (1, "lo, "), (2, "world"), (0, "again"), (1, " and on")]
        assert [f["data"]["text"] for f in published[alone] if f["type"] == "message"] == [
            "again and on"]
        assert await stored(client, alone) == await stored(client, batched)
    finally:
        await pubsub.aclose()
        await client.aclose()


async def stored(client: aioredis.Redis, chat: str) -> list[tuple[dict[str, Any], bytes]]:
    """The log of ``chat``, without what differs between conversations (id, times)."""
    frames = []
    for _, fields in await client.xrange(log_key(chat)):
        frame = msgspec.json.decode(fields[b"f"])
        assert frame.pop("chat_id") == chat and isinstance(frame.pop("ts"), int)
        frame["data"].pop("started_at", None)
        frame["data"].pop("latency_ms", None)
        frames.append((frame, fields[b"n"]))
    return frames
