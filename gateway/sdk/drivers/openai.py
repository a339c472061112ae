"""OpenAI-compatible agents: each turn one streamed ``POST {base}/chat/completions``.

Any server that speaks OpenAI's chat completions (vLLM, Ollama, llama.cpp's server, LiteLLM,
the hosted APIs) answers a conversation through the gateway with :class:`OpenAIAgent`, a
handler for :class:`gateway.sdk.agent.AgentWorker`::

    agent = OpenAIAgent("http://127.0.0.1:8001/v1", "qwen3-8b", system="Be brief.")
    worker = AgentWorker(redis, settings, agent)

One turn, with the official ``openai`` client:

- **Input.** The conversation so far (:meth:`Turn.history`) as chat messages: user and
  assistant messages, assistant ``tool_calls`` (``{id, type: "function", function: {name,
  arguments}}``, the arguments as JSON text) and ``tool`` messages with their
  ``tool_call_id``, after the ``system`` message if one is given. A tool call that was never
  answered gets a ``tool`` message saying so, as servers require an answer for every call.
  The request asks for ``stream: true`` and ``stream_options.include_usage``; ``temperature``
  and ``params`` (any other request parameters, passed through) go with it.
- **Output.** ``delta.content`` (or a ``refusal``) streams as the answer (``delta``,
  resumable), committed as one ``message`` at the end; ``reasoning_content`` (or
  ``reasoning``), as vLLM and others send it, streams as ``reasoning_delta`` and is
  committed as ``reasoning`` when the answer starts. Each streamed tool call becomes one
  durable ``tool_call {call_id, name, args}`` once its arguments are complete (``args``
  parsed from JSON; kept as text when they do not parse). The usage the server reports goes
  in ``turn_end.usage`` as it comes.
- **Stop.** A cancel closes the HTTP request at once; what streamed stays as the partial
  answer (the worker ends the turn ``cancelled``). A publish refused because the turn is
  over (:class:`~gateway.sdk.agent.TurnOver`) stops the run too.
- **Failures** end the turn with ``reason: error`` and a sentence in ``turn_end.data.error``:
  the server unreachable, a non-2xx answer (its status and the server's own message), a chunk
  that does not parse, an error sent mid-stream, or nothing for ``idle_timeout`` seconds. A
  connection that cannot be made is tried again after ``retry_delays`` (a few seconds in
  all); once the request was sent it never is. The API key is in no message and no log.
- **A crashed worker**: the turn is redelivered and runs again under a new attempt, which
  replaces the partial stream (:mod:`gateway.sdk.agent`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import openai
from openai.types.chat import ChatCompletionChunk

from ...protocol import ClientTool
from ..agent import Turn
from ..context import Message
from . import call_tool

log = logging.getLogger("gateway.agent.openai")

T = TypeVar("T")

RETRY_DELAYS = (0.25, 0.5, 1.0, 2.0)  # a connection refused: five tries, 3.75 s in all
DETAIL_MAX = 300  # characters of the server's own error message kept
UNANSWERED = "(no result: this tool call was not answered)"
RESERVED_PARAMS = frozenset({"model", "messages", "stream"})
_END = object()


class ModelError(Exception):
    """The model server failed the turn; the message is for a person to read."""


class _Stopped(Exception):
    """The turn was cancelled while the driver waited on the model server."""


class OpenAIAgent:
    """A turn handler that answers with an OpenAI-compatible chat completions server.

    - ``base_url``: the API's base, ``/chat/completions`` is added to it (usually ending in
      ``/v1``: ``http://127.0.0.1:8000/v1``, ``https://api.openai.com/v1``).
    - ``model``: the request's ``model``.
    - ``api_key``: sent as ``Authorization: Bearer``; None sends none (a local server).
      Never read from the environment here, never logged nor put in a message.
    - ``system``: a system message put before the conversation.
    - ``temperature``: the request's ``temperature``; None leaves the server's default.
    - ``params``: other request parameters, passed through as they are (``max_tokens``,
      ``top_p``, ``tools``, ``reasoning_effort``, ...); ``model``, ``messages`` and
      ``stream`` are the driver's.
    - ``request_timeout``: seconds to connect and get the response's status.
    - ``idle_timeout``: seconds of silence allowed between chunks (and before the first).
    - ``retry_delays``: the waits between tries of a connection that cannot be made.
    - ``history_messages``, ``history_tokens``: the budgets of :meth:`Turn.history`.
    """

    kind = "openai"

    def __init__(self, base_url: str, model: str, *, api_key: str | None = None,
                 system: str | None = None, temperature: float | None = None,
                 params: Mapping[str, Any] | None = None, request_timeout: float = 60.0,
                 idle_timeout: float = 60.0, retry_delays: Sequence[float] = RETRY_DELAYS,
                 history_messages: int = 120, history_tokens: int = 0) -> None:
        if not base_url:
            raise ValueError("base_url is required")
        if not model:
            raise ValueError("model is required")
        if request_timeout <= 0 or idle_timeout <= 0:
            raise ValueError("timeouts must be positive")
        reserved = RESERVED_PARAMS.intersection(params or {})
        if reserved:
            raise ValueError(f"params cannot set {', '.join(sorted(reserved))}")
        self.base_url = base_url.rstrip("/")
        self.model = model
        self._api_key = api_key or None
        self.system = system or None
        self.temperature = temperature
        self.params: dict[str, Any] = dict(params or {})
        self.request_timeout = float(request_timeout)
        self.idle_timeout = float(idle_timeout)
        self.retry_delays = tuple(float(d) for d in retry_delays)
        self.history_messages = history_messages
        self.history_tokens = history_tokens
        self.where = _display_url(self.base_url)
        self._client: openai.AsyncOpenAI | None = None
        self._client_loop: asyncio.AbstractEventLoop | None = None

    def __repr__(self) -> str:  # no key
        return f"<OpenAIAgent {self.model} at {self.where}>"

    async def __call__(self, turn: Turn) -> None:
        history = await turn.history(self.history_messages, self.history_tokens)
        run = _Run(self, turn)
        try:
            await run.run(chat_messages(history, self.system))
        except ModelError as exc:
            message = self.scrub(str(exc))
            log.warning("%r: %s (%s)", turn, message, self.where)
            await turn.end(usage=run.usage, reason="error", error=message)
            return
        # Done, or stopped: a cancelled turn ends as "cancelled" (Turn.end sees it).
        await turn.end(usage=run.usage)

    async def aclose(self) -> None:
        """Close the HTTP connections kept for the next turns."""
        if self._client is not None:
            client, self._client = self._client, None
            await client.close()

    def client(self) -> openai.AsyncOpenAI:
        """The ``openai`` client (one per event loop: its connections belong to one)."""
        loop = asyncio.get_running_loop()
        if self._client is None or self._client_loop is not loop:
            self._client = openai.AsyncOpenAI(
                # With no key the header is omitted from each request (see request()).
                base_url=self.base_url, api_key=self._api_key or "unused", max_retries=0,
                # A backstop only: the driver's own timeouts fire first, with their words.
                timeout=max(self.request_timeout, self.idle_timeout) + 30)
            self._client_loop = loop
        return self._client

    def request(self, messages: list[Message],
                client_tools: Sequence[ClientTool] = ()) -> dict[str, Any]:
        """The keyword arguments of ``chat.completions.create`` for ``messages``; the
        conversation's client tools as the model's ``tools``."""
        kwargs: dict[str, Any] = {"model": self.model, "messages": messages, "stream": True,
                                  "stream_options": {"include_usage": True}}
        if client_tools:
            kwargs["tools"] = [{"type": "function", "function": {
                "name": tool.name, "description": tool.description,
                "parameters": tool.parameters}} for tool in client_tools]
        if self.temperature is not None:
            kwargs["temperature"] = self.temperature
        if self.params:
            kwargs["extra_body"] = dict(self.params)
        if self._api_key is None:  # a server that needs no key gets no Authorization
            kwargs["extra_headers"] = {"Authorization": openai.Omit()}
        return kwargs

    def scrub(self, text: str) -> str:
        """``text`` without the API key in it (a server may echo it in an error)."""
        if self._api_key and self._api_key in text:
            text = text.replace(self._api_key, "***")
        return text

    async def wait_to_retry(self, turn: Turn, delay: float) -> bool:
        """Wait ``delay`` seconds before trying to connect again; True when the turn was
        cancelled meanwhile."""
        return await turn.sleep(delay)


# --- the messages a model takes ----------------------------------------------------------


def chat_messages(history: list[Message], system: str | None = None) -> list[dict[str, Any]]:
    """:meth:`Turn.history`'s messages as OpenAI chat messages, after ``system`` if given.

    Gateway-only keys (``msg_id``, ``partial``) are dropped; content is text (a result that
    is not a string as JSON); an assistant's text and the tool calls that follow it are one
    message; every tool call gets a ``tool`` message (:data:`UNANSWERED` when none came)."""
    out: list[dict[str, Any]] = []
    if system:
        out.append({"role": "system", "content": system})
    for message in history:
        role = message.get("role")
        if role == "user":
            out.append({"role": "user", "content": _as_text(message.get("content"))})
        elif role == "assistant" and message.get("tool_calls"):
            calls = [{"id": str(call.get("id") or ""), "type": "function",
                      "function": {"name": str(call.get("name") or ""),
                                   "arguments": _as_arguments(call.get("args"))}}
                     for call in message["tool_calls"]]
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and "tool_calls" not in last:
                last["tool_calls"] = calls  # the text the calls came with: one message
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": calls})
        elif role == "assistant":
            out.append({"role": "assistant", "content": _as_text(message.get("content"))})
        elif role == "tool":
            out.append({"role": "tool", "tool_call_id": str(message.get("tool_call_id") or ""),
                        "content": _as_text(message.get("content"))})
    return _answer_every_call(out)


def _answer_every_call(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with a ``tool`` message for every call that has none after it."""
    out: list[dict[str, Any]] = []
    waiting: list[str] = []  # calls of the last assistant message not answered yet

    def settle() -> None:
        out.extend({"role": "tool", "tool_call_id": call_id, "content": UNANSWERED}
                   for call_id in waiting)
        waiting.clear()

    for message in messages:
        if message["role"] == "tool" and message["tool_call_id"] in waiting:
            waiting.remove(message["tool_call_id"])
        elif message["role"] != "tool":
            settle()
        out.append(message)
        if message["role"] == "assistant":
            waiting.extend(call["id"] for call in message.get("tool_calls", ()))
    settle()
    return out


