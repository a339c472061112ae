"""The Vercel AI SDK's chat transport (``/v1/ai-sdk/chat``, gateway/ai_sdk.py).

Everything is real: the shared ``gateway serve`` process, an in-process ``AgentWorker``
(its own consumer group) whose handler streams and commits, HTTP for the transport and a
WebSocket for a second device. ``test_the_ai_package_drives_the_gateway`` runs the ``ai``
package itself (``tests/js/ai-sdk-chat.live.mjs``) under Node against the same gateway.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.sdk.agent import Turn

from .steps import history
from .test_agent import agent_worker
from .wsclient import connect

pytestmark = pytest.mark.anyio

Chunk = dict[str, Any]
ROOT = Path(__file__).resolve().parent.parent
JS = ROOT / "tests" / "js"
CHAT = "/v1/ai-sdk/chat"
WORDS = 40  # a "slow" answer: this many words, one every 50 ms


def slow_answer(n: int = WORDS) -> str:
    return "".join(f"w{i} " for i in range(n))


async def handler(turn: Turn) -> None:
    """What the tests ask for, by the message's first word."""
    command = turn.text.split()[0] if turn.text.split() else ""
    if command == "slow":
        for i in range(WORDS):
            await turn.delta(f"w{i} ")
            if await turn.sleep(0.05):
                break
        await turn.message()
        await turn.end(usage={"output_tokens": WORDS})
    elif command == "wait":  # streams until stopped
        await turn.delta("waiting")
        while not await turn.sleep(0.05):
            await turn.delta(".")
    elif command == "fail":
        await turn.delta("about to")
        raise RuntimeError("boom")
    elif command == "pay":  # asks a person; the answer's turn (no text) goes on below
        await turn.delta("Let me ask.")
        await turn.message()
        await turn.ask("approve", {"amount": 5})
    elif not turn.text:
        answer = (await turn.history())[-1]
        await turn.message(f"paid: {answer['content']}")
    else:
        await turn.reasoning("thinking")
        await turn.delta("Hello")
        await turn.delta(" world")
        call_id = await turn.tool_call("search", {"q": turn.text})
        await turn.tool_result(call_id, {"hits": 3})
        await turn.goal_state(True, objective="greet", ui_summary="greeting")
        await turn.title("A greeting")
        await turn.message()
        await turn.end(usage={"input_tokens": 5, "output_tokens": 7})


@pytest.fixture
async def agent(redis_url: str, group: str) -> AsyncIterator[None]:
    async with agent_worker(redis_url, handler, group):
        yield


def body(chat_id: str, text: str, message_id: str | None = None,
         earlier: list[Chunk] | None = None, **extra: Any) -> Chunk:
    """What ``DefaultChatTransport`` sends for ``sendMessage({text})``."""
    last = {"id": message_id or uuid.uuid4().hex[:16], "role": "user",
            "parts": [{"type": "text", "text": text}]}
    return {"id": chat_id, "messages": [*(earlier or []), last], "trigger": "submit-message",
            "messageId": None, **extra}


def parse(lines: list[str]) -> tuple[list[Chunk], bool]:
    """The chunks of an SSE body, and whether it ended with ``[DONE]``."""
    chunks: list[Chunk] = []
    done = False
    for line in lines:
        if not line.startswith("data: "):
            continue
        assert not done, "a chunk after [DONE]"
        if line == "data: [DONE]":
            done = True
        else:
            chunks.append(json.loads(line[6:]))
    return chunks, done


async def read_stream(response: httpx.Response, until: Any = None) -> tuple[list[Chunk], bool]:
    """Read a UI message stream to its end, or until ``until(chunks)`` holds."""
    lines: list[str] = []
    async with asyncio.timeout(20):
        async for line in response.aiter_lines():
            lines.append(line)
            if until is not None and line.startswith("data: {") and until(parse(lines)[0]):
                break
    return parse(lines)


