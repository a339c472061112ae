"""Rooms and cursors without I/O: who is on the fast lane, and which frames a reader takes."""

from __future__ import annotations

from gateway.frames import Frame
from gateway.redis.records import OpenStream
from gateway.rooms import Cursor, Room, Seat
from gateway.streams import Floor
from gateway.sync import merge


class Member:
    def __init__(self) -> None:
        self.delivered: list[Frame] = []
        self.resyncs = 0

    def deliver(self, chat_id: str, frame: Frame) -> None:
        self.delivered.append(frame)

    def deliver_feed(self, frame: Frame) -> None:
        raise AssertionError("not a feed member")

    def resync(self, chat_id: str) -> None:
        self.resyncs += 1


def durable(seq: int) -> Frame:
    return Frame(b'{"type":"note","seq":%d}' % seq, seq)


def delta(stream_id: str, pos: int) -> Frame:
    return Frame(b'{"type":"delta","seq":null}', None, (stream_id, pos))


def test_a_cursor_admits_durable_frames_after_its_seq_once() -> None:
    cursor = Cursor("e", 3)
    assert [f.seq for f in merge(cursor, [durable(2), durable(3), durable(4), durable(4),
                                          durable(5)])] == [4, 5]
    assert cursor.last_seq == 5


def test_a_snapshot_floor_skips_deltas_it_holds_until_a_newer_frame_goes_by() -> None:
    floor = Floor([OpenStream("s1", "delta", "t1", "abc", 3)])
    cursor = Cursor("e", 7, floor)
    assert not cursor.admit(delta("s1", 2))  # in the snapshot's text
    assert cursor.admit(delta("s1", 3))  # the next one: published after the read
    assert cursor.floor is None
    assert cursor.admit(delta("s2", 0))


def test_a_durable_frame_after_the_read_ends_the_floor() -> None:
    cursor = Cursor("e", 7, Floor([OpenStream("s1", "delta", "t1", "abc", 3)]))
    assert cursor.admit(durable(8)) and cursor.floor is None
    assert cursor.admit(delta("s1", 0))  # a floor no longer applies


def test_an_empty_floor_is_no_floor() -> None:
    assert Cursor("e", 0, Floor([])).floor is None


def test_only_a_seat_at_the_room_s_position_goes_direct() -> None:
    room = Room("c")
    room.epoch, room.last_seq = "e", 5
    member = Member()
    room.add(member)
    sent: list[bytes] = []
    seat = Seat(member, sent.append, binary=False)
    seat.epoch, seat.last_seq = "e", 4
    assert not room.go_direct(seat)  # behind the room
    seat.last_seq = 5
    seat.floor = Floor([OpenStream("s", "delta", "t", "x", 1)])
    assert not room.go_direct(seat)  # holds a snapshot floor
    seat.floor = None
    assert room.go_direct(seat) and seat.direct
    room.last_seq = 6
    room.fan_out(durable(6))
    assert sent == [durable(6).wire_text] and member.delivered == []


def test_a_seat_without_a_transport_never_goes_direct() -> None:
    room = Room("c")
    room.epoch, room.last_seq = "e", 0
    member = Member()
    room.add(member)
    seat = Seat(member, None, binary=False)
    seat.epoch = "e"
    assert not room.go_direct(seat)


def test_demoting_writes_the_room_s_position_into_each_seat() -> None:
    room = Room("c")
    room.epoch, room.last_seq = "e", 5
    member = Member()
    room.add(member)
    sent: list[bytes] = []
    seat = Seat(member, sent.append, binary=True)
    seat.epoch, seat.last_seq = "e", 5
    assert room.go_direct(seat)
    room.last_seq = 9  # frames fanned out while direct: the seat's own numbers are stale
    room.fan_out(Frame(b'{"type":"deleted","seq":null}'))  # everyone off the fast lane
    assert not seat.direct and (seat.epoch, seat.last_seq) == ("e", 9)
    assert [f.is_deleted for f in member.delivered] == [True]


def test_a_lost_history_resyncs_every_member_and_forgets_the_position() -> None:
    room = Room("c")
    room.epoch, room.last_seq = "e", 5
    members = [Member(), Member()]
    for member in members:
        room.add(member)
    room.history_lost("test")
    assert [m.resyncs for m in members] == [1, 1]
    assert (room.epoch, room.last_seq) == (None, None)