def _as_text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False)


def _as_arguments(args: Any) -> str:
    """A tool call's ``args`` as the JSON text OpenAI's ``arguments`` holds (text that did
    not parse when it came is passed back as it was)."""
    if isinstance(args, str):
        return args
    return json.dumps({} if args is None else args, ensure_ascii=False)


# --- one run -----------------------------------------------------------------------------


@dataclass
class _Call:
    id: str = ""
    name: str = ""
    arguments: list[str] = field(default_factory=list)


@dataclass
class _Piece:
    """What one chunk says, read before anything of it is published."""
    reasoning: str = ""
    content: str = ""
    calls: list[tuple[int, str, str, str]] = field(default_factory=list)  # index, id, name, args
    usage: dict[str, Any] | None = None


class _Run:
    def __init__(self, agent: OpenAIAgent, turn: Turn) -> None:
        self.agent = agent
        self.turn = turn
        self.usage: dict[str, Any] | None = None
        self.received = False  # a chunk came: the connection is not tried again
        self._text_open = False
        self._reasoning_open = False
        self._calls: dict[int, _Call] = {}
        self._stop: asyncio.Future[Any] | None = None

    async def run(self, messages: list[dict[str, Any]]) -> None:
        """Stream the answer; returns when it is complete or the turn was cancelled."""
        if self.turn.cancelled:
            return
        self._stop = asyncio.ensure_future(self.turn.cancel_event.wait())
        stream: Any = None
        try:
            stream = await self._open(messages)
            if stream is None:
                return
            while True:
                try:
                    chunk = await self._race(_next(stream), self.agent.idle_timeout)
                except _Stopped:
                    return
                except TimeoutError:
                    raise ModelError("The model server sent nothing for "
                                     f"{self.agent.idle_timeout:g} seconds.") from None
                except Exception as exc:
                    raise self._failure(exc) from None
                if chunk is _END:
                    break
                await self._take(_read(chunk))
            await self._finish()
        finally:
            self._stop.cancel()
            if stream is not None:
                await _close(stream)

    async def _open(self, messages: list[dict[str, Any]]) -> Any:
        """The response stream, the connection tried again while it is refused; None when
        the turn was cancelled first."""
        delays = list(self.agent.retry_delays)
        request = self.agent.request(messages, self.turn.client_tools)
        create: Any = self.agent.client().chat.completions.create
        while True:
            try:
                return await self._race(create(**request), self.agent.request_timeout)
            except _Stopped:
                return None
            except TimeoutError:
                raise ModelError("The model server did not answer within "
                                 f"{self.agent.request_timeout:g} seconds.") from None
            except openai.APIConnectionError as exc:
                if not _cannot_connect(exc) or not delays:
                    raise self._failure(exc) from None
                delay = delays.pop(0)
                log.info("%r: cannot connect to %s; trying again in %gs", self.turn,
                         self.agent.where, delay)
                if await self.agent.wait_to_retry(self.turn, delay):
                    return None
            except openai.APIError as exc:
                raise self._failure(exc) from None

    async def _race(self, step: Awaitable[T], timeout: float) -> T:
        """``step``'s result, unless the turn is cancelled first (:class:`_Stopped`) or
        ``timeout`` passes (:class:`TimeoutError`); either way ``step`` is abandoned, and
        with it the read it waits on."""
        assert self._stop is not None
        task = asyncio.ensure_future(step)
        try:
            done, _ = await asyncio.wait({task, self._stop}, timeout=timeout,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not task.done():
                task.cancel()
                await asyncio.wait({task})  # it stops at once: it only reads
        if task in done:
            return task.result()
        if not task.cancelled():
            task.exception()  # retrieved: a failure that lost the race is not reported
        if self._stop in done:
            raise _Stopped
        raise TimeoutError

    def _failure(self, exc: BaseException) -> ModelError:
        """``exc``, raised reading the model server, in words."""
        if isinstance(exc, ModelError):
            return exc
        if isinstance(exc, openai.APIStatusError):
            phrase = getattr(exc.response, "reason_phrase", "") or ""
            head = f"The model server answered {exc.status_code} {phrase}".rstrip()
            detail = _detail(exc.body)
            return ModelError(f"{head}: {detail}" if detail else f"{head}.")
        if isinstance(exc, openai.APITimeoutError):
            return ModelError("The model server did not answer in time.")
        if isinstance(exc, openai.APIConnectionError):
            if _cannot_connect(exc):
                why = "connection refused" if _in_chain(exc, ConnectionRefusedError) else \
                    "cannot connect"
                return ModelError(f"The model server cannot be reached ({why}).")
            return ModelError("The connection to the model server was lost"
                              f"{' mid-answer' if self.received else ''}.")
        if isinstance(exc, openai.APIError):  # an error event in the stream
            detail = _detail(exc.body) or _clean(exc.message)
            return ModelError(f"The model server reported an error: {detail}"
                              if detail else "The model server reported an error.")
        log.info("%r: unreadable chunk: %s", self.turn, type(exc).__name__)
        return ModelError("The model server sent a chunk that could not be read.")

    async def _take(self, piece: _Piece) -> None:
        self.received = True
        if piece.usage is not None:
            self.usage = piece.usage
        if piece.reasoning:
            await self.turn.reasoning(piece.reasoning)
            self._reasoning_open = True
        if piece.content:
            await self._commit_reasoning()
            await self.turn.delta(piece.content)
            self._text_open = True
        for index, call_id, name, arguments in piece.calls:
            if index not in self._calls:  # a new call: those before it are complete
                for earlier in sorted(i for i in self._calls if i < index):
                    await self._publish_call(earlier)
            call = self._calls.setdefault(index, _Call())
            call.id = call.id or call_id
            call.name = call.name or name
            if arguments:
                call.arguments.append(arguments)

    async def _finish(self) -> None:
        for index in sorted(self._calls):
            await self._publish_call(index)
        await self._commit_reasoning()
        await self._commit_text()

    async def _commit_reasoning(self) -> None:
        if self._reasoning_open:
            self._reasoning_open = False
            await self.turn.event("reasoning", {})  # commits the reasoning stream's text

    async def _commit_text(self) -> None:
        if self._text_open:
            self._text_open = False
            await self.turn.message()  # commits the streamed answer

    async def _publish_call(self, index: int) -> None:
        call = self._calls.pop(index)
        await self._commit_reasoning()
        await self._commit_text()  # the text the call came after stays before it
        text = "".join(call.arguments)
        args: Any
        try:
            args = json.loads(text) if text.strip() else {}
        except ValueError:
            args = text  # kept as it came: the model's own words
        await call_tool(self.turn, call.name, args, call.id or None)


async def _next(stream: Any) -> Any:
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return _END


async def _close(stream: Any) -> None:
    """Close the response: an unfinished one closes its connection, the server sees it."""
    try:
        async with asyncio.timeout(2):
            await stream.close()
    except Exception as exc:
        log.debug("closing the model stream: %s", type(exc).__name__)


def _read(chunk: Any) -> _Piece:
    """The parts of a ``chat.completion.chunk`` the turn publishes (the first choice's)."""
    if not isinstance(chunk, ChatCompletionChunk):
        raise ModelError("The model server sent a chunk that could not be read.")
    try:
        piece = _Piece()
        usage = chunk.usage
        if usage is not None:
            piece.usage = (usage.model_dump(mode="json", exclude_none=True)
                           if hasattr(usage, "model_dump") else dict(usage))
        for choice in chunk.choices or ():
            if (choice.index or 0) != 0 or choice.delta is None:
                continue
            delta = choice.delta
            for name in ("reasoning_content", "reasoning"):
                value = getattr(delta, name, None)
                if isinstance(value, str) and value:
                    piece.reasoning += value
                    break
            for text in (delta.content, getattr(delta, "refusal", None)):
                if isinstance(text, str):
                    piece.content += text  # a refusal is the answer a person reads
            for n, call in enumerate(delta.tool_calls or ()):
                index = call.index if isinstance(call.index, int) else n
                function = call.function
                piece.calls.append((index, call.id or "",
                                    (function.name if function else None) or "",
                                    (function.arguments if function else None) or ""))
        return piece
    except (AttributeError, TypeError, ValueError):
        raise ModelError("The model server sent a chunk that could not be read.") from None


def _detail(body: object) -> str:
    """The server's own error message in an error body (OpenAI's ``{"error": {"message"}}``,
    FastAPI's ``{"detail"}``, plain text), cleaned and cut; "" when it has none."""
    if isinstance(body, Mapping):
        for key in ("message", "detail", "error", "msg"):
            value = body.get(key)
            if isinstance(value, Mapping):
                return _detail(value)
            if isinstance(value, str) and value.strip():
                return _clean(value)
        return ""
    if isinstance(body, str) and not body.lstrip().startswith("<"):  # an HTML page: no
        return _clean(body)
    return ""


def _clean(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= DETAIL_MAX else text[:DETAIL_MAX - 1].rstrip() + "…"


def _in_chain(exc: BaseException, kind: type[BaseException]) -> bool:
    seen: BaseException | None = exc
    for _ in range(10):
        if seen is None:
            return False
        if isinstance(seen, kind):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _cannot_connect(exc: BaseException) -> bool:
    """Whether ``exc`` failed making the connection (nothing was sent), not later."""
    seen: BaseException | None = exc
    for _ in range(10):
        if seen is None:
            return False
        if type(seen).__name__ == "ConnectError" or isinstance(seen, ConnectionRefusedError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _display_url(url: str) -> str:
    """``url`` with no user, password or query: fit for a message."""
    with contextlib.suppress(ValueError):
        parts = urlsplit(url)
        host = parts.hostname or ""
        if ":" in host:
            host = f"[{host}]"  # IPv6
        if parts.port:
            host = f"{host}:{parts.port}"
        return urlunsplit((parts.scheme, host, parts.path.rstrip("/"), "", ""))
    return "the configured address"
