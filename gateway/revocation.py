"""Revocation and disconnection, on every gateway process within a second.

``POST /v1/admin/revoke`` refuses tokens (and the tickets made from them) until a time: one
token by its ``jti``, or every token of a user issued before the revocation.
``POST /v1/admin/disconnect`` closes every WebSocket and Server-Sent Events stream of a user
now. Both are one write to one Redis hash, which every process reads every
:data:`REFRESH_S`; then it

- checks each verification against what it read, the token cache's hits included, and
- closes its own connections and streams that a new entry names.

So a revocation or a disconnection takes effect everywhere within :data:`REFRESH_S` plus a
round trip, without a pub/sub channel to every process. The hash::

    admin:revoked   "jti:<jti>"         -> until (ms)
                    "user:<user>"       -> "<at ms> <until ms>"
                    "disconnect:<user>" -> "<at ms> <reason>", kept DISCONNECT_KEEP_MS
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from redis.exceptions import RedisError

from .auth import Principal
from .redis.pipeline import AutoPipeline

log = logging.getLogger("gateway.revocation")

KEY = "admin:revoked"
REFRESH_S = 0.25
DISCONNECT_KEEP_MS = 60_000  # a disconnection's entry, for the processes to read it

Close = Callable[[Callable[[Principal], bool], str, bool], int]
"""Close this process's connections and streams whose principal matches; the reason;
whether for a revocation (4001) or a disconnection (4005). Returns how many."""


def _now_ms() -> int:
    return int(time.time() * 1000)


class Revocations:
    """What this process knows of revocations, refreshed from Redis."""

    def __init__(self, pipeline: AutoPipeline) -> None:
        self.pipeline = pipeline
        self._jtis: dict[str, int] = {}  # jti -> until (ms)
        self._users: dict[str, tuple[int, int]] = {}  # user -> (at, until) (ms)
        self._acted: set[tuple[str, str]] = set()  # entries whose connections were closed
        self._task: asyncio.Task[None] | None = None

    # --- what verifications ask -----------------------------------------------------

    def revoked(self, who: Principal) -> bool:
        now = _now_ms()
        if who.jti is not None and self._jtis.get(who.jti, 0) > now:
            return True
        user = self._users.get(who.user_id)
        if user is None or user[1] <= now:
            return False
        return _issued_before(who, user[0])

    # --- what the admin routes write ------------------------------------------------

    async def revoke_jti(self, jti: str, until_ms: int) -> None:
        await self.pipeline.execute("HSET", KEY, f"jti:{jti}", until_ms)
        self._jtis[jti] = until_ms  # this process at once

    async def revoke_user(self, user_id: str, until_ms: int) -> None:
        at = _now_ms()
        await self.pipeline.execute("HSET", KEY, f"user:{user_id}", f"{at} {until_ms}")
        self._users[user_id] = (at, until_ms)

    async def disconnect(self, user_id: str, reason: str) -> None:
        await self.pipeline.execute("HSET", KEY, f"disconnect:{user_id}",
                                    f"{_now_ms()} {reason}")

    # --- every process --------------------------------------------------------------

    def start(self, close: Close) -> None:
        self._task = asyncio.create_task(self._run(close), name="revocations")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self, close: Close) -> None:
        while True:
            try:
                await self.refresh(close)
            except (RedisError, OSError) as exc:
                log.warning("revocations not read: %s", exc)
            await asyncio.sleep(REFRESH_S)

    async def refresh(self, close: Close) -> None:
        """Read the hash; drop what lapsed; close what an entry not acted on yet names."""
        raw = await self.pipeline.execute("HGETALL", KEY)
        now = _now_ms()
        jtis: dict[str, int] = {}
        users: dict[str, tuple[int, int]] = {}
        lapsed: list[str] = []
        for field, value in _pairs(raw):
            kind, _, name = field.partition(":")
            first = (field, value) not in self._acted
            self._acted.add((field, value))
            if kind == "jti":
                until = int(value)
                if until <= now:
                    lapsed.append(field)
                    continue
                jtis[name] = until
                if first:
                    close(_with_jti(name), "token revoked", True)
            elif kind == "user":
                at_text, _, until_text = value.partition(" ")
                at, until = int(at_text), int(until_text)
                if until <= now:
                    lapsed.append(field)
                    continue
                users[name] = (at, until)
                if first:
                    close(_of_user(name, issued_before=at), "token revoked", True)
            elif kind == "disconnect":
                at_text, _, reason = value.partition(" ")
                if int(at_text) + DISCONNECT_KEEP_MS <= now:
                    lapsed.append(field)
                elif first:
                    close(_of_user(name), reason or "disconnected", False)
        self._jtis, self._users = jtis, users
        if lapsed:
            await self.pipeline.execute("HDEL", KEY, *lapsed)
            self._acted -= {(f, v) for f, v in self._acted if f in lapsed}


def _with_jti(jti: str) -> Callable[[Principal], bool]:
    return lambda who: who.jti == jti


def _of_user(user_id: str, issued_before: int | None = None) -> Callable[[Principal], bool]:
    """The principals of ``user_id`` (with tokens issued before ``issued_before`` ms)."""
    def matches(who: Principal) -> bool:
        if who.user_id != user_id:
            return False
        return issued_before is None or _issued_before(who, issued_before)
    return matches


def _issued_before(who: Principal, at_ms: int) -> bool:
    """Whether ``who``'s token was issued before the second ``at_ms`` falls in (``iat`` has
    whole seconds: a token issued in that second, after the revocation maybe, is kept);
    one without ``iat`` counts as issued before."""
    return who.issued_at is None or who.issued_at < at_ms // 1000


def _pairs(raw: object) -> list[tuple[str, str]]:
    """HGETALL's reply (a dict, or a flat list) as text pairs."""
    def text(value: object) -> str:
        return value.decode() if isinstance(value, bytes) else str(value)

    if isinstance(raw, dict):
        return [(text(k), text(v)) for k, v in raw.items()]
    items = list(raw) if isinstance(raw, list | tuple) else []
    return [(text(items[i]), text(items[i + 1])) for i in range(0, len(items) - 1, 2)]
