"""deploy/ against the code: the Dockerfile, compose.yaml with haproxy.cfg, the Kubernetes
manifests and the systemd unit.

No Docker engine or Kubernetes cluster runs here, so each file is read and checked against
what the gateway really does: every ``GATEWAY_*`` name is one the code reads, each command is
run through the real ``gateway serve`` (with ``uvicorn.run`` stubbed: what it would listen on,
how long it takes to drain, which settings the app would load), probe and health-check paths
are the app's routes, and the manifests match the Kubernetes API schemas. Where the tools
are installed, HAProxy checks haproxy.cfg, and two real gateways drain behind it.
"""

from __future__ import annotations

import ast
import asyncio
import configparser
import contextlib
import functools
import json
import logging
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import kubernetes_validate
import msgspec
import pytest
import uvicorn
import yaml
from starlette.routing import Route

from gateway import api, cli, sse
from gateway.auth import TokenCache
from gateway.config import Settings, load_settings
from gateway.sdk.client import Event, GatewayClient

from .steps import publish

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
OTHERS = {DEPLOY / "grafana"}  # deploy/ folders another part of the project owns

# --- what the code reads ----------------------------------------------------------------


def _is_environ(node: ast.expr) -> bool:
    return ((isinstance(node, ast.Attribute) and node.attr == "environ")
            or (isinstance(node, ast.Name) and node.id == "environ"))


@functools.cache
def read_directly() -> frozenset[str]:
    """``GATEWAY_*`` names the package reads from the environment itself, not via Settings:
    ``os.environ["X"]`` (read, not assigned), ``os.environ.get("X")``, ``os.getenv("X")``."""
    names: set[str] = set()
    for path in (ROOT / "gateway").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            key: ast.expr | None = None
            if (isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load)
                    and _is_environ(node.value)):
                key = node.slice
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
                if ((node.func.attr == "get" and _is_environ(node.func.value))
                        or node.func.attr == "getenv"):
                    key = node.args[0]
            if isinstance(key, ast.Constant) and isinstance(key.value, str):
                if key.value.startswith("GATEWAY_"):
                    names.add(key.value)
    return frozenset(names)


def known_variables() -> frozenset[str]:
    """Every ``GATEWAY_*`` variable the gateway reads: field ``x`` of Settings is
    ``GATEWAY_X`` (config.load_settings), plus the ones read directly."""
    fields = {f"GATEWAY_{field.name.upper()}" for field in msgspec.structs.fields(Settings)}
    return fields | read_directly()


def deploy_files() -> list[Path]:
    return sorted(path for path in DEPLOY.rglob("*") if path.is_file()
                  and not any(path.is_relative_to(other) for other in OTHERS))


def test_the_known_variables_are_derived_from_the_code() -> None:
    known = known_variables()
    assert {"GATEWAY_REDIS_URL", "GATEWAY_SECRET", "GATEWAY_PORT"} <= known
    assert "GATEWAY_SECRET" in read_directly()  # cli.py reads it back after serve sets it


