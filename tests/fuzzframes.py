"""Hostile client frames for the fuzz test, each with the answers the protocol allows for it.

Frames are built from the real shapes: the ``ClientFrame`` structs of ``gateway.protocol``,
read with ``msgspec.inspect``, so a field or a frame type added there is fuzzed too. Then they
are mutated at three levels:

- a value: the wrong type, huge numbers, deep nesting, invalid UTF-8, JSON that is not JSON
  (``NaN``, lone surrogates), MessagePack extension types, binary strings and map keys JSON
  cannot carry (:class:`Splice`: bytes written into the encoded frame);
- the frame: a field dropped, an unknown field, an unknown ``type``, not an object;
- the bytes: truncated, flipped, the other codec, the other frame kind (text/binary),
  empty, just under or over the frame limit.

:func:`accepts` is the schema's rule for a plain value, written from the shapes (not by
asking the gateway's decoder), and :class:`Expect` what may come back for the frame.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import msgspec
from hypothesis import strategies as st
from msgspec import inspect as mi

from gateway import protocol as p

# --- what protocol.md documents ---------------------------------------------------------

PROTOCOL_MD = (Path(__file__).resolve().parents[1] / "protocol.md").read_text()


def documented_error_codes() -> frozenset[str]:
    """The ``error`` codes listed in protocol.md's ``error`` section."""
    section = PROTOCOL_MD.split("### `error`", 1)[1].split("## ", 1)[0]
    listed = section.split("Codes:", 1)[1].split("invalid frames in a row", 1)[0]
    return frozenset(re.findall(r"`([a-z_]+)`", listed)) - {"client_msg_id"}


def documented_close_codes() -> frozenset[int]:
    """The codes of protocol.md's close-code table."""
    table = PROTOCOL_MD.split("## Close codes", 1)[1].split("\n## ", 1)[0]
    return frozenset(int(code) for code in re.findall(r"^\| (\d{4}) \|", table, re.M))


BAD_CODES = frozenset({"malformed", "unknown_type", "invalid_frame"})
VALID = frozenset({"valid"})
# The replies of a valid frame, and the refusals it may get instead (protocol.md, per type).
REPLIES = {"subscribe": "subscribed", "unsubscribe": "unsubscribed", "leave": "left",
           "message": "ack", "cancel": "ack", "ping": "pong",
           "retry": "ack", "edit": "ack", "undo": "ack", "switch": "ack", "tool_result": "ack",
           "typing": "typed", "refresh": "refreshed"}
# Any tree operation (a message is one) may meet another head than it expects, a running
# turn, or nodes that name nothing (protocol.md, "Tree operations").
_TREE = {"forbidden", "not_found", "conflict", "turn_in_progress", "not_on_path",
         "nothing_to_retry", "nothing_to_undo", "replication_timeout"}
REFUSALS = {
    "subscribe": {"forbidden", "not_found", "too_many_subscriptions"},
    "message": {"text_too_long", *_TREE},
    "cancel": {"forbidden", "not_found", "no_active_turn", "turn_mismatch",
               "replication_timeout"},
    "retry": _TREE, "undo": _TREE, "switch": _TREE, "edit": {"text_too_long", *_TREE},
    # An answer to a client tool: nothing awaits it (conflict), or it does not fit.
    "tool_result": {"invalid_request", *_TREE},
    # Typing into a chat this connection holds no subscription to.
    "typing": {"not_subscribed"},
    # A fuzzed token is never good: refused, and nothing changes.
    "refresh": {"unauthorized", "forbidden"},
}
REPLY_TYPES = frozenset({*REPLIES.values(), "error"})

# --- the real shapes --------------------------------------------------------------------

_UNION = mi.multi_type_info([p.ClientFrame])[0]
assert isinstance(_UNION, mi.UnionType)
SHAPES: dict[str, mi.StructType] = {}
for _shape in _UNION.types:
    assert isinstance(_shape, mi.StructType) and isinstance(_shape.tag, str)
    SHAPES[_shape.tag] = _shape
TAG = next(iter(SHAPES.values())).tag_field or "type"
INT_MIN, UINT_MAX = -(2**63), 2**64 - 1  # the integers both wire formats carry


