"""Agents the gateway drives: each a Turn handler built from a remote agent's address;
nothing server-side. The worker (:class:`gateway.sdk.agent.AgentWorker`) runs one as it runs
any handler, so durability, resume, cancels and takeover after a crash are the same."""

from __future__ import annotations

from typing import Any

from ...errors import Rejected
from ..agent import Turn, TurnOver


async def call_tool(turn: Turn, name: str, args: Any, call_id: str | None) -> None:
    """A tool call the agent made, once its arguments are complete: a question for a
    person when ``name`` is one of the conversation's client tools (the turn then ends
    awaiting the answer, :meth:`Turn.ask`), else a durable ``tool_call``."""
    if not any(tool.name == name for tool in turn.client_tools):
        await turn.tool_call(name, args, call_id=call_id)
        return
    try:
        await turn.ask(name, args, call_id)
    except TurnOver:
        raise
    except Rejected as exc:  # arguments that do not fit: the person cannot answer them
        await turn.end(reason="error", error=f"The agent asked with {name} in a way that "
                       f"does not fit the tool: {exc.message}")
