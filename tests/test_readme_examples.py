"""Every ```python block of README.md runs as written, against a real gateway.

A block is one of three kinds, told by an HTML comment on the line just before its fence
(GitHub does not show it):

- **a program** (no comment): pasted into a file and run with ``python``, it must print
  what it got and exit 0 within a minute (a block that only defines a function prints
  nothing, and fails). It reads the gateway's address from ``GATEWAY_URL`` (defaulting to
  ``ws://127.0.0.1:8000``, where ``scripts/serve`` listens) and a user token from
  ``GATEWAY_TOKEN`` (the dev token ``scripts/serve`` prints)::

      URL = os.environ.get("GATEWAY_URL", "ws://127.0.0.1:8000")
      TOKEN = os.environ["GATEWAY_TOKEN"]

  and ends by itself (say, at its answer's ``turn_end``). Here it runs in a fresh
  interpreter with ``GATEWAY_URL`` set to the shared test gateway and ``GATEWAY_TOKEN`` to a
  token of :data:`READER`, one user for every block, as one person pasting them in order
  (chat ids are global: a chat such as ``trip`` is that user's), while the demo agent
  answers, as it does under ``scripts/serve``.
- **an agent handler**, ``<!-- example: agent -->``: the block defines
  ``async def handle(turn)`` (and whatever it needs). It is saved as a module and run by
  ``gateway agent <module>:handle``, as the README says to; a user sends one message to a
  new conversation, and the turn must end with ``reason: complete`` within 30 s.
- **a fragment**, ``<!-- example: fragment -->``: a few lines out of a larger program. It
  must compile (``await`` at the top level allowed). Use it only when neither kind above
  fits.
"""

from __future__ import annotations

import asyncio
import os
import re
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from gateway.sdk.demo_agent import handle as demo_handle

from .test_agent import agent_process, agent_worker
from .wsclient import connect

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"(?:<!-- example: (?P<kind>[\w-]+) -->\n)?```python\n(?P<code>.*?)```",
                   re.DOTALL)
KINDS = {"program", "agent", "fragment"}
PROGRAM_TIMEOUT = 60.0
READER = "readme-" + uuid.uuid4().hex[:8]
"""The user who runs the programs."""


def blocks() -> list[Any]:
    """Each ```python block of README.md, with its kind and the line it starts on."""
    readme = (ROOT / "README.md").read_text()
    found = []
    for match in BLOCK.finditer(readme):
        kind = match["kind"] or "program"
        line = readme.count("\n", 0, match.start("code")) + 1
        found.append(pytest.param(kind, match["code"], line, id=f"{kind}-line-{line}"))
    return found


def test_the_readme_has_examples_of_each_runnable_kind() -> None:
    kinds = [param.values[0] for param in blocks()]
    assert set(kinds) <= KINDS, f"unknown kinds: {set(kinds) - KINDS}"
    assert kinds.count("program") >= 3 and "agent" in kinds


@pytest.mark.parametrize(("kind", "code", "line"), blocks())
async def test_readme_example(kind: str, code: str, line: int, gateway: Any, user: str,
                              group: str, redis_url: str, tmp_path: Path,
                              monkeypatch: pytest.MonkeyPatch) -> None:
    flags = 0x2000 if kind == "fragment" else 0  # ast.PyCF_ALLOW_TOP_LEVEL_AWAIT
    compile(code, f"README.md:{line}", "exec", flags=flags)
    if kind == "program":
        async with agent_worker(redis_url, demo_handle, group):
            await run_program(code, line, gateway, READER, tmp_path)
    elif kind == "agent":
        module = "readme_example_" + uuid.uuid4().hex[:8]
        (tmp_path / f"{module}.py").write_text(code)
        monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # where a user runs it from
        async with agent_process(redis_url, f"{module}:handle", group):
            await one_turn(gateway, user)


async def run_program(code: str, line: int, gateway: Any, user: str, tmp_path: Path) -> None:
    path = tmp_path / "example.py"
    path.write_text(code)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    env.update(GATEWAY_URL=f"ws://127.0.0.1:{gateway.port}", GATEWAY_TOKEN=gateway.token(user))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(path), cwd=tmp_path, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    try:
        async with asyncio.timeout(PROGRAM_TIMEOUT):
            output, _ = await proc.communicate()
    except TimeoutError:
        proc.kill()
        output, _ = await proc.communicate()
        pytest.fail(f"README.md:{line}: still running after {PROGRAM_TIMEOUT:.0f} s:\n"
                    + output.decode(errors="replace")[-3000:])
    assert proc.returncode == 0, (f"README.md:{line} exited with {proc.returncode}:\n"
                                  + output.decode(errors="replace")[-3000:])
    assert output.strip(), f"README.md:{line} printed nothing: did it run at all?"


async def one_turn(gateway: Any, user: str) -> None:
    chat_id = "readme-" + uuid.uuid4().hex[:10]
    async with connect(gateway.url(user)) as ws:
        await ws.subscribe(chat_id)
        await ws.send({"type": "message", "chat_id": chat_id, "text": "plan a day in Lisbon",
                       "client_msg_id": uuid.uuid4().hex})
        end = await ws.wait_for(lambda f: f.get("type") == "turn_end", timeout=30)
    assert end["data"]["reason"] == "complete", end
