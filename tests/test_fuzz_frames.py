"""Hostile frames: a property-based fuzzer against a live gateway's ``/v1/ws``.

Hypothesis builds client frames from the real shapes and mutates them (:mod:`tests.fuzzframes`)
and sends them, pipelined, over JSON and MessagePack connections. Per frame, in order, exactly
one of: the normal reply of its type, an ``error`` with a code protocol.md documents (and the
one its damage calls for), or the close the frames before it explain: 4004 after
``GATEWAY_MAX_BAD_FRAMES`` invalid ones in a row, 4029 after ``GATEWAY_RATE_BURST``
rate-limited ones, 1009 for a frame over the limit, 1007 for a text frame that is not UTF-8.
After a close the fuzzer reconnects and sends the frames that were not answered again.

Meanwhile an agent publishes into the chats the fuzzer targets, and two bystanders (JSON and
MessagePack) subscribed to them must receive every event, in order, with no gap. Afterwards
the gateway is alive with nothing in its log, its sessions are gone (the per-user limit lets
exactly as many connections in as before), and its RSS and open files are where they were
after a warm-up.

10,000 frames by default (a few seconds); ``GATEWAY_FUZZ_EXAMPLES=N`` makes it a long run
of N frames with a random seed, ``GATEWAY_FUZZ_SEED`` replays one.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import random
import uuid
from collections import deque
from collections.abc import Awaitable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import msgspec
import psutil
import pytest
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st
from websockets.asyncio.client import ClientConnection
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed

from gateway import protocol as p

from . import fuzzframes as ff
from .steps import create, history

T = TypeVar("T")

DOCUMENTED_ERRORS = ff.documented_error_codes()
DOCUMENTED_CLOSES = ff.documented_close_codes()
DEFAULT_FRAMES = 10_000
LONG_FRAMES = int(os.environ.get("GATEWAY_FUZZ_EXAMPLES") or 0)
LONG_SEED = os.environ.get("GATEWAY_FUZZ_SEED")
CODECS = (False, True, False, True)  # the fuzzing connections: JSON, MessagePack, ...
DRAWN, SEEDED = 2, 23  # frames per connection and example: all choices drawn, or seeded
PER_EXAMPLE = len(CODECS) * (DRAWN + SEEDED)
MAX_CONNECTIONS = 12  # per user, on the fuzzed gateway
ANSWER_WITHIN = 20.0  # seconds for a batch's answers: a gateway that drops one is stuck
# RSS may grow this much between the warm-up and the end: the allocator's arenas and
# caches settle during the warm-up; a leak of a few hundred bytes a frame shows past it in
# a long run, and of a whole frame or session in the default one.
RSS_SLACK = 12 * 2**20
FD_SLACK = 2  # a pooled Redis connection opened late
LOG_ALARMS = ("Traceback", "Exception", "Task was destroyed", "never retrieved", "ERROR")


# --- one fuzzing connection -------------------------------------------------------------


class Failure(AssertionError):
    pass


class Conn:
    """One fuzzing WebSocket: frames go out pipelined, answers are matched in order.

    The model of the gateway's counters says which close the frames explain: invalid frames
    in a row (a refusal of a valid frame may or may not break the row, so a range), and
    rate-limited ones in a row.
    """

    def __init__(self, ws: ClientConnection, binary: bool, limits: dict[str, Any]) -> None:
        self.ws = ws
        self.binary = binary
        self.max_bad = int(limits["max_bad_frames"])
        self.burst = int(limits["rate_burst"])
        self.pending: deque[ff.Wire] = deque()
        self.bad_low = self.bad_high = self.limited = 0
        self.answered = self.events = 0
        self.close_code: int | None = None
        self.failure: BaseException | None = None
        self.closing = False  # we close it: 1000 expected
        self.idle = asyncio.Event()
        self.idle.set()
        self.reader = asyncio.get_running_loop().create_task(self._read())

    async def exchange(self, wires: list[ff.Wire]) -> list[ff.Wire]:
        """Send ``wires`` without waiting, then wait for every answer. Returns those left
        unanswered by a close (the frame that caused it excepted), to send again."""
        unsent: list[ff.Wire] = []
        for i, wire in enumerate(wires):
            if self.close_code is not None:
                unsent = wires[i:]
                break
            self.pending.append(wire)
            self.idle.clear()
            try:
                await self.ws.send(wire.data, text=wire.text)
            except ConnectionClosed:
                unsent = wires[i + 1:]
                break
        try:
            async with asyncio.timeout(ANSWER_WITHIN):
                await self.idle.wait()
        except TimeoutError:
            raise Failure(f"no answer within {ANSWER_WITHIN:g} s to {self.pending[0]!r} "
                          f"({len(self.pending)} frames unanswered)") from None
        if self.failure is not None:
            raise self.failure
        if self.close_code is None:
            return unsent
        return [*list(self.pending)[1:], *unsent]

    async def close(self) -> None:
        self.closing = True
        await self.ws.close()
        await self.reader
        if self.failure is not None:
            raise self.failure

    async def _read(self) -> None:
        try:
            async for raw in self.ws:
                self._on_frame(raw)
        except ConnectionClosed:
            pass
        except Failure as exc:
            self.failure = exc
            await self.ws.close()
        finally:
            if self.failure is None:
                try:
                    self._on_close(self.ws.close_code)
                except Failure as exc:
                    self.failure = exc
            self.close_code = self.ws.close_code or 1006
            self.idle.set()

    def _on_frame(self, raw: str | bytes) -> None:
        if isinstance(raw, bytes) != self.binary:
            raise Failure(f"a {'binary' if isinstance(raw, bytes) else 'text'} frame on a "
                          f"{'MessagePack' if self.binary else 'JSON'} connection: {raw!r}")
        frame = msgspec.msgpack.decode(raw) if self.binary else msgspec.json.decode(raw)
        if not isinstance(frame, dict) or not isinstance(frame.get("type"), str):
            raise Failure(f"not a frame: {frame!r}")
        if frame["type"] not in ff.REPLY_TYPES:
            self.events += 1  # a feed or event frame: not an answer
            return
        if not self.pending:
            raise Failure(f"an answer to no frame: {frame!r}")
        wire = self.pending.popleft()
        outcome = check_answer(frame, wire)
        self.answered += 1
        if outcome == "bad":
            self.bad_low, self.bad_high, self.limited = self.bad_low + 1, self.bad_high + 1, 0
        elif outcome == "refused":
            self.bad_low, self.limited = 0, 0
        elif outcome == "limited":
            self.limited += 1
        else:
            self.bad_low = self.bad_high = self.limited = 0
        if not self.pending:
            self.idle.set()

    def _on_close(self, code: int | None) -> None:
        if self.closing and code == 1000:
            return
        head = self.pending[0] if self.pending else None
        where = (f"after {self.answered} answers, bad in a row {self.bad_low}-{self.bad_high}, "
                 f"limited in a row {self.limited}; first unanswered: {head!r}")
        if code not in DOCUMENTED_CLOSES:
            raise Failure(f"closed with {code}, not a documented code, {where}")
        if head is None:
            raise Failure(f"closed with {code} with no frame unanswered, {where}")
        explained = {
            1009: head.expect.close == 1009,
            1007: head.expect.close == 1007,
            4004: head.expect.bad and self.bad_low <= self.max_bad <= self.bad_high,
            4029: self.limited == self.burst,
        }
        if not explained.get(code, False):
            raise Failure(f"closed with {code}, which the frames do not explain, {where}")
        CLOSES[code] = CLOSES.get(code, 0) + 1


CLOSES: dict[int, int] = {}  # closes seen, by code


def check_answer(frame: dict[str, Any], wire: ff.Wire) -> str:
    """Check ``frame`` answers ``wire`` as documented: "ok", "refused" (an error a valid
    frame may get), "bad" (an invalid frame's), or "limited"."""
    kind, expect = frame["type"], wire.expect
    why = f"{frame!r} answered {wire!r}"
    if expect.close is not None:
        raise Failure(f"{why}: the frame must close the connection with {expect.close}")
    if kind == "error":
        code = frame.get("code")
        if code not in DOCUMENTED_ERRORS:
            raise Failure(f"{why}: {code!r} is not an error code protocol.md documents")
        if not isinstance(frame.get("message"), str) or not frame["message"]:
            raise Failure(f"{why}: an error without a message")
        if code == "rate_limited":
            return "limited"
        if code not in expect.codes:
            raise Failure(f"{why}: expected one of {sorted(expect.codes)}")
        if wire.echo:
            for key, sent in (("id", wire.req_id), ("chat_id", wire.chat_id)):
                echoed = sent if ff.echoable(sent) and len(str(sent)) <= 128 else None
                if frame.get(key) != echoed:
                    raise Failure(f"{why}: {key} echoed as {frame.get(key)!r}, not {echoed!r}")
        return "bad" if code in ff.BAD_CODES else "refused"
    if kind not in expect.replies:
        raise Failure(f"{why}: expected {sorted(expect.replies)}")
    if wire.echo:
        if frame.get("id") != wire.req_id:
            raise Failure(f"{why}: the reply's id is not the request's")
        if kind != "pong" and frame.get("chat_id") != wire.chat_id:
            raise Failure(f"{why}: the reply's chat_id is not the request's")
    return "ok"


# --- the others: an agent publishing, bystanders reading ---------------------------------


class Publisher:
    """An agent publishing into the fuzzed chats over HTTP while the fuzzer runs: durable
    notes, ephemeral ones numbered per chat, and ``turn_end`` so messages start turns."""

    def __init__(self, gw: Any, chats: tuple[str, ...]) -> None:
        self.gw = gw
        self.chats = chats
        self.ephemeral: dict[str, list[int]] = {c: [] for c in chats}
        self.failure: BaseException | None = None
        self.published = 0
        self.running = asyncio.Event()
        self.task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        rng = random.Random(7)
        async with httpx.AsyncClient(base_url=self.gw.http, timeout=10,
                                     headers=self.gw.headers("agent", "service")) as http:
            n = 0
            while True:
                await self.running.wait()
                chat = rng.choice(self.chats)
                n += 1
                if n % 5 == 0:
                    event: dict[str, Any] = {"type": "turn_end", "data": {}}
                elif n % 2:
                    event = {"type": "note", "data": {"n": n}}
                else:
                    event = {"type": "note", "data": {"e": n}, "durable": False}
                try:
                    resp = await http.post(f"/v1/conversations/{chat}/events", json=event)
                except httpx.HTTPError as exc:
                    self.failure = exc
                    return
                if resp.status_code == 409 and event["type"] == "turn_end":
                    continue  # no turn running
                if resp.status_code != 200:
                    self.failure = Failure(f"publish {event} to {chat}: {resp.status_code} "
                                           f"{resp.text}")
                    return
                self.published += 1
                if event.get("durable") is False:
                    self.ephemeral[chat].append(n)
                await asyncio.sleep(0.005)  # pace: an agent, not a flood


class Bystander:
    """A service connection subscribed to the fuzzed chats, recording what it receives."""

    def __init__(self, ws: ClientConnection, binary: bool) -> None:
        self.ws = ws
        self.binary = binary
        self.durable: dict[str, list[dict[str, Any]]] = {}
        self.ephemeral: dict[str, list[int]] = {}
        self.subscribed: dict[str, dict[str, Any]] = {}
        self.failure: BaseException | None = None
        self.changed = asyncio.Event()
        self.task = asyncio.get_running_loop().create_task(self._read())

    @classmethod
    async def join(cls, gw: Any, chats: tuple[str, ...], binary: bool) -> Bystander:
        ws = await ws_connect(gw.url("bystander", "service"), max_size=None, compression=None,
                              subprotocols=[subprotocol(binary)])  # type: ignore[list-item]
        me = cls(ws, binary)
        for chat in chats:
            await ws.send(encode({"type": "subscribe", "chat_id": chat, "id": chat}, binary))
        await me.wait(lambda: len(me.subscribed) == len(chats), "subscribed")
        return me

    async def _read(self) -> None:
        try:
            async for raw in self.ws:
                frame = msgspec.msgpack.decode(raw) if self.binary else msgspec.json.decode(raw)
                kind, chat = frame.get("type"), frame.get("chat_id")
                if kind in ("error", "deleted") or (kind == "subscribed" and "id" not in frame):
                    raise Failure(f"bystander got {frame!r}")  # refused, or history lost
                if kind == "subscribed":
                    self.subscribed[chat] = frame
                elif frame.get("seq") is not None:
                    self.durable.setdefault(chat, []).append(frame)
                elif kind == "note":
                    self.ephemeral.setdefault(chat, []).append(frame["data"]["e"])
                self.changed.set()
        except ConnectionClosed as exc:
            self.failure = Failure(f"bystander closed: {exc}")
        except BaseException as exc:
            self.failure = exc
        finally:
            self.changed.set()

    async def caught_up(self, chat: str, count: int) -> None:
        await self.wait(lambda: len(self.durable.get(chat, [])) >= count, f"at {count} in {chat}")

    async def wait(self, done: Any, what: str, timeout: float = 10.0) -> None:
        try:
            async with asyncio.timeout(timeout):
                while not done():
                    if self.failure is not None:
                        raise self.failure
                    self.changed.clear()
                    await self.changed.wait()
        except TimeoutError:
            raise Failure(f"bystander: not {what} within {timeout:g} s") from None


def subprotocol(binary: bool) -> str:
    return p.MSGPACK_SUBPROTOCOL if binary else p.JSON_SUBPROTOCOL


def encode(frame: dict[str, Any], binary: bool) -> bytes | str:
    return msgspec.msgpack.encode(frame) if binary else msgspec.json.encode(frame).decode()


# --- the harness ------------------------------------------------------------------------


class Harness:
    """Fuzzing connections (reconnected as needed) for one user on one gateway."""

    def __init__(self, gw: Any, user: str, limits: dict[str, Any], targets: ff.Targets,
                 codecs: tuple[bool, ...]) -> None:
        self.gw = gw
        self.user = user
        self.limits = limits
        self.codecs = codecs
        self.frames = [ff.Frames(binary, targets, int(limits["max_frame_bytes"]),
                                 int(limits["max_text_bytes"])) for binary in codecs]
        self.conns: list[Conn | None] = [None] * len(codecs)
        self.sent = 0
        self.live = 0.0  # seconds spent sending and checking (the rest is generating)
        self.watch: list[Publisher | Bystander] = []

    def batches(self) -> st.SearchStrategy[tuple[list[ff.Wire], ...]]:
        return st.tuples(*[frames.batch(DRAWN, SEEDED) for frames in self.frames])

    async def run(self, batches: tuple[list[ff.Wire], ...]) -> None:
        try:
            async with asyncio.TaskGroup() as group:  # one failing stops the others
                for i, wires in enumerate(batches):
                    group.create_task(self._run_one(i, wires))
            for other in self.watch:
                if other.failure is not None:
                    raise other.failure
        except BaseException as exc:
            await self.close(check=False)  # the next example starts afresh
            if isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
                raise exc.exceptions[0] from None
            raise

    async def run_fresh(self, i: int, wires: list[ff.Wire]) -> None:
        """``wires`` on connection ``i``, opened for them and closed after."""
        try:
            await self._run_one(i, wires)
        finally:
            conn, self.conns[i] = self.conns[i], None
            if conn is not None and conn.close_code is None:
                await conn.close()

    async def _run_one(self, i: int, wires: list[ff.Wire]) -> None:
        queue = deque(wires)
        while queue:
            conn = self.conns[i]
            if conn is None or conn.close_code is not None:
                conn = self.conns[i] = await self.connect(self.codecs[i])
            # A frame the WebSocket layer closes on goes alone, once all before it are
            # answered: the frames queued behind it in the gateway would be dropped with it.
            batch = [queue.popleft()]
            if batch[0].expect.close is None:
                while queue and queue[0].expect.close is None:
                    batch.append(queue.popleft())
            elif conn.pending:
                raise Failure("a connection with frames pending")
            self.sent += len(batch)
            for wire in reversed(await conn.exchange(batch)):
                queue.appendleft(wire)
                self.sent -= 1

    async def connect(self, binary: bool) -> Conn:
        deadline = asyncio.get_running_loop().time() + 10
        while True:
            ws = await ws_connect(self.gw.url(self.user), max_size=None, compression=None,
                                  subprotocols=[subprotocol(binary)])  # type: ignore[list-item]
            try:
                raw = await asyncio.wait_for(ws.recv(), 5)
            except ConnectionClosed:
                # The per-user limit, while the gateway is still ending a closed session.
                assert ws.close_code == 4029, ws.close_code
                assert asyncio.get_running_loop().time() < deadline, "sessions never ended"
                await asyncio.sleep(0.02)
                continue
            hello = msgspec.msgpack.decode(raw) if binary else msgspec.json.decode(raw)
            assert hello["type"] == "hello", hello
            return Conn(ws, binary, self.limits)

    async def close(self, check: bool = True) -> None:
        conns, self.conns = self.conns, [None] * len(self.codecs)
        for conn in conns:
            if conn is not None and conn.close_code is None:
                if check:
                    await conn.close()
                else:
                    with contextlib.suppress(BaseException):
                        await conn.close()


def run_examples(loop: asyncio.AbstractEventLoop, harness: Harness, frames: int,
                 seed_value: int | None) -> None:
    """Hypothesis drives ``frames`` frames (rounded up to whole examples) through ``harness``."""
    publisher = next((w for w in harness.watch if isinstance(w, Publisher)), None)

    @settings(max_examples=math.ceil(frames / PER_EXAMPLE), deadline=None, database=None,
              # No shrinking: against a live server each step is a round of frames, and the
              # failure already names the frame and what came back for it.
              derandomize=seed_value is None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck), print_blob=True)
    @given(harness.batches())
    def example(batches: tuple[list[ff.Wire], ...]) -> None:
        if publisher is not None:
            publisher.running.set()
        started = loop.time()
        try:
            loop.run_until_complete(harness.run(batches))
        finally:
            harness.live += loop.time() - started
            if publisher is not None:
                publisher.running.clear()

    if seed_value is not None:
        example = seed(seed_value)(example)
    example()


