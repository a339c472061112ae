"""Waiting for several issued Redis futures at once (``pipeline.settled``).

The coroutine is stepped by hand (``send``): each step runs it until it waits on a
future still due, which it hands back. So "still waiting for b" is checked exactly, with
no loop turns or time to wait through."""

from __future__ import annotations

import asyncio
import gc
from typing import Any

import pytest

from gateway.redis.pipeline import settled

pytestmark = pytest.mark.anyio


def futures(n: int) -> list[asyncio.Future[Any]]:
    loop = asyncio.get_running_loop()
    return [loop.create_future() for _ in range(n)]


async def test_returns_once_every_future_has_its_reply() -> None:
    a, b, c = futures(3)
    waiting = settled([a, b, c])
    c.set_result(3)
    a.set_result(1)
    assert waiting.send(None) is b  # a is done: it waits for b, the one still due
    b.set_result(2)
    with pytest.raises(StopIteration):  # c was done: it returns
        waiting.send(None)


async def test_the_first_error_in_order_after_all_have_settled() -> None:
    """The others are still waited for, and none of their errors is left unretrieved (it
    would be logged as "Future exception was never retrieved")."""
    unretrieved: list[dict[str, Any]] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _, context: unretrieved.append(context))
    try:
        a, b, c, d = futures(4)
        waiting = settled([a, b, c, d])
        d.set_exception(KeyError("d"))
        b.set_exception(ValueError("b"))
        a.set_result(1)
        assert waiting.send(None) is c  # past b's error, waiting for c
        c.set_exception(LookupError("c"))
        with pytest.raises(ValueError, match="b"):
            waiting.send(None)
        del a, b, c, d, waiting
        gc.collect()
        assert unretrieved == []
    finally:
        loop.set_exception_handler(None)
