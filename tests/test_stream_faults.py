"""Resumable answers under faults: what a user sees when something dies mid-answer.

Every test runs real processes (``gateway serve`` children, ``gateway agent`` children, the
session's Redis-compatible server) and checks what users rely on: the text a client ends
with is the committed message's text, byte for byte, and it was built with no gap and no
duplicate. Nothing is mocked and nothing sleeps to wait for an event; publishers pace
themselves with short sleeps, as a model streaming tokens would.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Callable
from typing import Any

import httpx
import msgspec
import pytest
import redis.asyncio as aioredis
from websockets.exceptions import ConnectionClosed

from gateway.config import Settings
from gateway.errors import Rejected
from gateway.sdk.agent import Turn
from gateway.sdk.client import Event, GatewayClient, StreamReset

from .faults import until
from .steps import history, send_message
from .test_agent import (
    agent_process,
    agent_worker,
    of_type,
    pending,
    until_turn_end,
)
from .test_client import FAST, Watch, collect, take
from .test_sse import Block, open_stream
from .test_streams import delta, post, read_until
from .wsclient import Client, Frame, connect

pytestmark = pytest.mark.anyio

# The answer of the worker tests: non-ASCII on purpose (limits and "exact" are in bytes).
PIECES = [f"piece {i} — é日🙂; " for i in range(40)]
ANSWER = "".join(PIECES)


# --- handlers run by `gateway agent` child processes (imported as tests.test_stream_faults) --


async def stream_half_then_die(turn: Turn) -> None:
    """The first attempt: half the answer, one delta per piece, then the process dies."""
    for piece in PIECES[: len(PIECES) // 2]:
        await turn.delta(piece)
        await turn.flush()  # out now: every device holds this partial answer
    os.kill(os.getpid(), signal.SIGKILL)


async def answer_then_die_before_turn_end(turn: Turn) -> None:
    """The first attempt streams and commits the whole answer, then dies before its
    ``turn_end``: the next attempt's commit is a duplicate of this one."""
    for piece in PIECES:
        await turn.delta(piece)
    await turn.message()
    os.kill(os.getpid(), signal.SIGKILL)


async def answer_then_die_before_ack(turn: Turn) -> None:
    """The first attempt answers and ends its turn, then dies before the inbox entry is
    acknowledged: the turn is redelivered, already over."""
    for piece in PIECES:
        await turn.delta(piece)
    await turn.message()
    await turn.end()
    os.kill(os.getpid(), signal.SIGKILL)


# --- helpers ------------------------------------------------------------------------------


def is_durable(frame: Frame) -> bool:
    """An event of the log (replies such as ``ack`` carry a seq but no data)."""
    return isinstance(frame.get("seq"), int) and "data" in frame and "chat_id" in frame


class Screen:
    """What one WebSocket device shows, rebuilt from every frame it receives.

    Strict: a streamed delta must come at exactly its stream's next position (no gap, no
    duplicate), and durable events must be contiguous by seq across replays and live frames.
    """

    def __init__(self) -> None:
        self.frames: list[Frame] = []
        self.streams: dict[str, Any] = {}  # open stream id -> {text, pos}
        self.rebuilt: dict[str, str | None] = {}  # committed stream id -> the text built here
        self.discarded: list[str] = []
        self.events: list[Frame] = []  # durable events, in order
        self.seq: int | None = None
        self.epoch: str | None = None

    def apply(self, frame: Frame) -> None:
        self.frames.append(frame)
        kind = frame.get("type")
        assert kind != "error", frame
        if kind == "subscribed":
            self.epoch = frame["epoch"]
            if self.seq is None:  # live from here; a resume keeps its position
                self.seq = frame["seq"]
            listed = frame["snapshot"].get("streams")
            if listed is not None:  # the whole truth about open streams
                self.streams = {s["id"]: {"text": s["text"], "pos": s["pos"]} for s in listed}
        elif "stream" in frame:
            sid, pos = frame["stream"]["id"], frame["stream"]["pos"]
            state = self.streams.setdefault(sid, {"text": "", "pos": 0})
            assert pos == state["pos"], ("gap or duplicate", frame, state)
            state["text"] += frame["data"]["text"]
            state["pos"] = pos + 1
        elif kind == "stream_discarded":
            self.discarded.append(frame["data"]["stream_id"])
            self.streams.pop(frame["data"]["stream_id"], None)
        elif is_durable(frame):
            assert self.seq is not None and frame["seq"] == self.seq + 1, (self.seq, frame)
            self.seq = frame["seq"]
            self.events.append(frame)
            sid = frame["data"].get("stream_id")
            if sid is not None:
                closed = self.streams.pop(sid, None)
                self.rebuilt[sid] = closed["text"] if closed is not None else None

    def since(self) -> Frame:
        return {"seq": self.seq, "epoch": self.epoch}

    def types(self) -> list[str]:
        return [e["type"] for e in self.events]


