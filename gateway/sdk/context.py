"""An agent's context: the conversation so far, as chat messages a model takes.

Pure, no I/O: :meth:`Turn.history <gateway.sdk.agent.Turn.history>` reads the path to its
turn and hands the events here. The messages, in order:

- ``{"role": "user", "content": text, "msg_id": id}`` for each user message;
- ``{"role": "assistant", "content": text}`` for each answer the agent committed
  (``"partial": True`` when it was stopped: cancelled, timed out, or left by a retry);
- ``{"role": "assistant", "content": "", "tool_calls": [{"id", "name", "args"}]}`` for the
  tool calls of a turn, and ``{"role": "tool", "tool_call_id": id, "content": result}`` for
  each result.

Every message has a stable ``id``, the same each time the path is read: a user message's
``msg_id``; for the others ``e<seq>``, the seq of the event it comes from (of the first
``tool_call`` of a group). Protocols that name messages (AG-UI) take it as theirs.

The window obeys the rules that keep a model's input legal: it starts at a user message
(never mid-turn, never with a tool result whose call was cut off), the message budget is
applied first, then the token budget from the tail; assistant messages with nothing in them
are dropped.
"""

from __future__ import annotations

from typing import Any

Message = dict[str, Any]


def messages_of(events: list[dict[str, Any]]) -> list[Message]:
    """The chat messages of a path's events, in order."""
    out: list[Message] = []
    for event in events:
        kind, data = event.get("type"), event.get("data") or {}
        if not isinstance(data, dict):
            continue
        seq = event.get("seq")
        ident = f"e{seq}" if seq is not None else None
        if kind == "user_message":
            out.append({"role": "user", "content": str(data.get("text", "")),
                        "msg_id": data.get("msg_id"), "id": data.get("msg_id")})
        elif kind == "message":
            text = data.get("text")
            if isinstance(text, str) and text:
                message: Message = {"role": "assistant", "content": text, "id": ident}
                if data.get("partial"):
                    message["partial"] = True
                out.append(message)
        elif kind == "tool_call":
            call = {"id": data.get("call_id"), "name": data.get("name"), "args": data.get("args")}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call],
                            "id": ident})
        elif kind == "tool_result":
            out.append({"role": "tool", "tool_call_id": data.get("call_id"),
                        "content": data.get("result"), "id": ident})
    return out


def tokens(message: Message) -> int:
    """A rough count (four characters a token): enough to keep a window in budget."""
    size = len(str(message.get("content") or ""))
    for call in message.get("tool_calls", ()):
        size += len(str(call.get("name"))) + len(str(call.get("args")))
    return size // 4 + 4


def window(messages: list[Message], max_messages: int = 120,
           max_tokens: int = 0) -> list[Message]:
    """The legal suffix of ``messages`` within the budgets (0: no token budget)."""
    start = max(0, len(messages) - max_messages) if max_messages > 0 else 0
    if max_tokens > 0:
        used, first = 0, len(messages)
        for i in range(len(messages) - 1, start - 1, -1):
            used += tokens(messages[i])
            if used > max_tokens:
                break
            first = i
        start = first
    while start < len(messages) and messages[start]["role"] != "user":
        start += 1  # never mid-turn, never an orphan tool result
    return messages[start:]
