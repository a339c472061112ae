"""A new user's first hour: ``gateway serve`` on the embedded default in one folder, their own
agent (``gateway agent mymodule:handle``) from another, and a clean Ctrl-C.

Real processes only: the installed ``gateway`` command, the embedded server, a WebSocket.
Every process gets ``XDG_STATE_HOME`` of its own, so the note a serving gateway leaves
(:mod:`gateway.discovery`) is the test's, never the developer's.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from .conftest import free_port
from .steps import send_message
from .wsclient import connect

pytestmark = pytest.mark.anyio

GATEWAY = str(Path(sys.executable).parent / "gateway")  # as `pip install` puts it on PATH

MYMODULE = '''
async def handle(turn):
    await turn.message("mine: " + turn.text)
'''


def clean_env(state: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    env.update(XDG_STATE_HOME=str(state), **extra)
    return env


def launch(argv: list[str], cwd: Path, env: dict[str, str],
           log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


@contextlib.asynccontextmanager
async def serving(folder: Path, env: dict[str, str]) -> AsyncIterator[tuple[int, Path]]:
    """``gateway serve --dev`` run from ``folder`` (its data in ``folder/.gateway``), in a
    session of its own, as a terminal runs it; yields its port and its log."""
    port, log = free_port(), folder / "serve.log"
    proc = launch([GATEWAY, "serve", "--dev", "--port", str(port)], folder, env, log)
    try:
        async with asyncio.timeout(20), httpx.AsyncClient(timeout=1) as http:
            while True:
                assert proc.poll() is None, log.read_text()
                with contextlib.suppress(httpx.HTTPError):
                    if (await http.get(f"http://127.0.0.1:{port}/readyz")).status_code == 200:
                        break
                await asyncio.sleep(0.05)
        yield port, log
        # Ctrl-C in a terminal: SIGINT to the whole foreground process group.
        os.killpg(proc.pid, signal.SIGINT)
        assert await asyncio.to_thread(proc.wait, 20) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def token(cwd: Path, env: dict[str, str]) -> str:
    done = subprocess.run([GATEWAY, "token", "--sub", "newcomer"], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=30, check=True)
    return done.stdout.strip()


async def test_your_own_agent_runs_from_its_own_folder_first_time(tmp_path: Path,
                                                                 chat_id: str) -> None:
    """As the README says: the gateway serves from one folder with the demo agent off; from
    another, ``gateway agent mymodule:handle`` finds the module in the current folder and
    the embedded server where ``gateway serve`` runs, and answers every message."""
    gw, mine, state = tmp_path / "gw", tmp_path / "mine", tmp_path / "state"
    gw.mkdir(), mine.mkdir()
    (mine / "mymodule.py").write_text(MYMODULE)
    async with serving(gw, clean_env(state, GATEWAY_DEMO_AGENT="0")) as (port, _):
        env = clean_env(state)
        agent = await asyncio.create_subprocess_exec(
            GATEWAY, "agent", "mymodule:handle", cwd=mine, env=env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        try:
            assert agent.stdout is not None
            async with asyncio.timeout(20):
                while not (line := await agent.stdout.readline()).startswith(b"agent ready"):
                    assert line, "gateway agent exited"
            url = f"ws://127.0.0.1:{port}/v1/ws?token={token(mine, env)}"
            async with connect(url) as ws:
                await ws.subscribe(chat_id)
                for n in range(4):
                    await send_message(ws, chat_id, f"question {n}")
                    answer = await ws.wait_for(lambda f: f.get("type") == "message", 10)
                    assert answer["data"]["text"] == f"mine: question {n}"
                    await ws.wait_for(lambda f: f.get("type") == "turn_end", 10)
        finally:
            agent.terminate()
            await agent.wait()


async def test_an_agent_beside_the_demo_agent_is_told_they_share_the_turns(
        tmp_path: Path) -> None:
    gw, mine, state = tmp_path / "gw", tmp_path / "mine", tmp_path / "state"
    gw.mkdir(), mine.mkdir()
    (mine / "mymodule.py").write_text(MYMODULE)
    async with serving(gw, clean_env(state)):
        agent = await asyncio.create_subprocess_exec(
            GATEWAY, "agent", "mymodule:handle", cwd=mine, env=clean_env(state),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        try:
            assert agent.stderr is not None
            async with asyncio.timeout(20):
                warning = await agent.stderr.readline()
            assert b"runs the demo agent too" in warning and b"GATEWAY_DEMO_AGENT=0" in warning
        finally:
            agent.terminate()
            await agent.wait()


async def test_without_a_serving_gateway_the_agent_says_how_to_point_at_one(
        tmp_path: Path) -> None:
    (tmp_path / "mymodule.py").write_text(MYMODULE)
    done = await asyncio.to_thread(
        subprocess.run, [GATEWAY, "agent", "mymodule:handle"], cwd=tmp_path,
        env=clean_env(tmp_path / "state"), capture_output=True, text=True, timeout=30)
    assert done.returncode == 2
    assert "--data-dir" in done.stderr and "GATEWAY_REDIS_URL=" in done.stderr, done.stderr


async def test_ctrl_c_stops_the_gateway_and_its_server_without_a_restart(
        tmp_path: Path) -> None:
    """Ctrl-C reaches the terminal's whole process group; the embedded server must not
    exit first and be started again by a gateway that is going down."""
    async with serving(tmp_path, clean_env(tmp_path / "state",
                                           GATEWAY_DEMO_AGENT="0")) as (_, log):
        pass
    assert "starting it again" not in log.read_text(), log.read_text()
