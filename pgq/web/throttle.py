"""Failed token attempts, throttled per client: `/login` and `Authorization: Bearer`.

At most `limit` failures within `window` seconds from one client; then every
attempt from it is refused (429 with `Retry-After`), the right token too, until
the oldest of those failures leaves the window. A success forgets the client's
failures. A client is its address, an IPv6 one by its /64 (one host usually has
the whole /64), and every loopback address (127.0.0.0/8, ::1, ::ffff:127.x.y.z)
is one client, `loopback`: any local process may connect from any of 127/8's
sixteen million addresses. At most `max_clients` clients are remembered, the least
recently failed forgotten first, so many addresses cannot exhaust memory;
what stops a guesser with that many addresses is the token's strength
(`pgq.web.tokens`). Behind a reverse proxy every client is the proxy's
address: the limit then applies to all of them together.
"""

from __future__ import annotations

import collections
import ipaddress
import math
import threading
import time
from collections.abc import Callable

__all__ = ["Throttle", "client_of"]

LIMIT = 5
WINDOW = 60.0
MAX_CLIENTS = 10_000
LOOPBACK = "loopback"
"""The one client every loopback address is."""


def client_of(address: str | None) -> str:
    """The key failures are counted under: `loopback` for every loopback address, an
    IPv4 address, an IPv6 /64, or the text itself when it is no address (a Unix
    socket, a test)."""
    try:
        ip = ipaddress.ip_address(address or "")
    except ValueError:
        return address or ""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_loopback:
        return LOOPBACK
    if isinstance(ip, ipaddress.IPv6Address):
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


class Throttle:
    """See the module docstring; `clock` is monotonic seconds."""

    def __init__(
        self,
        limit: int = LIMIT,
        window: float = WINDOW,
        max_clients: int = MAX_CLIENTS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limit = limit
        self.window = window
        self.max_clients = max_clients
        self._clock = clock
        self._lock = threading.Lock()
        self._failures: collections.OrderedDict[str, collections.deque[float]] = (
            collections.OrderedDict()
        )

    def retry_after(self, address: str | None) -> int:
        """Whole seconds before `address` may try again; 0: it may try now."""
        key = client_of(address)
        with self._lock:
            failures = self._failures.get(key)
            if failures is None or len(failures) < self.limit:
                return 0
            wait = failures[0] + self.window - self._clock()
            if wait <= 0:
                return 0
            return max(1, math.ceil(wait))

    def failed(self, address: str | None) -> None:
        key = client_of(address)
        now = self._clock()
        with self._lock:
            failures = self._failures.pop(key, None)
            if failures is None:
                failures = collections.deque(maxlen=self.limit)
            while failures and failures[0] + self.window <= now:
                failures.popleft()
            failures.append(now)
            self._failures[key] = failures  # the most recent last
            while len(self._failures) > self.max_clients:
                self._failures.popitem(last=False)

    def succeeded(self, address: str | None) -> None:
        with self._lock:
            self._failures.pop(client_of(address), None)

    def __len__(self) -> int:
        """Clients remembered."""
        return len(self._failures)
