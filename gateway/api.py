"""HTTP routes: conversations, publishing, history, health, and the API's own document.

Each route is declared once, with ``@API.operation`` on its handler: that entry is both
the Starlette route and the OpenAPI document's entry (:mod:`gateway.openapi`), and the
Structs below are what the handlers decode and encode, so ``/v1/openapi.json`` is the
contract the replies keep.
"""

from __future__ import annotations

import asyncio
import functools
import secrets
from collections.abc import Awaitable, Mapping
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar, cast

import msgspec
from msgspec import UNSET, UnsetType
from redis.exceptions import RedisError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from . import __version__, ag_ui_frontend, ai_sdk, logs, sse, tools
from . import protocol as p
from .auth import AuthError, Principal, check_access, check_owner
from .errors import ErrorBody, ErrorDetail, Rejected
from .events import TYPED_EVENT, AgentEventType, EventList, PublishBatch, PublishEvent
from .openapi import Api
from .redis.agent_registry import LiveAgent
from .redis.listing import CURSOR_PATTERN, ListFilter, Place
from .redis.records import Meta
from .request_parts import chat_id_of, gateway_of, principal_of

if TYPE_CHECKING:
    from .runtime import Gateway

MAX_BODY_BYTES = 1 << 20
T = TypeVar("T")
_encode = msgspec.json.encode
EVENT_STREAM = sse.MEDIA_TYPE
NO_STORE = {"Cache-Control": "no-store"}  # a reply that holds a credential

# A new route: its handler below with @API.operation(...), and the type of any new path
# parameter here. Nothing else: the route and its document entry come from that one place.
API = Api(path_params={"chat_id": p.ChatId})


