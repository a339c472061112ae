"""RFC 6455 on the wire, against the gateway's own WebSocket protocol (``gateway serve``).

A raw TCP client writes every frame by hand (section 5.2), so the cases a WebSocket
library would never send can be sent: the handshake's refusals (4.2), fragmentation (5.4),
control frames in and out of fragments, oversize or fragmented control frames (5.5),
unmasked, reserved-bit and reserved-opcode frames (5.1, 5.2), invalid UTF-8 in a text
message and in a close reason (8.1, 5.5.1), close codes (7.4) and frames over the limit.
These are the Autobahn fuzzing client's core cases (sections 1-7 of its suite), written
from the RFC: its client does not install on Python 3.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
import struct
from typing import Any

import httpx
import pytest

from .conftest import GatewayProcess

pytestmark = pytest.mark.anyio

GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
TEXT, BINARY, CONT, CLOSE, PING, PONG = 0x1, 0x2, 0x0, 0x8, 0x9, 0xA
TIMEOUT = 10


def frame(opcode: int, payload: bytes = b"", *, fin: bool = True, rsv: int = 0,
          mask: bool = True) -> bytes:
    """One client frame (masked unless told not to), any length."""
    head = bytes([(0x80 if fin else 0) | (rsv << 4) | opcode])
    size = len(payload)
    bit = 0x80 if mask else 0
    if size < 126:
        head += bytes([bit | size])
    elif size < 65536:
        head += bytes([bit | 126]) + struct.pack("!H", size)
    else:
        head += bytes([bit | 127]) + struct.pack("!Q", size)
    if not mask:
        return head + payload
    key = os.urandom(4)
    return head + key + bytes(b ^ key[i % 4] for i, b in enumerate(payload))


def close_payload(code: int, reason: bytes = b"") -> bytes:
    return struct.pack("!H", code) + reason


class Raw:
    """A client socket speaking RFC 6455 by hand."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, gw: GatewayProcess, request: bytes | None = None,
                   user: str = "framing-user") -> tuple[Raw, bytes]:
        """Connect and send ``request`` (default: a valid upgrade); returns the client and
        the response head."""
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        if request is None:
            request = upgrade(gw, user)
        writer.write(request)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), TIMEOUT)
        return cls(reader, writer), head

    def send(self, data: bytes) -> None:
        self.writer.write(data)

    async def recv(self) -> tuple[int, bool, bytes]:
        """The next server frame: opcode, fin, payload. Server frames are never masked."""
        b0, b1 = await asyncio.wait_for(self.reader.readexactly(2), TIMEOUT)
        assert b1 & 0x80 == 0, "a server frame must not be masked"
        assert b0 & 0x70 == 0, "no extension was negotiated: RSV bits must be 0"
        size = b1 & 0x7F
        if size == 126:
            (size,) = struct.unpack("!H", await self.reader.readexactly(2))
        elif size == 127:
            (size,) = struct.unpack("!Q", await self.reader.readexactly(8))
        payload = await asyncio.wait_for(self.reader.readexactly(size), TIMEOUT)
        return b0 & 0x0F, bool(b0 & 0x80), payload

    async def message(self) -> dict[str, Any]:
        """The next JSON text message, answering nothing else on the way (pings included:
        none comes at the default heartbeat within a test)."""
        opcode, fin, payload = await self.recv()
        assert (opcode, fin) == (TEXT, True), (opcode, payload)
        result: dict[str, Any] = json.loads(payload)
        return result

    async def reply(self, type_: str) -> dict[str, Any]:
        """The next message of ``type_``, past feed frames."""
        while True:
            message = await self.message()
            if message["type"] == type_:
                return message

    async def closed_with(self) -> tuple[int | None, bytes]:
        """Read to the server's close frame; echo it as RFC 6455 asks and see the TCP
        connection end. Returns the close code (None: no code) and reason."""
        while True:
            opcode, _, payload = await self.recv()
            if opcode == CLOSE:
                break
        self.send(frame(CLOSE, payload[:2]))
        assert await asyncio.wait_for(self.reader.read(), TIMEOUT) == b"", "then EOF"
        self.writer.close()
        if not payload:
            return None, b""
        return struct.unpack("!H", payload[:2])[0], payload[2:]

    async def ready(self) -> Raw:
        """Past hello."""
        assert (await self.message())["type"] == "hello"
        return self

    def close(self) -> None:
        self.writer.close()