async def post(http: httpx.AsyncClient, gw: Any, user: str, payload: Chunk,
               until: Any = None) -> tuple[httpx.Response, list[Chunk], bool]:
    async with http.stream("POST", CHAT, json=payload, headers=gw.headers(user)) as response:
        if response.status_code != 200:
            await response.aread()
            return response, [], False
        chunks, done = await read_stream(response, until)
    return response, chunks, done


def text_of(chunks: list[Chunk], kind: str = "text") -> str:
    return "".join(c["delta"] for c in chunks if c["type"] == f"{kind}-delta")


def has_text(n: int) -> Any:
    return lambda chunks: len(text_of(chunks)) >= n


async def until_idle(gw: Any, user: str, chat_id: str) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=gw.http) as http, asyncio.timeout(15):
        while True:
            meta = (await http.get(f"/v1/conversations/{chat_id}",
                                   headers=gw.headers(user))).json()
            if meta["status"] == "idle":
                return dict(meta)
            await asyncio.sleep(0.05)


# --- send, stream ---------------------------------------------------------------------


async def test_a_message_streams_its_turn_as_ui_message_chunks_and_a_socket_sees_it(
    gateway: Any, agent: None, user: str, chat_id: str
) -> None:
    async with connect(gateway.url(user)) as ws, httpx.AsyncClient(base_url=gateway.http) as http:
        await ws.subscribe(chat_id)
        response, chunks, done = await post(http, gateway, user,
                                            body(chat_id, "hi there", "ui-msg-1"))
        socket: list[dict[str, Any]] = []
        while not socket or socket[-1]["type"] != "turn_end":
            socket.append(await ws.recv())
    assert response.status_code == 200
    assert response.headers["x-vercel-ai-ui-message-stream"] == "v1"
    assert response.headers["content-type"].startswith("text/event-stream")
    assert done
    turn_id = chunks[0]["messageId"]
    assert turn_id.startswith("t_")
    kinds = [c["type"] for c in chunks]
    assert kinds[:2] == ["start", "start-step"]
    assert kinds[-2:] == ["finish-step", "finish"] and chunks[-1]["finishReason"] == "stop"
    assert text_of(chunks) == "Hello world"
    assert text_of(chunks, "reasoning") == "thinking"
    # Each part opens once and closes once.
    for kind in ("text", "reasoning"):
        assert kinds.count(f"{kind}-start") == 1 and kinds.count(f"{kind}-end") == 1
    [call] = [c for c in chunks if c["type"] == "tool-input-available"]
    assert call["toolName"] == "search" and call["input"] == {"q": "hi there"}
    [result] = [c for c in chunks if c["type"] == "tool-output-available"]
    assert result == {"type": "tool-output-available", "toolCallId": call["toolCallId"],
                      "output": {"hits": 3}}
    data = {c["type"]: c for c in chunks if c["type"].startswith("data-")}
    assert data["data-goal_state"]["data"]["objective"] == "greet"
    assert data["data-title"]["data"]["title"] == "A greeting"
    assert data["data-usage"]["data"] == {"input_tokens": 5, "output_tokens": 7}
    # The socket saw the same turn: the message (its UI id the client_msg_id), every
    # piece of the answer, and its end.
    [message] = [f for f in socket if f["type"] == "user_message"]
    assert message["data"]["client_msg_id"] == "ui-msg-1" and message["data"]["text"] == "hi there"
    assert socket[-1]["data"]["turn_id"] == turn_id
    pieces = "".join(f["data"]["text"] for f in socket if f["type"] == "delta")
    assert pieces == "Hello world"


