"""What can be done to a conversation, whoever asks: the WebSocket, the HTTP API, the CLI.

Turns agent- and user-facing requests into validated :class:`OutEvent` batches for the
store, hands each new turn to the agents (:mod:`gateway.redis.agent_inbox`), and runs the
sweeper that ends turns nobody ended and does hand-offs a crashed gateway left undone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from typing import Any

import msgspec
from msgspec import UNSET
from redis.exceptions import RedisError

from . import protocol as p
from . import tools
from .auth import Principal
from .config import Settings
from .errors import Rejected
from .events import PublishEvent, clean_title, now_ms, to_out_event
from .metrics import COUNTS
from .redis.agent_inbox import AgentInbox, Handoff
from .redis.agent_registry import AgentRegistry
from .redis.records import Meta, OutEvent, Published, TreeOp
from .redis.store import NotReplicated, Store

log = logging.getLogger("gateway.conversations")

_encode = msgspec.json.encode
_to_msgpack = msgspec.msgpack.Encoder().encode
PREVIEW_CHARS = 120
SEQ_SCAN = 500  # latest events searched for a stranded turn's turn_start


def _new_msg_id() -> str:
    return "m_" + secrets.token_hex(8)


def _new_turn_id() -> str:
    return "t_" + secrets.token_hex(8)


class Conversations:
    """Conversation operations on top of the store."""

    def __init__(self, store: Store, settings: Settings) -> None:
        self.store = store
        self.settings = settings
        self.inbox = AgentInbox(store)
        self.agents = AgentRegistry(store.pipeline)

    async def post_message(self, who: Principal, req: p.Message) -> p.Ack:
        """Append the user's message under the head and start its turn; a retried
        ``client_msg_id`` is a no-op."""
        msg_id, turn_id = _new_msg_id(), _new_turn_id()
        events = self._message_events(who, req.text, req.client_msg_id, req.data, turn_id)
        handoff = Handoff(req.chat_id, turn_id, who.user_id, req.text, req.client_msg_id,
                          _encode(req.data).decode() if req.data is not None else "")
        op = TreeOp(kind="message", by=who.user_id, expected_head=req.expected_head,
                    cancel=req.cancel, msg_id=msg_id)
        result = await self._start_turn(
            who, req.chat_id, events, op, handoff,
            create_owner=who.user_id if self.settings.auto_create else "",
            idempotency_key=f"m:{who.user_id}:{req.client_msg_id}")
        return p.Ack(req.chat_id, result.seqs[0] if result.seqs else None, req.client_msg_id,
                     result.turn_id, result.duplicate, req.id, head=result.head or None,
                     msg_id=result.msg_id or UNSET)

    async def edit(self, who: Principal, req: p.Edit) -> p.Ack:
        """A new version of a message on the active path, beside it, and its turn."""
        msg_id, turn_id = _new_msg_id(), _new_turn_id()
        client_msg_id = req.client_msg_id or msg_id
        events = self._message_events(who, req.text, client_msg_id, None, turn_id)
        handoff = Handoff(req.chat_id, turn_id, who.user_id, req.text, client_msg_id)
        op = TreeOp(kind="edit", by=who.user_id, expected_head=req.expected_head,
                    cancel=req.cancel, node=req.msg_id, msg_id=msg_id)
        result = await self._start_turn(who, req.chat_id, events, op, handoff)
        return p.Ack(req.chat_id, result.seqs[0], client_msg_id, result.turn_id, False,
                     req.id, head=result.head or None, msg_id=msg_id)

    async def retry(self, who: Principal, req: p.Retry) -> p.Ack:
        """A new answer to the head turn's message, beside it."""
        op = TreeOp(kind="retry", by=who.user_id, expected_head=req.expected_head,
                    cancel=req.cancel)
        turn_id = _new_turn_id()
        result = await self._start_turn(
            who, req.chat_id, [OutEvent(type="turn_start", data=b"{}", turn_id=turn_id)], op,
            None)
        return p.Ack(req.chat_id, result.seqs[0], None, result.turn_id, False, req.id,
                     head=result.head or None)

    async def undo(self, who: Principal, req: p.Undo) -> p.Ack:
        """The head back before the path's last user message; its text comes back."""
        op = TreeOp(kind="undo", by=who.user_id, expected_head=req.expected_head,
                    cancel=req.cancel)
        result = await self._move_head(who, req.chat_id, op)
        taken = result.message
        return p.Ack(req.chat_id, result.last_seq, taken.client_msg_id if taken else None, None,
                     False, req.id, head=result.head or None,
                     msg_id=taken.msg_id if taken else UNSET,
                     text=taken.text if taken else UNSET)

    async def switch(self, who: Principal, req: p.Switch) -> p.Ack:
        """The head to the leaf last active under ``node_id``: another branch, or redo."""
        op = TreeOp(kind="switch", by=who.user_id, expected_head=req.expected_head,
                    cancel=req.cancel, node=req.node_id)
        result = await self._move_head(who, req.chat_id, op)
        return p.Ack(req.chat_id, result.last_seq, None, None, False, req.id,
                     head=result.head or None)

    def _message_events(self, who: Principal, text: str, client_msg_id: str,
                        extra: dict[str, Any] | None, turn_id: str) -> list[OutEvent]:
        if len(text.encode()) > self.settings.max_text_bytes:
            raise Rejected("text_too_long", f"text is over {self.settings.max_text_bytes} bytes")
        data: dict[str, Any] = {"text": text, "client_msg_id": client_msg_id,
                                "user_id": who.user_id}
        if extra is not None:
            data["data"] = extra
        preview = " ".join(text.split())[:PREVIEW_CHARS]
        return [OutEvent(type="user_message", data=_encode(data), preview=preview),
                OutEvent(type="turn_start", data=b"{}", turn_id=turn_id)]

    async def _start_turn(self, who: Principal, chat_id: str, events: list[OutEvent],
                          op: TreeOp, handoff: Handoff | None, *, create_owner: str = "",
                          idempotency_key: str | None = None) -> Published:
        """Publish a batch that starts a turn and hand the turn to the agents.

        The hand-off is staged first when its text is known (a message, an edit): from
        then on a crash cannot lose the turn. A retry learns the message it answers from
        the script, so its hand-off is done after; a gateway dying in between leaves the
        turn to end by its timeout.
        """
        if handoff is not None:
            await self.inbox.stage(handoff)
        not_replicated: NotReplicated | None = None
        try:
            result = await self.store.publish(
                chat_id, events, create_owner=create_owner, idempotency_key=idempotency_key,
                writer=who.writer(), op=op)
        except NotReplicated as exc:  # stored, the turn runs: hand it off, then say so
            assert exc.result is not None
            result, not_replicated = exc.result, exc
        except Rejected:
            if handoff is not None:
                with contextlib.suppress(RedisError, OSError):  # else the sweeper drops it
                    await self.inbox.discard(handoff)
            raise
        if result.duplicate:  # the first attempt's turn, handed off by that attempt
            if handoff is not None:
                with contextlib.suppress(RedisError, OSError):
                    await self.inbox.discard(handoff)
        else:
            await self._cancel_running(who, chat_id, result)
            taken = result.message
            if handoff is None and taken is not None and result.turn_id is not None:
                handoff = Handoff(chat_id, result.turn_id, who.user_id, taken.text,
                                  taken.client_msg_id,
                                  _encode(taken.data).decode() if taken.data is not None else "")
            if handoff is not None:
                first = next((s for s in result.seqs if s is not None), 0)
                seq = taken.seq if taken is not None and op.kind == "retry" else first
                deadline = result.ts + int(self.settings.turn_timeout * 1000)
                try:
                    await self.inbox.hand_off(handoff, seq, result.ts, deadline, result.agent)
                except (RedisError, OSError) as exc:  # the message stands: acknowledge it
                    log.warning("handing off %s %s: %s; the sweeper will", chat_id,
                                handoff.turn_id, exc)
        if not_replicated is not None:
            raise not_replicated
        return result

    async def _move_head(self, who: Principal, chat_id: str, op: TreeOp) -> Published:
        result = await self.store.publish(chat_id, [], writer=who.writer(), op=op)
        await self._cancel_running(who, chat_id, result)
        return result

    async def _cancel_running(self, who: Principal, chat_id: str, result: Published) -> None:
        """A tree operation ended the running turn first: tell its agent to stop."""
        if result.cancelled:
            with contextlib.suppress(RedisError, OSError):  # the turn is over either way
                await self.inbox.to_inbox(chat_id, {
                    "kind": "cancel", "chat_id": chat_id, "turn_id": result.cancelled,
                    "seq": str(result.last_seq), "user_id": who.user_id}, result.agent)

    async def cancel(self, who: Principal, req: p.Cancel) -> p.Ack:
        result = await self.store.publish(
            req.chat_id,
            [OutEvent(type="cancel_requested", data=b"{}", turn_id=req.turn_id or "")],
            writer=who.writer(),
        )
        await self.inbox.to_inbox(req.chat_id, {
            "kind": "cancel", "chat_id": req.chat_id, "turn_id": result.turn_id or "",
            "seq": str(result.seqs[0]), "user_id": who.user_id,
        }, result.agent)
        return p.Ack(req.chat_id, result.seqs[0], None, result.turn_id, False, req.id)

    async def publish(self, who: Principal, chat_id: str, events: list[PublishEvent],
                      idempotency_key: str | None = None, *, in_batch: bool = False,
                      turn_id: str | None = None) -> Published:
        """Store an agent's ``events``, all or none (one refused refuses them all).
        ``in_batch``: they came as a request's ``events``, so a refusal names the event's
        index (``$.events[i].data``, else ``$.data``). ``turn_id``: the turn they are
        written for, refused once it has ended."""
        out = [to_out_event(e, i if in_batch else None) for i, e in enumerate(events)]
        asking = [e for e in events if e.type == "tool_call" and e.data.get("awaiting") is True]
        if asking:  # the arguments fit the tool's schema (the script checks the name)
            meta = await self.store.meta(chat_id)
            for event in asking:
                tool = tools.find(meta.tools if meta else None, str(event.data.get("name")))
                if tool is not None:
                    tools.check_args(tool, event.data.get("args"))
        return await self.store.publish(
            chat_id, out, idempotency_key=f"p:{idempotency_key}" if idempotency_key else None,
            writer=who.writer(), turn=turn_id or "",
        )

    async def create(self, who: Principal, chat_id: str, title: str | None,
                     agent: str = "") -> None:
        """Create a conversation owned by ``who``, answered by ``agent`` (else the
        default); ``conflict`` if the id is taken."""
        clean = clean_title(title) if title is not None else None
        try:
            result = await self.store.publish(chat_id, [], create_owner=who.user_id,
                                              create_agent=agent, writer=who.user_id)
        except Rejected as exc:
            if exc.code != "forbidden":
                raise
            result = None
        if result is None or not result.created:
            raise Rejected("conflict", f"conversation {chat_id!r} already exists")
        if clean is not None:
            await self.rename(who, chat_id, clean)

    async def create_child(self, who: Principal, parent: str, chat_id: str,
                           title: str | None, agent: str = "") -> None:
        """Create a sub-conversation of ``parent`` (its owner's or a service's to open),
        owned by the parent's owner (:meth:`Store.open_child`), answered by ``agent``
        (else the parent's)."""
        clean = clean_title(title) if title is not None else None
        await self.store.open_child(parent, chat_id, clean, writer=who.owner_writer(),
                                    agent=agent)

    async def children(self, chat_id: str,
                       ids: list[str] | None = None) -> list[p.ChildSummary]:
        """``chat_id``'s sub-conversations, oldest first, as its snapshot and
        ``GET .../children`` list them; ``ids``: their ids, when read already."""
        return [p.ChildSummary(child, meta.title,
                               "running" if meta.status == "running" else "idle",
                               p.UsageTotals.of(meta.usage_billed, meta.usage_active))
                for child, meta in await self.store.children(chat_id, ids)]

    async def set_client_tools(self, who: Principal, chat_id: str,
                               declared: list[p.ClientTool]) -> Published:
        """Declare the tools the agent may call to ask a person (the whole list)."""
        tools.check_declared(declared)
        encoded = _encode(declared)
        return await self.store.publish(
            chat_id, [OutEvent(type="client_tools", data=b'{"tools":' + encoded + b"}",
                               tools=encoded)],
            writer=who.owner_writer())

    async def answer(self, who: Principal, req: p.ToolResult) -> p.Ack:
        """A person answers a client tool call: a durable ``tool_result`` on the path, and
        a new turn that goes on from it. The first answer wins (``conflict`` after)."""
        why = p.uncarried(_to_msgpack, req.result, "$.result")  # stored: both formats carry it
        if why is not None:
            raise Rejected("unprocessable", why)
        meta = await self.store.meta(req.chat_id)
        if meta is None:
            raise Rejected("not_found", f"conversation {req.chat_id!r} does not exist")
        awaiting = msgspec.json.decode(meta.awaiting) if meta.awaiting else {}
        name = awaiting.get(req.call_id)
        tool = tools.find(meta.tools, name) if name else None
        if tool is not None:
            tools.check_result(tool, req.result)  # else the script refuses it: not awaiting
        msg_id, turn_id = _new_msg_id(), _new_turn_id()
        preview = " ".join(_encode(req.result).decode().split())[:PREVIEW_CHARS]
        data = _encode({"call_id": req.call_id, "result": req.result, "by": who.user_id})
        events = [OutEvent(type="tool_result", data=data, preview=preview),
                  OutEvent(type="turn_start", data=b"{}", turn_id=turn_id)]
        handoff = Handoff(req.chat_id, turn_id, who.user_id, "", msg_id)
        op = TreeOp(kind="answer", by=who.user_id, node=req.call_id, msg_id=msg_id)
        result = await self._start_turn(who, req.chat_id, events, op, handoff)
        return p.Ack(req.chat_id, result.seqs[0], None, result.turn_id, False, req.id,
                     head=result.head or None, msg_id=msg_id)

    async def rename(self, who: Principal, chat_id: str, title: str) -> Published:
        return await self.store.publish(
            chat_id,
            [OutEvent(type="title", data=clean_title(title).encode(), title_source="user")],
            writer=who.owner_writer(),
        )

    async def end_overdue_turns(self) -> int:
        """End every turn past its deadline with ``reason: timeout``; returns how many.
        When its agent had no live worker, ``error`` says so."""
        ended = 0
        for chat_id, turn_id in await self.inbox.due_turns(now_ms()):
            data: dict[str, str] = {"reason": "timeout"}
            meta = await self.store.meta(chat_id)
            if meta is not None and not await self.agents.has_worker(meta.agent):
                data["error"] = (f"No worker of the agent {meta.agent!r} is running, so "
                                 f"nothing answered.")
            try:
                await self.store.publish(
                    chat_id, [OutEvent(type="turn_end", data=_encode(data), turn_id=turn_id)]
                )
                ended += 1
                COUNTS.turn_timeouts += 1
            except Rejected:
                pass  # already ended, or the conversation is gone
            await self.inbox.untrack_turn(chat_id, turn_id)
        return ended

    async def hand_off_stranded(self) -> int:
        """Do the hand-offs whose gateway died after staging them; returns how many.

        A hand-off is done only if its conversation runs its turn (the publish happened);
        else it is dropped (the publish never happened, or was refused, or the turn is
        over). One whose publish is still under way is dropped too, harmlessly: that
        publisher hands off itself once its publish returns.
        """
        handed = 0
        for handoff in await self.inbox.due_handoffs(now_ms()):
            meta = await self.store.meta(handoff.chat_id)
            if meta is None or meta.status != "running" or meta.turn_id != handoff.turn_id:
                await self.inbox.discard(handoff)
                continue
            started_at = meta.started_at or now_ms()
            deadline = started_at + int(self.settings.turn_timeout * 1000)
            seq = await self._message_seq(handoff.chat_id, handoff.turn_id, meta)
            if await self.inbox.hand_off(handoff, seq, started_at, deadline, meta.agent):
                log.info("handed off %s %s for a gateway that did not", handoff.chat_id,
                         handoff.turn_id)
                handed += 1
                COUNTS.handoffs_swept += 1
        return handed

    async def _message_seq(self, chat_id: str, turn_id: str, meta: Meta) -> int:
        """The seq of the user message that started the running turn ``turn_id``: the
        one before its ``turn_start``, among the latest events. If that is older than
        ``SEQ_SCAN`` events, the oldest seq searched (a turn reads its events after it)."""
        after = max(0, meta.seq - SEQ_SCAN)
        history = await self.store.read(chat_id, after=after, limit=SEQ_SCAN)
        for seq, frame in reversed(history.frames):
            if b'"turn_start"' in frame:
                event = msgspec.json.decode(frame)
                if event.get("type") == "turn_start" and \
                        (event.get("data") or {}).get("turn_id") == turn_id:
                    return seq - 1
        return after

    async def run_turn_sweeper(self) -> None:
        interval = min(1.0, max(0.05, self.settings.turn_timeout / 4))
        while True:
            try:
                await self.end_overdue_turns()
                await self.hand_off_stranded()
            except (RedisError, ConnectionError, OSError) as exc:
                log.warning("turn sweeper: %s", exc)
            await asyncio.sleep(interval)