def upgrade(gw: GatewayProcess, user: str, *, key: bytes | None = None, version: bytes = b"13",
            method: bytes = b"GET", path: bytes = b"/v1/ws", extra: bytes = b"",
            query: bytes | None = None) -> bytes:
    """An upgrade request; its query is ``user``'s token unless ``query`` is given."""
    key = base64.b64encode(os.urandom(16)) if key is None else key
    query = b"token=" + gw.token(user).encode() if query is None else query
    return (method + b" " + path + b"?" + query + b" HTTP/1.1\r\n"
            b"Host: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: keep-alive, Upgrade\r\n"
            b"Sec-WebSocket-Key: " + key + b"\r\nSec-WebSocket-Version: " + version + b"\r\n"
            + extra + b"\r\n")


async def connected(gw: GatewayProcess, user: str = "framing-user") -> Raw:
    raw, head = await Raw.open(gw, user=user)
    assert head.startswith(b"HTTP/1.1 101 "), head
    return await raw.ready()


def ping_request(request_id: str) -> bytes:
    return json.dumps({"type": "ping", "id": request_id}).encode()


# --- the opening handshake (section 4) ---------------------------------------------------


async def test_the_handshake_answers_with_the_accept_key_and_subprotocol(
        gateway: GatewayProcess) -> None:
    key = base64.b64encode(os.urandom(16))
    request = upgrade(gateway, "hs-user", key=key,
                      extra=b"Sec-WebSocket-Protocol: chat, gateway.v1.json\r\n")
    raw, head = await Raw.open(gateway, request)
    lines = head.decode().split("\r\n")
    assert lines[0] == "HTTP/1.1 101 Switching Protocols"
    fields = {k.lower(): v for k, _, v in (line.partition(": ") for line in lines[1:] if line)}
    expected = base64.b64encode(hashlib.sha1(key + GUID).digest()).decode()
    assert fields["sec-websocket-accept"] == expected
    assert fields["upgrade"].lower() == "websocket" and fields["connection"].lower() == "upgrade"
    assert fields["sec-websocket-protocol"] == "gateway.v1.json"
    assert "sec-websocket-extensions" not in fields  # no compression: frames are shared
    await raw.ready()
    raw.close()


@pytest.mark.parametrize(("change", "status"), [
    ({"version": b"8"}, b"426"),
    ({"key": b"c2hvcnQ="}, b"400"),  # 5 bytes, not 16
    ({"key": b"!!!!!!!!!!!!!!!!!!!!!!!="}, b"400"),  # not base64
    ({"method": b"POST"}, b"400"),
    ({"path": b"/v1/elsewhere"}, b"403"),
])
async def test_a_bad_upgrade_request_is_refused_over_http(
        gateway: GatewayProcess, change: dict[str, bytes], status: bytes) -> None:
    raw, head = await Raw.open(gateway, upgrade(gateway, "hs-user", **change))  # type: ignore[arg-type]
    assert head.split(b" ")[1] == status, head
    if status == b"426":
        assert b"sec-websocket-version: 13\r\n" in head.lower()
    assert await asyncio.wait_for(raw.reader.read(), TIMEOUT) == b"", "then the socket closes"


async def test_two_keys_are_refused(gateway: GatewayProcess) -> None:
    extra = b"Sec-WebSocket-Key: " + base64.b64encode(os.urandom(16)) + b"\r\n"
    raw, head = await Raw.open(gateway, upgrade(gateway, "hs-user", extra=extra))
    assert head.startswith(b"HTTP/1.1 400 "), head
    raw.close()


# --- data frames and fragmentation (section 5.4) ------------------------------------------


async def test_a_fragmented_text_message_is_one_message(gateway: GatewayProcess) -> None:
    raw = await connected(gateway)
    data = ping_request("frag")
    raw.send(frame(TEXT, data[:3], fin=False) + frame(CONT, data[3:9], fin=False)
             + frame(CONT, data[9:]))
    assert (await raw.reply("pong"))["id"] == "frag"
    raw.close()


async def test_a_code_point_split_across_fragments_is_valid_utf8(
        gateway: GatewayProcess) -> None:
    raw = await connected(gateway)
    data = json.dumps({"type": "ping", "id": "é€"}, ensure_ascii=False).encode()
    cut = data.index("€".encode()) + 1  # inside the three bytes of the euro sign
    raw.send(frame(TEXT, data[:cut], fin=False) + frame(CONT, data[cut:]))
    assert (await raw.reply("pong"))["id"] == "é€"
    raw.close()


async def test_control_frames_may_come_between_fragments(gateway: GatewayProcess) -> None:
    raw = await connected(gateway)
    data = ping_request("between")
    raw.send(frame(TEXT, data[:5], fin=False) + frame(PING, b"in the middle")
             + frame(PONG, b"unasked") + frame(CONT, data[5:]))
    assert await raw.recv() == (PONG, True, b"in the middle")
    assert (await raw.reply("pong"))["id"] == "between"
    raw.close()


