"""Agent workers: read the agent inbox, run a handler per turn, publish its events.

Every accepted ``message`` appends an entry to the inbox (a Redis Stream) of its chat's
partition (``inbox:{<tag>}``, see :mod:`gateway.redis.agent_inbox`); a ``cancel`` appends a
``kind=cancel`` entry to the same inbox. An :class:`AgentWorker` reads every partition
through a consumer group, so any number of workers (in any number of processes) share the
work, and runs the user's handler for each ``message``::

    async def handle(turn: Turn) -> None:
        await turn.delta("Hel")
        await turn.delta("lo")
        await turn.message()      # commits the streamed "Hello" as the durable message
        await turn.end()          # optional: the worker ends the turn if the handler did not

Streaming: ``delta``/``reasoning`` pieces form a resumable stream on the gateway (a client
that reconnects mid-answer gets the text so far, then the rest). They are coalesced over
``delta_window_ms`` (25 ms by default): a model emitting 150 tokens a second costs at most
40 publishes a second per answer. A durable event flushes them first, so order holds.

Delivery is at least once. An entry is XACKed only after its handler finished (and the turn
was ended); entries a crashed worker left pending are taken over with XAUTOCLAIM once idle
for ``claim_idle`` seconds, and a running worker keeps its own entries fresh so they are not
taken from it. A redelivered turn runs the handler again, but every durable event a
:class:`Turn` publishes carries an idempotency key derived from the turn (its id, the event
type and how many events of that type the turn published before), so the conversation gets
each durable event once. A turn that already ended (its ``turn_end`` went out before the
crash, or the gateway timed it out) is not handled again. A worker that restarts under its
old ``consumer`` name runs the entries it still owns at once, without waiting for
``claim_idle`` (see :func:`stable_consumer`).

On a Redis Cluster every partition is in a slot of its own, so the worker reads each
partition with its own blocking call; on a single server one call reads them all.

Cancellation is cooperative: ``turn.cancelled`` becomes true and ``turn.cancel_event`` is
set; the handler should stop and return (the worker then ends the turn with
``reason: cancelled``). A cancel entry is delivered through the group to *one* worker, which
may not be the one running the turn, so every worker also tails the inbox for cancels, and a
turn that starts (or restarts) checks its conversation for a ``cancel_requested`` event.
Every publish names its turn, so a handler that writes on after its turn ended (it ignored
the cancel, or a tree operation with ``cancel: true`` or the turn timeout ended it) gets
:class:`TurnOver` from that call, and nothing lands in the turn that runs now.

Publishing goes straight to Redis through :meth:`Store.publish` (the gateway's own Lua
script): no HTTP hop, and the events reach every gateway process's subscribers at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import multiprocessing
import os
import secrets
import signal
import socket
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import msgspec
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError, ResponseError

from .. import tools
from ..config import Settings
from ..errors import Rejected
from ..events import PublishEvent, clean_title, to_out_event
from ..protocol import ClientTool
from ..redis.agent_inbox import AgentInbox
from ..redis.agent_registry import RENEW_EVERY, AgentKind, AgentRegistry
from ..redis.backend import Backend, Client
from ..redis.presence import PresenceStore, agent_entry
from ..redis.records import Meta, OutEvent, Published
from ..redis.store import Store
from .context import Message, messages_of, window

log = logging.getLogger("gateway.agent")

Handler = Callable[["Turn"], Awaitable[None]]

_decode_json = msgspec.json.decode
# Rejections of turn_end meaning "this turn is already over": not an error on redelivery.
TURN_OVER = frozenset({"no_active_turn", "turn_mismatch", "not_found"})
UI_SUMMARY_MAX = 120
CANCEL_SCAN = 500  # durable events after turn_start searched for an early cancel_requested


class TurnOver(Rejected):
    """The turn ended while its handler still wrote (a cancel, an edit or retry with
    ``cancel: true``, the turn timeout): the gateway refused the event rather than file it
    under the turn that runs now. ``code`` is ``no_active_turn`` or ``turn_mismatch``. The
    handler should stop; the worker takes this as the turn's end, not as a failure."""


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _fields(raw: Any) -> dict[str, str]:
    return {_text(k): _text(v) for k, v in (raw or {}).items()}


def _xread_replies(reply: Any) -> Iterable[tuple[str, list[Any]]]:
    """XREAD/XREADGROUP replies as (key, entries), for RESP2 lists and RESP3 maps."""
    if not reply:
        return []
    if isinstance(reply, dict):
        return [(_text(k), v[0] if v and isinstance(v[0], list) else v)
                for k, v in reply.items()]
    return [(_text(key), entries) for key, entries in reply]


