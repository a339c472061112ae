"""Tokens, and who may read or write which conversation."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

import jwt
import msgspec
from jwt.algorithms import HMACAlgorithm
from jwt.utils import base64url_decode, base64url_encode

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
    issued_at: float | None = None  # the token's iat, unix seconds (revocation by user)
    jti: str | None = None  # the token's id, when it has one (revocation by jti)

    @property
    def is_service(self) -> bool:
        return self.role == "service"

    def may_access(self, owner: str) -> bool:
        """Own a conversation owned by ``owner`` (a service owns them all)."""
        return self.is_service or owner == self.user_id

    def role_in(self, meta: Meta) -> str | None:
        """``owner`` (a service counts as one), ``member``, ``viewer``, or None."""
        return "owner" if self.is_service else meta.role_of(self.user_id)

    def writer(self) -> str:
        """Whom a store write must check for: the owner or a member ("" lets a service
        write anywhere). The scripts check it (``write_refused`` in lua/meta.lua)."""
        return "" if self.is_service else self.user_id

    def owner_writer(self) -> str:
        """:meth:`writer` for what only the owner may do (rename, client tools, open a
        sub-conversation, share): ``":<user>"``, since a user id has no ``:``."""
        return "" if self.is_service else ":" + self.user_id


def check_access(who: Principal, meta: Meta | None, chat_id: str) -> Meta:
    """The one access check of a read: the conversation's state if ``who`` may have it
    (its owner, a member or a viewer, a service), else ``not_found`` or ``forbidden``.
    Writes are checked by the scripts (:meth:`Principal.writer`)."""
    if meta is None:
        raise Rejected("not_found", f"conversation {chat_id!r} does not exist")
    if who.role_in(meta) is None:
        raise Rejected("forbidden", "you may not access this conversation")
    return meta


def check_owner(who: Principal, meta: Meta | None, chat_id: str) -> Meta:
    """:func:`check_access` for what only the owner (or a service) may do: delete."""
    found = check_access(who, meta, chat_id)
    if who.role_in(found) != "owner":
        raise Rejected("forbidden", "only the owner may do this")
    return found


def issue_token(secret: str, sub: str, role: Role = "user", ttl: float = 3600.0) -> str:
    now = int(time.time())
    claims: dict[str, object] = {"sub": sub, "iat": now, "exp": now + int(ttl)}
    if role != "user":
        claims["role"] = role
    return jwt.encode(claims, secret, algorithm=ALGORITHM)


def verify_token(secret: str, token: str | None) -> Principal:
    """PyJWT's check of an HS256 token (``sub`` and ``exp`` required), then the gateway's
    rules on ``sub`` and ``role``: the one definition of a good token."""
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
    jti = claims.get("jti")
    return _principal(claims.get("sub"), claims.get("role", "user"), claims["exp"],
                      claims.get("iat"), jti if isinstance(jti, str) else None)


def _principal(sub: object, role: object, exp: object, iat: object = None,
               jti: str | None = None) -> Principal:
    if not isinstance(sub, str) or not sub or len(sub) > 128 or ":" in sub:
        raise AuthError("invalid token: sub must be a non-empty string without ':'")
    if role not in ("user", "service"):
        raise AuthError("invalid token: role must be 'user' or 'service'")
    try:
        expires_at = float(exp)  # type: ignore[arg-type]  # PyJWT checked int(exp)
    except OverflowError:
        raise AuthError("invalid token: exp out of range") from None
    issued_at = float(iat) if isinstance(iat, int | float) and not isinstance(iat, bool) \
        else None
    return Principal(user_id=sub, role=role, expires_at=expires_at, issued_at=issued_at,
                     jti=jti)


class _Header(msgspec.Struct, forbid_unknown_fields=True):
    alg: str
    typ: str | msgspec.UnsetType = msgspec.UNSET


class _Claims(msgspec.Struct, forbid_unknown_fields=True):
    """The claims the gateway and its SDKs put in a token; a token with any other claim
    (``aud``, ``jti``, ...) or another type takes PyJWT's whole path."""

    sub: str
    exp: int
    role: str = "user"
    iat: int | msgspec.UnsetType = msgspec.UNSET
    nbf: int | msgspec.UnsetType = msgspec.UNSET