async def test_a_ping_of_125_bytes_is_echoed(gateway: GatewayProcess) -> None:
    raw = await connected(gateway)
    payload = bytes(range(125))
    raw.send(frame(PING, payload))
    assert await raw.recv() == (PONG, True, payload)
    raw.close()


async def test_empty_fragments_and_an_empty_ping(gateway: GatewayProcess) -> None:
    raw = await connected(gateway)
    data = ping_request("empty")
    raw.send(frame(TEXT, b"", fin=False) + frame(CONT, data, fin=False) + frame(PING)
             + frame(CONT, b""))
    assert await raw.recv() == (PONG, True, b"")
    assert (await raw.reply("pong"))["id"] == "empty"
    raw.close()


async def test_a_large_frame_under_the_limit_is_read(gateway: GatewayProcess) -> None:
    raw = await connected(gateway)
    data = json.dumps({"type": "ping", "id": "big", "pad": "x" * 60_000}).encode()
    raw.send(frame(TEXT, data))  # a 16-bit length; 60 KB in several TCP segments
    assert (await raw.reply("pong"))["id"] == "big"  # read whole: a close would fail here
    raw.send(frame(TEXT, ping_request("after")))
    assert (await raw.reply("pong"))["id"] == "after"  # and the connection goes on
    raw.close()


# --- what closes the connection -----------------------------------------------------------


PROTOCOL_ERRORS = {
    "ping over 125 bytes": frame(PING, b"x" * 126),
    "fragmented ping": frame(PING, b"a", fin=False) + frame(CONT, b"b"),
    "fragmented close": frame(CLOSE, close_payload(1000), fin=False),
    "continuation with nothing to continue": frame(CONT, b"{}"),
    "a new message inside a fragmented one": frame(TEXT, b"{", fin=False) + frame(TEXT, b"}"),
    "unmasked client frame": frame(TEXT, ping_request("u"), mask=False),
    "reserved bit 1": frame(TEXT, ping_request("r"), rsv=4),
    "reserved bits 2 and 3": frame(TEXT, ping_request("r"), rsv=3),
    "reserved data opcode 3": frame(0x3, b"x"),
    "reserved control opcode 0xB": frame(0xB),
    "close with a 1-byte payload": frame(CLOSE, b"\x03"),
    "close code 999": frame(CLOSE, close_payload(999)),
    "close code 1004 (reserved)": frame(CLOSE, close_payload(1004)),
    "close code 1005 (never sent)": frame(CLOSE, close_payload(1005)),
    "close code 1006 (never sent)": frame(CLOSE, close_payload(1006)),
    "close code 5000": frame(CLOSE, close_payload(5000)),
}


@pytest.mark.parametrize("case", list(PROTOCOL_ERRORS))
async def test_a_protocol_error_closes_1002(gateway: GatewayProcess, case: str) -> None:
    raw = await connected(gateway)
    raw.send(PROTOCOL_ERRORS[case])
    code, _ = await raw.closed_with()
    assert code == 1002, case


async def test_invalid_utf8_in_a_text_message_closes_1007(gateway: GatewayProcess) -> None:
    raw = await connected(gateway)
    raw.send(frame(TEXT, b'{"type":"ping","id":"\xc3\x28"}'))
    assert (await raw.closed_with())[0] == 1007


async def test_invalid_utf8_across_fragments_closes_1007(gateway: GatewayProcess) -> None:
    raw = await connected(gateway)
    raw.send(frame(TEXT, b'{"type":"ping","id":"\xf0\x90', fin=False)
             + frame(CONT, b'\x28\xbc"}'))
    assert (await raw.closed_with())[0] == 1007


async def test_invalid_utf8_in_a_close_reason_closes_1007(gateway: GatewayProcess) -> None:
    raw = await connected(gateway)
    raw.send(frame(CLOSE, close_payload(1000, b"bye \xff")))
    assert (await raw.closed_with())[0] == 1007


async def test_a_frame_over_the_limit_closes_1009(gateway: GatewayProcess) -> None:
    raw = await connected(gateway)
    raw.send(frame(BINARY, b"x" * (64 * 1024 + 1)))
    assert (await raw.closed_with())[0] == 1009


async def test_a_fragmented_message_over_the_limit_closes_1009(
        gateway: GatewayProcess) -> None:
    raw = await connected(gateway)
    raw.send(frame(TEXT, b"x" * 40_000, fin=False) + frame(CONT, b"x" * 40_000))
    assert (await raw.closed_with())[0] == 1009


