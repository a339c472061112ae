"""The SDKs stand apart from the server: importing an SDK loads no server module, and no
server module imports an SDK.

Each rule is checked twice. Once as it happens: a fresh interpreter imports the modules and
its ``sys.modules`` is read, which also sees what a module loads by other means. And once as
a reader holds it: every import in the files, read with :mod:`ast`, including those inside
a function (which run only when it is called, so loading alone misses them) and under
``TYPE_CHECKING``. No Redis, no gateway process.

The command line (:data:`FRONT`) sits above both: it starts the server, runs the demo agent
(the worker SDK) and ``gateway tail`` (the client SDK), so it is the one module of the
package that may import an SDK. Nothing imports it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from .imports import closure, graph, libraries_of, modules

ROOT = Path(__file__).resolve().parents[2]

WIRE = {"gateway", "gateway.protocol", "gateway.closecodes"}
"""The wire contract, which the client SDK shares with the server."""

WORKER_SHARED = WIRE | {"gateway.config", "gateway.errors", "gateway.events", "gateway.tools"}
"""What the worker SDK shares with the server, beside the Redis layer (``gateway.redis.*``)."""

FRONT = {"gateway.cli", "gateway.__main__"}
"""The command line: above the server and both SDKs."""

SERVER_LIBRARIES = {"starlette", "uvicorn", "redis", "httptools", "prometheus_client"}
"""What the client SDK must not need: the server's libraries (``websockets`` it shares, as
its connection)."""


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
        if not in_package(name, "gateway.sdk") and name not in FRONT:
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
            "gateway.api"} <= set(modules)
    sdk = {name for name in loaded_by(*modules) if in_package(name, "gateway.sdk")}
    assert not sdk, f"importing the server loads SDK modules: {sorted(sdk)}"


# --- every import, as written ------------------------------------------------------------


def test_the_client_sdks_imports_reach_only_the_wire_contract() -> None:
    edges = graph()
    reached = closure(edges, {"gateway.sdk.client"})
    server = {name for name in reached if not in_package(name, "gateway.sdk")} - WIRE
    assert not server, f"the client SDK imports server modules: {sorted(server)}"
    found = modules()
    libraries = set().union(*(libraries_of(found[name], set(found)) for name in reached))
    assert not libraries & SERVER_LIBRARIES, (
        f"the client SDK imports {sorted(libraries & SERVER_LIBRARIES)}")


def test_the_worker_sdks_imports_reach_only_what_it_shares() -> None:
    reached = closure(graph(), {"gateway.sdk.agent"})
    server = {name for name in reached if not in_package(name, "gateway.sdk")
              and not in_package(name, "gateway.redis")} - WORKER_SHARED
    assert not server, f"the worker SDK imports server modules: {sorted(server)}"


def test_no_server_modules_imports_reach_an_sdk() -> None:
    edges = graph()
    modules = set(server_modules())
    sdk = {name for name in closure(edges, modules) if in_package(name, "gateway.sdk")}
    assert not sdk, f"the server imports SDK modules: {sorted(sdk)}"
    front = {name for name in closure(edges, modules | {"gateway.sdk"}) if name in FRONT}
    assert not front, f"{sorted(front)} is imported by the server or an SDK"


def test_an_import_inside_a_function_is_read() -> None:
    """``gateway.cli`` imports both SDKs only inside functions: loading it misses them."""
    assert {"gateway.sdk.client", "gateway.sdk.agent"} <= closure(graph(), {"gateway.cli"})
    assert not {"gateway.sdk.client", "gateway.sdk.agent"} & loaded_by("gateway.cli")
