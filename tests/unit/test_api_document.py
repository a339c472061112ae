"""The OpenAPI document: valid, one with the routes, and built only from types that can
say what the handlers accept."""

from __future__ import annotations

import re
import sys
from typing import Annotated

import msgspec
import pytest
import schemathesis
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway import api
from gateway import protocol as p
from gateway.openapi import Api


def test_the_document_is_valid_openapi_3_1() -> None:
    document = msgspec.json.decode(api.document())
    assert document["openapi"] == "3.1.0"
    schemathesis.openapi.from_dict(document).validate()


def test_every_route_is_documented_and_every_operation_routed() -> None:
    document = msgspec.json.decode(api.document())
    documented = {path: {m.upper() for m in item} for path, item in document["paths"].items()}
    routed: dict[str, set[str]] = {}
    for route in api.routes:
        assert isinstance(route, Route)
        # CORS preflight routes (the AI SDK transport's) are for browsers, not documented.
        routed.setdefault(route.path, set()).update(set(route.methods or ()) - {"HEAD", "OPTIONS"})
    assert routed == documented


def test_every_reply_and_error_refers_to_a_component() -> None:
    document = msgspec.json.decode(api.document())
    schemas = document["components"]["schemas"]
    for path, item in document["paths"].items():
        for method, op in item.items():
            for status, reply in op["responses"].items():
                for media, content in reply.get("content", {}).items():
                    ref = content["schema"].get("$ref", "")
                    name = ref.rsplit("/", 1)[-1]
                    if media == "application/json" and int(status) >= 400:
                        assert name == "ErrorBody", (method, path, status)
                    assert not ref or name in schemas, (method, path, status)


def test_a_title_must_hold_something_besides_whitespace() -> None:
    """The pattern's class is spelled out for every regex dialect; it must be exactly the
    whitespace str.split() trims, or the schema and the server disagree on a title."""
    (meta,) = p.Title.__metadata__
    pattern = re.compile(meta.pattern)
    everything = "".join(map(chr, range(sys.maxunicode + 1)))
    assert "".join(pattern.findall(everything)) == "".join(everything.split())


async def _endpoint(request: Request) -> Response:
    return Response()


def test_a_query_parameter_may_not_be_nullable() -> None:
    class Query(msgspec.Struct):
        page: Annotated[int, msgspec.Meta(ge=0)] | None = None

    table = Api(path_params={})
    table.operation("GET", "/q", summary="q", query=Query)(_endpoint)
    with pytest.raises(AssertionError, match=r"Query\.page"):
        table.document(title="t", version="0", description="")


def test_every_path_parameter_needs_a_type() -> None:
    table = Api(path_params={"chat_id": p.ChatId})
    with pytest.raises(AssertionError, match="turn_id"):
        table.operation("GET", "/v1/conversations/{chat_id}/turns/{turn_id}",
                        summary="t")(_endpoint)
