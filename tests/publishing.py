"""Publishing as an agent would: HTTP with a service token."""

from __future__ import annotations

from typing import Any

import httpx


async def publish(gw: Any, chat_id: str, *events: dict[str, Any], key: str | None = None) -> Any:
    """POST ``events`` (in order, one batch) to ``chat_id``; returns the reply body."""
    body: dict[str, Any] = {"events": list(events)}
    if key:
        body["idempotency_key"] = key
    async with httpx.AsyncClient(base_url=gw.http) as http:
        resp = await http.post(f"/v1/conversations/{chat_id}/events", json=body,
                               headers=gw.headers("agent", "service"))
    assert resp.status_code == 200, resp.text
    return resp.json()
