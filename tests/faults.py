"""A fault-injection harness: bounded publish/subscribe load on real gateway processes.

:class:`Load` runs, against a list of gateway processes, for as long as a test lets it:

- **publishers**: asyncio tasks publishing durable events over HTTP with a service token,
  each event with its own idempotency key, retried with the same key (on the next gateway)
  after any error or timeout until it is acknowledged or the run ends. Every attempt and
  every acknowledgement is recorded;
- **subscribers**: WebSocket clients subscribed to every chat of the run. On a disconnect
  (or a silence: ``ping`` after 5 s, gone after 5 s more, as protocol.md advises) they
  reconnect to the next gateway of the list and resubscribe with ``since`` = the last
  ``{seq, epoch}`` they saw. Every event frame and every resync signal (``subscribed`` with
  ``recovered: false``, asked or unasked) is recorded.

:meth:`Load.finish` stops publishing, waits (a condition with a timeout, not a sleep) until
every subscriber holds what it should, reads every chat's history over HTTP, records one
:class:`Row` in :data:`ROWS` (printed as a table at the end of the session by the
``pytest_terminal_summary`` hook in conftest.py) and then asserts:

- every acknowledged event is in history exactly once (counted by payload id), at the seq
  and epoch it was acknowledged with (unless ``history_lost``: then events acknowledged under
  an epoch that is gone are legitimately gone);
- every subscriber saw contiguous seqs with no duplicate, or an explicit resync, and holds
  every acknowledged event after its last resync point (its first subscribe or its last
  ``recovered: false``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import os
import random
import signal
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
import msgspec
import redis.asyncio as aioredis
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake

from gateway.embedded import EmbeddedRedis

from .conftest import GatewayProcess
from .steps import create, history_with_epoch

Frame = dict[str, Any]

SILENCE = 5.0  # seconds without a frame before a ping; as long again before reconnecting
PUBLISH_TIMEOUT = 2.0  # one HTTP attempt
ROWS: list[Row] = []


# --- records ------------------------------------------------------------------------------


@dataclasses.dataclass
class Attempt:
    publisher: int
    chat: str
    pid: str
    port: int
    started: float
    outcome: str = "pending"  # ok, duplicate, http <status>, <exception name>, cancelled


@dataclasses.dataclass(frozen=True)
class Ack:
    chat: str
    pid: str
    epoch: str
    seq: int
    duplicate: bool
    at: float


@dataclasses.dataclass
class Row:
    fault: str
    published: int  # distinct events attempted
    attempts: int  # HTTP attempts, retries included
    acked: int  # distinct events acknowledged
    delivered: int  # distinct (chat, epoch, seq) per subscriber, summed
    lost: int  # acked and not in history + (subscriber, event) pairs owed and not delivered
    duplicated: int  # a seq delivered twice to one subscriber in one epoch, + history dups
    resyncs: int  # `subscribed` with recovered: false (asked or unasked)
    reconnects: int
    gone: int = 0  # acked under an epoch that a history loss legitimately wiped
    seconds: float = 0.0
    verdict: str = "?"
    notes: str = ""  # publish outcomes and why subscriber connections ended


def table(rows: Sequence[Row]) -> list[str]:
    """The rows as a fixed-width text table."""
    head = ["fault", "published (attempts)", "acked", "delivered", "lost", "duplicated",
            "resyncs", "reconnects", "gone", "s", "verdict"]
    body = [[r.fault, f"{r.published} ({r.attempts})", str(r.acked), str(r.delivered),
             str(r.lost), str(r.duplicated), str(r.resyncs), str(r.reconnects), str(r.gone),
             f"{r.seconds:.1f}", r.verdict] for r in rows]
    widths = [max(len(line[i]) for line in [head, *body]) for i in range(len(head))]

    def fmt(line: list[str]) -> str:
        return "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w)
                         for i, (cell, w) in enumerate(zip(line, widths, strict=True)))

    notes = [f"{r.fault}: {r.notes}" for r in rows if r.notes]
    return [fmt(head), "  ".join("-" * w for w in widths), *(fmt(line) for line in body),
            *notes]


async def until(predicate: Callable[[], bool], timeout: float = 15.0, what: str = "") -> bool:
    """Poll ``predicate`` until it holds (True) or ``timeout`` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.02)
    return True


