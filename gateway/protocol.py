"""Wire protocol v1: every frame as a msgspec Struct, and the JSON/MessagePack codecs.

No I/O lives here. ``protocol.md`` is the prose version of this module; keep them in step.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Annotated, Any, Literal

import msgspec

JSON_SUBPROTOCOL = "gateway.v1.json"
MSGPACK_SUBPROTOCOL = "gateway.v1.msgpack"

# ``\Z``, not ``$``: Python's ``$`` also matches before a final newline.
CHAT_ID_PATTERN = r"^[A-Za-z0-9_.:-]{1,128}\Z"
EVENT_TYPE_PATTERN = r"^[a-z][a-z0-9_.]{0,63}\Z"
CHAT_ID_RE = re.compile(CHAT_ID_PATTERN)

ChatId = Annotated[str, msgspec.Meta(pattern=CHAT_ID_PATTERN)]
EventType = Annotated[str, msgspec.Meta(pattern=EVENT_TYPE_PATTERN)]
ClientMsgId = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
RequestId = Annotated[str, msgspec.Meta(max_length=128)] | Annotated[int, msgspec.Meta(ge=0)]
# Seqs are counted by Lua (doubles): none passes 2**53 - 1, which JSON readers (JavaScript's
# too) hold exactly. A larger one is refused, not sent to Redis (whose stream ids end at
# 2**64 - 1).
MAX_SEQ = 2**53 - 1
Seq = Annotated[int, msgspec.Meta(ge=0, le=MAX_SEQ)]

TITLE_MAX = 200
# Whitespace as str.split() sees it (titles are trimmed and collapsed with it), spelled out
# so that every regex dialect reading the schema (msgspec's, a JSON Schema validator's)
# means the same set: a title must hold something else.
_SPACE = r"\t\n\x0b\x0c\r\x1c-\x1f \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
Title = Annotated[str, msgspec.Meta(min_length=1, max_length=TITLE_MAX, pattern=f"[^{_SPACE}]")]
NodeId = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_.:-]{1,128}\Z")]
# An agent's name (a conversation's `agent`, `gateway agent --name`, GATEWAY_DEFAULT_AGENT).
AGENT_NAME_PATTERN = r"^[a-z0-9][a-z0-9_.-]{0,63}\Z"
AgentName = Annotated[str, msgspec.Meta(pattern=AGENT_NAME_PATTERN)]
# The head a tree operation expects: absent for any, null for none (an empty conversation).
ExpectedHead = NodeId | None | msgspec.UnsetType

# Event types whose meaning the gateway owns: agents cannot publish them as-is.
GATEWAY_ONLY_TYPES = frozenset(
    {"user_message", "turn_start", "cancel_requested", "deleted", "conversation",
     "client_tools",
     "stream_discarded", "head", "child", "hello", "subscribed", "unsubscribed", "left",
     "ack", "pong", "error", "presence", "typing", "typed", "members", "removed"}
)


# --- client -> server -------------------------------------------------------------------


class Since(msgspec.Struct, frozen=True):
    seq: Seq
    epoch: str


class Subscribe(msgspec.Struct, tag="subscribe", tag_field="type", frozen=True):
    chat_id: ChatId
    since: Since | None = None
    id: RequestId | None = None
    create: bool = True  # false: a conversation that does not exist is not_found, not created
    agent: AgentName | None = None  # the agent that answers it, when this creates it


class Unsubscribe(msgspec.Struct, tag="unsubscribe", tag_field="type", frozen=True):
    chat_id: ChatId
    id: RequestId | None = None


class Leave(msgspec.Struct, tag="leave", tag_field="type", frozen=True):
    chat_id: ChatId
    id: RequestId | None = None


class Message(msgspec.Struct, tag="message", tag_field="type", frozen=True):
    chat_id: ChatId
    text: str
    client_msg_id: ClientMsgId
    data: dict[str, Any] | None = None
    id: RequestId | None = None
    expected_head: ExpectedHead = msgspec.UNSET
    cancel: bool = False


class Retry(msgspec.Struct, tag="retry", tag_field="type", frozen=True):
    chat_id: ChatId
    expected_head: ExpectedHead = msgspec.UNSET
    cancel: bool = False
    id: RequestId | None = None


class Edit(msgspec.Struct, tag="edit", tag_field="type", frozen=True):
    chat_id: ChatId
    msg_id: NodeId
    text: str
    client_msg_id: ClientMsgId | None = None
    expected_head: ExpectedHead = msgspec.UNSET
    cancel: bool = False
    id: RequestId | None = None


class Undo(msgspec.Struct, tag="undo", tag_field="type", frozen=True):
    chat_id: ChatId
    expected_head: ExpectedHead = msgspec.UNSET
    cancel: bool = False
    id: RequestId | None = None


class Switch(msgspec.Struct, tag="switch", tag_field="type", frozen=True):
    chat_id: ChatId
    node_id: NodeId
    expected_head: ExpectedHead = msgspec.UNSET
    cancel: bool = False
    id: RequestId | None = None


# A tool call's id (the agent's, or the SDK's): no space, as the script keeps it in a list.
CallId = Annotated[str, msgspec.Meta(pattern=r"^[^\s]{1,128}\Z")]
ToolName = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z_][A-Za-z0-9_.-]{0,63}\Z")]


class ClientTool(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A tool the agent may call to ask a person: its arguments' JSON Schema and,
    optionally, the answer's."""

    name: ToolName
    parameters: dict[str, Any]  # JSON Schema of the arguments the agent passes
    description: Annotated[str, msgspec.Meta(max_length=2000)] = ""
    result: dict[str, Any] | None = None  # JSON Schema of the answer a person gives


