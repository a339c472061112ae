"""Python client SDK for the gateway's WebSocket protocol: see :mod:`.gateway_client`."""

# KEEP_BACKING_OFF, TERMINAL, AnyItem, ChatItem and TokenFactory are not in __all__ but stay
# importable from here, as from the module this package replaced.
from .gateway_client import (  # noqa: F401
    KEEP_BACKING_OFF,
    TERMINAL,
    Ack,
    AnyItem,
    ChatItem,
    ClientClosed,
    ConnectionLost,
    Ended,
    Event,
    GatewayClient,
    GatewayError,
    Recovery,
    RequestError,
    StreamReset,
    StreamText,
    SubscribeResult,
    TerminalError,
    TokenFactory,
)

__all__ = [
    "Ack",
    "ClientClosed",
    "ConnectionLost",
    "Ended",
    "Event",
    "GatewayClient",
    "GatewayError",
    "Recovery",
    "RequestError",
    "StreamReset",
    "StreamText",
    "SubscribeResult",
    "TerminalError",
]