def decode(raw: str | bytes) -> Frame:
    frame: Frame = msgspec.json.decode(raw)
    return frame


def is_event(frame: Frame) -> bool:
    """A durable event of the log (``ack``/``subscribed`` carry a seq but no data)."""
    return isinstance(frame.get("seq"), int) and "data" in frame and "chat_id" in frame


# --- publishers ---------------------------------------------------------------------------


class Publishers:
    """``count`` tasks, each publishing one event at a time, retried until acknowledged."""

    def __init__(self, gateways: Sequence[GatewayProcess], chats: Sequence[str], run: str,
                 count: int = 3, pace: float = 0.005) -> None:
        self.gateways = gateways
        self.chats = chats
        self.run = run
        self.count = count
        self.pace = pace
        self.attempts: list[Attempt] = []
        self.acks: list[Ack] = []
        self.events: set[str] = set()
        self.stopping = False
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._publisher(i), name=f"publisher-{i}")
                       for i in range(self.count)]

    async def stop(self) -> None:
        """Let no new event start; cancel attempts in flight (they stay unacknowledged)."""
        self.stopping = True
        for task in self._tasks:
            task.cancel()
        results = await asyncio.gather(*self._tasks, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException) and not isinstance(
                    result, asyncio.CancelledError):
                raise result

    async def _publisher(self, index: int) -> None:
        gw = index % len(self.gateways)
        first = index % len(self.chats)
        chats = itertools.cycle([*self.chats[first:], *self.chats[:first]])
        async with httpx.AsyncClient(timeout=PUBLISH_TIMEOUT) as http:
            for n in itertools.count():
                chat = next(chats)
                pid = f"{self.run}-p{index}-{n}"
                self.events.add(pid)
                body = msgspec.json.encode({"type": "note", "data": {"pid": pid},
                                            "idempotency_key": pid})
                backoff = 0.02
                while True:  # the same key until acknowledged
                    gateway = self.gateways[gw]
                    attempt = Attempt(index, chat, pid, gateway.port, time.monotonic())
                    self.attempts.append(attempt)
                    try:
                        resp = await http.post(
                            f"{gateway.http}/v1/conversations/{chat}/events", content=body,
                            headers={**gateway.headers("agent", "service"),
                                     "content-type": "application/json"})
                    except asyncio.CancelledError:
                        attempt.outcome = "cancelled"
                        raise
                    except (httpx.HTTPError, OSError) as exc:
                        attempt.outcome = type(exc).__name__
                    else:
                        if resp.status_code == 200:
                            reply = resp.json()
                            [seq] = reply["seqs"]
                            attempt.outcome = "duplicate" if reply["duplicate"] else "ok"
                            self.acks.append(Ack(chat, pid, reply["epoch"], seq,
                                                 reply["duplicate"], time.monotonic()))
                            break
                        attempt.outcome = f"http {resp.status_code}"
                    gw = (gw + 1) % len(self.gateways)  # try the next one
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, 0.5)
                await asyncio.sleep(self.pace)


# --- subscribers --------------------------------------------------------------------------


@dataclasses.dataclass
class ChatView:
    """What one subscriber knows of one chat."""

    epoch: str | None = None
    pos: int | None = None  # last durable seq seen (the next `since`)
    base: tuple[str, int] | None = None  # owed every event after this (epoch, seq)
    live: bool = False  # the current connection's subscribe was answered
    seen: dict[tuple[str, int], str | None] = dataclasses.field(default_factory=dict)
    # Every event frame received: (monotonic time, gateway port, epoch held, seq, payload id).
    frames: list[tuple[float, int | None, str | None, int, str | None]] = dataclasses.field(
        default_factory=list)
    duplicates: int = 0
    resyncs: list[Frame] = dataclasses.field(default_factory=list)
    violations: list[str] = dataclasses.field(default_factory=list)


