"""Redis commands issued in the same loop turn go to each node as one pipeline.

redis-py sends every command on its own: a pool checkout, a socket write and a read each,
and it packs each argument in Python. Under load (a reconnect storm, thousands of
publishes a second) that per-command cost is the gateway's. Here commands queue until the
loop turn ends and then leave together, in the order they were issued, one write per node
(the owner of each command's first key), packed by hiredis, on the node's pipelined link
(:mod:`.link`: batches in flight share it back to back, with no pool checkout, and its
replies are parsed a read at a time); the replies come back in order. A batch that ends
with ``WAIT`` takes a pooled connection instead: ``WAIT`` blocks the connection it runs on.
Each caller still gets its own reply or its own error: the pipeline is not a transaction,
and one command's failure leaves the others as they were.

On a cluster, a command sent to a node that no longer owns its slot is refused unapplied
(``MOVED``, ``ASK``, ``TRYAGAIN``), so it is safe to send again: the slot map is updated and
the command goes out with the next batch. A connection that fails mid-batch is different:
its commands may or may not have been applied, so their callers get the error (a publish
with an idempotency key is safe to retry).

Durable writes can wait for replicas (``GATEWAY_WAIT_REPLICAS``): a batch that holds one
ends with a single ``WAIT`` on the same connection, which covers every write before it, and
each durable caller gets the number of replicas that confirmed along with its reply.

Replies are raw (RESP as hiredis parses it): callers convert what they need.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Coroutine
from functools import partial
from typing import Any

import hiredis
from redis.exceptions import (
    AskError,
    ClusterDownError,
    MovedError,
    NoScriptError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import TimeoutError as RedisTimeoutError

from .backend import Backend, Node
from .counters import REDIS

log = logging.getLogger("gateway.pipeline")
MAX_REDIRECTS = 5  # per command: a slot that keeps moving is a cluster in trouble


class Script:
    """A Lua script known by its SHA1; loaded on the node that first lacks it."""

    __slots__ = ("sha", "source")

    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()


class _Call:
    __slots__ = ("args", "durable", "future", "redirects", "reloaded", "script")

    def __init__(self, args: tuple[Any, ...], script: Script | None, durable: bool,
                 future: asyncio.Future[Any]) -> None:
        self.args = args
        self.script = script
        self.durable = durable
        self.future = future
        self.redirects = 0
        self.reloaded = False  # sent again after its script was loaded (NOSCRIPT once)

    @property
    def key(self) -> Any:
        """The key that routes the call: a script's first key, else the first argument."""
        return self.args[3] if self.script is not None else self.args[1]


