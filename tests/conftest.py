"""Fixtures: a real Redis-compatible server process, real gateway processes, real sockets.

Nothing here assumes a server on a well-known port: the Redis-compatible server is started
per test session on a unix socket in a temporary directory, and every gateway process gets
a free TCP port.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from redis.exceptions import ResponseError

from gateway.auth import issue_token
from gateway.config import Settings
from gateway.embedded import EmbeddedRedis
from gateway.redis.agent_inbox import inbox_key

from .wsclient import Client, connect  # noqa: F401  (re-exported for tests)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session", autouse=True)
def state_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A serving gateway leaves a note in the user's state directory (gateway.discovery):
    the test processes leave theirs in a temporary one, never the developer's."""
    before = os.environ.get("XDG_STATE_HOME")
    os.environ["XDG_STATE_HOME"] = str(tmp_path_factory.mktemp("state"))
    yield
    if before is None:
        del os.environ["XDG_STATE_HOME"]
    else:
        os.environ["XDG_STATE_HOME"] = before


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server = EmbeddedRedis(tmp_path_factory.mktemp("redis"), persistent=False)
    server.start()
    yield server.url
    server.stop()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class GatewayProcess:
    """One ``gateway serve`` child process with its own settings."""

    def __init__(self, env: dict[str, str], args: list[str] | None = None) -> None:
        self.env = env
        self.args = args or []
        self.port = int(env["GATEWAY_PORT"])
        self.secret = env["GATEWAY_SECRET"]
        self.http = f"http://127.0.0.1:{self.port}"
        self.ws = f"ws://127.0.0.1:{self.port}/v1/ws"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 20.0) -> GatewayProcess:
        log = open(Path(self.env["GATEWAY_DATA_DIR"]) / f"gateway-{self.port}.log", "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gateway", "serve", "--log-level", "warning", *self.args],
            env=self.env, stdout=log, stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited with {self.proc.returncode}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.http + "/readyz", timeout=1).status_code == 200:
                    return self
            time.sleep(0.05)
        raise RuntimeError("gateway did not become ready")

    def token(self, sub: str, role: str = "user", ttl: float = 3600) -> str:
        return issue_token(self.secret, sub, role, ttl)  # type: ignore[arg-type]

    def headers(self, sub: str, role: str = "user") -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token(sub, role)}"}

    def url(self, sub: str, role: str = "user", **query: str) -> str:
        pairs = [f"token={self.token(sub, role)}", *(f"{k}={v}" for k, v in query.items())]
        params = "&".join(pairs)
        return f"{self.ws}?{params}"

    def stop(self, sig: int = signal.SIGTERM) -> None:
        self.signal(sig)
        self.wait_stopped()

    def signal(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def wait_stopped(self) -> None:
        """Wait for the process to exit after a signal; killed after 15 s."""
        if self.proc is not None:
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="session")
def gateway_env(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    env.update({
        "GATEWAY_REDIS_URL": redis_url,
        "GATEWAY_SECRET": secrets.token_hex(16),
        "GATEWAY_DATA_DIR": str(tmp_path_factory.mktemp("gateway")),
        "GATEWAY_ALLOWED_ORIGINS": "http://good.example",
    })
    return env


@pytest.fixture(scope="session")
def start_gateway(gateway_env: dict[str, str]) -> Iterator[Any]:
    """Start a gateway with extra ``GATEWAY_*`` settings; all are stopped at the end."""
    started: list[GatewayProcess] = []

    def start(**settings: Any) -> GatewayProcess:
        env = dict(gateway_env, GATEWAY_PORT=str(free_port()))
        env.update({f"GATEWAY_{k.upper()}": str(v) for k, v in settings.items()})
        process = GatewayProcess(env).start()
        started.append(process)
        return process

    yield start
    # All told at once, then waited for: they shut down side by side, not one by one.
    for process in started:
        process.signal()
    for process in started:
        process.wait_stopped()


@pytest.fixture(scope="session")
def gateway(start_gateway: Any) -> GatewayProcess:
    """The shared gateway with default settings (a short turn timeout aside)."""
    process: GatewayProcess = start_gateway(turn_timeout=600)
    return process


@pytest.fixture
def chat_id() -> str:
    return "chat-" + uuid.uuid4().hex[:12]


@pytest.fixture
def user() -> str:
    return "u" + uuid.uuid4().hex[:10]


@pytest.fixture
def group(redis_url: str) -> Iterator[str]:
    """An agent-inbox consumer group of this test only; destroyed afterwards."""
    name = "test-" + uuid.uuid4().hex[:10]
    yield name
    client = redis.Redis.from_url(redis_url)
    try:
        for n in range(Settings().inbox_partitions):
            with contextlib.suppress(ResponseError):
                client.xgroup_destroy(inbox_key(n), name)
    finally:
        client.close()


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """The table of the fault tests (rows collected by tests/faults.py), when any ran."""
    faults = sys.modules.get("tests.faults")
    rows = getattr(faults, "ROWS", None)
    if faults is not None and rows:
        terminalreporter.write_sep("-", "faults under load")
        for line in faults.table(rows):
            terminalreporter.write_line(line)