class ToolResult(msgspec.Struct, tag="tool_result", tag_field="type", frozen=True):
    """A person answers a client tool call that awaits them."""

    chat_id: ChatId
    call_id: CallId
    result: Any
    id: RequestId | None = None


class Refresh(msgspec.Struct, tag="refresh", tag_field="type", frozen=True):
    """A fresh token for the same user, in band: the connection and its subscriptions
    stay as they are."""

    token: Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]
    id: RequestId | None = None


class Cancel(msgspec.Struct, tag="cancel", tag_field="type", frozen=True):
    chat_id: ChatId
    turn_id: str | None = None
    id: RequestId | None = None


class Ping(msgspec.Struct, tag="ping", tag_field="type", frozen=True):
    id: RequestId | None = None


class Typing(msgspec.Struct, tag="typing", tag_field="type", frozen=True):
    """The person is typing in ``chat_id``: the other subscribers get a ``typing`` frame."""

    chat_id: ChatId
    id: RequestId | None = None


ClientFrame = (Subscribe | Unsubscribe | Leave | Message | Cancel | Ping | Retry | Edit | Undo
               | Switch | ToolResult | Typing | Refresh)


class Envelope(msgspec.Struct):
    """The lenient view of a frame that failed validation, to echo ``id`` and ``chat_id``."""

    type: Any = None
    id: Any = None
    chat_id: Any = None


# --- server -> client -------------------------------------------------------------------


class Limits(msgspec.Struct, frozen=True):
    max_frame_bytes: int
    max_text_bytes: int
    max_subscriptions: int
    replay_limit: int
    rate_limit: float
    buffer_max_frames: int
    buffer_max_bytes: int
    buffer_ttl: float
    typing_interval: float = 2.0  # a connection's `typing` frames per chat: one per this


class Hello(msgspec.Struct, tag="hello", tag_field="type", omit_defaults=False):
    connection_id: str
    user_id: str
    role: str
    heartbeat_interval: float
    limits: Limits
    protocol: str = "v1"


class StreamSnapshot(msgspec.Struct):
    """An open stream: its text so far; the next live delta has position ``pos``."""

    id: str
    type: str
    turn_id: str
    text: str
    pos: int


