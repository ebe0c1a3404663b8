"""Who may change what: admin tokens, login sessions, cross-site checks, Host checks.

Read-only unless `pgq web --admin`; then every change (requeue, purge) needs
either

- a login session: the operator types their token once into `/login` (a POST
  body, never a URL); the answer sets a random session id in an HttpOnly,
  SameSite=Strict cookie, and every form carries that session's CSRF token,
  which a change must send back; a request whose `Origin` is another site is
  refused even with both; or
- `Authorization: Bearer <token>` (scripts; browsers never send it on their own).

Each token is one person's (`pgq.web.tokens`): a change is recorded as done by
the person whose token opened the session or came with the request. Tokens are
compared in constant time and never logged; failed attempts are throttled per
client (`pgq.web.throttle`: `Throttled`). Sessions live in memory: restarting
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

from pgq.web.throttle import Throttle
from pgq.web.tokens import DEFAULT_USER

__all__ = ["Guard", "Session", "Throttled", "host_allowed", "same_origin"]

SESSION_COOKIE = "pgq_session"
SESSION_TTL = 12 * 3600.0
LOOPBACK_NAMES = frozenset({"127.0.0.1", "localhost", "::1", "[::1]"})
EVERY_INTERFACE = frozenset({"0.0.0.0", "::", ""})


@dataclass(frozen=True, slots=True)
class Session:
    id: str
    csrf: str
    expires: float
    user: str
    """The person whose token opened it."""


class Throttled(Exception):
    """Too many failed token attempts from this client: try again in `retry_after` s."""

    def __init__(self, retry_after: int) -> None:
        super().__init__(f"too many failed attempts: try again in {retry_after} s")
        self.retry_after = retry_after


class Guard:
    """The admin tokens (person -> token) and the sessions they opened; None means
    read-only, and a single token string is the person `admin`'s."""

    def __init__(
        self,
        users: Mapping[str, str] | str | None,
        *,
        ttl: float = SESSION_TTL,
        clock: Callable[[], float] = time.monotonic,
        throttle: Throttle | None = None,
    ) -> None:
        if isinstance(users, str):
            users = {DEFAULT_USER: users}
        self._users = dict(users) if users is not None else None
        self._ttl = ttl
        self._clock = clock
        self.throttle = throttle or Throttle(clock=clock)
        self._lock = threading.Lock()
        self._sessions: dict[str, Session] = {}

    @property
    def admin(self) -> bool:
        return self._users is not None

    def user_of(self, offered: str | None) -> str | None:
        """The person whose token `offered` is, or None (every token compared, each
        in constant time)."""
        if not self._users or not offered:
            return None
        found = None
        for user, token in self._users.items():
            if _same_secret(offered, token):
                found = user
        return found

    def _attempt(self, offered: str | None, address: str | None) -> str | None:
        """`user_of(offered)`, throttled per client `address` (raises `Throttled`)."""
        wait = self.throttle.retry_after(address)
        if wait:
            raise Throttled(wait)
        user = self.user_of(offered)
        if user is None:
            self.throttle.failed(address)
        else:
            self.throttle.succeeded(address)
        return user

    def login(self, offered: str | None, address: str | None = None) -> Session | None:
        """A new session when `offered` is a person's token, else None; `Throttled`
        after too many failures from `address`."""
        if not self.admin:
            return None
        user = self._attempt(offered, address)
        if user is None:
            return None
        s = Session(
            secrets.token_urlsafe(32), secrets.token_urlsafe(32), self._clock() + self._ttl, user
        )
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

    def changer(
        self,
        *,
        cookie: str | None,
        headers: Mapping[str, str],
        form_csrf: str | None,
        host: str,
        address: str | None = None,
    ) -> str | None:
        """The person this request changes something as, or None when it may not
        (see the module docstring); `Throttled` for a Bearer token from a client
        `address` with too many failures."""
        if not self.admin:
            return None
        auth = headers.get("Authorization", "")
        if auth.startswith("Bearer "):
            return self._attempt(auth[len("Bearer ") :], address)
        s = self.session(cookie)
        if s is None or not form_csrf or not _same_secret(form_csrf, s.csrf):
            return None
        return s.user if same_origin(headers, host) else None


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