class Subscriber:
    def __init__(self, name: str, gateways: Sequence[GatewayProcess], chats: Sequence[str],
                 user: str, first: int) -> None:
        self.name = name
        self.gateways = gateways
        self.chats = chats
        self.user = user
        self.next_gateway = first
        self.views = {chat: ChatView() for chat in chats}
        self.connections = 0
        self.connected_to: int | None = None  # port of the current connection
        self.closes: Counter[str] = Counter()  # why connections ended
        self.errors: list[Frame] = []
        self.ready_once = False  # every chat answered on the current connection
        self._requests = itertools.count(1)
        self._pending: dict[int, str] = {}
        self._task: asyncio.Task[None] | None = None
        self._ws: Any = None
        self._bounced = False

    @property
    def ready(self) -> bool:
        return self.connected_to is not None and all(v.live for v in self.views.values())

    @property
    def reconnects(self) -> int:
        return max(0, self.connections - 1)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"subscriber-{self.name}")

    async def bounce(self) -> None:
        """Close the current connection from this side: the subscriber resumes elsewhere."""
        if self._ws is not None:
            self._bounced = True
            await self._ws.close()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        backoff = 0.05
        while True:
            gateway = self.gateways[self.next_gateway % len(self.gateways)]
            self.next_gateway += 1
            try:
                await self._connection(gateway)
                self.closes["silent"] += 1
            except ConnectionClosed as exc:
                code = exc.rcvd.code if exc.rcvd is not None else "no close frame"
                self.closes["bounced" if self._bounced else f"closed {code}"] += 1
            except (OSError, InvalidHandshake, TimeoutError) as exc:
                self.closes[type(exc).__name__] += 1
            except _Resubscribe as exc:
                self.closes[str(exc)] += 1
            except Exception as exc:  # a harness bug: keep going, fail the check later
                self.closes[f"unexpected {exc!r}"] += 1
            finally:
                self._ws, self._bounced = None, False
                self.connected_to = None
                for view in self.views.values():
                    view.live = False
            if self.ready_once:
                backoff = 0.05
            self.ready_once = False
            await asyncio.sleep(backoff * (1 + random.random()))
            backoff = min(backoff * 2, 1.0)

    async def _connection(self, gateway: GatewayProcess) -> None:
        async with ws_connect(gateway.url(self.user), open_timeout=3, close_timeout=1,
                              max_size=None, compression=None) as ws:
            self._ws = ws
            hello = decode(await asyncio.wait_for(ws.recv(), SILENCE))
            if hello.get("type") != "hello":
                raise _Resubscribe(f"first frame {hello.get('type')}")
            self.connections += 1
            self.connected_to = gateway.port
            self._pending = {}
            for chat, view in self.views.items():
                request: Frame = {"type": "subscribe", "chat_id": chat,
                                  "id": next(self._requests)}
                if view.epoch is not None and view.pos is not None:
                    request["since"] = {"seq": view.pos, "epoch": view.epoch}
                self._pending[request["id"]] = chat
                await ws.send(msgspec.json.encode(request).decode())
            pinged = False
            while True:
                try:
                    raw = await asyncio.wait_for(ws.recv(), SILENCE)
                except TimeoutError:
                    if pinged:
                        return  # silent for too long: a dead connection
                    pinged = True
                    await ws.send('{"type": "ping"}')
                    continue
                pinged = False
                self.on_frame(decode(raw))

    def on_frame(self, frame: Frame) -> None:
        kind = frame.get("type")
        chat = frame.get("chat_id")
        view = self.views.get(chat) if isinstance(chat, str) else None
        if kind == "error":
            self.errors.append(frame)
            if frame.get("id") in self._pending:
                raise _Resubscribe(f"error {frame.get('code')}")
            return
        if view is None:
            return  # the conversation feed, pong, ...
        if kind == "subscribed":
            asked = frame.get("id")
            if asked is not None:
                if self._pending.pop(asked, None) != chat:
                    view.violations.append(f"unexpected subscribed reply {frame}")
                view.live = True
                if all(v.live for v in self.views.values()):
                    self.ready_once = True
            if frame["recovered"] is False:
                view.resyncs.append(frame)
                if frame["replayed"] != 0:
                    view.violations.append(f"recovered false yet replayed: {frame}")
                view.epoch, view.pos = frame["epoch"], frame["seq"]
                view.base = (frame["epoch"], frame["seq"])
            elif view.epoch is None:  # the first subscribe: live from here
                view.epoch, view.pos = frame["epoch"], frame["seq"]
                view.base = (frame["epoch"], frame["seq"])
            elif frame["epoch"] != view.epoch:
                view.violations.append(f"recovered true under another epoch: {frame} "
                                       f"(held {view.epoch}:{view.pos})")
            # recovered true after a since: the replay continues from view.pos
            return
        if not is_event(frame):
            return  # ephemeral frames
        seq: int = frame["seq"]
        pid = frame["data"].get("pid")
        view.frames.append((time.monotonic(), self.connected_to, view.epoch, seq, pid))
        if view.epoch is None or view.pos is None:
            view.violations.append(f"event before any subscribed: {frame}")
            return
        key = (view.epoch, seq)
        if key in view.seen:
            view.duplicates += 1
            if view.seen[key] != pid:
                view.violations.append(f"seq {seq} named two events: {view.seen[key]} and {pid}")
            return
        if seq != view.pos + 1:
            view.violations.append(
                f"{'gap' if seq > view.pos else 'backwards'}: seq {seq} after {view.pos}")
        view.seen[key] = pid
        view.pos = max(view.pos, seq)

    def owed(self, chat: str, acks: dict[str, Ack]) -> list[Ack]:
        """Acknowledged events of ``chat`` this subscriber must hold and does not."""
        view = self.views[chat]
        if view.base is None:
            return [a for a in acks.values() if a.chat == chat]
        epoch, after = view.base
        return [a for a in acks.values()
                if a.chat == chat and a.epoch == epoch and a.seq > after
                and view.seen.get((a.epoch, a.seq), "") != a.pid]


