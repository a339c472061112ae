"""What every HTTP route takes from its request: the gateway, who asks, the chat id.

One place for the three, so that every door (the HTTP API, the AI SDK's transport, AG-UI
for frontends) authenticates and checks a chat id the same way, and logs them the same.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from starlette.requests import Request

from . import logs
from . import protocol as p
from .auth import Principal
from .errors import Rejected

if TYPE_CHECKING:
    from .runtime import Gateway


def gateway_of(request: Request) -> Gateway:
    gateway: Gateway = request.app.state.gateway
    return gateway


def principal_of(request: Request) -> Principal:
    """Who asks: the bearer token (header, else ``?token=``); ``unauthorized`` else."""
    who = gateway_of(request).authenticate(request)
    logs.bind(user_id=who.user_id)
    return who


def chat_id_of(request: Request) -> str:
    """The path's ``{chat_id}``, checked (``invalid_request``), for the logs too."""
    chat_id: str = request.path_params["chat_id"]
    if not p.CHAT_ID_RE.match(chat_id):
        raise Rejected("invalid_request", f"chat_id must match {p.CHAT_ID_PATTERN}")
    logs.about_chat(chat_id)
    return chat_id
