"""Resumable answers: streamed deltas, their snapshot on subscribe, commits and discards."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from .steps import post_events as post
from .steps import start_turn
from .wsclient import Client, Frame, connect

pytestmark = pytest.mark.anyio


def delta(text: str, attempt: str = "a1", kind: str = "delta") -> dict[str, Any]:
    return {"type": kind, "data": {"text": text}, "durable": False, "attempt": attempt}


class Screen:
    """What a client shows: each open stream's text, rebuilt from snapshot and deltas."""

    def __init__(self) -> None:
        self.streams: dict[str, dict[str, Any]] = {}
        self.committed: list[Frame] = []
        self.discarded: list[str] = []
        self.rebuilt: dict[str, str] = {}  # a committed stream's text as this client built it

    def apply(self, frame: Frame) -> None:
        kind = frame.get("type")
        if kind == "subscribed":
            listed = frame["snapshot"].get("streams")
            if listed is not None:
                self.streams = {s["id"]: dict(s) for s in listed}
        elif "stream" in frame:
            sid, pos = frame["stream"]["id"], frame["stream"]["pos"]
            state = self.streams.setdefault(sid, {"text": "", "pos": 0})
            assert pos == state["pos"], (frame, state)  # never a gap, never a duplicate
            state["text"] += frame["data"]["text"]
            state["pos"] = pos + 1
        elif kind == "stream_discarded":
            self.discarded.append(frame["data"]["stream_id"])
            self.streams.pop(frame["data"]["stream_id"], None)
        elif kind in ("message", "reasoning") and "stream_id" in frame.get("data", {}):
            state = self.streams.pop(frame["data"]["stream_id"], {})
            if state:
                self.rebuilt[frame["data"]["stream_id"]] = state["text"]
            self.committed.append(frame)


async def read_until(ws: Client, screen: Any, predicate: Callable[[Frame], bool],
                     timeout: float = 10.0) -> Frame:
    """Apply every frame to ``screen`` until one satisfies ``predicate``."""
    async with asyncio.timeout(timeout):
        while True:
            frame = await ws.recv(timeout)
            screen.apply(frame)
            if predicate(frame):
                return frame


async def test_a_delta_with_no_turn_running_is_a_plain_ephemeral_frame(
        gateway: Any, user: str, chat_id: str) -> None:
    async with connect(gateway.url(user)) as ws:
        await ws.subscribe(chat_id)
        assert (await post(gateway, chat_id, delta("loose"))).status_code == 200
        frame = await ws.expect("delta")
        assert "stream" not in frame and frame["seq"] is None


async def test_deltas_form_a_stream_that_a_late_subscriber_joins_exactly(
        gateway: Any, user: str, chat_id: str) -> None:
    async with connect(gateway.url(user)) as ws, connect(gateway.url(user)) as late:
        await ws.subscribe(chat_id)
        turn_id = await start_turn(ws, chat_id)
        for word in ("The ", "answer ", "is "):
            assert (await post(gateway, chat_id, delta(word))).status_code == 200
        frames = [await ws.wait_for(lambda f: f.get("type") == "delta") for _ in range(3)]
        sid = frames[0]["stream"]["id"]
        assert [f["stream"] for f in frames] == [{"id": sid, "pos": i} for i in range(3)]

        joined = await late.subscribe(chat_id)
        assert joined["snapshot"]["streams"] == [
            {"id": sid, "type": "delta", "turn_id": turn_id, "text": "The answer is ", "pos": 3}]
        await post(gateway, chat_id, delta("42."))
        nxt = await late.wait_for(lambda f: f.get("type") == "delta")
        assert nxt["stream"] == {"id": sid, "pos": 3} and nxt["data"]["text"] == "42."

        # message with no text commits what was streamed; history keeps only that message.
        reply = await post(gateway, chat_id, {"type": "message", "data": {}},
                           {"type": "turn_end", "data": {}})
        assert reply.status_code == 200, reply.text
        for client in (ws, late):
            message = await client.wait_for(lambda f: f.get("type") == "message")
            assert message["data"] == {"stream_id": sid, "text": "The answer is 42."}
            await client.wait_for(lambda f: f.get("type") == "turn_end")
        after = await late.subscribe(chat_id, since={"seq": 0, "epoch": joined["epoch"]})
        assert after["snapshot"]["streams"] == []
        types = [f["type"] for f in await late.events(chat_id, after["replayed"])]
        assert types == ["user_message", "turn_start", "head", "message", "turn_end"]