class JSONResponse(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return content if isinstance(content, bytes) else _encode(content)


def _error_body(code: str, message: str, head: str | None = None) -> bytes:
    # A refused tree operation names the head now (null for none).
    return _encode(ErrorBody(ErrorDetail(code, message,
                                         UNSET if head is None else head or None)))


def error_response(status: int, code: str, message: str,
                   headers: Mapping[str, str] | None = None,
                   head: str | None = None) -> JSONResponse:
    return JSONResponse(_error_body(code, message, head), status_code=status,
                        headers=headers)


# --- what the routes take -------------------------------------------------------------


class NewConversation(msgspec.Struct, frozen=True):
    chat_id: p.ChatId | None = None
    title: p.Title | None = None
    parent_chat_id: p.ChatId | None = None  # a sub-conversation of this one
    # The agent that answers it: GATEWAY_DEFAULT_AGENT, or for a sub-conversation its
    # parent's, when none is named.
    agent: p.AgentName | None = None


class Change(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A conversation's title, its client tools, or both."""

    title: p.Title | UnsetType = UNSET
    # The tools its agent may call to ask a person (all of them: replaces the last list).
    client_tools: Annotated[list[p.ClientTool], msgspec.Meta(max_length=tools.MAX_TOOLS)] \
        | UnsetType = UNSET


# Documents the rule rename_conversation enforces: at least one of the two.
CHANGE_BODY = Annotated[Change, msgspec.Meta(extra_json_schema={
    "anyOf": [{"required": ["title"]}, {"required": ["client_tools"]}],
})]


class Answer(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    call_id: p.CallId
    result: Any


# Query Structs: an optional parameter defaults to UNSET, never None, since lax conversion
# would read "?cursor=null" as None (openapi.py refuses a nullable query parameter).


Millis = Annotated[int, msgspec.Meta(ge=0, le=10**15)]


class ListQuery(msgspec.Struct, frozen=True):
    """``GET /v1/conversations``: a page, and the filters (protocol.md, the list)."""

    limit: Annotated[int, msgspec.Meta(ge=1, le=200)] = 50
    cursor: Annotated[str, msgspec.Meta(pattern=CURSOR_PATTERN)] | UnsetType = UNSET
    status: Literal["running", "idle"] | UnsetType = UNSET
    q: Annotated[str, msgspec.Meta(min_length=1, max_length=200)] | UnsetType = UNSET
    updated_after: Millis | UnsetType = UNSET
    updated_before: Millis | UnsetType = UNSET
    include_children: bool = False  # conversations with a parent too
    agent: p.AgentName | UnsetType = UNSET  # the ones that agent answers

    def wanted(self) -> ListFilter:
        def given(value: T | UnsetType) -> T | None:
            return None if isinstance(value, UnsetType) else value

        return ListFilter(status=given(self.status), q=given(self.q),
                          updated_after=given(self.updated_after),
                          updated_before=given(self.updated_before),
                          include_children=self.include_children, agent=given(self.agent))


class HistoryQuery(msgspec.Struct, frozen=True):
    after: p.Seq = 0
    limit: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 100
    view: Literal["active", "all"] = "active"  # the active path, or every branch


class TreeOpBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``POST .../retry``, ``.../undo``: the WebSocket frame's fields but type and id."""

    expected_head: p.ExpectedHead = UNSET  # null: no head expected (an empty conversation)
    cancel: bool = False  # end a running turn first instead of being refused


class EditBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    msg_id: p.NodeId
    text: str
    client_msg_id: p.ClientMsgId | None = None
    expected_head: p.ExpectedHead = UNSET
    cancel: bool = False


class SwitchBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    node_id: p.NodeId
    expected_head: p.ExpectedHead = UNSET
    cancel: bool = False


LastEventId = Annotated[str, msgspec.Meta(pattern=sse.LAST_EVENT_ID_RE.pattern)]


# Each event's data: one line of JSON (protocol.md, "Server-Sent Events").
_SSE_DATA = msgspec.Meta(extra_json_schema={
    "contentMediaType": "application/json",
    "contentSchema": {"type": "object", "required": ["chat_id"],
                      "properties": {"chat_id": {"type": "string"}}},
    "description": "one line of JSON: the event frame as stored (`type`, `chat_id`, `seq`, "
                   "`ts`, `data`, ...); for `ready` and `reset` the conversation's state "
                   "`{chat_id, epoch, seq, recovered, status, title, turn_id, started_at, "
                   "goal_state, usage, message_count}`; for `stream` an open stream "
                   "`{chat_id, id, type, turn_id, text, pos}`",
})


class StreamEvent(msgspec.Struct, frozen=True):
    """One event of ``GET .../stream`` as an SSE client parses it (``: ping`` comments
    carry no event)."""

    # The frame's type, or `ready`, `reset` (where the stream starts) or `stream`.
    event: Annotated[str, msgspec.Meta(pattern=r"^[a-z][a-z0-9_.]{0,63}$")]
    data: Annotated[str, _SSE_DATA]
    # `<epoch>:<seq>`, or `<epoch>:<seq>:<stream>:<pos>` on a streamed piece; the position
    # to resume from. Only `deleted` has none.
    id: LastEventId | UnsetType = UNSET


class StreamQuery(msgspec.Struct, frozen=True):
    # The Last-Event-ID header wins over it; sse.endpoint checks both with this pattern.
    last_event_id: LastEventId | UnsetType = UNSET


class PublishBody(msgspec.Struct, frozen=True):
    """One event (`type`, `data`, ...) or a batch of them (`events`)."""

    # Unset rather than None: `"type": null` is not a way to leave it out.
    type: AgentEventType | UnsetType = UNSET
    data: dict[str, Any] = {}
    durable: bool = True
    idempotency_key: Annotated[str, msgspec.Meta(min_length=1, max_length=200)] | None = None
    events: EventList | UnsetType = UNSET
    attempt: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_.-]{1,64}\Z")] | None = None
    # The turn the events are written for: refused (409) once it has ended, so a late
    # answer never lands in the next turn. Without it they join whichever turn runs.
    turn_id: p.NodeId | None = None

    def batch(self) -> PublishBatch:
        if not isinstance(self.events, UnsetType):
            if not isinstance(self.type, UnsetType):
                raise Rejected("unprocessable", "give either `type` (one event) or `events`")
            return PublishBatch(self.events, self.idempotency_key, self.turn_id)
        if isinstance(self.type, UnsetType):
            raise Rejected("unprocessable", "Object missing required field `type`")
        one = PublishEvent(self.type, self.data, self.durable, self.idempotency_key,
                           self.attempt)
        return PublishBatch([one], self.idempotency_key, self.turn_id)


# Documents the one-event-or-batch rule PublishBody.batch() enforces.
PUBLISH_BODY = Annotated[PublishBody, TYPED_EVENT, msgspec.Meta(extra_json_schema={
    "oneOf": [{"required": ["type"]}, {"required": ["events"]}],
})]


# --- what the routes answer -----------------------------------------------------------


class Conversation(msgspec.Struct, frozen=True):
    """A conversation as the HTTP API shows it."""

    chat_id: p.ChatId
    owner: str
    title: str | None
    status: Literal["idle", "running"]
    turn_id: str | None
    epoch: str
    last_seq: int
    created_at: int
    updated_at: int
    goal_state: p.GoalState | None
    preview: str | None
    head: str | None  # the node the next message follows (protocol.md, the tree)
    usage: p.UsageTotals
    message_count: int  # user messages and turns on the active path
    parent: str | None = None  # a sub-conversation: its parent's chat_id
    agent: str = "default"  # the agent that answers it
    client_tools: list[p.ClientTool] = []  # what its agent may ask a person
    awaiting: dict[str, str] = {}  # client tool calls awaiting an answer: call_id -> name
    members: dict[str, str] = {}  # who it is shared with besides its owner: user -> role

    @classmethod
    def of(cls, chat_id: str, meta: Meta) -> Conversation:
        goal = msgspec.json.decode(meta.goal, type=p.GoalState) if meta.goal else None
        return cls(chat_id, meta.owner, meta.title,
                   "running" if meta.status == "running" else "idle", meta.turn_id,
                   meta.epoch, meta.seq, meta.created_at, meta.updated_at, goal, meta.preview,
                   meta.head, p.UsageTotals.of(meta.usage_billed, meta.usage_active),
                   meta.message_count, parent=meta.parent, agent=meta.agent,
                   client_tools=tools.declared(meta.tools),
                   awaiting=msgspec.json.decode(meta.awaiting) if meta.awaiting else {},
                   members=meta.members)


class Children(msgspec.Struct, frozen=True):
    chat_id: p.ChatId
    children: list[p.ChildSummary]  # oldest first


class ConversationPage(msgspec.Struct, frozen=True):
    conversations: list[Conversation]
    # Give it as ?cursor= for the next page (it may be short, even empty); null on the last.
    next_cursor: str | None


class Published(msgspec.Struct, frozen=True):
    chat_id: p.ChatId
    epoch: str
    seqs: list[int | None]  # one per event: its seq, or null for an ephemeral one
    last_seq: int
    duplicate: bool  # a repeated idempotency_key: the first result, nothing written
    turn_id: str | None = None  # the turn its durable events were filed under (null: none)


class EventFrame(msgspec.Struct, frozen=True):
    """A durable event as stored and sent (protocol.md, "Event frames")."""

    type: str
    chat_id: p.ChatId
    seq: int
    ts: int
    data: dict[str, Any]


class Fork(msgspec.Struct, frozen=True):
    siblings: list[str]  # the node and its siblings, by creation
    index: int  # the node's place among them


class HistoryPage(msgspec.Struct, frozen=True, omit_defaults=True):
    chat_id: p.ChatId
    epoch: str
    last_seq: int
    next_after: int | None  # give it as ?after= for the next page; null on the last
    head: str | None
    events: list[EventFrame]
    # view=active: every node on the active path that has siblings.
    forks: dict[str, Fork] | UnsetType = UNSET
    # view=active: true when history was trimmed past the path's start, which then begins
    # at the first whole exchange left.
    trimmed: bool | UnsetType = UNSET


class TreeNodeView(msgspec.Struct, frozen=True):
    id: str
    kind: Literal["user", "turn"]
    parent_id: str | None
    seq: int
    preview: str | None
    children: list[str]
    usage: dict[str, int | float] | None  # a turn's, as its turn_end reported it
    trimmed: bool  # its events are gone: history was trimmed past it


class ForkLeaf(msgspec.Struct, frozen=True):
    node_id: str | None  # null: the first messages' fork
    leaf: str  # where a switch to it goes: the leaf last active below it


class TreeView(msgspec.Struct, frozen=True):
    chat_id: p.ChatId
    head: str | None
    roots: list[str]  # the first messages
    forks: list[ForkLeaf]
    nodes: list[TreeNodeView]  # by seq


class WsTicket(msgspec.Struct, frozen=True):
    ticket: str  # give it as `GET /v1/ws?ticket=`: good for one connection
    expires_in: int  # seconds it stays valid, at most 30 (never past the token's expiry)


class Health(msgspec.Struct, frozen=True):
    status: Literal["ok"]


class Ready(msgspec.Struct, frozen=True):
    status: Literal["ready"]
    dependencies: dict[str, Literal["ok"]]


# --- reading a request ----------------------------------------------------------------


_gateway, _principal, _chat_id = gateway_of, principal_of, chat_id_of


def _query(request: Request, kind: type[T]) -> T:
    try:
        return msgspec.convert(dict(request.query_params), kind, strict=False)
    except msgspec.ValidationError as exc:
        raise Rejected("invalid_request", f"query: {exc}") from None


async def _body(request: Request, kind: type[T], empty_ok: bool = False) -> T:
    """The body decoded as ``kind``; with ``empty_ok``, no body at all means ``{}``."""
    body = await _read_body(request.receive, request.headers.get("content-length"))
    return _decode(body, kind, empty_ok)


def _decode(body: bytes, kind: type[T], empty_ok: bool = False) -> T:
    if empty_ok and not body.strip():
        body = b"{}"
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        raise Rejected("unprocessable", str(exc)) from None
    except msgspec.DecodeError as exc:
        raise Rejected("invalid_request", f"body is not valid JSON: {exc}") from None


async def _read_body(receive: Receive, declared: str | None) -> bytes:
    """The whole body from ASGI ``receive``; ``declared`` is its Content-Length header."""
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise Rejected("payload_too_large", f"body is over {MAX_BODY_BYTES} bytes")
    # Straight from ASGI receive, not request.stream(): the publish path reads every body
    # here, and the async generator costs more than the rest of this function.
    chunks: list[bytes] = []
    size, more = 0, True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        chunk: bytes = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise Rejected("payload_too_large", f"body is over {MAX_BODY_BYTES} bytes")
        chunks.append(chunk)
        more = message.get("more_body", False)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def _owned(request: Request, who: Principal, chat_id: str) -> Meta:
    return check_access(who, await _gateway(request).store.meta(chat_id), chat_id)


# --- routes ---------------------------------------------------------------------------

CONVERSATIONS = "/v1/conversations/"
EVENTS = "/events"


def _publisher(gateway: Gateway, authorization: str | None, query: bytes, path: str,
               task: asyncio.Task[Any] | None) -> tuple[Principal, str]:
    """Who publishes to which conversation, checked before the body is read."""
    who = gateway.authenticate_raw(authorization, query)
    if not who.is_service:
        raise Rejected("forbidden", "publishing needs a service token")
    chat_id = path[len(CONVERSATIONS):-len(EVENTS)]
    if not p.CHAT_ID_RE.match(chat_id):
        raise Rejected("invalid_request", f"chat_id must match {p.CHAT_ID_PATTERN}")
    logs.bind(user_id=who.user_id, chat_id=chat_id, task=task)
    return who, chat_id


async def _published(gateway: Gateway, who: Principal, chat_id: str, body: bytes) -> bytes:
    request = _decode(body, PublishBody)
    batch = request.batch()
    result = await gateway.conversations.publish(
        who, chat_id, list(batch.events), batch.idempotency_key,
        in_batch=not isinstance(request.events, UnsetType), turn_id=batch.turn_id,
    )
    return _encode(Published(chat_id, result.epoch, result.seqs, result.last_seq,
                             result.duplicate, result.filed))


async def _publish(gateway: Gateway, scope: Scope, receive: Receive,
                   task: asyncio.Task[Any] | None) -> bytes:
    # The two headers it needs, in one pass over the raw list: the first of each, decoded
    # as Starlette would (latin-1), without building a Request and its Headers.
    authorization = length = None
    for name, value in scope["headers"]:
        if name == b"authorization":
            if authorization is None:
                authorization = value.decode("latin-1")
        elif name == b"content-length" and length is None:
            length = value.decode("latin-1")
    who, chat_id = _publisher(gateway, authorization, scope.get("query_string", b""),
                              scope["path"], task)
    return await _published(gateway, who, chat_id, await _read_body(receive, length))


async def _answered(work: Awaitable[bytes]) -> tuple[int, bytes]:
    """A publish's status and JSON body: its reply, or its error as every route gives it."""
    try:
        return 200, await work
    except Rejected as exc:
        return exc.http_status, _error_body(exc.code, exc.message)
    except (RedisError, ConnectionError) as exc:
        return 503, _error_body("backend_unavailable", f"redis: {exc}")


_JSON_HEADERS = (b"content-type", b"application/json")


class PublishEndpoint:
    """``POST /v1/conversations/{chat_id}/events``, the durable-publish hot path.

    Agents publish thousands of times a second, and Starlette's routing and middleware cost
    as much as the publish itself, so it skips them two ways, with the same replies and
    errors as the ``publish`` operation below:

    * under ``gateway serve``, a request whose whole body fits in one read goes from the
      HTTP parser straight to :meth:`answer` (``FAST_POST`` in the lifespan state; see
      :mod:`gateway.transport.uvicorn_ws`): no ASGI cycle;
    * anything else (another server, a chunked or large body) reaches it as a plain ASGI
      app that :class:`~gateway.app.GatewayApp` calls directly.
    """

    max_body = MAX_BODY_BYTES

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        # Python 3.11 makes a getpid() call in every running-loop lookup: once is enough.
        self._loop: asyncio.AbstractEventLoop | None = None

    def _task(self) -> asyncio.Task[Any] | None:
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        return asyncio.current_task(loop)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            status, body = await _answered(_publish(self.gateway, scope, receive, self._task()))
        except ClientDisconnect:
            return  # nobody left to answer
        await send({"type": "http.response.start", "status": status,
                    "headers": [_JSON_HEADERS, (b"content-length", b"%d" % len(body))]})
        await send({"type": "http.response.body", "body": body})

    async def answer(self, authorization: str | None, path: str, body: bytes
                     ) -> tuple[int, bytes]:
        """A request with no query string, its body read: its status and JSON body."""
        gateway = self.gateway

        async def work() -> bytes:
            who, chat_id = _publisher(gateway, authorization, b"", path, self._task())
            return await _published(gateway, who, chat_id, body)

        return await _answered(work())

    @staticmethod
    def routes(path: str) -> bool:
        """Whether a POST to ``path`` is this endpoint's."""
        return (path.startswith(CONVERSATIONS) and path.endswith(EVENTS)
                and "/" not in path[len(CONVERSATIONS):-len(EVENTS)])

    @classmethod
    def matches(cls, scope: Scope) -> bool:
        return scope["method"] == "POST" and cls.routes(scope["path"])


@API.operation(
    "POST", "/v1/conversations/{chat_id}/events", summary="Publish events (service)",
    description="One event (`type`, `data`, ...) or a batch (`events`, at most 500, atomic, "
    "in order). A repeated `idempotency_key` returns the first result with "
    "`duplicate: true` and writes nothing. `data` must fit both wire formats: an integer "
    "outside -2^63 to 2^64 - 1 is refused (422). Event types and their data: protocol.md.",
    body=PUBLISH_BODY, reply=Published, errors=(400, 403, 404, 409, 413, 422, 503),
)
async def publish(request: Request) -> Response:
    # app.py routes this operation to PublishEndpoint first; this is the same, via Starlette.
    return JSONResponse(await _publish(_gateway(request), request.scope, request.receive,
                                       asyncio.current_task()))


@API.operation(
    "POST", "/v1/conversations", summary="Create a conversation", status=201,
    description="Owned by the caller; a `chat_id` is made up when none is given. With "
    "`parent_chat_id`, a sub-conversation of that one (its owner or a service), owned by "
    "the parent's owner; the parent gets a `child` event.",
    body=NewConversation, reply=Conversation, errors=(400, 403, 404, 409, 413, 422, 503),
)
async def create_conversation(request: Request) -> Response:
    who = _principal(request)
    spec = await _body(request, NewConversation)
    chat_id = spec.chat_id or "c_" + secrets.token_hex(8)
    conversations = _gateway(request).conversations
    if spec.parent_chat_id is not None:
        await conversations.create_child(who, spec.parent_chat_id, chat_id, spec.title,
                                         spec.agent or "")
    else:
        await conversations.create(who, chat_id, spec.title, spec.agent or "")
    meta = await _owned(request, who, chat_id)
    return JSONResponse(_encode(Conversation.of(chat_id, meta)), status_code=201)


@API.operation(
    "GET", "/v1/conversations", summary="The caller's conversations, newest change first",
    description="Filtered by `status`, `q` (a piece of the title, any case), "
    "`updated_after`/`updated_before` (ms, exclusive) and `include_children`. A page may "
    "hold fewer than `limit`, even none: continue from `next_cursor` while it is not null. "
    "What a walk sees while conversations change: protocol.md.",
    query=ListQuery, reply=ConversationPage, errors=(400, 503),
)
async def list_conversations(request: Request) -> Response:
    who = _principal(request)
    page = _query(request, ListQuery)
    cursor = None if isinstance(page.cursor, UnsetType) else Place.of_cursor(page.cursor)
    rows, reached = await _gateway(request).store.conversations(who.user_id, cursor,
                                                                page.limit, page.wanted())
    # A member removed while a change of the conversation was being listed may find it
    # again in their list, briefly: what they may no longer read is left out.
    items = [Conversation.of(chat_id, meta) for chat_id, meta in rows
             if who.role_in(meta) is not None]
    next_cursor = reached.cursor() if reached is not None else None
    return JSONResponse(_encode(ConversationPage(items, next_cursor)))


@API.operation(
    "GET", "/v1/conversations/{chat_id}", summary="A conversation (owner or service)",
    reply=Conversation, errors=(400, 403, 404, 503),
)
async def get_conversation(request: Request) -> Response:
    chat_id = _chat_id(request)
    meta = await _owned(request, _principal(request), chat_id)
    return JSONResponse(_encode(Conversation.of(chat_id, meta)))


@API.operation(
    "GET", "/v1/conversations/{chat_id}/children",
    summary="A conversation's sub-conversations (owner or service)",
    description="Oldest first, each with its title and status.",
    reply=Children, errors=(400, 403, 404, 503),
)
async def children(request: Request) -> Response:
    chat_id = _chat_id(request)
    await _owned(request, _principal(request), chat_id)
    found = await _gateway(request).conversations.children(chat_id)
    return JSONResponse(_encode(Children(chat_id, found)))


@API.operation(
    "GET", "/v1/conversations/{chat_id}/presence",
    summary="Who is connected to a conversation now (owner or service)",
    description="`users`: each user with a subscribed connection and how many it has; "
    "`agents`: each agent running a turn in it and its workers there. `v` only grows: of "
    "two lists, the higher `v` is the newer (protocol.md, presence).",
    reply=p.PresenceList, errors=(400, 403, 404, 503),
)
async def presence(request: Request) -> Response:
    chat_id = _chat_id(request)
    await _owned(request, _principal(request), chat_id)
    return JSONResponse(_encode(await _gateway(request).presence.read(chat_id)))


UserId = Annotated[str, msgspec.Meta(pattern=r"^[^:]{1,128}\Z")]
WITHIN_MS = 1000  # revocations and disconnections take effect everywhere within this


class Disconnect(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    user_id: UserId
    reason: Annotated[str, msgspec.Meta(min_length=1, max_length=120)] = (
        "disconnected by an administrator")


class Revoke(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    # Refused until then (ms); past the tokens' exp, nothing is left to refuse. A number:
    # 4449.0 is an integer to JSON Schema.
    until: Annotated[float, msgspec.Meta(ge=0, le=10**15)]
    jti: Annotated[str, msgspec.Meta(min_length=1, max_length=256)] | UnsetType = UNSET
    user_id: UserId | UnsetType = UNSET


# Documents the rule revoke enforces: exactly one of the two.
REVOKE_BODY = Annotated[Revoke, msgspec.Meta(extra_json_schema={
    "oneOf": [{"required": ["jti"]}, {"required": ["user_id"]}],
})]


class Done(msgspec.Struct, frozen=True):
    """Recorded: every gateway process acts on it within ``within_ms``."""

    within_ms: int


def _service(request: Request) -> Principal:
    who = _principal(request)
    if not who.is_service:
        raise Rejected("forbidden", "this needs a service token")
    return who


@API.operation(
    "POST", "/v1/admin/disconnect", summary="Close every connection of a user (service)",
    description="Every WebSocket of `user_id` closes with 4005 (terminal: the client does not "
    "reconnect by itself) and every Server-Sent Events stream of theirs ends, on every "
    "gateway process, within a second. Their tokens stay good: revoke them too to keep "
    "them out.",
    body=Disconnect, reply=Done, status=202, errors=(400, 403, 413, 422, 503),
)
async def admin_disconnect(request: Request) -> Response:
    _service(request)
    body = await _body(request, Disconnect)
    await _gateway(request).revocations.disconnect(body.user_id, body.reason)
    return JSONResponse(_encode(Done(WITHIN_MS)), status_code=202)


@API.operation(
    "POST", "/v1/admin/revoke", summary="Refuse tokens until a time (service)",
    description="`jti`: that token; `user_id`: every token of that user issued before now "
    "(its `iat`; one without `iat` too). Until `until` (ms) they and the tickets made from "
    "them are refused on every gateway process, verifications that hit the token cache "
    "included, and the connections and streams that use them close (4001, `token "
    "revoked`), within a second.",
    body=REVOKE_BODY, reply=Done, status=202, errors=(400, 403, 413, 422, 503),
)
async def admin_revoke(request: Request) -> Response:
    _service(request)
    body = await _body(request, Revoke)
    if isinstance(body.jti, UnsetType) == isinstance(body.user_id, UnsetType):
        raise Rejected("unprocessable", "give exactly one of `jti` and `user_id`")
    revocations = _gateway(request).revocations
    if not isinstance(body.jti, UnsetType):
        await revocations.revoke_jti(body.jti, int(body.until))
    elif not isinstance(body.user_id, UnsetType):
        await revocations.revoke_user(body.user_id, int(body.until))
    return JSONResponse(_encode(Done(WITHIN_MS)), status_code=202)


class Agents(msgspec.Struct, frozen=True):
    agents: list[LiveAgent]  # by name


@API.operation(
    "GET", "/v1/agents", summary="The agents with a live worker now (any token)",
    description="Each agent name with at least one worker that announced itself within "
    "the last 10 s: its `kind` (`handler`, `ag-ui` or `openai`) and how many workers it has. "
    "A conversation may name any agent; one with no worker waits until the turn timeout.",
    reply=Agents, errors=(503,),
)
async def agents(request: Request) -> Response:
    _principal(request)
    return JSONResponse(_encode(Agents(await _gateway(request).conversations.agents.live())))


@API.operation(
    "PATCH", "/v1/conversations/{chat_id}",
    summary="Rename a conversation, or set its client tools (owner or service)",
    description="`title`: emits a `title` event with `source: user`; the title is trimmed "
    "and its runs of whitespace collapsed. `client_tools`: the tools its agent may call to "
    "ask a person (each `{name, description?, parameters, result?}`, JSON Schemas), stored "
    "with a durable `client_tools` event; the list replaces the last one.",
    body=CHANGE_BODY, reply=Conversation, errors=(400, 403, 404, 413, 422, 503),
)
async def rename_conversation(request: Request) -> Response:
    who, chat_id = _principal(request), _chat_id(request)
    spec = await _body(request, Change)
    if isinstance(spec.title, UnsetType) and isinstance(spec.client_tools, UnsetType):
        raise Rejected("unprocessable", "Object missing required field `title` (or "
                       "`client_tools`)")
    await _owned(request, who, chat_id)
    conversations = _gateway(request).conversations
    if not isinstance(spec.client_tools, UnsetType):
        await conversations.set_client_tools(who, chat_id, spec.client_tools)
    if not isinstance(spec.title, UnsetType):
        await conversations.rename(who, chat_id, spec.title)
    return JSONResponse(_encode(Conversation.of(chat_id, await _owned(request, who, chat_id))))


MAX_MEMBERS = 100  # a conversation's members besides its owner
MemberRole = Literal["member", "viewer"]


class MembersChange(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    roles: Annotated[dict[UserId, MemberRole], msgspec.Meta(max_length=MAX_MEMBERS)] = (
        msgspec.field(default_factory=dict, name="set"))
    remove: Annotated[list[UserId], msgspec.Meta(max_length=MAX_MEMBERS)] = (
        msgspec.field(default_factory=list))


class Members(msgspec.Struct, frozen=True):
    chat_id: p.ChatId
    owner: str
    members: dict[str, str]  # user -> role, besides the owner
    removed: list[str]  # who this change removed (they were members)


@API.operation(
    "PATCH", "/v1/conversations/{chat_id}/members",
    summary="Share a conversation: set or remove members (owner or service)",
    description="`set`: `{user_id: role}`, each role `member` (reads, writes messages, runs "
    "tree operations, answers client tools) or `viewer` (reads only); `remove`: user ids. "
    "Applied together, atomically. A user removed who was a member gets `removed` on each "
    "of their subscriptions and streams, which end; the conversation leaves their list. "
    "At most 100 members; the owner's own role cannot be set or removed (400).",
    body=MembersChange, reply=Members, errors=(400, 403, 404, 413, 422, 503),
)
async def members(request: Request) -> Response:
    who, chat_id = _principal(request), _chat_id(request)
    change = await _body(request, MembersChange)
    if not change.roles and not change.remove:
        raise Rejected("invalid_request", "give `set` or `remove`")
    both = set(change.roles).intersection(change.remove)
    if both:
        raise Rejected("invalid_request", f"{sorted(both)[0]!r} is both set and removed")
    changed = await _gateway(request).store.set_members(
        chat_id, who.owner_writer(), dict(change.roles), list(change.remove), MAX_MEMBERS)
    return JSONResponse(_encode(Members(chat_id, changed.owner, changed.members,
                                        changed.removed)))


@API.operation(
    "POST", "/v1/conversations/{chat_id}/tool-results",
    summary="Answer a client tool call (owner or service)",
    description="A person answers the question an agent asked (a `tool_call` with "
    "`awaiting: true`): a durable `tool_result {call_id, result, by}` on the active path, "
    "and a new turn at once, so the agent goes on. The first answer wins: a call that is "
    "not awaiting gets 409 `conflict`; an answer that does not fit the tool's `result` "
    "schema 400.",
    body=Answer, reply=p.Ack, errors=(400, 403, 404, 409, 413, 422, 503),
)
async def tool_results(request: Request) -> Response:
    who, chat_id = _principal(request), _chat_id(request)
    body = await _body(request, Answer)
    ack = await _gateway(request).conversations.answer(
        who, p.ToolResult(chat_id, body.call_id, body.result))
    return JSONResponse(_encode(ack))


@API.operation(
    "DELETE", "/v1/conversations/{chat_id}", summary="Delete a conversation (owner or service)",
    description="Emits `deleted`; the history is gone. A member or viewer gets 403.",
    status=204, errors=(400, 403, 404, 503),
)
async def delete_conversation(request: Request) -> Response:
    who, chat_id = _principal(request), _chat_id(request)
    check_owner(who, await _gateway(request).store.meta(chat_id), chat_id)
    await _gateway(request).store.delete(chat_id)
    return Response(status_code=204)


@API.operation(
    "GET", "/v1/conversations/{chat_id}/events", summary="History (owner or service)",
    description="Durable events with seq > `after`, oldest first: with `view=active` (the "
    "default) those of the active path and the conversation itself, and its `forks`; with "
    "`view=all` every branch's. A page may hold fewer than `limit`: continue from "
    "`next_after` while it is not null.",
    query=HistoryQuery, reply=HistoryPage, errors=(400, 403, 404, 503),
)
async def history(request: Request) -> Response:
    who, chat_id = _principal(request), _chat_id(request)
    query = _query(request, HistoryQuery)
    await _owned(request, who, chat_id)
    store = _gateway(request).store
    forks: dict[str, Fork] | UnsetType = UNSET
    trimmed: bool | UnsetType = UNSET
    if query.view == "all":
        page = await store.read(chat_id, query.after, query.limit)
        meta, frames = page.meta, [frame for _, frame in page.frames]
        scanned = page.frames[-1][0] if page.frames else query.after
    else:
        path = await store.active_path(chat_id, query.after, query.limit)
        meta = path.meta if path is not None else None
        frames, scanned = (path.events, path.scanned) if path is not None else ([], 0)
        forks = {node: Fork(f.siblings, f.index)
                 for node, f in path.forks.items()} if path is not None else {}
        trimmed = path.trimmed if path is not None else False
    if meta is None:
        raise Rejected("not_found", f"conversation {chat_id!r} does not exist")
    next_after = scanned if frames and scanned < meta.seq else None
    # The stored frames are EventFrame JSON already: spliced in as they are, not re-encoded.
    events = cast("list[EventFrame]", [msgspec.Raw(frame) for frame in frames])
    return JSONResponse(_encode(HistoryPage(chat_id, meta.epoch, meta.seq, next_after,
                                            meta.head, events, forks, trimmed)))


@API.operation(
    "GET", "/v1/conversations/{chat_id}/tree", summary="The conversation tree (owner or service)",
    description="Every node (user messages and turns), the head, the first messages, and the "
    "leaf each fork was left at (where a `switch` to it goes).",
    reply=TreeView, errors=(400, 403, 404, 503),
)
async def tree(request: Request) -> Response:
    who, chat_id = _principal(request), _chat_id(request)
    await _owned(request, who, chat_id)
    found = await _gateway(request).store.tree(chat_id)
    if found is None:
        raise Rejected("not_found", f"conversation {chat_id!r} does not exist")
    forks = [ForkLeaf(node_id, leaf) for node_id, leaf in found.forks()]
    nodes = [TreeNodeView(n.id, "user" if n.kind == "user" else "turn", n.parent_id, n.seq,
                          n.preview, n.children, n.usage, n.trimmed) for n in found.nodes]
    return JSONResponse(_encode(TreeView(chat_id, found.head, found.roots, forks, nodes)))


_TREE_ERRORS = (400, 403, 404, 409, 413, 422, 503)


@API.operation(
    "POST", "/v1/conversations/{chat_id}/retry", summary="Retry the head's answer",
    description="A new turn answers the head turn's message, beside it; the head moves to "
    "it. The reply is the WebSocket `ack`. protocol.md, \"Tree operations\".",
    body=TreeOpBody, reply=p.Ack, errors=_TREE_ERRORS,
)
async def retry(request: Request) -> Response:
    who, chat_id = _principal(request), _chat_id(request)
    body = await _body(request, TreeOpBody, empty_ok=True)
    ack = await _gateway(request).conversations.retry(
        who, p.Retry(chat_id, body.expected_head, body.cancel))
    return JSONResponse(_encode(ack))


@API.operation(
    "POST", "/v1/conversations/{chat_id}/edit", summary="Edit a message on the active path",
    description="A new version of `msg_id` beside it, and its turn; the head moves there.",
    body=EditBody, reply=p.Ack, errors=_TREE_ERRORS,
)
async def edit(request: Request) -> Response:
    who, chat_id = _principal(request), _chat_id(request)
    body = await _body(request, EditBody)
    ack = await _gateway(request).conversations.edit(who, p.Edit(
        chat_id, body.msg_id, body.text, body.client_msg_id, body.expected_head, body.cancel))
    return JSONResponse(_encode(ack))


@API.operation(
    "POST", "/v1/conversations/{chat_id}/undo", summary="Undo the last exchange",
    description="The head moves before the active path's last user message; the reply "
    "gives its text back. Nothing is deleted.",
    body=TreeOpBody, reply=p.Ack, errors=_TREE_ERRORS,
)
async def undo(request: Request) -> Response:
    who, chat_id = _principal(request), _chat_id(request)
    body = await _body(request, TreeOpBody, empty_ok=True)
    ack = await _gateway(request).conversations.undo(
        who, p.Undo(chat_id, body.expected_head, body.cancel))
    return JSONResponse(_encode(ack))


@API.operation(
    "POST", "/v1/conversations/{chat_id}/switch", summary="Switch to another branch, or redo",
    description="The head moves to the leaf last active below `node_id`.",
    body=SwitchBody, reply=p.Ack, errors=_TREE_ERRORS,
)
async def switch(request: Request) -> Response:
    who, chat_id = _principal(request), _chat_id(request)
    body = await _body(request, SwitchBody)
    ack = await _gateway(request).conversations.switch(
        who, p.Switch(chat_id, body.node_id, body.expected_head, body.cancel))
    return JSONResponse(_encode(ack))


@API.operation(
    "GET", "/v1/conversations/{chat_id}/stream", summary="Server-Sent Events (owner or service)",
    description="One conversation's durable events and streamed answers as "
    "`text/event-stream`, resumable with the `Last-Event-ID` header (which wins) or "
    "`?last_event_id=`; the events and ids are described in protocol.md, "
    "\"Server-Sent Events\". Refusals come before the stream.",
    query=StreamQuery, reply=StreamEvent, media_type=EVENT_STREAM,
    errors=(400, 403, 404, 503),
)
async def stream(request: Request) -> Response:
    return await sse.endpoint(request)


# --- the Vercel AI SDK's chat transport (gateway/ai_sdk.py; protocol.md, "The Vercel AI SDK")

_AI_SDK_CHAT = ai_sdk.PREFIX + "/{chat_id}"


@API.operation(
    "POST", ai_sdk.PREFIX, summary="The AI SDK's chat transport: send, or regenerate",
    description="The body `DefaultChatTransport` sends (`id`, `messages`, `trigger`, "
    "`messageId`, and the app's own fields, which reach the agent as the message's "
    "`data.props`). `id` is the chat id: the conversation is created for the caller, "
    "answered by `agent`, if it does not exist. `submit-message`: the last message (the "
    "user's) becomes a `message`, its id the `client_msg_id` (a resent request stores "
    "nothing twice and streams the same turn); `regenerate-message`: a `retry`. The reply "
    "is the turn as a UI message stream (`x-vercel-ai-ui-message-stream: v1`) ending with "
    "`data: [DONE]`. Closing it does not stop the turn. Refusals come before the stream.",
    body=ai_sdk.ChatRequest, reply=ai_sdk.ChunkEvent, media_type=EVENT_STREAM,
    errors=(400, 403, 404, 409, 413, 422, 503),
)
async def ai_sdk_chat(request: Request) -> Response:
    return await ai_sdk.chat(request)


@API.operation(
    "GET", _AI_SDK_CHAT + "/stream", summary="The AI SDK's chat transport: resume",
    description="The running turn as a UI message stream from its start (its text so far "
    "at once, then live), ending with the turn; any device, any number of times. 204 when "
    "no turn runs (or the chat does not exist yet).",
    reply=ai_sdk.ChunkEvent, media_type=EVENT_STREAM, empty=(204,),
    errors=(400, 403, 503),
)
async def ai_sdk_resume(request: Request) -> Response:
    return await ai_sdk.resume(request)


@API.operation(
    "GET", _AI_SDK_CHAT + "/messages", summary="The AI SDK's chat transport: the messages",
    description="The active path as `UIMessage[]` (user messages; each answer with its "
    "text, reasoning, tool and data parts), for the page's first render; `[]` for a chat "
    "that does not exist yet.",
    reply=list[ai_sdk.OutMessage], errors=(400, 403, 503),
)
async def ai_sdk_messages(request: Request) -> Response:
    return await ai_sdk.messages(request)


@API.operation(
    "POST", _AI_SDK_CHAT + "/stop", summary="The AI SDK's chat transport: stop the answer",
    description="Cancels the running turn (`turn_id`: the one told to stop, null when none "
    "was running). Closing a response never stops a turn. No body.",
    reply=ai_sdk.Stopped, errors=(400, 403, 404, 503),
)
async def ai_sdk_stop(request: Request) -> Response:
    return await ai_sdk.stop(request)


# --- AG-UI for frontends (gateway/ag_ui_frontend.py; protocol.md, "AG-UI for frontends") ---


@API.operation(
    "POST", ag_ui_frontend.PATH, summary="AG-UI: run the conversation's agent",
    description="`RunAgentInput`, as an AG-UI client (`@ag-ui/client`'s `HttpAgent`) sends "
    "it. `threadId` is the chat id: the conversation is created for the caller, answered "
    "by `forwardedProps.agent`, if it does not exist. A new trailing user message becomes "
    "a `message`, its id the `client_msg_id` (one already stored is not stored again); "
    "`resume` (`interruptId`: the call id) or a trailing `tool` message answers the "
    "client tool that awaits a person. The reply is AG-UI events over SSE: `RUN_STARTED`, "
    "`MESSAGES_SNAPSHOT` of the active path, `STATE_SNAPSHOT`, the turn (or the running "
    "one when nothing new was sent; none: the run finishes at once), then `RUN_FINISHED` "
    "or `RUN_ERROR`. Closing it does not stop the turn. Refusals come before the stream.",
    body=ag_ui_frontend.AgUiRunInput, reply=ag_ui_frontend.AgUiEvent, media_type=EVENT_STREAM,
    errors=(400, 403, 404, 409, 413, 422, 503),
)
async def ag_ui_run(request: Request) -> Response:
    return await ag_ui_frontend.run_endpoint(request)


@API.operation(
    "POST", "/v1/ws-ticket", summary="A connection ticket for the WebSocket",
    description="Trades the bearer token for a ticket that opens one connection to "
    "`GET /v1/ws?ticket=<ticket>` within `expires_in` seconds (at most 30, never past the "
    "token's expiry), on any gateway process, as the token's user and role. A browser "
    "cannot set headers on a WebSocket: this keeps its token out of URLs. No body.",
    reply=WsTicket, errors=(503,),
)
async def ws_ticket(request: Request) -> Response:
    who = _principal(request)
    try:
        ticket, ttl = await _gateway(request).tickets.issue(who)
    except AuthError as exc:
        raise Rejected("unauthorized", str(exc)) from None
    return JSONResponse(_encode(WsTicket(ticket, ttl)), headers=NO_STORE)


@API.operation("GET", "/healthz", summary="The process is alive", auth=False, reply=Health)
async def healthz(request: Request) -> Response:
    return JSONResponse(_encode(Health("ok")))


@API.operation(
    "GET", "/readyz", summary="Every dependency is up", auth=False, reply=Ready, errors=(503,),
    description="Every Redis node answers (a cluster reports `ok`) and every pub/sub "
    "connection is up; the 503 names each failing dependency.",
)
async def readyz(request: Request) -> Response:
    """Ready when every Redis node answers (and, on a cluster, the cluster is ok) and live
    frames arrive (every pub/sub connection is up). The body names each dependency."""
    gateway = _gateway(request)
    report = await gateway.backend.health()
    report["pubsub"] = "ok" if gateway.hub.connected else "reconnecting"
    failing = {name: state for name, state in report.items() if state != "ok"}
    if failing:
        detail = "; ".join(f"{name}: {state}" for name, state in failing.items())
        return error_response(503, "backend_unavailable", detail)
    return JSONResponse(_encode(Ready("ready", cast("dict[str, Literal['ok']]", report))))


DESCRIPTION = """\
The gateway's HTTP API. Tokens go in `Authorization: Bearer` (or `?token=`); `gateway token`
prints one. Every error is `{"error": {"code", "message"}}`.

Not described here (see protocol.md): the WebSocket endpoint `GET /v1/ws` (many
conversations over one connection, resumable with `since`) and the events and ids of the
Server-Sent Events stream.
"""


@API.operation("GET", "/v1/openapi.json", summary="This document", auth=False,
               reply=dict[str, Any])
async def openapi_json(request: Request) -> Response:
    return JSONResponse(document())


@functools.cache
def document() -> bytes:
    """The OpenAPI document, built once."""
    return _encode(API.document(title="gateway", version=__version__, description=DESCRIPTION,
                                shared={p.JSON_VALUE: p.JSON_VALUE_SCHEMA}))


# --- errors ---------------------------------------------------------------------------


async def on_rejected(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, Rejected)
    return error_response(exc.http_status, exc.code, exc.message, head=exc.head)


async def on_http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    return error_response(exc.status_code, code, str(exc.detail), exc.headers)


async def on_backend_error(request: Request, exc: Exception) -> Response:
    return error_response(503, "backend_unavailable", f"redis: {exc}")


exception_handlers = {
    Rejected: on_rejected,
    HTTPException: on_http_error,
    RedisError: on_backend_error,
    ConnectionError: on_backend_error,
}

# CORS preflight: not in the document
routes = API.routes() + ai_sdk.preflight_routes() + ag_ui_frontend.preflight_routes()
