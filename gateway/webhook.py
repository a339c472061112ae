"""Webhooks for people who are away: a phone that sleeps learns its answer is ready.

When a turn ends (or an agent asks a client tool) its owner may have no live connection
to the conversation. The publisher put a :class:`~gateway.redis.notify_outbox.Notification`
in the outbox; this sender, on every gateway with ``GATEWAY_WEBHOOK_URL``, takes the due
ones (two seconds after their event) under a lease and, unless the owner is connected to
the conversation then, POSTs::

    POST GATEWAY_WEBHOOK_URL
    Content-Type: application/json
    Gateway-Webhook-Id: <id>                   the same on every attempt: dedupe by it
    Gateway-Webhook-Timestamp: <unix seconds>
    Gateway-Webhook-Signature: v1=<hex HMAC-SHA256 of "<timestamp>.<body>" with the secret>

    {"id", "type": "turn_end" | "awaiting_input", "user_id", "chat_id", "seq", "ts",
     "preview", "title"}

A 2xx delivers it. Anything else, or no answer within ``GATEWAY_WEBHOOK_TIMEOUT``, is tried
again with backoff (1 s doubling to 10 min, :data:`MAX_ATTEMPTS` in all); a gateway killed
mid-delivery leaves it to another once its lease (three timeouts) lapses. So deliveries
are at least once: the receiver dedupes by ``id``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import time
from collections.abc import Awaitable, Callable

import httpx
import msgspec
from redis.exceptions import RedisError

from .config import Settings
from .redis.notify_outbox import Notification, NotifyOutbox

log = logging.getLogger("gateway.webhook")

MAX_ATTEMPTS = 12  # 1 s doubling to 10 min: about 28 minutes of trying in all
POLL_S = 0.25  # how often the outbox is read for due notifications
ON_TTL_S = 30  # the "some gateway delivers" mark, renewed every POLL_S

Present = Callable[[str, str], Awaitable[bool]]
"""Whether ``chat_id`` has a live connection of ``user`` now (then no webhook is sent)."""


class Payload(msgspec.Struct, frozen=True):
    """The body of a webhook."""

    id: str
    type: str
    user_id: str
    chat_id: str
    seq: int
    ts: int
    preview: str | None
    title: str | None


def signature(secret: str, timestamp: int, body: bytes) -> str:
    """``v1=`` and the hex HMAC-SHA256 of ``"<timestamp>.<body>"``: what a receiver checks."""
    mac = hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256)
    return "v1=" + mac.hexdigest()


def backoff_s(attempt: int) -> float:
    """Seconds before the next try after ``attempt`` failed ones."""
    return float(min(600, 2 ** max(0, attempt - 1)))


class WebhookSender:
    """Delivers the outbox's due notifications, as a companion of the gateway's runtime."""

    def __init__(self, outbox: NotifyOutbox, settings: Settings, present: Present) -> None:
        self.outbox = outbox
        self.url = settings.webhook_url
        self.secret = settings.webhook_secret
        self.timeout = settings.webhook_timeout
        # A claimed notification is this gateway's while a delivery may still be under way.
        self.lease_ms = int(self.timeout * 3000)
        self.present = present
        self.stats = {"delivered": 0, "skipped": 0, "retried": 0, "dropped": 0}
        self._task: asyncio.Task[None] | None = None
        self._client: httpx.AsyncClient | None = None

    async def start(self) -> None:
        self._client = httpx.AsyncClient(timeout=self.timeout)
        await self.outbox.announce(ON_TTL_S)
        self._task = asyncio.create_task(self._run(), name="webhooks")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._client is not None:
            await self._client.aclose()

    async def _run(self) -> None:
        while True:
            try:
                await self.outbox.announce(ON_TTL_S)
                for tag in self.outbox.partitions:
                    due = await self.outbox.claim(tag, self.lease_ms, 50)
                    await asyncio.gather(*(self._deliver(note) for note in due))
            except (RedisError, OSError) as exc:
                log.warning("webhook outbox: %s", exc)
            await asyncio.sleep(POLL_S)

    async def _deliver(self, note: Notification) -> None:
        if await self.present(note.chat_id, note.user):
            self.stats["skipped"] += 1  # they see it live: no push
            await self.outbox.done(note)
            return
        body = msgspec.json.encode(Payload(note.id, note.kind, note.user, note.chat_id,
                                           note.seq, note.ts, note.preview, note.title))
        now = int(time.time())
        headers = {"Content-Type": "application/json", "Gateway-Webhook-Id": note.id,
                   "Gateway-Webhook-Timestamp": str(now),
                   "Gateway-Webhook-Signature": signature(self.secret, now, body)}
        assert self._client is not None
        try:
            reply = await self._client.post(self.url, content=body, headers=headers)
            ok, why = reply.is_success, f"HTTP {reply.status_code}"
        except httpx.HTTPError as exc:
            ok, why = False, type(exc).__name__
        if ok:
            self.stats["delivered"] += 1
            await self.outbox.done(note)
        elif note.attempt + 1 >= MAX_ATTEMPTS:
            self.stats["dropped"] += 1
            log.warning("webhook %s given up after %d attempts: %s", note.id,
                        note.attempt + 1, why)
            await self.outbox.done(note)
        else:
            self.stats["retried"] += 1
            delay = backoff_s(note.attempt + 1)
            log.info("webhook %s failed (%s); again in %gs", note.id, why, delay)
            await self.outbox.retry(note, int((time.time() + delay) * 1000))
