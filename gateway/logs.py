"""Log output: uvicorn's text or one JSON object per line, who each line is about, no secrets.

``GATEWAY_LOG_FORMAT=json`` gives ``{"ts", "level", "logger", "message"}`` per line, plus
``connection_id``, ``user_id`` and ``chat_id`` where they apply and ``exc`` for a traceback.
The ids come from :func:`bind`, called where a session starts, where a request names its
user and where a frame names a chat; ``extra={"chat_id": ...}`` on a log call works too.

A binding belongs to the task that made it. Tasks a session merely causes to exist (a pub/sub
reader started by its first subscribe, a pipeline flush) inherit its context, but their lines
are not about that session, so they carry none of its ids.

:class:`RedactSecrets` keeps tokens (``token=`` values, bearer credentials) and WebSocket
frame payloads (message text, at debug level) out of every line, whatever the format.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import logging.config
import re
import time
import weakref
from collections.abc import Callable
from contextvars import ContextVar, Token
from typing import Any, Literal

import msgspec

LogFormat = Literal["text", "json"]
TRACE = 5  # uvicorn's trace level
LEVELS = ("trace", "debug", "info", "warning", "error", "critical")
FIELDS = ("connection_id", "user_id", "chat_id")


# --- who a line is about -------------------------------------------------------------------


# The binding task, then connection_id, user_id and chat_id: a plain tuple, as a session
# binds a chat for every frame it handles. The task is held weakly: the binding lives in
# the task's own context, and a strong reference would make every bound task (each HTTP
# request's) a reference cycle that only the cyclic collector frees.
_TaskRef = Callable[[], "asyncio.Task[Any] | None"]
_Scope = tuple[_TaskRef, str | None, str | None, str | None]
_scope: ContextVar[_Scope | None] = ContextVar("gateway_log_scope", default=None)


def _no_task() -> None:
    return None


def _ref(task: asyncio.Task[Any] | None) -> _TaskRef:
    return _no_task if task is None else weakref.ref(task)


def _is(ref: _TaskRef, task: asyncio.Task[Any] | None) -> bool:
    """Whether the binding's task is ``task`` (a task gone is no task, not None)."""
    bound = ref()
    return bound is task and (bound is not None or ref is _no_task)


def _current_task() -> asyncio.Task[Any] | None:
    try:
        return asyncio.current_task()
    except RuntimeError:  # no running loop (a thread, or before the loop starts)
        return None


def bind(*, connection_id: str | None = None, user_id: str | None = None,
         chat_id: str | None = None, task: asyncio.Task[Any] | None = None
         ) -> Token[_Scope | None]:
    """Tag the current task's log lines with these ids (those given; the others are kept).
    ``unbind`` the returned token to go back. A hot caller that knows its task already
    passes it (looking it up costs a system call on Python 3.11)."""
    task = task or _current_task()
    base = _scope.get()
    if base is not None and _is(base[0], task):
        connection_id = connection_id or base[1]
        user_id = user_id or base[2]
        chat_id = chat_id or base[3]
    return _scope.set((_ref(task), connection_id, user_id, chat_id))


def about_chat(chat_id: str | None) -> Token[_Scope | None]:
    """:func:`bind` ``chat_id`` alone, for the handling of one frame: no task lookup (the
    binding keeps its task, so one this task merely inherited stays unused)."""
    base = _scope.get()
    if base is None:
        return _scope.set((_ref(_current_task()), None, None, chat_id))
    return _scope.set((base[0], base[1], base[2], chat_id or base[3]))


def unbind(token: Token[_Scope | None]) -> None:
    _scope.reset(token)


def ids(record: logging.LogRecord) -> dict[str, str]:
    """The ids a record is about: its ``extra`` fields, else the task's binding."""
    scope = _scope.get()
    bound = scope[1:] if scope is not None and _is(scope[0], _current_task()) else (None,) * 3
    found: dict[str, str] = {}
    for name, value in zip(FIELDS, bound, strict=True):
        value = record.__dict__.get(name) or value
        if value is not None:
            found[name] = str(value)
    return found


