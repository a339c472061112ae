"""The HTTP API as a contract: each operation declared once, next to its handler, and the
OpenAPI 3.1 document built from those declarations.

``@API.operation(...)`` on a handler (see :mod:`gateway.api`) is the one place a route is
added: the same entry makes the Starlette route and the document's entry. The schemas are
``msgspec.json.schema_components`` of the very Structs the handler decodes and encodes, so
the document and the replies cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any, TypeVar

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from .errors import HTTP_STATUS, ErrorBody

Endpoint = Callable[[Request], Awaitable[Response]]
E = TypeVar("E", bound=Endpoint)

JSON = "application/json"
REF = "#/components/schemas/{name}"
SECURITY_SCHEMES = {
    "bearer": {"type": "http", "scheme": "bearer", "bearerFormat": "JWT",
               "description": "A token from `gateway token` (HS256 with GATEWAY_SECRET)."},
    "query_token": {"type": "apiKey", "in": "query", "name": "token",
                    "description": "The same token as `?token=`, for clients that cannot set "
                                   "headers (an EventSource)."},
}
_PARAM_RE = re.compile(r"{([^}]+)}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Operation:
    """One method on one path: what it takes, what it answers, and its handler."""

    method: str
    path: str
    endpoint: Endpoint
    summary: str
    description: str = ""
    status: int = 200  # the success status
    reply: Any = None  # the success body's type (None: no body)
    media_type: str = JSON  # the success body's media type
    body: Any = None  # the request body's type, decoded as JSON
    query: Any = None  # a Struct whose fields are the query parameters
    errors: tuple[int, ...] = ()  # error statuses besides 401 (implied by auth)
    empty: tuple[int, ...] = ()  # other success statuses, answered with no body (a 204)
    auth: bool = True  # needs a token

    @property
    def operation_id(self) -> str:
        return self.endpoint.__name__


class Api:
    """The table of operations: Starlette routes and the OpenAPI document from one list."""

    def __init__(self, path_params: dict[str, Any]) -> None:
        self.path_params = path_params  # the type of every ``{name}`` a path may hold
        self.operations: list[Operation] = []

    def operation(self, method: str, path: str, **spec: Any) -> Callable[[E], E]:
        """A decorator: the handler serves ``method path``, taking and answering what
        ``spec`` (the other fields of :class:`Operation`) declares."""

        def register(endpoint: E) -> E:
            self.add(Operation(method=method, path=path, endpoint=endpoint, **spec))
            return endpoint

        return register

    def add(self, op: Operation) -> None:
        unknown = set(_PARAM_RE.findall(op.path)) - set(self.path_params)
        assert not unknown, f"{op.path}: no type for path parameters {unknown}"
        assert all((o.method, o.path) != (op.method, op.path) for o in self.operations), op
        assert all(o.operation_id != op.operation_id for o in self.operations), op
        self.operations.append(op)

    def routes(self) -> list[BaseRoute]:
        """One Starlette route per path, so a 405 names every method the path has."""
        by_path: dict[str, dict[str, Endpoint]] = {}
        for op in self.operations:
            by_path.setdefault(op.path, {})[op.method] = op.endpoint
        return [Route(path, _by_method(handlers), methods=list(handlers))
                for path, handlers in by_path.items()]

    def document(self, *, title: str, version: str, description: str,
                 shared: dict[str, Any] | None = None) -> dict[str, Any]:
        """The OpenAPI 3.1 document of every operation. ``shared``: schemas the types'
        own refer to by name (a recursive one, which msgspec cannot make)."""
        types: list[Any] = [ErrorBody, *self.path_params.values()]
        for op in self.operations:
            types += [t for t in (op.reply, op.body, op.query) if t is not None]
        refs, components = msgspec.json.schema_components(types, ref_template=REF)
        components.update(shared or {})
        schema = dict(zip(types, refs, strict=True))
        for op in self.operations:  # query Structs become parameters, not components
            if op.query is not None:
                components.pop(op.query.__name__, None)
        paths: dict[str, dict[str, Any]] = {}
        for op in self.operations:
            paths.setdefault(op.path, {})[op.method.lower()] = self._operation(
                op, schema, components)
        return {
            "openapi": "3.1.0",
            "info": {"title": title, "version": version, "description": description},
            "paths": paths,
            "components": {"schemas": components, "securitySchemes": SECURITY_SCHEMES},
            "security": [{name: []} for name in SECURITY_SCHEMES],
        }

    def _operation(self, op: Operation, schema: dict[Any, Any],
                   components: dict[str, Any]) -> dict[str, Any]:
        doc: dict[str, Any] = {"operationId": op.operation_id, "summary": op.summary}
        if op.description:
            doc["description"] = op.description
        params = [
            {"name": name, "in": "path", "required": True,
             "schema": schema[self.path_params[name]]}
            for name in _PARAM_RE.findall(op.path)
        ]
        if op.query is not None:
            params += _query_parameters(op.query)
        if params:
            doc["parameters"] = params
        if op.body is not None:
            doc["requestBody"] = {"required": True,
                                  "content": {JSON: {"schema": schema[op.body]}}}
        success: dict[str, Any] = {"description": HTTPStatus(op.status).phrase}
        if op.reply is not None:
            success["content"] = {op.media_type: {"schema": schema[op.reply]}}
        responses: dict[str, Any] = {str(op.status): success}
        for status in op.empty:
            responses[str(status)] = {"description": HTTPStatus(status).phrase}
        error = {JSON: {"schema": schema[ErrorBody]}}
        for status in sorted({*op.errors, *((401,) if op.auth else ())}):
            responses[str(status)] = {"description": _error_description(status),
                                      "content": error}
        doc["responses"] = responses
        if not op.auth:
            doc["security"] = []
        return doc


def _by_method(handlers: dict[str, Endpoint]) -> Endpoint:
    if len(handlers) == 1:
        return next(iter(handlers.values()))

    async def endpoint(request: Request) -> Response:
        method = request.method
        return await handlers["GET" if method == "HEAD" else method](request)

    return endpoint


def _query_parameters(query: type[msgspec.Struct]) -> list[dict[str, Any]]:
    """The query parameters of a Struct's fields."""
    (_,), components = msgspec.json.schema_components([query], ref_template=REF)
    obj = components[query.__name__]
    required = set(obj.get("required", ()))
    params = []
    for name, field in obj["properties"].items():
        # A query string has no null, and lax conversion reads "null" as None: an optional
        # parameter defaults to msgspec.UNSET instead.
        assert {"type": "null"} not in field.get("anyOf", ()), f"{query.__name__}.{name}"
        params.append({"name": name, "in": "query", "required": name in required,
                       "schema": field})
    return params


def _error_description(status: int) -> str:
    codes = sorted(code for code, http in HTTP_STATUS.items() if http == status)
    phrase = HTTPStatus(status).phrase
    return phrase + (": " + ", ".join(f"`{c}`" for c in codes) if codes else "")
