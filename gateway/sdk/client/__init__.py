"""Python client SDK for the gateway's WebSocket protocol (``protocol.md``), for server-side
subscribers and apps.

::

    async with GatewayClient("ws://127.0.0.1:8000", token_factory=get_token) as client:
        await client.subscribe("trip")
        ack = await client.send_message("trip", "plan a day in Lisbon")
        async for item in client.events("trip"):
            if isinstance(item, Recovery):      # continuity broken: reload history over HTTP
                await reload_history(item.chat_id, item.epoch)
                continue
            print(item.type, item.seq, item.data)

What it does for you
--------------------

* **Connection.** One WebSocket (``compression=None``, JSON frames), the token sent as
  ``?token=``. With a ``token_factory`` (an async, or plain, callable returning a token) a
  fresh token is fetched for every connection attempt, so a close with 4011 (token expired)
  reconnects with a new one. With a static ``token``, 4011 is terminal.
* **Reconnect.** Network drops and the resumable close codes (4008, 4011, 4029, 1012, 1013,
  and anything else that is not terminal) reconnect with exponential backoff and full
  jitter: ``uniform(0, min(backoff_max, backoff_base * 2 ** attempt))``. The attempt count
  restarts after a connection that reached ``hello``, except after 4029/1013, which keep
  backing off. The terminal codes 4001, 4003, 4004 (and an HTTP refusal of the handshake,
  say 403 for a bad ``Origin``) stop the client: pending calls and iterators raise
  :class:`TerminalError`.
* **Liveness.** After ``idle_ping`` seconds (5) with nothing received, the client sends a
  protocol ``ping``; when nothing arrives within ``pong_timeout`` (5) more, the connection
  is taken for dead and replaced: a silent network loss is noticed within about 10 s.
* **Resume.** The client remembers ``{seq, epoch}`` per chat (from ``subscribed`` and from
  every durable event) and, after a reconnect, resubscribes every chat with ``since``, so
  the server replays exactly what was missed. Durable events are de-duplicated by seq as a
  defence (never delivered twice, even if the server were to re-send).
* **Outbox.** :meth:`GatewayClient.send_message` and :meth:`GatewayClient.cancel` are queued
  at call time (in call order) and sent as soon as a connection is up; after a reconnect,
  every message not acknowledged yet is sent again, once and in order, with the *same*
  ``client_msg_id`` (generated once per message), so a first attempt that did land is
  answered with the original ack (``duplicate: true``) instead of a second message. A
  ``cancel`` that was already written when the connection dropped is not repeated (it is not
  idempotent): it fails with :class:`ConnectionLost`. Both return futures resolved by the
  ``ack`` (or failed by the ``error``) reply.

Answers being written (streams)
-------------------------------

The client keeps each chat's open streams (``protocol.md``, "Streams"): :meth:`streams`
returns them with their text so far. A streamed delta arrives as an :class:`Event` whose
``stream_text`` is the stream's whole text so far; a delta already held is skipped, and one
that skips a position makes the client resubscribe with ``since`` for a fresh snapshot.
After every (re)subscribe that reports the open streams, a :class:`StreamReset` per stream
gives its exact text: show it as is. A durable event whose ``data.stream_id`` names a
stream (``message``, ``reasoning``) commits it, and ``stream_discarded`` drops it.

How ``recovered: false`` reaches the application
-----------------------------------------------

It is **not** hidden, and it does not stop the stream. When a (re)subscribe answers
``recovered: false`` (the conversation was deleted and recreated so the epoch changed,
history was trimmed, more than ``replay_limit`` events were missed, ...) or the epoch
changed under the client, a :class:`Recovery` item is put into the chat's event stream, in
order: everything before it came from the old position, everything after it is live from the
new ``epoch``/``seq`` (nothing was replayed). The application should then reload the
conversation over HTTP (``GET /v1/conversations/{chat_id}/events``) and carry on iterating.
A :class:`Recovery` item is only ever produced for a broken continuity; a successful resume
is silent (the missed events simply arrive).

Streams
-------

Received items are kept in an in-memory item queue until consumed. Each item is consumed once,
by whichever iterator reads it: :meth:`GatewayClient.events` (one chat: :class:`Event` and
:class:`Recovery` items; it stops after ``leave``, after a ``deleted`` event or a
``removed`` one (the user was removed from a shared conversation), and raises
:class:`RequestError` when an automatic resubscribe is refused) or
:meth:`GatewayClient.all_events` (every chat, in arrival order, also yielding :class:`Ended`
markers). Use one style per chat. :meth:`GatewayClient.feed` yields the conversation feed
frames (as dicts); the last ``feed_max`` are kept until read. When the client closes, the
iterators drain what was received and then stop (or raise the terminal error).

Who is here, who is typing
--------------------------

The client keeps each subscribed chat's presence list (``protocol.md``, "Presence and
typing"): :meth:`GatewayClient.presence` is the newest (by ``v``) of the snapshot's and
the ``presence`` frames', :meth:`GatewayClient.typing` the users typing now (heard within
three ``typing_interval``s, not since sent their message). :meth:`GatewayClient.signals`
yields each :class:`PresenceChange` and :class:`Typing` as it comes. Call
:meth:`GatewayClient.send_typing` on every keystroke: it sends at most one ``typing`` per
interval per chat.

Conversations as trees
----------------------

The client keeps each chat's tree (``protocol.md``, "The conversation tree";
:mod:`gateway.sdk.tree`) from the events it receives: :meth:`GatewayClient.head`,
:meth:`GatewayClient.active_path` (node ids; an :class:`Event` belongs on it when
``tree(chat_id).visible(event.frame)``), :meth:`GatewayClient.siblings` (a fork's "2/3").
Each move of the head is a durable ``head`` event in the chat's stream; a resume with
``since`` replays the moves (the tree never moves back to an older one), and a
:class:`Recovery` resets the tree (reload the history, and give it to
:meth:`GatewayClient.load_history`). :meth:`GatewayClient.retry`, :meth:`~GatewayClient.edit`,
:meth:`~GatewayClient.undo` and :meth:`~GatewayClient.switch` are queued like messages and
return the ``ack``; each sends the head the client knows as ``expected_head`` (unless told
otherwise), so of two devices racing, one gets a :class:`RequestError` ``conflict`` with the
``head`` now.

The package, by concept: the items and replies the application gets (:mod:`.items`), the
errors (:mod:`.errors`), the queue of received items (:mod:`.item_queue`), the outbox and
the writer (:mod:`.outbox`), the requests waiting for replies (:mod:`.requests`), what is
kept per chat (:mod:`.chats`), the tree operations' frames (:mod:`.tree_ops`), the
connection loop (:mod:`.connection`) and the client itself (:mod:`.gateway_client`).
"""

