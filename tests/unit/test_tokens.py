"""Which tokens the gateway's HS256 check (PyJWT, with the gateway's rules on ``sub`` and
``role``) lets in, on every kind of token, good and bad; and that the fast check a
handshake uses (:class:`~gateway.auth.TokenVerifier`) decides every one of them exactly
as that check does."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import re
import time
from typing import Any

import jwt
import pytest

from gateway.auth import AuthError, Principal, TokenVerifier, issue_token, verify_token

SECRET = "s" * 32


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _signed(claims: Any, header: Any = None, secret: str = SECRET) -> str:
    """A token PyJWT would not make: any header, any payload (even not an object); text
    is taken as the JSON itself."""
    head = _b64(_json(header or {"alg": "HS256", "typ": "JWT"}))
    body = _b64(_json(claims))
    sig = hmac.new(secret.encode(), f"{head}.{body}".encode(), hashlib.sha256).digest()
    return f"{head}.{body}.{_b64(sig)}"


def _json(value: Any) -> bytes:
    return value.encode() if isinstance(value, str) else json.dumps(value).encode()


def _respelled(index: int) -> str:
    """A good token with one segment's last character changed in its unused low bits
    only (the same bytes, spelled otherwise), signed over that spelling."""
    head = _b64(b'{"alg": "HS256"}')  # 16 bytes: 4 spare bits
    body = _b64(_json({"sub": "a", "exp": NOW + 3600, "role": "user"}))
    if index == 0:
        head = _spelled_otherwise(head)
    elif index == 1:
        body = _spelled_otherwise(body)
    token = _signed_as(head, body)
    return token[:-1] + _spelled_otherwise(token[-2:])[-1] if index == 2 else token


def _signed_as(head: str, body: str) -> str:
    """Segments spelled as given, signed."""
    sig = hmac.new(SECRET.encode(), f"{head}.{body}".encode(), hashlib.sha256).digest()
    return f"{head}.{body}.{_b64(sig)}"


def _spelled_otherwise(segment: str) -> str:
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
    assert len(segment) % 4 in (2, 3), "no spare bits in this segment"
    last = alphabet.index(segment[-1])
    return segment[:-1] + alphabet[last ^ 1]


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
    # The shapes the fast check reads itself, and their near misses:
    "no typ": _signed({"sub": "a", "exp": NOW + 3600}, {"alg": "HS256"}),
    "typ a number": _signed({"sub": "a", "exp": NOW + 3600}, {"alg": "HS256", "typ": 1}),
    "alg twice, HS256 last": _signed({"sub": "a", "exp": NOW + 3600},
                                     '{"alg":"none","alg":"HS256"}'),
    "alg twice, none last": _signed({"sub": "a", "exp": NOW + 3600},
                                    '{"alg":"HS256","alg":"none"}'),
    "sub twice": _signed(f'{{"sub":"a","sub":"b","exp":{NOW + 3600}}}'),
    "with kid": _signed({"sub": "a", "exp": NOW + 3600}, {"alg": "HS256", "kid": "k1"}),
    "kid a number": _signed({"sub": "a", "exp": NOW + 3600}, {"alg": "HS256", "kid": 1}),
    "crit unknown": _signed({"sub": "a", "exp": NOW + 3600},
                            {"alg": "HS256", "crit": ["exp"], "exp": 1}),
    "b64 false": _signed({"sub": "a", "exp": NOW + 3600},
                         {"alg": "HS256", "b64": False, "crit": ["b64"]}),
    "with jti": _signed({"sub": "a", "exp": NOW + 3600, "jti": "j"}),
    "jti a number": _signed({"sub": "a", "exp": NOW + 3600, "jti": 5}),
    "with iss": _signed({"sub": "a", "exp": NOW + 3600, "iss": "me"}),
    "iat null": _signed({"sub": "a", "exp": NOW + 3600, "iat": None}),
    "iat past": _signed({"sub": "a", "exp": NOW + 3600, "iat": NOW - 5}),
    "role null": _signed({"sub": "a", "exp": NOW + 3600, "role": None}),
    "role service": _signed({"sub": "a", "exp": NOW + 3600, "role": "service"}),
    "exp true": _signed({"sub": "a", "exp": True}),
    "exp a numeric string": _signed({"sub": "a", "exp": str(NOW + 3600)}),
    "exp past 64 bits": _signed({"sub": "a", "exp": 10**20}),
    "exp past a float": _signed({"sub": "a", "exp": 10**400}),
    "sub empty": _signed({"sub": "", "exp": NOW + 3600}),
    "sub too long": _signed({"sub": "a" * 129, "exp": NOW + 3600}),
    "header respelled": _respelled(0),
    "header spelled plainly": _signed({"sub": "a", "exp": NOW + 3600}, {"alg": "HS256"}),
    "payload respelled": _respelled(1),
    "signature respelled": _respelled(2),
    "padded header": _signed_as(_b64(b'{"alg": "HS256"}') + "==", BODY),
    "not ascii": f"{HEAD}.{BODY}.{SIG[:-1]}\u00e9",
    "space inside": f"{HEAD}.{BODY[:5]} {BODY[5:]}.{SIG}",
}


# A padded signature is the same signature: base64url decoders accept the padding.
ACCEPTED = {"valid": "alice", "valid service": "svc", "exp a float": "a", "nbf past": "a",
            "padded signature": "alice", "no typ": "a", "typ a number": "a",
            "alg twice, HS256 last": "a", "sub twice": "b", "with kid": "a", "with jti": "a",
            "with iss": "a", "iat past": "a", "role service": "a", "exp a numeric string": "a",
            "exp past 64 bits": "a", "padded header": "alice",
            "header spelled plainly": "a"}


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


def _outcome(check: Any, token: str | None) -> Principal | str:
    try:
        return check(token)  # type: ignore[no-any-return]
    except AuthError as exc:
        return f"refused: {exc}"


@pytest.mark.parametrize("name", list(TOKENS))
def test_the_fast_check_decides_as_pyjwt(name: str) -> None:
    """Same principal, or the same refusal with the same reason, for every token."""
    fast = TokenVerifier(SECRET).verify
    assert _outcome(fast, TOKENS[name]) == _outcome(lambda t: verify_token(SECRET, t),
                                                    TOKENS[name])


def test_the_fast_check_skips_pyjwt_for_issued_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a reconnect storm brings (tokens as the gateway and the SDKs issue them) is
    decided without PyJWT's generic path; a token of any other shape still takes it."""
    calls: list[str] = []
    decode = jwt.decode

    def counted(token: str, *args: Any, **kwargs: Any) -> Any:
        calls.append(token)
        return decode(token, *args, **kwargs)

    monkeypatch.setattr(jwt, "decode", counted)
    verifier = TokenVerifier(SECRET)
    for token in (GOOD, TOKENS["valid service"], TOKENS["no typ"], TOKENS["iat past"]):
        assert verifier.verify(token).expires_at is not None
    assert calls == []
    for name in ("with kid", "expired", "other secret"):
        _outcome(verifier.verify, TOKENS[name])
    assert calls == [TOKENS["with kid"], TOKENS["expired"], TOKENS["other secret"]]