@pytest.mark.parametrize("path", deploy_files(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_deploy_files_name_only_variables_the_code_reads(path: Path) -> None:
    """Comments included: a setting that was renamed or removed must not linger anywhere."""
    named = set(re.findall(r"\bGATEWAY_[A-Z0-9_]+\b", path.read_text()))
    unknown = named - known_variables()
    assert not unknown, f"{path.name} names {sorted(unknown)}, which the gateway never reads"


# --- the app's routes -------------------------------------------------------------------


def route(path: str) -> Route:
    """The HTTP route serving ``path`` exactly (probes and health checks use no parameters)."""
    matches = [r for r in api.routes if isinstance(r, Route) and r.path == path]
    assert matches, f"{path} is not a route of the app (gateway/api.py)"
    return matches[0]


def sse_suffix() -> str:
    """The last path segment of the SSE route (``/v1/conversations/{chat_id}/stream``)."""
    paths = [r.path for r in api.routes if isinstance(r, Route) and r.endpoint is sse.endpoint]
    assert len(paths) == 1
    return "/" + paths[0].rsplit("/", 1)[1]


# --- running `gateway serve` for real, up to uvicorn ------------------------------------


@dataclass
class Served:
    """What ``gateway serve`` hands uvicorn, and the settings its app loads."""

    uvicorn: dict[str, Any]
    settings: Settings

    @property
    def port(self) -> int:
        port: int = self.uvicorn["port"]
        return port

    @property
    def drain_seconds(self) -> float:
        """SIGTERM to exit, at most: uvicorn closes the WebSockets with 1012 at once, waits
        up to its graceful timeout for HTTP requests and SSE streams, then the app stops
        (companions, pub/sub, Redis), each Redis call bounded by the Redis timeout."""
        graceful: float = self.uvicorn["timeout_graceful_shutdown"]
        return graceful + self.settings.redis_timeout


@contextlib.contextmanager
def environment(env: dict[str, str]) -> Iterator[None]:
    """``env`` as the whole ``GATEWAY_*`` environment; everything restored afterwards (serve
    writes some variables itself)."""
    saved = dict(os.environ)
    try:
        for name in [name for name in os.environ if name.startswith("GATEWAY_")]:
            del os.environ[name]
        os.environ.update(env)
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def serve(argv: list[str], env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Served:
    """Run ``argv`` through the real CLI with ``uvicorn.run`` stubbed."""
    assert argv[:2] == ["gateway", "serve"], f"{argv} does not run `gateway serve`"
    # Without one, serve starts the embedded server: fine on a laptop, not in a container.
    assert env.get("GATEWAY_REDIS_URL"), "GATEWAY_REDIS_URL is not set"
    calls: list[Served] = []

    def run(app: str, **kwargs: Any) -> None:
        calls.append(Served(kwargs, load_settings()))  # as the app factory loads them

    monkeypatch.setattr(uvicorn, "run", run)
    monkeypatch.setattr(signal, "signal", lambda *args: None)  # not this process's SIGTERM
    with environment(env):
        assert cli.main(argv[1:]) == 0
    assert len(calls) == 1
    return calls[0]


def publicly_served(served: Served) -> None:
    assert served.uvicorn["host"] == "0.0.0.0", "a container must listen on every interface"
    assert not served.settings.dev, "dev mode prints tokens and serves the demo page"
    assert served.settings.secret


# --- the Dockerfile ---------------------------------------------------------------------


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, rest) in order, continuation lines joined."""
    text = re.sub(r"\\\n", " ", (DEPLOY / "Dockerfile").read_text())
    lines = [line.strip() for line in text.splitlines()]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1])
            for line in lines if line and not line.startswith("#")]


def image_env() -> dict[str, str]:
    env: dict[str, str] = {}
    for instruction, rest in dockerfile():
        if instruction == "ENV":
            env.update(pair.split("=", 1) for pair in shlex.split(rest))
    return env


def image_instruction(name: str) -> str:
    found = [rest for instruction, rest in dockerfile() if instruction == name]
    assert len(found) == 1, f"one {name} in the Dockerfile"
    return found[0]


def image_cmd() -> list[str]:
    cmd: list[str] = json.loads(image_instruction("CMD"))
    return cmd


def image_healthcheck() -> list[str]:
    """The HEALTHCHECK command, as an argv (it is in shell form)."""
    _options, command = image_instruction("HEALTHCHECK").split(" CMD ", 1)
    return shlex.split(command)


# The least a production container is given (README's "Run it"); the secret is a dummy.
PRODUCTION_ENV = {"GATEWAY_REDIS_URL": "redis://redis:6379/0", "GATEWAY_SECRET": "dummy"}


def test_the_image_serves_on_the_port_it_exposes(monkeypatch: pytest.MonkeyPatch) -> None:
    served = serve(image_cmd(), image_env() | PRODUCTION_ENV, monkeypatch)
    publicly_served(served)
    assert image_instruction("EXPOSE").split() == [str(served.port)]
    assert "USER" in dict(dockerfile()), "the image must not run as root"


def test_the_image_health_check_asks_readyz() -> None:
    command = image_healthcheck()
    assert command[:2] == ["python", "-c"]
    path = re.search(r"http://127\.0\.0\.1:%s(/\w+)", command[2])
    assert path is not None and "GATEWAY_PORT" in command[2]
    assert route(path.group(1)).endpoint is api.readyz


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def check_passes(argv: list[str], port: int, env: dict[str, str] | None = None) -> bool:
    """Run a container health check's python command here against ``port``."""
    assert argv[0] == "python"
    done = subprocess.run([sys.executable, *argv[1:]], capture_output=True, timeout=30,
                          env=dict(os.environ, GATEWAY_PORT=str(port), **(env or {})))
    return done.returncode == 0


def test_the_health_checks_pass_on_a_ready_gateway_only(gateway: Any) -> None:
    image = image_healthcheck()
    assert check_passes(image, gateway.port)
    assert not check_passes(image, free_port())
    # compose.yaml's names the port: point it at the live gateway.
    compose_check = compose()["services"]["gateway-a"]["healthcheck"]["test"]
    assert compose_check[0] == "CMD"
    code = compose_check[3].replace(":8000/", f":{gateway.port}/")
    assert code != compose_check[3]
    assert check_passes([*compose_check[1:3], code], gateway.port)


# --- compose.yaml -----------------------------------------------------------------------


def compose() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    return loaded


def interpolate(value: str) -> str:
    """Compose's ``${VAR}``, ``${VAR:-default}``, ``${VAR:?error}`` and ``$$``, with no
    variable set: what a bare ``docker compose up`` gets."""
    def one(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name, op, rest = match.group(1), match.group(2) or "", match.group(3) or ""
        assert "?" not in op, f"${{{name}}} is required: `docker compose up` alone fails"
        return rest if "-" in op else ""
    return re.sub(r"\$\$|\$\{(\w+)(:?[-?])?([^}]*)\}", one, value)


def service_env(service: dict[str, Any]) -> dict[str, str]:
    raw = service.get("environment") or {}
    if isinstance(raw, list):
        raw = dict(item.split("=", 1) for item in raw)
    return {name: interpolate(str(value)) for name, value in raw.items()}


def gateway_services() -> dict[str, dict[str, Any]]:
    services = compose()["services"]
    return {name: service for name, service in services.items()
            if service.get("command", [])[:2] == ["gateway", "serve"]}


def compose_served(name: str, data_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Served:
    service = gateway_services()[name]
    env = image_env() | service_env(service) | {"GATEWAY_DATA_DIR": str(data_dir)}
    return serve(service["command"], env, monkeypatch)


def run_secret_service(data_dir: Path) -> str:
    """The compose `secret` service's command, run here on ``data_dir``."""
    command = compose()["services"]["secret"]["command"]
    assert command[0] == "python"
    subprocess.run([sys.executable, *command[1:]], check=True, timeout=30,
                   env=dict(os.environ, GATEWAY_DATA_DIR=str(data_dir)))
    return (data_dir / cli.SECRET_FILE).read_text()


def mounts(service: dict[str, Any]) -> dict[str, str]:
    """Container path -> volume name or host path."""
    return {v.split(":")[1]: v.split(":")[0] for v in service.get("volumes", [])}


def test_compose_writes_one_secret_that_the_gateways_and_the_cli_use(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    services = compose()["services"]
    secret_dir = service_env(services["secret"])["GATEWAY_DATA_DIR"]
    for name, service in gateway_services().items():
        data_dir = service_env(service)["GATEWAY_DATA_DIR"]
        assert data_dir == secret_dir, name
        assert mounts(service)[data_dir] == mounts(services["secret"])[secret_dir], name
        assert service["depends_on"]["secret"]["condition"] == "service_completed_successfully"
    secret = run_secret_service(tmp_path)
    assert len(secret) >= 32 and (tmp_path / cli.SECRET_FILE).stat().st_mode & 0o077 == 0
    assert run_secret_service(tmp_path) == secret  # kept across `up`s
    for name in gateway_services():
        assert compose_served(name, tmp_path, monkeypatch).settings.secret == secret
    # `docker compose exec gateway-a gateway token --sub alice`
    env = image_env() | service_env(gateway_services()["gateway-a"])
    with environment(env | {"GATEWAY_DATA_DIR": str(tmp_path)}):
        capsys.readouterr()
        assert cli.main(["token", "--sub", "alice"]) == 0
    assert TokenCache(secret).verify(capsys.readouterr().out.strip()).user_id == "alice"


def test_compose_gateways_run_on_valkey_with_aof(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    services = compose()["services"]
    valkey = services["valkey"]
    assert " ".join(valkey["command"]).count("--appendonly yes") == 1
    assert "/data" in mounts(valkey), "the AOF must outlive the container"
    run_secret_service(tmp_path)
    assert len(gateway_services()) == 2
    for name, service in gateway_services().items():
        served = compose_served(name, tmp_path, monkeypatch)
        publicly_served(served)
        assert httpx.URL(served.settings.redis_url).host == "valkey"
        assert service["depends_on"]["valkey"]["condition"] == "service_healthy"
        assert service["expose"] == [str(served.port)]
        check = service["healthcheck"]["test"]
        url = re.search(r"http://127\.0\.0\.1:(\d+)(/\w+)", check[-1])
        assert url is not None and int(url.group(1)) == served.port
        assert route(url.group(2)).endpoint is api.readyz
        assert seconds(service["stop_grace_period"]) > served.drain_seconds, name


def test_compose_builds_the_image_from_the_repository(tmp_path: Path) -> None:
    for name, service in compose()["services"].items():
        if "build" in service:
            context = (DEPLOY / service["build"]["context"]).resolve()
            assert (context / service["build"]["dockerfile"]).resolve() == DEPLOY / "Dockerfile"
            assert (context / "pyproject.toml").exists(), name
    proxy = compose()["services"]["proxy"]
    config = {path: host for path, host in mounts(proxy).items() if host.startswith("./")}
    assert [(DEPLOY / host).resolve() for host in config.values()] == [DEPLOY / "haproxy.cfg"]
    for name in gateway_services():
        assert proxy["depends_on"][name]["condition"] == "service_healthy"


# --- haproxy.cfg ------------------------------------------------------------------------


def haproxy() -> dict[str, list[str]]:
    """Section header -> its lines, comments dropped."""
    sections: dict[str, list[str]] = {}
    current: list[str] = []
    for raw in (DEPLOY / "haproxy.cfg").read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if not raw[0].isspace():
            current = sections[line] = []
        else:
            current.append(line)
    return sections


def seconds(duration: str) -> float:
    """An HAProxy or Compose duration (``1h``, ``60s``, ``15s``, ``500ms``)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(us|ms|s|m|h|d)?", duration.strip())
    assert match, duration
    unit = {"us": 1e-6, "ms": 1e-3, "s": 1, "m": 60, "h": 3600, "d": 86400}
    return float(match.group(1)) * unit[match.group(2) or "ms"]


def setting(lines: list[str], prefix: str) -> str:
    found = [line[len(prefix):].strip() for line in lines if line.startswith(prefix + " ")]
    assert len(found) == 1, f"one `{prefix}`"
    return found[0]


def test_haproxy_sends_to_the_gateways_it_checks_on_readyz(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    backend = haproxy()["backend gateways"]
    assert "option httpchk" in backend
    check = setting(backend, "http-check send").split()
    assert check[:2] == ["meth", "GET"] and check[2] == "uri"
    assert route(check[3]).endpoint is api.readyz
    assert setting(backend, "http-check expect") == "status 200"
    assert "check" in setting(backend, "default-server").split()
    run_secret_service(tmp_path)
    servers = dict(line.split()[1:3] for line in backend if line.startswith("server "))
    expected = {name: f"{name}:{compose_served(name, tmp_path, monkeypatch).port}"
                for name in gateway_services()}
    assert servers == expected


def test_haproxy_keeps_websockets_and_sse_open_and_unbuffered(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sections = haproxy()
    defaults, backend = sections["defaults"], sections["backend gateways"]
    run_secret_service(tmp_path)
    heartbeat = compose_served("gateway-a", tmp_path, monkeypatch).settings.heartbeat
    # Idle limits: a WebSocket (tunnel) and an SSE stream see a ping every heartbeat.
    assert seconds(setting(defaults, "timeout tunnel")) >= 60 * heartbeat
    assert seconds(setting(defaults, "timeout client")) >= 60 * heartbeat
    sse_rule = setting(backend, "http-request set-timeout server")
    timeout, condition = sse_rule.split(None, 1)
    assert seconds(timeout) >= 60 * heartbeat
    assert condition == f"if {{ path_end {sse_suffix()} }}"
    every_line = [line for lines in sections.values() for line in lines]
    assert not [line for line in every_line if line.startswith("compression")]
    assert not [line for line in every_line if re.search(r"header Connection|http-server-close"
                                                         r"|httpclose|http-buffer-request", line)]


def test_haproxy_accepts_the_config() -> None:
    done = subprocess.run(["haproxy", "-c", "-f", str(DEPLOY / "haproxy.cfg")],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stdout + done.stderr


@contextlib.contextmanager
def running_haproxy(folder: Path, gateways: dict[str, int]) -> Iterator[str]:
    """deploy/haproxy.cfg in a real HAProxy, its addresses pointed at local processes:
    ``gateways`` maps compose service names to local ports. Yields the proxy's base URL."""
    text = (DEPLOY / "haproxy.cfg").read_text()
    for name, port in gateways.items():
        text, count = re.subn(rf"\b{name}:\d+", f"127.0.0.1:{port}", text)
        assert count == 1, name
    proxy = free_port()
    text, count = re.subn(r"bind :8080\b", f"bind 127.0.0.1:{proxy}", text)
    assert count == 1
    text = re.sub(r"bind :8404\b", f"bind 127.0.0.1:{free_port()}", text)
    config = folder / "haproxy.cfg"
    config.write_text(text)
    with open(folder / "haproxy.log", "wb") as log:
        # -n: fewer connections than the container's (this shell's nofile may be lower).
        process = subprocess.Popen(["haproxy", "-db", "-n", "1000", "-f", str(config)],
                                   stdout=log, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{proxy}"
        deadline = time.monotonic() + 20
        while True:  # HAProxy is up and has found a ready gateway behind it
            assert process.poll() is None, (folder / "haproxy.log").read_text()
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(base + "/readyz", timeout=1).status_code == 200:
                    break
            assert time.monotonic() < deadline, "HAProxy did not pass /readyz through"
            time.sleep(0.05)
        yield base
    finally:
        process.terminate()
        process.wait(timeout=10)


@pytest.mark.anyio
async def test_a_gateway_restarted_behind_haproxy_moves_its_clients_resumed(
        start_gateway: Any, user: str, chat_id: str, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    """compose.yaml's draining demo, with the processes run here: SIGTERM one of two gateways
    behind deploy/haproxy.cfg; its clients get 1012, come back through the proxy to the other
    one and resume, missing nothing."""
    caplog.set_level(logging.INFO, logger="gateway.client")  # the SDK logs each drop
    a, b = start_gateway(), start_gateway()
    with running_haproxy(tmp_path, {"gateway-a": a.port, "gateway-b": b.port}) as base:
        url = base.replace("http", "ws", 1)
        clients = [GatewayClient(url, token_factory=lambda: a.token(user), backoff_base=0.05,
                                 backoff_max=0.5) for _ in range(4)]
        received: list[list[int]] = [[] for _ in clients]
        total = 30

        async def read(n: int, client: GatewayClient) -> None:
            async for item in client.events(chat_id):
                assert isinstance(item, Event), item  # a Recovery would mean a gap
                received[n].append(item.seq or 0)
                if len(received[n]) == total:
                    return

        readers: list[asyncio.Task[None]] = []
        try:
            async with asyncio.timeout(20):  # the SDK retries for ever: bound it
                for client in clients:  # one after another: leastconn puts two on each
                    await client.connect()
                    await client.subscribe(chat_id)
            readers = [asyncio.create_task(read(n, c)) for n, c in enumerate(clients)]
            for n in range(10):
                await publish(b, chat_id, {"type": "note", "data": {"n": n}})
            stopping = asyncio.create_task(asyncio.to_thread(a.stop, signal.SIGTERM))
            for n in range(10, total):  # while gateway-a drains, and after
                await publish(b, chat_id, {"type": "note", "data": {"n": n}})
            await stopping
            async with asyncio.timeout(20):
                await asyncio.gather(*readers)
        finally:
            for task in readers:
                task.cancel()
            for client in clients:
                await client.close()
    assert a.proc.returncode == 0
    assert received == [list(range(1, total + 1))] * len(clients)  # in order, no gap, no dup
    # leastconn put two clients on each gateway: gateway-a's two were closed with 1012 and
    # reconnected once; gateway-b's two never noticed.
    assert sorted(c.connections for c in clients) == [1, 1, 2, 2]
    drops = [r.getMessage() for r in caplog.records if r.name == "gateway.client"
             and r.getMessage().startswith("disconnected")]
    assert len(drops) >= 2 and sum(d.startswith("disconnected (1012 ") for d in drops) == 2


# --- Kubernetes -------------------------------------------------------------------------


def manifests(folder: Path = K8S) -> dict[tuple[str, str], dict[str, Any]]:
    """(kind, name) -> object, from ``folder``'s own files: what `kubectl apply -f` takes."""
    found: dict[tuple[str, str], dict[str, Any]] = {}
    for path in sorted(folder.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            key = (doc["kind"], doc["metadata"]["name"])
            assert key not in found, key
            found[key] = doc
    return found


BASE = manifests()
PLACEHOLDER = manifests(K8S / "secret-placeholder")
CLUSTER = manifests(K8S / "redis-cluster")
DEPLOYMENT = BASE[("Deployment", "gateway")]
POD = DEPLOYMENT["spec"]["template"]
CONTAINER = POD["spec"]["containers"][0]


def test_kubectl_apply_takes_every_manifest() -> None:
    """Every manifest is in deploy/k8s/ or the two folders the README applies on purpose."""
    folders = {path.parent for path in K8S.rglob("*.yaml")}
    assert folders == {K8S, K8S / "secret-placeholder", K8S / "redis-cluster"}
    assert set(BASE) == {("ConfigMap", "gateway-config"), ("Deployment", "gateway"),
                         ("Service", "gateway"), ("PodDisruptionBudget", "gateway"),
                         ("HorizontalPodAutoscaler", "gateway")}


@pytest.mark.parametrize("version", ["1.27.0", kubernetes_validate.utils.latest_version()])
@pytest.mark.parametrize("path", sorted(K8S.rglob("*.yaml")),
                         ids=lambda p: str(p.relative_to(K8S)))
def test_manifests_match_the_kubernetes_api(path: Path, version: str) -> None:
    """Strict: a misspelled field is an error, not silently ignored as kubectl would."""
    errors = []
    for doc in yaml.safe_load_all(path.read_text()):
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:  # its str() is the whole schema
            where = ".".join(str(part) for part in exc.absolute_path)
            errors.append(f"{doc['kind']} {doc['metadata']['name']}: {where}: {exc.message}")
    assert not errors


def pod_env(*sources: dict[tuple[str, str], dict[str, Any]]) -> dict[str, str]:
    """The container's environment as the kubelet builds it, with ``sources`` applied:
    the image's ENV, then envFrom in order (later keys win), then env."""
    objects = {key: obj for source in (BASE, *sources) for key, obj in source.items()}
    env = image_env()
    for source in CONTAINER["envFrom"]:
        ref = source["configMapRef"]
        config = objects.get(("ConfigMap", ref["name"]))
        if config is None:
            assert ref.get("optional"), f"ConfigMap {ref['name']} is missing"
            continue
        env.update(config["data"])
    for var in CONTAINER["env"]:
        if "value" in var:
            env[var["name"]] = var["value"]
        else:
            ref = var["valueFrom"]["secretKeyRef"]
            env[var["name"]] = objects[("Secret", ref["name"])]["stringData"][ref["key"]]
    return env


def pod_argv() -> list[str]:
    """The image has no ENTRYPOINT: `command` replaces it, `args` replaces CMD."""
    command: list[str] = CONTAINER.get("command") or []
    args: list[str] = CONTAINER.get("args") or []
    return command + args if command else (args or image_cmd())


def pod_served(monkeypatch: pytest.MonkeyPatch, *sources: dict[tuple[str, str], Any]) -> Served:
    return serve(pod_argv(), pod_env(PLACEHOLDER, *sources), monkeypatch)


def named_port(port: int | str) -> int:
    if isinstance(port, int):
        return port
    by_name = {p["name"]: p["containerPort"] for p in CONTAINER["ports"]}
    assert port in by_name, f"no container port named {port}"
    return int(by_name[port])


def test_the_pod_listens_where_its_port_probes_and_service_point(
        monkeypatch: pytest.MonkeyPatch) -> None:
    served = pod_served(monkeypatch)
    publicly_served(served)
    assert served.uvicorn["workers"] == 1
    assert [p["containerPort"] for p in CONTAINER["ports"]] == [served.port]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert named_port(CONTAINER[probe]["httpGet"]["port"]) == served.port, probe
    service = BASE[("Service", "gateway")]
    assert [named_port(p["targetPort"]) for p in service["spec"]["ports"]] == [served.port]


def test_probes_ask_the_routes_that_check_what_they_must() -> None:
    """Readiness is Redis and pub/sub (/readyz); liveness only that the process serves
    (/healthz): a Redis outage takes pods out of the Service, never restarts them."""
    assert route(CONTAINER["readinessProbe"]["httpGet"]["path"]).endpoint is api.readyz
    for probe in ("livenessProbe", "startupProbe"):
        assert route(CONTAINER[probe]["httpGet"]["path"]).endpoint is api.healthz, probe


def test_termination_grace_outlasts_prestop_and_the_drain(
        monkeypatch: pytest.MonkeyPatch) -> None:
    served = pod_served(monkeypatch)
    prestop = CONTAINER["lifecycle"]["preStop"]["exec"]["command"]
    assert prestop[0] == "sleep"
    grace = POD["spec"]["terminationGracePeriodSeconds"]
    assert grace > float(prestop[1]) + served.drain_seconds


def test_the_secret_comes_from_a_secret_and_the_placeholder_is_never_applied() -> None:
    (var,) = [v for v in CONTAINER["env"] if v["name"] == "GATEWAY_SECRET"]
    ref = var["valueFrom"]["secretKeyRef"]
    assert not ref.get("optional"), "no pod may start without the secret"
    placeholder = PLACEHOLDER[("Secret", ref["name"])]["stringData"][ref["key"]]
    assert "PLACEHOLDER" in placeholder
    # `kubectl apply -f deploy/k8s/` must not overwrite a real secret with it...
    assert not [key for key in BASE if key[0] == "Secret"]
    # ...and no ConfigMap carries the secret in the clear.
    for objects in (BASE, CLUSTER):
        for (kind, name), obj in objects.items():
            assert kind != "ConfigMap" or "GATEWAY_SECRET" not in obj["data"], name


def test_the_cluster_example_points_the_same_pods_at_a_cluster(
        monkeypatch: pytest.MonkeyPatch) -> None:
    single = pod_served(monkeypatch)
    clustered = pod_served(monkeypatch, CLUSTER)
    (override,) = CLUSTER.values()
    assert clustered.settings.redis_url == override["data"]["GATEWAY_REDIS_URL"]
    assert clustered.settings.redis_url != single.settings.redis_url
    assert clustered.settings.wait_replicas >= 1
    assert clustered.port == single.port


def test_service_budget_and_autoscaler_select_the_pods() -> None:
    labels = POD["metadata"]["labels"]
    assert DEPLOYMENT["spec"]["selector"]["matchLabels"].items() <= labels.items()
    service, budget = BASE[("Service", "gateway")], BASE[("PodDisruptionBudget", "gateway")]
    assert service["spec"]["selector"].items() <= labels.items()
    assert service["spec"].get("sessionAffinity", "None") == "None"  # clients resume anywhere
    assert budget["spec"]["selector"]["matchLabels"].items() <= labels.items()
    hpa = BASE[("HorizontalPodAutoscaler", "gateway")]
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", DEPLOYMENT["metadata"]["name"])
    assert [m["resource"]["name"] for m in hpa["spec"]["metrics"]] == ["cpu"]
    assert hpa["spec"]["minReplicas"] >= 2  # one drains while another holds its clients
    assert "replicas" not in DEPLOYMENT["spec"], "the HPA owns the count"
    # A CPU utilization target is a share of the request: without one the HPA cannot act.
    requests = CONTAINER["resources"]["requests"]
    assert requests["cpu"] and requests["memory"]


# --- the systemd unit -------------------------------------------------------------------


def test_the_systemd_unit_serves_and_waits_for_the_drain(monkeypatch: pytest.MonkeyPatch) -> None:
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str  # type: ignore[assignment,method-assign]
    unit.read_string((DEPLOY / "gateway.service").read_text())
    service = unit["Service"]
    argv = shlex.split(service["ExecStart"])
    argv[0] = Path(argv[0]).name
    # EnvironmentFile is env.example filled in, then Environment= lines.
    env = dict(line.split("=", 1) for line in (DEPLOY / "env.example").read_text().splitlines()
               if line and not line.startswith("#"))
    env.update(pair.split("=", 1) for pair in shlex.split(service["Environment"]))
    served = serve(argv, env, monkeypatch)
    publicly_served(served)
    assert float(service["TimeoutStopSec"]) > served.drain_seconds
