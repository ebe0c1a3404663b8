"""The dashboard's pure pieces, exact: timeline, sparklines, the guard, escaping."""

from __future__ import annotations

import datetime as dt
import re

import pytest

pytest.importorskip("flask")

from markupsafe import Markup

from pgq.web.app import _finalize
from pgq.web.charts import sparkline
from pgq.web.guard import Guard, host_allowed, same_origin
from pgq.web.server import Limits
from pgq.web.timeline import auto_window, timeline

NOW = dt.datetime(2026, 12, 1, 12, 0, tzinfo=dt.timezone.utc)


def at(seconds_ago: float) -> str:
    return (NOW - dt.timedelta(seconds=seconds_ago)).isoformat()


def outage(opened: float, closed: float | None, refunded: int = 7) -> dict:
    history = [{"epoch": 1, "state": "OPEN", "at": at(opened), "refunded": 0, "by_member": "m1"}]
    if closed is not None:
        history.insert(
            0,
            {
                "epoch": 2,
                "state": "CLOSED",
                "at": at(closed),
                "refunded": refunded,
                "by_member": "m2",
            },
        )
    probes = [
        {"epoch": 1, "at": at(opened - 1), "member": "m2", "message_id": 5, "outcome": "failed"},
    ]
    if closed is not None:
        probes.insert(
            0,
            {"epoch": 1, "at": at(closed), "member": "m2", "message_id": 6, "outcome": "succeeded"},
        )
    return {
        "state": "CLOSED" if closed is not None else "OPEN",
        "epoch": 2 if closed else 1,
        "history": history,
        "probes": probes,
    }


def test_spans_alternate_and_end_now():
    t = timeline(outage(opened=120, closed=60), now=NOW, window=300)
    assert [(s.state, s.epoch) for s in t.spans] == [("CLOSED", 0), ("OPEN", 1), ("CLOSED", 2)]
    assert t.spans[0].start == NOW - dt.timedelta(seconds=300)
    assert t.spans[1].start == NOW - dt.timedelta(seconds=120)
    assert t.spans[1].end == t.spans[2].start == NOW - dt.timedelta(seconds=60)
    assert t.spans[-1].end == NOW


def test_events_newest_first_with_refund_and_probe_outcomes():
    t = timeline(outage(opened=120, closed=60), now=NOW, window=300)
    kinds = [(e.kind, e.outcome, e.refunded) for e in t.events]
    assert kinds == [
        ("close", None, 7),
        ("probe", "succeeded", None),
        ("probe", "failed", None),
        ("open", None, None),
    ]


def test_a_group_that_never_opened_is_closed_all_along():
    info = {"state": "CLOSED", "epoch": 0, "history": [], "probes": []}
    t = timeline(info, now=NOW)
    assert [(s.state, s.start, s.end) for s in t.spans] == [
        ("CLOSED", NOW - dt.timedelta(hours=1), NOW)
    ]
    assert t.events == []


def test_spans_before_the_window_are_left_out():
    t = timeline(outage(opened=7200, closed=7100), now=NOW, window=300)
    assert [s.state for s in t.spans] == ["CLOSED"]


@pytest.mark.parametrize(
    ("opened", "window"),
    [
        (10, 60),
        (47, 60),
        (49, 300),
        (239, 300),
        (241, 900),
        (700, 900),
        (2000, 3600),
        (4 * 3600, 6 * 3600),
        (30 * 3600, 24 * 3600),
    ],
)
def test_the_window_zooms_to_the_last_outage(opened, window):
    assert auto_window(outage(opened=opened, closed=None)["history"], NOW) == window
    assert timeline(outage(opened=opened, closed=None), now=NOW).window == window


def test_the_svg_escapes_member_names():
    info = outage(opened=100, closed=50)
    info["probes"][0]["member"] = '<script>alert(1)</script>"'
    svg = timeline(info, now=NOW, window=300).svg()
    assert "<script>" not in svg and "&lt;script&gt;" in svg


