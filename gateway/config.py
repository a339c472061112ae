"""Settings, read once from ``GATEWAY_*`` environment variables and validated at start."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

import msgspec

from .protocol import AGENT_NAME_PATTERN


class ConfigError(ValueError):
    """A ``GATEWAY_*`` variable has a value the gateway cannot use."""


class Settings(msgspec.Struct, frozen=True, kw_only=True):
    """Every tunable of the gateway. Field ``x`` is read from ``GATEWAY_X``."""

    redis_url: str = ""  # empty: the embedded default starts a private server
    secret: str = ""  # HS256 key; dev mode generates one in the data dir
    allowed_origins: tuple[str, ...] = ("*",)
    host: str = "127.0.0.1"
    port: int = 8000
    metrics_port: int = 0  # serve /metrics on this port only (0: on the main port)
    data_dir: str = ".gateway"
    dev: bool = False  # dev mode: prints a token, serves the demo page
    demo_agent: bool = False  # run the demo agent inside the gateway (embedded default, dev)
    default_agent: str = "default"  # the agent that answers a conversation that names none
    # Seconds before a connection's token expires that it is told (token_expiring), so it
    # can refresh in band.
    token_refresh_before: float = 60.0
    # A webhook for people who are away (gateway/webhook.py): where, and the signing key.
    webhook_url: str = ""
    webhook_secret: str = ""
    webhook_timeout: float = 10.0  # seconds a receiver has to answer one delivery
    auto_create: bool = True  # subscribe/message to an unknown chat creates it
    # Seconds any Redis call may take (connect, or one reply) before it fails: a frozen
    # server fails requests and /readyz in bounded time instead of hanging them.
    redis_timeout: float = 3.0
    # Replicas a durable write must reach before it is acknowledged (WAIT), and how long to
    # wait for them; past it the caller gets `replication_timeout` (safe to retry with the
    # same idempotency key).
    wait_replicas: int = 0
    wait_timeout_ms: int = 1000

    turn_timeout: float = 300.0  # seconds before the gateway ends a silent turn
    # Seconds a conversation may go untouched (nothing stored, no turn running) before it
    # is deleted (gateway/retention.py); 0: kept forever.
    conversation_ttl: float = 0.0
    history_maxlen: int = 10_000  # stream entries kept per conversation (approximate trim)
    replay_limit: int = 1000  # most events one subscribe may replay
    buffer_max_frames: int = 1000
    buffer_max_bytes: int = 1 << 20
    buffer_ttl: float = 900.0
    queue_max_bytes: int = 1 << 20  # outbound bytes per connection before 4008
    idempotency_ttl: int = 86_400  # seconds a message/publish dedupe result is kept
    list_scan: int = 1000  # list entries one conversation-list request reads, at most

    max_frame_bytes: int = 64 * 1024
    max_text_bytes: int = 32 * 1024
    max_subscriptions: int = 256
    max_connections_per_user: int = 32
    rate_limit: float = 50.0  # inbound frames per second, sustained
    rate_burst: int = 100
    max_bad_frames: int = 20  # invalid frames in a row before 4004
    heartbeat: float = 25.0  # WebSocket ping interval, seconds
    # Presence (gateway/presence.py): seconds an entry lives unless renewed (renewed every
    # third of it), and the shortest gap between two presence frames one process sends
    # for one conversation. A killed gateway's users drop out within 4/3 TTL + the window.
    presence_ttl: float = 15.0
    presence_window: float = 0.5
    typing_interval: float = 2.0  # a connection's `typing` frames per chat: one per this
    inbox_partitions: int = 8  # agent inbox streams; a chat always maps to the same one
    inbox_maxlen: int = 100_000  # entries kept per inbox partition (approximate trim)
    # Ephemeral types that, published while a turn runs, form a resumable stream; each is
    # `delta` (committed by `message`) or `X_delta` (committed by `X`).
    stream_types: tuple[str, ...] = ("delta", "reasoning_delta")
    stream_max_bytes: int = 1 << 20  # text one stream may hold (stream_too_large past it)
    delta_window_ms: float = 25.0  # agent workers coalesce streamed pieces over this window
    log_format: Literal["text", "json"] = "text"  # json: one object per line (gateway.logs)


_ENV_PREFIX = "GATEWAY_"


def _parse(name: str, raw: str, kind: object) -> object:
    try:
        if kind is bool:
            lowered = raw.strip().lower()
            if lowered in {"1", "true", "yes", "on"}:
                return True
            if lowered in {"0", "false", "no", "off", ""}:
                return False
            raise ValueError(raw)
        if kind is int:
            return int(raw)
        if kind is float:
            return float(raw)
        if name in ("allowed_origins", "stream_types"):
            return tuple(o.strip() for o in raw.split(",") if o.strip())
        return raw
    except ValueError:
        raise ConfigError(f"{_ENV_PREFIX}{name.upper()}={raw!r} is not a valid {kind}") from None


def load_settings(env: Mapping[str, str] | None = None, **overrides: object) -> Settings:
    """Build :class:`Settings` from the environment, then apply ``overrides``."""
    env = os.environ if env is None else env
    values: dict[str, object] = {}
    for field in msgspec.structs.fields(Settings):
        raw = env.get(_ENV_PREFIX + field.name.upper())
        if raw is not None:
            values[field.name] = _parse(field.name, raw, field.type)
    values.update({k: v for k, v in overrides.items() if v is not None})
    try:
        settings = msgspec.convert(values, Settings)
    except msgspec.ValidationError as exc:
        raise ConfigError(str(exc)) from None
    for name in ("replay_limit", "buffer_max_frames", "buffer_max_bytes", "queue_max_bytes",
                 "max_frame_bytes", "max_subscriptions", "max_connections_per_user",
                 "inbox_partitions", "stream_max_bytes", "redis_timeout", "wait_timeout_ms",
                 "list_scan", "presence_ttl"):
        if not getattr(settings, name) > 0:  # NaN too
            raise ConfigError(f"{_ENV_PREFIX}{name.upper()} must be positive")
    if not 0 <= settings.metrics_port <= 65535 or settings.metrics_port == settings.port:
        raise ConfigError(f"{_ENV_PREFIX}METRICS_PORT must be a port other than "
                          f"{_ENV_PREFIX}PORT, or 0")
    if not 0 <= settings.conversation_ttl < 10**12:  # NaN and inf too
        raise ConfigError(f"{_ENV_PREFIX}CONVERSATION_TTL must be 0 (off) or seconds")
    if not (0 <= settings.presence_window < settings.presence_ttl
            and 0 <= settings.typing_interval < 3600):
        raise ConfigError(f"{_ENV_PREFIX}PRESENCE_WINDOW must be under {_ENV_PREFIX}PRESENCE_TTL, "
                          f"and {_ENV_PREFIX}TYPING_INTERVAL seconds")
    if settings.wait_replicas < 0:
        raise ConfigError(f"{_ENV_PREFIX}WAIT_REPLICAS must not be negative")
    if settings.webhook_url and len(settings.webhook_secret) < 16:
        raise ConfigError(f"{_ENV_PREFIX}WEBHOOK_URL needs {_ENV_PREFIX}WEBHOOK_SECRET, "
                          "16 characters or more: receivers check each delivery's signature")
    if not settings.webhook_timeout > 0:
        raise ConfigError(f"{_ENV_PREFIX}WEBHOOK_TIMEOUT must be positive")
    if not re.match(AGENT_NAME_PATTERN, settings.default_agent):
        raise ConfigError(f"{_ENV_PREFIX}DEFAULT_AGENT must match {AGENT_NAME_PATTERN}")
    for kind in settings.stream_types:
        if not re.match(r"^(delta|[a-z][a-z0-9_.]{0,57}_delta)$", kind):
            raise ConfigError(f"{_ENV_PREFIX}STREAM_TYPES: {kind!r} is not `delta` or `X_delta`")
    return settings


def data_path(settings: Settings) -> Path:
    path = Path(settings.data_dir).absolute()
    path.mkdir(parents=True, exist_ok=True)
    return path