class UsageTotals(msgspec.Struct, frozen=True):
    """A conversation's usage: ``billed`` sums every turn ever (it only grows), ``active``
    the turns on the active path (it follows the head)."""

    billed: dict[str, int | float] = {}
    active: dict[str, int | float] = {}

    @classmethod
    def of(cls, billed: bytes, active: bytes) -> UsageTotals:
        """From the meta hash's JSON fields."""
        decode = msgspec.json.decode
        return cls(decode(billed, type=dict[str, int | float]),
                   decode(active, type=dict[str, int | float]))


class ChildSummary(msgspec.Struct, frozen=True):
    """A sub-conversation as its parent lists it."""

    chat_id: str
    title: str | None
    status: Literal["idle", "running"]
    usage: UsageTotals


class PresentUser(msgspec.Struct, frozen=True):
    """A user connected to a conversation now, with their number of connections."""

    user_id: str
    connections: int


class PresentAgent(msgspec.Struct, frozen=True):
    """An agent running a turn in a conversation now, with its number of workers there."""

    name: str
    workers: int


class PresenceList(msgspec.Struct, frozen=True):
    """Who is connected to a conversation now (``subscribed.snapshot.presence``, the
    ``presence`` frame, ``GET .../presence``). ``v`` only grows: keep the highest."""

    v: int
    users: list[PresentUser]
    agents: list[PresentAgent]


class TypingFrame(msgspec.Struct, tag="typing", tag_field="type", frozen=True):
    """Someone is typing in ``chat_id`` (ephemeral: never stored, never replayed)."""

    chat_id: str
    user_id: str
    ts: int


class MembersFrame(msgspec.Struct, tag="members", tag_field="type", frozen=True):
    """Who shares ``chat_id`` changed (ephemeral; lua/members.lua writes it): the owner
    and ``members``, user -> ``member`` or ``viewer``, after the change."""

    chat_id: str
    owner: str
    members: dict[str, str]
    ts: int


class RemovedFrame(msgspec.Struct, tag="removed", tag_field="type", frozen=True):
    """``user_id`` was removed from ``chat_id``: sent to that user's subscriptions and
    streams only, each of which ends (buffer dropped)."""

    chat_id: str
    user_id: str
    reason: str
    ts: int


class Snapshot(msgspec.Struct, omit_defaults=True):
    title: str | None
    status: Literal["idle", "running"]
    turn_id: str | None
    started_at: int | None
    goal_state: msgspec.Raw | None
    # Omitted only when the connection already holds every open stream (an intact buffer
    # drain, or a subscribe to a chat that is already live).
    streams: list[StreamSnapshot] | None = None
    head: str | msgspec.UnsetType | None = msgspec.UNSET  # the node the next message follows
    usage: UsageTotals | None = None
    message_count: int | None = None  # user messages and turns on the active path
    children: list[ChildSummary] | msgspec.UnsetType = msgspec.UNSET  # omitted: none
    # The agent's state, the last `state` event's snapshot; omitted when there is none.
    state: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET
    # Client tool calls awaiting a person's answer: {call_id: tool name}; omitted: none.
    awaiting: dict[str, str] | msgspec.UnsetType = msgspec.UNSET
    agent: str | msgspec.UnsetType = msgspec.UNSET  # the agent that answers it
    presence: PresenceList | msgspec.UnsetType = msgspec.UNSET  # who is connected now


class Subscribed(msgspec.Struct, tag="subscribed", tag_field="type", omit_defaults=True):
    chat_id: str
    epoch: str
    seq: int
    recovered: bool
    replayed: int
    snapshot: Snapshot
    id: RequestId | None = None
    buffered: int | None = None
    overflowed: bool | None = None


class Unsubscribed(msgspec.Struct, tag="unsubscribed", tag_field="type", omit_defaults=True):
    chat_id: str
    id: RequestId | None = None


class Left(msgspec.Struct, tag="left", tag_field="type", omit_defaults=True):
    chat_id: str
    id: RequestId | None = None


class Ack(msgspec.Struct, tag="ack", tag_field="type", omit_defaults=True):
    chat_id: str
    seq: int | None
    client_msg_id: str | None
    turn_id: str | None
    duplicate: bool
    id: RequestId | None = None
    head: str | msgspec.UnsetType | None = msgspec.UNSET  # a tree operation's new head
    msg_id: str | msgspec.UnsetType = msgspec.UNSET  # the user message it added or took back
    text: str | msgspec.UnsetType = msgspec.UNSET  # undo: the text taken back