def accepts(t: mi.Type, value: Any) -> bool:
    """Whether the schema takes ``value`` (plain: JSON-like, no :class:`Splice`) for ``t``.

    Patterns are full matches, as protocol.md states them.
    """
    if isinstance(t, mi.AnyType):
        return True
    if isinstance(t, mi.NoneType):
        return value is None
    if isinstance(t, mi.BoolType):
        return isinstance(value, bool)
    if isinstance(t, mi.IntType):
        if not isinstance(value, int) or isinstance(value, bool):
            return False
        return ((t.ge is None or value >= t.ge) and (t.le is None or value <= t.le)
                and (t.gt is None or value > t.gt) and (t.lt is None or value < t.lt))
    if isinstance(t, mi.StrType):
        return (isinstance(value, str)
                and (t.min_length is None or len(value) >= t.min_length)
                and (t.max_length is None or len(value) <= t.max_length)
                and (t.pattern is None or re.fullmatch(t.pattern.strip("^$"), value) is not None))
    if isinstance(t, mi.UnionType):
        return any(accepts(member, value) for member in t.types)
    if isinstance(t, mi.DictType):
        return isinstance(value, dict) and all(
            accepts(t.key_type, k) and accepts(t.value_type, v) for k, v in value.items())
    if isinstance(t, mi.StructType):
        return isinstance(value, dict) and all(
            accepts(f.type, value[f.encode_name]) if f.encode_name in value else not f.required
            for f in t.fields)
    raise NotImplementedError(f"no rule for {t!r}: teach accepts() the new field type")


# --- splices: values no Python object encodes to ----------------------------------------


@dataclass(frozen=True)
class Splice:
    """Bytes written into an encoded frame in place of a value, and the outcomes when they
    stand where a typed field is (or are the frame), where any value is taken (inside a
    message's ``data``), in a field the frame type does not have, and as the ``type``."""

    raw: bytes
    label: str
    typed: frozenset[str]
    any: frozenset[str]
    unknown: frozenset[str]
    tag: frozenset[str]
    number: int | None = None  # an integer past 64 bits: typed fields take it by its value


def _f(*outcomes: str) -> frozenset[str]:
    return frozenset(outcomes)


BAD = BAD_CODES
MAYBE = BAD_CODES | VALID
INVALID, MALFORMED, UNKNOWN = _f("invalid_frame"), _f("malformed"), _f("unknown_type")
BAD_STR = MALFORMED | INVALID


def _deep(open_: bytes, leaf: bytes, close: bytes, depth: int) -> bytes:
    return open_ * depth + leaf + close * depth


def json_splices() -> st.SearchStrategy[Splice]:
    depth = st.integers(3_000, 8_000)  # well past any decoder's depth limit (about 1,000)
    big = st.integers(20, 1_000).map(lambda n: b"1" + b"7" * n)
    not_json = st.sampled_from([b"NaN", b"Infinity", b"-Infinity", b"01", b"+1", b".5",
                                b"'x'", b"tru", b"nul", b'"a\x01b"', b'"\\x41"'])
    surrogate = st.sampled_from([b'"\\ud800"', b'"\\udc00x"', b'"\\ud800\\u0041"',
                                 b'"\\udbff\\udbff"'])
    bad_utf8 = st.sampled_from([b"\xff", b"\xfe\xff", b"\xc3\x28", b"\xed\xa0\x80",
                                b"\xc0\xaf", b"\xf8\x88\x80\x80\x80", b"a\x80b"])
    return st.one_of(
        depth.map(lambda d: Splice(_deep(b"[", b"", b"]", d), f"[ x {d}", BAD, BAD, BAD, BAD)),
        depth.map(lambda d: Splice(_deep(b'{"a":', b"0", b"}", d), f"{{ x {d}",
                                   BAD, BAD, BAD, BAD)),
        # JSON numbers have no size: one past 64 bits is an integer to the schema, but data
        # must travel in both codecs, and MessagePack stops at 64 bits.
        st.tuples(big, st.booleans()).map(lambda b: Splice(
            (b"-" if b[1] else b"") + b[0], f"{len(b[0])}-digit int",
            INVALID, INVALID, VALID, UNKNOWN, int((b"-" if b[1] else b"") + b[0]))),
        st.sampled_from([b"1e400", b"-1e400", b"1.5e999"]).map(
            lambda r: Splice(r, r.decode(), INVALID, INVALID, VALID, UNKNOWN)),
        not_json.map(lambda r: Splice(r, f"not JSON {r!r}", MALFORMED, MALFORMED, MALFORMED,
                                      MALFORMED)),
        # A string is refused for its content, or first for being a string where a field
        # takes none; skipped strings are not decoded: an unknown field may hold any bytes.
        surrogate.map(lambda r: Splice(r, f"lone surrogate {r!r}", BAD_STR, MALFORMED,
                                       MALFORMED, MALFORMED)),
        bad_utf8.map(lambda r: Splice(b'"' + r + b'"', f"invalid UTF-8 {r!r}", BAD_STR,
                                      MALFORMED, MAYBE, MALFORMED | UNKNOWN)),
    )