_SEGMENT = re.compile(r"[A-Za-z0-9_-]+")  # unpadded base64url
_HEADER = msgspec.json.Decoder(_Header)
_CLAIMS = msgspec.json.Decoder(_Claims)


def _segment(text: str) -> bytes | None:
    """The bytes of one unpadded, canonically encoded base64url segment, else None."""
    if len(text) % 4 == 1 or _SEGMENT.fullmatch(text) is None:
        return None
    data = base64url_decode(text)
    # Unused low bits must be zero: any other spelling of the same bytes is refused.
    return data if base64url_encode(data) == text.encode() else None


class TokenVerifier:
    """:func:`verify_token`, fast for the tokens a gateway sees by the thousand.

    A reconnect storm is thousands of distinct tokens at once, and PyJWT's generic path
    costs about 30 µs each (a per-character check of every segment, the key's PEM, SSH,
    DER and JWK checks on every call): the largest single part of a handshake. A token in
    the shape :func:`issue_token` and the SDKs make (unpadded base64url, header
    ``{"alg": "HS256"}`` with an optional ``typ``, the claims of :class:`_Claims`) is
    checked here instead, in about 7 µs: the signature by PyJWT's own HMAC algorithm
    with the key it prepared once, the claims as PyJWT checks them (``exp`` passed,
    ``iat`` and ``nbf`` not ahead). Any other token, and every token that fails a check
    here, goes to :func:`verify_token`: PyJWT decides it and gives the reason.
    """

    __slots__ = ("_hmac", "_key", "_secret")

    def __init__(self, secret: str) -> None:
        self._secret = secret
        self._hmac = HMACAlgorithm(HMACAlgorithm.SHA256)
        try:
            self._key: bytes | None = self._hmac.prepare_key(secret)
        except jwt.PyJWTError:  # a key PyJWT refuses: it refuses every token, with why
            self._key = None

    def verify(self, token: str | None) -> Principal:
        principal = self._fast(token) if token else None
        return principal if principal is not None else verify_token(self._secret, token)

    def _fast(self, token: str) -> Principal | None:
        parts = token.split(".")
        if len(parts) != 3 or self._key is None:
            return None
        header, payload, signature = (_segment(part) for part in parts)
        if header is None or payload is None or signature is None:
            return None
        try:
            if _HEADER.decode(header).alg != ALGORITHM:
                return None
            claims = _CLAIMS.decode(payload)
        except msgspec.DecodeError:
            return None
        signed = token[: len(parts[0]) + 1 + len(parts[1])].encode()
        if not self._hmac.verify(signed, self._key, signature):
            return None
        now = time.time()
        if (claims.exp <= now or (claims.iat is not msgspec.UNSET and claims.iat > now)
                or (claims.nbf is not msgspec.UNSET and claims.nbf > now)):
            return None
        try:
            return _principal(claims.sub, claims.role, claims.exp,
                              None if claims.iat is msgspec.UNSET else claims.iat)
        except AuthError:
            return None


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
        self._verifier = TokenVerifier(secret)
        self._max = max_entries
        self._verified: dict[str, Principal] = {}
        # Revocations (gateway.revocation), checked on every verification, hits included.
        self.revoked: Callable[[Principal], bool] = lambda who: False

    def verify(self, token: str | None) -> Principal:
        if token:
            principal = self._verified.get(token)
            if principal is not None:
                if principal.expires_at is not None and principal.expires_at <= time.time():
                    del self._verified[token]
                    raise AuthError("token expired")
                if self.revoked(principal):
                    raise AuthError("token revoked")
                return principal
        principal = self._verifier.verify(token)
        if self.revoked(principal):
            raise AuthError("token revoked")
        assert token is not None  # verify_token refuses a missing token
        if len(self._verified) >= self._max:
            del self._verified[next(iter(self._verified))]
        self._verified[token] = principal
        return principal