def at_pos(pos: int) -> Callable[[Frame], bool]:
    return lambda f: "stream" in f and f["stream"]["pos"] >= pos


def of(kind: str) -> Callable[[Frame], bool]:
    return lambda f: f.get("type") == kind


async def ask(ws: Client, screen: Screen, chat_id: str, text: str = "hi") -> str:
    """Send a user message; returns the turn's id once ``turn_start`` arrived."""
    await send_message(ws, chat_id, text)
    started = await read_until(ws, screen, of("turn_start"))
    turn_id: str = started["data"]["turn_id"]
    return turn_id


async def commit(gw: Any, chat_id: str) -> None:
    """The agent commits what it streamed (a message with no text), then ends the turn."""
    resp = await post(gw, chat_id, {"type": "message", "data": {}},
                      {"type": "turn_end", "data": {}})
    assert resp.status_code == 200, resp.text


class Streamer:
    """An agent streaming an answer over HTTP with a service token: one streamed delta per
    piece, paced, pausable. ``sent`` holds the pieces the gateway accepted, in order."""

    def __init__(self, gw: Any, chat_id: str, pieces: list[str], pace: float = 0.005) -> None:
        self.gw, self.chat_id, self.pieces, self.pace = gw, chat_id, pieces, pace
        self.sent: list[str] = []
        self.parked = False
        self.finished = False
        self._go = asyncio.Event()
        self._go.set()
        self._stop = False
        self._changed = asyncio.Condition()
        self._task: asyncio.Task[None] | None = None

    @property
    def text(self) -> str:
        return "".join(self.sent)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def _notify(self, **state: bool) -> None:
        async with self._changed:
            for name, value in state.items():
                setattr(self, name, value)
            self._changed.notify_all()

    async def _run(self) -> None:
        try:
            async with httpx.AsyncClient(base_url=self.gw.http,
                                         headers=self.gw.headers("agent", "service")) as http:
                for piece in self.pieces:
                    while not self._go.is_set():
                        await self._notify(parked=True)
                        await self._go.wait()
                        await self._notify(parked=False)
                    if self._stop:
                        break
                    resp = await http.post(f"/v1/conversations/{self.chat_id}/events",
                                           json=delta(piece))
                    assert resp.status_code == 200, resp.text
                    async with self._changed:
                        self.sent.append(piece)
                        self._changed.notify_all()
                    await asyncio.sleep(self.pace)  # pacing, like tokens from a model
        finally:
            await self._notify(finished=True)

    async def _wait(self, predicate: Callable[[], bool], within: float) -> None:
        async with asyncio.timeout(within), self._changed:
            await self._changed.wait_for(lambda: predicate() or self.finished)

    async def until(self, count: int, within: float = 20.0) -> None:
        """Wait until ``count`` pieces were accepted (or every piece was)."""
        await self._wait(lambda: len(self.sent) >= count, within)
        assert len(self.sent) >= min(count, len(self.pieces)), "the streamer stopped early"

    async def pause(self, within: float = 10.0) -> int:
        """Stop before the next piece; returns how many were accepted by then."""
        self._go.clear()
        await self._wait(lambda: self.parked, within)
        return len(self.sent)

    def resume(self) -> None:
        self._go.set()

    async def finish(self, within: float = 30.0) -> str:
        """Wait for the last piece; returns the whole text sent."""
        if self._task is not None:
            async with asyncio.timeout(within):
                await self._task
        return self.text

    async def stop(self) -> str:
        """Stop after the piece in flight; returns the whole text sent."""
        self._stop = True
        self._go.set()
        return await self.finish()


# --- 1. a gateway killed mid-answer ------------------------------------------------------------