class Typed(msgspec.Struct, tag="typed", tag_field="type", omit_defaults=True):
    """The reply to ``typing``: ``sent`` false when this connection's limit dropped it."""

    chat_id: str
    sent: bool
    id: RequestId | None = None


class TokenExpiring(msgspec.Struct, tag="token_expiring", tag_field="type"):
    """The connection's token expires at ``expires_at`` (ms): send ``refresh`` before it,
    else the connection closes with 4011 then."""

    expires_at: int


class Refreshed(msgspec.Struct, tag="refreshed", tag_field="type", omit_defaults=True):
    """The reply to ``refresh``: the connection runs on the new token until ``expires_at``."""

    expires_at: int
    id: RequestId | None = None


class Pong(msgspec.Struct, tag="pong", tag_field="type", omit_defaults=True):
    ts: int
    id: RequestId | None = None


class Error(msgspec.Struct, tag="error", tag_field="type", omit_defaults=True):
    code: str
    message: str
    id: Any = None
    chat_id: Any = None
    head: str | msgspec.UnsetType | None = msgspec.UNSET  # a refused tree operation: the head


# --- agent-published payloads the gateway interprets -----------------------------------


class GoalState(msgspec.Struct, forbid_unknown_fields=False):
    active: bool
    status: Annotated[str, msgspec.Meta(max_length=64)] = "active"
    objective: Annotated[str, msgspec.Meta(max_length=4096)] = ""
    ui_summary: Annotated[str, msgspec.Meta(max_length=120)] = ""
    recap: Annotated[str, msgspec.Meta(max_length=16384)] | None = None
    updated_at: int | None = None


# What a turn cost, as its agent reports it: its provider's usage object as it comes
# (``input_tokens``, ``cost``, OpenAI's ``prompt_tokens_details: {cached_tokens}``...).
# usage_counts keeps its counts, summed into the conversation's totals. The bound keeps
# every sum exact in a double (Lua's numbers).
USAGE_MAX = 10**15
USAGE_NAMES_MAX = 32
USAGE_NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]{0,63}\Z")
USAGE_DEPTH_MAX = 4


def usage_counts(usage: dict[str, Any]) -> dict[str, int | float]:
    """The counts of a usage object: each number from 0 to ``USAGE_MAX``, by its name, a
    nested one under a dotted name (``prompt_tokens_details.cached_tokens``). Anything else
    (text, booleans, lists, a name past 64 characters, a count past the 32nd) is not a
    count and is dropped: a turn's end is never refused for its usage."""
    counts: dict[str, int | float] = {}

    def walk(prefix: str, value: Any, depth: int) -> None:
        if isinstance(value, dict):
            if depth < USAGE_DEPTH_MAX:
                for name, inner in value.items():
                    walk(f"{prefix}{name}.", inner, depth + 1)
            return
        name = prefix[:-1]
        if (type(value) in (int, float) and 0 <= value <= USAGE_MAX
                and len(counts) < USAGE_NAMES_MAX and USAGE_NAME_RE.match(name)):
            counts[name] = value

    walk("", usage, 0)
    return counts


TURN_ERROR_MAX = 2000


class TurnEndData(msgspec.Struct):
    # awaiting_input: the agent asked a person (a client tool) and waits for the answer
    reason: Literal["complete", "cancelled", "error", "timeout", "awaiting_input"] = "complete"
    turn_id: str | None = None
    # Any object: its counts are kept (usage_counts), the rest dropped.
    usage: dict[str, Any] | None = None
    # What went wrong, in words a person can read (reason "error"); cut to TURN_ERROR_MAX.
    error: str | None = None


class StateData(msgspec.Struct):
    """The agent's state (AG-UI's STATE_SNAPSHOT, or a delta applied): any JSON value."""

    snapshot: Any


