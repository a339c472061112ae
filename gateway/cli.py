"""``gateway serve | token | publish | tail | agent``."""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import secrets
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from . import discovery, logs
from . import protocol as p
from .auth import Principal, issue_token
from .config import ConfigError, Settings, data_path, load_settings
from .errors import Rejected

if TYPE_CHECKING:
    from .app import GatewayApp
    from .runtime import Companion, Gateway
    from .sdk.agent import AgentWorker

SECRET_FILE = "secret"


def _stored_secret(settings: Settings, create: bool) -> str:
    path = data_path(settings) / SECRET_FILE
    if path.exists():
        return path.read_text().strip()
    if not create:
        raise ConfigError(f"GATEWAY_SECRET is not set and {path} does not exist")
    secret = secrets.token_urlsafe(32)
    path.touch(mode=0o600)
    path.write_text(secret)
    return secret


def _secret(settings: Settings, create: bool = False) -> str:
    return settings.secret or _stored_secret(settings, create)


def _client_settings(data_dir: str | None, **overrides: Any) -> Settings:
    """Settings for the commands that talk to a serving gateway: its data directory (the
    secret, the embedded server's socket) found from any folder (:mod:`.discovery`)."""
    settings = load_settings(data_dir=data_dir, **overrides)
    if data_dir is None and "GATEWAY_DATA_DIR" not in os.environ:
        found, _ = discovery.find_data_dir(settings.data_dir)
        settings = msgspec.structs.replace(settings, data_dir=str(found))
    return settings


def _redis_url(settings: Settings) -> str:
    if settings.redis_url:
        return settings.redis_url
    sock = data_path(settings) / discovery.SOCKET
    if sock.exists():
        return f"unix://{sock}"
    raise ConfigError(
        f"GATEWAY_REDIS_URL is not set and no embedded server is running in "
        f"{data_path(settings)} (nor in a .gateway folder above it, nor where the last "
        f"`gateway serve` ran). Start one (`scripts/serve`, or `gateway serve`), or point "
        f"at yours: --data-dir /path/to/.gateway, or GATEWAY_REDIS_URL=redis://host:6379/0 "
        f"(`gateway serve` prints its embedded server's unix:// URL when it starts)")


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(0)


def _loop() -> str:
    """uvloop where it exists (not on Windows): the fan-out and the publish path lean on it."""
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return "asyncio"
    return "uvloop"


def _http() -> Any:
    """uvicorn's httptools protocol with the gateway's WebSocket upgrade; without httptools,
    h11 and the plain ASGI path (slower)."""
    try:
        import httptools  # noqa: F401
    except ImportError:
        return "h11"
    from .transport.uvicorn_ws import GatewayHttpProtocol

    return GatewayHttpProtocol


def create_app() -> GatewayApp:
    """uvicorn's factory for ``gateway serve``: the app, with the in-process demo agent when
    ``GATEWAY_DEMO_AGENT`` asks for it (the embedded default and dev mode do)."""
    from .app import create_app as make_app

    app = make_app()
    gateway: Gateway = app.state.gateway
    if gateway.settings.demo_agent:
        gateway.companions.append(_demo_agent)
    return app


def _demo_agent(gateway: Gateway) -> Companion:
    from .metrics import COUNTS
    from .sdk.agent import AgentWorker, stable_consumer
    from .sdk.demo_agent import handle

    # A stable name: restarted, this process resumes the turns it was running.
    worker = AgentWorker(gateway.backend.client, gateway.settings, handle, name="default",
                         consumer=stable_consumer(gateway.settings.port))
    COUNTS.agents.append(worker.stats)  # its reclaims, in /metrics
    return _Stopping(worker, grace=3)


