"""The demo agent: enough behaviour to exercise every agent-UI frame without a model.

Run it with ``gateway agent gateway.sdk.demo_agent:handle`` (or in-process: the embedded default
and dev mode start it inside the gateway, see :class:`gateway.runtime.Gateway`). It answers
every message by streaming the answer word by word as ``delta`` frames (a resumable
stream), then commits it as one durable ``message``, and ends the turn. Commands:

- ``/goal <objective>``: start a goal (``goal_state`` active);
- ``/done``: complete the active goal (``goal_state`` inactive, ``status: complete``, a recap);
- ``/slow``: stream for about ten seconds (cancel it to see ``turn_end`` ``reason: cancelled``);
- ``/fail``: raise, so the worker ends the turn with ``reason: error``.

The first message of an untitled conversation also gives it a title (:func:`title_for`):
its first words, or for a command its argument or what the command does.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

from ..redis.records import Meta
from .agent import Turn

WORD_DELAY = 0.03  # seconds between streamed words
SLOW_WORDS = 100
SLOW_DELAY = 0.1  # /slow: 100 words, 0.1 s apart: about ten seconds
TITLE_CHARS = 60
ECHO_CHARS = 200
HELP = "Try /goal <objective>, /done or /slow."
# The title of a chat started with a command and nothing after it: what the command does.
COMMAND_TITLES = {
    "/goal": "New goal",
    "/done": "Goal check",
    "/slow": "Slow answer",
    "/fail": "Failure test",
}


def make_title(text: str) -> str:
    """The first words of ``text``, up to 60 characters, capitalised."""
    title = ""
    for word in text.split():
        candidate = f"{title} {word}".strip()
        if len(candidate) > TITLE_CHARS:
            break
        title = candidate
    title = title or " ".join(text.split())[:TITLE_CHARS]
    return title[:1].upper() + title[1:]


def title_for(text: str) -> str:
    """The title a first message gives its chat: its first words; for a slash command, the
    words after it ("/goal plan a trip": "Plan a trip"), or, with none, what the command
    does ("/slow": "Slow answer", an unknown "/help": "Help")."""
    text = " ".join(text.split())
    if not text.startswith("/"):
        return make_title(text)
    command, _, rest = text.partition(" ")
    if rest:
        return make_title(rest)
    return COMMAND_TITLES.get(command.lower()) or make_title(command.lstrip("/")) or "Command"


def shorten(text: str, limit: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 1].rstrip() + "…"


def current_goal(meta: Meta | None) -> dict[str, Any] | None:
    if meta is None or not meta.goal:
        return None
    goal = msgspec.json.decode(meta.goal)
    return goal if isinstance(goal, dict) else None


async def stream(turn: Turn, text: str, delay: float = WORD_DELAY) -> str:
    """Send ``text`` word by word as deltas; stop early on cancel. Returns what was sent."""
    sent: list[str] = []
    for piece in re.findall(r"\S+\s*", text):
        if turn.cancelled:
            break
        await turn.delta(piece)
        sent.append(piece)
        if await turn.sleep(delay):
            break
    return "".join(sent)


async def give_title(turn: Turn, meta: Meta, text: str) -> None:
    """The first message titles an untitled chat. Another version of the first message (an
    edit, or a new first message after undoing everything) titles it anew, unless someone
    renamed it: only a title the agent gave an earlier version is replaced."""
    if not meta.title:
        await turn.title(title_for(text))
        return
    if meta.message_count > 2:  # not the first exchange on the path: nothing to look up
        return
    tree = await turn.store.tree(turn.chat_id)
    if tree is None or len(tree.roots) < 2:
        return
    nodes = {node.id: node for node in tree.nodes}
    mine = nodes.get(turn.turn_id)
    if mine is None or mine.parent_id not in tree.roots:
        return
    given = {title_for(nodes[root].preview or "") for root in tree.roots
             if root != mine.parent_id and root in nodes}
    wanted = title_for(text)
    if meta.title != wanted and meta.title in given:
        await turn.title(wanted)


async def handle(turn: Turn) -> None:
    text = turn.text.strip()
    command, _, rest = text.partition(" ")
    meta = turn.meta or await turn.store.meta(turn.chat_id)

    if meta is not None and text:
        await give_title(turn, meta, text)

    delay = WORD_DELAY
    if command == "/goal":
        objective = " ".join(rest.split())
        if not objective:
            reply = "Tell me the objective: /goal <objective>."
        else:
            await turn.goal_state(True, objective=objective,
                                  ui_summary=shorten(f"Goal: {objective}", 120))
            reply = (f"Goal set: {objective}. I will keep it in view; "
                     "send /done when it is complete.")
    elif command == "/done":
        goal = current_goal(meta)
        if goal is None or not goal.get("active"):
            reply = "There is no active goal. Start one with /goal <objective>."
        else:
            objective = str(goal.get("objective") or "")
            recap = f"Completed the goal: {objective}." if objective else "Completed the goal."
            await turn.goal_state(False, objective=objective, status="complete",
                                  ui_summary=shorten(f"Done: {objective}", 120), recap=recap)
            reply = f"Goal complete. {recap}"
    elif command == "/slow":
        reply = " ".join(f"word{i}" for i in range(1, SLOW_WORDS + 1))
        delay = SLOW_DELAY
    elif command == "/fail":
        raise RuntimeError("the demo agent failed on purpose (/fail)")
    else:
        reply = (f"You said: “{shorten(text, ECHO_CHARS)}”. I am the demo agent: I stream my "
                 f"answers word by word. {HELP}")

    streamed = await stream(turn, reply, delay)
    # No text: the message commits what was streamed (the gateway has it), sent once.
    if turn.cancelled:
        if streamed:
            await turn.message(cancelled=True)
    else:
        await turn.message()
    # A model would report its own counts; the demo estimates four characters a token.
    await turn.end(usage={"input_tokens": -(-len(turn.text) // 4),
                          "output_tokens": -(-len(streamed) // 4)})