# --- the gateway process ----------------------------------------------------------------


class Usage:
    """What the gateway process holds: resident memory and open files."""

    def __init__(self, pid: int) -> None:
        proc = psutil.Process(pid)
        self.rss = proc.memory_info().rss
        self.fds = proc.num_fds()

    def __repr__(self) -> str:
        return f"<rss {self.rss / 2**20:.1f} MiB, {self.fds} fds>"


async def sessions_ended(gw: Any, user: str, limit: int) -> None:
    """Exactly ``limit`` connections of ``user`` are let in, and no more: the gateway holds
    no session of the user's any longer (it counts them against the limit)."""
    deadline = asyncio.get_running_loop().time() + 10
    while True:
        opened: list[ClientConnection] = []
        try:
            for _ in range(limit + 1):
                ws = await ws_connect(gw.url(user), max_size=None)
                opened.append(ws)
                with contextlib.suppress(ConnectionClosed):
                    assert msgspec.json.decode(await ws.recv())["type"] == "hello"
            codes = [ws.close_code for ws in opened]
            if codes[:limit] == [None] * limit:
                assert codes[limit] == 4029, f"the limit let one more in: {codes}"
                return
        finally:
            for ws in opened:
                await ws.close()
        assert asyncio.get_running_loop().time() < deadline, f"sessions left over: {codes}"
        await asyncio.sleep(0.05)