def test_a_sparkline_of_one_sample_is_a_point():
    svg = sparkline([(10, 4.0)], start=0, end=20, width=104, height=34, label="x")
    assert '<circle cx="52.0" cy="2.0" r="1.5"/>' in svg and "polyline" not in svg


def test_sparkline_scales_to_its_maximum():
    svg = sparkline(
        [(0, 0.0), (10, 5.0), (20, 10.0)], start=0, end=20, width=104, height=34, label="lag of <g>"
    )
    assert 'points="2.0,32.0 52.0,17.0 102.0,2.0"' in svg
    assert "lag of &lt;g&gt;" in svg


def test_a_sparkline_of_an_hour_of_samples_stays_small_and_keeps_dips_and_peaks():
    """Failed before `_columns`: every sample was a point, 720 of them on 160 pixels
    (the overview of 500 groups, 7.8 MB a refresh after an hour;
    docs/defects.md)."""
    values = [5.0] * 720
    values[300], values[500] = 0.0, 50.0  # one outage dip, one burst
    svg = sparkline(list(enumerate(values)), start=0, end=719, width=160, label="x")
    [points] = re.findall(r'points="([^"]*)"', svg)
    ys = [float(p.split(",")[1]) for p in points.split()]
    assert len(ys) <= 2 * 160 // 4
    assert max(ys) == 30.0 and min(ys) == 2.0  # the dip (value 0) and the burst (the top)


def test_text_is_made_visible_markup_is_kept():
    assert _finalize("a\x1b[2Jb\u202ec") == "a\\x1b[2Jb\\u202ec"
    assert _finalize(Markup("<svg/>")) == Markup("<svg/>")
    assert _finalize(3) == 3


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


TOKEN = "s3cret-e8b1f4a92c7d5063"


def test_a_read_only_guard_never_allows_a_change():
    g = Guard(None)
    assert not g.admin and g.login(TOKEN) is None
    assert not g.changer(
        cookie=None,
        headers={"Authorization": f"Bearer {TOKEN}"},
        form_csrf=None,
        host="127.0.0.1:8080",
    )


def test_sessions_need_the_token_their_csrf_and_expire():
    clock = Clock()
    g = Guard(TOKEN, ttl=60, clock=clock)
    assert g.login("wrong") is None and g.login("") is None and g.login(None) is None
    s = g.login(TOKEN)
    assert s is not None
    same = {"Origin": "http://127.0.0.1:8080"}
    assert g.changer(cookie=s.id, headers=same, form_csrf=s.csrf, host="127.0.0.1:8080") == "admin"
    assert not g.changer(cookie=s.id, headers=same, form_csrf="x", host="127.0.0.1:8080")
    assert not g.changer(cookie=s.id, headers=same, form_csrf=None, host="127.0.0.1:8080")
    assert not g.changer(cookie="forged", headers=same, form_csrf=s.csrf, host="127.0.0.1:8080")
    clock.now = 61
    assert not g.changer(cookie=s.id, headers=same, form_csrf=s.csrf, host="127.0.0.1:8080")


def test_bearer_token_needs_no_session():
    g = Guard(TOKEN)
    ok = {"Authorization": f"Bearer {TOKEN}"}
    assert g.changer(cookie=None, headers=ok, form_csrf=None, host="h") == "admin"
    bad = {"Authorization": "Bearer nope"}
    assert not g.changer(cookie=None, headers=bad, form_csrf=None, host="h")


@pytest.mark.parametrize(
    ("headers", "allowed"),
    [
        ({}, True),
        ({"Origin": "http://127.0.0.1:8080"}, True),
        ({"Referer": "http://127.0.0.1:8080/groups/g"}, True),
        ({"Origin": "http://evil.example"}, False),
        ({"Origin": "null"}, False),
        ({"Referer": "http://127.0.0.1:9999/"}, False),
        ({"Origin": "http://127.0.0.1:8080", "Sec-Fetch-Site": "cross-site"}, False),
    ],
)
def test_cross_site_requests_are_refused(headers, allowed):
    assert same_origin(headers, "127.0.0.1:8080") is allowed


