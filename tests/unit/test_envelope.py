"""The pub/sub envelope, read back: every kind of frame a script publishes.

(tests/test_scripts.py runs the Lua writer on a real server against this reader.)
"""

from __future__ import annotations

import pytest

from gateway.redis.envelope import Envelope, unpack


def test_a_durable_frame_has_its_epoch_and_seq() -> None:
    assert unpack(b'e1f|42||{"type":"note","seq":42}') == Envelope(
        "e1f", 42, None, b'{"type":"note","seq":42}')


def test_a_streamed_delta_has_its_position_and_no_seq() -> None:
    assert unpack(b'||se1.3:17|{"type":"delta"}') == Envelope(
        "", None, ("se1.3", 17), b'{"type":"delta"}')


def test_a_stream_id_may_hold_colons_the_position_is_after_the_last() -> None:
    assert unpack(b"||a:b:9|{}").stream == ("a:b", 9)


def test_any_other_frame_has_neither() -> None:
    assert unpack(b'|||{"type":"typing"}') == Envelope("", None, None, b'{"type":"typing"}')


def test_bars_inside_the_frame_are_the_frame_s() -> None:
    frame = b'{"type":"x","data":{"t":"a|b||c|"}}'
    assert unpack(b"e|1||" + frame).frame == frame


@pytest.mark.parametrize("bad", [b"", b"e|1|", b"e|x||{}", b"||s:nope|{}"])
def test_a_malformed_envelope_raises(bad: bytes) -> None:
    with pytest.raises(ValueError):
        unpack(bad)