def log_alarms(gw: Any) -> list[str]:
    log = Path(gw.env["GATEWAY_DATA_DIR"]) / f"gateway-{gw.port}.log"
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    return [line for line in lines if any(alarm in line for alarm in LOG_ALARMS)]


def run(loop: asyncio.AbstractEventLoop, coro: Awaitable[T]) -> T:
    return loop.run_until_complete(coro)


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """One event loop for the whole test: Hypothesis runs each example on it."""
    loop = asyncio.new_event_loop()
    yield loop

    async def cancel_all() -> None:
        tasks = asyncio.all_tasks() - {asyncio.current_task()}
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    loop.run_until_complete(cancel_all())
    loop.run_until_complete(loop.shutdown_asyncgens())
    loop.close()


@pytest.fixture(scope="module")
def fuzzed_gateway(start_gateway: Any) -> Any:
    """A gateway whose rate limit and invalid-frame limit are out of the fuzzer's way."""
    return start_gateway(rate_limit=1_000_000, rate_burst=1_000_000, max_bad_frames=1_000_000,
                         max_connections_per_user=MAX_CONNECTIONS, turn_timeout=600)


def fuzz_live(loop: asyncio.AbstractEventLoop, gw: Any, frames: int,
              seed_value: int | None) -> None:
    user = "fz" + uuid.uuid4().hex[:10]
    chats = tuple(f"fz-{uuid.uuid4().hex[:8]}-{n}" for n in range(3))
    theirs = ("fz-theirs-" + uuid.uuid4().hex[:8],)
    for chat in chats:
        run(loop, create(gw, user, chat))
    run(loop, create(gw, "someone-else", theirs[0]))
    limits = {"max_frame_bytes": 65536, "max_text_bytes": 32768,
              "max_bad_frames": 1_000_000, "rate_burst": 1_000_000}
    harness = Harness(gw, user, limits, ff.Targets(chats, theirs), CODECS)

    async def start() -> None:
        harness.watch = [await Bystander.join(gw, chats, False),
                         await Bystander.join(gw, chats, True), Publisher(gw, chats)]

    run(loop, start())
    bystanders = [w for w in harness.watch if isinstance(w, Bystander)]
    publisher = next(w for w in harness.watch if isinstance(w, Publisher))

    # Warm up: every code path once, the allocator settled; then the baseline, idle.
    run_examples(loop, harness, 1_000, 1 if seed_value is None else seed_value + 1)
    run(loop, harness.close())
    run(loop, sessions_ended(gw, user, MAX_CONNECTIONS))
    before = Usage(gw.proc.pid)
    warm = harness.sent

    run_examples(loop, harness, frames, seed_value)
    sent = harness.sent - warm
    assert sent >= frames, f"only {sent} frames sent"
    run(loop, harness.close())

    # Every event published during the run reached both bystanders, in order, no gap.
    publisher.task.cancel()
    for chat in chats:
        stored = run(loop, history(gw, user, chat))
        assert [e["seq"] for e in stored] == list(range(1, len(stored) + 1))
        for bystander in bystanders:
            run(loop, bystander.caught_up(chat, len(stored)))
            got = bystander.durable[chat]
            assert [(e["seq"], e["type"], e["data"]) for e in got] == [
                (e["seq"], e["type"], e["data"]) for e in stored], chat
            assert bystander.ephemeral.get(chat, []) == publisher.ephemeral[chat], chat
    for bystander in bystanders:
        run(loop, bystander.ws.close())

    # The gateway: alive, quiet, every session of the fuzzed user gone, no growth.
    run(loop, sessions_ended(gw, user, MAX_CONNECTIONS))
    after = Usage(gw.proc.pid)
    assert gw.proc.poll() is None, "the gateway died"
    assert httpx.get(gw.http + "/healthz", timeout=5).status_code == 200
    alarms = log_alarms(gw)
    assert not alarms, f"{len(alarms)} alarming log lines, first: {alarms[:20]}"
    assert after.rss - before.rss <= RSS_SLACK, (before, after, sent)
    assert after.fds - before.fds <= FD_SLACK, (before, after)
    print(f"\n{sent} frames after a warm-up of {warm}; {publisher.published} published; "
          f"closes {CLOSES}; {harness.live:.1f} s live; gateway {before} -> {after}")


