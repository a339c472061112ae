"""Server frames as they go on the wire: RFC 6455 headers, and one encoding per process."""

from __future__ import annotations

import struct
from typing import NamedTuple

import msgspec
import pytest

from gateway.frames import Frame
from gateway.transport.frames import binary_frame, text_frame

OP_TEXT, OP_BINARY = 0x1, 0x2


class Parsed(NamedTuple):
    fin: bool
    rsv: int
    opcode: int
    masked: bool
    header_size: int
    payload: bytes


def parse(wire: bytes) -> Parsed:
    """Decode one frame by RFC 6455 section 5.2, checking the length is encoded minimally."""
    first, second = wire[0], wire[1]
    size, offset = second & 0x7F, 2
    if size == 126:
        (size,) = struct.unpack_from("!H", wire, 2)
        offset = 4
        assert size >= 126, "a 16-bit length must not be used for lengths under 126"
    elif size == 127:
        (size,) = struct.unpack_from("!Q", wire, 2)
        offset = 10
        assert size >= 65536, "a 64-bit length must not be used for lengths under 65536"
        assert size >> 63 == 0, "the most significant bit of a 64-bit length must be 0"
    payload = wire[offset:]
    assert len(payload) == size, "the frame must hold exactly its payload"
    return Parsed(bool(first & 0x80), (first >> 4) & 0x7, first & 0x0F, bool(second & 0x80),
                  offset, payload)


# The boundaries of the three length encodings: 7 bits, then 16, then 64.
SIZES = [(0, 2), (1, 2), (125, 2), (126, 4), (127, 4), (65535, 4), (65536, 10), (70000, 10)]


@pytest.mark.parametrize(("size", "header_size"), SIZES)
def test_a_text_frame_is_one_final_unmasked_text_message(size: int, header_size: int) -> None:
    payload = (b'{"t":"' + b"x" * size)[:size]
    wire = text_frame(payload)
    assert parse(wire) == Parsed(True, 0, OP_TEXT, False, header_size, payload)


@pytest.mark.parametrize(("size", "header_size"), SIZES)
def test_a_binary_frame_is_one_final_unmasked_binary_message(size: int,
                                                             header_size: int) -> None:
    payload = bytes(range(256)) * (size // 256) + bytes(size % 256)
    wire = binary_frame(payload)
    assert parse(wire) == Parsed(True, 0, OP_BINARY, False, header_size, payload)


def test_the_length_bytes_are_big_endian() -> None:
    assert text_frame(b"a" * 300)[:4] == bytes((0x81, 126, 0x01, 0x2C))
    assert binary_frame(b"a" * 65536)[:10] == bytes((0x82, 127, 0, 0, 0, 0, 0, 1, 0, 0))


def test_a_websocket_client_reads_the_frames_back() -> None:
    # An independent parser (the websockets library, as a client: frames must be unmasked).
    from websockets.frames import Frame as WsFrame
    from websockets.frames import Opcode
    from websockets.streams import StreamReader

    for build, opcode in ((text_frame, Opcode.TEXT), (binary_frame, Opcode.BINARY)):
        for size, _ in SIZES:
            payload = b"y" * size
            reader = StreamReader()
            reader.feed_data(build(payload))
            parser = WsFrame.parse(reader.read_exact, mask=False)
            try:
                next(parser)
            except StopIteration as done:
                frame = done.value
            else:
                raise AssertionError("the frame is incomplete")
            assert (frame.fin, frame.opcode, frame.data) == (True, opcode, payload)


# --- the hub's Frame: one encoding per process, whatever the number of recipients ----------

EVENT = '{"type":"note","chat_id":"c1","seq":3,"data":{"text":"héllo","n":[1,2.5],"ok":true}}'


def test_wire_text_is_the_stored_json_in_a_text_frame() -> None:
    frame = Frame(EVENT.encode(), 3)
    assert frame.text == EVENT and frame.size == len(EVENT.encode())
    parsed = parse(frame.wire_text)
    assert (parsed.opcode, parsed.fin, parsed.masked) == (OP_TEXT, True, False)
    assert parsed.payload == EVENT.encode()
    assert frame.wire_text is frame.wire_text  # built once, written to every socket


def test_msgpack_holds_the_same_frame_as_the_json() -> None:
    frame = Frame(EVENT.encode(), 3)
    assert msgspec.msgpack.decode(frame.msgpack) == msgspec.json.decode(EVENT)
    parsed = parse(frame.wire_binary)
    assert (parsed.opcode, parsed.fin, parsed.masked) == (OP_BINARY, True, False)
    assert parsed.payload == frame.msgpack
    assert frame.wire_binary is frame.wire_binary


def test_a_large_frame_gets_the_long_length_forms() -> None:
    big = msgspec.json.encode({"type": "note", "seq": 1, "data": {"text": "z" * 70_000}})
    frame = Frame(big, 1)
    assert parse(frame.wire_text).header_size == 10
    assert parse(frame.wire_text).payload == big
    assert msgspec.msgpack.decode(parse(frame.wire_binary).payload)["data"]["text"] == "z" * 70_000


def test_only_the_rooms_deletion_frame_is_deleted() -> None:
    # As delete.lua publishes it to the room.
    deleted = (b'{"type":"deleted","chat_id":"c1","seq":null,"ts":1,'
               b'"data":{"epoch":"e1","last_seq":4}}')
    assert Frame(deleted).is_deleted
    # The owner's feed frame about the deletion, and events that merely mention it, are not.
    for json in (
        b'{"type":"conversation","chat_id":"c1","title":null,"status":"idle","deleted":true}',
        b'{"type":"note","chat_id":"c1","seq":5,"data":{"type":"deleted"}}',
        b'{"type":"deleted_note","chat_id":"c1","seq":6,"data":{}}',
    ):
        assert not Frame(json).is_deleted, json
