"""The dashboard's HTTP side: routes, templates, errors, security headers.

`create_app(dashboard, guard, ...)` returns a Flask app (a WSGI callable that
`pgq.web.server` serves with waitress). Pages are Jinja templates with
autoescape on, and every string the templates print first goes through
`visible` (control and format characters escaped, as the CLI prints them), so
names, payloads and error texts can neither inject markup nor hide or forge
text; only hidden fields' values are printed as they are (`exact`), escaped
and with character references.
A page asked with `?live=1` answers only its live part, which `static/live.js`
swaps in every `refresh` seconds.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
from dataclasses import replace
from typing import Any

from flask import (
    Flask,
    Response,
    abort,
    jsonify,
    make_response,
    redirect,
    render_template,
    request,
    url_for,
)
from markupsafe import Markup, escape
from werkzeug.exceptions import HTTPException

from pgq.cli.parse import parse_age, parse_ids, parse_message_id
from pgq.cli.render import ago, message_lines, visible
from pgq.errors import DatabaseUnavailable, PgqError, UnknownGroup, UsageError
from pgq.metrics import exposition
from pgq.read_models import iso
from pgq.records import MessageFilter, RowState
from pgq.schema import ERROR_CLASSES
from pgq.store import admin as store_admin
from pgq.store import lifecycle as store_lifecycle
from pgq.web.charts import chart, seconds_label, seconds_ticks, sparkline
from pgq.web.guard import SESSION_COOKIE, Guard, Throttled, host_allowed, same_origin
from pgq.web.query import PAGE_SIZES, filter_args, parse_filter, parse_position
from pgq.web.views import Dashboard

__all__ = ["create_app"]

logger = logging.getLogger(__name__)

CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
MAX_BODY = 256 * 1024
"""Bytes a request body may have: a requeue form with 10,000 ids fits (the ids one
audit row lists), whatever their size: 10,000 ticked 19-digit ids, `ids=…&`
each, are 240,000 bytes."""
LIVE_PAGES = frozenset({"overview.html", "group.html", "message.html"})
"""The pages with a live part (`_<page>`); `?live=1` on any other answers the page
(it was a 500 after the change was made; docs/defects.md)."""
WINDOWS = {"auto": None, "1m": 60.0, "5m": 300.0, "1h": 3600.0, "24h": 86400.0}
"""The breaker timeline's spans a group page offers (`?window=`)."""
SPANS = {"1h": 3600.0, "24h": 86400.0}
"""The spans a group page's charts offer (`?span=`; the samples are kept a day)."""


def _finalize(value: Any) -> Any:
    """Every `{{ value }}`: markup we built stays; text is made visible, then escaped."""
    if isinstance(value, Markup) or not isinstance(value, str):
        return value
    return visible(value)


def _exact(value: Any) -> Markup:
    """`{{ value|exact }}`: a hidden field's value as it is, not made `visible`: the
    bulk forms carry the filter the page searched with, and an escaped tab (`\\t`)
    would search for other rows. Escaped, and every character that is not
    printable written as a character reference (`&#9;`), so the page holds none
    raw; the browser sends the character itself back. (HTML reads the references
    of C1 controls as Windows-1252 characters, and a browser sends a line break
    as CR LF: those alone do not come back as they were.)"""
    text = str(escape(str(value)))
    return Markup("".join(c if c.isprintable() else f"&#{ord(c)};" for c in text))


def _duration(seconds: float) -> str:
    """`300` -> `5 min`, `3600` -> `1 h`, `86400` -> `24 h`."""
    if seconds >= 3600:
        return f"{seconds / 3600:.3g} h"
    return f"{seconds / 60:.3g} min"


def _when(ts: dt.datetime | str | None, now: dt.datetime) -> Markup:
    """`ts` relative to `now` (`3 min ago`), the absolute time on hover: a `<time>`
    whose `title` and `datetime` are the UTC ISO 8601 text."""
    if ts is None:
        return Markup("–")
    text = ts if isinstance(ts, str) else (iso(ts) or "")
    return Markup('<time datetime="{0}" title="{0}">{1}</time>').format(visible(text), ago(ts, now))


