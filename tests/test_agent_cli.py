"""``gateway agent --name NAME --openai ... | --ag-ui ...``: one command puts an agent the
gateway drives behind a named conversation, as a process of its own.

The agents are real servers in this test's event loop (the OpenAI-compatible one of
tests/test_openai_agent.py, pydantic-ai's AG-UI adapter of tests/agui_server.py); the
worker is the ``gateway agent`` command; the person is a WebSocket client.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from . import agui_server
from .steps import send_message
from .test_agent import until_turn_end
from .test_openai_agent import Plan, model_server
from .wsclient import connect

pytestmark = pytest.mark.anyio


@contextlib.asynccontextmanager
async def agent_command(redis_url: str, *args: str,
                        **env: str) -> AsyncIterator[asyncio.subprocess.Process]:
    """``gateway agent ARGS`` until it reads its inbox; stopped with SIGTERM after."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    environ.update(GATEWAY_REDIS_URL=redis_url, GATEWAY_DELTA_WINDOW_MS="0", **env)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway", "agent", *args, "--log-level", "warning",
        env=environ, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    assert proc.stdout is not None
    try:
        async with asyncio.timeout(20):
            while not (line := await proc.stdout.readline()).startswith(b"agent ready"):
                assert line, "gateway agent exited"
        yield proc
    finally:
        if proc.returncode is None:
            proc.terminate()
        await proc.wait()


async def named_chat(gw: Any, user: str, agent: str) -> str:
    chat_id = "chat-" + uuid.uuid4().hex[:8]
    async with httpx.AsyncClient(base_url=gw.http) as http:
        resp = await http.post("/v1/conversations", json={"chat_id": chat_id, "agent": agent},
                               headers=gw.headers(user))
    assert resp.status_code == 201, resp.text
    return chat_id


def texts(frames: list[dict[str, Any]]) -> list[str]:
    return [f["data"]["text"] for f in frames if f["type"] == "message"]


async def test_an_openai_compatible_model_answers_a_named_agents_conversations(
        gateway: Any, redis_url: str, user: str) -> None:
    name = "model-" + uuid.uuid4().hex[:6]
    async with model_server() as model:
        model.plans = [Plan(text=["Hi ", "from ", "the model"],
                            usage={"prompt_tokens": 4, "completion_tokens": 3})]
        async with agent_command(
                redis_url, "--name", name, "--openai", model.url, "--model", "tiny",
                "--api-key-env", "TEST_MODEL_KEY", "--system", "Be brief.",
                "--temperature", "0.5", "--param", "max_tokens=64", "--param", "user=ann",
                TEST_MODEL_KEY="sk-test-123"):
            async with httpx.AsyncClient(base_url=gateway.http) as http:
                listed = (await http.get("/v1/agents",
                                         headers=gateway.headers(user))).json()["agents"]
            assert {"name": name, "kind": "openai", "workers": 1} in listed
            chat_id = await named_chat(gateway, user, name)
            async with connect(gateway.url(user)) as ws:
                await ws.subscribe(chat_id)
                await send_message(ws, chat_id, "hello")
                frames = await until_turn_end(ws, chat_id)
    assert texts(frames) == ["Hi from the model"]
    assert frames[-1]["data"]["usage"] == {"prompt_tokens": 4, "completion_tokens": 3}
    body = model.requests[0]
    assert (body["model"], body["temperature"], body["max_tokens"], body["user"]) == (
        "tiny", 0.5, 64, "ann")
    assert body["messages"] == [{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "hello"}]
    assert model.headers[0]["authorization"] == "Bearer sk-test-123"


async def test_an_ag_ui_agent_answers_with_headers_from_the_environment(
        gateway: Any, redis_url: str, user: str) -> None:
    name = "agui-" + uuid.uuid4().hex[:6]
    async with agui_server.serving() as (url, recorder):
        async with agent_command(redis_url, "--name", name, "--ag-ui", url + "/agent",
                                 "--header", "X-Agent-Key: $AGENT_KEY", AGENT_KEY="k-42"):
            chat_id = await named_chat(gateway, user, name)
            async with connect(gateway.url(user)) as ws:
                await ws.subscribe(chat_id)
                await send_message(ws, chat_id, "hello")
                frames = await until_turn_end(ws, chat_id)
    assert frames[-1]["data"]["reason"] == "complete", frames[-1]
    assert texts(frames)
    assert recorder.headers[0]["x-agent-key"] == "k-42"
    assert recorder.inputs[0]["threadId"] == chat_id


@pytest.mark.parametrize(("args", "says"), [
    ((), "give one of"),
    (("--openai", "http://127.0.0.1:1/v1"), "--openai needs --model"),
    (("--openai", "http://127.0.0.1:1/v1", "--model", "m", "--api-key-env", "NOPE_UNSET"),
     "NOPE_UNSET is not set"),
    (("--openai", "http://127.0.0.1:1/v1", "--model", "m", "--param", "novalue"),
     "KEY=VALUE"),
    (("--ag-ui", "http://127.0.0.1:1/", "--header", "no colon here"), "'NAME: VALUE'"),
    (("mymod:handle", "--ag-ui", "http://127.0.0.1:1/"), "give one of"),
    (("--name", "Bad Name", "gateway.sdk.demo_agent:handle"), "--name must match"),
])
async def test_bad_options_are_named_and_nothing_starts(redis_url: str, args: tuple[str, ...],
                                                        says: str) -> None:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    environ["GATEWAY_REDIS_URL"] = redis_url
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway", "agent", *args, env=environ,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 2 and says in err.decode(), (out, err)
