"""Who may change what: the admin token, login sessions, cross-site checks, Host checks.

Read-only unless `pgq web --admin`; then every change (requeue, purge) needs
either

- a login session: the operator types the token once into `/login` (a POST
  body, never a URL); the answer sets a random session id in an HttpOnly,
  SameSite=Strict cookie, and every form carries that session's CSRF token,
  which a change must send back; a request whose `Origin` is another site is
  refused even with both; or
- `Authorization: Bearer <token>` (scripts; browsers never send it on their own).

The token comes from the environment (`PGQ_WEB_TOKEN`), is compared in
constant time, and is never logged. Sessions live in memory: restarting
`pgq web` logs everyone out. The Host check refuses a request whose `Host`
header names another server (DNS rebinding: a page on an attacker's name that
resolves to 127.0.0.1) unless the app was told to listen on every interface.
"""

from __future__ import annotations

import hmac
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

__all__ = ["MIN_TOKEN_LENGTH", "TOKEN_ENV", "Guard", "Session", "host_allowed"]

TOKEN_ENV = "PGQ_WEB_TOKEN"
MIN_TOKEN_LENGTH = 16
SESSION_COOKIE = "pgq_session"
SESSION_TTL = 12 * 3600.0
LOOPBACK_NAMES = frozenset({"127.0.0.1", "localhost", "::1", "[::1]"})
EVERY_INTERFACE = frozenset({"0.0.0.0", "::", ""})


@dataclass(frozen=True, slots=True)
class Session:
    id: str
    csrf: str
    expires: float


class Guard:
    """The admin token and the sessions it opened; `token` None means read-only."""

    def __init__(
        self,
        token: str | None,
        *,
        ttl: float = SESSION_TTL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._token = token
        self._ttl = ttl
        self._clock = clock
        self._lock = threading.Lock()
        self._sessions: dict[str, Session] = {}

    @property
    def admin(self) -> bool:
        return self._token is not None

    def token_matches(self, offered: str | None) -> bool:
        if self._token is None or not offered:
            return False
        return _same_secret(offered, self._token)

    def login(self, offered: str | None) -> Session | None:
        """A new session when `offered` is the token, else None."""
        if not self.token_matches(offered):
            return None
        s = Session(secrets.token_urlsafe(32), secrets.token_urlsafe(32), self._clock() + self._ttl)
        with self._lock:
            now = self._clock()
            self._sessions = {k: v for k, v in self._sessions.items() if v.expires > now}
            self._sessions[s.id] = s
        return s

    def session(self, cookie: str | None) -> Session | None:
        if not self.admin or not cookie:
            return None
        with self._lock:
            s = self._sessions.get(cookie)
            if s is None or s.expires <= self._clock():
                self._sessions.pop(cookie, None)
                return None
            return s

    def logout(self, cookie: str | None) -> None:
        with self._lock:
            self._sessions.pop(cookie or "", None)

    def may_change(
        self,
        *,
        cookie: str | None,
        headers: Mapping[str, str],
        form_csrf: str | None,
        host: str,
    ) -> bool:
        """May this request change something? See the module docstring."""
        if not self.admin:
            return False
        auth = headers.get("Authorization", "")
        if auth.startswith("Bearer "):
            return self.token_matches(auth[len("Bearer ") :])
        s = self.session(cookie)
        if s is None or not form_csrf or not _same_secret(form_csrf, s.csrf):
            return False
        return same_origin(headers, host)


def _same_secret(offered: str, secret: str) -> bool:
    """Constant-time equality of two strings, whatever characters they hold
    (`hmac.compare_digest` raises TypeError on a non-ASCII `str`, and a token
    from the environment may hold surrogate escapes of undecodable bytes)."""
    return hmac.compare_digest(
        offered.encode(errors="surrogatepass"), secret.encode(errors="surrogatepass")
    )


def same_origin(headers: Mapping[str, str], host: str) -> bool:
    """False when the browser says the request came from another site: `Origin`
    (or, without it, `Referer`) names another host, or `Sec-Fetch-Site` is
    `cross-site`. Browsers send at least one of these on a form POST."""
    if headers.get("Sec-Fetch-Site") == "cross-site":
        return False
    source = headers.get("Origin") or headers.get("Referer")
    if not source or source == "null":
        return source is None
    return urlsplit(source).netloc == host


def host_allowed(host_header: str, listen: str, port: int) -> bool:
    """Whether a request's `Host` header names this server (see the module docstring)."""
    if listen in EVERY_INTERFACE:
        return True
    name, given_port = _split_host(host_header)
    if given_port and given_port != str(port):
        return False
    name = name.lower()
    return name == listen.lower() or (listen in LOOPBACK_NAMES and name in LOOPBACK_NAMES)


def _split_host(host_header: str) -> tuple[str, str]:
    """`name:port`, `[v6]:port` or a bare name as (name, port or "")."""
    if host_header.startswith("["):
        end = host_header.find("]")
        rest = host_header[end + 1 :]
        return host_header[: end + 1], rest[1:] if rest.startswith(":") else ""
    if host_header.count(":") == 1:
        name, port = host_header.split(":")
        return name, port
    return host_header, ""