async def test_turn_end_commits_an_open_stream_as_partial(
        gateway: Any, user: str, chat_id: str) -> None:
    async with connect(gateway.url(user)) as ws:
        await ws.subscribe(chat_id)
        await start_turn(ws, chat_id)
        await post(gateway, chat_id, delta("thinking", kind="reasoning_delta"), delta("Half an"))
        await ws.send({"type": "cancel", "chat_id": chat_id})
        await ws.wait_for(lambda f: f.get("type") == "cancel_requested")
        await post(gateway, chat_id, {"type": "turn_end", "data": {"reason": "cancelled"}})
        seen: list[Frame] = []
        while not seen or seen[-1]["type"] != "turn_end":
            frame = await ws.recv()
            if frame.get("seq") is not None and "data" in frame:
                seen.append(frame)
        partials = {f["type"]: f["data"] for f in seen[:-1]}
        assert partials["message"]["text"] == "Half an" and partials["message"]["partial"]
        assert partials["reasoning"]["text"] == "thinking" and partials["reasoning"]["partial"]
        assert [f["seq"] for f in seen] == list(range(seen[0]["seq"], seen[-1]["seq"] + 1))
        assert seen[-1]["data"]["reason"] == "cancelled"


async def test_a_new_attempt_discards_the_old_stream_first(
        gateway: Any, user: str, chat_id: str) -> None:
    async with connect(gateway.url(user)) as ws:
        await ws.subscribe(chat_id)
        await start_turn(ws, chat_id)
        screen = Screen()
        await post(gateway, chat_id, delta("first try ", attempt="w1"))
        old = await read_until(ws, screen, lambda f: f.get("type") == "delta")
        await post(gateway, chat_id, delta("second ", attempt="w2"), delta("try", attempt="w2"))
        gone = await read_until(ws, screen, lambda f: f.get("type") == "stream_discarded")
        assert gone["data"]["stream_id"] == old["stream"]["id"]
        new = await read_until(ws, screen, lambda f: f.get("type") == "delta")
        assert new["stream"]["pos"] == 0 and new["stream"]["id"] != old["stream"]["id"]
        await read_until(ws, screen, lambda f: f.get("type") == "delta")
        assert [s["text"] for s in screen.streams.values()] == ["second try"]


async def test_a_stream_that_refused_a_delta_for_size_refuses_every_later_one(
        start_gateway: Any, user: str, chat_id: str) -> None:
    """Its text stays a prefix of what the agent sent: never a hole in the middle."""
    gw = start_gateway(stream_max_bytes=10)
    async with connect(gw.url(user)) as ws:
        await ws.subscribe(chat_id)
        await start_turn(ws, chat_id)
        assert (await post(gw, chat_id, delta("12345"))).status_code == 200
        refused = await post(gw, chat_id, delta("678901"))
        assert refused.status_code == 413 and refused.json()["error"]["code"] == "stream_too_large"
        for later in (delta("67890"), delta("6")):  # would fit: refused all the same
            again = await post(gw, chat_id, later)
            assert again.status_code == 413, again.text
            assert again.json()["error"]["code"] == "stream_too_large"
        other = await post(gw, chat_id, delta("r", kind="reasoning_delta"))
        assert other.status_code == 200  # another type's stream is its own
        async with connect(gw.url(user)) as late:
            joined = await late.subscribe(chat_id)
            assert sorted((s["type"], s["text"], s["pos"])
                          for s in joined["snapshot"]["streams"]) == [
                ("delta", "12345", 1), ("reasoning_delta", "r", 1)]
        # A commit ends the refused stream; the next delta opens a new one.
        assert (await post(gw, chat_id, {"type": "message", "data": {}})).status_code == 200
        assert (await post(gw, chat_id, delta("next"))).status_code == 200
        async with connect(gw.url(user)) as late:
            joined = await late.subscribe(chat_id)
            texts = {s["type"]: s["text"] for s in joined["snapshot"]["streams"]}
            assert texts["delta"] == "next"


