"""Agent workers: the inbox consumer group, takeover after a crash, cancels, the demo agent.

Everything is real: the session's Redis-compatible server, the shared ``gateway serve``
process, WebSockets and HTTP, and ``gateway agent`` child processes. The inbox streams are
shared by the whole session, so every test reads through its own consumer group created at
``$`` (only entries added after the test started).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from gateway.config import Settings
from gateway.errors import Rejected
from gateway.redis.agent_inbox import inbox_key
from gateway.sdk.agent import AgentWorker, Handler, Turn
from gateway.sdk.demo_agent import handle as demo_handle

from .steps import history, message_and_reply, op, send_message
from .wsclient import Client, connect

pytestmark = pytest.mark.anyio

Frame = dict[str, Any]
ROOT = Path(__file__).resolve().parent.parent
PARTITIONS = Settings().inbox_partitions  # the shared gateway runs with the default


# --- handlers run by `gateway agent` child processes (imported there as tests.test_agent) --


async def crash_after_reply(turn: Turn) -> None:
    """Publishes the reply, then dies before ending the turn or acknowledging the entry."""
    await turn.delta("the one ")
    await turn.message("the one and only reply")
    os.kill(os.getpid(), signal.SIGKILL)


async def crash_after_end(turn: Turn) -> None:
    """Finishes the turn, then dies before the worker acknowledges the entry."""
    await turn.message("finished")
    await turn.end()
    os.kill(os.getpid(), signal.SIGKILL)


async def reply_with_pid(turn: Turn) -> None:
    await asyncio.sleep(0.05)  # a little work, so both workers of a group get some
    await turn.message("handled", pid=os.getpid())


# --- helpers ------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def agent_worker(redis_url: str, handler: Handler, group: str,
                       settings: Settings | None = None,
                       **options: Any) -> AsyncIterator[AgentWorker]:
    """An AgentWorker in this process, on its own client, for new entries only."""
    client = aioredis.from_url(redis_url)
    worker = AgentWorker(client, settings or Settings(redis_url=redis_url), handler,
                         group=group, start_id="$", **options)
    await worker.start()
    try:
        yield worker
    finally:
        await worker.stop(grace=5)
        await client.aclose()


@contextlib.asynccontextmanager
async def agent_process(redis_url: str, spec: str, group: str,
                        *args: str) -> AsyncIterator[asyncio.subprocess.Process]:
    """``gateway agent SPEC`` as a child process; yields once it reads the inbox."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    env["GATEWAY_REDIS_URL"] = redis_url
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway", "agent", spec, "--group", group, "--start-id", "$",
        "--log-level", "warning", *args,
        cwd=ROOT, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )
    assert proc.stdout is not None
    output: list[bytes] = []
    try:
        async with asyncio.timeout(20):
            while True:
                line = await proc.stdout.readline()
                output.append(line)
                if not line:
                    raise RuntimeError(f"gateway agent exited: {b''.join(output).decode()}")
                if line.startswith(b"agent ready"):
                    break

        async def drain() -> None:
            assert proc.stdout is not None
            while line := await proc.stdout.readline():
                output.append(line)

        drainer = asyncio.create_task(drain())
        try:
            yield proc
        finally:
            if proc.returncode is None:
                proc.terminate()
            try:
                async with asyncio.timeout(10):
                    await proc.wait()
            except TimeoutError:
                proc.kill()
                await proc.wait()
            await drainer
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def until_turn_end(ws: Client, chat_id: str, within: float = 10.0) -> list[Frame]:
    """Every frame of ``chat_id`` up to and including the next ``turn_end``."""
    frames: list[Frame] = []
    async with asyncio.timeout(within):
        while True:
            frame = await ws.recv(within)
            if frame.get("chat_id") != chat_id:
                continue
            frames.append(frame)
            if frame["type"] == "turn_end":
                return frames


def of_type(frames: list[Frame], type_: str) -> list[Frame]:
    return [f for f in frames if f["type"] == type_]


async def pending(redis_url: str, group: str) -> int:
    """Entries delivered to ``group`` and not acknowledged, over every partition."""
    client = aioredis.from_url(redis_url)
    try:
        total = 0
        for n in range(PARTITIONS):
            with contextlib.suppress(ResponseError):
                total += (await client.xpending(inbox_key(n), group))["pending"]
        return total
    finally:
        await client.aclose()


