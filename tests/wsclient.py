"""A small test client over a real WebSocket: send frames, wait for frames with a timeout."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
from websockets.asyncio.client import ClientConnection
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed

Frame = dict[str, Any]
# Frames most tests do not care about: the conversation feed arrives on every connection,
# and who is connected to a subscribed conversation (presence) comes and goes with tests.
FEED = frozenset({"conversation", "presence", "typing", "token_expiring"})


class Client:
    def __init__(self, ws: ClientConnection, binary: bool = False) -> None:
        self.ws = ws
        self.binary = binary
        self.hello: Frame = {}

    async def send(self, frame: Frame) -> None:
        if self.binary:
            await self.ws.send(msgspec.msgpack.encode(frame))
        else:
            await self.ws.send(msgspec.json.encode(frame).decode())

    async def send_raw(self, data: str | bytes) -> None:
        await self.ws.send(data)

    async def recv(self, timeout: float = 5.0, ignore: frozenset[str] = FEED) -> Frame:
        """The next frame whose type is not in ``ignore``."""
        async with asyncio.timeout(timeout):
            while True:
                raw = await self.ws.recv()
                frame: Frame = (msgspec.msgpack.decode(raw) if isinstance(raw, bytes)
                                else msgspec.json.decode(raw))
                if frame.get("type") not in ignore:
                    return frame

    async def expect(self, type_: str, timeout: float = 5.0, **fields: Any) -> Frame:
        """The next non-feed frame, which must be of ``type_`` with ``fields``."""
        frame = await self.recv(timeout)
        assert frame["type"] == type_, frame
        for key, value in fields.items():
            assert frame.get(key) == value, (key, frame)
        return frame

    async def wait_for(self, predicate: Callable[[Frame], bool], timeout: float = 5.0,
                       ignore: frozenset[str] = frozenset()) -> Frame:
        """Skip frames until one satisfies ``predicate``."""
        async with asyncio.timeout(timeout):
            while True:
                frame = await self.recv(timeout, ignore)
                if predicate(frame):
                    return frame

    async def events(self, chat_id: str, count: int, timeout: float = 5.0) -> list[Frame]:
        """The next ``count`` event frames of ``chat_id``, in order (other frames skipped)."""
        got: list[Frame] = []
        async with asyncio.timeout(timeout):
            while len(got) < count:
                frame = await self.recv(timeout)
                if frame.get("chat_id") == chat_id and "seq" in frame and "data" in frame:
                    got.append(frame)
        return got

    async def subscribe(self, chat_id: str, since: Frame | None = None, **extra: Any) -> Frame:
        request: Frame = {"type": "subscribe", "chat_id": chat_id, **extra}
        if since is not None:
            request["since"] = since
        await self.send(request)
        return await self.expect("subscribed", chat_id=chat_id)

    async def close_code(self, timeout: float = 5.0) -> int | None:
        """Read until the server closes the connection; return its close code."""
        with contextlib.suppress(ConnectionClosed):
            async with asyncio.timeout(timeout):
                while True:
                    await self.ws.recv()
        return self.ws.close_code

    async def close(self) -> None:
        await self.ws.close()


@contextlib.asynccontextmanager
async def connect(url: str, *, binary: bool = False, hello: bool = True,
                  **kwargs: Any) -> AsyncIterator[Client]:
    if binary:
        kwargs.setdefault("subprotocols", ["gateway.v1.msgpack"])
    async with ws_connect(url, max_size=None, compression=None, **kwargs) as ws:
        client = Client(ws, binary)
        if hello:
            client.hello = await client.expect("hello")
        yield client
