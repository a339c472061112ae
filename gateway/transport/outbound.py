"""How a session's bytes reach its socket: the fast path, or plain ASGI ``send``.

:class:`DirectOutbound` writes complete frames synchronously to the transport: frames the hub
built once per process, and replies framed here. Every write of a connection is a plain
``transport.write`` made in program order, so order holds across fan-out, replies, replays
and the feed with no queue and no task; the transport's own buffer is the queue, and its
``pause_writing``/``resume_writing`` are the backpressure signal. Its ``write`` is also what
the hub calls for members in a room's direct set.

:class:`AsgiOutbound` is the fallback for servers without the fast path: a bounded queue
drained by one writer task through ASGI ``send``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

from . import cork
from .frames import binary_frame, text_frame
from .uvicorn_ws import GatewayWebSocketProtocol, TransportListener

Send = Callable[[dict[str, Any]], Awaitable[None]]


class WireFrame(Protocol):
    """A hub frame: its payloads and its complete WebSocket frames, each made once."""

    @property
    def text(self) -> str: ...

    @property
    def msgpack(self) -> bytes: ...

    @property
    def wire_text(self) -> bytes: ...

    @property
    def wire_binary(self) -> bytes: ...


class Outbound(Protocol):
    binary: bool
    # ``transport.write`` when frames may be written straight to the socket, else None.
    write: Callable[[bytes], None] | None

    @property
    def paused(self) -> bool: ...

    def buffered(self) -> int: ...

    def send_payload(self, payload: bytes) -> None: ...

    def send_frame(self, frame: WireFrame) -> None: ...

    def send_frames(self, frames: Sequence[WireFrame]) -> None: ...

    async def wait_writable(self) -> None: ...

    def close(self, code: int, reason: str) -> asyncio.Task[None]: ...


def _close_task(send: Send, code: int, reason: str) -> asyncio.Task[None]:
    async def close() -> None:
        # No timeout: the close frame of a peer that stopped reading (4008) can only leave
        # once what is already in flight drains; if the peer goes away, the send fails.
        with contextlib.suppress(Exception):
            await send({"type": "websocket.close", "code": code, "reason": reason})

    return asyncio.get_running_loop().create_task(close())


class DirectOutbound:
    """Frames written straight to the transport of a :class:`GatewayWebSocketProtocol`."""

    __slots__ = ("_frame", "_protocol", "_send", "binary", "write")

    def __init__(self, protocol: GatewayWebSocketProtocol, send: Send, binary: bool,
                 listener: TransportListener, pause_above: int) -> None:
        self._protocol = protocol
        self._send = send
        self.binary = binary
        self._frame = binary_frame if binary else text_frame
        transport = protocol.transport
        # Pause (and so pace replays, and leave rooms' direct sets) well before the bound
        # that closes the connection with 4008.
        transport.set_write_buffer_limits(high=pause_above, low=pause_above // 4)
        self.write: Callable[[bytes], None] | None = transport.write
        protocol.listener = listener

    @property
    def paused(self) -> bool:
        return not self._protocol.writable.is_set()

    def buffered(self) -> int:
        return self._protocol.transport.get_write_buffer_size()

    # Through the cork: while the hub hands out several frames at once, they are held and
    # leave in one write (cork.py).

    def send_payload(self, payload: bytes) -> None:
        cork.write(self._protocol.transport.write, self._frame(payload))

    def send_frame(self, frame: WireFrame) -> None:
        cork.write(self._protocol.transport.write,
                   frame.wire_binary if self.binary else frame.wire_text)

    def send_frames(self, frames: Sequence[WireFrame]) -> None:
        if self.binary:
            data = b"".join([f.wire_binary for f in frames])
        else:
            data = b"".join([f.wire_text for f in frames])
        cork.write(self._protocol.transport.write, data)

    async def wait_writable(self) -> None:
        await self._protocol.writable.wait()

    def close(self, code: int, reason: str) -> asyncio.Task[None]:
        self._protocol.listener = None
        return _close_task(self._send, code, reason)


class AsgiOutbound:
    """A byte-bounded queue drained by one writer task through ASGI ``send``."""

    __slots__ = ("_drained", "_key", "_queue", "_queued", "_send", "_wake", "_writer",
                 "binary", "pause_above", "write")

    def __init__(self, send: Send, binary: bool, pause_above: int) -> None:
        self._send = send
        self.binary = binary
        self._key = "bytes" if binary else "text"
        self.pause_above = pause_above
        self.write: Callable[[bytes], None] | None = None
        self._queue: deque[str | bytes] = deque()
        self._queued = 0
        self._wake = asyncio.Event()
        self._drained = asyncio.Event()
        self._writer = asyncio.get_running_loop().create_task(self._write_loop())

    @property
    def paused(self) -> bool:
        return self._queued > self.pause_above

    def buffered(self) -> int:
        return self._queued

    def _put(self, payload: str | bytes) -> None:
        self._queue.append(payload)
        self._queued += len(payload)
        self._drained.clear()
        self._wake.set()

    def send_payload(self, payload: bytes) -> None:
        self._put(payload if self.binary else payload.decode())

    def send_frame(self, frame: WireFrame) -> None:
        self._put(frame.msgpack if self.binary else frame.text)

    def send_frames(self, frames: Sequence[WireFrame]) -> None:
        for frame in frames:
            self.send_frame(frame)

    async def wait_writable(self) -> None:
        await self._drained.wait()

    async def _write_loop(self) -> None:
        queue, send, key = self._queue, self._send, self._key
        with contextlib.suppress(Exception):
            while True:
                await self._wake.wait()
                self._wake.clear()
                while queue:
                    payload = queue[0]
                    # Popped only after the send: a send in flight still counts as queued.
                    await send({"type": "websocket.send", key: payload})
                    queue.popleft()
                    self._queued -= len(payload)
                self._drained.set()

    def close(self, code: int, reason: str) -> asyncio.Task[None]:
        self._writer.cancel()
        self._queue.clear()
        self._queued = 0
        self._drained.set()
        return _close_task(self._send, code, reason)


def outbound_for(scope: dict[str, Any], send: Send, binary: bool,
                 listener: TransportListener, pause_above: int) -> Outbound:
    """The fast path when the server offers it, else the ASGI fallback."""
    protocol = scope.get("extensions", {}).get("gateway.transport")
    if isinstance(protocol, GatewayWebSocketProtocol) and protocol.transport is not None:
        return DirectOutbound(protocol, send, binary, listener, pause_above)
    return AsgiOutbound(send, binary, pause_above)