async def test_a_refused_stream_stays_a_prefix_whatever_the_batch_sizes(
        start_gateway: Any, user: str, chat_id: str) -> None:
    """Tokens sent in batches of varying sizes (as the worker coalesces them): once one
    batch is refused for size, every later one is too, and the stream's text is exactly
    the batches accepted before it."""
    limit = 64
    gw = start_gateway(stream_max_bytes=limit)
    rng = random.Random(17)
    for round_ in range(4):
        chat = f"{chat_id}-{round_}"
        async with connect(gw.url(user)) as ws:
            await ws.subscribe(chat)
            await start_turn(ws, chat)
            accepted, refusals, sent = "", 0, 0
            while sent < 3 * limit:
                tokens = [rng.choice("abcdefgh") * rng.randint(1, 9)
                          for _ in range(rng.randint(1, 4))]
                batch = [delta(t) for t in tokens]
                reply = await post(gw, chat, *batch)
                sent += sum(len(t) for t in tokens)
                if reply.status_code == 200:
                    assert refusals == 0, "a delta was accepted after a refusal"
                    accepted += "".join(tokens)
                else:
                    assert reply.json()["error"]["code"] == "stream_too_large"
                    refusals += 1
            assert refusals > 0 and len(accepted) <= limit
            async with connect(gw.url(user)) as late:
                joined = await late.subscribe(chat)
                [stream] = joined["snapshot"]["streams"]
                assert stream["text"] == accepted


async def test_subscribing_at_random_points_of_a_fast_answer_rebuilds_it_exactly(
        gateway: Any, user: str, chat_id: str) -> None:
    """Hundreds of joins while deltas stream: snapshot + live deltas = the committed text."""
    words = [f"w{i} " for i in range(300)]
    joins = [random.randrange(len(words)) for _ in range(150)]
    joined = [asyncio.Event() for _ in joins]
    subscribed = [asyncio.Event() for _ in joins]
    async with connect(gateway.url(user)) as ws:
        await ws.subscribe(chat_id)
        await start_turn(ws, chat_id)

        async def agent() -> None:
            async with httpx.AsyncClient(base_url=gateway.http,
                                         headers=gateway.headers("a", "service")) as http:
                for i, word in enumerate(words):
                    resp = await http.post(f"/v1/conversations/{chat_id}/events", json=delta(word))
                    assert resp.status_code == 200, resp.text
                    for at, event in zip(joins, joined, strict=True):
                        if at == i:
                            event.set()
                # Commit once every viewer is in (one that came after would see no stream).
                await asyncio.gather(*(event.wait() for event in subscribed))
                resp = await http.post(f"/v1/conversations/{chat_id}/events",
                                       json={"events": [{"type": "message", "data": {}},
                                                        {"type": "turn_end", "data": {}}]})
                assert resp.status_code == 200, resp.text

        async def viewer(index: int, start: asyncio.Event) -> str:
            await start.wait()  # joins right after a given word was published
            screen = Screen()
            # Many devices at once: one (service) identity each, below the per-user cap.
            async with connect(gateway.url(f"viewer{index}", "service")) as client:
                await client.send({"type": "subscribe", "chat_id": chat_id})
                await read_until(client, screen, lambda f: f.get("type") == "subscribed")
                subscribed[index].set()
                message = await read_until(client, screen, lambda f: f.get("type") == "message",
                                           timeout=30)
            return screen.rebuilt[message["data"]["stream_id"]]

        views = asyncio.gather(*(viewer(i, event) for i, event in enumerate(joined)))
        await agent()
        expected = "".join(words)
        message = await ws.wait_for(lambda f: f.get("type") == "message", timeout=30)
        assert message["data"]["text"] == expected
        assert await views == [expected] * len(joins)