class _Resubscribe(Exception):
    """End this connection and reconnect (an error reply to a subscribe, say)."""


# --- the run ------------------------------------------------------------------------------


class Load:
    """Publishers and subscribers over ``gateways`` for one fault; see the module doc."""

    def __init__(self, gateways: Sequence[GatewayProcess], *, chats: int = 3,
                 subscribers: int = 4, publishers: int = 3, pace: float = 0.005) -> None:
        self.gateways = list(gateways)
        self.run = uuid.uuid4().hex[:8]
        self.user = f"owner-{self.run}"
        self.chats = [f"fault-{self.run}-{i}" for i in range(chats)]
        self.publishers = Publishers(self.gateways, self.chats, self.run, publishers, pace)
        self.subscribers = [Subscriber(f"s{i}", self.gateways, self.chats, self.user, i)
                            for i in range(subscribers)]
        self.started = 0.0
        self.epochs: dict[str, str] = {}  # chat -> epoch at creation

    async def __aenter__(self) -> Load:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.publishers.stop()
        for sub in self.subscribers:
            await sub.stop()

    async def start(self) -> None:
        """Create the chats, subscribe everyone, then start publishing."""
        self.started = time.monotonic()
        for chat in self.chats:
            self.epochs[chat] = (await create(self.gateways[0], self.user, chat))["epoch"]
        for sub in self.subscribers:
            sub.start()
        if not await until(lambda: all(s.ready for s in self.subscribers), 15):
            raise AssertionError(self.report(["subscribers did not all subscribe within 15s"]))
        self.publishers.start()

    async def bounce(self) -> None:
        """Every subscriber drops its connection and resumes (with ``since``)."""
        await asyncio.gather(*(s.bounce() for s in self.subscribers))

    def acks(self) -> dict[str, Ack]:
        """The first acknowledgement of every event."""
        first: dict[str, Ack] = {}
        for ack in self.publishers.acks:
            first.setdefault(ack.pid, ack)
        return first

    async def until_acked(self, count: int, timeout: float = 20.0,
                          where: Callable[[Ack], bool] = lambda a: True) -> None:
        """Wait for ``count`` more acknowledgements (matching ``where``) from now on."""
        mark = len(self.publishers.acks)
        done = await until(
            lambda: sum(1 for a in self.publishers.acks[mark:] if where(a)) >= count, timeout)
        assert done, (f"fewer than {count} events acknowledged within {timeout}s; "
                      f"attempts: {self.outcomes()}")

    def outcomes(self) -> Counter[str]:
        return Counter(a.outcome for a in self.publishers.attempts)

    def live_gateway(self) -> GatewayProcess:
        for gw in self.gateways:
            if gw.proc is not None and gw.proc.poll() is None:
                return gw
        raise AssertionError("no gateway process is alive")

    async def history(self, chat: str, timeout: float = 15.0) -> tuple[str, list[Frame]]:
        """Every durable event of ``chat`` over HTTP (paged): (epoch, events)."""
        gw = self.live_gateway()
        deadline = time.monotonic() + timeout
        while True:
            try:
                return await history_with_epoch(gw, "agent", chat, role="service")
            except (httpx.HTTPError, AssertionError):  # not ready yet, or recreated meanwhile
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(0.1)

    async def finish(self, fault: str, *, history_lost: bool = False,
                     settle: float = 20.0) -> Row:
        """Stop publishing, let everything settle, record the row, then assert."""
        await self.publishers.stop()
        acks = self.acks()

        def settled() -> bool:
            return all(
                s.ready and not any(s.owed(c, acks) for c in self.chats)
                and (not history_lost or all(s.views[c].resyncs for c in self.chats))
                for s in self.subscribers)

        quiet = await until(settled, settle)
        histories = {chat: await self.history(chat) for chat in self.chats}
        for sub in self.subscribers:
            await sub.stop()

        problems: list[str] = []
        if not quiet:
            problems.append(f"did not settle within {settle}s")
        # Acknowledgements agree with each other (a retried key returns the first result).
        for ack in self.publishers.acks:
            if (ack.epoch, ack.seq) != (acks[ack.pid].epoch, acks[ack.pid].seq):
                problems.append(f"acks of {ack.pid} disagree: {ack} vs {acks[ack.pid]}")
        # History: every acknowledged event exactly once, where it was acknowledged.
        lost = duplicated = gone = 0
        for chat, (epoch, events) in histories.items():
            seqs = [e["seq"] for e in events]
            if seqs != list(range(1, len(seqs) + 1)):
                problems.append(f"{chat}: history seqs not 1..n: {seqs[:5]}...{seqs[-5:]}")
            where: dict[str, list[int]] = {}
            for event in events:
                where.setdefault(event["data"].get("pid"), []).append(event["seq"])
            for pid, at in where.items():
                if len(at) > 1:
                    duplicated += len(at) - 1
                    problems.append(f"{chat}: {pid} is in history {len(at)} times, seqs {at}")
            other_epoch: list[Ack] = []
            missing: list[Ack] = []
            for ack in acks.values():
                if ack.chat != chat:
                    continue
                if ack.epoch != epoch:
                    if history_lost and ack.epoch == self.epochs[chat]:
                        gone += 1
                    else:
                        other_epoch.append(ack)
                elif ack.pid not in where:
                    missing.append(ack)
                elif where[ack.pid] != [ack.seq]:
                    problems.append(f"{chat}: {ack.pid} acked as seq {ack.seq}, "
                                    f"history has it at {where[ack.pid]}")
            lost += len(other_epoch) + len(missing)
            if other_epoch:
                problems.append(
                    f"{chat}: {len(other_epoch)} acked events are of epoch(s) "
                    f"{sorted({a.epoch for a in other_epoch})} (created as "
                    f"{self.epochs[chat]}), the history now is epoch {epoch} with "
                    f"{len(events)} events; acked seqs {_span(other_epoch)}")
            if missing:
                problems.append(f"{chat}: {len(missing)} acked events not in history (epoch "
                                f"{epoch}, {len(events)} events): seqs {_span(missing)}")
        # Subscribers: contiguous, no duplicate, or an explicit resync; nothing owed missing.
        delivered = resyncs = 0
        for sub in self.subscribers:
            for chat, view in sub.views.items():
                delivered += len(view.seen)
                resyncs += len(view.resyncs)
                duplicated += view.duplicates
                if view.duplicates:
                    problems.append(f"{sub.name}/{chat}: {view.duplicates} duplicate frames")
                problems += [f"{sub.name}/{chat}: {v}" for v in view.violations]
                owed = sub.owed(chat, acks)
                lost += len(owed)
                if owed:
                    problems.append(
                        f"{sub.name}/{chat}: {len(owed)} acked events never delivered "
                        f"(seqs {sorted(a.seq for a in owed)[:10]}...; held "
                        f"{view.epoch}:{view.pos}, base {view.base}, "
                        f"resyncs {len(view.resyncs)})")
                if history_lost and not view.resyncs:
                    problems.append(f"{sub.name}/{chat}: no resync after the history was lost")
        for sub in self.subscribers:
            problems += [f"{sub.name}: harness error {k}" for k in sub.closes
                         if k.startswith("unexpected")]
        row = Row(fault, len(self.publishers.events), len(self.publishers.attempts), len(acks),
                  delivered, lost, duplicated, resyncs,
                  sum(s.reconnects for s in self.subscribers), gone,
                  time.monotonic() - self.started)
        closes: Counter[str] = Counter()
        for sub in self.subscribers:
            closes.update(sub.closes)
        row.notes = (f"attempts {dict(sorted(self.outcomes().items()))}; "
                     f"subscriber connections ended: {dict(sorted(closes.items()))}")
        ROWS.append(row)
        row.verdict = "FAIL" if problems else "ok"
        assert not problems, self.report(problems)
        return row

    def report(self, problems: list[str]) -> str:
        lines = [f"{len(problems)} problem(s):", *problems[:40]]
        lines.append(f"publish attempts: {dict(self.outcomes())}")
        for sub in self.subscribers:
            lines.append(f"{sub.name}: {sub.connections} connections, closes "
                         f"{dict(sub.closes)}, errors {sub.errors[:3]}")
            for chat, view in sub.views.items():
                for told in view.resyncs[:3]:
                    lines.append(f"  {chat}: resync {'asked' if 'id' in told else 'unasked'} "
                                 f"epoch {told['epoch']} seq {told['seq']}")
        for gw in self.gateways:
            lines += [f"--- gateway {gw.port} log (tail) ---", *log_tail(gw)]
        return "\n".join(lines)


