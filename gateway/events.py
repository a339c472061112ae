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
TITLE_MAX = 200


def now_ms() -> int:
    return int(time.time() * 1000)


class PublishEvent(msgspec.Struct, frozen=True):
    """One event as an agent or service publishes it."""

    type: p.EventType
    data: dict[str, Any] = {}
    durable: bool = True
    idempotency_key: Annotated[str, msgspec.Meta(min_length=1, max_length=200)] | None = None
    # Which run of the turn a streamed delta, or its commit, comes from: a redelivered turn
    # (another worker, another attempt) discards the open stream of the previous one.
    attempt: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_.-]{1,64}$")] | None = None


class PublishBatch(msgspec.Struct, frozen=True):
    events: Annotated[list[PublishEvent], msgspec.Meta(min_length=1, max_length=500)]
    idempotency_key: Annotated[str, msgspec.Meta(min_length=1, max_length=200)] | None = None


def clean_title(raw: str) -> str:
    title = " ".join(raw.split())
    if not 1 <= len(title) <= TITLE_MAX:
        raise Rejected("invalid_request", f"title must be 1-{TITLE_MAX} characters after trimming")
    return title


def to_out_event(event: PublishEvent) -> OutEvent:
    """Validate an agent event; complete the ones whose meaning the gateway owns."""
    kind = event.type
    if kind in p.GATEWAY_ONLY_TYPES:
        raise Rejected("reserved_type", f"event type {kind!r} is reserved for the gateway")
    try:
        if kind == "turn_end":
            end = msgspec.convert(event.data, p.TurnEndData)
            body = _encode({"reason": end.reason, "usage": end.usage})
            return OutEvent(type=kind, data=body, turn_id=end.turn_id or "")
        if kind == "goal_state":
            goal = msgspec.convert(event.data, p.GoalState)
            if goal.updated_at is None:
                goal.updated_at = now_ms()
            return OutEvent(type=kind, data=_encode(goal))
        if kind == "title":
            title = msgspec.convert(event.data, p.TitleData)
            return OutEvent(type=kind, data=clean_title(title.title).encode(),
                            title_source=title.source)
    except msgspec.ValidationError as exc:
        raise Rejected("invalid_request", f"{kind}: {exc}") from None
    # A streamed delta names its attempt, and so may its commit (`message` closing the
    # `delta` stream...); a commit without text takes the stream's text.
    return OutEvent(type=kind, data=_encode(event.data), durable=event.durable,
                    attempt=event.attempt or "", fill=event.durable and "text" not in event.data)