async def eventually(check: Callable[[], Awaitable[bool]], within: float = 10.0) -> None:
    """Poll ``check`` until it holds: for state that sends no frame, like an XACK."""
    async with asyncio.timeout(within):
        while not await check():  # noqa: ASYNC110  (no event to wait on: poll Redis)
            await asyncio.sleep(0.05)


# --- the Turn API ---------------------------------------------------------------------------


async def test_turn_api_publishes_every_kind_of_event_and_the_worker_ends_the_turn(
    gateway: Any, redis_url: str, group: str, user: str, chat_id: str
) -> None:
    turns: list[Turn] = []

    async def handler(turn: Turn) -> None:
        turns.append(turn)
        await turn.reasoning("thinking")
        await turn.delta("Hel")
        await turn.delta("lo")
        call_id = await turn.tool_call("search", {"q": "lisbon"})
        await turn.tool_result(call_id, {"hits": 3})
        await turn.message("Hello", mood="cheerful")
        await turn.title("  A   greeting ")
        await turn.goal_state(True, objective="greet", ui_summary="x" * 300)
        await turn.event("note", {"n": 1})
        # returns without end(): the worker ends the turn

    async with agent_worker(redis_url, handler, group) as worker, \
            connect(gateway.url(user)) as ws:
        await ws.subscribe(chat_id)
        await send_message(ws, chat_id, "hi there", data={"k": "v"})
        frames = await until_turn_end(ws, chat_id)
    assert worker.stats["handled"] == 1 and worker.stats["failed"] == 0

    ack = of_type(frames, "ack")[0]
    turn = turns[0]
    assert (turn.chat_id, turn.turn_id, turn.text, turn.user_id, turn.data) == (
        chat_id, ack["turn_id"], "hi there", user, {"k": "v"})
    assert turn.cancelled is False and turn.redelivered is False and turn.ended is True
    assert turn.meta is not None and turn.meta.status == "running"

    events = [f for f in frames
              if f["type"] not in ("ack", "user_message", "turn_start", "head")]
    # The pieces streamed within one window went out as one delta per stream; the durable
    # tool_call flushed them first. The message (given its own text) commits the delta
    # stream; the reasoning stream, never committed, is committed by the gateway as partial
    # right before turn_end.
    assert [f["type"] for f in events] == [
        "reasoning_delta", "delta", "tool_call", "tool_result", "message", "title",
        "goal_state", "note", "reasoning", "turn_end"]
    assert [f["seq"] is None for f in events[:2]] == [True, True]
    assert all(isinstance(f["seq"], int) for f in events[2:])
    # Every durable event of the turn belongs to its node; title and goal are the chat's.
    assert [f.get("node") for f in events[2:]] == [
        ack["turn_id"], ack["turn_id"], ack["turn_id"], None, None, ack["turn_id"],
        ack["turn_id"], ack["turn_id"]]
    assert [f["data"] for f in events[:2]] == [{"text": "thinking"}, {"text": "Hello"}]
    assert [f["stream"]["pos"] for f in events[:2]] == [0, 0]
    call, result = events[2]["data"], events[3]["data"]
    assert call["name"] == "search" and call["args"] == {"q": "lisbon"}
    assert result == {"call_id": call["call_id"], "result": {"hits": 3}}
    assert events[4]["data"] == {"stream_id": events[1]["stream"]["id"], "text": "Hello",
                                 "mood": "cheerful"}
    assert events[5]["data"]["title"] == "A greeting" and events[5]["data"]["source"] == "agent"
    goal = events[6]["data"]
    assert goal["active"] is True and goal["status"] == "active"
    assert len(goal["ui_summary"]) == 120
    assert events[8]["data"] == {"text": "thinking", "stream_id": events[0]["stream"]["id"],
                                 "partial": True}
    end = events[9]["data"]
    assert end["reason"] == "complete" and end["turn_id"] == ack["turn_id"]
    assert isinstance(end["latency_ms"], int) and end["latency_ms"] >= 0
    assert end["goal_state"]["objective"] == "greet"
    assert await pending(redis_url, group) == 0