async def test_a_resent_request_stores_nothing_twice_and_streams_the_same_turn(
    gateway: Any, agent: None, user: str, chat_id: str
) -> None:
    """Sent again (a retry after a network error), even once the turn is over and no one
    listened: the same turn, whole, and one message in the log."""
    payload = body(chat_id, "slow please", "ui-msg-again")
    async with httpx.AsyncClient(base_url=gateway.http) as http:
        # The first reply is dropped after its first chunks: the turn goes on.
        _, first, _ = await post(http, gateway, user, payload, until=has_text(3))
        await until_idle(gateway, user, chat_id)
        _, again, done = await post(http, gateway, user, payload)
    assert done and again[0]["messageId"] == first[0]["messageId"]
    assert text_of(again) == slow_answer()
    assert again[-1]["finishReason"] == "stop"
    events = await history(gateway, user, chat_id)
    assert [e["type"] for e in events].count("user_message") == 1
    assert [e["type"] for e in events].count("turn_start") == 1


async def test_earlier_messages_in_the_body_are_not_stored_again(
    gateway: Any, agent: None, user: str, chat_id: str
) -> None:
    async with httpx.AsyncClient(base_url=gateway.http) as http:
        await post(http, gateway, user, body(chat_id, "one"))
        # The body disagrees with the log (made-up earlier messages): not an error.
        earlier = [{"id": "x1", "role": "user", "parts": [{"type": "text", "text": "zzz"}]},
                   {"id": "x2", "role": "assistant", "parts": [{"type": "text", "text": "?"}]}]
        _, chunks, done = await post(http, gateway, user, body(chat_id, "two", earlier=earlier))
    assert done and text_of(chunks) == "Hello world"
    texts = [e["data"]["text"] for e in await history(gateway, user, chat_id)
             if e["type"] == "user_message"]
    assert texts == ["one", "two"]


async def test_the_apps_own_fields_reach_the_agent_and_the_request_names_the_agent(
    gateway: Any, redis_url: str, group: str, user: str, chat_id: str
) -> None:
    name = "aisdk-" + uuid.uuid4().hex[:8]

    async def named(turn: Turn) -> None:
        await turn.message(f"{name}: {json.dumps(turn.data, sort_keys=True)}")

    async with agent_worker(redis_url, named, group, name=name), \
            httpx.AsyncClient(base_url=gateway.http) as http:
        _, chunks, done = await post(http, gateway, user,
                                     body(chat_id, "hi", agent=name, model="small", n=2))
        meta = (await http.get(f"/v1/conversations/{chat_id}",
                               headers=gateway.headers(user))).json()
    assert done and meta["agent"] == name and meta["owner"] == user
    assert text_of(chunks) == name + ': {"props": {"model": "small", "n": 2}}'


async def test_a_failed_turn_ends_with_an_error_chunk(
    gateway: Any, agent: None, user: str, chat_id: str
) -> None:
    async with httpx.AsyncClient(base_url=gateway.http) as http:
        _, chunks, done = await post(http, gateway, user, body(chat_id, "fail now"))
    assert done
    assert text_of(chunks) == "about to"
    errors = [c for c in chunks if c["type"] == "error"]
    assert errors == [{"type": "error",
                       "errorText": "The agent failed while answering (RuntimeError)."}]
    assert chunks[-1] == {"type": "finish", "finishReason": "error"}
    # The partial answer was committed before the error: its part is closed.
    assert [c["type"] for c in chunks].count("text-end") == 1


# --- regenerate, resume, stop -----------------------------------------------------------


async def test_regenerate_is_a_tree_retry(gateway: Any, agent: None, user: str,
                                          chat_id: str) -> None:
    async with httpx.AsyncClient(base_url=gateway.http) as http:
        _, first, _ = await post(http, gateway, user, body(chat_id, "hello"))
        again = {"id": chat_id, "messages": [], "trigger": "regenerate-message",
                 "messageId": first[0]["messageId"]}
        _, second, done = await post(http, gateway, user, again)
        tree = (await http.get(f"/v1/conversations/{chat_id}/tree",
                               headers=gateway.headers(user))).json()
        shown = (await http.get(f"{CHAT}/{chat_id}/messages",
                                headers=gateway.headers(user))).json()
    assert done and text_of(second) == "Hello world"
    old, new = first[0]["messageId"], second[0]["messageId"]
    assert old != new and tree["head"] == new
    turns = [n for n in tree["nodes"] if n["kind"] == "turn"]
    assert [t["id"] for t in turns] == [old, new]
    assert turns[0]["parent_id"] == turns[1]["parent_id"]  # siblings: two answers
    assert [m["id"] for m in shown][1:] == [new]  # the active path shows the new one