@pytest.mark.parametrize(
    ("host_header", "listen", "allowed"),
    [
        ("127.0.0.1:8080", "127.0.0.1", True),
        ("localhost:8080", "127.0.0.1", True),
        ("[::1]:8080", "127.0.0.1", True),
        ("LOCALHOST:8080", "127.0.0.1", True),
        ("127.0.0.1", "127.0.0.1", True),
        ("127.0.0.1:9999", "127.0.0.1", False),
        ("evil.example:8080", "127.0.0.1", False),
        ("evil.example", "127.0.0.1", False),
        ("10.0.0.5:8080", "10.0.0.5", True),
        ("evil.example:8080", "10.0.0.5", False),
        ("anything:8080", "0.0.0.0", True),
    ],
)
def test_host_header_names_this_server(host_header, listen, allowed):
    assert host_allowed(host_header, listen, 8080) is allowed


def test_a_truncated_history_leaves_the_time_before_it_unread():
    """Failed before `truncated`: with only the newest transitions read, the time
    before the oldest one was drawn as the other state, so a breaker that flapped
    for hours looked steady (docs/defects.md)."""
    flapping = {
        "state": "CLOSED",
        "epoch": 40,
        "history": [
            {
                "epoch": e,
                "state": "OPEN" if e % 2 else "CLOSED",
                "at": at(10 * (41 - e)),
                "refunded": 0,
            }
            for e in range(40, 30, -1)
        ],
        "probes": [],
    }
    t = timeline(flapping, now=NOW, window=3600, truncated=True)
    assert (t.spans[0].state, t.spans[0].start) == ("UNREAD", NOW - dt.timedelta(seconds=3600))
    assert t.spans[0].end == NOW - dt.timedelta(seconds=100)
    assert {s.state for s in t.spans[1:]} == {"OPEN", "CLOSED"}
    assert 'class="span unread"' in t.svg() and "earlier transitions not read" in t.svg()
    assert timeline(flapping, now=NOW, window=3600).spans[0].state == "CLOSED"  # as read
    # a history that starts at the first transition is complete, truncated or not
    first = timeline(outage(opened=120, closed=60), now=NOW, window=300, truncated=True)
    assert first.spans[0].state == "CLOSED"


def test_connections_are_closed_when_idle_or_slow_and_sooner_when_crowded():
    limits = Limits(connections=100, idle=30, request=10, crowded=0.75, crowded_idle=1,
                    crowded_request=2)  # fmt: skip

    def overdue(now: float, *, last: float = 0.0, started: float | None = None,
                busy: bool = False, open_connections: int = 10,
                waited: float = 0.0) -> bool:  # fmt: skip
        return limits.overdue(now=now, last_activity=last, started=started, busy=busy,
                              open_connections=open_connections, waited=waited)  # fmt: skip

    assert not overdue(30) and overdue(30.01)  # idle
    assert not overdue(10, started=0, last=9.9) and overdue(10.01, started=0, last=10)
    assert not overdue(74, last=73.9, started=None) and overdue(1e9, last=0, started=None)
    assert not overdue(1e9, started=0, busy=True)  # answering: the reads have a deadline
    # crowded from 75 open connections on
    assert not overdue(1.5, open_connections=74) and overdue(1.01, open_connections=75)
    assert not overdue(1, open_connections=75)
    assert overdue(2.01, started=0, last=2, open_connections=75)
    assert not overdue(2, started=0, last=2, open_connections=100)
    assert not overdue(1e9, busy=True, open_connections=100)
    # answering, a thread waiting for the client to read: `request` in all (crowded: 2 s)
    assert not overdue(1e9, busy=True, waited=10) and overdue(0, busy=True, waited=10.01)
    assert not overdue(0, busy=True, waited=2, open_connections=75)
    assert overdue(0, busy=True, waited=2.01, open_connections=75)