class _Stopping:
    """A worker as a companion: stopped with a short grace (the gateway is going down)."""

    def __init__(self, worker: AgentWorker, grace: float) -> None:
        self.worker, self.grace = worker, grace

    async def start(self) -> None:
        await self.worker.start()

    async def stop(self) -> None:
        await self.worker.stop(grace=self.grace)


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from . import scrape
    from .embedded import EmbeddedRedis
    from .transport.uvicorn_ws import check_compatible

    settings = load_settings(redis_url=args.redis_url, data_dir=args.data_dir, host=args.host,
                             port=args.port, dev=args.dev or None)
    embedded = None
    if not settings.redis_url:
        embedded = EmbeddedRedis(data_path(settings))
        os.environ["GATEWAY_REDIS_URL"] = embedded.start()
        embedded.supervise()
        print(f"embedded server: {embedded.url} (data in {embedded.data_dir})", flush=True)
    if embedded is not None or settings.dev:
        # A complete product out of the box: the demo agent answers unless told not to.
        os.environ.setdefault("GATEWAY_DEMO_AGENT", "1")
    # The embedded default and dev mode keep a generated secret in the data dir.
    os.environ["GATEWAY_SECRET"] = _secret(settings, create=embedded is not None or settings.dev)
    for name in ("host", "port", "data_dir"):
        os.environ[f"GATEWAY_{name.upper()}"] = str(getattr(settings, name))
    if embedded is not None or settings.dev:
        demo = load_settings().demo_agent
        discovery.leave_note(data_path(settings), demo)
        if demo:
            print("the demo agent answers; for your own: GATEWAY_DEMO_AGENT=0, then "
                  "`gateway agent MODULE:HANDLER` from any folder", flush=True)
    if settings.dev:
        os.environ["GATEWAY_DEV"] = "1"
        token = issue_token(os.environ["GATEWAY_SECRET"], "dev", ttl=7 * 86400)
        url = f"ws://{settings.host}:{settings.port}/v1/ws?token={token}"
        print(f"dev token (user 'dev', 7 days): {token}\nconnect: {url}\n"
              f"open: http://{settings.host}:{settings.port}/?token={token}", flush=True)
    # uvicorn shuts down gracefully on SIGTERM, then re-raises the signal with the handler it
    # found installed: with the default one the process would die right there, skipping the
    # ``finally`` below that stops (and waits for) the embedded server. Exit cleanly instead.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    check_compatible()  # fail at start, not on the first connection, after a uvicorn upgrade
    # Workers are processes of their own: their metrics meet in files (scrape.py).
    made_dir = None
    if args.workers > 1 or scrape.multiprocess_dir():
        made_dir = scrape.prepare_multiprocess_dir()
    metrics_dir = scrape.multiprocess_dir()
    metrics_port = None
    if metrics_dir is not None and settings.metrics_port:
        metrics_port = scrape.MetricsPort(settings.host, settings.metrics_port,
                                          scrape.multiprocess_registry(metrics_dir))
    try:
        uvicorn.run(
            "gateway.cli:create_app", factory=True, host=settings.host, port=settings.port,
            workers=args.workers, loop=_loop(), http=_http(),
            ws="websockets-sansio", ws_max_size=settings.max_frame_bytes,
            ws_ping_interval=settings.heartbeat, ws_ping_timeout=settings.heartbeat,
            ws_per_message_deflate=False, log_level=args.log_level, lifespan="on",
            log_config=logs.uvicorn_config(settings.log_format, args.log_level),
            timeout_graceful_shutdown=5,
            access_log=False,  # query strings carry tokens (browsers cannot set headers)
            # The gateway reads neither the client's address nor the scheme: uvicorn's
            # X-Forwarded-* middleware would only wrap every request for nothing.
            proxy_headers=False,
        )
    finally:
        if metrics_port is not None:
            metrics_port.close()
        scrape.remove_multiprocess_dir(made_dir)
        discovery.remove_note()
        if embedded is not None:
            embedded.stop()
    return 0


def cmd_token(args: argparse.Namespace) -> int:
    settings = _client_settings(args.data_dir)
    print(issue_token(_secret(settings), args.sub, args.role, args.ttl))
    return 0


def cmd_publish(args: argparse.Namespace) -> int:
    from .events import PublishEvent

    try:
        data = msgspec.json.decode(args.json)
        event = msgspec.convert({"type": args.type, "data": data, "durable": not args.ephemeral},
                                PublishEvent)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        print(f"invalid event: {exc}", file=sys.stderr)
        return 2
    settings = _client_settings(args.data_dir)

    async def run() -> Any:
        from .conversations import Conversations
        from .redis.backend import Backend
        from .redis.store import Store

        backend = await Backend.connect(msgspec.structs.replace(
            settings, redis_url=_redis_url(settings)))
        try:
            ops = Conversations(Store(backend, settings), settings)
            return await ops.publish(Principal("cli", "service"), args.chat, [event])
        finally:
            await backend.aclose()

    try:
        result = asyncio.run(run())
    except Rejected as exc:  # nothing was stored
        print(f"gateway publish: {exc.code}: {exc.message}", file=sys.stderr)
        return 1
    print(msgspec.json.encode({"epoch": result.epoch, "seqs": result.seqs}).decode())
    return 0