async def test_a_failing_handler_ends_the_turn_with_reason_error(
    gateway: Any, redis_url: str, group: str, user: str, chat_id: str
) -> None:
    async def handler(turn: Turn) -> None:
        await turn.delta("partial")
        raise RuntimeError("boom")

    async with agent_worker(redis_url, handler, group) as worker, \
            connect(gateway.url(user)) as ws:
        await ws.subscribe(chat_id)
        await send_message(ws, chat_id, "fail please")
        frames = await until_turn_end(ws, chat_id)
        assert frames[-1]["data"]["reason"] == "error"
        # In words a person can read, and none of the handler's own (its "boom").
        assert frames[-1]["data"]["error"] == (
            "The agent failed while answering (RuntimeError).")
        # The conversation is usable again: the next message gets a turn.
        await send_message(ws, chat_id, "again")
        again = await until_turn_end(ws, chat_id)
        assert again[-1]["data"]["reason"] == "error"
    assert worker.stats["failed"] == 2 and worker.stats["handled"] == 2
    assert await pending(redis_url, group) == 0  # acknowledged although it raised


async def test_turn_publishes_refuse_data_messagepack_cannot_carry(
    gateway: Any, redis_url: str, group: str, user: str, chat_id: str
) -> None:
    """A worker publishes straight to Redis, past the HTTP route: an integer past 64 bits in
    an event's data was stored, then sent to JSON subscribers only (the MessagePack frame
    cannot hold it). Every Turn call refuses it now, ``Rejected("unprocessable")`` naming
    ``$.data``, before anything is sent or stored, and the turn goes on."""
    big = 123456789012345678901234567890
    edges = {"max": 2**64 - 1, "min": -(2**63)}  # the last integers both formats carry
    refused: list[tuple[str, str] | None] = []

    async def handler(turn: Turn) -> None:
        attempts: list[Callable[[], Awaitable[Any]]] = [
            lambda: turn.event("note", {"n": big}),
            lambda: turn.event("note", {"deep": [{"n": -big}]}, durable=False),
            lambda: turn.message("hi", n=2**64),
            lambda: turn.tool_call("search", {"q": [-(2**63) - 1]}),
            lambda: turn.tool_result("call_1", {"hits": big}),
            lambda: turn.event("goal_state", {"active": True, "updated_at": 2**64}),
        ]
        for attempt in attempts:
            try:
                await attempt()
            except Rejected as exc:
                refused.append((exc.code, exc.message))
            else:
                refused.append(None)
        await turn.message("fine", edges=edges)

    async with agent_worker(redis_url, handler, group) as worker, \
            connect(gateway.url(user)) as js, connect(gateway.url(user), binary=True) as mp:
        for ws in (js, mp):
            await ws.subscribe(chat_id)
        await send_message(js, chat_id, "big numbers")
        for ws in (js, mp):
            sent = [(f["type"], f["data"]) for f in await until_turn_end(ws, chat_id)
                    if f["type"] in ("note", "message", "tool_call", "tool_result",
                                     "goal_state", "turn_end")]
            assert [t for t, _ in sent] == ["message", "turn_end"], sent
            assert sent[0][1] == {"text": "fine", "edges": edges}, sent
            assert sent[1][1]["goal_state"] is None, sent
    assert worker.stats["failed"] == 0 and worker.stats["handled"] == 1
    assert len(refused) == 6, refused
    for why in refused:
        assert why is not None and why[0] == "unprocessable", refused
        assert "`$.data`" in why[1] and "2**64" in why[1], refused
    stored = [e for e in await history(gateway, user, chat_id) if e["type"] != "head"]
    assert [e["type"] for e in stored] == ["user_message", "turn_start", "message",
                                           "turn_end"], stored
    assert stored[2]["data"] == {"text": "fine", "edges": edges}


# --- crashes and takeover -----------------------------------------------------------------------


async def test_a_worker_killed_mid_turn_is_taken_over_without_duplicates(
    gateway: Any, redis_url: str, group: str, user: str, chat_id: str
) -> None:
    taken_over: list[Turn] = []

    async def finish(turn: Turn) -> None:  # the same durable reply, then the end
        taken_over.append(turn)
        await turn.message("the one and only reply")

    async with connect(gateway.url(user)) as ws:
        await ws.subscribe(chat_id)
        async with agent_process(redis_url, "tests.test_agent:crash_after_reply", group) as proc:
            await send_message(ws, chat_id, "hello")
            reply = await ws.wait_for(lambda f: f["type"] == "message", timeout=10)
            async with asyncio.timeout(10):
                assert await proc.wait() == -signal.SIGKILL
        assert await pending(redis_url, group) == 1  # the dead worker's, unacknowledged
        async with agent_worker(redis_url, finish, group, claim_idle=0.5) as worker:
            end = await ws.wait_for(lambda f: f["type"] == "turn_end", timeout=10)
        assert end["data"]["reason"] == "complete"
        assert worker.stats["reclaimed"] == 1 and worker.stats["handled"] == 1
        assert [t.redelivered for t in taken_over] == [True]

    events = await history(gateway, user, chat_id)
    assert [e["type"] for e in events] == ["user_message", "turn_start", "head", "message",
                                           "turn_end"]
    assert events[3]["seq"] == reply["seq"]  # the reply of the first attempt, only once
    assert await pending(redis_url, group) == 0