def msgpack_splices() -> st.SearchStrategy[Splice]:
    depth = st.integers(3_000, 20_000)
    ext = st.tuples(st.integers(-128, 127).filter(lambda n: n != -1), st.binary(max_size=20))
    timestamp = st.integers(0, 2**32 - 1).map(lambda s: b"\xd6\xff" + s.to_bytes(4, "big"))
    bad_timestamp = st.just(b"\xd7\xff" + b"\xff" * 8)  # nanoseconds over 999,999,999
    bad_keys = st.sampled_from([b"\x81\xc0\x01", b"\x81\xc3\x01", b"\x81\x92\x01\x02\x01",
                                b"\x81\x81\xa1a\x01\x01", b"\x82\xa1a\x01\xc2\x02"])
    bad_utf8 = st.sampled_from([b"\xff", b"\xfe\xff", b"\xc3\x28", b"\xed\xa0\x80", b"a\x80b"])
    return st.one_of(
        depth.map(lambda d: Splice(_deep(b"\x91", b"\xc0", b"", d), f"array x {d}",
                                   BAD, BAD, BAD, BAD)),
        depth.map(lambda d: Splice(_deep(b"\x81\xa1a", b"\xc0", b"", d), f"map x {d}",
                                   BAD, BAD, BAD, BAD)),
        ext.map(lambda e: Splice(msgspec.msgpack.encode(msgspec.msgpack.Ext(*e)),
                                 f"ext {e[0]}", INVALID, INVALID, VALID, UNKNOWN)),
        timestamp.map(lambda r: Splice(r, "timestamp", INVALID, VALID, VALID, UNKNOWN)),
        bad_timestamp.map(lambda r: Splice(r, "bad timestamp", INVALID, INVALID, VALID,
                                           UNKNOWN)),
        st.binary(max_size=40).map(lambda b: Splice(msgspec.msgpack.encode(b), "bin",
                                                    INVALID, VALID, VALID, UNKNOWN)),
        # A map whose keys JSON cannot carry (nil, bool, array, map), in a message's data.
        bad_keys.map(lambda r: Splice(r, f"map key {r!r}", INVALID, BAD, VALID, UNKNOWN)),
        bad_utf8.map(lambda r: Splice(bytes([0xA0 | len(r)]) + r, f"invalid UTF-8 {r!r}",
                                      BAD_STR, MALFORMED, MAYBE, MALFORMED | UNKNOWN)),
    )


# --- plain values -----------------------------------------------------------------------

EDGE_INTS = [0, 1, -1, 127, 128, 255, 256, 65535, 65536, 2**31 - 1, 2**31, 2**32, 2**53 + 1,
             2**63 - 1, 2**63, UINT_MAX, -(2**31), INT_MIN]
EDGE_TEXTS = ["", " ", "\x00", "null", "ping", "subscribe", "c1\n", "\nc1", "c 1", "é", "😀",
              "a" * 128, "a" * 129, "é" * 128, "😀" * 129, "\u202e" + "x" * 10, "\ufeff"]
