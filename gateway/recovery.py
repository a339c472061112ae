"""Deciding what a resuming subscriber gets: every missed durable event, or nothing.

Pure logic, no I/O: given what the client has (``since``) and an atomic read of the
conversation (its epoch, last seq and the frames after ``since.seq``), decide whether the
gap can be closed exactly. A partial replay is never offered: it would look like success.
"""

from __future__ import annotations

from typing import NamedTuple

from .protocol import Since


class ReplayPlan(NamedTuple):
    recovered: bool
    frames: list[tuple[int, bytes]]


def plan_replay(
    since: Since | None,
    epoch: str,
    last_seq: int,
    frames: list[tuple[int, bytes]],
    limit: int,
) -> ReplayPlan:
    """``frames`` are the stored frames with seq > ``since.seq``, ascending, read atomically
    with ``epoch`` and ``last_seq``."""
    if since is None:
        return ReplayPlan(True, [])  # nothing was asked for, nothing was missed
    if since.epoch != epoch or since.seq > last_seq:
        return ReplayPlan(False, [])  # history was recreated: old positions mean nothing
    missing = last_seq - since.seq
    if missing == 0:
        return ReplayPlan(True, [])
    if missing > limit:
        return ReplayPlan(False, [])
    wanted = frames[:missing]
    expected = range(since.seq + 1, last_seq + 1)
    if len(wanted) != missing or any(s != e for (s, _), e in zip(wanted, expected, strict=True)):
        return ReplayPlan(False, [])  # trimmed: some of the gap is gone
    return ReplayPlan(True, wanted)