def cmd_tail(args: argparse.Namespace) -> int:
    import dataclasses
    import logging

    from .sdk.client import GatewayClient, GatewayError, StreamReset

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="gateway tail: %(message)s")
    settings = _client_settings(args.data_dir)
    secret = _secret(settings)
    base = (args.url or f"ws://{settings.host}:{settings.port}").rstrip("/")
    base = base.removesuffix("/v1/ws")

    def token() -> str:
        return issue_token(secret, "tail", "service", ttl=3600)

    def emit(frame: Any) -> None:
        print(msgspec.json.encode(frame).decode(), flush=True)

    async def run() -> None:
        # A fresh token for every (re)connect; the SDK resumes with since after a drop.
        async with GatewayClient(base, token_factory=token) as client:
            seq = epoch = None
            if args.since is not None:
                seq = args.since
                epoch = args.epoch or await asyncio.to_thread(_epoch_of, base, args.chat,
                                                              token())
            emit((await client.subscribe(args.chat, seq=seq, epoch=epoch)).frame)
            async for item in client.events(args.chat):
                # Events as received; a broken resume (a Recovery item) as the subscribed
                # frame that said recovered: false; an open stream's text after a resume as
                # {"type": "stream", "chat_id", "stream": {id, type, turn_id, text, pos}}.
                if isinstance(item, StreamReset):
                    emit({"type": "stream", "chat_id": item.chat_id,
                          "stream": dataclasses.asdict(item.stream)})
                else:
                    emit(item.frame)

    try:
        asyncio.run(run())
    except KeyboardInterrupt:
        pass
    except (GatewayError, OSError) as exc:  # OSError: the --since epoch lookup over HTTP
        print(f"gateway tail: {exc}", file=sys.stderr)
        return 1
    return 0


def _driven(args: argparse.Namespace) -> tuple[Any, str]:
    """The handler ``gateway agent`` runs, and its kind: a Python handler, or an agent the
    gateway drives (``--openai``, ``--ag-ui``). Raises ValueError for a bad option."""
    if sum(x is not None for x in (args.handler, args.openai, args.ag_ui)) != 1:
        raise ValueError("give one of MODULE:HANDLER, --openai BASE_URL or --ag-ui URL")
    if args.openai is not None:
        if not args.model:
            raise ValueError("--openai needs --model")
        from .sdk.drivers.openai import OpenAIAgent

        params = {}
        for item in args.param:
            key, sep, raw = item.partition("=")
            if not sep or not key:
                raise ValueError(f"--param takes KEY=VALUE, not {item!r}")
            try:
                params[key] = msgspec.json.decode(raw)  # numbers stay numbers
            except msgspec.DecodeError:
                params[key] = raw
        api_key = None
        if args.api_key_env:
            api_key = os.environ.get(args.api_key_env)
            if not api_key:
                raise ValueError(f"--api-key-env: {args.api_key_env} is not set")
        return OpenAIAgent(args.openai, args.model, api_key=api_key, system=args.system,
                           temperature=args.temperature, params=params,
                           request_timeout=args.timeout), "openai"
    if args.ag_ui is not None:
        from .sdk.drivers.ag_ui import AgUiAgent

        headers = {}
        for item in args.header:
            key, sep, value = item.partition(":")
            if not sep or not key.strip():
                raise ValueError(f"--header takes 'NAME: VALUE', not {item.split(':')[0]!r}")
            headers[key.strip()] = os.path.expandvars(value.strip())  # $VAR from the env
        return AgUiAgent(args.ag_ui, headers=headers, request_timeout=args.timeout), "ag-ui"
    from .sdk.agent import load_handler

    # As `uvicorn module:app` does: a module in the current folder is found.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return load_handler(args.handler), "handler"
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot load {args.handler}: {exc}") from None


def cmd_agent(args: argparse.Namespace) -> int:
    from .sdk.agent import serve

    settings = _client_settings(args.data_dir, redis_url=args.redis_url)
    logs.configure(settings.log_format, args.log_level)
    try:
        handler, kind = _driven(args)
    except ImportError as exc:  # the agents extra is missing
        print(f"gateway agent: {exc}; install it: pip install 'gateway[agents]'",
              file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"gateway agent: {exc}", file=sys.stderr)
        return 2
    if args.name is not None and not re.match(p.AGENT_NAME_PATTERN, args.name):
        print(f"gateway agent: --name must match {p.AGENT_NAME_PATTERN}", file=sys.stderr)
        return 2
    note = discovery.read_note()
    if ((args.name or settings.default_agent) == "default"
            and not settings.redis_url and note is not None and note.demo_agent
            and Path(note.data_dir) == data_path(settings)):
        print("gateway agent: the gateway serving from "
              f"{note.data_dir} runs the demo agent too, and the two share its turns; "
              "restart it with GATEWAY_DEMO_AGENT=0 to have this agent answer them all",
              file=sys.stderr, flush=True)
    return asyncio.run(serve(
        handler, _redis_url(settings), settings, name=args.name, kind=kind, group=args.group,
        consumer=args.consumer,
        concurrency=args.concurrency, claim_idle=args.claim_idle, start_id=args.start_id))


