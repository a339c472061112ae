"""Waiting for a subscription's confirmation that other joiners share."""

from __future__ import annotations

import asyncio

import pytest

from gateway.redis.channels import wait_shared

pytestmark = pytest.mark.anyio


async def test_a_waiter_gets_the_confirmation_or_its_failure() -> None:
    shared: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    waiters = [asyncio.ensure_future(wait_shared(shared, 5)) for _ in range(3)]
    await asyncio.sleep(0)
    shared.set_result(None)
    assert await asyncio.gather(*waiters) == [None, None, None]
    assert await wait_shared(shared, 5) is None  # already done: no wait

    failed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    waiter = asyncio.ensure_future(wait_shared(failed, 5))
    await asyncio.sleep(0)
    failed.set_exception(ConnectionError("refused"))
    with pytest.raises(ConnectionError, match="refused"):
        await waiter


async def test_a_cancelled_or_timed_out_waiter_leaves_the_others_waiting() -> None:
    shared: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    cancelled = asyncio.ensure_future(wait_shared(shared, 5))
    patient = asyncio.ensure_future(wait_shared(shared, 5))
    await asyncio.sleep(0)
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    with pytest.raises(TimeoutError):
        await wait_shared(shared, 0.01)
    assert not shared.done() and not patient.done()
    shared.set_result(None)
    assert await patient is None