class TitleData(msgspec.Struct):
    title: Title
    source: Annotated[str, msgspec.Meta(max_length=32)] = "agent"


# --- codecs -----------------------------------------------------------------------------


class Codec:
    """Encode and decode frames in one of the two wire formats."""

    def __init__(self, subprotocol: str) -> None:
        self.subprotocol = subprotocol
        self.binary = subprotocol == MSGPACK_SUBPROTOCOL
        if self.binary:
            self._decode = msgspec.msgpack.Decoder(ClientFrame).decode
            self._envelope = msgspec.msgpack.Decoder(Envelope).decode
            self.encode = msgspec.msgpack.Encoder().encode
            self._other = msgspec.json.Encoder().encode
        else:
            self._decode = msgspec.json.Decoder(ClientFrame).decode
            self._envelope = msgspec.json.Decoder(Envelope).decode
            self.encode = msgspec.json.Encoder().encode
            self._other = msgspec.msgpack.Encoder().encode

    def decode(self, data: bytes) -> ClientFrame:
        """Decode one client frame; raises ``msgspec.DecodeError`` with a readable message."""
        try:
            frame: ClientFrame = self._decode(data)
        except RecursionError:
            raise msgspec.ValidationError("the frame is nested too deeply") from None
        except UnicodeDecodeError:  # msgspec checks a string's UTF-8 as it decodes it
            raise msgspec.DecodeError("a string is not valid UTF-8") from None
        # What is stored must go out in both wire formats: a message's data, an answer.
        why = None
        if isinstance(frame, Message) and frame.data is not None:
            why = uncarried(self._other, frame.data, "$.data")
        elif isinstance(frame, ToolResult):
            why = uncarried(self._other, frame.result, "$.result")
        if why is not None:
            raise msgspec.ValidationError(why)
        return frame

    def envelope(self, data: bytes) -> Envelope:
        try:
            envelope: Envelope = self._envelope(data)
            return envelope
        except (msgspec.DecodeError, RecursionError, UnicodeDecodeError):
            return Envelope()


# What a client's or an agent's data may hold, as the API document says it: any JSON, but
# integers only where MessagePack has them too (uncarried checks it; recursive, so the
# document defines it once, as the component JSON_VALUE).
JSON_VALUE = "JsonValue"
CARRIED_VALUE = {"$ref": f"#/components/schemas/{JSON_VALUE}"}
CARRIED_DATA = {"type": "object", "additionalProperties": CARRIED_VALUE}
JSON_VALUE_SCHEMA: dict[str, Any] = {
    "description": "Any JSON value. An integer is refused (422) outside -2^63 to 2^64 - 1, "
                   "which both wire formats carry; a number with a fraction or an exponent "
                   "is a float and taken whatever its size. (A schema cannot tell the two "
                   "apart: 1e300 is an integer to it.)",
    "anyOf": [
        {"type": ["string", "boolean", "null"]},
        {"type": "number"},
        {"type": "array", "items": CARRIED_VALUE},
        {"type": "object", "additionalProperties": CARRIED_VALUE},
    ],
}


def uncarried(other: Callable[[Any], bytes], data: Any, at: str) -> str | None:
    """Why ``data``, decoded from one wire format, cannot be encoded by ``other`` (the other
    format's encoder), naming where it is (``at``); None when it can.

    Clients' data (a ``message``'s, a published event's) is stored once, then sent in both
    formats: what one of them cannot carry (integers past 64 bits in MessagePack;
    MessagePack extensions, maps keyed by non-strings in JSON) is refused up front.
    """
    try:
        other(data)
    except (TypeError, OverflowError) as exc:
        return f"{exc} - at `{at}`"
    return None


def error_message(exc: msgspec.DecodeError | msgspec.ValidationError) -> tuple[str, str]:
    """Map a msgspec failure to an ``(error code, message)`` pair for the wire."""
    text = str(exc)
    if isinstance(exc, msgspec.ValidationError):
        if "`$.type`" in text or "missing required field `type`" in text:
            return "unknown_type", text
        return "invalid_frame", text
    return "malformed", text
