"""A logged-in form post whose CSRF field holds a non-ASCII character is a 500, not a 403.

What it shows: `Guard.may_change` compared the posted CSRF token with
`hmac.compare_digest(str, str)`, which raises `TypeError: comparing strings
with non-ASCII characters is not supported`; Flask turned that into HTTP 500
and logged a traceback. Nothing was written, but the refusal of a forged or
mangled form must be the 403 every other refusal is. The same held for the
admin token at `/login` when `$PGQ_WEB_TOKEN` held bytes that are not UTF-8.

Run: .venv/bin/python scripts/attacks/web_csrf_non_ascii.py (~3 s). Exit 1
while the defect exists, 0 once fixed (fixed in pgq/web/guard.py: both sides
are compared as bytes). Severity: robustness (error page, traceback in the log).
"""

from _common import Schema, verdict
from _web import TOKEN, dashboard, login, request

import pgq

problems = []
with Schema("webcsrf") as s:
    pgq.create_topic(s.engine, "t")
    pgq.subscribe(s.engine, "g", "t")
    with dashboard(s, token=TOKEN) as server:
        cookie = login(server.url)
        if not cookie:
            problems.append("login with the right token set no cookie")
        for csrf in ("é", "\u202e", "名前", "x" * 40 + "ü"):
            for path in ("/groups/g/requeue", "/groups/g/purge"):
                answer = request(
                    server.url,
                    "POST",
                    path,
                    form={"csrf": csrf, "ids": "1", "reason": "x"},
                    headers={"Cookie": cookie},
                )
                if answer.status != 403:
                    problems.append(f"POST {path} with csrf={csrf!r}: HTTP {answer.status}")
verdict(problems, "a non-ASCII CSRF field is refused with 403")
