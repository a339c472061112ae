"""The gateway's own overhead per streamed token for an AG-UI agent, against the same
agent's stream read directly.

The agent is a real AG-UI endpoint: pydantic-ai's ``AGUIAdapter`` over a ``FunctionModel``
that streams ``N`` tokens (``t0 t1 ...``) as fast as it can, ``N`` being the last user
message, served by uvicorn in a process of its own. Two ways to read one answer, alternated
``--rounds`` times (A then B, then B then A, ...) after one unmeasured warm-up of each:

- **A, direct**: this process ``POST``s a ``RunAgentInput`` to the agent (a new
  ``httpx.AsyncClient`` per run, as the gateway's driver does) and parses every SSE event
  as JSON, as a front end would. Timed: the ``POST`` to the last ``TEXT_MESSAGE_CONTENT``
  and to ``RUN_FINISHED``; CPU: this process's.
- **B, through the gateway**: a private Redis server and ``gateway serve`` (``launch.py``),
  plus ``gateway agent --name bench-agui --ag-ui URL`` as a process. A WebSocket client,
  subscribed to a fresh conversation naming that agent, sends the message. Timed: the send
  to the ``delta`` that completes the last token, to the committed ``message`` and to
  ``turn_end``; CPU (before and after: each thread's
  ``schedstat`` on Linux, else psutil's user + system) of the gateway, the worker,
  the Redis server and this process.

Both ways the agent process's CPU is reported too: it should be the same, else the two
runs did not ask for the same work.

Run it from the repository root::

    .venv/bin/python bench/ag_ui_overhead.py                       # 1000 tokens, 5 rounds
    .venv/bin/python bench/ag_ui_overhead.py --tokens 2000 --rounds 7
    .venv/bin/python bench/ag_ui_overhead.py --delta-window 0      # no coalescing

How to read it: **gateway + worker µs/token** is the CPU the gateway adds per streamed
token (the worker parses the agent's stream as the direct client does, coalesces tokens
over ``--delta-window`` ms, and publishes each batch through a Redis script; the gateway
fans each batch out and stores the answer). Compare it with **client µs/token** of A, what
parsing the stream costs a reader anyway. **latency ratio** is B's time to the last token
over A's, per round (then the median): it includes the coalescing window (up to
``--delta-window`` ms for the last batch), the Redis round trips and the fan-out. On a
shared machine absolute times drift between runs; compare only within one run, and the
``host`` line prints the load average. Linux or macOS (psutil).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import psutil
from websockets.asyncio.client import ClientConnection, connect

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from launch import Private, free_port, private_gateway

from gateway.auth import issue_token

ROOT = Path(__file__).resolve().parent.parent
AGENT = "bench-agui"
USER = "bencher"


# --- the agent ---------------------------------------------------------------------------


def serve_agent(port: int) -> None:
    """The AG-UI agent, served by uvicorn on ``port`` (this file run with --serve-agent)."""
    import uvicorn
    from pydantic_ai import Agent
    from pydantic_ai.messages import ModelMessage, ModelRequest, UserPromptPart
    from pydantic_ai.models.function import AgentInfo, FunctionModel
    from pydantic_ai.ui.ag_ui import AGUIAdapter
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    def asked(messages: list[ModelMessage]) -> int:
        for message in reversed(messages):
            if isinstance(message, ModelRequest):
                for part in message.parts:
                    if isinstance(part, UserPromptPart) and isinstance(part.content, str):
                        return int(part.content)
        return 1

    async def stream(messages: list[ModelMessage], info: AgentInfo) -> AsyncIterator[str]:
        for n in range(asked(messages)):
            yield f"t{n} "

    agent: Agent[None, str] = Agent(FunctionModel(stream_function=stream))

    async def run(request: Request) -> Response:
        return await AGUIAdapter.dispatch_request(request, agent=agent)

    app = Starlette(routes=[Route("/agent", run, methods=["POST"])])
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")


def last_token(tokens: int) -> str:
    return f"t{tokens - 1} "


def cpu(proc: psutil.Process) -> float:
    """CPU seconds the process has run so far. On Linux the sum of its threads'
    ``schedstat`` (nanoseconds; ``cpu_times`` counts 10 ms ticks, too coarse for one run),
    elsewhere psutil's user + system."""
    if proc.pid == os.getpid():
        return time.process_time()
    tasks = Path(f"/proc/{proc.pid}/task")
    if tasks.is_dir():
        total = 0
        for task in tasks.iterdir():
            try:
                total += int((task / "schedstat").read_text().split()[0])
            except (OSError, ValueError, IndexError):
                continue  # a thread that just ended
        return total / 1e9
    times = proc.cpu_times()
    return float(times.user + times.system)