# KEEP_BACKING_OFF, TERMINAL, TokenFactory, AnyItem and ChatItem are not in __all__, but stay
# importable from here as from the module this package replaced.
from ..streams import StreamText
from ..tree import ConversationTree, HeadMove, Siblings, TreeNode
from .connection import KEEP_BACKING_OFF, TERMINAL, TokenFactory  # noqa: F401
from .errors import ClientClosed, ConnectionLost, GatewayError, RequestError, TerminalError
from .gateway_client import GatewayClient
from .items import (  # noqa: F401
    Ack,
    AnyItem,
    ChatItem,
    Ended,
    Event,
    PresenceChange,
    Recovery,
    StreamReset,
    SubscribeResult,
    Typing,
)
from .tree_ops import ANY_HEAD, KNOWN_HEAD, HeadChoice

__all__ = [
    "ANY_HEAD",
    "KNOWN_HEAD",
    "Ack",
    "ClientClosed",
    "ConnectionLost",
    "ConversationTree",
    "Ended",
    "Event",
    "GatewayClient",
    "GatewayError",
    "HeadChoice",
    "HeadMove",
    "PresenceChange",
    "Recovery",
    "RequestError",
    "Siblings",
    "StreamReset",
    "StreamText",
    "SubscribeResult",
    "TerminalError",
    "TreeNode",
    "Typing",
]
