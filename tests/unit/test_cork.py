"""Coalesced writes without I/O: frames handed out together leave in one write per socket."""

from __future__ import annotations

import pytest

from gateway.frames import Frame
from gateway.rooms import Room, Seat
from gateway.transport import cork


class Socket:
    """A transport's ``write``: records every call."""

    def __init__(self, fail: bool = False) -> None:
        self.writes: list[bytes] = []
        self.fail = fail

    def write(self, data: bytes) -> None:
        if self.fail:
            raise RuntimeError("closed")
        self.writes.append(data)


class Member:
    def deliver(self, chat_id: str, frame: Frame) -> None:
        raise AssertionError("a direct member is written to, not handed frames")

    def deliver_feed(self, frame: Frame) -> None:
        raise AssertionError("not a feed member")

    def resync(self, chat_id: str) -> None:
        raise AssertionError("no resync here")


def durable(seq: int) -> Frame:
    return Frame(b'{"type":"note","seq":%d}' % seq, seq)


def direct_room(chat_id: str, sockets: list[Socket]) -> Room:
    room = Room(chat_id)
    room.epoch, room.last_seq = "e", 0
    for socket in sockets:
        member = Member()
        room.add(member)
        seat = Seat(member, socket.write, binary=False)
        seat.epoch, seat.last_seq = "e", 0
        assert room.go_direct(seat)
    return room


def test_uncorked_writes_go_straight_through() -> None:
    socket = Socket()
    cork.write(socket.write, b"a")
    cork.write(socket.write, b"b")
    assert socket.writes == [b"a", b"b"]


def test_writes_held_by_the_cork_leave_in_one_write_per_socket_in_order() -> None:
    one, two = Socket(), Socket()
    with cork.corked():
        cork.write(one.write, b"a")
        cork.write(two.write, b"x")
        cork.write(one.write, b"b")
        cork.hold_all((one.write, two.write), b"c")
        assert one.writes == two.writes == []  # nothing leaves while corked
    assert one.writes == [b"abc"]
    assert two.writes == [b"xc"]
    cork.write(one.write, b"d")  # the cork is out: straight through again
    assert one.writes == [b"abc", b"d"]


def test_a_socket_that_fails_does_not_keep_the_others_from_their_write() -> None:
    dead, alive = Socket(fail=True), Socket()
    with cork.corked():
        cork.write(dead.write, b"a")
        cork.write(alive.write, b"b")
    assert alive.writes == [b"b"]


def test_an_inner_cork_leaves_the_writing_to_the_outer_one() -> None:
    socket = Socket()
    with cork.corked():
        with cork.corked():
            cork.write(socket.write, b"a")
        assert socket.writes == []
        cork.write(socket.write, b"b")
    assert socket.writes == [b"ab"]


def test_the_cork_comes_out_when_delivery_raises() -> None:
    socket = Socket()
    with pytest.raises(ValueError), cork.corked():
        cork.write(socket.write, b"a")
        raise ValueError
    assert socket.writes == [b"a"] and not cork.CORK.active


def test_a_fan_out_of_many_rooms_to_one_socket_is_one_write() -> None:
    """One client watching ten rooms, a frame in each: one write, frames in order."""
    watcher, other = Socket(), Socket()
    rooms = [direct_room(f"c{i}", [watcher] + ([other] if i == 0 else [])) for i in range(10)]
    frames = [durable(1) for _ in rooms]
    with cork.corked():
        for room, frame in zip(rooms, frames, strict=True):
            room.last_seq = 1
            room.fan_out(frame)
    assert watcher.writes == [b"".join(f.wire_text for f in frames)]
    assert other.writes == [frames[0].wire_text]