# -- the messages page's URL (pgq.web.query) -------------------------------------------


def test_a_filter_goes_to_the_url_and_back_unchanged():
    from pgq.records import MessageFilter
    from pgq.web.query import filter_args, parse_filter

    f = MessageFilter(
        message_id=7,
        key="k 1",
        dedupe_key=" order 42\t ",
        state="dead",
        error_class="systemic",
        error="502",
        field="a.b",
        value="x=y&z",
        published_from=dt.datetime(2026, 1, 31, 14, 5, tzinfo=dt.timezone.utc),
        published_to=dt.datetime(2026, 2, 1, tzinfo=dt.timezone(dt.timedelta(hours=2))),
        up_to=99,
        changed_by=dt.datetime(2026, 2, 1, 3, 4, 5, 123456, tzinfo=dt.timezone.utc),
    )
    assert parse_filter(filter_args(f)) == f
    assert parse_filter({"id": "", "key": "", "state": ""}) == MessageFilter()
    # a datetime-local value has no offset: it is UTC
    naive = parse_filter({"from": "2026-01-31T14:05"}).published_from
    assert naive == dt.datetime(2026, 1, 31, 14, 5, tzinfo=dt.timezone.utc)


def test_the_dedupe_key_is_read_as_it_is_from_its_own_argument():
    from pgq.records import MessageFilter
    from pgq.web.query import filter_args, parse_filter

    # literal, like the key: not stripped, no pattern characters
    f = parse_filter({"dedupe": " a%_b\\ ", "key": "k"})
    assert f == MessageFilter(key="k", dedupe_key=" a%_b\\ ")
    assert filter_args(f) == {"key": "k", "dedupe": " a%_b\\ "}
    assert "dedupe_key" in f.shape()
    assert parse_filter({"dedupe": ""}) == MessageFilter()


@pytest.mark.parametrize(
    "args",
    [
        {"id": "1e3"},
        {"id": "-1"},
        {"upto": "x"},
        {"from": "yesterday"},
        {"to": "2026-13-01"},
        {"from": "0001-01-01T00:00:00+01:00"},  # year 0 in UTC
        {"to": "9999-12-31T23:59:59-01:00"},  # year 10000 in UTC
    ],
)
def test_bad_filter_arguments_are_usage_errors(args):
    from pgq.errors import UsageError
    from pgq.web.query import parse_filter

    with pytest.raises(UsageError):
        parse_filter(args)


def test_positions_read_prev_pages_backwards():
    from pgq.errors import UsageError
    from pgq.web.query import Position, parse_position

    assert parse_position({}) == Position()
    assert Position(next=10).bounds() == (10, None, False, False)
    assert Position(prev=10).bounds() == (None, 10, True, True)
    assert Position(descending=True, next=10).bounds() == (None, 10, True, False)
    assert Position(descending=True, prev=10).bounds() == (10, None, False, True)
    assert parse_position({"order": "desc", "limit": "500"}).args() == {
        "order": "desc",
        "limit": "500",
    }
    for bad in ({"order": "up"}, {"limit": "0"}, {"limit": "501"}, {"next": "1", "prev": "2"}):
        with pytest.raises(UsageError):
            parse_position(bad)


def test_a_requeue_form_of_as_many_ids_as_an_audit_row_lists_fits_in_a_body():
    """MAX_BODY's promise for the largest ids, each a ticked checkbox's field, with a
    reason and the CSRF token."""
    import urllib.parse

    from pgq.store.admin import MAX_LISTED_IDS
    from pgq.store.messages import MAX_MESSAGE_ID
    from pgq.web.app import MAX_BODY

    ids = [("ids", str(MAX_MESSAGE_ID - i)) for i in range(MAX_LISTED_IDS)]
    form = [*ids, ("csrf", "x" * 43), ("reason", "billing is back " * 100)]
    assert len(urllib.parse.urlencode(form)) <= MAX_BODY
