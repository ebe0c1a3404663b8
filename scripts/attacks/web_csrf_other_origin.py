"""CSRF from another origin: a second local web server serves a form that posts to the
dashboard; the form is submitted the way a browser would submit it.

The victim is logged in (a session cookie for 127.0.0.1). The attacker's page is
served by a second HTTP server on 127.0.0.1 (another port: the same *site*, so a
SameSite=Strict cookie still goes along) or under another name (cross-site: the
cookie stays home). The script fetches the attacker's page, parses its form and
submits it with the headers a browser sends for that case (`Cookie` where the
browser would send it, `Origin`, `Referer`, `Sec-Fetch-Site`, `Sec-Fetch-Mode`),
for requeue and for purge, plus a `fetch()`-style variant (no-cors: `Origin`
only). It also checks that no page offers CORS (so the attacker's script cannot
read a CSRF token out of a dashboard page).

Expected: every submission refused (403), nothing written (no audit row, rows
still dead); the same form with the victim's own CSRF token and the dashboard's
own origin goes through (the control). Run:
.venv/bin/python scripts/attacks/web_csrf_other_origin.py (~5 s). Exit 1 on a
defect, 0 when it holds.
"""

import html.parser
import http.server
import threading
import urllib.parse
import urllib.request

from _common import Schema, states, verdict
from _web import TOKEN, csrf_of, dashboard, login, request
from sqlalchemy import text

import pgq
from pgq import monitor


class Forms(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.forms: list[dict[str, object]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "form":
            self.forms.append({"action": a.get("action"), "fields": {}})
        elif tag == "input" and self.forms and a.get("name"):
            self.forms[-1]["fields"][a["name"]] = a.get("value") or ""  # type: ignore[index]


def attacker_site(page: str) -> http.server.ThreadingHTTPServer:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = page.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    site = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=site.serve_forever, daemon=True).start()
    return site


problems: list[str] = []
with Schema("webcsrf2") as s:
    pgq.create_topic(s.engine, "t")
    pgq.subscribe(s.engine, "g", "t")
    ids = pgq.publish_many(s.engine, "t", [{"n": i} for i in range(3)])
    with s.engine.begin() as conn:
        conn.execute(
            text(
                f"UPDATE \"{s.name}\".delivery SET state = 'dead', error_class = 'message',"
                " attempts = 5, last_error = 'x'"
            )
        )
    with dashboard(s, token=TOKEN) as server:
        target = server.url.rstrip("/")
        cookie = login(server.url)  # the victim's session
        for action in ("requeue", "purge"):
            page = (
                "<html><body><form method=post"
                f' action="{target}/groups/g/{action}">'
                f'<input name="ids" value="{ids[0]}"><input name="all" value="1">'
                '<input name="reason" value="csrf"><input name="csrf" value="">'
                "</form><script>document.forms[0].submit()</script></body></html>"
            )
            site = attacker_site(page)
            here = f"http://127.0.0.1:{site.server_address[1]}"
            try:
                fetched = urllib.request.urlopen(f"{here}/attack.html", timeout=10).read()
                parser = Forms()
                parser.feed(fetched.decode())
                [form] = parser.forms
                path = urllib.parse.urlsplit(str(form["action"])).path
                fields = dict(form["fields"])  # type: ignore[call-overload]
                browsers = {
                    "same-site form (another port)": {
                        "Cookie": cookie,
                        "Origin": here,
                        "Referer": f"{here}/attack.html",
                        "Sec-Fetch-Site": "same-site",
                        "Sec-Fetch-Mode": "navigate",
                    },
                    "cross-site form (another name)": {
                        "Origin": "http://evil.example",
                        "Referer": "http://evil.example/attack.html",
                        "Sec-Fetch-Site": "cross-site",
                        "Sec-Fetch-Mode": "navigate",
                    },
                    "same-site fetch, no-cors": {
                        "Cookie": cookie,
                        "Origin": here,
                        "Sec-Fetch-Site": "same-site",
                        "Sec-Fetch-Mode": "no-cors",
                    },
                    "same-site form, an old browser (no Origin, no Sec-Fetch)": {
                        "Cookie": cookie,
                        "Referer": f"{here}/attack.html",
                    },
                    "same-site form, referrer policy no-referrer": {"Cookie": cookie},
                }
                for name, headers in browsers.items():
                    answer = request(server.url, "POST", path, form=fields, headers=headers)
                    if answer.status != 403:
                        problems.append(f"{action}, {name}: HTTP {answer.status}")
            finally:
                site.shutdown()
        for path in ("/", "/groups/g", "/groups/g?live=1"):
            answer = request(
                server.url, "GET", path, headers={"Cookie": cookie, "Origin": "http://evil.example"}
            )
            if answer.header("Access-Control-Allow-Origin"):
                problems.append(
                    f"GET {path} offers CORS: {answer.header('Access-Control-Allow-Origin')}"
                )
        if monitor.audit(s.engine, "g") or states(s, "g") != {"dead": 3}:
            problems.append(f"written: {monitor.audit(s.engine, 'g')}, {states(s, 'g')}")
        # the control: the victim's own form, from the dashboard's own page
        own = request(
            server.url,
            "POST",
            "/groups/g/requeue",
            form={"ids": str(ids[0]), "reason": "own", "csrf": csrf_of(server.url, cookie, "g")},
            headers={"Cookie": cookie, "Origin": target, "Sec-Fetch-Site": "same-origin"},
        )
        if own.status != 200:
            problems.append(f"the control (own form) was refused: HTTP {own.status}")
verdict(problems, "forms from another origin are refused and write nothing")