class AutoPipeline:
    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        self._wait = (backend.settings.wait_replicas, backend.settings.wait_timeout_ms)
        self._queued: list[_Call] = []
        self._scheduled = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._loading: dict[tuple[Node, str], asyncio.Future[bool]] = {}
        # Python 3.11's get_running_loop() makes a getpid() system call every time, on the
        # hottest line of the gateway: look the loop up once per batch, not once per call.
        self._loop: asyncio.AbstractEventLoop | None = None

    async def execute(self, *args: Any) -> Any:
        """One command, routed by its first argument's key; its raw reply."""
        return await self._enqueue(_Call(args, None, False, self._future()))

    def issue(self, *args: Any) -> asyncio.Future[Any]:
        """:meth:`execute`, queued now: it leaves ahead of whatever is issued after it in
        this loop turn (on the same node, it runs before them)."""
        return self._enqueue(_Call(args, None, False, self._future()))

    async def evalsha(self, script: Script, keys: list[Any], args: list[Any]) -> Any:
        """A script (its keys must share a slot); its raw reply."""
        call = _Call(("EVALSHA", script.sha, len(keys), *keys, *args), script, False,
                     self._future())
        return await self._enqueue(call)

    async def evalsha_durable(self, script: Script, keys: list[Any], args: list[Any]
                              ) -> tuple[Any, int | None]:
        """A script that writes what the caller will acknowledge: its reply, and how many
        replicas confirmed it (None when ``GATEWAY_WAIT_REPLICAS`` is 0)."""
        call = _Call(("EVALSHA", script.sha, len(keys), *keys, *args), script, True,
                     self._future())
        result: tuple[Any, int | None] = await self._enqueue(call)
        return result

    def _future(self) -> asyncio.Future[Any]:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._loop.create_future()

    def _enqueue(self, call: _Call) -> asyncio.Future[Any]:
        if not self._scheduled:
            self._scheduled = True
            assert self._loop is not None
            self._loop.call_soon(self._flush)
        self._queued.append(call)
        return call.future

    def _flush(self) -> None:
        self._scheduled = False
        batch, self._queued = self._queued, []
        backend = self._backend
        by_node: dict[Node, list[_Call]] = {}
        for call in batch:
            try:
                node = backend.node(call.key)
            except Exception as exc:  # no node serves the slot (the cluster is down)
                _settle(call, exc)
                continue
            by_node.setdefault(node, []).append(call)
        assert self._loop is not None
        waits = self._wait[0] > 0
        for node, calls in by_node.items():
            link = node.open_link
            if link is None or (waits and any(call.durable for call in calls)):
                self._spawn(self._send(node, calls))
                continue
            # The usual case needs no task: the batch goes out now, and its replies are
            # handed out by the read that brings them.
            try:
                link.send(_packed([call.args for call in calls]), len(calls),
                          partial(self._replied, node, calls))
            except Exception as exc:  # the link closed since: the same as a failed send
                self._spawn(self._failed(calls, exc))

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        assert self._loop is not None
        task = self._loop.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _replied(self, node: Node, calls: list[_Call], outcome: list[Any] | BaseException
                 ) -> None:
        if isinstance(outcome, BaseException):
            self._spawn(self._failed(calls, outcome))
            return
        retry = _hand_out(calls, outcome, None)
        if retry:
            self._spawn(self._retry(node, retry))

    async def _send(self, node: Node, calls: list[_Call]) -> None:
        """A batch on a link still to be made, or one that waits for replicas."""
        commands = [call.args for call in calls]
        durable = self._wait[0] > 0 and any(call.durable for call in calls)
        if durable:
            commands.append(("WAIT", *self._wait))
        try:
            if durable:  # WAIT blocks its connection: a pooled one, not the shared link
                replies = await _round_trip(node, commands)
            else:
                replies = await _pipelined(node, commands)
        except Exception as exc:  # the round trip itself failed: every caller hears it
            await self._failed(calls, exc)
            return
        acked = replies.pop() if durable else None
        if durable:
            _count_wait(acked, self._wait[0])
        retry = _hand_out(calls, replies, acked)
        if retry:
            await self._retry(node, retry)

    async def _failed(self, calls: list[_Call], exc: BaseException) -> None:
        timeout = isinstance(exc, (TimeoutError, RedisTimeoutError))
        REDIS.command_errors["timeout" if timeout else "connection"] += len(calls)
        for call in calls:
            _settle(call, exc)
        if isinstance(exc, (ConnectionError, OSError, TimeoutError)):
            await self._backend.refresh()  # the node may have failed over

    async def _retry(self, node: Node, retry: list[tuple[_Call, Exception]]) -> None:
        """The calls refused unapplied: a script the node lacks, a slot that moved.

        A node that lost its scripts (a restart, ``SCRIPT FLUSH``, a new primary) refuses
        every call in flight: each script is loaded there once, and its calls go back into
        a batch. Sending each call with its source instead would put a script's whole text
        (up to 36 KB) on the wire once per call, at the moment the node is busiest."""
        lacking = {call.script for call, reply in retry
                   if isinstance(reply, NoScriptError) and not call.reloaded}
        loaded: dict[Script | None, bool] = {
            script: await self._load(node, script) for script in lacking if script is not None}
        for call, reply in retry:
            if isinstance(reply, NoScriptError):
                if loaded.get(call.script) and not call.reloaded:
                    call.reloaded = True
                    self._enqueue(call)
                    continue
                reply = await self._alone(node, call)  # lost again: send it with its source
                if not isinstance(reply, Exception):
                    _settle(call, reply)  # complete: (reply, replicas) when durable
                    continue
            if _redirected(call, reply):
                call.redirects += 1
                REDIS.redirects[_REDIRECTS.get(type(reply), "other")] += 1
                await self._redirect(call, reply)
                continue
            REDIS.command_errors["reply"] += 1
            _settle(call, reply)

    def _load(self, node: Node, script: Script) -> asyncio.Future[bool]:
        """``SCRIPT LOAD`` on ``node``, shared by every batch that finds it missing
        meanwhile; whether the node now has the script."""
        key = (node, script.sha)
        loading = self._loading.get(key)
        if loading is None:
            async def load() -> bool:
                try:
                    (sha,) = await _round_trip(node, [("SCRIPT", "LOAD", script.source)])
                    return bool(sha == script.sha or sha == script.sha.encode())
                except Exception as exc:  # the calls fall back to sending their source
                    log.debug("SCRIPT LOAD on %s failed: %s", node.name, exc)
                    return False
                finally:
                    del self._loading[key]

            assert self._loop is not None
            loading = self._loading[key] = self._loop.create_task(load())
        return loading

    async def _alone(self, node: Node, call: _Call, before: tuple[Any, ...] = ()) -> Any:
        """Run one call on its own (after ``before``, e.g. ``ASKING``), with the source of
        its script, which the node may not have; a durable one waits for its replicas."""
        args = call.args
        if call.script is not None:
            args = ("EVAL", call.script.source, *args[2:])
        commands = [before, args] if before else [args]
        waits = call.durable and self._wait[0] > 0
        if waits:
            commands.append(("WAIT", *self._wait))
        try:
            replies = await _round_trip(node, commands)
        except Exception as exc:
            return exc
        reply = replies[1 if before else 0]
        if not call.durable or isinstance(reply, Exception):
            return reply
        return reply, replies[-1] if waits else None

    async def _redirect(self, call: _Call, error: Exception) -> None:
        """The command was refused unapplied: send it where the slot is now."""
        if isinstance(error, MovedError):
            await self._backend.moved(error)
        elif isinstance(error, AskError):  # mid-migration: this one command goes there
            target = self._backend.node_at(error.host, int(error.port))
            _settle(call, await self._alone(target, call, ("ASKING",)))
            return
        else:  # TRYAGAIN (keys split by a migration) or CLUSTERDOWN: wait a moment
            await asyncio.sleep(0.05 * call.redirects)
            await self._backend.refresh()
        self._enqueue(call)