class Turn:
    """One turn of one conversation, as a handler sees it, with the calls to answer it."""

    def __init__(self, store: Store, fields: dict[str, str], *, entry_id: str = "",
                 redelivered: bool = False, delta_window_ms: float = 25.0) -> None:
        self.store = store
        self.chat_id = fields.get("chat_id", "")
        self.turn_id = fields.get("turn_id", "")
        self.text = fields.get("text", "")
        self.user_id = fields.get("user_id", "")
        self.client_msg_id = fields.get("client_msg_id", "")
        raw_data = fields.get("data", "")
        self.data: Any = _decode_json(raw_data) if raw_data else None
        self.seq = int(fields.get("seq") or 0)  # the user_message's seq
        self.started_at = int(fields.get("started_at") or 0)  # ms, server time
        self.entry_id = entry_id
        # True when this entry was taken over from another (presumably crashed) worker.
        self.redelivered = redelivered
        # The conversation's state when the turn started (title, goal, ...).
        self.meta: Meta | None = None
        self.cancel_event = asyncio.Event()
        self.ended = False
        self._counts: dict[str, int] = {}
        # This run of the turn: a redelivered turn streams under a new attempt, and the
        # gateway discards the old attempt's partial answer on every device first.
        self.attempt = secrets.token_hex(6)
        self._window = max(0.0, delta_window_ms / 1000)
        self._pending: dict[str, list[str]] = {}  # streamed type -> pieces not yet sent
        self._flusher: asyncio.Task[None] | None = None
        self._stream_error: Rejected | None = None
        self._publishing = asyncio.Lock()  # one publish at a time: order is the handler's

    def __repr__(self) -> str:
        return f"<Turn {self.chat_id} {self.turn_id}>"

    @property
    def state(self) -> Any:
        """The conversation's agent state when the turn started (the last ``state``
        event's snapshot), or None."""
        if self.meta is None or not self.meta.state:
            return None
        return _decode_json(self.meta.state)

    @property
    def cancelled(self) -> bool:
        return self.cancel_event.is_set()

    def cancel(self) -> None:
        """Mark the turn cancelled (the worker does this when the user cancels)."""
        self.cancel_event.set()

    async def sleep(self, seconds: float) -> bool:
        """Sleep up to ``seconds``, waking early on cancel; returns whether it was cancelled."""
        if not self.cancelled:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.cancel_event.wait(), seconds)
        return self.cancelled

    def _key(self, type_: str) -> str:
        """Idempotency key of the next durable event of ``type_`` in this turn."""
        n = self._counts.get(type_, 0)
        self._counts[type_] = n + 1
        return f"agent:{self.turn_id}:{type_}:{n}"

    async def event(self, type: str, data: dict[str, Any] | None = None, durable: bool = True,
                    *, key: str | None = None) -> Published:
        """Publish one event. Durable events are deduplicated per turn (see module doc);
        ``key`` replaces the derived per-turn suffix when the handler has a better one.
        Streamed pieces still waiting for their window go out first.

        Raises :class:`Rejected` when refused; for the event itself before anything is
        sent: ``invalid_request`` (a field of the wrong type), ``reserved_type``, or
        ``unprocessable`` (``data`` that both wire formats cannot carry: an integer outside
        -2**63 .. 2**64 - 1); :class:`TurnOver` once the turn has ended."""
        try:
            event = msgspec.convert({"type": type, "data": data or {}, "durable": durable,
                                     "attempt": self.attempt},
                                    PublishEvent)
        except msgspec.ValidationError as exc:
            raise Rejected("invalid_request", f"{type}: {exc}") from None
        out = to_out_event(event)  # refused here: no key taken, nothing flushed or stored
        idem = None
        if durable:
            idem = f"agent:{self.turn_id}:{key}" if key is not None else self._key(type)
        await self.flush()
        async with self._publishing:
            return await self._publish([out], idem)

    async def _publish(self, events: list[OutEvent], idem: str | None = None) -> Published:
        """Every publish of the turn names it, so none lands in a later turn."""
        try:
            return await self.store.publish(self.chat_id, events, idempotency_key=idem,
                                            turn=self.turn_id)
        except Rejected as exc:
            if exc.code not in ("no_active_turn", "turn_mismatch"):
                raise
            self.cancel_event.set()  # over: a handler that looks stops here
            raise TurnOver(exc.code, exc.message) from None

    async def delta(self, text: str) -> None:
        """A piece of the answer as it streams (``delta``, resumable while the turn runs)."""
        await self._stream("delta", text)

    async def reasoning(self, text: str) -> None:
        """A piece of visible reasoning (``reasoning_delta``)."""
        await self._stream("reasoning_delta", text)

    async def history(self, max_messages: int = 120, max_tokens: int = 0) -> list[Message]:
        """The conversation so far, as chat messages (:mod:`gateway.sdk.context`): the path
        from the first message to this turn's, the edited text where a message was
        edited; a retried turn sees what the turn it replaces saw. ``max_messages`` and
        ``max_tokens`` (0: none) bound it from the tail, starting at a user message."""
        events: list[dict[str, Any]] = []
        after = 0
        while True:
            page = await self.store.active_path(self.chat_id, after, 1000, tip=self.turn_id)
            if page is None:
                break
            events += [e for e in map(_decode_json, page.events)
                       if e.get("node") != self.turn_id]
            if not page.events or page.scanned >= page.meta.seq:
                break
            after = page.scanned
        return window(messages_of(events), max_messages, max_tokens)

    async def message(self, text: str | None = None, **data: Any) -> Published:
        """The agent's complete message (durable ``message``, ``{text, **data}``). With no
        ``text`` it commits what was streamed with :meth:`delta`, so the answer is not sent
        twice."""
        return await self.event("message", data if text is None else {"text": text, **data})

    async def _stream(self, kind: str, text: str) -> None:
        self._raise_stream_error()
        self._pending.setdefault(kind, []).append(text)
        if self._window == 0:
            await self.flush()
        elif self._flusher is None:
            self._flusher = asyncio.create_task(self._flush_later())

    async def _flush_later(self) -> None:
        await asyncio.sleep(self._window)
        self._flusher = None
        try:
            await self.flush()
        except Rejected as exc:  # kept, and raised by the handler's next call
            self._stream_error = exc
        except (RedisError, OSError) as exc:
            log.warning("%r: streaming failed: %s", self, exc)

    async def flush(self) -> None:
        """Send the streamed pieces waiting for their window now: one publish, one
        position per type. Raises ``Rejected("stream_too_large")`` past
        ``GATEWAY_STREAM_MAX_BYTES`` (what was streamed before stays exact)."""
        async with self._publishing:
            if not self._pending:
                return
            pending, self._pending = self._pending, {}
            events = [to_out_event(PublishEvent(kind, {"text": "".join(pieces)}, False,
                                                None, self.attempt))
                      for kind, pieces in pending.items()]
            await self._publish(events)

    def _raise_stream_error(self) -> None:
        if self._stream_error is not None:
            error, self._stream_error = self._stream_error, None
            raise error

    async def tool_call(self, name: str, args: Any, call_id: str | None = None) -> str:
        """Announce a tool call (durable ``tool_call``); returns its ``call_id``."""
        if call_id is None:
            call_id = f"call_{self.turn_id}_{self._counts.get('tool_call', 0)}"
        await self.event("tool_call", {"call_id": call_id, "name": name, "args": args})
        return call_id

    async def tool_result(self, call_id: str, result: Any) -> Published:
        return await self.event("tool_result", {"call_id": call_id, "result": result})

    async def ask(self, name: str, args: Any, call_id: str | None = None) -> str:
        """Ask a person: call the conversation's client tool ``name`` (``PATCH
        /v1/conversations/{id}`` declares them) with ``args``, and end the turn with
        ``reason: awaiting_input``. Every device shows the question; the first answer
        becomes a ``tool_result`` and starts a new turn, whose :meth:`history` ends with
        it. Returns the call's id; the handler should return after it.

        Raises :class:`Rejected` (``invalid_request``) when ``name`` is not a client tool
        of the conversation or ``args`` do not fit its ``parameters`` schema."""
        tool = tools.find(self.meta.tools if self.meta else None, name)
        if tool is None:
            raise Rejected("invalid_request", f"{name} is not a client tool of this "
                           "conversation")
        tools.check_args(tool, args)
        if call_id is None:
            call_id = f"call_{self.turn_id}_{self._counts.get('tool_call', 0)}"
        await self.event("tool_call", {"call_id": call_id, "name": name, "args": args,
                                       "awaiting": True})
        await self.end(reason="awaiting_input")
        return call_id

    @property
    def client_tools(self) -> list[ClientTool]:
        """The tools this turn's agent may call to ask a person (:meth:`ask`)."""
        return tools.declared(self.meta.tools if self.meta else None)

    async def goal_state(self, active: bool, objective: str = "", ui_summary: str = "",
                         recap: str | None = None, status: str | None = None) -> Published:
        """Set the conversation's goal; ``status`` defaults to active/complete.
        ``ui_summary`` is cut to 120 characters."""
        if len(ui_summary) > UI_SUMMARY_MAX:
            ui_summary = ui_summary[:UI_SUMMARY_MAX - 1].rstrip() + "…"
        data: dict[str, Any] = {
            "active": active, "status": status or ("active" if active else "complete"),
            "objective": objective, "ui_summary": ui_summary, "recap": recap,
        }
        return await self.event("goal_state", data)

    async def title(self, title: str) -> Published:
        return await self.event("title", {"title": title})

    async def open_child(self, title: str | None = None, agent: str | None = None) -> str:
        """Open a sub-conversation of this one (a sub-task), owned by its owner, answered
        by ``agent`` (by default this conversation's: name another to hand it the
        sub-task); the conversation gets a durable ``child`` event. Returns its chat id.

        The id comes from the turn and how many children it opened before, so a
        redelivered turn opening its children again gets the same ones, each once.
        """
        n = self._counts.get("<child>", 0)
        self._counts["<child>"] = n + 1
        chat_id = f"{self.turn_id}.c{n}"
        clean = clean_title(title) if title is not None else None
        await self.store.open_child(self.chat_id, chat_id, clean, title_source="agent",
                                    existing_ok=True, agent=agent or "")
        return chat_id

    async def end(self, usage: dict[str, Any] | None = None, reason: str = "complete",
                  error: str | None = None) -> Published | None:
        """End this turn (``turn_end``, only if it is still the running one).

        ``usage`` is what the turn cost: your provider's usage object as it comes, or
        numbers by name, usually ``input_tokens``, ``output_tokens``, ``cached_tokens`` and
        ``cost`` (in your currency). Its numbers are counted (nested ones under a dotted
        name), the rest dropped, and summed into the conversation's totals (protocol.md,
        "Usage"); a turn
        that ended without its agent (cancelled by a tree operation, timed out) still has its
        usage counted, once.

        ``error``: with ``reason="error"``, what went wrong in words a person can read
        (``turn_end.data.error``; the page shows it). A cancelled turn ends with
        ``reason: cancelled``. Returns None when the turn was
        already over (ended before a redelivery, timed out, conversation deleted).
        """
        if self.ended:
            return None
        with contextlib.suppress(Rejected):  # a refused delta must not keep the turn open
            self._raise_stream_error()
            await self.flush()
        if reason == "complete" and self.cancelled:
            reason = "cancelled"
        data: dict[str, Any] = {"reason": reason, "turn_id": self.turn_id}
        if usage is not None:
            data["usage"] = usage
        if error is not None:
            data["error"] = error
        try:
            result = await self.event("turn_end", data, key="turn_end")
        except Rejected as exc:
            if exc.code not in TURN_OVER:
                raise
            log.info("%r was already over: %s", self, exc.message)
            self.ended = True
            return None
        self.ended = True
        with contextlib.suppress(RedisError, OSError):
            await AgentInbox(self.store).untrack_turn(self.chat_id, self.turn_id)
        return result