def test_hostile_frames_get_documented_answers_and_harm_nothing(
    loop: asyncio.AbstractEventLoop, fuzzed_gateway: Any
) -> None:
    """10,000 frames, derandomized; GATEWAY_FUZZ_EXAMPLES=N makes it a long run of N frames
    with a random seed (printed; GATEWAY_FUZZ_SEED replays it)."""
    if not LONG_FRAMES:
        fuzz_live(loop, fuzzed_gateway, DEFAULT_FRAMES, None)
        return
    seed_value = int(LONG_SEED) if LONG_SEED else random.randrange(2**32)
    print(f"GATEWAY_FUZZ_SEED={seed_value} replays this run")
    fuzz_live(loop, fuzzed_gateway, LONG_FRAMES, seed_value)


def scripted(binary: bool, limits: dict[str, Any]) -> list[list[ff.Wire]]:
    """Batches that must close with each documented code at the default limits."""
    def wire(frame: Any, expect: ff.Expect, label: str, text: bool | None = None) -> ff.Wire:
        data = ff.encode(frame, binary)
        return ff.Wire(data, not binary if text is None else text, expect, label)

    ping = ff.Expect.of(ff.VALID, "ping")
    flood = [wire({"type": "ping", "id": i}, ping, "flood")
             for i in range(3 * limits["rate_burst"])]
    bad_run = [wire({"type": "dance"}, ff.Expect.of(ff.UNKNOWN, None), "bad")
               for _ in range(limits["max_bad_frames"] + 5)]
    big = wire({"type": "ping", "pad": "x" * limits["max_frame_bytes"]}, ff.closes(1009), "big")
    not_utf8 = ff.Wire(b'{"type":"ping","id":"\xff"}', True, ff.closes(1007), "not UTF-8")
    return [flood, bad_run, [big], [not_utf8]]