_REDIRECTS = {MovedError: "moved", AskError: "ask", TryAgainError: "tryagain",
              ClusterDownError: "clusterdown"}


def _count_wait(acked: Any, wanted: int) -> None:
    if isinstance(acked, int) and acked >= wanted:
        REDIS.wait_met += 1
    else:
        REDIS.wait_short += 1


def _redirected(call: _Call, reply: Any) -> bool:
    """A refusal that another try may get past: a slot moving or a cluster recovering."""
    return (isinstance(reply, (AskError, TryAgainError, ClusterDownError))
            and call.redirects < MAX_REDIRECTS)


def _hand_out(calls: list[_Call], replies: list[Any], acked: Any
              ) -> list[tuple[_Call, Exception]]:
    """Settle each call with its reply, ``(reply, replicas)`` for a durable one; return the
    calls refused unapplied (NOSCRIPT, a redirect), which :meth:`AutoPipeline._retry` sends
    again."""
    retry = []
    for call, reply in zip(calls, replies, strict=True):
        if isinstance(reply, Exception):
            if isinstance(reply, NoScriptError) or _redirected(call, reply):
                retry.append((call, reply))
                continue
            REDIS.command_errors["reply"] += 1
            _settle(call, reply)
        else:
            _settle(call, (reply, acked) if call.durable else reply)
    return retry


async def settled(futures: list[asyncio.Future[Any]]) -> None:
    """Wait for every one of ``futures`` (issued: they are in flight together); raise the
    first one's error, in their order.

    What ``asyncio.gather`` does for them, without its wrapping future and a callback per
    future: about 5 µs less for three, on the connect path of a new conversation. The
    futures after a failed one are still awaited, so that no error goes unretrieved."""
    error: Exception | None = None
    for future in futures:
        try:
            await future
        except Exception as exc:
            error = error or exc
    if error is not None:
        raise error


def _settle(call: _Call, reply: Any) -> None:
    if call.future.done():
        return  # the caller went away; the command stands
    if isinstance(reply, BaseException):
        call.future.set_exception(reply)
    else:
        call.future.set_result(reply)


async def _pipelined(node: Node, commands: list[tuple[Any, ...]]) -> list[Any]:
    """Every command in one write on the node's pipelined link; every reply, an error
    reply as its exception object. Batches in flight share the link, in order."""
    link = await node.link()
    return await link.request(_packed(commands), len(commands))


def _packed(commands: list[tuple[Any, ...]]) -> bytes:
    return b"".join([hiredis.pack_command(args) for args in commands])


async def _round_trip(node: Node, commands: list[tuple[Any, ...]]) -> list[Any]:
    """Write every command at once, read every reply: an error reply is that command's."""
    pool = node.client.connection_pool
    connection = await pool.get_connection()
    try:
        await connection.send_packed_command(_packed(commands))
        replies: list[Any] = []
        for _ in commands:
            try:
                replies.append(await connection.read_response())
            except ResponseError as exc:
                replies.append(exc)
        return replies
    except BaseException:
        # Replies may be half read: the connection is of no use to anyone now.
        await connection.disconnect()
        raise
    finally:
        await pool.release(connection)