async def test_resume_gives_the_running_answer_from_its_start_then_204(
    gateway: Any, agent: None, user: str, chat_id: str
) -> None:
    async with httpx.AsyncClient(base_url=gateway.http) as http:
        headers = gateway.headers(user)
        nothing = await http.get(f"{CHAT}/{chat_id}/stream", headers=headers)
        assert nothing.status_code == 204  # no such chat yet: nothing to resume
        _, first, _ = await post(http, gateway, user, body(chat_id, "slow"),
                                 until=has_text(10))
        turn_id = first[0]["messageId"]

        async def resume() -> tuple[list[Chunk], bool]:
            async with http.stream("GET", f"{CHAT}/{chat_id}/stream",
                                   headers=headers) as response:
                assert response.status_code == 200
                assert response.headers["x-vercel-ai-ui-message-stream"] == "v1"
                return await read_stream(response)

        # Two devices, and a third that reads a little and reloads.
        async with http.stream("GET", f"{CHAT}/{chat_id}/stream", headers=headers) as response:
            partial, _ = await read_stream(response, until=has_text(len(text_of(first)) + 4))
        (a, a_done), (b, b_done) = await asyncio.gather(resume(), resume())
        after = await http.get(f"{CHAT}/{chat_id}/stream", headers=headers)
    assert after.status_code == 204
    assert partial[0] == {"type": "start", "messageId": turn_id}
    assert text_of(partial).startswith(text_of(first))  # from the start, not from here
    for chunks, done in ((a, a_done), (b, b_done)):
        assert done and chunks[0]["messageId"] == turn_id
        assert text_of(chunks) == slow_answer()  # each piece once
        assert chunks[-1]["finishReason"] == "stop"
        assert [c["type"] for c in chunks].count("text-start") == 1


async def test_closing_the_response_does_not_stop_the_turn_and_stop_does(
    gateway: Any, agent: None, user: str, chat_id: str
) -> None:
    async with httpx.AsyncClient(base_url=gateway.http) as http:
        headers = gateway.headers(user)
        idle = await http.post(f"{CHAT}/{chat_id}/stop", headers=headers)
        assert idle.status_code == 404  # no such chat
        _, first, _ = await post(http, gateway, user, body(chat_id, "wait"),
                                 until=has_text(len("waiting")))
        went_on = asyncio.Event()

        def grows(chunks: list[Chunk]) -> bool:
            if len(text_of(chunks)) >= len(text_of(first)) + 3:
                went_on.set()
            return False  # read on to the end

        async with http.stream("GET", f"{CHAT}/{chat_id}/stream", headers=headers) as response:
            resumed = asyncio.create_task(read_stream(response, until=grows))
            async with asyncio.timeout(10):
                await went_on.wait()  # the reply was closed; the turn goes on
            meta = (await http.get(f"/v1/conversations/{chat_id}", headers=headers)).json()
            assert meta["status"] == "running"
            stopped = await http.post(f"{CHAT}/{chat_id}/stop", headers=headers)
            chunks, done = await resumed
        again = await http.post(f"{CHAT}/{chat_id}/stop", headers=headers)
        shown = (await http.get(f"{CHAT}/{chat_id}/messages", headers=headers)).json()
    turn_id = first[0]["messageId"]
    assert stopped.status_code == 200 and stopped.json() == {"chat_id": chat_id,
                                                              "turn_id": turn_id}
    assert again.json() == {"chat_id": chat_id, "turn_id": None}  # nothing runs
    assert done and text_of(chunks).startswith("waiting.")
    assert [c["type"] for c in chunks][-3:] == ["finish-step", "abort", "finish"]
    assert chunks[-1]["finishReason"] == "other"
    # The stopped answer is kept as a partial, whole.
    [text] = [p for p in shown[-1]["parts"] if p["type"] == "text"]
    assert text == {"type": "text", "text": text_of(chunks), "state": "done"}


