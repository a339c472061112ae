"""The demo agent's titles: a chat started with a slash command gets a sensible one."""

from __future__ import annotations

import pytest

from gateway.sdk.demo_agent import TITLE_CHARS, title_for


@pytest.mark.parametrize(("text", "title"), [
    ("plan a day in Lisbon", "Plan a day in Lisbon"),
    ("  plan\n a   day ", "Plan a day"),
    ("/goal ship the release", "Ship the release"),
    ("/slow tell me a long story", "Tell me a long story"),
    ("/goal", "New goal"),
    ("/done", "Goal check"),
    ("/slow", "Slow answer"),
    ("/fail", "Failure test"),
    ("/SLOW", "Slow answer"),
    ("/help", "Help"),
    ("/", "Command"),
])
def test_title_for(text: str, title: str) -> None:
    assert title_for(text) == title


def test_a_long_first_message_is_cut_at_a_word() -> None:
    title = title_for("/goal " + "word " * 40)
    assert len(title) <= TITLE_CHARS and title.endswith("word") and title.startswith("Word")
