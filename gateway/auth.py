"""Tokens, and who may read or write which conversation."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Literal

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
    if not token:
        raise AuthError("missing token")
    try:
        claims = jwt.decode(
            token, secret, algorithms=[ALGORITHM], options={"require": ["sub", "exp"]}
        )
    except jwt.ExpiredSignatureError:
        raise AuthError("token expired") from None
    except jwt.PyJWTError as exc:
        raise AuthError(f"invalid token: {exc}") from None
    sub, role = claims.get("sub"), claims.get("role", "user")
    if not isinstance(sub, str) or not sub or len(sub) > 128 or ":" in sub:
        raise AuthError("invalid token: sub must be a non-empty string without ':'")
    if role not in ("user", "service"):
        raise AuthError("invalid token: role must be 'user' or 'service'")
    return Principal(user_id=sub, role=role, expires_at=float(claims["exp"]))


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