async def test_a_turn_that_ended_before_the_crash_is_not_run_again(
    gateway: Any, redis_url: str, group: str, user: str, chat_id: str
) -> None:
    called: list[Turn] = []

    async def handler(turn: Turn) -> None:
        called.append(turn)

    async with connect(gateway.url(user)) as ws:
        await ws.subscribe(chat_id)
        async with agent_process(redis_url, "tests.test_agent:crash_after_end", group) as proc:
            await send_message(ws, chat_id, "hello")
            await until_turn_end(ws, chat_id)
            async with asyncio.timeout(10):
                assert await proc.wait() == -signal.SIGKILL
        assert await pending(redis_url, group) == 1
        async with agent_worker(redis_url, handler, group, claim_idle=0.3) as worker:

            async def acked() -> bool:
                return await pending(redis_url, group) == 0

            await eventually(acked)
        assert called == [] and worker.stats["skipped"] == 1
    events = await history(gateway, user, chat_id)
    assert [e["type"] for e in events] == ["user_message", "turn_start", "head", "message",
                                           "turn_end"]


async def test_a_long_turn_is_not_taken_from_a_live_worker(
    gateway: Any, redis_url: str, group: str, user: str, chat_id: str
) -> None:
    """The running worker keeps its entry fresh, so a peer with a short claim_idle waits."""
    release = asyncio.Event()
    runs: list[str] = []

    async def slow(turn: Turn) -> None:
        runs.append(turn.turn_id)
        await turn.delta("working")
        await release.wait()

    async with connect(gateway.url(user)) as ws:
        await ws.subscribe(chat_id)
        async with agent_worker(redis_url, slow, group, claim_idle=0.3) as first:
            await send_message(ws, chat_id, "take your time")
            await ws.wait_for(lambda f: f["type"] == "delta")
            async with agent_worker(redis_url, slow, group, claim_idle=0.3) as second:
                # Five claim_idle periods, the peer trying XAUTOCLAIM every 0.1 s: a takeover
                # would run the handler again (another delta) or end the turn.
                with pytest.raises(TimeoutError):
                    await ws.wait_for(lambda f: f["type"] in ("delta", "turn_end"), timeout=1.5)
                release.set()
                await ws.wait_for(lambda f: f["type"] == "turn_end")
            assert second.stats["reclaimed"] == 0 and second.stats["handled"] == 0
        assert first.stats["handled"] == 1 and len(runs) == 1


# --- cancel ----------------------------------------------------------------------------


async def test_cancel_reaches_the_handler_and_ends_the_turn_cancelled(
    gateway: Any, redis_url: str, group: str, user: str, chat_id: str
) -> None:
    seen: list[bool] = []

    async def slow(turn: Turn) -> None:
        await turn.delta("working")
        async with asyncio.timeout(10):
            await turn.cancel_event.wait()
        seen.append(turn.cancelled)

    async with agent_worker(redis_url, slow, group) as worker, \
            connect(gateway.url(user)) as ws:
        await ws.subscribe(chat_id)
        await send_message(ws, chat_id, "take your time")
        await ws.wait_for(lambda f: f["type"] == "delta")
        await ws.send({"type": "cancel", "chat_id": chat_id})
        frames = await until_turn_end(ws, chat_id)
    assert seen == [True]
    assert of_type(frames, "cancel_requested")
    assert frames[-1]["data"]["reason"] == "cancelled"
    assert worker.stats["cancels"] == 1