@pytest.mark.parametrize(("payload", "echoed"), [
    (close_payload(1000, b"done"), 1000),
    (close_payload(1001), 1001),
    (close_payload(3000), 3000),  # registered by libraries and frameworks
    (close_payload(4999, "ok ✓".encode()), 4999),  # private use
    (b"", None),  # no code at all: the echo has none either
])
async def test_the_client_closes_and_the_server_echoes(
        gateway: GatewayProcess, payload: bytes, echoed: int | None) -> None:
    raw = await connected(gateway)
    raw.send(frame(CLOSE, payload))
    opcode, fin, body = await raw.recv()
    assert (opcode, fin) == (CLOSE, True)
    assert (struct.unpack("!H", body[:2])[0] if body else None) == echoed
    assert await asyncio.wait_for(raw.reader.read(), TIMEOUT) == b"", "the server closes TCP"
    raw.close()


async def test_frames_after_a_close_are_ignored(gateway: GatewayProcess) -> None:
    raw = await connected(gateway)
    raw.send(frame(CLOSE, close_payload(1000)) + frame(TEXT, ping_request("late")))
    opcode, _, body = await raw.recv()
    assert opcode == CLOSE and struct.unpack("!H", body[:2])[0] == 1000
    assert await asyncio.wait_for(raw.reader.read(), TIMEOUT) == b"", "no pong: only EOF"
    raw.close()


async def test_a_refused_token_gets_its_close_code_after_the_101(
        gateway: GatewayProcess) -> None:
    raw, head = await Raw.open(gateway, upgrade(gateway, "", query=b"token=nope"))
    assert head.startswith(b"HTTP/1.1 101 ")
    code, reason = await raw.closed_with()
    assert code == 4001 and reason.startswith(b"invalid token")


# --- keepalive ------------------------------------------------------------------------------


async def test_keepalive_pings_and_closes_1011_when_unanswered(start_gateway: Any) -> None:
    gw = start_gateway(heartbeat=0.3)
    answering, silent = await connected(gw, "ka-a"), await connected(gw, "ka-b")
    for _ in range(3):  # three rounds answered: still open
        while (found := await answering.recv())[0] != PING:
            pass
        answering.send(frame(PONG, found[2]))
    answering.send(frame(TEXT, ping_request("alive")))
    assert (await answering.reply("pong"))["id"] == "alive"
    assert (await silent.closed_with())[0] == 1011  # never answered
    answering.close()


async def test_keepalive_leaves_a_connection_that_talks_unpinged(start_gateway: Any) -> None:
    """A message since the last round shows the peer is alive: no ping (``reply`` fails on
    one) for as long as it talks, though it never answers pings; silent, it is pinged, and
    closed with 1011 when it does not answer."""
    gw = start_gateway(heartbeat=0.3)
    talking = await connected(gw, "ka-talk")
    loop = asyncio.get_running_loop()
    until, sent = loop.time() + 1.5, 0  # five rounds
    while loop.time() < until:
        talking.send(frame(TEXT, ping_request(f"t{sent}")))
        assert (await talking.reply("pong"))["id"] == f"t{sent}"
        sent += 1
        # Three messages a round: between them, no frame (a ping) may come.
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(talking.recv(), 0.1)
    while (await talking.recv())[0] != PING:
        pass
    assert (await talking.closed_with())[0] == 1011
    talking.close()


# --- a connection ticket is redeemed after the 101 ----------------------------------------


async def test_messages_sent_before_a_ticket_is_redeemed_wait_for_the_session(
        gateway: GatewayProcess) -> None:
    async with httpx.AsyncClient(base_url=gateway.http) as http:
        reply = await http.post("/v1/ws-ticket", headers=gateway.headers("ticket-user"))
        assert reply.status_code == 200, reply.text
    ticket = b"ticket=" + reply.json()["ticket"].encode()
    raw, head = await Raw.open(gateway, upgrade(gateway, "ticket-user", query=ticket))
    assert head.startswith(b"HTTP/1.1 101 ")
    # At once, before hello: more messages than are held before reading stops.
    raw.send(b"".join(frame(TEXT, ping_request(f"early-{i}")) for i in range(6)))
    hello = await raw.message()
    assert hello["type"] == "hello" and hello["user_id"] == "ticket-user"
    assert [(await raw.reply("pong"))["id"] for _ in range(6)] == [f"early-{i}"
                                                                   for i in range(6)]
    raw.close()


async def test_a_spent_ticket_closes_4001(gateway: GatewayProcess) -> None:
    raw, head = await Raw.open(gateway, upgrade(gateway, "", query=b"ticket=nope"))
    assert head.startswith(b"HTTP/1.1 101 ")
    raw.send(frame(TEXT, ping_request("too-early")))  # dropped with the refusal
    code, reason = await raw.closed_with()
    assert code == 4001 and reason.startswith(b"invalid ticket")
