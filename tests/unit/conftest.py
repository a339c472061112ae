"""The unit tier: pure modules only, no server process and no socket.

Every server of the suite hangs off the session's ``redis_url`` (the gateways, the agent
groups); asking for it here is a mistake, so it fails at once instead of starting one.
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def redis_url() -> str:
    pytest.fail("a unit test may not start a server: move it out of tests/unit")
