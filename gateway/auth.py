"""Tokens, and who may read or write which conversation."""

from __future__ import annotations

import binascii
import hmac
import time
from typing import TYPE_CHECKING, Any, Literal

import jwt
import msgspec

from .errors import Rejected

if TYPE_CHECKING:
    from .redis.records import Meta

ALGORITHM = "HS256"

Role = Literal["user", "service"]


class AuthError(Exception):
    """The token is missing, malformed, badly signed or expired."""


class Principal(msgspec.Struct, frozen=True):
    """Who is on the other end of a connection or request."""

    user_id: str
    role: Role = "user"
    expires_at: float | None = None  # unix seconds

    @property
    def is_service(self) -> bool:
        return self.role == "service"

    def may_access(self, owner: str) -> bool:
        """Read, write, rename or delete a conversation owned by ``owner``."""
        return self.is_service or owner == self.user_id

    def writer(self) -> str:
        """The owner a store write must check for ("" lets a service write anywhere)."""
        return "" if self.is_service else self.user_id


def check_access(who: Principal, meta: Meta | None, chat_id: str) -> Meta:
    """The one ownership check of a read: the conversation's state if ``who`` may have it,
    else ``not_found`` or ``forbidden``."""
    if meta is None:
        raise Rejected("not_found", f"conversation {chat_id!r} does not exist")
    if not who.may_access(meta.owner):
        raise Rejected("forbidden", "you may not access this conversation")
    return meta


def issue_token(secret: str, sub: str, role: Role = "user", ttl: float = 3600.0) -> str:
    now = int(time.time())
    claims: dict[str, object] = {"sub": sub, "iat": now, "exp": now + int(ttl)}
    if role != "user":
        claims["role"] = role
    return jwt.encode(claims, secret, algorithm=ALGORITHM)


def verify_token(secret: str, token: str | None) -> Principal:
    """Who an HS256 JWT names, once its signature and its claims hold.

    Checked here with the standard library rather than by PyJWT, which costs about 80 µs a
    token (it scans each segment character by character, and re-checks the key on every
    call); a connection storm verifies thousands of distinct tokens. The rules are PyJWT's,
    for the claims PyJWT checks when no audience or issuer is asked for: ``sub`` and ``exp``
    required, ``exp`` in the future, ``nbf`` and ``iat`` not, no ``aud`` at all.
    ``tests/unit/test_tokens.py`` holds the two to the same verdicts."""
    if not token:
        raise AuthError("missing token")
    claims = _claims(secret, token)
    exp, now = claims.get("exp"), time.time()
    for name in ("exp", "nbf", "iat"):
        value = claims.get(name)
        if (value is not None or name == "exp") and (
                isinstance(value, bool) or not isinstance(value, int | float)):
            raise AuthError(f"invalid token: the {name} claim must be a number")
    assert isinstance(exp, int | float)
    if exp <= now:
        raise AuthError("token expired")
    if claims.get("nbf", 0) > now or claims.get("iat", 0) > now:
        raise AuthError("invalid token: The token is not yet valid")
    if "aud" in claims:
        raise AuthError("invalid token: Invalid audience")
    sub, role = claims.get("sub"), claims.get("role", "user")
    if not isinstance(sub, str) or not sub or len(sub) > 128 or ":" in sub:
        raise AuthError("invalid token: sub must be a non-empty string without ':'")
    if role not in ("user", "service"):
        raise AuthError("invalid token: role must be 'user' or 'service'")
    return Principal(user_id=sub, role=role, expires_at=float(exp))


_B64URL = str.maketrans("-_", "+/")
_JSON_OBJECT = msgspec.json.Decoder(dict[str, Any])


def _segment(text: str) -> bytes:
    """A base64url segment, decoded strictly (no stray characters; padding optional)."""
    text = text.rstrip("=")
    if "=" in text or "+" in text or "/" in text:
        raise ValueError(text)
    return binascii.a2b_base64((text + "=" * (-len(text) % 4)).translate(_B64URL),
                               strict_mode=True)


def _claims(secret: str, token: str) -> dict[str, Any]:
    """The claims of ``token`` if it is an HS256 JWS signed with ``secret``."""
    parts = token.split(".")
    if len(parts) != 3:
        raise AuthError("invalid token: Not enough segments")
    try:
        header, payload, signature = (_segment(part) for part in parts)
        alg = _JSON_OBJECT.decode(header).get("alg")
    except (ValueError, binascii.Error, msgspec.DecodeError, msgspec.ValidationError):
        raise AuthError("invalid token: Invalid header or padding") from None
    if alg != ALGORITHM:
        raise AuthError("invalid token: The specified alg value is not allowed")
    signed = hmac.digest(secret.encode(), f"{parts[0]}.{parts[1]}".encode("ascii"), "sha256")
    if not hmac.compare_digest(signed, signature):
        raise AuthError("invalid token: Signature verification failed")
    try:
        claims = _JSON_OBJECT.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError):
        raise AuthError("invalid token: Invalid payload string: must be a json object") from None
    for name in ("sub", "exp"):
        if name not in claims:
            raise AuthError(f'invalid token: Token is missing the "{name}" claim')
    return claims


def bearer(authorization: str | None, query_token: str | None) -> str | None:
    """The token from an ``Authorization: Bearer`` header, else from ``?token=``."""
    if authorization:
        scheme, _, value = authorization.partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
        return None
    return query_token or None


class TokenCache:
    """Verified tokens by token string, so a client's every request does not pay for HS256.

    Bounded (the oldest entry goes first), and ``exp`` is checked again on every hit: a
    cached token is refused the moment it expires, exactly as an uncached one would be.
    Failures are not cached.
    """

    def __init__(self, secret: str, max_entries: int = 10_000) -> None:
        self._secret = secret
        self._max = max_entries
        self._verified: dict[str, Principal] = {}

    def verify(self, token: str | None) -> Principal:
        if token:
            principal = self._verified.get(token)
            if principal is not None:
                if principal.expires_at is not None and principal.expires_at <= time.time():
                    del self._verified[token]
                    raise AuthError("token expired")
                return principal
        principal = verify_token(self._secret, token)
        assert token is not None  # verify_token refuses a missing token
        if len(self._verified) >= self._max:
            del self._verified[next(iter(self._verified))]
        self._verified[token] = principal
        return principal
