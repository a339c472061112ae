"""A TCP proxy whose open connections can go silent, as a network does that dies quietly.

``silence()`` stops forwarding on every connection open now, in both directions, without
closing anything (no FIN, no RST): what a phone sees when it moves from Wi-Fi to cellular,
or a NAT or proxy that drops its state. Connections made afterwards are forwarded as usual
(the new network works). Runs its own event loop in a thread, so synchronous tests (the
browser tests) can use it too.
"""

from __future__ import annotations

import asyncio
import threading
import time
from types import TracebackType

CHUNK = 65536


class SilenceableProxy:
    """Forwards ``127.0.0.1:<port>`` to ``target_host:target_port``."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = 0
        self.connections = 0  # accepted so far
        self.silenced_at: float | None = None  # time.monotonic() of the last silence()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.Server | None = None
        self._live: list[asyncio.Event] = []  # one per open connection: set = silenced
        self._writers: list[asyncio.StreamWriter] = []

    def __enter__(self) -> SilenceableProxy:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def silence(self) -> float:
        """Every connection open now goes silent for good; returns time.monotonic()."""
        def freeze() -> None:
            for event in self._live:
                event.set()
            self._live.clear()
        self._loop.call_soon_threadsafe(freeze)
        self.silenced_at = time.monotonic()
        return self.silenced_at

    async def _start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in self._writers:
            writer.close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        silenced = asyncio.Event()
        self._live.append(silenced)
        self._writers += [writer, up_writer]
        try:
            await asyncio.gather(self._pump(reader, up_writer, silenced),
                                 self._pump(up_reader, writer, silenced))
        except asyncio.CancelledError:
            pass  # the proxy stops

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    silenced: asyncio.Event) -> None:
        try:
            while not silenced.is_set():
                data = await reader.read(CHUNK)
                if silenced.is_set():
                    break  # read, never delivered: the network lost it
                if not data:
                    writer.write_eof() if writer.can_write_eof() else writer.close()
                    return
                writer.write(data)
                await writer.drain()
        except (OSError, RuntimeError):
            writer.close()
            return
        # Silent: hold both ends open, forwarding nothing, until the proxy stops.
        await asyncio.Event().wait()