async def test_a_gateway_killed_mid_answer_is_resumed_exactly_on_another(
        start_gateway: Any, user: str, chat_id: str) -> None:
    a, b = start_gateway(), start_gateway()
    pieces = [f"w{i}·é " for i in range(150)]
    screen = Screen()
    async with asyncio.timeout(60):
        async with connect(a.url(user)) as on_a:
            screen.apply(await on_a.subscribe(chat_id))
            await ask(on_a, screen, chat_id)
            # The agent publishes through B: it outlives A.
            streamer = Streamer(b, chat_id, pieces)
            streamer.start()
            await read_until(on_a, screen, at_pos(20))
            await asyncio.to_thread(a.stop, signal.SIGKILL)
            assert a.proc is not None and a.proc.returncode == -signal.SIGKILL
            # Frames already on their way still count; then the connection is gone.
            with contextlib.suppress(ConnectionClosed):
                await read_until(on_a, screen, lambda f: False)
        [(sid, held)] = [(k, dict(v)) for k, v in screen.streams.items()]
        assert held["text"] == "".join(pieces[:held["pos"]])

        # While the client is away the answer goes on, and a durable event lands meanwhile.
        resp = await post(b, chat_id, {"type": "tool_call", "data": {"name": "lookup"}})
        assert resp.status_code == 200, resp.text
        await streamer.until(held["pos"] + 20)

        async with connect(b.url(user)) as on_b:
            await on_b.send({"type": "subscribe", "chat_id": chat_id, "since": screen.since()})
            resumed = await on_b.expect("subscribed", chat_id=chat_id)
            assert resumed["recovered"] is True and resumed["epoch"] == screen.epoch
            assert resumed["replayed"] == 1  # the tool_call
            [snap] = resumed["snapshot"]["streams"]
            assert snap["id"] == sid and snap["type"] == "delta"
            assert snap["pos"] >= held["pos"] + 20
            assert snap["text"] == "".join(pieces[:snap["pos"]])  # starts with what we held
            screen.apply(resumed)
            await read_until(on_b, screen, of("tool_call"))
            expected = await streamer.finish()
            await commit(b, chat_id)
            message = await read_until(on_b, screen, of("message"))
            await read_until(on_b, screen, of("turn_end"))
    assert expected == "".join(pieces)
    assert message["data"] == {"stream_id": sid, "text": expected}
    assert screen.rebuilt == {sid: expected}  # byte for byte, built with no gap or duplicate
    assert screen.streams == {}
    assert screen.types() == ["user_message", "turn_start", "head", "tool_call", "message",
                              "turn_end"]


# --- 2. a worker killed mid-answer ---------------------------------------------------------