def test_hostile_frames_at_default_limits_close_as_documented(
    loop: asyncio.AbstractEventLoop, gateway: Any
) -> None:
    """The documented closes, at the defaults: 4004 after 20 invalid frames in a row, 4029
    after a burst's worth of rate-limited ones, 1009, 1007; a fresh connection per round."""
    user = "fz" + uuid.uuid4().hex[:10]
    chat, theirs = "fz-" + uuid.uuid4().hex[:8], "fz-theirs-" + uuid.uuid4().hex[:8]
    run(loop, create(gateway, user, chat))
    run(loop, create(gateway, "someone-else", theirs))
    limits = {"max_frame_bytes": 65536, "max_text_bytes": 32768, "max_bad_frames": 20,
              "rate_burst": 100}
    harness = Harness(gateway, user, limits, ff.Targets((chat,), (theirs,)), (False, True))
    seen = dict(CLOSES)
    for i, binary in enumerate(harness.codecs):
        for batch in scripted(binary, limits):
            run(loop, harness.run_fresh(i, batch))
    closed = {code: CLOSES.get(code, 0) - seen.get(code, 0) for code in (4004, 4029, 1009, 1007)}
    assert all(n >= len(harness.codecs) for n in closed.values()), closed

    # Generated rounds: each on fresh connections, so a round starts with a full bucket.
    @settings(max_examples=20, deadline=None, database=None, derandomize=True,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(harness.batches())
    def example(batches: tuple[list[ff.Wire], ...]) -> None:
        for i, wires in enumerate(batches):
            loop.run_until_complete(harness.run_fresh(i, wires))

    example()
    run(loop, sessions_ended(gateway, user, 32))
    assert gateway.proc.poll() is None


# --- what the fuzzer found, one frame each ----------------------------------------------

def raw(data: bytes) -> ff.Splice:
    """``data`` written as is where it stands in a frame."""
    return ff.Splice(data, "raw", ff.VALID, ff.VALID, ff.VALID, ff.VALID)


def message(data: Any) -> dict[str, Any]:
    return {"type": "message", "chat_id": "CHAT", "text": "hi", "client_msg_id": "m1",
            "data": data}


# (what, MessagePack, the frame (CHAT: the chat's id), the error it gets)
FOUND: list[tuple[str, bool, Any, str]] = [
    ("JSON nested 5,000 deep", False,
     {"type": "ping", "id": 1, "x": raw(b"[" * 5000 + b"]" * 5000)}, "invalid_frame"),
    ("MessagePack nested 5,000 deep", True,
     {"type": "ping", "id": 1, "x": raw(b"\x91" * 5000 + b"\xc0")}, "invalid_frame"),
    ("invalid UTF-8 in a binary JSON frame", False,
     {"type": "subscribe", "chat_id": "CHAT", "id": raw(b'"\xff\xfe"')}, "malformed"),
    ("invalid UTF-8 in a MessagePack string", True,
     {"type": "subscribe", "chat_id": raw(b"\xa2\xff\xfe")}, "malformed"),
    ("an extension type in a message's data", True,
     message({"k": raw(b"\xd4\x05\x00")}), "invalid_frame"),
    ("a map keyed by nil in a message's data", True,
     message({"k": raw(b"\x81\xc0\x01")}), "invalid_frame"),
    ("an integer past 64 bits in a message's data", False,
     message({"n": raw(b"123456789012345678901234567890")}), "invalid_frame"),
    ("a chat id ending in a newline", False,
     {"type": "subscribe", "chat_id": "CHAT\n"}, "invalid_frame"),
]


@pytest.mark.anyio
@pytest.mark.parametrize(("binary", "frame", "code"), [f[1:] for f in FOUND],
                         ids=[f[0] for f in FOUND])
async def test_found_frames_are_refused_and_harm_nothing(
    gateway: Any, user: str, chat_id: str, binary: bool, frame: Any, code: str
) -> None:
    from .wsclient import connect

    await create(gateway, user, chat_id)
    async with connect(gateway.url(user), binary=True) as watcher, \
            connect(gateway.url(user), binary=binary) as ws:
        await watcher.subscribe(chat_id)
        named = {k: v.replace("CHAT", chat_id) if isinstance(v, str) else v
                 for k, v in frame.items()}
        await ws.send_raw(ff.encode(named, binary))  # bytes: a binary frame
        error = await ws.expect("error", code=code)
        assert error["message"]
        await ws.send({"type": "ping", "id": "after"})
        await ws.expect("pong", id="after")
        # Nothing was stored, and a MessagePack subscriber still gets what is.
        await ws.send({"type": "message", "chat_id": chat_id, "text": "ok",
                       "client_msg_id": "ok", "data": {"n": 2**64 - 1}})
        (event,) = await watcher.events(chat_id, 1)
        assert event["seq"] == 1 and event["data"]["client_msg_id"] == "ok"
        assert event["data"]["data"] == {"n": 2**64 - 1}
    assert [e["data"]["client_msg_id"] for e in await history(gateway, user, chat_id)
            if e["type"] == "user_message"] == ["ok"]


@pytest.mark.anyio
async def test_a_text_frame_that_is_not_utf8_closes_1007_quietly(gateway: Any, user: str) -> None:
    from .wsclient import connect

    before = len(log_alarms(gateway))
    async with connect(gateway.url(user)) as ws:
        await ws.ws.send(b'{"type":"ping","id":"\xff"}', text=True)
        assert await ws.close_code() == 1007
    async with connect(gateway.url(user)) as ws:  # the gateway serves on
        await ws.send({"type": "ping", "id": 1})
        await ws.expect("pong", id=1)
    assert log_alarms(gateway)[before:] == []  # no error, no traceback: the client's fault
