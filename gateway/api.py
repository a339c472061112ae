"""HTTP routes: conversations, publishing, history, health."""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar

import msgspec
from redis.exceptions import RedisError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from . import logs, sse
from . import protocol as p
from .auth import Principal, check_access
from .errors import Rejected
from .events import PublishBatch, PublishEvent
from .redis.records import Meta

if TYPE_CHECKING:
    from .runtime import Gateway

MAX_BODY_BYTES = 1 << 20
T = TypeVar("T")
_encode = msgspec.json.encode


class JSONResponse(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return content if isinstance(content, bytes) else _encode(content)


def _error_body(code: str, message: str, head: str | None = None) -> bytes:
    error: dict[str, Any] = {"code": code, "message": message}
    if head is not None:  # a refused tree operation: the head now (null for none)
        error["head"] = head or None
    return _encode({"error": error})


def error_response(status: int, code: str, message: str,
                   head: str | None = None) -> JSONResponse:
    return JSONResponse(_error_body(code, message, head), status_code=status)


class NewConversation(msgspec.Struct, frozen=True):
    chat_id: p.ChatId | None = None
    title: str | None = None


class Rename(msgspec.Struct, frozen=True):
    title: str


class PageQuery(msgspec.Struct, frozen=True):
    limit: Annotated[int, msgspec.Meta(ge=1, le=200)] = 50
    cursor: Annotated[int, msgspec.Meta(ge=0)] | None = None


class PublishBody(msgspec.Struct, frozen=True):
    """``POST .../events``: one event (``type``...) or a batch (``events``), decoded in one
    pass straight from the body."""

    type: p.EventType | None = None
    data: dict[str, Any] = {}
    durable: bool = True
    idempotency_key: Annotated[str, msgspec.Meta(min_length=1, max_length=200)] | None = None
    events: Annotated[list[PublishEvent], msgspec.Meta(min_length=1, max_length=500)] | None = None
    attempt: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_.-]{1,64}$")] | None = None

    def batch(self) -> PublishBatch:
        if self.events is not None:
            if self.type is not None:
                raise Rejected("unprocessable", "give either `type` (one event) or `events`")
            return PublishBatch(self.events, self.idempotency_key)
        if self.type is None:
            raise Rejected("unprocessable", "Object missing required field `type`")
        one = PublishEvent(self.type, self.data, self.durable, self.idempotency_key,
                           self.attempt)
        return PublishBatch([one], self.idempotency_key)


class HistoryQuery(msgspec.Struct, frozen=True):
    after: Annotated[int, msgspec.Meta(ge=0)] = 0
    limit: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 100
    view: Literal["active", "all"] = "active"  # the active path, or every branch


class TreeOpBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``POST .../retry`` and ``.../undo``: the WebSocket frame's fields but type and id."""

    expected_head: p.ExpectedHead = msgspec.UNSET
    cancel: bool = False


class EditBody(TreeOpBody, frozen=True):
    msg_id: p.NodeId = ""
    text: str = ""
    client_msg_id: p.ClientMsgId | None = None


class SwitchBody(TreeOpBody, frozen=True):
    node_id: p.NodeId = ""


def _gateway(request: Request) -> Gateway:
    gateway: Gateway = request.app.state.gateway
    return gateway


def _principal(request: Request) -> Principal:
    who = _gateway(request).authenticate(request)
    logs.bind(user_id=who.user_id)
    return who


def _chat_id(request: Request) -> str:
    chat_id: str = request.path_params["chat_id"]
    if not p.CHAT_ID_RE.match(chat_id):
        raise Rejected("invalid_request", f"chat_id must match {p.CHAT_ID_PATTERN}")
    logs.about_chat(chat_id)
    return chat_id


def _query(request: Request, kind: type[T]) -> T:
    try:
        return msgspec.convert(dict(request.query_params), kind, strict=False)
    except msgspec.ValidationError as exc:
        raise Rejected("invalid_request", f"query: {exc}") from None


async def _body(request: Request, kind: type[T], empty_ok: bool = False) -> T:
    """The body decoded as ``kind``; with ``empty_ok``, no body at all means ``{}``."""
    body = await _read_body(request)
    if empty_ok and not body.strip():
        body = b"{}"
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        raise Rejected("unprocessable", str(exc)) from None
    except msgspec.DecodeError as exc:
        raise Rejected("invalid_request", f"body is not valid JSON: {exc}") from None


async def _read_body(request: Request) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise Rejected("payload_too_large", f"body is over {MAX_BODY_BYTES} bytes")
    # Straight from ASGI receive, not request.stream(): the publish path reads every body
    # here, and the async generator costs more than the rest of this function.
    chunks: list[bytes] = []
    size, more = 0, True
    while more:
        message = await request.receive()
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


