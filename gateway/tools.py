"""Client tools: what an agent may ask a person, and the checks on both sides of the question.

A conversation declares its client tools (``PATCH /v1/conversations/{id}``): each a name,
a JSON Schema of the arguments the agent passes and, optionally, one of the answer a person
gives. The agent's ``tool_call`` (``awaiting: true``) is checked against the first, the
person's ``tool_result`` against the second, with the ``jsonschema`` library (2020-12).
Pure: no I/O; the gateway and the worker SDK both check here.
"""

from __future__ import annotations

from typing import Any

import msgspec
from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError, ValidationError

from . import protocol as p
from .errors import Rejected

MAX_TOOLS = 32
_decode_tools = msgspec.json.Decoder(list[p.ClientTool]).decode


def check_declared(tools: list[p.ClientTool]) -> None:
    """Refuse tools with the same name, or a schema that is not a JSON Schema."""
    if len(tools) > MAX_TOOLS:
        raise Rejected("invalid_request", f"client_tools: at most {MAX_TOOLS}")
    names = [tool.name for tool in tools]
    if len(set(names)) != len(names):
        raise Rejected("invalid_request", "client_tools: each name once")
    for tool in tools:
        for what, schema in (("parameters", tool.parameters), ("result", tool.result)):
            if schema is None:
                continue
            try:
                Draft202012Validator.check_schema(schema)
            except SchemaError as exc:
                raise Rejected("invalid_request", f"client_tools: {tool.name}.{what} is not "
                               f"a JSON Schema: {exc.message}") from None


def declared(raw: bytes | None) -> list[p.ClientTool]:
    """A conversation's client tools, as its meta keeps them."""
    return _decode_tools(raw) if raw else []


def find(raw: bytes | None, name: str) -> p.ClientTool | None:
    return next((tool for tool in declared(raw) if tool.name == name), None)


def check_args(tool: p.ClientTool, args: Any) -> None:
    """The agent's arguments fit the tool's ``parameters``, else ``invalid_request``."""
    _check(tool.parameters, args, f"tool_call: {tool.name}'s arguments")


def check_result(tool: p.ClientTool, result: Any) -> None:
    """A person's answer fits the tool's ``result`` schema (any answer without one)."""
    if tool.result is not None:
        _check(tool.result, result, f"tool_result: the answer to {tool.name}")


def _check(schema: dict[str, Any], value: Any, what: str) -> None:
    error = next(iter(Draft202012Validator(schema).iter_errors(value)), None)
    if error is not None:
        where = "".join(f"[{part!r}]" for part in error.absolute_path)
        raise Rejected("invalid_request", f"{what}{' at ' + where if where else ''} "
                       f"do not fit its schema: {_message(error)}")


def _message(error: ValidationError) -> str:
    return str(error.message)[:300]