async def test_a_slow_reader_reads_on_from_the_log_within_the_same_reply(
    start_gateway: Any, redis_url: str, group: str, user: str, chat_id: str
) -> None:
    """With a queue of a few bytes, the reply's room member overflows at almost every
    frame: each time it reads on from its last seq and the open streams, and the answer
    still comes whole, each piece once."""
    tiny = start_gateway(queue_max_bytes=64)
    async with agent_worker(redis_url, handler, group), \
            httpx.AsyncClient(base_url=tiny.http) as http:
        _, slow, slow_done = await post(http, tiny, user, body(chat_id, "slow"))
        _, rich, rich_done = await post(http, tiny, user, body(chat_id, "hi"))
    assert slow_done and text_of(slow) == slow_answer()
    assert rich_done and text_of(rich) == "Hello world"
    assert [c["type"] for c in rich].count("tool-output-available") == 1
    assert [c["type"] for c in rich].count("data-usage") == 1


async def test_a_client_tool_question_and_its_answer(gateway: Any, agent: None, user: str,
                                                     chat_id: str) -> None:
    async with httpx.AsyncClient(base_url=gateway.http) as http:
        headers = gateway.headers(user)
        await http.post("/v1/conversations", json={"chat_id": chat_id}, headers=headers)
        tools = [{"name": "approve", "parameters": {"type": "object"}}]
        (await http.patch(f"/v1/conversations/{chat_id}", json={"client_tools": tools},
                          headers=headers)).raise_for_status()
        _, asked, done = await post(http, gateway, user, body(chat_id, "pay the bill"))
        [question] = [c for c in asked if c["type"] == "tool-input-available"]
        answer = await http.post(f"/v1/conversations/{chat_id}/tool-results", headers=headers,
                                 json={"call_id": question["toolCallId"], "result": "yes"})
        assert answer.status_code == 200, answer.text
        async with http.stream("GET", f"{CHAT}/{chat_id}/stream", headers=headers) as reply:
            # The answer's turn, unless it was over before the resume asked.
            went_on, _ = (await read_stream(reply)) if reply.status_code == 200 else ([], True)
        await until_idle(gateway, user, chat_id)
        shown = (await http.get(f"{CHAT}/{chat_id}/messages", headers=headers)).json()
    assert done and question["toolName"] == "approve" and question["input"] == {"amount": 5}
    assert asked[-1] == {"type": "finish", "finishReason": "tool-calls"}
    if went_on:
        assert went_on[0]["messageId"] == answer.json()["turn_id"]
        assert text_of(went_on) == "paid: yes"
    assert [m["role"] for m in shown] == ["user", "assistant", "assistant"]
    [tool] = [p for p in shown[1]["parts"] if p["type"] == "tool-approve"]
    assert tool["state"] == "output-available" and tool["output"] == "yes"
    assert [p["text"] for p in shown[2]["parts"] if p["type"] == "text"] == ["paid: yes"]


# --- messages -------------------------------------------------------------------------


