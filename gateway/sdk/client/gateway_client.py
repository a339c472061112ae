"""The application-facing :class:`GatewayClient`: its lifecycle, its calls (subscribe, send,
cancel, ...) and its iterators. What it receives goes through the item queue
(:mod:`.item_queue`), what it sends through the outbox (:mod:`.outbox`); the connection
itself is kept by :class:`~.connection.ConnectionLoop`."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from types import TracebackType
from typing import Any

from ... import protocol as p
from ..streams import StreamText
from ..tree import ConversationTree, Siblings
from .chats import Chat, check_chat_id
from .connection import Conn, ConnectionLoop, TokenFactory
from .errors import ClientClosed, GatewayError
from .item_queue import ItemIterator, ItemQueue
from .items import AnyItem, ChatItem, Ended, Signal, SubscribeResult
from .outbox import DEFAULT_LIMITS, Outbox, Outgoing
from .requests import Request, Requests
from .tree_ops import KNOWN_HEAD, ExpectedHead, op_frame


class GatewayClient(ConnectionLoop):
    """A reconnecting, resuming client of one gateway.

    ``url`` is ``ws://host:port`` (``/v1/ws`` is added) or the full ``ws://host:port/v1/ws``.
    Give either ``token`` or ``token_factory``. Extra keyword arguments go to
    :func:`websockets.asyncio.client.connect`.
    """

    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        token_factory: TokenFactory | None = None,
        backoff_base: float = 0.5,
        backoff_max: float = 30.0,
        open_timeout: float = 10.0,
        feed_max: int = 1000,
        idle_ping: float = 5.0,
        pong_timeout: float = 5.0,
        active_ping: float = 2.0,
        active_pong_timeout: float = 2.5,
        **connect_kwargs: Any,
    ) -> None:
        if (token is None) == (token_factory is None):
            raise ValueError("give exactly one of token and token_factory")
        self.url = url
        self._token = token
        self._token_factory = token_factory
        self.backoff_base = backoff_base
        self.backoff_max = backoff_max
        self.open_timeout = open_timeout
        # A connection that died silently (a phone changing networks, a laptop waking up) is
        # noticed within idle_ping + pong_timeout: a ping after idle_ping seconds of silence,
        # and a reconnect when nothing answers it.
        self.idle_ping = idle_ping
        self.pong_timeout = pong_timeout
        # While a subscribed chat streams an answer or runs a turn, frames are expected: a
        # dead connection is noticed within active_ping + active_pong_timeout (< 5 s).
        self.active_ping = active_ping
        self.active_pong_timeout = active_pong_timeout
        self._connect_kwargs = connect_kwargs
        self._refreshes: set[asyncio.Task[None]] = set()
        self._chats: dict[str, Chat] = {}
        self._outbox = Outbox()
        self._requests = Requests()
        self._items = ItemQueue(feed_max)
        self._conn: Conn | None = None
        self._gen = 0
        self._task: asyncio.Task[None] | None = None
        self._connected = asyncio.Event()
        self._disconnected = asyncio.Event()
        self._disconnected.set()
        self._stopped = asyncio.Event()
        self._error: GatewayError | None = None
        self.hello: dict[str, Any] = {}
        """The last ``hello`` frame."""
        self.connections = 0
        """How many connections reached ``hello`` so far."""
        self.last_close: tuple[int | None, str] | None = None
        """Close code (None: no WebSocket) and reason of the last lost connection."""

    # --- lifecycle --------------------------------------------------------------------

    async def __aenter__(self) -> GatewayClient:
        await self.connect()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    def start(self) -> None:
        """Start connecting in the background (idempotent)."""
        self._check_open()
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="gateway-client")

    async def connect(self) -> None:
        """Start, and wait for the first connection (transient failures are retried; wrap
        this in ``asyncio.timeout`` to bound it). Raises :class:`TerminalError`."""
        self.start()
        await self.wait_connected()

    async def wait_connected(self) -> None:
        """Wait until a connection is up (hello received, resubscribes and outbox sent)."""
        while not self._connected.is_set():
            self._check_open()
            waiters = {asyncio.ensure_future(self._connected.wait()),
                       asyncio.ensure_future(self._stopped.wait())}
            try:
                await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for waiter in waiters:
                    waiter.cancel()
        self._check_open()

    async def wait_disconnected(self) -> None:
        """Wait until the current connection, if any, is lost."""
        await self._disconnected.wait()

    @property
    def connected(self) -> bool:
        return self._conn is not None

    @property
    def pending(self) -> int:
        """Messages and cancels not acknowledged yet (queued or in flight)."""
        return self._outbox.pending

    def streams(self, chat_id: str) -> list[StreamText]:
        """The chat's open streams (answers being written) with their text so far."""
        chat = self._chats.get(chat_id)
        if chat is None:
            return []
        return [dataclasses.replace(s) for s in chat.streams.by_id.values()]

    def position(self, chat_id: str) -> tuple[int | None, str | None]:
        """The ``(seq, epoch)`` the client would resume ``chat_id`` from."""
        chat = self._chats.get(chat_id)
        return (chat.seq, chat.epoch) if chat is not None else (None, None)

    # --- the conversation tree -----------------------------------------------------------

    def tree(self, chat_id: str) -> ConversationTree:
        """The chat's tree as the client keeps it from the events (read it, do not change
        it): its nodes, head, active path, siblings. It starts empty at the first subscribe
        (a subscribe without ``since`` knows the head, then the nodes made from then on);
        :meth:`load_history` fills in what came before. A :class:`Recovery` resets it."""
        return self._chat(chat_id).tree

    def head(self, chat_id: str) -> str | None:
        """The node the next message follows (a turn), or None: none, or not known yet."""
        chat = self._chats.get(chat_id)
        return chat.tree.head if chat is not None else None

    def active_path(self, chat_id: str) -> list[str]:
        """The node ids of the active path, from the first message the client knows of to
        the head: what a chat UI shows (events whose ``node`` is on it, or with none)."""
        chat = self._chats.get(chat_id)
        return chat.tree.path() if chat is not None else []

    def siblings(self, chat_id: str, node_id: str) -> Siblings:
        """The versions of a node (itself included, in creation order) and its index: for
        a "2/3" version switch. A node whose siblings the client does not know is alone."""
        return self.tree(chat_id).siblings(node_id)

    def load_history(self, chat_id: str, page: dict[str, Any]) -> None:
        """Fill the chat's tree from a page of ``GET /v1/conversations/{chat_id}/events``
        (its events, ``forks`` and ``head``), e.g. after a :class:`Recovery` or before the
        first subscribe. A page of another epoch than the client's is ignored."""
        check_chat_id(chat_id)
        chat = self._chat(chat_id)
        if chat.epoch is not None and page.get("epoch") not in (None, chat.epoch):
            return
        chat.tree.load_page(page)

    def retry(self, chat_id: str, *, expected_head: ExpectedHead = KNOWN_HEAD,
              cancel: bool = False) -> asyncio.Future[p.Ack]:
        """Queue a ``retry``: a new answer to the head turn's message. The ack has the new
        turn's ``turn_id`` and ``head``. ``expected_head`` defaults to the head the client
        knows (:data:`ANY_HEAD`: none); ``cancel`` ends a running turn first. Refusals fail
        with :class:`RequestError` (``conflict``, ``nothing_to_retry``, ``turn_in_progress``;
        ``head`` set). Not repeated after a connection loss once written (it is not
        idempotent): it then fails with :class:`ConnectionLost`."""
        return self._tree_op("retry", chat_id, expected_head, cancel)

    def edit(self, chat_id: str, msg_id: str, text: str, *, client_msg_id: str | None = None,
             expected_head: ExpectedHead = KNOWN_HEAD,
             cancel: bool = False) -> asyncio.Future[p.Ack]:
        """Queue an ``edit`` of the user message ``msg_id`` (on the active path): a new
        version beside it, with ``text``, and a turn answering it. The ack has the new
        message's ``msg_id``, the ``turn_id`` and ``head``. As :meth:`retry` otherwise
        (``not_on_path``, ``not_found`` too)."""
        fields: dict[str, Any] = {"msg_id": msg_id, "text": text}
        if client_msg_id is not None:
            fields["client_msg_id"] = client_msg_id
        return self._tree_op("edit", chat_id, expected_head, cancel, **fields)

    def undo(self, chat_id: str, *, expected_head: ExpectedHead = KNOWN_HEAD,
             cancel: bool = False) -> asyncio.Future[p.Ack]:
        """Queue an ``undo``: the head moves back before the active path's last user
        message, whose ``text`` (and ``msg_id``, ``client_msg_id``) the ack gives back (put
        it in the composer). Nothing is deleted: :meth:`switch` to that message redoes it.
        As :meth:`retry` otherwise (``nothing_to_undo``)."""
        return self._tree_op("undo", chat_id, expected_head, cancel)

    def switch(self, chat_id: str, node_id: str, *, expected_head: ExpectedHead = KNOWN_HEAD,
               cancel: bool = False) -> asyncio.Future[p.Ack]:
        """Queue a ``switch``: the head moves to the leaf last active below ``node_id``
        (another version at a fork, or redo after an undo). As :meth:`retry` otherwise."""
        return self._tree_op("switch", chat_id, expected_head, cancel, node_id=node_id)

    def _tree_op(self, kind: str, chat_id: str, expected_head: ExpectedHead, cancel: bool,
                 **fields: Any) -> asyncio.Future[p.Ack]:
        check_chat_id(chat_id)
        frame = op_frame(kind, chat_id, self._chat(chat_id).tree, expected_head, cancel,
                         **fields)
        return self._submit(frame, retry_safe=False)

    async def close(self) -> None:
        """Close the connection; pending calls fail with :class:`ClientClosed`, iterators
        drain what was received and stop."""
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._finish(ClientClosed("client closed"), terminal=False)

    def _check_open(self) -> None:
        if self._error is not None:
            raise self._error

    # --- requests ---------------------------------------------------------------------

    async def subscribe(self, chat_id: str, *, seq: int | None = None,
                        epoch: str | None = None, create: bool = True,
                        agent: str | None = None) -> SubscribeResult:
        """Subscribe (and keep subscribed across reconnects). ``seq``/``epoch`` resume from
        an explicit position, as ``since``. Waits for the ``subscribed`` reply (which may come
        after a reconnect); raises :class:`RequestError` (``forbidden``, ...). With
        ``create=False`` a conversation that does not exist is not created: ``not_found``
        (kept for the chat's resubscribes). ``agent`` names the agent that answers a
        conversation this subscribe creates (GET /v1/agents lists the live ones)."""
        self._check_open()
        check_chat_id(chat_id)
        if (seq is None) != (epoch is None):
            raise ValueError("seq and epoch go together")
        chat = self._chat(chat_id)
        if seq is not None:
            chat.seq, chat.epoch, chat.live_gen, chat.buffered_gen = seq, epoch, None, None
        chat.desired, chat.dropping, chat.create = True, False, create
        chat.agent = agent
        self._items.drop_ended(chat_id)  # a new subscription: a new stream
        waiter: asyncio.Future[SubscribeResult] = asyncio.get_running_loop().create_future()
        chat.waiters.append(waiter)
        if self._conn is not None:
            self._send_subscribe(self._conn, chat_id, chat)
        return await waiter

    async def unsubscribe(self, chat_id: str) -> None:
        """Stop receiving a chat; the server buffers its frames, and the next
        :meth:`subscribe` delivers what was missed (from the buffer, or replayed)."""
        self._check_open()
        chat = self._chat(chat_id)
        chat.desired, chat.live_gen = False, None
        conn = self._conn
        if conn is None:
            return
        chat.buffered_gen = conn.gen
        await self._requests.call(conn.queue, Request("unsubscribe", chat_id),
                                  {"type": "unsubscribe", "chat_id": chat_id})

    async def leave(self, chat_id: str) -> None:
        """Stop receiving a chat and forget its position; its :meth:`events` stream ends."""
        self._check_open()
        chat = self._chat(chat_id)
        chat.desired, chat.dropping = False, True
        chat.seq = chat.epoch = chat.live_gen = chat.buffered_gen = None
        chat.tree.reset()
        self._items.put(chat_id, Ended(chat_id, "left"))
        conn = self._conn
        if conn is not None:
            await self._requests.call(conn.queue, Request("leave", chat_id),
                                      {"type": "leave", "chat_id": chat_id})

    async def ping(self) -> int:
        """Round trip to the server; returns its clock (ms)."""
        self._check_open()
        await self.wait_connected()
        assert self._conn is not None
        pong: dict[str, Any] = await self._requests.call(
            self._conn.queue, Request("ping", None), {"type": "ping"})
        return int(pong["ts"])

    def presence(self, chat_id: str) -> p.PresenceList | None:
        """Who is connected to a subscribed chat now (users with their connections, agents
        running a turn in it): the newest list received, None before the first."""
        chat = self._chats.get(chat_id)
        return chat.presence if chat is not None else None

    def typing(self, chat_id: str, *, within: float | None = None) -> list[str]:
        """The users typing in a chat now, other than this client's own: those heard from
        within ``within`` seconds (default: three ``typing_interval``s), and not since
        sent their message or gone from the presence list."""
        chat = self._chats.get(chat_id)
        if chat is None:
            return []
        if within is None:
            within = 3 * self._typing_interval()
        now, me = time.monotonic(), self.hello.get("user_id")
        return sorted(u for u, at in chat.typing.items() if now - at <= within and u != me)

    async def send_typing(self, chat_id: str) -> bool:
        """Tell the chat's other connections the person is typing; call it on every
        keystroke: at most one ``typing`` per ``typing_interval`` leaves (the others return
        False at once). True when the gateway sent it on. Fails with
        :class:`RequestError` ``not_subscribed`` for a chat not subscribed to, and with
        :class:`ConnectionLost` when the connection drops first."""
        check_chat_id(chat_id)
        self._check_open()
        chat = self._chats.get(chat_id)
        now = time.monotonic()
        if chat is not None and now - chat.typed_at < self._typing_interval():
            return False
        conn = self._conn
        if conn is None:
            return False  # typing is of the moment: not queued for a later connection
        if chat is not None:
            chat.typed_at = now
        reply: dict[str, Any] = await self._requests.call(
            conn.queue, Request("typing", chat_id), {"type": "typing", "chat_id": chat_id})
        return bool(reply.get("sent"))

    def _typing_interval(self) -> float:
        limits = self.hello.get("limits") or {}
        return float(limits.get("typing_interval", 2.0))

    def send_message(self, chat_id: str, text: str, client_msg_id: str | None = None,
                     data: dict[str, Any] | None = None) -> asyncio.Future[p.Ack]:
        """Queue a user message now; await the result for its ``ack``.

        Retry-safe: the ``client_msg_id`` (generated here when not given) is reused for
        every attempt. Fails with :class:`RequestError` (``turn_in_progress``, ...).
        """
        check_chat_id(chat_id)
        if client_msg_id is None:
            client_msg_id = "m-" + uuid.uuid4().hex
        elif not 1 <= len(client_msg_id) <= 128:
            raise ValueError("client_msg_id must be 1-128 characters")
        frame: dict[str, Any] = {"type": "message", "chat_id": chat_id, "text": text,
                                 "client_msg_id": client_msg_id}
        if data is not None:
            frame["data"] = data
        return self._submit(frame, retry_safe=True)

    def cancel(self, chat_id: str, turn_id: str | None = None) -> asyncio.Future[p.Ack]:
        """Queue a ``cancel`` of the running turn; await the result for its ``ack``."""
        check_chat_id(chat_id)
        frame: dict[str, Any] = {"type": "cancel", "chat_id": chat_id}
        if turn_id is not None:
            frame["turn_id"] = turn_id
        return self._submit(frame, retry_safe=False)

    def answer(self, chat_id: str, call_id: str, result: Any) -> asyncio.Future[p.Ack]:
        """Queue a person's answer to a client tool call that awaits one (a ``tool_call``
        with ``awaiting: true``; ``subscribed.snapshot.awaiting`` lists them). The ack has
        the new turn's ``turn_id``: the agent goes on with the answer. Fails with
        :class:`RequestError` ``conflict`` when another answer won (or the call is not
        awaiting), ``invalid_request`` when the answer does not fit the tool's schema. Not
        repeated after a connection loss once written: it then fails with
        :class:`ConnectionLost` (subscribe again to see whether it won)."""
        check_chat_id(chat_id)
        frame = {"type": "tool_result", "chat_id": chat_id, "call_id": call_id,
                 "result": result}
        return self._submit(frame, retry_safe=False)

    def _submit(self, frame: dict[str, Any], retry_safe: bool) -> asyncio.Future[p.Ack]:
        self._check_open()
        rid = self._requests.next_id()
        frame["id"] = rid
        future: asyncio.Future[p.Ack] = asyncio.get_running_loop().create_future()
        entry = Outgoing(rid, frame, retry_safe, future)
        self._outbox.add(entry, self.hello.get("limits") or DEFAULT_LIMITS)
        if self._conn is not None:
            self._conn.queue.put_nowait(entry.outbound())
        return future

    # --- iteration --------------------------------------------------------------------

    def events(self, chat_id: str) -> AsyncIterator[ChatItem]:
        """The chat's :class:`Event` and :class:`Recovery` items, in order."""
        return ItemIterator(lambda: self._items.next_of_chat(chat_id))

    def all_events(self) -> AsyncIterator[AnyItem]:
        """Every chat's items, in arrival order, :class:`Ended` markers included."""
        return ItemIterator(self._items.next_of_any)

    def signals(self) -> AsyncIterator[Signal]:
        """Who is here and who is typing, for every subscribed chat, in arrival order:
        :class:`PresenceChange` (the whole list, newest ``v`` only) and :class:`Typing`
        items; the last ``feed_max`` are kept until read. :meth:`presence` and
        :meth:`typing` say the same without reading."""
        return ItemIterator(self._items.next_of_signals)

    def feed(self) -> AsyncIterator[dict[str, Any]]:
        """The conversation feed: ``conversation`` frames for the user's conversations."""
        return ItemIterator(self._items.next_of_feed)