def _input_time(ts: dt.datetime | None) -> str:
    """`ts` in UTC as an `<input type="datetime-local">` value ("" for None)."""
    if ts is None:
        return ""
    return ts.astimezone(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S")


def _pretty(value: Any) -> Markup:
    """JSON indented for a `<pre>`: each line made visible and escaped."""
    text = json.dumps(value, indent=2, ensure_ascii=False, sort_keys=True)
    return Markup("\n").join(visible(line) for line in text.splitlines())


def create_app(dashboard: Dashboard, guard: Guard, *, host: str, port: int) -> Flask:
    """The dashboard app for `dashboard`'s database; `guard` says who may change things,
    `host`/`port` what it listens on (for the Host check)."""
    app = Flask(__name__)
    # forms are a few fields: a bigger body is refused (413) before it is read
    app.config["MAX_CONTENT_LENGTH"] = MAX_BODY
    app.config["MAX_FORM_MEMORY_SIZE"] = MAX_BODY
    app.jinja_env.finalize = _finalize
    app.jinja_env.filters["exact"] = _exact
    app.jinja_env.globals.update(
        ago=ago,
        when=_when,
        input_time=_input_time,
        duration=_duration,
        sparkline=sparkline,
        chart=chart,
        seconds_label=seconds_label,
        seconds_ticks=seconds_ticks,
        spans=SPANS,
        admin=guard.admin,
        refresh_ms=int(dashboard.options.refresh * 1000),
        error_classes=ERROR_CLASSES,
        row_states=tuple(s.value for s in RowState),
        page_sizes=PAGE_SIZES,
        windows=WINDOWS,
        pretty=_pretty,
    )

    def session() -> Any:
        return guard.session(request.cookies.get(SESSION_COOKIE))

    @app.context_processor
    def _user() -> dict[str, Any]:
        s = session()
        return {
            "logged_in": s is not None,
            "csrf": s.csrf if s else "",
            "user": s.user if s else "",
        }

    @app.before_request
    def _check_host() -> Any:
        if not host_allowed(request.host, host, port):
            return _page("error.html", 400, title="Bad request", text="unexpected Host header")
        return None

    @app.after_request
    def _headers(resp: Response) -> Response:
        resp.headers["Content-Security-Policy"] = CSP
        resp.headers["X-Content-Type-Options"] = "nosniff"
        resp.headers["X-Frame-Options"] = "DENY"
        resp.headers["Referrer-Policy"] = "same-origin"
        resp.headers.setdefault("Cache-Control", "no-store")
        return resp

    @app.errorhandler(PgqError)
    def _pgq_error(exc: PgqError) -> Any:
        code = 503 if isinstance(exc, DatabaseUnavailable) else 500
        if isinstance(exc, UnknownGroup):
            code = 404
        elif isinstance(exc, UsageError):
            code = 400
        if code == 500:  # a 503's streak is logged by the dashboard, once
            logger.warning("web request failed path=%r error=%r", request.path, str(exc))
        if request.path.startswith("/api/") or request.path == "/healthz":
            return jsonify({"error": visible(str(exc))}), code
        return _page("error.html", code, title=_TITLES[code], text=str(exc))

    @app.errorhandler(Throttled)
    def _throttled(exc: Throttled) -> Any:
        text = f"too many failed token attempts from your address: try again in {exc.retry_after} s"
        resp = _page("error.html", 429, title="Too many attempts", text=text)
        resp.headers["Retry-After"] = str(exc.retry_after)
        return resp

    @app.errorhandler(HTTPException)
    def _http_error(exc: HTTPException) -> Any:
        code = exc.code or 500
        if request.path.startswith("/api/"):
            return jsonify({"error": exc.description}), code
        return _page("error.html", code, title=exc.name, text=exc.description or "")

    def _page(template: str, code: int = 200, **values: Any) -> Response:
        if request.args.get("live") == "1" and code == 200 and template in LIVE_PAGES:
            template = "_" + template
        return make_response(render_template(template, **values), code)

    # --- pages ------------------------------------------------------------------

    @app.get("/")
    def overview() -> Any:
        if dashboard.options.group and request.args.get("all") is None:
            return redirect(url_for("group", name=dashboard.options.group), 303)
        return _page("overview.html", data=dashboard.overview())

    @app.get("/groups/<name>")
    def group(name: str) -> Any:
        cls = request.args.get("class") or None
        if cls is not None:
            # the dead list this filtered is the messages page now: old links go there
            if cls not in ERROR_CLASSES:
                abort(400, f"unknown error class (use one of {', '.join(ERROR_CLASSES)})")
            where: dict[str, Any] = {"state": "dead", "class": cls}
            return redirect(url_for("messages", name=name, **where), 303)
        window = WINDOWS.get(request.args.get("window", "auto"))
        if window is None and request.args.get("window", "auto") != "auto":
            abort(400, f"unknown window (use one of {', '.join(WINDOWS)})")
        span = request.args.get("span", "1h")
        if span not in SPANS:
            abort(400, f"unknown span (use one of {', '.join(SPANS)})")
        data = dashboard.group(name, window, SPANS[span])
        data["window"] = request.args.get("window", "auto")
        data["span"] = span
        done = request.args.get("done", type=int)
        result = next((a for a in data["audit"] if a["id"] == done), None)
        nothing = request.args.get("none")
        if result is None and nothing in ("requeue", "purge"):
            result = {"action": nothing, "count": 0, "id": None}  # a change that changed nothing
        kept = max(request.args.get("kept", 0, type=int) or 0, 0)
        return _page("group.html", name=name, data=data, result=result, kept=kept)

    @app.get("/groups/<name>/messages")
    def messages(name: str) -> Any:
        """A group's messages by filter, a keyset page at a time (`pgq.web.query`)."""
        f = parse_filter(request.args)
        position = parse_position(request.args)
        data = dashboard.messages(name, f, position)
        args = {**filter_args(f), **position.args()}
        return _page("messages.html", name=name, data=data, f=f, position=position, args=args)

    @app.get("/topics")
    def topics() -> Any:
        """Every topic, as `pgq topics` prints it, with its groups."""
        removed = request.args.get("removed") or None
        done = request.args.get("done", type=int)
        result = None
        if removed is not None and done is not None:
            # what was done is read back from the audit trail (a link cannot make the
            # page say something that did not happen); a bad name is no result
            try:
                trail = dashboard.audit_of(removed)
            except (UsageError, UnknownGroup):
                trail = []
            result = next(
                (a for a in trail if a["id"] == done and a["action"] == "unsubscribe"), None
            )
        return _page("topics.html", data=dashboard.topics(), removed=removed, result=result)

    @app.get("/groups/<name>/messages/<message_id>")
    def message(name: str, message_id: str) -> Any:
        try:
            mid = parse_message_id(message_id)
        except UsageError as exc:
            abort(404, str(exc))
        try:
            data = dashboard.message(name, mid)
        except UnknownGroup:
            raise
        except UsageError as exc:
            abort(404, str(exc))
        return _page("message.html", name=name, data=data, lines=message_lines(data["message"]))

    # --- JSON -------------------------------------------------------------------

    @app.get("/api/groups")
    def api_groups() -> Any:
        return jsonify(dashboard.status(None).to_json())

    @app.get("/api/groups/<name>")
    def api_group(name: str) -> Any:
        return jsonify(dashboard.status(name).to_json())

    @app.get("/favicon.ico")
    def favicon() -> Any:
        """What a browser asks for on a page that names no icon (the JSON ones)."""
        return app.send_static_file("favicon.svg")

    @app.get("/healthz")
    def healthz() -> Any:
        dashboard.health()  # raises DatabaseUnavailable: 503
        return jsonify({"ok": True})

    @app.get("/metrics")
    def metrics() -> Any:
        """Every group's state in the Prometheus text format, from one `status_all` read
        (`pgq.metrics.group_families`); like every read, no login needed."""
        groups = dashboard.status_all().groups
        body, content_type = exposition(groups, request.headers.get("Accept", ""))
        return Response(body, content_type=content_type)

    # --- changes (admin) --------------------------------------------------------

    def _actor() -> str:
        """Who makes this change, as the audit row records it (`alice (pgq web)`)."""
        if not guard.admin:
            abort(403, "this dashboard is read-only (start pgq web with --admin)")
        user = guard.changer(
            cookie=request.cookies.get(SESSION_COOKIE),
            headers=dict(request.headers),
            form_csrf=request.form.get("csrf"),
            host=request.host,
            address=request.remote_addr,
        )
        if user is None:
            abort(403, "log in with your admin token first (or the form is stale or cross-site)")
        return f"{user} (pgq web)"

    def _reason() -> str:
        reason = request.form.get("reason", "")
        if not reason.strip():
            abort(400, "a reason is required")
        return reason

    def _selected() -> list[int]:
        """The ids a form names: `ids` fields (checkboxes), each also a list of ids
        separated by spaces or commas (the typed field)."""
        return parse_ids(" ".join(request.form.getlist("ids")).split())

    def _matching() -> MessageFilter | None:
        """The filter of an "every dead row that matches" form (`match=1`), its
        `upto` and `changed` required (the confirmation fixed them), else None."""
        if request.form.get("match") != "1":
            return None
        f = parse_filter(request.form)
        if f.up_to is None or f.changed_by is None:
            abort(400, "a change of every row that matches needs the confirmation's bounds")
        return f

    @app.post("/groups/<name>/requeue")
    def requeue(name: str) -> Any:
        actor = _actor()
        reason = _reason()
        cls = request.form.get("class") or None
        matching = _matching()
        if matching is not None:
            result = store_admin.requeue(
                dashboard.engine, name, all_dead=True, matching=matching, reason=reason, actor=actor
            )
        elif request.form.get("all") == "1":
            result = store_admin.requeue(
                dashboard.engine, name, all_dead=True, error_class=cls, reason=reason, actor=actor
            )
        else:
            ids = _selected()
            if not ids:
                abort(400, "give the message ids to requeue, or tick 'every dead row'")
            result = store_admin.requeue(dashboard.engine, name, ids, reason=reason, actor=actor)
        text = f"requeued {result.count}{_audited(result.audit_id)}"
        return _done(name, "requeue", text, result.audit_id)

    @app.post("/groups/<name>/purge")
    def purge(name: str) -> Any:
        actor = _actor()
        reason = _reason()
        older = request.form.get("older_than", "").strip()
        ids = _selected() or None
        matching = _matching()
        if ids is not None and matching is not None:
            abort(400, "purge either the rows selected or every row that matches")
        result = store_admin.purge(
            dashboard.engine,
            name,
            older_than=parse_age(older) if older else None,
            ids=ids,
            matching=matching,
            reason=reason,
            max_refunds=dashboard.options.max_refunds,
            actor=actor,
        )
        kept = f", kept {result.kept} pending reconciliation" if result.kept else ""
        text = f"purged {result.count}{kept}{_audited(result.audit_id)}"
        return _done(name, "purge", text, result.audit_id, kept=result.kept)

    @app.post("/groups/<name>/messages/confirm")
    def confirm(name: str) -> Any:
        """What a bulk requeue or purge from the messages page would do, before it is
        done: how many dead rows, and the form (a reason required) that does it.
        Admin only, as the change itself: it names rows to change."""
        _actor()
        action = request.form.get("action")
        if action not in ("requeue", "purge"):
            abort(400, "choose requeue or purge")
        f = parse_filter(request.form)
        dead = replace(f, state=RowState.DEAD.value)
        if request.form.get("scope") == "filter":
            count, fixed = dashboard.count(name, dead)
            return _page(
                "confirm.html",
                name=name,
                action=action,
                count=count,
                ids=None,
                match=filter_args(fixed) if fixed else None,
                back=filter_args(f),
            )
        ids = _selected()
        if not ids:
            abort(400, "tick the rows to change, or choose every row that matches")
        return _page(
            "confirm.html",
            name=name,
            action=action,
            count=len(ids),
            ids=" ".join(str(i) for i in ids),
            match=None,
            back=filter_args(f),
        )

    @app.post("/groups/<name>/unsubscribe")
    def unsubscribe(name: str) -> Any:
        """Remove the group and its rows, audited (`pgq unsubscribe`); refused while a
        member is live unless forced."""
        actor = _actor()
        reason = _reason()
        result = store_lifecycle.unsubscribe(
            dashboard.engine,
            name,
            reason=reason,
            force=request.form.get("force") == "1",
            member_ttl=dashboard.options.member_ttl,
            actor=actor,
        )
        if request.headers.get("Authorization", "").startswith("Bearer "):
            return _page("done.html", name=None, text=f"removed group {name} ({result.count} rows)")
        return redirect(url_for("topics", removed=name, done=result.audit_id), 303)

    def _audited(audit_id: int | None) -> str:
        """The audit row a change wrote, for its answer (none when it changed nothing)."""
        return "" if audit_id is None else f" (audit {audit_id})"

    def _done(name: str, action: str, text: str, audit_id: int | None, **shown: int) -> Any:
        """A change's answer: for a browser a 303 to the group page, which says what was
        done (a reload of a POST's answer would post it again; docs/defects.md),
        also when it changed nothing (`none=<action>`: no audit row to read it from);
        for a script (`Authorization: Bearer`) the result page itself."""
        if request.headers.get("Authorization", "").startswith("Bearer "):
            return _page("done.html", name=name, text=text)
        values: dict[str, Any] = {k: v for k, v in shown.items() if v}
        if audit_id is None:
            values["none"] = action
        return redirect(url_for("group", name=name, done=audit_id, **values), 303)

    @app.route("/login", methods=["GET", "POST"])
    def login() -> Any:
        if not guard.admin:
            abort(403, "this dashboard is read-only (start pgq web with --admin)")
        if request.method != "POST":  # GET, and HEAD as GET (docs/defects.md)
            return _page("login.html", failed=False)
        if not same_origin(dict(request.headers), request.host):
            # before the throttle: another site's page neither locks the operator out
            # nor logs their browser in as someone else (login CSRF)
            abort(403, "a login from another site's page is refused")
        s = guard.login(request.form.get("token"), request.remote_addr)
        if s is None:
            return _page("login.html", 403, failed=True)
        resp = redirect(url_for("overview"), 303)
        resp.set_cookie(
            SESSION_COOKIE, s.id, httponly=True, samesite="Strict", secure=request.is_secure
        )
        return resp

    @app.post("/logout")
    def logout() -> Any:
        guard.logout(request.cookies.get(SESSION_COOKIE))
        resp = redirect(url_for("overview"), 303)
        resp.delete_cookie(SESSION_COOKIE)
        return resp

    return app


_TITLES = {400: "Bad request", 404: "Not found", 500: "Error", 503: "Database unavailable"}
