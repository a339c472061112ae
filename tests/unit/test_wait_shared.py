"""Waiting for a subscription's confirmation that other joiners share."""

from __future__ import annotations

import asyncio

import pytest

from gateway.redis.channels import wait_shared

pytestmark = pytest.mark.anyio


async def waiting(shared: asyncio.Future[None], timeout: float = 5) -> asyncio.Task[None]:
    """A task inside ``wait_shared(shared)``: returned once it waits there."""
    started = asyncio.Event()

    async def wait() -> None:
        started.set()  # the test resumes only once this task is suspended in wait_shared
        await wait_shared(shared, timeout)

    task = asyncio.ensure_future(wait())
    await started.wait()
    return task


async def test_a_waiter_gets_the_confirmation_or_its_failure() -> None:
    shared: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    waiters = [await waiting(shared) for _ in range(3)]
    assert not any(w.done() for w in waiters)
    shared.set_result(None)
    assert await asyncio.gather(*waiters) == [None, None, None]
    assert await wait_shared(shared, 5) is None  # already done: no wait

    failed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    waiter = await waiting(failed)
    failed.set_exception(ConnectionError("refused"))
    with pytest.raises(ConnectionError, match="refused"):
        await waiter


async def test_a_cancelled_or_timed_out_waiter_leaves_the_others_waiting() -> None:
    shared: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    cancelled = await waiting(shared)
    patient = await waiting(shared)
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    with pytest.raises(TimeoutError):
        await wait_shared(shared, 0.01)
    assert not shared.done() and not patient.done()
    shared.set_result(None)
    assert await patient is None
