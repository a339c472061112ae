"""Coalesced writes: while several frames are handed out at once, each socket gets one write.

When one read from pub/sub brings several messages (an agent streaming into many rooms that
one client watches, a burst), the hub delivers them all inside :func:`corked`. Meanwhile
every write to a socket, the fan-out's and a session's alike, is held in order per
transport (:func:`write`), and when the last frame is out each transport gets one
``write`` of everything held for it: one system call instead of one per frame.

A single message is written at once, as without the cork: nothing is held, nothing costs.
Holding never reorders a socket's bytes: every write made while corked is held, and the
held writes leave before any later one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager

log = logging.getLogger("gateway.transport")

Write = Callable[[bytes], None]  # a transport's write


class _Cork:
    __slots__ = ("active", "held")

    def __init__(self) -> None:
        self.active = False
        # transport.write -> what it will write; bound methods of one transport are equal.
        self.held: dict[Write, list[bytes]] = {}


CORK = _Cork()


def write(transport_write: Write, data: bytes) -> None:
    """``transport_write(data)``, or held until the cork comes out."""
    if CORK.active:
        held = CORK.held.get(transport_write)
        if held is None:
            CORK.held[transport_write] = [data]
        else:
            held.append(data)
    else:
        transport_write(data)


def hold_all(writes: Iterator[Write] | tuple[Write, ...], data: bytes) -> None:
    """:func:`write` of the same ``data`` to every one of ``writes``, while corked."""
    held = CORK.held
    for transport_write in writes:
        chunks = held.get(transport_write)
        if chunks is None:
            held[transport_write] = [data]
        else:
            chunks.append(data)


@contextmanager
def corked() -> Iterator[None]:
    """Hold every write made inside; then one write per transport."""
    if CORK.active:  # already held by an outer cork: it writes
        yield
        return
    CORK.active = True
    try:
        yield
    finally:
        CORK.active = False
        held, CORK.held = CORK.held, {}
        for transport_write, chunks in held.items():
            try:
                transport_write(chunks[0] if len(chunks) == 1 else b"".join(chunks))
            except (RuntimeError, OSError) as exc:
                # A transport that died without telling us yet: its session is closing.
                log.debug("a coalesced write failed: %s", exc)