async def test_a_worker_killed_mid_answer_is_discarded_then_answered_once(
        gateway: Any, redis_url: str, group: str, user: str, chat_id: str) -> None:
    taken: list[Turn] = []

    async def answer_again(turn: Turn) -> None:
        taken.append(turn)
        for piece in PIECES:
            await turn.delta(piece)
            await asyncio.sleep(0)
        await turn.message()  # commits the streamed text

    async with asyncio.timeout(60):
        async with connect(gateway.url(user)) as phone, connect(gateway.url(user)) as laptop:
            devices = [(phone, Screen()), (laptop, Screen())]
            for ws, screen in devices:
                screen.apply(await ws.subscribe(chat_id))
            watching = [asyncio.create_task(read_until(ws, screen, of("turn_end"), timeout=45))
                        for ws, screen in devices]
            try:
                spec = "tests.test_stream_faults:stream_half_then_die"
                async with agent_process(redis_url, spec, group) as proc:
                    await send_message(phone, chat_id, "tell me everything")
                    async with asyncio.timeout(15):
                        assert await proc.wait() == -signal.SIGKILL
                assert await pending(redis_url, group) == 1  # the dead worker's entry
                async with agent_worker(redis_url, answer_again, group, claim_idle=0.5) as worker:
                    ends = await asyncio.gather(*watching)
            finally:
                for task in watching:
                    task.cancel()
            assert worker.stats["reclaimed"] == 1 and worker.stats["handled"] == 1
            assert [t.redelivered for t in taken] == [True]
    assert [end["data"]["reason"] for end in ends] == ["complete", "complete"]

    half = "".join(PIECES[: len(PIECES) // 2])
    for _, screen in devices:
        frames = screen.frames
        turn_id = next(f for f in frames if f.get("type") == "turn_start")["data"]["turn_id"]
        streamed = [f for f in frames if "stream" in f]
        first = streamed[0]["stream"]["id"]
        second = next(f for f in streamed if f["stream"]["id"] != first)["stream"]["id"]
        assert "".join(f["data"]["text"] for f in streamed
                       if f["stream"]["id"] == first) == half
        [discarded] = [i for i, f in enumerate(frames) if f.get("type") == "stream_discarded"]
        assert frames[discarded]["data"] == {"stream_id": first, "type": "delta",
                                             "turn_id": turn_id}
        first_new = next(i for i, f in enumerate(frames)
                         if f.get("stream", {}).get("id") == second)
        assert discarded < first_new  # dropped before the new attempt's first delta
        assert frames[first_new]["stream"]["pos"] == 0
        [message] = [f for f in frames if f.get("type") == "message"]
        assert message["data"] == {"stream_id": second, "text": ANSWER}
        # The answer is shown once: the partial is gone, the new stream rebuilt exactly.
        assert screen.discarded == [first] and screen.streams == {}
        assert screen.rebuilt == {second: ANSWER}

    events = await history(gateway, user, chat_id)
    assert [e["type"] for e in events] == ["user_message", "turn_start", "head", "message",
                                           "turn_end"]
    assert events[3]["data"]["text"] == ANSWER and "partial" not in events[3]["data"]
    assert await pending(redis_url, group) == 0


@pytest.mark.parametrize("crash", ["answer_then_die_before_turn_end",
                                   "answer_then_die_before_ack"])
async def test_a_worker_killed_after_its_answer_leaves_one_message(
        crash: str, gateway: Any, redis_url: str, group: str, user: str,
        chat_id: str) -> None:
    """The redelivered turn runs again: its commit is absorbed as a duplicate (same
    idempotency key), so the stream it opened meanwhile is discarded on every device, and
    its turn_end commits no second, partial message. (Killed mid-stream: the test above.)"""
    taken: list[Turn] = []

    async def answer_again(turn: Turn) -> None:
        taken.append(turn)
        for piece in PIECES[:5]:  # the second run's answer differs: only the first counts
            await turn.delta(piece.upper())
            await turn.flush()
        await turn.message()

    async with asyncio.timeout(60):
        async with connect(gateway.url(user)) as phone, connect(gateway.url(user)) as laptop:
            devices = [(phone, Screen()), (laptop, Screen())]
            for ws, screen in devices:
                screen.apply(await ws.subscribe(chat_id))
            async with agent_process(redis_url, f"tests.test_stream_faults:{crash}",
                                     group) as proc:
                await send_message(phone, chat_id, "tell me everything")
                async with asyncio.timeout(15):
                    assert await proc.wait() == -signal.SIGKILL
            assert await pending(redis_url, group) == 1  # the dead worker's entry
            async with agent_worker(redis_url, answer_again, group, claim_idle=0.5) as worker:
                for ws, screen in devices:
                    await read_until(ws, screen, of("turn_end"), timeout=30)
                assert await until(lambda: worker.stats["handled"] + worker.stats["skipped"] == 1)
            assert worker.stats["reclaimed"] == 1 and await pending(redis_url, group) == 0
            # Ended before the crash: not run again. Else run again, and absorbed.
            assert len(taken) == (0 if crash == "answer_then_die_before_ack" else 1)

    for _, screen in devices:
        [message] = [f for f in screen.frames if f.get("type") == "message"]
        assert message["data"]["text"] == ANSWER and "partial" not in message["data"]
        assert screen.streams == {}  # nothing left open: no partial answer on screen
        second = {f["stream"]["id"] for f in screen.frames
                  if "stream" in f and f["stream"]["id"] != message["data"]["stream_id"]}
        assert sorted(screen.discarded) == sorted(second)
        assert [e["data"]["reason"] for e in screen.events if e["type"] == "turn_end"] == [
            "complete"]
    events = await history(gateway, user, chat_id)
    assert [e["type"] for e in events] == ["user_message", "turn_start", "head", "message",
                                           "turn_end"]
    assert events[3]["data"]["text"] == ANSWER and "partial" not in events[3]["data"]


# --- 3. the Python SDK sees a position jump ------------------------------------------------


def sdk_view(items: list[Any]) -> tuple[dict[str, str], list[Event], int]:
    """What an application built on the SDK shows, checked item by item. Returns (stream id
    -> text shown, commits, how many StreamReset items came).

    Between resets a delta must extend the text shown by exactly its own text, at the next
    position (no gap, no duplicate); across a reset, the text shown next must keep what was
    shown before (a resync never takes text back) and positions only move forward.
    """
    shown: dict[str, str] = {}
    pos: dict[str, int] = {}
    reset: set[str] = set()
    commits: list[Event] = []
    resets = 0
    for item in items:
        if isinstance(item, StreamReset):
            resets += 1
            reset.add(item.stream.id)
            assert item.stream.text.startswith(shown.get(item.stream.id, "")), item
        elif isinstance(item, Event) and item.stream_text is not None:
            sid = item.stream_id
            assert sid is not None
            at = item.frame["stream"]["pos"]
            text = item.data["text"]
            if sid in reset:
                reset.discard(sid)
                assert at >= pos.get(sid, 0), item
                assert item.stream_text.startswith(shown.get(sid, "")), item
                assert item.stream_text.endswith(text), item
            else:
                assert at == pos.get(sid, 0), ("gap or duplicate", item)
                assert item.stream_text == shown.get(sid, "") + text, item
            shown[sid], pos[sid] = item.stream_text, at + 1
        elif isinstance(item, Event) and item.durable and item.stream_id is not None:
            commits.append(item)
    return shown, commits, resets


async def test_the_sdk_resyncs_a_stream_after_pubsub_loss(
        start_gateway: Any, redis_url: str, user: str, chat_id: str,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="gateway.client")
    gw = start_gateway()
    streamer = Streamer(gw, chat_id, [f"t{i}ü " for i in range(5000)])
    killer = aioredis.from_url(redis_url)
    try:
        async with asyncio.timeout(90), GatewayClient(
                gw.ws, token_factory=lambda: gw.token(user), **FAST) as client:
            sub = await client.subscribe(chat_id)
            assert sub.snapshot["streams"] == []  # nothing open: no StreamReset from this one
            items: Watch[Any]
            items, consumer = collect(client.events(chat_id))
            await client.send_message(chat_id, "stream please")
            streamer.start()

            def deltas(got: list[Any]) -> int:
                return sum(1 for i in got if isinstance(i, Event) and i.stream_text is not None)

            # Kill this gateway's pub/sub connection while deltas flow: the ones published
            # before it reconnects never reach it, and the next one skips positions.
            for _ in range(5):
                enough = deltas(items.items) + 10

                def flowing(got: list[Any], enough: int = enough) -> bool:
                    return deltas(got) >= enough

                await items.until(flowing)
                killed = await killer.client_kill_filter(_type="pubsub")
                assert killed >= 1
                with contextlib.suppress(TimeoutError):
                    await items.until(lambda got: sdk_view(got)[2] > 0, seconds=5)
                    break
            shown, _, resets = sdk_view(items.items)
            assert resets > 0, "killing pub/sub never made the client see a gap"
            assert any("skipped a position" in r.getMessage() for r in caplog.records)

            await streamer.until(len(streamer.sent) + 20)  # and live again after the resync
            expected = await streamer.stop()
            await items.until(lambda got: expected in sdk_view(got)[0].values(), seconds=15)
            [open_stream_] = client.streams(chat_id)
            assert open_stream_.text == expected and open_stream_.pos == len(streamer.sent)

            await commit(gw, chat_id)
            await items.until(lambda got: any(isinstance(i, Event) and i.type == "turn_end"
                                              for i in got))
            assert client.streams(chat_id) == []
        await consumer
    finally:
        await streamer.stop()
        await killer.aclose()
    assert items.error is None
    shown, commits, _ = sdk_view(items.items)
    [message] = commits
    assert message.type == "message" and message.data["text"] == expected
    assert shown == {message.data["stream_id"]: expected}
    durable = [i.seq for i in items.items if isinstance(i, Event) and i.durable]
    assert durable == list(range(1, len(durable) + 1))  # user_message .. turn_end, once each


async def test_a_stream_reset_item_keeps_the_text_it_reported(
        gateway: Any, user: str, chat_id: str) -> None:
    async with asyncio.timeout(20), connect(gateway.url(user)) as ws:
        screen = Screen()
        screen.apply(await ws.subscribe(chat_id))
        await ask(ws, screen, chat_id)
        assert (await post(gateway, chat_id, delta("a"), delta("b"))).status_code == 200
        async with GatewayClient(gateway.ws, gateway.token(user)) as client:
            sub = await client.subscribe(chat_id)
            assert [(s["text"], s["pos"]) for s in sub.snapshot["streams"]] == [("ab", 2)]
            assert (await post(gateway, chat_id, delta("c"), delta("d"))).status_code == 200
            reset, c, d = await take(client.events(chat_id), 3)
    assert isinstance(reset, StreamReset) and isinstance(c, Event) and isinstance(d, Event)
    assert (c.stream_text, d.stream_text) == ("abc", "abcd")
    # Shown as documented: the reset's text as is, then each delta after it.
    assert (reset.stream.text, reset.stream.pos) == ("ab", 2)  # seen: ("abcd", 4)


# --- 4. SSE: disconnect mid-answer, resume with Last-Event-ID ------------------------------


class SseView:
    """What an SSE client shows: ``stream`` snapshots, deltas at exactly their next
    position, durable events contiguous by seq, every id as the protocol describes it."""

    def __init__(self) -> None:
        self.epoch: str | None = None
        self.seq: int | None = None
        self.streams: dict[str, Any] = {}
        self.rebuilt: dict[str, str | None] = {}
        self.kinds: list[str] = []
        self.last_id: str | None = None

    def apply(self, block: Block) -> dict[str, Any]:
        kind = block["event"]
        data: dict[str, Any] = msgspec.json.decode(block["data"])
        self.kinds.append(kind)
        if block["id"] is not None:
            self.last_id = block["id"]
        if kind in ("ready", "reset"):
            assert kind == "ready", block
            self.epoch, self.seq = data["epoch"], data["seq"]
            assert block["id"] == f"{self.epoch}:{self.seq}"
        elif kind == "stream":
            sid = data["id"]
            held = self.streams.get(sid, {"text": "", "pos": 0})
            assert data["text"].startswith(held["text"]) and data["pos"] >= held["pos"], block
            self.streams[sid] = {"text": data["text"], "pos": data["pos"]}
            assert block["id"] == f"{self.epoch}:{self.seq}:{sid}:{data['pos'] - 1}"
        elif "stream" in data:
            sid, pos = data["stream"]["id"], data["stream"]["pos"]
            state = self.streams.setdefault(sid, {"text": "", "pos": 0})
            assert pos == state["pos"], ("gap or duplicate", block, state)
            state["text"] += data["data"]["text"]
            state["pos"] = pos + 1
            assert block["id"] == f"{self.epoch}:{self.seq}:{sid}:{pos}"
        elif kind == "stream_discarded":
            self.streams.pop(data["data"]["stream_id"], None)
        else:
            assert self.seq is not None and data["seq"] == self.seq + 1, (self.seq, block)
            self.seq = data["seq"]
            assert block["id"] == f"{self.epoch}:{self.seq}"
            sid = data["data"].get("stream_id")
            if sid is not None:
                closed = self.streams.pop(sid, None)
                self.rebuilt[sid] = closed["text"] if closed is not None else None
        return data

    def pos(self) -> int:
        return max((s["pos"] for s in self.streams.values()), default=0)


async def test_sse_disconnected_mid_answer_resumes_with_last_event_id(
        gateway: Any, user: str, chat_id: str) -> None:
    pieces = [f"s{i}·ß " for i in range(200)]
    view = SseView()
    async with asyncio.timeout(60), connect(gateway.url(user)) as ws:
        screen = Screen()
        screen.apply(await ws.subscribe(chat_id))
        await ask(ws, screen, chat_id)
        streamer = Streamer(gateway, chat_id, pieces)
        async with open_stream(gateway, chat_id, user) as sse:
            ready = view.apply(await sse.event())
            assert view.kinds == ["ready"] and ready["status"] == "running"
            streamer.start()
            while view.pos() < 15:
                view.apply(await sse.event())
        # Gone mid-answer; the answer goes on without this client.
        [(sid, held)] = [(k, dict(v)) for k, v in view.streams.items()]
        await streamer.until(held["pos"] + 20)
        async with open_stream(gateway, chat_id, user, last_event_id=view.last_id) as sse:
            first = await sse.event()
            assert first["event"] == "stream", first  # what it missed, as one snapshot
            snap = view.apply(first)
            assert snap["id"] == sid and snap["pos"] >= held["pos"] + 20
            assert snap["text"] == "".join(pieces[:snap["pos"]])
            # Then the deltas go on from there; stop the agent and catch up completely.
            sent = await streamer.pause()
            while view.pos() < sent:
                view.apply(await sse.event())
        # Gone again, holding the stream whole: the resume does not send it again.
        async with open_stream(gateway, chat_id, user, last_event_id=view.last_id) as sse:
            streamer.resume()
            nxt = await sse.event()
            assert nxt["event"] == "delta", nxt
            assert view.apply(nxt)["stream"] == {"id": sid, "pos": sent}
            expected = await streamer.finish()
            await commit(gateway, chat_id)
            while view.kinds[-1] != "turn_end":
                view.apply(await sse.event())
        message = await read_until(ws, screen, of("message"))
    assert expected == "".join(pieces)
    assert message["data"] == {"stream_id": sid, "text": expected}
    assert view.rebuilt == {sid: expected} and view.streams == {}
    assert view.kinds.count("stream") == 1 and view.kinds.count("message") == 1
    assert view.seq == 5  # ready at 3 (user_message, turn_start, head), message, turn_end


# --- 5. an overflowed buffer ---------------------------------------------------------------


async def test_an_overflowed_buffer_resubscribes_with_the_whole_stream(
        start_gateway: Any, user: str, chat_id: str) -> None:
    gw = start_gateway(buffer_max_frames=5)
    before = [f"b{i}ñ " for i in range(3)]
    away = [f"a{i}ñ " for i in range(10)]
    after = [f"c{i}ñ " for i in range(5)]
    screen = Screen()
    async with asyncio.timeout(30), connect(gw.url(user)) as ws, \
            connect(gw.url(user)) as observer:
        screen.apply(await ws.subscribe(chat_id))
        await observer.subscribe(chat_id)
        turn_id = await ask(ws, screen, chat_id)
        for piece in before:
            assert (await post(gw, chat_id, delta(piece))).status_code == 200
        first = await read_until(ws, screen, at_pos(len(before) - 1))
        sid = first["stream"]["id"]

        await ws.send({"type": "unsubscribe", "chat_id": chat_id})
        await read_until(ws, screen, of("unsubscribed"))
        for i, piece in enumerate(away):
            assert (await post(gw, chat_id, delta(piece))).status_code == 200
            if i == 4:
                resp = await post(gw, chat_id, {"type": "tool_call", "data": {"n": 1}})
                assert resp.status_code == 200, resp.text
        # The observer got the last one, so the gateway fanned it out to every member of
        # the room, the buffering connection included: 11 frames into a buffer of 5.
        last = len(before) + len(away) - 1
        await observer.wait_for(lambda f: f.get("stream", {}).get("pos") == last)

        await ws.send({"type": "subscribe", "chat_id": chat_id})
        again = await ws.expect("subscribed", chat_id=chat_id)  # nothing buffered came first
        assert again["overflowed"] is True and again["recovered"] is True
        assert again["replayed"] == 1  # the tool_call; the buffered deltas are not sent
        assert again["snapshot"]["streams"] == [
            {"id": sid, "type": "delta", "turn_id": turn_id, "text": "".join(before + away),
             "pos": len(before) + len(away)}]
        screen.apply(again)
        await read_until(ws, screen, of("tool_call"))

        for piece in after:
            assert (await post(gw, chat_id, delta(piece))).status_code == 200
        live = await read_until(ws, screen, lambda f: "stream" in f)
        assert live["stream"] == {"id": sid, "pos": len(before) + len(away)}
        await commit(gw, chat_id)
        message = await read_until(ws, screen, of("message"))
        await read_until(ws, screen, of("turn_end"))
    expected = "".join(before + away + after)
    assert message["data"] == {"stream_id": sid, "text": expected}
    assert screen.rebuilt == {sid: expected} and screen.streams == {}
    assert screen.types() == ["user_message", "turn_start", "head", "tool_call", "message",
                              "turn_end"]


# --- 6. the worker SDK: coalescing, and the stream limit -----------------------------------


TINY = [("a", "é", "日", "🙂", " ")[i % 5] for i in range(300)]


async def stream_tiny_pieces(turn: Turn) -> None:
    """300 tiny pieces as fast as it can (yielding, as a token stream would), or, when the
    user says "paced", one about every millisecond; then commit them."""
    pace = 0.001 if turn.text == "paced" else 0
    for piece in TINY:
        await turn.delta(piece)
        await asyncio.sleep(pace)
    await turn.message()


async def answer_frames(gw: Any, redis_url: str, group: str, user: str, chat_id: str,
                        text: str = "burst", **options: Any) -> list[Frame]:
    """One turn answered by an in-process worker; every frame a subscriber got."""
    async with agent_worker(redis_url, stream_tiny_pieces, group, **options), \
            connect(gw.url(user)) as ws:
        await ws.subscribe(chat_id)
        await send_message(ws, chat_id, text)
        return await until_turn_end(ws, chat_id, within=30)


async def test_the_worker_sdk_coalesces_deltas_unless_its_window_is_zero(
        gateway: Any, redis_url: str, group: str, user: str, chat_id: str) -> None:
    expected = "".join(TINY)
    async with asyncio.timeout(60):
        coalesced = await answer_frames(gateway, redis_url, group, user, chat_id)
        paced = await answer_frames(gateway, redis_url, group, user, chat_id + "-p", "paced")
        one_each = await answer_frames(gateway, redis_url, group, user, chat_id + "-w0",
                                       delta_window_ms=0)
    for frames in (coalesced, paced, one_each):
        deltas = of_type(frames, "delta")
        assert [d["stream"]["pos"] for d in deltas] == list(range(len(deltas)))
        assert len({d["stream"]["id"] for d in deltas}) == 1
        assert "".join(d["data"]["text"] for d in deltas) == expected
        [message] = of_type(frames, "message")
        assert message["data"] == {"stream_id": deltas[0]["stream"]["id"], "text": expected}
        assert frames[-1]["data"]["reason"] == "complete"
    assert 1 <= len(of_type(coalesced, "delta")) < 60
    assert 2 <= len(of_type(paced, "delta")) < 60  # several windows, stitched back exactly
    assert [d["data"]["text"] for d in of_type(one_each, "delta")] == TINY


async def test_a_worker_stream_past_the_limit_takes_no_more_and_stays_a_prefix(
        start_gateway: Any, redis_url: str, group: str, user: str, chat_id: str) -> None:
    limit = 40  # bytes
    gw = start_gateway(stream_max_bytes=limit)
    settings = Settings(redis_url=redis_url, stream_max_bytes=limit)
    refused: list[tuple[str, str]] = []

    async def coalesced(turn: Turn) -> None:  # the default window: refused at the flush
        await turn.delta("é" * 10)  # 20 bytes
        await turn.flush()
        await turn.delta("x" * 21)  # 41 bytes: too many
        try:
            await turn.message()
        except Rejected as exc:
            refused.append(("message", exc.code))
        await turn.message()  # commits what was streamed

    async def immediate(turn: Turn) -> None:  # window 0: refused by the delta itself
        await turn.delta("日" * 10)  # 30 bytes
        for piece in ("b" * 11, "c" * 10):  # the second would fit: refused all the same
            try:
                await turn.delta(piece)
            except Rejected as exc:
                refused.append(("delta", exc.code))
        await turn.message()

    results: list[list[Frame]] = []
    async with asyncio.timeout(60):
        for handler, chat, options in ((coalesced, chat_id, {}),
                                       (immediate, chat_id + "-w0", {"delta_window_ms": 0})):
            async with agent_worker(settings.redis_url, handler, group, settings, **options), \
                    connect(gw.url(user)) as ws:
                screen = Screen()
                screen.apply(await ws.subscribe(chat))
                await send_message(ws, chat, "go")
                await read_until(ws, screen, of("turn_end"), timeout=30)
                results.append(screen.frames)
                expected = "é" * 10 if handler is coalesced else "日" * 10
                [message] = [f for f in screen.frames if f.get("type") == "message"]
                sid = message["data"]["stream_id"]
                assert message["data"] == {"stream_id": sid, "text": expected}
                assert screen.rebuilt == {sid: expected}
                assert screen.events[-1]["data"]["reason"] == "complete"
            events = await history(gw, user, chat)
            assert [e["type"] for e in events] == ["user_message", "turn_start", "head",
                                                   "message", "turn_end"]
            assert events[3]["data"]["text"] == expected
    assert refused == [("message", "stream_too_large"), ("delta", "stream_too_large"),
                       ("delta", "stream_too_large")]