def _span(acks: Sequence[Ack]) -> str:
    seqs = sorted(a.seq for a in acks)
    return f"{seqs[0]}..{seqs[-1]}" if len(seqs) > 1 else str(seqs)


def log_tail(gw: GatewayProcess, lines: int = 25) -> list[str]:
    path = Path(gw.env["GATEWAY_DATA_DIR"]) / f"gateway-{gw.port}.log"
    try:
        return path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return []


# --- faults -------------------------------------------------------------------------------


def server_pid(server: EmbeddedRedis) -> int:
    assert server.process is not None and server.process.poll() is None
    return server.process.pid


async def kill_server(server: EmbeddedRedis) -> None:
    """SIGKILL the Redis-compatible server: no chance to flush anything."""
    assert server.process is not None
    server.process.kill()
    await asyncio.to_thread(server.process.wait)


async def start_server(server: EmbeddedRedis) -> None:
    """Start it again on the same data dir and socket (off the event loop: start() blocks)."""
    await asyncio.to_thread(server.start)


@contextlib.asynccontextmanager
async def frozen(server: EmbeddedRedis) -> AsyncIterator[None]:
    """SIGSTOP the server for the block, then SIGCONT (always)."""
    pid = server_pid(server)
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


async def kill_pubsub_clients(url: str) -> int:
    """``CLIENT KILL TYPE pubsub``: every gateway's pub/sub connection drops."""
    client = aioredis.from_url(url)
    try:
        killed: int = await client.client_kill_filter(_type="pubsub")
        return killed
    finally:
        await client.aclose()


async def pubsub_clients(url: str) -> int:
    """How many connections are in pub/sub mode (``CLIENT LIST TYPE pubsub``)."""
    client = aioredis.from_url(url)
    try:
        return len(await client.client_list(_type="pubsub"))
    finally:
        await client.aclose()
