"""Which tokens the gateway's HS256 check (PyJWT, with the gateway's rules on ``sub`` and
``role``) lets in, on every kind of token, good and bad."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import re
import time
from typing import Any

import pytest

from gateway.auth import AuthError, issue_token, verify_token

SECRET = "s" * 32


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _signed(claims: Any, header: Any = None, secret: str = SECRET) -> str:
    """A token PyJWT would not make: any header, any payload (even not an object)."""
    head = _b64(json.dumps(header or {"alg": "HS256", "typ": "JWT"}).encode())
    body = _b64(json.dumps(claims).encode())
    sig = hmac.new(secret.encode(), f"{head}.{body}".encode(), hashlib.sha256).digest()
    return f"{head}.{body}.{_b64(sig)}"


NOW = int(time.time())
GOOD = issue_token(SECRET, "alice")
HEAD, BODY, SIG = GOOD.split(".")
MALLORY = _b64(json.dumps({"sub": "mallory", "exp": NOW + 3600}).encode())
TOKENS = {
    "valid": GOOD,
    "valid service": issue_token(SECRET, "svc", role="service"),
    "expired": issue_token(SECRET, "alice", ttl=-10),
    "other secret": issue_token("t" * 32, "alice"),
    "alg none": _signed({"sub": "a", "exp": NOW + 3600}, {"alg": "none"}),
    "alg HS512": _signed({"sub": "a", "exp": NOW + 3600}, {"alg": "HS512", "typ": "JWT"}),
    "no exp": _signed({"sub": "a"}),
    "no sub": _signed({"exp": NOW + 3600}),
    "exp a string": _signed({"sub": "a", "exp": "soon"}),
    "exp a float": _signed({"sub": "a", "exp": NOW + 3600.5}),
    "nbf ahead": _signed({"sub": "a", "exp": NOW + 3600, "nbf": NOW + 1800}),
    "nbf past": _signed({"sub": "a", "exp": NOW + 3600, "nbf": NOW - 30}),
    "iat ahead": _signed({"sub": "a", "exp": NOW + 3600, "iat": NOW + 1800}),
    "with aud": _signed({"sub": "a", "exp": NOW + 3600, "aud": "x"}),
    "payload a list": _signed([1, 2]),
    "sub a number": _signed({"sub": 5, "exp": NOW + 3600}),
    "sub with colon": _signed({"sub": "a:b", "exp": NOW + 3600}),
    "role admin": _signed({"sub": "a", "exp": NOW + 3600, "role": "admin"}),
    "tampered payload": f"{HEAD}.{MALLORY}.{SIG}",
    "junk in signature": f"{HEAD}.{BODY}.{SIG[:10]}!{SIG[10:]}",
    "padded signature": f"{GOOD}=",
    "two segments": f"{HEAD}.{BODY}",
    "four segments": f"{GOOD}.x",
    "header not json": f"{_b64(b'nope')}.{BODY}.{SIG}",
    "empty signature": f"{HEAD}.{BODY}.",
}


# A padded signature is the same signature: base64url decoders accept the padding.
ACCEPTED = {"valid": "alice", "valid service": "svc", "exp a float": "a", "nbf past": "a",
            "padded signature": "alice"}


@pytest.mark.parametrize("name", list(TOKENS))
def test_only_good_tokens_get_in(name: str) -> None:
    token = TOKENS[name]
    if name in ACCEPTED:
        assert verify_token(SECRET, token).user_id == ACCEPTED[name]
    else:
        with pytest.raises(AuthError):
            verify_token(SECRET, token)


def test_the_reasons_a_client_sees() -> None:
    for name, reason in [("expired", "token expired"),
                         ("other secret", "invalid token: Signature verification failed"),
                         ("no sub", 'invalid token: Token is missing the "sub" claim')]:
        with pytest.raises(AuthError, match=f"^{re.escape(reason)}$"):
            verify_token(SECRET, TOKENS[name])
    with pytest.raises(AuthError, match=r"^missing token$"):
        verify_token(SECRET, None)
