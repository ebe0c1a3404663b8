"""`HEAD /login` was answered as a failed login (403, "that is not the token").

The login route served its form for `GET` and treated every other method as
the form's POST, so a `HEAD` (link checkers, monitors, `curl -I`) ran a login
with no token. Expected: `HEAD /login` answers as `GET /login` (200). Exits 1
while the defect exists.
"""

from __future__ import annotations

import sys

from _common import Schema
from _web import TOKEN, dashboard, request


def main() -> int:
    s = Schema("web2_head_login")
    try:
        with dashboard(s, token=TOKEN) as server:
            head = request(server.url, "HEAD", "/login").status
            get = request(server.url, "GET", "/login").status
    finally:
        s.close()
    if head != get:
        print(f"DEFECT: HEAD /login {head}, GET /login {get}")
        return 1
    print("held: HEAD /login answers as GET")
    return 0


if __name__ == "__main__":
    sys.exit(main())