EDGE_FLOATS = [0.0, -0.0, 0.5, 1.0, -1.5, 1e-300, 1.7976931348623157e308, 2.0**64]


def _nest(depth: int, as_list: bool) -> Any:
    value: Any = [] if as_list else {}
    for _ in range(depth - 1):
        value = [value] if as_list else {"a": value}
    return value


DEEP_PLAIN = [_nest(d, as_list) for d in (2, 10, 50, 100) for as_list in (True, False)]
# Strategies are built once: building them costs more than drawing from them.
TEXTS = st.one_of(st.sampled_from(EDGE_TEXTS), st.text(max_size=10))
SCALARS = st.one_of(st.sampled_from([None, True, False, *EDGE_INTS, *EDGE_FLOATS]),
                    st.integers(INT_MIN, UINT_MAX), TEXTS)
PLAIN = st.one_of(SCALARS, SCALARS, st.lists(SCALARS, max_size=3),
                  st.dictionaries(TEXTS, SCALARS, max_size=3), st.sampled_from(DEEP_PLAIN))


def plain_values() -> st.SearchStrategy[Any]:
    """JSON-like values both codecs carry (integers in 64 bits, finite floats), nested up to
    100 deep (well inside any decoder's limit)."""
    return PLAIN


# --- valid frames from the shapes -------------------------------------------------------


@dataclass(frozen=True)
class Targets:
    """The chat ids a frame names: mostly the fuzzed chats, some owned by someone else."""

    mine: tuple[str, ...]
    theirs: tuple[str, ...]


