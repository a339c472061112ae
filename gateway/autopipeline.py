"""Redis commands issued in the same loop turn go to the server as one pipeline.

redis-py sends every command on its own: a pool checkout, a socket write and a read each,
and it packs each argument in Python. Under load (a reconnect storm, thousands of
publishes a second) that per-command cost is the gateway's. Here commands queue until the
loop turn ends and then leave together, in the order they were issued, packed by hiredis
in one write on one pooled connection; the replies are read back in order. Each caller
still gets its own reply or its own error: the pipeline is not a transaction, and one
command's failure leaves the others as they were. Alone, a command costs less than before.

Replies are raw (RESP as hiredis parses it): callers convert what they need.
"""

from __future__ import annotations

import asyncio
from typing import Any

import hiredis
import redis.asyncio as aioredis
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError, ResponseError

Queued = tuple[tuple[Any, ...], AsyncScript | None, asyncio.Future[Any]]


class AutoPipeline:
    def __init__(self, redis: aioredis.Redis) -> None:
        self._redis = redis
        self._queued: list[Queued] = []
        self._scheduled = False
        self._tasks: set[asyncio.Task[None]] = set()
        # Python 3.11's get_running_loop() makes a getpid() system call every time, on the
        # hottest line of the gateway: look the loop up once per batch, not once per call.
        self._loop: asyncio.AbstractEventLoop | None = None

    async def execute(self, *args: Any) -> Any:
        """One command; its raw reply (``HGETALL`` gives a flat list)."""
        return await self._enqueue(args, None)

    async def evalsha(self, script: AsyncScript, keys: list[Any], args: list[Any]) -> Any:
        """A registered script; loaded again if the server lost its script cache."""
        return await self._enqueue(("EVALSHA", script.sha, len(keys), *keys, *args), script)

    def _enqueue(self, args: tuple[Any, ...], script: AsyncScript | None
                 ) -> asyncio.Future[Any]:
        if not self._scheduled:
            self._loop = asyncio.get_running_loop()
            self._scheduled = True
            self._loop.call_soon(self._flush)
        assert self._loop is not None
        future: asyncio.Future[Any] = self._loop.create_future()
        self._queued.append((args, script, future))
        return future

    def _flush(self) -> None:
        self._scheduled = False
        batch, self._queued = self._queued, []
        assert self._loop is not None
        task = self._loop.create_task(self._send(batch))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send(self, batch: list[Queued]) -> None:
        try:
            replies = await self._round_trip([args for args, _, _ in batch])
        except Exception as exc:  # the round trip itself failed: every caller hears it
            for _, _, future in batch:
                if not future.done():
                    future.set_exception(exc)
            return
        for i, (args, script, _) in enumerate(batch):
            if isinstance(replies[i], NoScriptError) and script is not None:
                replies[i] = await self._reload_and_run(script, args)
        for (_, _, future), reply in zip(batch, replies, strict=True):
            if future.done():
                continue  # the caller went away; the command stands
            if isinstance(reply, Exception):
                future.set_exception(reply)
            else:
                future.set_result(reply)

    async def _round_trip(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        """Write every command at once, read every reply: an error reply is that command's."""
        pool = self._redis.connection_pool
        connection = await pool.get_connection()
        try:
            await connection.send_packed_command(
                b"".join([hiredis.pack_command(args) for args in commands]))
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

    async def _reload_and_run(self, script: AsyncScript, args: tuple[Any, ...]) -> Any:
        """The server lost its script cache (a restart, SCRIPT FLUSH): load, run again.
        A failure here is this caller's alone: the others' writes stand."""
        try:
            await script.registered_client.script_load(script.script)
            return (await self._round_trip([args]))[0]
        except Exception as exc:
            return exc