# --- A: the agent's stream read directly ---------------------------------------------------


async def direct(agent_url: str, tokens: int, agent: psutil.Process) -> dict[str, float]:
    body = {"threadId": uuid.uuid4().hex, "runId": uuid.uuid4().hex, "state": {},
            "messages": [{"id": uuid.uuid4().hex, "role": "user", "content": str(tokens)}],
            "tools": [], "context": [], "forwardedProps": {}}
    me = psutil.Process()
    cpu0, agent0 = cpu(me), cpu(agent)
    start = time.perf_counter()
    seen, last, finished = 0, 0.0, 0.0
    async with httpx.AsyncClient(timeout=60) as http, http.stream(
            "POST", agent_url, json=body, headers={"Accept": "text/event-stream"}) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            event = json.loads(line[5:])
            if event["type"] == "TEXT_MESSAGE_CONTENT":
                seen += 1
                last = time.perf_counter()
            elif event["type"] == "RUN_FINISHED":
                finished = time.perf_counter()
    assert seen == tokens, (seen, tokens)
    return {"last_token_ms": (last - start) * 1000, "finished_ms": (finished - start) * 1000,
            "client_us": (cpu(me) - cpu0) / tokens * 1e6,
            "agent_us": (cpu(agent) - agent0) / tokens * 1e6}


# --- B: the same agent driven by the gateway -----------------------------------------------


class Through:
    """The gateway, its Redis server and the worker, with one WebSocket client."""

    def __init__(self, gw: Private, worker: psutil.Process, ws: ClientConnection) -> None:
        self.gw = gw
        self.ws = ws
        self.http = f"http://127.0.0.1:{gw.port}"
        self.headers = {"Authorization": f"Bearer {issue_token(gw.secret, USER)}"}
        self.procs = {"gateway": psutil.Process(gw.process.pid), "worker": worker,
                      "redis": redis_process(gw)}

    async def recv(self) -> dict[str, Any]:
        frame: dict[str, Any] = json.loads(await asyncio.wait_for(self.ws.recv(), 30))
        return frame

    async def run(self, tokens: int, agent: psutil.Process) -> dict[str, float]:
        chat = "c-" + uuid.uuid4().hex[:12]
        async with httpx.AsyncClient(base_url=self.http, headers=self.headers) as http:
            resp = await http.post("/v1/conversations", json={"chat_id": chat, "agent": AGENT})
            assert resp.status_code == 201, resp.text
        await self.ws.send(json.dumps({"type": "subscribe", "chat_id": chat}))
        while (await self.recv()).get("type") != "subscribed":
            pass
        me = psutil.Process()
        before = {name: cpu(p) for name, p in self.procs.items()}
        cpu0, agent0 = cpu(me), cpu(agent)
        start = time.perf_counter()
        await self.ws.send(json.dumps({"type": "message", "chat_id": chat, "text": str(tokens),
                                       "client_msg_id": uuid.uuid4().hex}))
        text, deltas, last, committed = "", 0, 0.0, 0.0
        while True:
            frame = await self.recv()
            if frame.get("chat_id") != chat:
                continue
            kind = frame["type"]
            if kind == "delta":
                deltas += 1
                text += frame["data"]["text"]
                if not last and text.endswith(last_token(tokens)):
                    last = time.perf_counter()
            elif kind == "message":
                committed = time.perf_counter()
                assert frame["data"]["text"].endswith(last_token(tokens))
            elif kind == "turn_end":
                ended = time.perf_counter()
                assert frame["data"]["reason"] == "complete", frame
                break
        after = {name: cpu(p) for name, p in self.procs.items()}
        assert last and committed, "the answer did not stream to the end"
        result = {"last_token_ms": (last - start) * 1000,
                  "message_ms": (committed - start) * 1000,
                  "turn_end_ms": (ended - start) * 1000, "deltas": deltas,
                  "client_us": (cpu(me) - cpu0) / tokens * 1e6,
                  "agent_us": (cpu(agent) - agent0) / tokens * 1e6}
        for name in self.procs:
            result[f"{name}_us"] = (after[name] - before[name]) / tokens * 1e6
        result["overhead_us"] = result["gateway_us"] + result["worker_us"]
        return result