async def test_messages_are_the_active_path_as_ui_messages(
    gateway: Any, agent: None, user: str, chat_id: str
) -> None:
    async with httpx.AsyncClient(base_url=gateway.http) as http:
        headers = gateway.headers(user)
        empty = await http.get(f"{CHAT}/{chat_id}/messages", headers=headers)
        assert empty.status_code == 200 and empty.json() == []
        _, first, _ = await post(http, gateway, user, body(chat_id, "hi", "ui-1"))
        _, running, _ = await post(http, gateway, user, body(chat_id, "slow", "ui-2"),
                                   until=has_text(8))
        during = (await http.get(f"{CHAT}/{chat_id}/messages", headers=headers)).json()
        await until_idle(gateway, user, chat_id)
        after = (await http.get(f"{CHAT}/{chat_id}/messages", headers=headers)).json()
    turn = first[0]["messageId"]
    assert [(m["id"], m["role"]) for m in after] == [
        ("ui-1", "user"), (turn, "assistant"), ("ui-2", "user"),
        (running[0]["messageId"], "assistant")]
    assert after[0]["parts"] == [{"type": "text", "text": "hi"}]
    parts = after[1]["parts"]
    assert parts[0] == {"type": "step-start"}
    assert {"type": "reasoning", "text": "thinking", "state": "done"} in parts
    assert {"type": "text", "text": "Hello world", "state": "done"} in parts
    [tool] = [p for p in parts if p["type"] == "tool-search"]
    assert tool["state"] == "output-available" and tool["input"] == {"q": "hi"}
    assert tool["output"] == {"hits": 3}
    data = {p["type"]: p["data"] for p in parts if p["type"].startswith("data-")}
    assert data["data-title"]["title"] == "A greeting"
    assert data["data-usage"] == {"input_tokens": 5, "output_tokens": 7}
    # Mid-answer: the running turn's text so far, still streaming.
    [partial] = [p for p in during[-1]["parts"] if p["type"] == "text"]
    assert partial["state"] == "streaming" and slow_answer().startswith(partial["text"])
    assert len(partial["text"]) >= 8
    [whole] = [p for p in after[-1]["parts"] if p["type"] == "text"]
    assert whole == {"type": "text", "text": slow_answer(), "state": "done"}


# --- refusals, CORS ---------------------------------------------------------------------


async def test_bad_requests_get_the_apis_errors(gateway: Any, user: str, chat_id: str) -> None:
    other = "u-other-" + uuid.uuid4().hex[:6]
    async with httpx.AsyncClient(base_url=gateway.http) as http:
        headers = gateway.headers(user)

        async def refused(status: int, code: str, content: bytes | None = None,
                          payload: Any = None, who: dict[str, str] | None = None,
                          method: str = "POST", path: str = CHAT) -> None:
            response = await http.request(method, path, content=content,
                                          json=payload, headers=headers if who is None else who)
            assert response.status_code == status, response.text
            assert response.json()["error"]["code"] == code, response.text
            assert set(response.json()) == {"error"}

        await refused(400, "invalid_request", content=b"{not json")
        await refused(422, "unprocessable", payload=[1, 2])
        await refused(422, "unprocessable", payload={"messages": []})
        await refused(422, "unprocessable", payload={"id": "bad id!", "messages": []})
        await refused(422, "unprocessable", payload={**body(chat_id, "x"), "trigger": "nope"})
        await refused(422, "unprocessable",
                      payload={"id": chat_id, "messages": [{"id": "a", "parts": []}]})
        await refused(400, "invalid_request", payload={"id": chat_id, "messages": []})
        assistant = {"id": "a1", "role": "assistant", "parts": [{"type": "text", "text": "x"}]}
        await refused(400, "invalid_request", payload={"id": chat_id, "messages": [assistant]})
        image = {"id": "a2", "role": "user",
                 "parts": [{"type": "file", "url": "data:,", "mediaType": "image/png"}]}
        await refused(400, "invalid_request", payload={"id": chat_id, "messages": [image]})
        await refused(401, "unauthorized", payload=body(chat_id, "x"), who={})
        await refused(404, "not_found", payload={"id": chat_id, "messages": [],
                                                 "trigger": "regenerate-message"})
        # Someone else's conversation: every route refuses.
        await http.post("/v1/conversations", json={"chat_id": chat_id},
                        headers=gateway.headers(other))
        await refused(403, "forbidden", payload=body(chat_id, "x"))
        for method, path in [("GET", "/stream"), ("GET", "/messages"), ("POST", "/stop")]:
            await refused(403, "forbidden", method=method, path=f"{CHAT}/{chat_id}{path}")
            await refused(401, "unauthorized", method=method, path=f"{CHAT}/{chat_id}{path}",
                          who={})
            await refused(400, "invalid_request", method=method, path=f"{CHAT}/bad*id{path}")
        # Nothing was stored for any of them.
        assert await history(gateway, other, chat_id) == []


