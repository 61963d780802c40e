"""Who may act: the bearer token of `[web] admin_token_file`, and browser sessions.

API calls carry ``Authorization: Bearer <token>``; a browser cannot be made to send
that header cross-site, so the API needs no other protection against request forgery.

The pages ask for the token once (POST /login) and set a session cookie:
``<nonce>.<expiry>.<mac>``, where mac = HMAC-SHA256(token, "session" nonce expiry).
The cookie is HttpOnly and SameSite=Strict. Every action form also carries a CSRF
field, HMAC(token, "csrf" nonce), that a page of another site cannot read, and a POST
whose Origin header names another origin is refused whatever it carries. Nothing is
stored server-side: changing the token file (and restarting) ends every session.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

from pgjobd.errors import ConfigError

SESSION_COOKIE = "pgjobd_session"
SESSION_S = 12 * 3600
MIN_TOKEN_CHARS = 16


def read_token(path: Path) -> str:
    """The token in `path` (surrounding whitespace dropped); ConfigError naming the key."""
    where = "web.admin_token_file"
    try:
        token = path.read_text(encoding="utf-8").strip()
    except OSError as e:
        raise ConfigError(f"{where}: cannot read {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{where}: cannot read {path}: not UTF-8") from None
    if len(token) < MIN_TOKEN_CHARS:
        raise ConfigError(
            f"{where}: the token in {path} is {len(token)} characters; use at least "
            f"{MIN_TOKEN_CHARS} (for example: python3 -c 'import secrets; "
            "print(secrets.token_urlsafe(32))')"
        )
    return token


@dataclass(frozen=True)
class Session:
    nonce: str
    csrf: str


class Guard:
    """Checks tokens, sessions and CSRF fields against one admin token (None: the
    console is read-only and every action is refused)."""

    def __init__(self, token: str | None) -> None:
        self.token = token

    @property
    def read_only(self) -> bool:
        return self.token is None

    def bearer_ok(self, header: str) -> bool:
        """Whether an Authorization header value carries the token."""
        scheme, _, given = header.partition(" ")
        return (
            self.token is not None
            and scheme.lower() == "bearer"
            and hmac.compare_digest(given.strip().encode(), self.token.encode())
        )

    def token_ok(self, given: str) -> bool:
        return self.token is not None and hmac.compare_digest(
            given.strip().encode(), self.token.encode()
        )

    def new_cookie(self, now: float | None = None) -> str:
        nonce = secrets.token_urlsafe(16)
        expiry = int((time.time() if now is None else now) + SESSION_S)
        return f"{nonce}.{expiry}.{self._mac('session', nonce, str(expiry))}"

    def session(self, cookie: str | None, now: float | None = None) -> Session | None:
        """The session a cookie value proves, or None (absent, forged, expired)."""
        if self.token is None or not cookie:
            return None
        parts = cookie.split(".")
        if len(parts) != 3 or not parts[1].isdigit():
            return None
        nonce, expiry, mac = parts
        if not hmac.compare_digest(mac, self._mac("session", nonce, expiry)):
            return None
        if int(expiry) < (time.time() if now is None else now):
            return None
        return Session(nonce=nonce, csrf=self._mac("csrf", nonce))

    def csrf_ok(self, session: Session, given: str) -> bool:
        return hmac.compare_digest(given.encode(), session.csrf.encode())

    def _mac(self, *parts: str) -> str:
        assert self.token is not None
        message = "\0".join(parts).encode()
        return hmac.new(self.token.encode(), message, hashlib.sha256).hexdigest()
