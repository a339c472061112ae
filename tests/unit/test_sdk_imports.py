"""The SDKs stand apart from the server: importing an SDK loads no server module, and no
server module imports an SDK. Each check imports in a fresh interpreter and reads its
``sys.modules``; no Redis, no gateway process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

WIRE = {"gateway", "gateway.protocol", "gateway.closecodes"}
"""The wire contract, which the client SDK shares with the server."""

WORKER_SHARED = WIRE | {"gateway.config", "gateway.errors", "gateway.events"}
"""What the worker SDK shares with the server, beside the Redis layer (``gateway.redis.*``)."""


def loaded_by(*modules: str) -> set[str]:
    """Every module a fresh interpreter has loaded once it imported ``modules``."""
    code = "".join(f"import {name}\n" for name in modules)
    code += "import json, sys\nprint(json.dumps(sorted(sys.modules)))\n"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    loaded = set(json.loads(done.stdout))
    assert set(modules) <= loaded
    return loaded


def ours(loaded: set[str]) -> set[str]:
    return {name for name in loaded if name.split(".")[0] == "gateway"}


def in_package(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def server_modules() -> list[str]:
    """Every module of the gateway package outside the SDKs, found by file (importing a
    package to list it would load it)."""
    names = []
    for path in sorted((ROOT / "gateway").rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        name = ".".join(parts)
        if not in_package(name, "gateway.sdk") and name != "gateway.__main__":
            names.append(name)
    return names


def test_the_client_sdk_loads_only_the_wire_contract() -> None:
    loaded = loaded_by("gateway.sdk.client")
    server = {name for name in ours(loaded) if not in_package(name, "gateway.sdk")} - WIRE
    assert not server, f"importing the client SDK loads server modules: {sorted(server)}"
    libraries = {name.split(".")[0] for name in loaded} & {"starlette", "uvicorn", "redis"}
    assert not libraries, f"importing the client SDK loads {sorted(libraries)}"


def test_the_worker_sdk_loads_no_server_module() -> None:
    loaded = ours(loaded_by("gateway.sdk.agent"))
    server = {name for name in loaded if not in_package(name, "gateway.sdk")
              and not in_package(name, "gateway.redis")} - WORKER_SHARED
    assert not server, f"importing the worker SDK loads server modules: {sorted(server)}"


def test_no_server_module_imports_an_sdk() -> None:
    modules = server_modules()
    assert {"gateway.app", "gateway.runtime", "gateway.hub", "gateway.session", "gateway.sse",
            "gateway.api", "gateway.cli"} <= set(modules)
    sdk = {name for name in loaded_by(*modules) if in_package(name, "gateway.sdk")}
    assert not sdk, f"importing the server loads SDK modules: {sorted(sdk)}"