def conversation_view(chat_id: str, meta: Meta) -> dict[str, Any]:
    return {
        "chat_id": chat_id, "owner": meta.owner, "title": meta.title, "status": meta.status,
        "turn_id": meta.turn_id, "epoch": meta.epoch, "last_seq": meta.seq,
        "created_at": meta.created_at, "updated_at": meta.updated_at,
        "goal_state": msgspec.Raw(meta.goal) if meta.goal else None, "preview": meta.preview,
        "head": meta.head,
    }


# --- routes ---------------------------------------------------------------------------


class PublishEndpoint:
    """``POST /v1/conversations/{chat_id}/events``, the durable-publish hot path.

    A plain ASGI app that :class:`~gateway.app.GatewayApp` calls directly: agents publish
    thousands of times a second, and Starlette's routing and middleware cost as much as the
    publish itself. Replies and errors have the same shape as every other route's.
    """

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            status, body = 200, await self._publish(Request(scope, receive))
        except ClientDisconnect:
            return  # nobody left to answer
        except Rejected as exc:
            status, body = exc.http_status, _error_body(exc.code, exc.message)
        except (RedisError, ConnectionError) as exc:
            status, body = 503, _error_body("backend_unavailable", f"redis: {exc}")
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    async def _publish(self, request: Request) -> bytes:
        who = self.gateway.authenticate(request)
        if not who.is_service:
            raise Rejected("forbidden", "publishing needs a service token")
        chat_id = request.scope["path"][len(CONVERSATIONS):-len(EVENTS)]
        if not p.CHAT_ID_RE.match(chat_id):
            raise Rejected("invalid_request", f"chat_id must match {p.CHAT_ID_PATTERN}")
        logs.bind(user_id=who.user_id, chat_id=chat_id)
        batch = (await _body(request, PublishBody)).batch()
        result = await self.gateway.conversations.publish(
            who, chat_id, list(batch.events), batch.idempotency_key
        )
        return _encode({"chat_id": chat_id, "epoch": result.epoch, "seqs": result.seqs,
                        "last_seq": result.last_seq, "duplicate": result.duplicate})

    @staticmethod
    def matches(scope: Scope) -> bool:
        path: str = scope["path"]
        return (scope["method"] == "POST" and path.startswith(CONVERSATIONS)
                and path.endswith(EVENTS) and "/" not in path[len(CONVERSATIONS):-len(EVENTS)])


CONVERSATIONS = "/v1/conversations/"
EVENTS = "/events"


async def create_conversation(request: Request) -> Response:
    who = _principal(request)
    spec = await _body(request, NewConversation)
    chat_id = spec.chat_id or "c_" + secrets.token_hex(8)
    await _gateway(request).conversations.create(who, chat_id, spec.title)
    meta = await _owned(request, who, chat_id)
    return JSONResponse(conversation_view(chat_id, meta), status_code=201)


async def list_conversations(request: Request) -> Response:
    who = _principal(request)
    page = _query(request, PageQuery)
    rows, next_cursor = await _gateway(request).store.conversations(
        who.user_id, page.cursor, page.limit
    )
    items = [conversation_view(chat_id, meta) for chat_id, meta in rows]
    return JSONResponse({"conversations": items, "next_cursor": next_cursor})


async def get_conversation(request: Request) -> Response:
    chat_id = _chat_id(request)
    meta = await _owned(request, _principal(request), chat_id)
    return JSONResponse(conversation_view(chat_id, meta))


async def rename_conversation(request: Request) -> Response:
    who, chat_id = _principal(request), _chat_id(request)
    spec = await _body(request, Rename)
    await _owned(request, who, chat_id)
    await _gateway(request).conversations.rename(who, chat_id, spec.title)
    return JSONResponse(conversation_view(chat_id, await _owned(request, who, chat_id)))


async def delete_conversation(request: Request) -> Response:
    who, chat_id = _principal(request), _chat_id(request)
    await _owned(request, who, chat_id)
    await _gateway(request).store.delete(chat_id)
    return Response(status_code=204)


async def history(request: Request) -> Response:
    """The active path's events (and its forks), or with ``view=all`` every event."""
    who, chat_id = _principal(request), _chat_id(request)
    query = _query(request, HistoryQuery)
    await _owned(request, who, chat_id)
    store = _gateway(request).store
    forks: dict[str, Any] | None = None
    if query.view == "all":
        page = await store.read(chat_id, query.after, query.limit)
        meta, events = page.meta, [f for _, f in page.frames]
        scanned = page.frames[-1][0] if page.frames else query.after
    else:
        path = await store.active_path(chat_id, query.after, query.limit)
        meta = path.meta if path is not None else None
        events, scanned = (path.events, path.scanned) if path is not None else ([], 0)
        forks = {node: msgspec.structs.asdict(fork)
                 for node, fork in path.forks.items()} if path is not None else {}
    if meta is None:
        raise Rejected("not_found", f"conversation {chat_id!r} does not exist")
    next_after = scanned if events and scanned < meta.seq else None
    fields: dict[str, Any] = {"chat_id": chat_id, "epoch": meta.epoch, "last_seq": meta.seq,
                              "next_after": next_after, "head": meta.head}
    if forks is not None:
        fields["forks"] = forks
    # The stored frames are already JSON: splice them in rather than re-encoding.
    head = _encode(fields)
    return JSONResponse(head[:-1] + b',"events":[' + b",".join(events) + b"]}")