def redis_process(gw: Private) -> psutil.Process:
    """The private Redis server (a child of this process, on a unix socket)."""
    assert gw.server.process is not None
    return psutil.Process(gw.server.process.pid)


async def worker_ready(gw: Private, timeout: float = 30) -> None:
    headers = {"Authorization": f"Bearer {issue_token(gw.secret, USER)}"}
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{gw.port}") as http:
        while time.monotonic() < deadline:
            agents = (await http.get("/v1/agents", headers=headers)).json()["agents"]
            if any(a["name"] == AGENT for a in agents):
                return
            await asyncio.sleep(0.1)
    raise SystemExit("the worker did not announce itself")


async def agent_ready(port: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient() as http:
        while time.monotonic() < deadline:
            try:
                await http.get(f"http://127.0.0.1:{port}/")
                return
            except httpx.TransportError:
                await asyncio.sleep(0.1)
    raise SystemExit("the agent did not start")


# --- the run -------------------------------------------------------------------------------


def median(rows: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in rows)


async def bench(args: argparse.Namespace) -> int:
    port = free_port()
    agent_proc = start_agent(port)
    worker_proc: subprocess.Popen[bytes] | None = None
    try:
        await agent_ready(port)
        agent_url = f"http://127.0.0.1:{port}/agent"
        agent = psutil.Process(agent_proc.pid)
        with private_gateway("bench-agui-", env={"GATEWAY_DEMO_AGENT": "0"}) as gw:
            worker_proc = start_worker(gw, agent_url, args.delta_window)
            await worker_ready(gw)
            url = f"ws://127.0.0.1:{gw.port}/v1/ws?token={issue_token(gw.secret, USER)}"
            async with connect(url, compression=None, max_size=None) as ws:
                through = Through(gw, psutil.Process(worker_proc.pid), ws)
                idle = {n: cpu(p) for n, p in through.procs.items()}
                await asyncio.sleep(2)
                idle_ms = sum(cpu(p) - idle[n] for n, p in through.procs.items()
                              if n != "redis") / 2 * 1000
                await direct(agent_url, args.tokens, agent)  # warm-up, not counted
                await through.run(args.tokens, agent)
                a_rows: list[dict[str, float]] = []
                b_rows: list[dict[str, float]] = []
                for n in range(args.rounds):
                    for way in ("AB" if n % 2 == 0 else "BA"):
                        if way == "A":
                            a_rows.append(await direct(agent_url, args.tokens, agent))
                        else:
                            b_rows.append(await through.run(args.tokens, agent))
                    report_round(n, a_rows[-1], b_rows[-1])
            stop(worker_proc)  # before its Redis server goes
        report(args, a_rows, b_rows, idle_ms)
    finally:
        stop(worker_proc)
        stop(agent_proc)
    return 0


def start_agent(port: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, __file__, "--serve-agent", str(port)], cwd=ROOT)