async def test_a_cancelled_turns_late_answer_is_refused_not_filed_under_the_next(
    gateway: Any, redis_url: str, group: str, user: str, chat_id: str
) -> None:
    """The person edits the message with ``cancel: true`` while the answer streams; the
    handler ignores the cancel and answers a moment later. The late answer is refused
    (the handler hears it as TurnOver) and never shows inside the edit's new answer."""
    first_turn: list[str] = []
    late: list[BaseException] = []
    edit_answered = asyncio.Event()
    release = asyncio.Event()

    async def stubborn(turn: Turn) -> None:
        if not first_turn:
            first_turn.append(turn.turn_id)
            await turn.delta("thinking")
            await release.wait()  # the cancel came and went: it is ignored
            try:
                await turn.message("stubborn late answer")
            except Rejected as exc:
                late.append(exc)
                raise
            return
        await turn.message("the edit's answer")
        edit_answered.set()

    async with agent_worker(redis_url, stubborn, group, concurrency=2), \
            connect(gateway.url(user)) as ws:
        await ws.subscribe(chat_id)
        ack, _ = await message_and_reply(ws, chat_id, "first version")
        await ws.wait_for(lambda f: f["type"] == "delta")
        edited, _ = await op(ws, chat_id, "edit", msg_id=ack["msg_id"],
                             text="second version", cancel=True)
        assert edited["type"] == "ack", edited
        release.set()  # the first handler answers only now, inside the edit's turn
        frames = await until_turn_end(ws, chat_id)
        await asyncio.wait_for(edit_answered.wait(), 10)
    assert [type(e).__name__ for e in late] == ["TurnOver"]
    assert late[0].code == "turn_mismatch"  # type: ignore[attr-defined]
    assert first_turn[0] in late[0].message  # type: ignore[attr-defined]
    texts = [(f["node"], f["data"]["text"]) for f in frames if f["type"] == "message"]
    assert texts == [(edited["turn_id"], "the edit's answer")], frames
    stored = [e for e in await history(gateway, user, chat_id) if e["type"] == "message"]
    assert [e["data"]["text"] for e in stored] == ["thinking", "the edit's answer"]
    assert stored[0]["node"] == first_turn[0] and stored[0]["data"]["partial"] is True


async def test_cancel_reaches_a_turn_running_on_another_worker(
    gateway: Any, redis_url: str, group: str, user: str, chat_id: str
) -> None:
    """The group hands the cancel entry to whichever worker reads next: here not the one
    running the turn (it is full, so it does not read), which still sees the cancel."""
    seen: list[bool] = []

    async def slow(turn: Turn) -> None:
        await turn.delta("working")
        async with asyncio.timeout(10):
            await turn.cancel_event.wait()
        seen.append(turn.cancelled)

    async with connect(gateway.url(user)) as ws:
        await ws.subscribe(chat_id)
        async with agent_worker(redis_url, slow, group, concurrency=1) as busy:
            await send_message(ws, chat_id, "take your time")
            await ws.wait_for(lambda f: f["type"] == "delta")
            async with agent_worker(redis_url, slow, group) as idle:
                await ws.send({"type": "cancel", "chat_id": chat_id})
                frames = await until_turn_end(ws, chat_id)
            assert idle.stats["cancels"] == 1 and idle.stats["handled"] == 0
        assert busy.stats["cancels"] == 0 and busy.stats["handled"] == 1
    assert seen == [True]
    assert frames[-1]["data"]["reason"] == "cancelled"


# --- sharing --------------------------------------------------------------------------------


async def test_two_workers_share_the_partitions_and_handle_each_turn_once(
    gateway: Any, redis_url: str, group: str, user: str
) -> None:
    chats = [f"{user}-{i}" for i in range(24)]
    spec = "tests.test_agent:reply_with_pid"
    async with agent_process(redis_url, spec, group, "--concurrency", "2") as a, \
            agent_process(redis_url, spec, group, "--concurrency", "2") as b, \
            connect(gateway.url(user)) as ws:
        for chat in chats:
            await ws.subscribe(chat)
        for chat in chats:
            await send_message(ws, chat, f"hello {chat}")
        ended: set[str] = set()
        async with asyncio.timeout(30):
            while ended != set(chats):
                frame = await ws.wait_for(lambda f: f["type"] == "turn_end", timeout=30)
                assert frame["chat_id"] not in ended, frame  # one turn_end per chat
                ended.add(frame["chat_id"])
        pids = {a.pid, b.pid}
    # Both stopped gracefully (SIGTERM): every entry was acknowledged, none is left over.
    assert (a.returncode, b.returncode) == (0, 0)
    assert await pending(redis_url, group) == 0

    handled_by: dict[str, int] = {}
    for chat in chats:
        events = await history(gateway, user, chat)
        assert [e["type"] for e in events] == ["user_message", "turn_start", "head", "message",
                                               "turn_end"], events
        assert events[4]["data"]["reason"] == "complete"
        handled_by[chat] = events[3]["data"]["pid"]
    assert set(handled_by.values()) == pids  # both took part, each chat exactly once