# --- no secrets ----------------------------------------------------------------------------


_SECRET_RE = re.compile(r"((?:token|ticket)=)[^&\s\"']*|(bearer\s+)[^\s\"',)]+",
                        re.IGNORECASE)
# websockets logs every frame it parses or sends at debug level, payload included.
_FRAME_DUMPS = ("< %s", "> %s")


def redact(text: str) -> str:
    """``text`` with every ``token=`` and ``ticket=`` value and bearer credential replaced."""
    return _SECRET_RE.sub(lambda m: (m.group(1) or m.group(2)) + "[redacted]", text)


def _has_secret(text: str) -> bool:
    lowered = text.lower()
    return "token=" in lowered or "ticket=" in lowered or "bearer" in lowered


class RedactSecrets(logging.Filter):
    """Rewrite a record so it holds no token and no frame payload; never drops one."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if record.msg in _FRAME_DUMPS and isinstance(args, tuple) and len(args) == 1:
            frame = args[0]
            opcode, data = getattr(frame, "opcode", None), getattr(frame, "data", None)
            if opcode is not None and isinstance(data, bytes | bytearray | memoryview):
                name = getattr(opcode, "name", opcode)
                record.msg = f"{record.msg[0]} {name} [{len(data)} bytes]"
                record.args = None
                return True
        message = record.getMessage()
        if _has_secret(message):
            record.msg, record.args = redact(message), None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text and _has_secret(record.exc_text):
            record.exc_text = redact(record.exc_text)
        return True


# --- formats -------------------------------------------------------------------------------


class JsonFormatter(logging.Formatter):
    """One JSON object per line; a traceback is the ``exc`` field, not more lines."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, str] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage().rstrip(),
        }
        entry.update(ids(record))
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            entry["exc"] = record.exc_text
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return msgspec.json.encode(entry).decode()


def level_number(name: str) -> int:
    """``trace``, ``debug``, ... as a number; uvicorn's trace included."""
    return TRACE if name.lower() == "trace" else logging.getLevelNamesMapping()[name.upper()]


_JSON_FORMATTER = {"()": f"{__name__}.JsonFormatter"}
_REDACT = {"()": f"{__name__}.RedactSecrets"}


def uvicorn_config(fmt: LogFormat, level: str) -> dict[str, Any]:
    """``uvicorn.run(log_config=...)`` for ``gateway serve``: uvicorn's own configuration
    (text) or the same loggers in JSON on stderr, plus the gateway's loggers at ``level``.
    uvicorn applies its ``log_level`` to its loggers after this."""
    from uvicorn.config import LOGGING_CONFIG

    config: dict[str, Any] = copy.deepcopy(LOGGING_CONFIG)
    config["filters"] = {"redact": _REDACT}
    for handler in config["handlers"].values():
        handler["filters"] = ["redact"]
    config["loggers"]["gateway"] = {"handlers": ["default"], "level": level_number(level),
                                    "propagate": False}
    if fmt == "json":
        config["formatters"] = {"json": _JSON_FORMATTER}
        for handler in config["handlers"].values():
            handler.update(formatter="json", stream="ext://sys.stderr")
        # Everything else (asyncio's "Task exception was never retrieved"...) as JSON too,
        # at the level Python's last-resort handler shows in text.
        config["root"] = {"handlers": ["default"], "level": "WARNING"}
    return config


def configure(fmt: LogFormat, level: str) -> None:
    """Every logger of the process to stderr at ``level`` (``gateway agent``)."""
    logging.addLevelName(TRACE, "TRACE")
    formatter = _JSON_FORMATTER if fmt == "json" else {
        "format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}
    logging.config.dictConfig({
        "version": 1,
        "disable_existing_loggers": False,
        "filters": {"redact": _REDACT},
        "formatters": {"main": formatter},
        "handlers": {"main": {"class": "logging.StreamHandler", "stream": "ext://sys.stderr",
                              "formatter": "main", "filters": ["redact"]}},
        "root": {"handlers": ["main"], "level": level_number(level)},
    })
