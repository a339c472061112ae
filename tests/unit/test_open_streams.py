"""The client's stream rules (protocol.md): what an open answer shows, and when to resync."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.sdk.streams import Applied, OpenStreams, StreamText


def delta(stream_id: str, pos: int, text: str, kind: str = "delta") -> dict[str, Any]:
    return {"type": kind, "chat_id": "c", "seq": None, "data": {"text": text},
            "stream": {"id": stream_id, "pos": pos}}


def listed(stream_id: str, text: str, pos: int, kind: str = "delta") -> dict[str, Any]:
    return {"id": stream_id, "type": kind, "turn_id": "t1", "text": text, "pos": pos}


def texts(streams: OpenStreams) -> dict[str, tuple[str, int]]:
    return {sid: (s.text, s.pos) for sid, s in streams.by_id.items()}


def test_a_snapshot_replaces_every_open_stream() -> None:
    streams = OpenStreams()
    streams.apply(delta("gone", 0, "old "))
    new = streams.reset([listed("s1", "The answer ", 2),
                         listed("s2", "Thinking", 1, "reasoning_delta")])
    assert new == [StreamText("s1", "delta", "t1", "The answer ", 2),
                   StreamText("s2", "reasoning_delta", "t1", "Thinking", 1)]
    # A stream the snapshot does not list is gone.
    assert texts(streams) == {"s1": ("The answer ", 2), "s2": ("Thinking", 1)}
    assert streams.reset([]) == [] and streams.by_id == {}


def test_the_next_delta_continues_its_stream() -> None:
    streams = OpenStreams()
    streams.reset([listed("s1", "The ", 1)])
    result, stream = streams.apply(delta("s1", 1, "answer"))
    assert result is Applied.APPENDED
    assert stream is streams.by_id["s1"] and (stream.text, stream.pos) == ("The answer", 2)


def test_an_unknown_stream_at_position_zero_is_opened() -> None:
    streams = OpenStreams()
    result, stream = streams.apply(delta("s1", 0, "Hi", "reasoning_delta"))
    assert result is Applied.APPENDED
    assert stream == StreamText("s1", "reasoning_delta", None, "Hi", 1)
    assert streams.apply(delta("s1", 1, " there"))[0] is Applied.APPENDED
    assert texts(streams) == {"s1": ("Hi there", 2)}


def test_a_delta_already_in_the_snapshot_text_is_a_duplicate() -> None:
    # The snapshot was taken after delta 1 was published but before it reached this client.
    streams = OpenStreams()
    streams.reset([listed("s1", "ab", 2)])
    for pos in (0, 1):
        result, stream = streams.apply(delta("s1", pos, "x"))
        assert result is Applied.DUPLICATE and stream is streams.by_id["s1"]
    assert texts(streams) == {"s1": ("ab", 2)}


def test_a_delta_past_the_next_position_is_a_gap_and_changes_nothing() -> None:
    streams = OpenStreams()
    streams.reset([listed("s1", "ab", 2)])
    result, stream = streams.apply(delta("s1", 3, "d"))
    assert result is Applied.GAP and stream is streams.by_id["s1"]
    assert texts(streams) == {"s1": ("ab", 2)}
    # The expected delta still applies: the text never holds a hole.
    assert streams.apply(delta("s1", 2, "c"))[0] is Applied.APPENDED
    assert texts(streams) == {"s1": ("abc", 3)}


@pytest.mark.parametrize("pos", [1, 4])
def test_an_unknown_stream_past_position_zero_is_a_gap_and_is_not_opened(pos: int) -> None:
    streams = OpenStreams()
    assert streams.apply(delta("s1", pos, "e")) == (Applied.GAP, None)
    assert streams.by_id == {}


def test_a_durable_event_naming_a_stream_commits_it() -> None:
    streams = OpenStreams()
    streams.reset([listed("s1", "The answer", 1), listed("s2", "hmm", 1, "reasoning_delta")])
    commit = {"type": "message", "chat_id": "c", "seq": 5,
              "data": {"text": "The answer", "stream_id": "s1"}}
    result, stream = streams.apply(commit)
    assert result is Applied.CLOSED
    assert stream == StreamText("s1", "delta", "t1", "The answer", 1)
    assert texts(streams) == {"s2": ("hmm", 1)}
    # A commit of a stream this client never saw closes nothing.
    assert streams.apply(dict(commit, data={"stream_id": "s9"})) == (Applied.CLOSED, None)
    assert texts(streams) == {"s2": ("hmm", 1)}


def test_an_ephemeral_frame_naming_a_stream_does_not_commit_it() -> None:
    streams = OpenStreams()
    streams.reset([listed("s1", "ab", 2)])
    frame = {"type": "progress", "chat_id": "c", "seq": None, "data": {"stream_id": "s1"}}
    assert streams.apply(frame) == (Applied.NOT_STREAMED, None)
    assert texts(streams) == {"s1": ("ab", 2)}


def test_stream_discarded_drops_the_stream() -> None:
    streams = OpenStreams()
    streams.reset([listed("s1", "first attempt", 3)])
    discarded = {"type": "stream_discarded", "chat_id": "c", "seq": None,
                 "data": {"stream_id": "s1", "type": "delta", "turn_id": "t1"}}
    result, stream = streams.apply(discarded)
    assert result is Applied.CLOSED and stream is not None and stream.text == "first attempt"
    assert streams.by_id == {}
    # The redelivered turn streams anew from position 0.
    assert streams.apply(delta("s2", 0, "second"))[0] is Applied.APPENDED
    assert texts(streams) == {"s2": ("second", 1)}


def test_frames_about_no_stream_change_nothing() -> None:
    streams = OpenStreams()
    streams.reset([listed("s1", "ab", 2)])
    for frame in (
        {"type": "note", "chat_id": "c", "seq": 3, "data": {"n": 1}},
        {"type": "turn_end", "chat_id": "c", "seq": 4, "data": {"reason": "complete"}},
        {"type": "pong", "ts": 1},
        {"type": "delta", "chat_id": "c", "seq": None, "data": "not an object"},
        # A malformed position is not a stream delta at all.
        {"type": "delta", "seq": None, "data": {"text": "x"}, "stream": {"id": 1, "pos": 2}},
        {"type": "delta", "seq": None, "data": {"text": "x"}, "stream": {"id": "s1"}},
    ):
        assert streams.apply(frame) == (Applied.NOT_STREAMED, None), frame
    assert texts(streams) == {"s1": ("ab", 2)}


def test_a_whole_answer_rebuilt_from_a_snapshot_and_live_deltas() -> None:
    streams = OpenStreams()
    streams.reset([listed("s1", "The ", 1)])
    for frame in (delta("s1", 0, "The "), delta("s1", 1, "answer "), delta("s1", 2, "is "),
                  delta("s1", 2, "is "), delta("s1", 3, "42.")):
        streams.apply(frame)
    assert texts(streams) == {"s1": ("The answer is 42.", 4)}
