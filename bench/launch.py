"""Start and stop a gateway process for a benchmark: one way, shared by every script here."""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))

from gateway.embedded import EmbeddedRedis  # noqa: E402 (after the path is set)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_gateway(redis_url: str, secret: str, port: int, data_dir: Path, *,
                  checkout: Path | None = None,
                  env: dict[str, str] | None = None,
                  log_level: str = "warning") -> subprocess.Popen[bytes]:
    """``gateway serve`` on ``port``, ready (``/readyz``) when this returns; its output goes
    to ``data_dir/gateway.log``. ``checkout``: serve that checkout with its own ``.venv``
    (A/B runs); default this one, with this interpreter. ``log_level``: ``gateway serve``'s
    (the peer bench runs it at its default, ``info``)."""
    root = (checkout or HERE).resolve()
    python = root / ".venv" / "bin" / "python" if checkout is not None else Path(sys.executable)
    process_env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    process_env.update({"GATEWAY_REDIS_URL": redis_url, "GATEWAY_SECRET": secret,
                        "GATEWAY_PORT": str(port), "GATEWAY_DATA_DIR": str(data_dir),
                        **(env or {})})
    process_env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(root), process_env.get("PYTHONPATH")]))
    with open(data_dir / "gateway.log", "ab") as log:
        proc = subprocess.Popen([str(python), "-m", "gateway", "serve", "--log-level", log_level],
                                env=process_env, stdout=log, stderr=subprocess.STDOUT, cwd=root)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"gateway exited with {proc.returncode}; see {data_dir}/gateway.log")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1) as resp:
                if resp.status == 200:
                    return proc
        time.sleep(0.05)
    proc.kill()
    raise SystemExit("gateway did not become ready")


def stop_gateway(proc: subprocess.Popen[bytes] | None) -> None:
    """SIGTERM (a graceful drain), then SIGKILL after 15 s."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@dataclass
class Private:
    """A gateway serving on its own private Redis server (``private_gateway``)."""

    redis_url: str
    port: int
    secret: str
    process: subprocess.Popen[bytes]
    server: EmbeddedRedis
    data_dir: Path


@contextlib.contextmanager
def private_gateway(prefix: str, *, checkout: Path | None = None,
                    env: dict[str, str] | None = None) -> Iterator[Private]:
    """A private Redis server and a gateway on it, in a temporary directory; both stopped
    (and the directory gone) on leaving."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        data_dir = Path(tmp)
        server = EmbeddedRedis(data_dir / "redis", persistent=False)
        server.start()
        gateway = None
        try:
            secret, port = secrets.token_hex(16), free_port()
            gateway = start_gateway(server.url, secret, port, data_dir, checkout=checkout,
                                    env=env)
            yield Private(server.url, port, secret, gateway, server, data_dir)
        finally:
            stop_gateway(gateway)
            server.stop()