def _epoch_of(ws_base: str, chat_id: str, token: str) -> str:
    """The conversation's current epoch, so ``--since`` needs only a seq."""
    import urllib.request

    url = ws_base.replace("ws", "http", 1) + f"/v1/conversations/{chat_id}"
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        epoch: str = msgspec.json.decode(resp.read())["epoch"]
    return epoch


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gateway", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the gateway (embedded Redis unless one is set)")
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    serve.add_argument("--workers", type=int, default=1)
    serve.add_argument("--redis-url", help="overrides GATEWAY_REDIS_URL")
    serve.add_argument("--data-dir", help="overrides GATEWAY_DATA_DIR")
    serve.add_argument("--dev", action="store_true", help="print a token; serve the demo page")
    serve.add_argument("--log-level", default="info", choices=logs.LEVELS)
    serve.set_defaults(func=cmd_serve)

    token = sub.add_parser("token", help="print a signed token")
    token.add_argument("--sub", required=True)
    token.add_argument("--role", choices=["user", "service"], default="user")
    token.add_argument("--ttl", type=float, default=3600.0, help="seconds")
    token.add_argument("--data-dir")
    token.set_defaults(func=cmd_token)

    publish = sub.add_parser("publish", help="publish one event as a service")
    publish.add_argument("chat")
    publish.add_argument("type")
    publish.add_argument("json", nargs="?", default="{}")
    publish.add_argument("--ephemeral", action="store_true")
    publish.add_argument("--data-dir")
    publish.set_defaults(func=cmd_publish)

    tail = sub.add_parser("tail", help="print a conversation's frames as they arrive")
    tail.add_argument("chat")
    tail.add_argument("--since", type=int, help="replay durable events after this seq")
    tail.add_argument("--epoch", help="the epoch --since belongs to")
    tail.add_argument("--url", help="ws://host:port of the gateway")
    tail.add_argument("--data-dir")
    tail.set_defaults(func=cmd_tail)

    agent = sub.add_parser("agent", help="run an agent worker: MODULE:HANDLER per turn, or "
                           "drive an OpenAI-compatible or AG-UI agent")
    agent.add_argument("handler", nargs="?",
                       help="async handler, e.g. gateway.sdk.demo_agent:handle")
    driven = agent.add_argument_group("an agent the gateway drives (the agents extra)")
    driven.add_argument("--openai", metavar="BASE_URL",
                        help="an OpenAI-compatible server, e.g. http://127.0.0.1:8000/v1")
    driven.add_argument("--model", help="--openai: the model to ask")
    driven.add_argument("--api-key-env", metavar="VAR",
                        help="--openai: the environment variable that holds the API key")
    driven.add_argument("--system", help="--openai: a system message before the conversation")
    driven.add_argument("--temperature", type=float, help="--openai: sampling temperature")
    driven.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                        help="--openai: another request parameter (VALUE as JSON when it "
                             "parses); repeatable")
    driven.add_argument("--ag-ui", metavar="URL", help="an AG-UI agent's endpoint")
    driven.add_argument("--header", action="append", default=[], metavar="'NAME: VALUE'",
                        help="--ag-ui: a request header ($VAR in VALUE is read from the "
                             "environment; never logged); repeatable")
    driven.add_argument("--timeout", type=float, default=30.0,
                        help="seconds to connect and get the agent's answer started")
    agent.add_argument("--name", help="the agent it answers for (default: "
                       "GATEWAY_DEFAULT_AGENT, itself `default`)")
    agent.add_argument("--group", default="agents", help="consumer group (default: agents)")
    agent.add_argument("--consumer", help="consumer name (default: host-pid-random)")
    agent.add_argument("--concurrency", type=int, default=16, help="turns run at once")
    agent.add_argument("--claim-idle", type=float, default=30.0,
                       help="seconds before another worker's stalled entry is taken over")
    agent.add_argument("--start-id", default="0",
                       help="where a new group starts: 0 (all of the inbox) or $ (new only)")
    agent.add_argument("--redis-url", help="overrides GATEWAY_REDIS_URL")
    agent.add_argument("--data-dir", help="overrides GATEWAY_DATA_DIR")
    agent.add_argument("--log-level", default="info", choices=logs.LEVELS)
    agent.set_defaults(func=cmd_agent)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code: int = args.func(args)
    except ConfigError as exc:
        print(f"gateway: {exc}", file=sys.stderr)
        return 2
    return code


if __name__ == "__main__":
    sys.exit(main())

