"""Events as agents and services publish them: validation, and the store's form.

Shared by the server (the HTTP publish route, the CLI) and the worker SDK, which publishes
straight to Redis: both turn a :class:`PublishEvent` into the same :class:`OutEvent`.
"""

from __future__ import annotations

import time
from typing import Annotated, Any

import msgspec

from . import protocol as p
from .errors import Rejected
from .redis.records import OutEvent

_encode = msgspec.json.encode
# Every event is stored once and sent in both wire formats: its data must fit MessagePack
# too (to_out_event; protocol.uncarried).
_to_msgpack = msgspec.msgpack.Encoder().encode
TITLE_MAX = p.TITLE_MAX

# The event types whose data the gateway reads, and the shape it must have (to_out_event).
TYPED_DATA: dict[str, type[msgspec.Struct]] = {
    "turn_end": p.TurnEndData, "goal_state": p.GoalState, "title": p.TitleData,
    "state": p.StateData,
}


def _typed_data_schema() -> dict[str, Any]:
    """JSON Schema of an event object whose ``data`` must fit its ``type`` (TYPED_DATA)."""
    _, components = msgspec.json.schema_components(TYPED_DATA.values())
    rules = []
    for kind, spec in TYPED_DATA.items():
        data = components[spec.__name__]
        then: dict[str, Any] = {"properties": {"data": data}}
        if data.get("required"):
            then["required"] = ["data"]
        rules.append({"if": {"properties": {"type": {"const": kind}}, "required": ["type"]},
                      "then": then})
    rules.append({"if": {"properties": {"type": {"not": {"enum": sorted(TYPED_DATA)}}}},
                  "then": {"properties": {"data": p.CARRIED_DATA}}})
    return {"allOf": rules}


# An event type an agent may publish: the gateway's own are refused (``reserved_type``).
AgentEventType = Annotated[str, msgspec.Meta(
    pattern=p.EVENT_TYPE_PATTERN,
    extra_json_schema={"not": {"enum": sorted(p.GATEWAY_ONLY_TYPES)}},
)]
# Documents what to_out_event checks of an event object, beyond its fields' types.
TYPED_EVENT = msgspec.Meta(extra_json_schema=_typed_data_schema())


def now_ms() -> int:
    return int(time.time() * 1000)


class PublishEvent(msgspec.Struct, frozen=True):
    """One event as an agent or service publishes it."""

    type: AgentEventType
    data: dict[str, Any] = {}
    durable: bool = True
    idempotency_key: Annotated[str, msgspec.Meta(min_length=1, max_length=200)] | None = None
    # Which run of the turn a streamed delta, or its commit, comes from: a redelivered turn
    # (another worker, another attempt) discards the open stream of the previous one.
    attempt: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_.-]{1,64}\Z")] | None = None


EventList = Annotated[list[Annotated[PublishEvent, TYPED_EVENT]],
                     msgspec.Meta(min_length=1, max_length=500)]


class PublishBatch(msgspec.Struct, frozen=True):
    events: EventList
    idempotency_key: Annotated[str, msgspec.Meta(min_length=1, max_length=200)] | None = None
    # The turn the events are written for: refused unless it is still the running turn.
    turn_id: p.NodeId | None = None


def clean_title(raw: str) -> str:
    title = " ".join(raw.split())
    if not 1 <= len(title) <= TITLE_MAX:
        raise Rejected("invalid_request", f"title must be 1-{TITLE_MAX} characters after trimming")
    return title


def _check_carried(value: Any, index: int | None) -> None:
    """Refuse what is to be stored if both wire formats cannot carry it."""
    why = p.uncarried(_to_msgpack, value, "$.data" if index is None else f"$.events[{index}].data")
    if why is not None:
        raise Rejected("unprocessable", why)


def to_out_event(event: PublishEvent, index: int | None = None) -> OutEvent:
    """Validate an agent event; complete the ones whose meaning the gateway owns.

    Every publisher's events pass here (the HTTP route, the CLI, the worker SDK), so this
    is where data that both wire formats cannot carry (an integer past 64 bits) is refused,
    ``unprocessable``, at ``$.data``, or ``$.events[index].data`` for the ``index``-th
    event of a batch: one MessagePack encode of what is stored (a typed event's struct).
    """
    kind = event.type
    if kind in p.GATEWAY_ONLY_TYPES:
        raise Rejected("reserved_type", f"event type {kind!r} is reserved for the gateway")
    spec = TYPED_DATA.get(kind)
    if spec is not None:
        try:
            typed = msgspec.convert(event.data, spec)
        except msgspec.ValidationError as exc:
            raise Rejected("invalid_request", f"{kind}: {exc}") from None
        if isinstance(typed, p.TurnEndData):
            # Its counts only: what is stored is what the totals sum, and both wire
            # formats carry each of them.
            usage = p.usage_counts(typed.usage) if typed.usage is not None else None
            fields: dict[str, Any] = {"reason": typed.reason, "usage": usage}
            if typed.error:
                fields["error"] = typed.error[:p.TURN_ERROR_MAX]
            body = _encode(fields)
            return OutEvent(type=kind, data=body, turn_id=typed.turn_id or "")
        _check_carried(typed, index)  # what is stored: its other fields are dropped
        if isinstance(typed, p.StateData):
            snapshot = _encode(typed.snapshot)
            return OutEvent(type=kind, data=b'{"snapshot":' + snapshot + b"}", state=snapshot)
        if isinstance(typed, p.GoalState):
            if typed.updated_at is None:
                typed.updated_at = now_ms()
            return OutEvent(type=kind, data=_encode(typed))
        assert isinstance(typed, p.TitleData)
        return OutEvent(type=kind, data=clean_title(typed.title).encode(),
                        title_source=typed.source)
    _check_carried(event.data, index)
    awaiting = ""
    if kind == "tool_call" and event.data.get("awaiting") is True:
        awaiting = _asking(event.data)
    # A streamed delta names its attempt, and so may its commit (`message` closing the
    # `delta` stream...); a commit without text takes the stream's text.
    return OutEvent(type=kind, data=_encode(event.data), durable=event.durable,
                    attempt=event.attempt or "", fill=event.durable and "text" not in event.data,
                    awaiting=awaiting)


class _Asking(msgspec.Struct, frozen=True):
    call_id: p.CallId
    name: p.ToolName
    args: Any = None


def _asking(data: dict[str, Any]) -> str:
    """A tool_call that asks a person (``awaiting: true``): ``"<call id> <name>"``, which
    the script checks against the conversation's client tools and keeps until answered."""
    try:
        asked = msgspec.convert(data, _Asking)
    except msgspec.ValidationError as exc:
        raise Rejected("invalid_request", f"tool_call: {exc}") from None
    return f"{asked.call_id} {asked.name}"