def start_worker(gw: Private, agent_url: str,
                 delta_window: float | None) -> subprocess.Popen[bytes]:
    """``gateway agent --name bench-agui --ag-ui URL`` on the gateway's Redis server."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    env.update(GATEWAY_REDIS_URL=gw.redis_url, GATEWAY_DATA_DIR=str(gw.data_dir))
    if delta_window is not None:
        env["GATEWAY_DELTA_WINDOW_MS"] = str(delta_window)
    return subprocess.Popen([sys.executable, "-m", "gateway", "agent", "--name", AGENT,
                             "--ag-ui", agent_url, "--start-id", "$", "--log-level", "warning"],
                            cwd=ROOT, env=env)


def stop(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def report_round(n: int, a: dict[str, float], b: dict[str, float]) -> None:
    print(f"round {n + 1}: A last token {a['last_token_ms']:7.1f} ms, client "
          f"{a['client_us']:5.1f} µs/tok, agent {a['agent_us']:5.1f} | B last token "
          f"{b['last_token_ms']:7.1f} ms, message {b['message_ms']:7.1f} ms, gateway "
          f"{b['gateway_us']:5.1f} + worker {b['worker_us']:5.1f} µs/tok, redis "
          f"{b['redis_us']:5.1f}, client {b['client_us']:5.1f}, agent {b['agent_us']:5.1f}, "
          f"{b['deltas']:.0f} deltas", flush=True)


def report(args: argparse.Namespace, a: list[dict[str, float]], b: list[dict[str, float]],
           idle_ms: float) -> None:
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"\nhost: {os.cpu_count()} cores, load average {load}; {args.tokens} tokens, "
          f"{args.rounds} rounds, delta window "
          f"{'default' if args.delta_window is None else args.delta_window} ms; gateway + "
          f"worker idle {idle_ms:.1f} ms CPU/s")
    ratios = [y["last_token_ms"] / x["last_token_ms"] for x, y in zip(a, b, strict=True)]
    ends = [y["message_ms"] / x["finished_ms"] for x, y in zip(a, b, strict=True)]
    print("medians over the rounds:")
    print(f"  A direct   last token {median(a, 'last_token_ms'):7.1f} ms, RUN_FINISHED "
          f"{median(a, 'finished_ms'):7.1f} ms; client {median(a, 'client_us'):.1f} µs/token, "
          f"agent {median(a, 'agent_us'):.1f} µs/token")
    print(f"  B gateway  last token {median(b, 'last_token_ms'):7.1f} ms, message "
          f"{median(b, 'message_ms'):7.1f} ms, turn_end {median(b, 'turn_end_ms'):7.1f} ms; "
          f"client {median(b, 'client_us'):.1f} µs/token, agent {median(b, 'agent_us'):.1f} "
          f"µs/token, {median(b, 'deltas'):.0f} delta frames")
    print(f"  gateway + worker CPU: {median(b, 'overhead_us'):.1f} µs/token (gateway "
          f"{median(b, 'gateway_us'):.1f}, worker {median(b, 'worker_us'):.1f}); Redis "
          f"{median(b, 'redis_us'):.1f} µs/token")
    print(f"  latency ratio B/A: last token {statistics.median(ratios):.2f} "
          f"(rounds {min(ratios):.2f}-{max(ratios):.2f}), committed message / RUN_FINISHED "
          f"{statistics.median(ends):.2f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=1000, help="tokens per answer")
    parser.add_argument("--rounds", type=int, default=5, help="A/B pairs, alternated")
    parser.add_argument("--delta-window", type=float,
                        help="the worker's coalescing window in ms (default: its setting, 25)")
    parser.add_argument("--serve-agent", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_agent:
        serve_agent(args.serve_agent)
        return 0
    return asyncio.run(bench(args))


if __name__ == "__main__":
    sys.exit(main())