def valid_value(t: mi.Type, name: str, targets: Targets, max_text: int) -> st.SearchStrategy[Any]:
    """A value the schema takes for field ``name`` of type ``t``."""
    if name == "chat_id":
        fresh = st.integers(0, 2**40).map(lambda n: f"fz-{n:x}")
        return st.one_of(st.sampled_from(targets.mine * 6 + targets.theirs), fresh)
    if name == "text":
        return st.one_of(TEXTS, TEXTS, TEXTS, st.sampled_from(
            ["x" * (max_text - 1), "x" * max_text, "x" * (max_text + 1), "é" * (max_text // 2),
             "é" * (max_text // 2 + 1)]))
    if isinstance(t, mi.UnionType):
        return st.one_of([valid_value(m, name, targets, max_text) for m in t.types])
    if isinstance(t, mi.NoneType):
        return st.none()
    if isinstance(t, mi.IntType):
        low = t.ge if t.ge is not None else INT_MIN
        return st.one_of(st.integers(low, UINT_MAX),
                         st.sampled_from([v for v in EDGE_INTS if v >= low]))
    if isinstance(t, mi.StrType):
        high = t.max_length or 200
        edges = [s for s in [*EDGE_TEXTS, "x" * high, "😀" * high] if accepts(t, s)]
        return st.one_of(st.sampled_from(edges), st.text(min_size=t.min_length or 0,
                                                         max_size=min(high, 10)))
    if isinstance(t, mi.DictType):
        return st.dictionaries(TEXTS, PLAIN, max_size=3)
    if isinstance(t, mi.StructType):
        return struct_value(t, targets, max_text)
    return PLAIN.filter(lambda v: accepts(t, v))


def struct_value(shape: mi.StructType, targets: Targets,
                 max_text: int) -> st.SearchStrategy[dict[str, Any]]:
    required = {f.encode_name: valid_value(f.type, f.name, targets, max_text)
                for f in shape.fields if f.required}
    optional = {f.encode_name: valid_value(f.type, f.name, targets, max_text)
                for f in shape.fields if not f.required}
    base = st.fixed_dictionaries(required, optional=optional)
    if shape.tag is not None:
        return base.map(lambda d: {shape.tag_field or TAG: shape.tag, **d})
    return base


def valid_frames(targets: Targets, max_text: int) -> st.SearchStrategy[dict[str, Any]]:
    return st.one_of([struct_value(shape, targets, max_text) for shape in SHAPES.values()])


# --- what a frame may get back ----------------------------------------------------------


def combine(verdicts: list[frozenset[str]]) -> frozenset[str]:
    """The outcomes of a frame with several values' outcomes: the decoder stops at the first
    problem it meets, in an order this model does not fix."""
    problems = [v for v in verdicts if v != VALID]
    if not problems:
        return VALID
    if len(problems) == 1:
        return problems[0]
    out = frozenset().union(*problems)
    return out - VALID if any("valid" not in v for v in problems) else out


def value_outcomes(t: mi.Type, value: Any) -> frozenset[str]:
    if isinstance(value, Splice):
        if isinstance(t, mi.AnyType):
            return value.any
        if value.number is not None and _has_int(t):
            return VALID if accepts(t, value.number) else INVALID
        return value.typed
    if not _has_splice(value):
        return VALID if accepts(t, value) else INVALID
    # A container holding splices: its plain shape must fit, then each splice where it is.
    if isinstance(t, mi.UnionType):
        fitting = [m for m in t.types if _shape_fits(m, value)]
        return value_outcomes(fitting[0], value) if fitting else combine(
            [INVALID, *_splice_outcomes(value, "typed")])
    if isinstance(t, mi.AnyType):
        return combine(_splice_outcomes(value, "any"))
    if isinstance(t, mi.DictType) and isinstance(value, dict):
        return combine([value_outcomes(t.value_type, v) for v in value.values()]
                       + [VALID if accepts(t.key_type, k) else INVALID for k in value])
    if isinstance(t, mi.StructType) and isinstance(value, dict):
        return struct_outcomes(t, value)
    return combine([INVALID, *_splice_outcomes(value, "typed")])


def struct_outcomes(shape: mi.StructType, frame: dict[str, Any]) -> frozenset[str]:
    known = {f.encode_name: f for f in shape.fields}
    verdicts = [INVALID for name, f in known.items() if f.required and name not in frame]
    for name, value in frame.items():
        if name == shape.tag_field:
            continue
        f = known.get(name)
        verdicts.append(value_outcomes(f.type, value) if f is not None
                        else combine(_splice_outcomes(value, "unknown")))
    return combine(verdicts)


def frame_outcomes(frame: Any) -> tuple[frozenset[str], str | None]:
    """What a frame built of plain values and splices may get: ``valid`` and/or error codes;
    and its type when that is a known one."""
    if isinstance(frame, Splice):
        return frame.typed, None
    if not isinstance(frame, dict):
        return combine([INVALID, *_splice_outcomes(frame, "typed")]), None
    tag = frame.get(TAG)
    if isinstance(tag, str) and tag in SHAPES:
        return struct_outcomes(SHAPES[tag], frame), tag
    tag_outcome = tag.tag if isinstance(tag, Splice) else combine(
        [UNKNOWN, *_splice_outcomes(tag, "tag")])
    others = [combine(_splice_outcomes(v, "unknown")) for k, v in frame.items() if k != TAG]
    return combine([tag_outcome, *others]), None


def _has_int(t: mi.Type) -> bool:
    return isinstance(t, mi.IntType) or (
        isinstance(t, mi.UnionType) and any(isinstance(m, mi.IntType) for m in t.types))


def _has_splice(value: Any) -> bool:
    if isinstance(value, Splice):
        return True
    if isinstance(value, dict):
        return any(_has_splice(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_splice(v) for v in value)
    return False


def _splice_outcomes(value: Any, where: str) -> list[frozenset[str]]:
    if isinstance(value, Splice):
        return [getattr(value, where)]
    children = value.values() if isinstance(value, dict) else (
        value if isinstance(value, list) else ())
    return [o for child in children for o in _splice_outcomes(child, where)]


def _shape_fits(t: mi.Type, value: Any) -> bool:
    return (isinstance(t, mi.AnyType) or (isinstance(t, mi.DictType) and isinstance(value, dict))
            or (isinstance(t, mi.StructType) and isinstance(value, dict)))


# --- encoding ---------------------------------------------------------------------------


def encode(frame: Any, binary: bool) -> bytes:
    """``frame`` in MessagePack or JSON, each :class:`Splice` written in as its bytes."""
    splices: list[Splice] = []

    def placeholder(value: Any) -> Any:
        if isinstance(value, Splice):
            splices.append(value)
            return f"\x1fsplice-{len(splices) - 1}\x1f"
        if isinstance(value, dict):
            return {k: placeholder(v) for k, v in value.items()}
        if isinstance(value, list):
            return [placeholder(v) for v in value]
        return value

    enc = msgspec.msgpack.encode if binary else msgspec.json.encode
    data = enc(placeholder(frame))
    for i, splice in enumerate(splices):
        data = data.replace(enc(f"\x1fsplice-{i}\x1f"), splice.raw, 1)
    return data


# --- the frame as sent ------------------------------------------------------------------


@dataclass(frozen=True)
class Expect:
    """What may come back for one frame: a reply of ``replies`` (an ``error`` with one of
    ``codes``); or, for a frame the WebSocket layer refuses, the close ``close``."""

    replies: frozenset[str]
    codes: frozenset[str]
    close: int | None = None
    kind: str | None = None  # the frame's type when it is valid: the reply must be its own

    @classmethod
    def of(cls, outcomes: frozenset[str], kind: str | None) -> Expect:
        replies: set[str] = set()
        codes = set(outcomes - VALID)
        if "valid" in outcomes:
            assert kind is not None
            replies.add(REPLIES[kind])
            codes |= REFUSALS.get(kind, set())
        if codes:
            replies.add("error")
        return cls(frozenset(replies), frozenset(codes), None, kind)

    @property
    def bad(self) -> bool:
        """The frame may count as an invalid one (toward 4004)."""
        return bool(self.codes & BAD_CODES) or self.close is not None


    def or_bad(self) -> Expect:
        """The same, or refused as invalid (a frame the gateway may take or refuse)."""
        return Expect(self.replies | {"error"}, self.codes | BAD_CODES, self.close, self.kind)


ANYTHING = Expect(REPLY_TYPES, documented_error_codes())


class Wire:
    """One client frame as sent: its bytes, text or binary, and what may come back.

    ``echo``: its ``id`` and ``chat_id`` can be read, so a reply echoes them.
    """

    __slots__ = ("chat_id", "data", "echo", "expect", "label", "req_id", "text")

    def __init__(self, data: bytes, text: bool, expect: Expect, label: str,
                 echo: bool = False, req_id: Any = None, chat_id: Any = None) -> None:
        self.data, self.text, self.expect, self.label = data, text, expect, label
        self.echo, self.req_id, self.chat_id = echo, req_id, chat_id

    def __repr__(self) -> str:  # short: Hypothesis prints every frame of a failing example
        shown = self.data[:160] + (b"..." if len(self.data) > 160 else b"")
        return (f"<{self.label} {'text' if self.text else 'binary'} {len(self.data)}B "
                f"{shown!r}>")


def closes(code: int) -> Expect:
    return Expect(frozenset(), frozenset(), code)


def echoable(value: Any) -> bool:
    """An ``id``/``chat_id`` a reply may echo: a plain string or integer."""
    return isinstance(value, (str, int)) and not isinstance(value, bool)


# --- mutations --------------------------------------------------------------------------

NEAR_NAMES = ["Type", "type ", "chatId", "chat_Id", "ID", "since ", "text\x00", "", "_", "é",
              "pad", "x" * 200]
TYPES = [*SHAPES, "Ping", "PING", "ping ", "", "subscribed", "error", "hello", "conversation"]
OPS_PER_FRAME = [0, 0, 1, 1, 1, 1, 2, 3]
FRAME_OPS = ["id", "field", "field", "drop", "extra", "data", "type", "not_object", "nest"]
BYTE_OPS = ["keep"] * 12 + ["truncate", "flip", "insert", "trailing", "spaces", "bom",
                            "other_codec", "other_kind", "other_kind", "empty", "size"]
# Intact bytes of a frame of plain values: its id and chat_id can be read, so are echoed.
ECHOING_OPS = frozenset({"keep", "spaces", "other_kind", "size"})


class Chooser(Protocol):
    """Where a mutation's choices come from: Hypothesis draws, or a seeded generator."""

    def pick(self, options: Sequence[Any]) -> Any: ...

    def integer(self, low: int, high: int) -> int: ...

    def value(self) -> Any: ...

    def blob(self, low: int, high: int) -> bytes: ...


class Drawn:
    """Choices Hypothesis makes (and shrinks)."""

    def __init__(self, draw: st.DrawFn, values: st.SearchStrategy[Any]) -> None:
        self.draw = draw
        self.values = values

    def pick(self, options: Sequence[Any]) -> Any:
        return self.draw(st.sampled_from(options))

    def integer(self, low: int, high: int) -> int:
        return self.draw(st.integers(low, high))

    def value(self) -> Any:
        return self.draw(self.values)

    def blob(self, low: int, high: int) -> bytes:
        return self.draw(st.binary(min_size=low, max_size=high))


class Seeded:
    """Choices of a generator seeded by Hypothesis, among values Hypothesis drew: many more
    frames per example than drawing each choice would allow in a CI's few seconds."""

    def __init__(self, rng: random.Random, pool: Sequence[Any]) -> None:
        self.rng = rng
        self.pool = pool

    def pick(self, options: Sequence[Any]) -> Any:
        return options[self.rng.randrange(len(options))]

    def integer(self, low: int, high: int) -> int:
        return self.rng.randint(low, high)

    def value(self) -> Any:
        return self.pick(self.pool)

    def blob(self, low: int, high: int) -> bytes:
        return self.rng.randbytes(self.rng.randint(low, high))


class Frames:
    """Hostile frames for one connection: MessagePack (``binary``) or JSON."""

    def __init__(self, binary: bool, targets: Targets, max_frame: int, max_text: int) -> None:
        self.binary = binary
        self.max_frame = max_frame
        self.valid = valid_frames(targets, max_text)
        self.splices = msgpack_splices() if binary else json_splices()
        self.values = st.one_of(PLAIN, PLAIN, self.splices)  # a hostile value, of any type

    def batch(self, drawn: int, seeded: int) -> st.SearchStrategy[list[Wire]]:
        """``drawn`` frames whose every choice Hypothesis makes, then ``seeded`` more made
        from the same valid frames and hostile values by a generator it seeds."""

        @st.composite
        def make(draw: st.DrawFn) -> list[Wire]:
            bases = draw(st.lists(self.valid, min_size=drawn, max_size=drawn))
            chooser = Drawn(draw, self.values)
            wires = [self.wire(chooser, base) for base in bases]
            pool = draw(st.lists(self.values, min_size=4, max_size=8))
            seeded_chooser = Seeded(random.Random(draw(st.integers(0, 2**64 - 1))), pool)
            wires += [self.wire(seeded_chooser, seeded_chooser.pick(bases))
                      for _ in range(seeded)]
            return wires

        return make()

    def wire(self, choose: Chooser, frame: Any) -> Wire:
        """``frame`` (a valid one) mutated, encoded, and what may come back for it."""
        labels = [frame[TAG]]
        for _ in range(choose.pick(OPS_PER_FRAME)):
            op = choose.pick(FRAME_OPS)
            frame = self._mutate(choose, op, frame)
            labels.append(op)
        outcomes, kind = frame_outcomes(frame)
        expect = Expect.of(outcomes, kind)
        data = encode(frame, self.binary)
        text = not self.binary
        op = choose.pick(BYTE_OPS)
        if op != "keep":
            labels.append(op)
            data, text, expect = self._mutate_bytes(choose, op, frame, data, expect)
        if text and not _utf8(data) and choose.integer(0, 7):
            # Mostly as binary frames, which reach the decoder: as text, each one closes.
            text, expect = False, expect if self.binary else expect.or_bad()
        # The WebSocket layer comes first: the size of the frame, then UTF-8 in a text frame.
        if len(data) > self.max_frame:
            expect = closes(1009)
        elif text and not _utf8(data):
            expect = closes(1007)
        echo = isinstance(frame, dict) and not _has_splice(frame) and op in ECHOING_OPS
        return Wire(data, text, expect, "+".join(labels), echo,
                    frame.get("id") if echo else None, frame.get("chat_id") if echo else None)

    def _mutate(self, choose: Chooser, op: str, frame: Any) -> Any:
        if not isinstance(frame, dict):
            return frame
        frame = dict(frame)
        tag = frame.get(TAG)
        shape = SHAPES.get(tag) if isinstance(tag, str) else None
        names = [f.encode_name for f in shape.fields] if shape is not None else list(frame)
        if op == "id":
            frame["id"] = choose.value()
        elif op == "field" and names:
            frame[choose.pick(names)] = choose.value()
        elif op == "drop" and frame:
            frame.pop(choose.pick(list(frame)), None)
        elif op == "extra":
            name = choose.pick(NEAR_NAMES)
            frame[name] = choose.value()
        elif op == "data":
            frame["data"] = (choose.value() if choose.integer(0, 2) == 0 else
                             {choose.pick(EDGE_TEXTS): choose.value()
                              for _ in range(choose.integer(1, 3))})
        elif op == "type":
            frame[TAG] = choose.value() if choose.integer(0, 2) == 0 else choose.pick(TYPES)
        elif op == "not_object":
            return choose.pick([list(frame.values()), [choose.value()], choose.value()])
        elif op == "nest" and names:
            name = choose.pick(names)
            value = frame.get(name)
            for _ in range(choose.integer(1, 40)):
                value = [value] if choose.integer(0, 1) else {"v": value}
            frame[name] = value
        return frame

    def _mutate_bytes(self, choose: Chooser, op: str, frame: Any, data: bytes,
                      expect: Expect) -> tuple[bytes, bool, Expect]:
        binary = self.binary
        text = not binary
        if op == "truncate" and data:
            # Malformed, or invalid if a value before the cut already was.
            return data[:choose.integer(0, len(data) - 1)], text, Expect.of(BAD, None)
        if op == "flip" and data:
            out = bytearray(data)
            for _ in range(choose.integer(1, 3)):
                out[choose.integer(0, len(out) - 1)] = choose.integer(0, 255)
            return bytes(out), text, ANYTHING
        if op == "insert":
            at = choose.integer(0, len(data))
            return data[:at] + choose.blob(1, 8) + data[at:], text, ANYTHING
        if op == "trailing":
            junk = choose.pick([b"x", b"}", b"\x00", b"\xc0", b"{}"])
            # Decoded whole first: a frame refused anyway is refused for that.
            return data + junk, text, Expect.of(outcomes_without_valid(expect), None)
        if op == "spaces" and not binary:
            return b" \n\t" + data + b"\r\n ", text, expect
        if op == "bom" and not binary:
            return b"\xef\xbb\xbf" + data, text, Expect.of(MALFORMED, None)
        if op == "other_codec":  # the other codec's bytes in the other codec's frame kind
            return encode(frame, not binary), binary, Expect.of(BAD, None)
        if op == "other_kind":  # the gateway may take it, or refuse it as invalid
            return data, not text, expect.or_bad()
        if op == "empty":
            return b"", bool(choose.integer(0, 1)), Expect.of(MALFORMED, None)
        if op == "size" and isinstance(frame, dict) and "pad" not in frame:
            size = self.max_frame + choose.pick([-2, -1, 0, 0, -1, 0, 1, self.max_frame])
            return _padded(frame, binary, size), text, expect
        return data, text, expect


def outcomes_without_valid(expect: Expect) -> frozenset[str]:
    """A frame that would be valid is now malformed; one refused anyway keeps its codes."""
    bad = expect.codes & BAD_CODES
    return bad | MALFORMED


def _padded(frame: dict[str, Any], binary: bool, size: int) -> bytes:
    """``frame`` with an unknown field padding it to ``size`` bytes (or just over)."""
    pad = 0
    for _ in range(4):
        data = encode({**frame, "pad": "x" * pad}, binary)
        if len(data) == size:
            break
        pad = max(0, pad + size - len(data))
    return data


def _utf8(data: bytes) -> bool:
    try:
        data.decode()
    except UnicodeDecodeError:
        return False
    return True
