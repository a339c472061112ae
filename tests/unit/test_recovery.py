"""Resume planning: a subscriber gets every missed durable event, in order, or nothing."""

from __future__ import annotations

import pytest

from gateway.protocol import Since
from gateway.recovery import ReplayPlan, plan_replay

EPOCH = "e1"
LIMIT = 5


def stored(*seqs: int) -> list[tuple[int, bytes]]:
    """Stored frames with these seqs, as the history read returns them."""
    return [(seq, b'{"seq":%d}' % seq) for seq in seqs]


def test_no_since_is_recovered_with_nothing_to_replay() -> None:
    # A first subscribe asks for nothing, so nothing was missed, whatever the history holds.
    assert plan_replay(None, EPOCH, 7, stored(1, 2, 3), LIMIT) == ReplayPlan(True, [])


@pytest.mark.parametrize("seq", [0, 2, 7])
def test_a_position_of_another_epoch_is_not_recovered(seq: int) -> None:
    # The conversation was recreated: the old seq numbers name other events.
    plan = plan_replay(Since(seq, "old"), EPOCH, 7, stored(*range(seq + 1, 8)), LIMIT)
    assert plan == ReplayPlan(False, [])


def test_a_position_ahead_of_the_history_is_not_recovered() -> None:
    # The client saw seq 9 but the store ends at 7: history went backwards (lost writes).
    assert plan_replay(Since(9, EPOCH), EPOCH, 7, [], LIMIT) == ReplayPlan(False, [])


@pytest.mark.parametrize("last_seq", [0, 7])
def test_a_client_at_the_last_seq_is_recovered_with_nothing_to_replay(last_seq: int) -> None:
    plan = plan_replay(Since(last_seq, EPOCH), EPOCH, last_seq, [], LIMIT)
    assert plan == ReplayPlan(True, [])


def test_the_missing_events_are_replayed_exactly_and_in_order() -> None:
    frames = stored(4, 5, 6, 7)
    plan = plan_replay(Since(3, EPOCH), EPOCH, 7, frames, LIMIT)
    assert plan.recovered is True
    assert plan.frames == frames


def test_a_gap_of_exactly_the_limit_is_replayed_one_more_is_not() -> None:
    at_limit = plan_replay(Since(2, EPOCH), EPOCH, 2 + LIMIT, stored(*range(3, 3 + LIMIT)),
                           LIMIT)
    assert at_limit == ReplayPlan(True, stored(*range(3, 3 + LIMIT)))
    # The reader asks for limit + 1 frames, so it sees that the gap is over the limit.
    over = plan_replay(Since(1, EPOCH), EPOCH, 2 + LIMIT, stored(*range(2, 3 + LIMIT)), LIMIT)
    assert over == ReplayPlan(False, [])


def test_only_the_frames_up_to_the_last_seq_are_replayed() -> None:
    # The read fetched one frame more than needed (limit + 1): it is not part of the gap.
    plan = plan_replay(Since(5, EPOCH), EPOCH, 7, stored(6, 7, 8), LIMIT)
    assert plan == ReplayPlan(True, stored(6, 7))


@pytest.mark.parametrize(("frames", "why"), [
    (stored(6, 7), "the start of the gap was trimmed"),
    (stored(4, 6, 7), "a frame inside the gap is missing"),
    (stored(4, 5, 6), "the end of the gap is missing"),
    ([], "the whole gap was trimmed"),
    (stored(4, 4, 5, 6), "a frame is duplicated"),
    (stored(5, 4, 6, 7), "frames out of order"),
])
def test_a_partial_history_is_never_offered(frames: list[tuple[int, bytes]], why: str) -> None:
    # Replaying what is left would look like success with events silently missing.
    assert plan_replay(Since(3, EPOCH), EPOCH, 7, frames, LIMIT) == ReplayPlan(False, []), why