class _Entry:
    __slots__ = ("fields", "id", "key", "redelivered")

    def __init__(self, key: str, entry_id: str, fields: dict[str, str],
                 redelivered: bool) -> None:
        self.key = key  # the inbox partition it came from
        self.id = entry_id
        self.fields = fields
        self.redelivered = redelivered


class AgentWorker:
    """Runs ``handler`` for every inbox message delivered to this worker's consumer group.

    - ``name``: the agent it answers for (default ``GATEWAY_DEFAULT_AGENT``): it reads only
      the inboxes of conversations that name this agent, and announces itself as a live
      worker of it (``GET /v1/agents``), of ``kind`` ``handler``, ``ag-ui`` or ``openai``.
    - ``group``: workers with the same group share the work; another group gets every
      entry again.
    - ``concurrency``: handlers running at once; one chat's turns always run in order.
    - ``claim_idle``: seconds an entry may stay unacknowledged with no sign of life before
      another worker takes it over. Use the same value for every worker of a group.
    - ``start_id``: where a new group starts: ``"0"`` (everything still in the inbox) or
      ``"$"`` (only entries added from now on).
    - ``accept``: optional chat filter; entries of other chats are acknowledged unhandled.
    - ``delta_window_ms``: streamed pieces are coalesced over this window (default
      ``GATEWAY_DELTA_WINDOW_MS``, 25); 0 sends each piece at once.
    """

    def __init__(self, redis: Client, settings: Settings, handler: Handler, *,
                 group: str = "agents", consumer: str | None = None, concurrency: int = 16,
                 claim_idle: float = 30.0, start_id: str = "0", block: float = 2.0,
                 accept: Callable[[str], bool] | None = None,
                 delta_window_ms: float | None = None, name: str | None = None,
                 kind: AgentKind = "handler") -> None:
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        if claim_idle <= 0:
            raise ValueError("claim_idle must be positive")
        self.redis = redis
        self.settings = settings
        self.store = Store(Backend.of(redis, settings), settings)
        self.handler = handler
        self.group = group
        self.consumer = consumer or (
            f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}")
        self.concurrency = concurrency
        self.claim_idle = claim_idle
        self.start_id = start_id
        # A blocking read must return before the client's socket timeout (redis-py >= 6
        # defaults to 5 s) or it fails as a timeout.
        socket_timeout = redis.get_connection_kwargs().get("socket_timeout")
        if socket_timeout:
            block = min(block, socket_timeout / 2)
        self._block_ms = max(10, int(block * 1000))
        self.accept = accept
        self.delta_window_ms = (settings.delta_window_ms if delta_window_ms is None
                                else delta_window_ms)
        self.name = name or settings.default_agent
        self.kind: AgentKind = kind
        self.registry = AgentRegistry(self.store.pipeline)
        # While it runs a turn, the worker is in the conversation's presence list.
        self.presence = PresenceStore(self.store.pipeline, settings.presence_ttl)
        self._present: set[str] = set()  # chats this worker runs a turn in now
        self.keys = AgentInbox(self.store).keys(self.name)
        # Keys one call may name together: all of them on one server; on a cluster, where
        # each partition has a slot of its own, one each.
        self._cluster = isinstance(redis, RedisCluster)
        self._key_groups = self._grouped(self.keys)
        self.stats = {"handled": 0, "failed": 0, "skipped": 0, "reclaimed": 0, "cancels": 0,
                      "resumed": 0}
        self._slots = asyncio.Semaphore(concurrency)
        self._inflight: dict[tuple[str, str], _Entry] = {}  # read, not yet acked
        self._freed = asyncio.Event()
        self._chains: dict[str, asyncio.Task[None]] = {}  # chat -> its latest entry's task
        self._tasks: set[asyncio.Task[None]] = set()  # entry tasks
        self._turns: dict[tuple[str, str], Turn] = {}  # (chat, turn) -> running turn
        self._loops: list[asyncio.Task[None]] = []
        self._stopped = asyncio.Event()
        self._stop_task: asyncio.Task[None] | None = None
        self._closing = False
        self._started = False
        self.error: BaseException | None = None  # why a loop died, if one did

    # --- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        """Create the group where missing and start reading. Returns once reading."""
        if self._started:
            return
        self._started = True
        await self._create_groups()
        await self.registry.announce(self.name, self.kind, self.consumer)
        tails = await self._inbox_tails()  # before any turn runs, so no cancel is missed
        await self._resume_own()
        self._loops = [asyncio.create_task(self._maintain(), name=f"agent-claim-{self.consumer}"),
                       asyncio.create_task(self._renew_presence(),
                                           name=f"agent-presence-{self.consumer}")]
        for n, keys in enumerate(self._key_groups):
            self._loops += [
                asyncio.create_task(self._read_loop(keys), name=f"agent-read-{self.consumer}-{n}"),
                asyncio.create_task(self._watch_cancels({key: tails[key] for key in keys}),
                                    name=f"agent-cancels-{self.consumer}-{n}"),
            ]
        for task in self._loops:
            task.add_done_callback(self._loop_done)
        log.info("agent worker %s of agent %s reading %d inbox partitions (group %s)",
                 self.consumer, self.name, len(self.keys), self.group)

    async def run(self) -> None:
        """Start, then run until :meth:`stop`."""
        await self.start()
        await self._stopped.wait()

    def request_stop(self, grace: float = 10.0) -> None:
        """Begin :meth:`stop` without waiting for it (for signal handlers)."""
        if self._stop_task is None:
            self._stop_task = asyncio.create_task(self._stop(grace))

    async def stop(self, grace: float = 10.0) -> None:
        """Stop reading; let running handlers finish for up to ``grace`` seconds.

        Handlers still running then are cancelled: their entries stay pending and another
        worker takes them over after ``claim_idle``.
        """
        self.request_stop(grace)
        assert self._stop_task is not None
        await asyncio.shield(self._stop_task)

    async def _stop(self, grace: float) -> None:
        self._closing = True
        await _cancel_and_wait(self._loops, every=0.05)
        if self._tasks:
            _, pending = await asyncio.wait(set(self._tasks), timeout=grace)
            await _cancel_and_wait(pending, every=0.5)
        if self._started:
            with contextlib.suppress(RedisError, OSError):
                await self.registry.withdraw(self.name, self.kind, self.consumer)
                await self._forget_consumer()
        self._stopped.set()
        log.info("agent worker %s stopped", self.consumer)

    def _loop_done(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            self.error = task.exception()
            log.error("agent worker %s: %s stopped", self.consumer, task.get_name(),
                      exc_info=self.error)
            self.request_stop()

    def _grouped(self, keys: list[str]) -> list[list[str]]:
        """``keys`` in groups one call may name together (one group, or one per key)."""
        if not keys:
            return []
        return [[key] for key in keys] if self._cluster else [keys]

    async def _pipelined(self, keys: list[str], add: Callable[[Any, str], object], *,
                         raise_on_error: bool = True) -> list[Any]:
        """``add(pipe, key)`` for every key, one pipeline per key group; the replies in
        ``keys``' order."""
        replies: list[Any] = []
        for group in self._grouped(keys):
            async with self.redis.pipeline(transaction=False) as pipe:
                for key in group:
                    add(pipe, key)
                replies += await pipe.execute(raise_on_error=raise_on_error)
        return replies

    async def _forget_consumer(self) -> None:
        """Remove this consumer from the group unless it still owns pending entries."""
        pending = await self._pipelined(
            self.keys, lambda pipe, key: pipe.xpending_range(
                key, self.group, min="-", max="+", count=1, consumername=self.consumer),
            raise_on_error=False)
        done = [key for key, rows in zip(self.keys, pending, strict=True)
                if isinstance(rows, list) and not rows]
        await self._pipelined(
            done, lambda pipe, key: pipe.xgroup_delconsumer(key, self.group, self.consumer),
            raise_on_error=False)

    async def _create_groups(self) -> None:
        for key in self.keys:
            try:
                await self.redis.xgroup_create(key, self.group, id=self.start_id, mkstream=True)
            except ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    async def _inbox_tails(self) -> dict[str, str]:
        last = await self._pipelined(self.keys, lambda pipe, key: pipe.xrevrange(key, count=1))
        return {key: _text(rows[0][0]) if rows else "0-0"
                for key, rows in zip(self.keys, last, strict=True)}

    # --- reading -----------------------------------------------------------------------

    async def _wait_capacity(self) -> None:
        while len(self._inflight) >= self.concurrency:
            self._freed.clear()
            await self._freed.wait()

    async def _resume_own(self) -> None:
        """Run the entries this consumer was given and never acknowledged, as redelivered:
        a worker restarted under its old name resumes its turns at once instead of waiting
        for a takeover after ``claim_idle``. Usually one empty read per key group."""
        for keys in self._key_groups:
            after: dict[Any, Any] = dict.fromkeys(keys, "0")
            while after:
                try:
                    reply = await self.redis.xreadgroup(self.group, self.consumer, after,
                                                        count=self.concurrency)
                except (RedisError, OSError) as exc:
                    log.warning("reading our pending entries: %s; left to a takeover", exc)
                    return
                got = dict(_xread_replies(reply))
                for key in list(after):
                    entries = got.get(key) or []
                    for entry_id, raw in entries:
                        self.stats["resumed"] += 1
                        log.info("resuming inbox entry %s of %s", _text(entry_id), key)
                        await self._dispatch(_Entry(key, _text(entry_id), _fields(raw), True))
                    if len(entries) < self.concurrency:
                        del after[key]  # that was the last page
                    else:
                        after[key] = _text(entries[-1][0])

    async def _read_loop(self, keys: list[str]) -> None:
        streams: dict[Any, Any] = {key: ">" for key in keys}
        backoff = 0.1
        while not self._closing:
            await self._wait_capacity()
            free = self.concurrency - len(self._inflight)
            # COUNT is per key: the total may pass ``free`` by at most one per partition.
            count = max(1, free // len(self.keys))
            try:
                reply = await self.redis.xreadgroup(self.group, self.consumer, streams,
                                                    count=count, block=self._block_ms)
            except ResponseError as exc:
                if "NOGROUP" not in str(exc):
                    raise
                log.warning("inbox group %s is gone; creating it again", self.group)
                with contextlib.suppress(RedisError, OSError):
                    await self._create_groups()
                continue
            except (RedisError, OSError) as exc:
                log.warning("reading the inbox: %s; retrying in %.1fs", exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            backoff = 0.1
            for key, entries in _xread_replies(reply):
                for entry_id, raw in entries:
                    await self._dispatch(_Entry(key, _text(entry_id), _fields(raw), False))

    async def _dispatch(self, entry: _Entry) -> None:
        key = (entry.key, entry.id)
        if key in self._inflight:
            return  # already ours and running (reclaimed while we still had it)
        kind = entry.fields.get("kind")
        chat_id = entry.fields.get("chat_id", "")
        if kind == "cancel":
            self.stats["cancels"] += 1
            self._mark_cancelled(chat_id, entry.fields.get("turn_id", ""))
            try:
                await self.redis.xack(entry.key, self.group, entry.id)
            except (RedisError, OSError) as exc:
                log.warning("acknowledging cancel %s: %s", entry.id, exc)
            return
        if kind != "message" or not chat_id:
            log.warning("ignoring inbox entry %s of kind %r", entry.id, kind)
            with contextlib.suppress(RedisError, OSError):
                await self.redis.xack(entry.key, self.group, entry.id)
            return
        self._inflight[key] = entry
        previous = self._chains.get(chat_id)
        task = asyncio.create_task(self._run(entry, previous))
        self._chains[chat_id] = task
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _mark_cancelled(self, chat_id: str, turn_id: str) -> None:
        turn = self._turns.get((chat_id, turn_id))
        if turn is not None and not turn.cancelled:
            log.info("%r cancelled", turn)
            turn.cancel()

    async def _watch_cancels(self, last: dict[str, str]) -> None:
        """Tail every partition (outside the group) for cancels of turns running here."""
        backoff = 0.1
        while not self._closing:
            try:
                reply = await self.redis.xread(last, count=500,  # type: ignore[arg-type]
                                               block=self._block_ms)
            except (RedisError, OSError) as exc:
                log.warning("watching for cancels: %s; retrying in %.1fs", exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            backoff = 0.1
            for key, entries in _xread_replies(reply):
                for entry_id, raw in entries:
                    last[key] = _text(entry_id)
                    fields = _fields(raw)
                    if fields.get("kind") == "cancel":
                        self._mark_cancelled(fields.get("chat_id", ""),
                                             fields.get("turn_id", ""))

    # --- liveness and takeover -----------------------------------------------------------

    async def _maintain(self) -> None:
        """Keep our pending entries fresh; take over entries idle past ``claim_idle``; say
        we are alive."""
        interval = max(0.05, min(self.claim_idle / 3, RENEW_EVERY))
        cursors = dict.fromkeys(self.keys, "0-0")
        while not self._closing:
            await asyncio.sleep(interval)
            try:
                await self.registry.announce(self.name, self.kind, self.consumer)
                await self._heartbeat()
                await self._reclaim(cursors)
            except (RedisError, OSError) as exc:
                log.warning("inbox maintenance: %s", exc)

    async def _renew_presence(self) -> None:
        """Renew this worker's presence in the chats it runs a turn in, every third of
        ``GATEWAY_PRESENCE_TTL``: a worker that dies leaves their lists within the TTL."""
        while not self._closing:
            await asyncio.sleep(self.settings.presence_ttl / 3)
            entry = agent_entry(self.name, self.consumer)
            for chat_id in list(self._present):
                try:
                    await self.presence.change(chat_id, add=[entry])
                except (RedisError, OSError) as exc:
                    log.warning("renewing presence in %s: %s", chat_id, exc)

    async def _announce(self, chat_id: str, present: bool) -> None:
        """This worker is in the chat's presence list while it runs a turn there; the
        room is told at once (a failure only costs the list, never the turn)."""
        entry = agent_entry(self.name, self.consumer)
        if present:
            self._present.add(chat_id)
        else:
            self._present.discard(chat_id)
        try:
            await self.presence.change(chat_id, *(([entry], []) if present else ([], [entry])))
        except (RedisError, OSError) as exc:
            log.warning("presence in %s: %s", chat_id, exc)

    async def _heartbeat(self) -> None:
        """XCLAIM our own in-flight entries (JUSTID: the delivery count stays) to reset
        their idle time, so a long turn is not taken over while it runs."""
        by_key: dict[str, list[str]] = {}
        for key, entry_id in list(self._inflight):
            by_key.setdefault(key, []).append(entry_id)
        await self._pipelined(list(by_key), lambda pipe, key: pipe.xclaim(
            key, self.group, self.consumer, 0, by_key[key], justid=True))

    async def _reclaim(self, cursors: dict[str, str]) -> None:
        idle_ms = int(self.claim_idle * 1000)
        for key in self.keys:
            free = self.concurrency - len(self._inflight)
            if free <= 0:
                return
            reply = await self.redis.xautoclaim(key, self.group, self.consumer, idle_ms,
                                                start_id=cursors[key], count=free)
            cursors[key] = _text(reply[0])
            for entry_id, raw in reply[1]:
                if entry_id is None or raw is None:
                    continue  # deleted from the stream while pending (older servers)
                entry = _Entry(key, _text(entry_id), _fields(raw), True)
                if (key, entry.id) not in self._inflight:
                    self.stats["reclaimed"] += 1
                    log.info("taking over inbox entry %s of %s", entry.id, key)
                await self._dispatch(entry)

    # --- running a turn ------------------------------------------------------------------

    async def _run(self, entry: _Entry, previous: asyncio.Task[None] | None) -> None:
        chat_id = entry.fields["chat_id"]
        try:
            if previous is not None:
                await asyncio.wait([previous])  # this chat's earlier turn first
            async with self._slots:
                await self._handle(entry)
        except (RedisError, OSError) as exc:
            # Left pending: retried after claim_idle (durable events are deduplicated).
            log.warning("turn from inbox entry %s failed on Redis: %s", entry.id, exc)
        except Exception:
            log.exception("turn from inbox entry %s failed", entry.id)
        finally:
            self._inflight.pop((entry.key, entry.id), None)
            self._freed.set()
            if self._chains.get(chat_id) is asyncio.current_task():
                del self._chains[chat_id]

    async def _handle(self, entry: _Entry) -> None:
        fields = entry.fields
        turn = Turn(self.store, fields, entry_id=entry.id, redelivered=entry.redelivered,
                    delta_window_ms=self.delta_window_ms)
        if not turn.turn_id or (self.accept is not None and not self.accept(turn.chat_id)):
            await self.redis.xack(entry.key, self.group, entry.id)
            return
        ident = (turn.chat_id, turn.turn_id)
        self._turns[ident] = turn  # from now on the cancel watcher can reach it
        try:
            history = await self.store.read(turn.chat_id, after=turn.seq, limit=CANCEL_SCAN)
            meta = history.meta
            if meta is None or meta.status != "running" or meta.turn_id != turn.turn_id:
                # Ended already: a redelivery after turn_end, a timeout, a deleted chat.
                self.stats["skipped"] += 1
                log.info("%r is no longer running; acknowledging it unhandled", turn)
                await self.redis.xack(entry.key, self.group, entry.id)
                return
            turn.meta = meta
            if _cancel_requested(history.frames, turn.turn_id):
                turn.cancel()
            failed: str | None = None
            await self._announce(turn.chat_id, True)
            try:
                await self.handler(turn)
            except TurnOver as exc:
                log.info("%r ended while its handler wrote: %s", turn, exc.message)
            except Exception as exc:
                # The person sees that the agent failed, not its internals.
                failed = f"The agent failed while answering ({type(exc).__name__})."
                self.stats["failed"] += 1
                log.exception("handler failed on %r", turn)
            if not turn.ended:
                error = failed if failed and not turn.cancelled else None
                try:
                    await turn.end(reason="error" if error else "complete", error=error)
                except Rejected as exc:  # nothing a retry would fix
                    log.warning("ending %r: %s %s", turn, exc.code, exc.message)
            await self.redis.xack(entry.key, self.group, entry.id)
            self.stats["handled"] += 1
        finally:
            self._turns.pop(ident, None)
            if turn.chat_id in self._present:
                await self._announce(turn.chat_id, False)


async def _cancel_and_wait(tasks: Iterable[asyncio.Task[None]], every: float,
                           patience: float = 10.0) -> None:
    """Cancel ``tasks`` and wait for them, cancelling again every ``every`` seconds.

    Once is not always enough on Python 3.11: its ``asyncio.wait_for`` (which redis-py
    uses around socket writes) drops a cancel that arrives as the wrapped call completes.
    """
    pending = set(tasks)
    deadline = asyncio.get_running_loop().time() + patience
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=every)
        if pending and asyncio.get_running_loop().time() > deadline:
            log.warning("%d agent tasks did not stop: %s", len(pending), pending)
            return


def _cancel_requested(frames: list[tuple[int, bytes]], turn_id: str) -> bool:
    for _, frame in frames:
        if b'"cancel_requested"' in frame:
            event = _decode_json(frame)
            if event.get("type") == "cancel_requested" and \
                    (event.get("data") or {}).get("turn_id") == turn_id:
                return True
    return False


# --- running one ---------------------------------------------------------------------------


def stable_consumer(port: int) -> str:
    """A consumer name that a gateway process gets again when it restarts: the host, the
    gateway's port and, under ``--workers N``, the worker's number (uvicorn names them
    ``SpawnProcess-<n>``), so live processes never share one. Restarted, the worker finds
    the entries it still owned and resumes them at once."""
    process = multiprocessing.current_process().name
    worker = "" if process == "MainProcess" else "-" + process.rpartition("-")[2]
    return f"{socket.gethostname()}-gateway-{port}{worker}"


def load_handler(spec: str) -> Handler:
    """``"package.module:function"`` -> the handler."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"handler must be given as MODULE:FUNCTION, not {spec!r}")
    target: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        target = getattr(target, part)
    if not callable(target):
        raise ValueError(f"{spec} is not callable")
    handler: Handler = target
    return handler


async def serve(handler: Handler, redis_url: str, settings: Settings, **options: Any) -> int:
    """Run a worker until SIGTERM/SIGINT (``gateway agent``); returns the exit status."""
    # A single server or any node of a cluster, with the gateway's timeouts.
    backend = await Backend.connect(msgspec.structs.replace(settings, redis_url=redis_url))
    worker = AgentWorker(backend.client, settings, handler, **options)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, worker.request_stop)
    try:
        await worker.start()
        print(f"agent ready: {worker.name} ({worker.kind}), consumer {worker.consumer}, "
              f"group {worker.group}, {len(worker.keys)} partitions", flush=True)
        await worker.run()
    finally:
        await worker.stop()
        await backend.aclose()
        closing = getattr(handler, "aclose", None)  # a driver's HTTP client
        if closing is not None:
            await closing()
    return 1 if worker.error is not None else 0
