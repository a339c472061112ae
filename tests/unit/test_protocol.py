"""The wire codecs: every client frame decoded, bad frames named, server frames encoded.

Each test runs with both subprotocols: a client must get the same answer in either.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
import pytest

from gateway import protocol as p

SUBPROTOCOLS = [p.JSON_SUBPROTOCOL, p.MSGPACK_SUBPROTOCOL]


@pytest.fixture(params=SUBPROTOCOLS, ids=["json", "msgpack"])
def codec(request: pytest.FixtureRequest) -> p.Codec:
    return p.Codec(request.param)


def wire(codec: p.Codec, frame: Any) -> bytes:
    """``frame`` as a client of ``codec`` sends it."""
    return msgspec.msgpack.encode(frame) if codec.binary else msgspec.json.encode(frame)


def read(codec: p.Codec, data: bytes) -> Any:
    """A server frame as a client of ``codec`` reads it."""
    return msgspec.msgpack.decode(data) if codec.binary else msgspec.json.decode(data)


def test_the_subprotocol_chooses_text_or_binary() -> None:
    assert p.Codec(p.MSGPACK_SUBPROTOCOL).binary is True
    assert p.Codec(p.JSON_SUBPROTOCOL).binary is False
    # No subprotocol (a plain WebSocket client) speaks JSON.
    assert p.Codec("").binary is False


# --- client frames ----------------------------------------------------------------------

DECODED: list[tuple[dict[str, Any], p.ClientFrame]] = [
    ({"type": "subscribe", "chat_id": "c1"}, p.Subscribe("c1")),
    ({"type": "subscribe", "chat_id": "a-Z_0.9:x", "since": {"seq": 41, "epoch": "e1"}, "id": 1},
     p.Subscribe("a-Z_0.9:x", p.Since(41, "e1"), 1)),
    ({"type": "unsubscribe", "chat_id": "c1", "id": "r1"}, p.Unsubscribe("c1", "r1")),
    ({"type": "leave", "chat_id": "c1"}, p.Leave("c1")),
    ({"type": "message", "chat_id": "c1", "text": "héllo", "client_msg_id": "m-1",
      "data": {"attachments": [1, 2]}, "id": 7},
     p.Message("c1", "héllo", "m-1", {"attachments": [1, 2]}, 7)),
    ({"type": "message", "chat_id": "c1", "text": "", "client_msg_id": "m" * 128},
     p.Message("c1", "", "m" * 128)),
    ({"type": "cancel", "chat_id": "c1", "turn_id": "t1"}, p.Cancel("c1", "t1")),
    ({"type": "cancel", "chat_id": "c1"}, p.Cancel("c1")),
    ({"type": "ping", "id": 0}, p.Ping(0)),
    ({"type": "ping", "id": "x" * 128}, p.Ping("x" * 128)),
    # Unknown fields are ignored.
    ({"type": "ping", "extra": {"any": "thing"}, "v": 2}, p.Ping()),
]


@pytest.mark.parametrize(("sent", "expected"), DECODED)
def test_each_client_frame_decodes(codec: p.Codec, sent: dict[str, Any],
                                   expected: p.ClientFrame) -> None:
    assert codec.decode(wire(codec, sent)) == expected


def bad_json(text: str) -> Callable[[p.Codec], bytes]:
    return lambda codec: text.encode()


def bad(frame: Any) -> Callable[[p.Codec], bytes]:
    return lambda codec: wire(codec, frame)


# (the frame, error code, words the message must hold): what a client reads in `error`.
BAD: list[tuple[Callable[[p.Codec], bytes], str, tuple[str, ...]]] = [
    (bad([1, 2, 3]), "invalid_frame", ("object", "array")),
    (bad(42), "invalid_frame", ("object", "int")),
    (bad("subscribe"), "invalid_frame", ("object", "str")),
    (bad({"id": "r1", "chat_id": "c1"}), "unknown_type", ("missing", "type")),
    (bad({"type": "dance", "id": "r2"}), "unknown_type", ("dance", "$.type")),
    (bad({"type": 7}), "unknown_type", ("$.type",)),
    (bad({"type": "subscribe", "chat_id": 5}), "invalid_frame", ("str", "$.chat_id")),
    (bad({"type": "subscribe", "chat_id": "no spaces!"}), "invalid_frame",
     ("regex", "$.chat_id")),
    (bad({"type": "subscribe", "chat_id": "c" * 129}), "invalid_frame", ("$.chat_id",)),
    (bad({"type": "subscribe"}), "invalid_frame", ("missing", "chat_id")),
    (bad({"type": "subscribe", "chat_id": "c1", "since": {"seq": -1, "epoch": "e"}}),
     "invalid_frame", (">= 0", "$.since.seq")),
    (bad({"type": "subscribe", "chat_id": "c1", "since": {"seq": 1}}), "invalid_frame",
     ("epoch", "$.since")),
    (bad({"type": "subscribe", "chat_id": "c1", "since": 4}), "invalid_frame", ("$.since",)),
    (bad({"type": "message", "chat_id": "c1", "text": "hi"}), "invalid_frame",
     ("missing", "client_msg_id")),
    (bad({"type": "message", "chat_id": "c1", "text": 5, "client_msg_id": "m"}),
     "invalid_frame", ("str", "$.text")),
    (bad({"type": "message", "chat_id": "c1", "text": "x", "client_msg_id": ""}),
     "invalid_frame", ("$.client_msg_id",)),
    (bad({"type": "message", "chat_id": "c1", "text": "x", "client_msg_id": "m" * 129}),
     "invalid_frame", ("$.client_msg_id",)),
    (bad({"type": "message", "chat_id": "c1", "text": "x", "client_msg_id": "m",
          "data": [1]}), "invalid_frame", ("object", "$.data")),
    (bad({"type": "cancel", "chat_id": "c1", "turn_id": 3}), "invalid_frame", ("$.turn_id",)),
    (bad({"type": "unsubscribe"}), "invalid_frame", ("chat_id",)),
    (bad({"type": "ping", "id": -3}), "invalid_frame", (">= 0", "$.id")),
    (bad({"type": "ping", "id": "x" * 129}), "invalid_frame", ("$.id",)),
    (bad({"type": "ping", "id": {"nested": True}}), "invalid_frame", ("$.id",)),
]


@pytest.mark.parametrize(("build", "code", "words"), BAD)
def test_a_bad_frame_gets_an_error_naming_the_problem(
        codec: p.Codec, build: Callable[[p.Codec], bytes], code: str,
        words: tuple[str, ...]) -> None:
    with pytest.raises(msgspec.DecodeError) as caught:
        codec.decode(build(codec))
    got_code, message = p.error_message(caught.value)
    assert got_code == code, message
    for word in words:
        assert word.lower() in message.lower(), (word, message)


@pytest.mark.parametrize("data", [b"this is not json", b"", b"{", b'{"type": "ping"'])
def test_bytes_that_are_not_json_are_malformed(data: bytes) -> None:
    with pytest.raises(msgspec.DecodeError) as caught:
        p.Codec(p.JSON_SUBPROTOCOL).decode(data)
    assert not isinstance(caught.value, msgspec.ValidationError)
    code, message = p.error_message(caught.value)
    assert code == "malformed" and message


@pytest.mark.parametrize("data", [b"\xc1", b"", b"\x81\xa4type"])
def test_bytes_that_are_not_msgpack_are_malformed(data: bytes) -> None:
    with pytest.raises(msgspec.DecodeError) as caught:
        p.Codec(p.MSGPACK_SUBPROTOCOL).decode(data)
    code, message = p.error_message(caught.value)
    assert code == "malformed" and message


# --- the envelope: id and chat_id echoed in the error of a bad frame ---------------------


@pytest.mark.parametrize(("sent", "echoed"), [
    ({"type": "dance", "id": "r2", "chat_id": "c1"}, ("r2", "c1")),
    ({"type": "subscribe", "chat_id": 5, "id": 3}, (3, 5)),
    ({"type": "message", "chat_id": "c1", "text": "hi", "id": {"n": 1}}, ({"n": 1}, "c1")),
    ({"type": "ping"}, (None, None)),
])
def test_the_envelope_reads_id_and_chat_id_of_an_invalid_frame(
        codec: p.Codec, sent: dict[str, Any], echoed: tuple[Any, Any]) -> None:
    envelope = codec.envelope(wire(codec, sent))
    assert (envelope.id, envelope.chat_id) == echoed
    assert envelope.type == sent["type"]


@pytest.mark.parametrize("build", [bad([1, 2]), bad(42), bad("x")])
def test_the_envelope_of_a_frame_that_is_no_object_is_empty(
        codec: p.Codec, build: Callable[[p.Codec], bytes]) -> None:
    envelope = codec.envelope(build(codec))
    assert (envelope.type, envelope.id, envelope.chat_id) == (None, None, None)


def test_the_envelope_of_malformed_bytes_is_empty() -> None:
    for codec, data in ((p.Codec(p.JSON_SUBPROTOCOL), b"{oops"),
                        (p.Codec(p.MSGPACK_SUBPROTOCOL), b"\xc1")):
        envelope = codec.envelope(data)
        assert (envelope.type, envelope.id, envelope.chat_id) == (None, None, None)


# --- server frames ----------------------------------------------------------------------

LIMITS = p.Limits(65536, 32768, 256, 1000, 50.0, 1000, 1 << 20, 900.0)


def test_hello_carries_the_protocol_version_and_the_limits(codec: p.Codec) -> None:
    hello = read(codec, codec.encode(p.Hello("conn-1", "alice", "user", 25.0, LIMITS)))
    assert hello == {
        "type": "hello", "connection_id": "conn-1", "user_id": "alice", "role": "user",
        "heartbeat_interval": 25.0, "protocol": "v1",
        "limits": {"max_frame_bytes": 65536, "max_text_bytes": 32768, "max_subscriptions": 256,
                   "replay_limit": 1000, "rate_limit": 50.0, "buffer_max_frames": 1000,
                   "buffer_max_bytes": 1048576, "buffer_ttl": 900.0, "typing_interval": 2.0},
    }


def test_subscribed_holds_the_position_and_the_snapshot(codec: p.Codec) -> None:
    # goal_state is spliced in already encoded (stored as JSON, re-encoded for MessagePack).
    goal = msgspec.Raw(wire(codec, {"active": True}))
    snapshot = p.Snapshot("Trip", "running", "t1", 1763712000000, goal,
                          [p.StreamSnapshot("s1", "delta", "t1", "The first", 4)])
    frame = read(codec, codec.encode(p.Subscribed("c1", "e1", 57, True, 16, snapshot, 1)))
    assert frame == {
        "type": "subscribed", "chat_id": "c1", "epoch": "e1", "seq": 57, "recovered": True,
        "replayed": 16, "id": 1,
        "snapshot": {"title": "Trip", "status": "running", "turn_id": "t1",
                     "started_at": 1763712000000, "goal_state": {"active": True},
                     "streams": [{"id": "s1", "type": "delta", "turn_id": "t1",
                                  "text": "The first", "pos": 4}]},
    }


def test_subscribed_omits_what_was_not_asked(codec: p.Codec) -> None:
    # No request id, no buffer drain, no stream list: the fields are absent, not null...
    snapshot = p.Snapshot(None, "idle", None, None, None)
    frame = read(codec, codec.encode(p.Subscribed("c1", "e1", 0, False, 0, snapshot)))
    assert set(frame) == {"type", "chat_id", "epoch", "seq", "recovered", "replayed",
                          "snapshot"}
    # ...but the snapshot's state is always there, null when unset.
    assert frame["snapshot"] == {"title": None, "status": "idle", "turn_id": None,
                                 "started_at": None, "goal_state": None}
    # A drained buffer says how much and whether it overflowed, even when false.
    drained = read(codec, codec.encode(p.Subscribed("c1", "e1", 4, True, 0, snapshot,
                                                    buffered=6, overflowed=False)))
    assert (drained["buffered"], drained["overflowed"]) == (6, False)


def test_ack_error_and_pong(codec: p.Codec) -> None:
    ack = read(codec, codec.encode(p.Ack("c1", 58, "m-123", "t1", False, 7)))
    assert ack == {"type": "ack", "chat_id": "c1", "seq": 58, "client_msg_id": "m-123",
                   "turn_id": "t1", "duplicate": False, "id": 7}
    # A cancel's ack: the client_msg_id and turn_id are there, null.
    cancel = read(codec, codec.encode(p.Ack("c1", 59, None, None, False)))
    assert cancel == {"type": "ack", "chat_id": "c1", "seq": 59, "client_msg_id": None,
                      "turn_id": None, "duplicate": False}
    error = read(codec, codec.encode(p.Error("forbidden", "you may not", 1, "c1")))
    assert error == {"type": "error", "code": "forbidden", "message": "you may not", "id": 1,
                     "chat_id": "c1"}
    assert read(codec, codec.encode(p.Error("malformed", "bad"))) == {
        "type": "error", "code": "malformed", "message": "bad"}
    assert read(codec, codec.encode(p.Pong(1763712000000, "x"))) == {
        "type": "pong", "ts": 1763712000000, "id": "x"}
    for frame in (p.Unsubscribed("c1", 2), p.Left("c1", 3)):
        assert read(codec, codec.encode(frame)) == {"type": frame.__struct_config__.tag,
                                                   "chat_id": "c1", "id": frame.id}


def test_usage_counts_keep_each_number_and_drop_the_rest() -> None:
    usage = {"prompt_tokens": 9, "model": "gpt-4o", "cost": 0.5, "flag": True,
             "prompt_tokens_details": {"cached_tokens": 3, "note": "x"},
             "neg": -1, "huge": p.USAGE_MAX + 1, "edge": p.USAGE_MAX, "bad name": 1}
    assert p.usage_counts(usage) == {"prompt_tokens": 9, "cost": 0.5,
                                     "prompt_tokens_details.cached_tokens": 3,
                                     "edge": p.USAGE_MAX}
    many = {f"n{i}": i for i in range(40)}
    assert list(p.usage_counts(many)) == [f"n{i}" for i in range(p.USAGE_NAMES_MAX)]
    assert p.usage_counts({"a": {"b": {}}, "c": []}) == {}


def test_a_webhook_signature_is_the_hmac_of_timestamp_dot_body() -> None:
    import hashlib
    import hmac

    from gateway.webhook import backoff_s, signature

    body = b'{"id":"c:e:5"}'
    mac = hmac.new(b"secret", b"1763712000." + body, hashlib.sha256).hexdigest()
    assert signature("secret", 1763712000, body) == "v1=" + mac
    assert [backoff_s(n) for n in (1, 2, 3, 10, 11, 20)] == [1, 2, 4, 512, 600, 600]