# --- the demo agent ------------------------------------------------------------------------------


async def test_demo_agent_over_a_real_websocket(
    gateway: Any, redis_url: str, group: str, user: str, chat_id: str
) -> None:
    async with agent_process(redis_url, "gateway.sdk.demo_agent:handle", group), \
            connect(gateway.url(user)) as ws:
        await ws.subscribe(chat_id)
        await send_message(ws, chat_id, "plan a day in Lisbon")
        frames = await until_turn_end(ws, chat_id)
        title = of_type(frames, "title")
        assert [t["data"]["title"] for t in title] == ["Plan a day in Lisbon"]
        deltas = of_type(frames, "delta")
        assert len(deltas) > 5 and all(d["seq"] is None for d in deltas)
        (message,) = of_type(frames, "message")
        assert isinstance(message["seq"], int)
        assert "".join(d["data"]["text"] for d in deltas) == message["data"]["text"]
        assert "plan a day in Lisbon" in message["data"]["text"]
        assert frames.index(deltas[-1]) < frames.index(message)
        end = frames[-1]["data"]
        assert end["reason"] == "complete" and isinstance(end["latency_ms"], int)
        assert end["latency_ms"] >= 0 and end["goal_state"] is None

        objective = "ship the agent worker " + "with every test green " * 10
        await send_message(ws, chat_id, f"/goal {objective}")
        frames = await until_turn_end(ws, chat_id)
        assert not of_type(frames, "title")  # it has one already
        (goal,) = of_type(frames, "goal_state")
        assert goal["data"]["active"] is True and goal["data"]["status"] == "active"
        assert goal["data"]["objective"] == objective.strip()
        assert 0 < len(goal["data"]["ui_summary"]) <= 120
        assert frames[-1]["data"]["goal_state"]["active"] is True
        assert of_type(frames, "message") and of_type(frames, "delta")

        await send_message(ws, chat_id, "/done")
        frames = await until_turn_end(ws, chat_id)
        (done,) = of_type(frames, "goal_state")
        assert done["data"]["active"] is False and done["data"]["status"] == "complete"
        assert done["data"]["recap"]
        assert frames[-1]["data"]["goal_state"]["status"] == "complete"
        assert frames[-1]["data"]["reason"] == "complete"

        sub = await ws.subscribe(chat_id)
        snapshot = sub["snapshot"]
        assert snapshot["title"] == "Plan a day in Lisbon"
        assert snapshot["goal_state"]["status"] == "complete" and snapshot["status"] == "idle"


async def test_demo_agent_slow_turn_stops_on_cancel(
    gateway: Any, redis_url: str, group: str, user: str, chat_id: str
) -> None:
    async with agent_worker(redis_url, demo_handle, group), connect(gateway.url(user)) as ws:
        await ws.subscribe(chat_id)
        await send_message(ws, chat_id, "/slow")
        for _ in range(3):
            await ws.wait_for(lambda f: f["type"] == "delta")
        await ws.send({"type": "cancel", "chat_id": chat_id})
        frames = await until_turn_end(ws, chat_id, within=5)  # well before the 10 s
        assert (await ws.subscribe(chat_id))["snapshot"]["title"] == "Slow answer"
    assert frames[-1]["data"]["reason"] == "cancelled"
    (message,) = of_type(frames, "message")
    assert message["data"]["cancelled"] is True
    assert len(message["data"]["text"].split()) < 50


async def test_demo_agent_failure_ends_the_turn_with_error(
    gateway: Any, redis_url: str, group: str, user: str, chat_id: str
) -> None:
    async with agent_worker(redis_url, demo_handle, group), connect(gateway.url(user)) as ws:
        await ws.subscribe(chat_id)
        await send_message(ws, chat_id, "/fail")
        frames = await until_turn_end(ws, chat_id)
    assert frames[-1]["data"]["reason"] == "error"
    assert [t["data"]["title"] for t in of_type(frames, "title")] == ["Failure test"]