async def tree(request: Request) -> Response:
    """Every node of the conversation tree, the head, and where each fork was last."""
    who, chat_id = _principal(request), _chat_id(request)
    await _owned(request, who, chat_id)
    found = await _gateway(request).store.tree(chat_id)
    if found is None:
        raise Rejected("not_found", f"conversation {chat_id!r} does not exist")
    forks = [{"node_id": None, "leaf": found.leaf(found.last_root)}] if (
        len(found.roots) > 1 and found.last_root) else []
    forks += [{"node_id": n.id, "leaf": found.leaf(n.id)} for n in found.nodes
              if len(n.children) > 1]
    return JSONResponse(_encode({
        "chat_id": chat_id, "head": found.head, "roots": found.roots, "forks": forks,
        "nodes": [{"id": n.id, "kind": n.kind, "parent_id": n.parent_id, "seq": n.seq,
                   "preview": n.preview, "children": n.children} for n in found.nodes]}))


async def _tree_op(request: Request, kind: str) -> Response:
    """``POST /v1/conversations/{chat_id}/<op>``: the WebSocket frame's HTTP twin; the
    reply is the same ``ack``."""
    who, chat_id = _principal(request), _chat_id(request)
    convs = _gateway(request).conversations
    ack: p.Ack
    if kind == "edit":
        edit = await _body(request, EditBody)
        if not edit.msg_id:
            raise Rejected("unprocessable", "Object missing required field `msg_id`")
        ack = await convs.edit(who, p.Edit(chat_id, edit.msg_id, edit.text, edit.client_msg_id,
                                           edit.expected_head, edit.cancel))
    elif kind == "switch":
        switch = await _body(request, SwitchBody)
        if not switch.node_id:
            raise Rejected("unprocessable", "Object missing required field `node_id`")
        ack = await convs.switch(who, p.Switch(chat_id, switch.node_id, switch.expected_head,
                                               switch.cancel))
    else:
        body = await _body(request, TreeOpBody, empty_ok=True)
        if kind == "retry":
            ack = await convs.retry(who, p.Retry(chat_id, body.expected_head, body.cancel))
        else:
            ack = await convs.undo(who, p.Undo(chat_id, body.expected_head, body.cancel))
    return JSONResponse(_encode(ack))


async def retry(request: Request) -> Response:
    return await _tree_op(request, "retry")


async def edit(request: Request) -> Response:
    return await _tree_op(request, "edit")


async def undo(request: Request) -> Response:
    return await _tree_op(request, "undo")


async def switch(request: Request) -> Response:
    return await _tree_op(request, "switch")


async def healthz(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


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
    return JSONResponse({"status": "ready", "dependencies": report})


# --- errors ---------------------------------------------------------------------------


async def on_rejected(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, Rejected)
    return error_response(exc.http_status, exc.code, exc.message, exc.head)


async def on_http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    return error_response(exc.status_code, code, str(exc.detail))


async def on_backend_error(request: Request, exc: Exception) -> Response:
    return error_response(503, "backend_unavailable", f"redis: {exc}")


exception_handlers = {
    Rejected: on_rejected,
    HTTPException: on_http_error,
    RedisError: on_backend_error,
    ConnectionError: on_backend_error,
}

routes = [
    Route("/healthz", healthz),
    Route("/readyz", readyz),
    Route("/v1/conversations", create_conversation, methods=["POST"]),
    Route("/v1/conversations", list_conversations, methods=["GET"]),
    Route("/v1/conversations/{chat_id}", get_conversation, methods=["GET"]),
    Route("/v1/conversations/{chat_id}", rename_conversation, methods=["PATCH"]),
    Route("/v1/conversations/{chat_id}", delete_conversation, methods=["DELETE"]),
    Route("/v1/conversations/{chat_id}/events", history, methods=["GET"]),
    Route("/v1/conversations/{chat_id}/tree", tree, methods=["GET"]),
    Route("/v1/conversations/{chat_id}/retry", retry, methods=["POST"]),
    Route("/v1/conversations/{chat_id}/edit", edit, methods=["POST"]),
    Route("/v1/conversations/{chat_id}/undo", undo, methods=["POST"]),
    Route("/v1/conversations/{chat_id}/switch", switch, methods=["POST"]),
    Route("/v1/conversations/{chat_id}/stream", sse.endpoint),
]