async def test_a_message_while_a_turn_runs_is_refused(
    gateway: Any, agent: None, user: str, chat_id: str
) -> None:
    async with httpx.AsyncClient(base_url=gateway.http) as http:
        await post(http, gateway, user, body(chat_id, "wait"), until=has_text(3))
        busy, _, _ = await post(http, gateway, user, body(chat_id, "hi"))
        retry, _, _ = await post(http, gateway, user,
                                 {"id": chat_id, "messages": [], "trigger": "regenerate-message"})
        await http.post(f"{CHAT}/{chat_id}/stop", headers=gateway.headers(user))
    assert busy.status_code == 409 and busy.json()["error"]["code"] == "turn_in_progress"
    assert retry.status_code == 409 and retry.json()["error"]["code"] == "turn_in_progress"


async def test_cors_for_the_origins_the_operator_allows(gateway: Any, user: str,
                                                        chat_id: str) -> None:
    """The shared gateway allows http://good.example (conftest)."""
    async with httpx.AsyncClient(base_url=gateway.http) as http:
        for path in (CHAT, f"{CHAT}/{chat_id}/stream", f"{CHAT}/{chat_id}/messages",
                     f"{CHAT}/{chat_id}/stop"):
            asked = await http.options(path, headers={
                "Origin": "http://good.example", "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization, content-type, x-app"})
            assert asked.status_code == 204, (path, asked.text)
            assert asked.headers["access-control-allow-origin"] == "http://good.example"
            assert "POST" in asked.headers["access-control-allow-methods"]
            assert asked.headers["access-control-allow-headers"] == \
                "authorization, content-type, x-app"
            bad = await http.options(path, headers={
                "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
            assert bad.status_code == 403 and "access-control-allow-origin" not in bad.headers
        good = {"Origin": "http://good.example", **gateway.headers(user)}
        read = await http.get(f"{CHAT}/{chat_id}/messages", headers=good)
        assert read.headers["access-control-allow-origin"] == "http://good.example"
        assert "x-vercel-ai-ui-message-stream" in read.headers["access-control-expose-headers"]
        # Errors too, so that the page can read them.
        refused = await http.post(CHAT, content=b"{", headers=good)
        assert refused.status_code == 400
        assert refused.headers["access-control-allow-origin"] == "http://good.example"
        evil = await http.get(f"{CHAT}/{chat_id}/messages",
                              headers={"Origin": "http://evil.example", **gateway.headers(user)})
        assert "access-control-allow-origin" not in evil.headers


# --- the `ai` package itself, under Node --------------------------------------------------


@pytest.mark.skipif(shutil.which("node") is None, reason="needs Node.js")
async def test_the_ai_package_drives_the_gateway(gateway: Any, agent: None, user: str) -> None:
    """``tests/js/ai-sdk-chat.live.mjs``: the ``ai`` package's ``Chat`` over
    ``DefaultChatTransport`` against this gateway (send, stream, regenerate, stop, a reload
    mid-answer that resumes, a second device on the WebSocket)."""
    if not (JS / "node_modules" / "ai").is_dir():
        pytest.skip("tests/js needs `npm install` (scripts/test does it)")
    env = {**os.environ, "GATEWAY_HTTP": gateway.http, "GATEWAY_WS": gateway.ws,
           "GATEWAY_TOKEN": gateway.token(user), "SLOW_ANSWER": slow_answer()}
    proc = await asyncio.create_subprocess_exec(
        "node", "--test", "--test-reporter=spec", "ai-sdk-chat.live.mjs", cwd=JS, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    async with asyncio.timeout(120):
        output, _ = await proc.communicate()
    assert proc.returncode == 0, output.decode()
