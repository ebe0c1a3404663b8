"""Attacks on the dashboard's messages page and its bulk actions (decision 0041),
over raw HTTP against a real server and real PostgreSQL.

- hostile filter values in the URL: one 400 page (or a page), never a 500;
- the bulk requeue and purge of a filter or a selection: they act on exactly the
  rows the page showed and the confirmation counted, audited by name;
- a bulk requeue while a consumer drains the group: nothing lost or doubled;
- hostile text on the confirmation page, and filters' round trip through forms.
"""

from __future__ import annotations

import html
import re
import threading
import urllib.parse
from collections import Counter

import pytest

pytest.importorskip("flask")

import test_web
from helpers import kill, rows, set_rows, states, wait_until
from sqlalchemy import Engine
from test_web import TOKEN, get, login, origin, post

import pgq
from pgq import monitor
from pgq.records import MessageFilter
from pgq.store import admin as store_admin
from pgq.web.query import Position
from pgq.web.views import listing

serve = test_web.serve
"""test_web's fixture: dashboard servers on this test's engine, closed at the end."""

BEARER = {"Authorization": f"Bearer {TOKEN}"}


def hidden(page: str, form_id: str) -> dict[str, str]:
    """The hidden fields of form `form_id` on `page`, as a browser would send them
    (HTML entities decoded)."""
    form = re.search(rf'<form[^>]*id="{form_id}".*?</form>', page, re.S)
    assert form, page[:3000]
    found = re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)">', form[0])
    return {name: browser_unescape(value) for name, value in found}


def browser_unescape(value: str) -> str:
    """`value`'s character references decoded as a browser does: `html.unescape`
    drops a reference to a C0 control or DEL (`&#27;`), a browser keeps it."""
    controls = re.sub(
        r"&#(x[0-9a-fA-F]+|[0-9]+);",
        lambda m: (
            chr(n)
            if (n := int(m[1][1:], 16) if m[1][0] == "x" else int(m[1])) < 32 or n == 127
            else m[0]
        ),
        value,
    )
    return html.unescape(controls)


def shown(page: str) -> list[int]:
    """The message ids a messages page lists, in its order."""
    return [int(i) for i in re.findall(r'<tr data-message="(\d+)"', page)]


def group(engine: Engine, name: str = "g", topic: str = "t") -> None:
    if topic not in {tp.name for tp in pgq.topics(engine).topics}:
        pgq.create_topic(engine, topic)
    pgq.subscribe(engine, name, topic)


@pytest.fixture
def board(engine: Engine) -> dict[str, int]:
    """Group `g` on `t`: a few dead rows with awkward error texts and payloads, and a
    ready one. Returns their ids by name."""
    group(engine)
    ids = {
        "percent": pgq.publish(engine, "t", {"n": 1}, key="k"),
        "thousand": pgq.publish(engine, "t", {"n": "1"}, key="k"),
        "underscore": pgq.publish(engine, "t", {"n": 1.0}, key="k_"),
        "backslash": pgq.publish(engine, "t", {"a": {"b": "x'y"}}, key="k%"),
        "ready": pgq.publish(engine, "t", {"n": 1}, key="k"),
    }
    errors = {
        "percent": "disk 100% full",
        "thousand": "disk 1000 full",
        "underscore": "bad a_b",
        "backslash": "bad a\\b axb",
    }
    for name, error in errors.items():
        kill(engine, [ids[name]], "message", last_error=error)
    return ids


def query(**args: str) -> str:
    return "/groups/g/messages?" + urllib.parse.urlencode(args)


# -- hostile filter values ----------------------------------------------------------

BAD_QUERIES = [
    pytest.param({"from": "2026-13-01"}, id="month 13"),
    pytest.param({"from": "yesterday"}, id="not a time"),
    pytest.param({"to": "2026-01-01T00:00:00+24:00"}, id="offset 24h"),
    pytest.param({"id": "1 OR 1=1"}, id="sql in id"),
    pytest.param({"id": "0"}, id="id 0"),
    pytest.param({"id": "9223372036854775808"}, id="id past bigint"),
    pytest.param({"upto": "-1"}, id="negative upto"),
    pytest.param({"state": "dead' OR '1'='1"}, id="sql in state"),
    pytest.param({"state": "DEAD"}, id="state in capitals"),
    pytest.param({"class": "bogus"}, id="bad class"),
    pytest.param({"key": "a\x00b"}, id="NUL in key"),
    pytest.param({"error": "\x00"}, id="NUL in error"),
    pytest.param({"field": "a", "value": "\x00"}, id="NUL in value"),
    pytest.param({"key": "x" * 1001}, id="huge key"),
    pytest.param({"field": "a..b", "value": "1"}, id="empty path key"),
    pytest.param({"field": ".", "value": "1"}, id="path of dots"),
    pytest.param({"field": ".".join("a" * 17), "value": "1"}, id="path 17 deep"),
    pytest.param({"field": "n"}, id="field without value"),
    pytest.param({"value": "1"}, id="value without field"),
    pytest.param({"limit": "-1"}, id="negative limit"),
    pytest.param({"limit": "0"}, id="limit 0"),
    pytest.param({"limit": "501"}, id="limit 501"),
    pytest.param({"limit": "1e3"}, id="limit 1e3"),
    pytest.param({"limit": "9" * 40}, id="huge limit"),
    pytest.param({"order": "desc; DROP TABLE pgq.message"}, id="sql in order"),
    pytest.param({"next": "abc"}, id="garbage next"),
    pytest.param({"next": "0"}, id="next 0"),
    pytest.param({"prev": "-5"}, id="negative prev"),
    pytest.param({"next": "9223372036854775808"}, id="next past bigint"),
    pytest.param({"next": "9" * 30}, id="huge next"),
    pytest.param({"next": "1", "prev": "2"}, id="next and prev"),
]


@pytest.mark.parametrize("args", BAD_QUERIES)
def test_a_bad_filter_or_position_is_one_400_page(engine, board, serve, args):
    server = serve()
    answer = get(server, query(**args))
    assert answer.status == 400, answer.body[:3000]
    assert "Traceback" not in answer.body
    assert "<h1" in answer.body and answer.header("Content-Type").startswith("text/html")


@pytest.mark.parametrize(
    "args",
    [
        pytest.param({"from": "0001-01-01T00:00:00+01:00"}, id="from year 1 east of UTC"),
        pytest.param({"to": "9999-12-31T23:59:59-01:00"}, id="to year 9999 west of UTC"),
    ],
)
def test_a_time_at_the_edge_of_the_calendar_is_no_500(engine, board, serve, args):
    """A time whose UTC form leaves Python's date range (year 1 east of UTC, year
    9999 west of it) passes `parse_filter` and the search, then the page's filter
    form draws it with `astimezone(utc)` for its `datetime-local` input:
    OverflowError, a 500 with a traceback in the log. A page or a 400 is fine."""
    answer = get(serve(), query(**args))
    assert answer.status in (200, 400), (answer.status, answer.body[:1000])


GOOD_QUERIES = [
    pytest.param({"key": "'; DROP TABLE pgq.message; --"}, id="sql in key"),
    pytest.param({"key": "k' OR '1'='1"}, id="quote in key"),
    pytest.param({"error": "%"}, id="percent alone"),
    pytest.param({"error": "\\"}, id="backslash alone"),
    pytest.param({"field": "'", "value": "'"}, id="quote path"),
    pytest.param({"field": "a.b.c.d.e.f.g.h.i.j.k.l.m.n.o.p", "value": "1"}, id="path 16 deep"),
    pytest.param({"field": "{a,b}", "value": "1"}, id="array literal path"),
    pytest.param({"key": "x" * 1000}, id="key of 1000"),
    pytest.param({"from": "0001-01-01T00:00:00", "to": "9999-12-31T23:59:59"}, id="widest"),
    pytest.param({"next": "9223372036854775807", "order": "desc"}, id="next at bigint max"),
    pytest.param({"prev": "1"}, id="prev 1"),
]


@pytest.mark.parametrize("args", GOOD_QUERIES)
def test_odd_but_valid_filters_answer_a_page(engine, board, serve, args):
    answer = get(serve(), query(**args))
    assert answer.status == 200, answer.body[:3000]


def test_bytes_that_are_no_utf_8_answer_a_page(engine, board, serve):
    """A lone surrogate's UTF-8 form and an overlong NUL, percent-encoded."""
    for raw in ("key=%ED%B3%BF", "error=%C0%80", "field=%ED%A0%80&value=%FF"):
        answer = get(serve(), f"/groups/g/messages?{raw}")
        assert answer.status in (200, 400), (raw, answer.body[:2000])


def test_error_text_and_payload_values_match_literally(engine, board, serve):
    """`%`, `_` and `\\` are no wildcards; a payload value is compared as its text."""
    server = serve()

    def found(**args: str) -> list[int]:
        answer = get(server, query(**args))
        assert answer.status == 200, answer.body[:2000]
        return shown(answer.body)

    assert found(error="100%") == [board["percent"]]
    assert found(error="a_b") == [board["underscore"]]
    assert found(error="a\\b") == [board["backslash"]]
    assert found(key="k%") == [board["backslash"]]
    assert found(field="a.b", value="x'y") == [board["backslash"]]
    # `n = 1` finds the number 1 and the string "1" alike (the page compares text) ...
    assert found(field="n", value="1") == [board["percent"], board["thousand"], board["ready"]]
    # ... and 1.0 only as it is written
    assert found(field="n", value="1.0") == [board["underscore"]]


def test_the_previous_page_of_an_empty_search_window_shows_the_row_before_it(engine):
    """A page of an unindexed filter whose window ends on a matching row says "next
    from that row"; when the next page finds nothing, its "previous" link is that
    same row (`prev=ID`: the rows before it), so the page it opens leaves the row
    out, shows nothing, and has no "next" link either: the row cannot be reached
    going back. (The window is 100,000 rows on the real page; 2 here.)"""
    group(engine)
    ids = pgq.publish_many(engine, "t", [{"n": n} for n in ("x", "y", "x", "x")])
    kill(engine, ids, "message")
    f = MessageFilter(state="dead", field="n", value="y")
    first = listing(engine, "g", f, Position(), scan=2)
    assert [r.message_id for r in first.rows] == [ids[1]] and first.next == ids[1]
    second = listing(engine, "g", f, Position(next=first.next), scan=2)
    assert second.rows == () and second.next is None and second.prev is not None
    back = listing(engine, "g", f, Position(prev=second.prev), scan=2)
    assert [r.message_id for r in back.rows] == [ids[1]], (back.rows, back.next, back.prev)


@pytest.mark.parametrize("descending", [False, True], ids=["oldest first", "newest first"])
def test_an_empty_previous_page_links_on_to_the_row_it_started_from(engine, descending):
    """The rows before a page went (requeued, say) and its "previous" link finds
    nothing: that empty page's "next" link must lead back to the row it started
    from (it had none without a search window: the row could be reached only from
    the first page)."""
    group(engine)
    ids = pgq.publish_many(engine, "t", [{"n": n} for n in ("x", "y", "x")])
    kill(engine, ids, "message")
    f = MessageFilter(state="dead", field="n", value="y")
    empty = listing(engine, "g", f, Position(descending=descending, prev=ids[1]), scan=5)
    assert empty.rows == () and empty.next is not None, (empty.next, empty.prev)
    on = listing(engine, "g", f, Position(descending=descending, next=empty.next), scan=5)
    assert [r.message_id for r in on.rows] == [ids[1]], (on.rows, on.next, on.prev)


# -- bulk actions ---------------------------------------------------------------------


def _confirm(server, cookie: str, page: str, scope: str, action: str) -> str:
    form = {**hidden(page, "bulk-form"), "scope": scope, "action": action}
    same = {"Cookie": cookie, "Origin": origin(server)}
    answer = post(server, "/groups/g/messages/confirm", form, **same)
    assert answer.status == 200, answer.body[:3000]
    return answer.body


@pytest.mark.parametrize(
    ("arg", "value"),
    [
        pytest.param("key", "acct\t42", id="a tab in the key"),
        pytest.param("value", "Zoë\xa0Ltd", id="a no-break space in the payload value"),
    ],
)
def test_a_bulk_requeue_of_a_filter_acts_on_the_rows_the_page_showed(engine, serve, arg, value):
    """The messages page finds the rows by the raw filter value from the URL, but
    writes the bulk form's hidden fields (and the confirmation's) through `visible`,
    so a value holding a tab or a no-break space reaches the confirmation as its
    escaped text (`acct\\t42`): the confirmation counts, and the requeue changes,
    the rows whose text is literally that, not the ones the operator looked at."""
    group(engine)
    escaped = value.replace("\t", "\\t").replace("\xa0", "\\xa0")
    if arg == "key":
        meant = [pgq.publish(engine, "t", {"i": i}, key=value) for i in range(2)]
        lookalike = pgq.publish(engine, "t", {"i": 9}, key=escaped)
    else:
        meant = [pgq.publish(engine, "t", {"customer": value, "i": i}) for i in range(2)]
        lookalike = pgq.publish(engine, "t", {"customer": escaped})
    kill(engine, [*meant, lookalike], "message")
    server = serve(token=TOKEN)
    cookie = login(server)
    filters = {"state": "dead", arg: value}
    if arg == "value":
        filters["field"] = "customer"
    page = get(server, query(**filters), Cookie=cookie)
    assert page.status == 200 and shown(page.body) == meant  # the page finds the right rows
    confirm = _confirm(server, cookie, page.body, "filter", "requeue")
    fields = hidden(confirm, "confirm-form") if 'id="confirm-form"' in confirm else {}
    same = {"Cookie": cookie, "Origin": origin(server)}
    if fields:
        done = post(server, "/groups/g/requeue", {**fields, "reason": "fixed"}, **same)
        assert done.status == 303, done.body[:2000]
    requeued = [m for a in monitor.audit(engine, "g") for m in a["message_ids"]]
    count = re.search(r'id="count"><strong>(\d+)</strong>', confirm)
    assert (count and count[1], requeued) == ("2", meant), (
        f"the page showed {meant}; the confirmation counted {count and count[1]}; "
        f"requeued {requeued} (the look-alike is {lookalike})"
    )


def test_a_row_that_dies_after_the_confirmation_is_left_alone(engine, serve):
    """The confirmation says "message ids up to N: rows that die later are left
    alone", but `upto` bounds ids, not deaths: an older message that was waiting
    for a retry when the confirmation was drawn, and dies before the click, has an
    id below N and is swept up by the requeue the operator confirmed for fewer rows."""
    group(engine)
    retrying, *dead = pgq.publish_many(engine, "t", [{"i": i} for i in range(3)])
    kill(engine, dead, "message")
    server = serve(token=TOKEN)
    cookie = login(server)
    page = get(server, query(state="dead"), Cookie=cookie)
    assert shown(page.body) == dead
    confirm = _confirm(server, cookie, page.body, "filter", "requeue")
    assert re.search(r'id="count"><strong>2</strong> dead rows match', confirm), confirm
    assert "rows that die later are left alone" in confirm
    fields = hidden(confirm, "confirm-form")
    assert fields["upto"] == str(dead[-1])
    kill(engine, [retrying], "message")  # its last retry fails after the confirmation
    same = {"Cookie": cookie, "Origin": origin(server)}
    done = post(server, "/groups/g/requeue", {**fields, "reason": "confirmed 2"}, **same)
    assert done.status == 303, done.body[:2000]
    [audit] = monitor.audit(engine, "g")
    assert (audit["count"], audit["message_ids"]) == (2, dead), audit
    assert states(engine, "g") == {"ready": 2, "dead": 1}


def test_a_confirmed_requeue_that_finds_nothing_left_says_so(engine, serve):
    """The rows confirmed were requeued by someone else before the click: the
    requeue changes nothing and writes no audit row, and its answer, a 303 to the
    group page "which says what was done", carries no `done=` at all: the page
    the operator lands on says nothing, as if the click had been lost."""
    group(engine)
    dead = pgq.publish_many(engine, "t", [{"i": i} for i in range(2)])
    kill(engine, dead, "message")
    server = serve(token=TOKEN)
    cookie = login(server)
    page = get(server, query(state="dead"), Cookie=cookie)
    fields = hidden(_confirm(server, cookie, page.body, "filter", "requeue"), "confirm-form")
    store_admin.requeue(engine, "g", dead, reason="a colleague was faster")
    same = {"Cookie": cookie, "Origin": origin(server)}
    done = post(server, "/groups/g/requeue", {**fields, "reason": "mine"}, **same)
    assert done.status == 303, done.body[:2000]
    landed = get(server, done.header("Location"), Cookie=cookie)
    assert landed.status == 200
    assert re.search(r'id="result">[^<]*requeued 0', landed.body), done.header("Location")


def test_a_selection_changes_only_its_own_groups_dead_rows_once(engine, serve):
    """Ids of another group, of ready and leased rows, and duplicates: a requeue of
    the selection refuses and writes nothing; a purge leaves them out; each id
    counts once; the audit row names the person and the reason."""
    group(engine)
    group(engine, "other", "t2")
    mine = pgq.publish_many(engine, "t", [{"i": i} for i in range(4)])
    theirs = pgq.publish(engine, "t2", {"i": 0})
    kill(engine, mine[:2], "message")
    kill(engine, [theirs], "message")
    set_rows(engine, [mine[3]], state="leased", lease_owner="m1")
    server = serve(users={"alice": "alice-7f3c9e1b5a2d8064"})
    cookie = login(server, "alice-7f3c9e1b5a2d8064")
    same = {"Cookie": cookie, "Origin": origin(server)}
    csrf = hidden(get(server, query(state="dead"), Cookie=cookie).body, "bulk-form")["csrf"]
    ids = f"{mine[0]} {mine[0]},{theirs} {mine[2]} {mine[3]} {mine[1]}"
    refused = post(server, "/groups/g/requeue", {"csrf": csrf, "ids": ids, "reason": "r"}, **same)
    assert refused.status == 400 and "not dead" in refused.body
    assert monitor.audit(engine, "g") == [] and monitor.audit(engine, "other") == []
    purged = post(server, "/groups/g/purge", {"csrf": csrf, "ids": ids, "reason": "junk"}, **same)
    assert purged.status == 303, purged.body[:2000]
    [audit] = monitor.audit(engine, "g")
    assert (audit["count"], sorted(audit["message_ids"])) == (2, mine[:2])
    assert (audit["actor"], audit["reason"]) == ("alice (pgq web)", "junk")
    assert states(engine, "g") == {"ready": 1, "leased": 1}
    assert states(engine, "other") == {"dead": 1}
    # replayed: the same form again changes nothing and writes no audit row
    again = post(server, "/groups/g/purge", {"csrf": csrf, "ids": ids, "reason": "junk"}, **same)
    assert again.status == 303
    assert len(monitor.audit(engine, "g")) == 1
    # no reason, a blank one, a NUL in it: refused, nothing written
    for reason in ("", "  \t", "a\x00b"):
        form = {"csrf": csrf, "ids": str(mine[2]), "reason": reason}
        assert post(server, "/groups/g/purge", form, **same).status == 400, repr(reason)
    assert len(monitor.audit(engine, "g")) == 1


def test_a_requeue_form_of_ten_thousand_ids_fits(engine, serve):
    """`MAX_BODY`'s promise ("a requeue form with 10,000 ids fits") and the audit's
    10,000 listed ids: with the ids of a queue past a million messages (seven
    digits) the typed form is 80 kB, and the dashboard refuses it unread (413)."""
    group(engine)
    server = serve(token=TOKEN)
    ids = " ".join(str(1_000_000 + i) for i in range(10_000))
    answer = post(server, "/groups/g/requeue", {"ids": ids, "reason": "r"}, **BEARER)
    assert answer.status == 400 and "not dead" in answer.body, (answer.status, answer.body[:500])


def test_a_bulk_requeue_while_a_consumer_drains_the_group_loses_and_doubles_nothing(engine, serve):
    """Rows leased while the requeue runs are not touched; every message is handled
    exactly once; the audit row counts exactly the rows requeued."""
    group(engine)
    ids = pgq.publish_many(engine, "t", [{"i": i} for i in range(300)])
    dead = ids[::2]
    kill(engine, dead, "message")
    handled: Counter[int] = Counter()
    lock = threading.Lock()
    started = threading.Event()

    def handle(msg: pgq.Message) -> None:
        with lock:
            handled[msg.id] += 1
        started.set()

    server = serve(token=TOKEN)
    with pgq.Consumer(engine, "g", handle, workers=2, poll_interval=0.05):
        assert started.wait(30)
        confirm = post(
            server,
            "/groups/g/messages/confirm",
            {"state": "dead", "scope": "filter", "action": "requeue"},
            **BEARER,
        )
        assert confirm.status == 200, confirm.body[:2000]
        fields = hidden(confirm.body, "confirm-form")
        done = post(server, "/groups/g/requeue", {**fields, "reason": "drain"}, **BEARER)
        assert done.status == 200, done.body[:2000]
        wait_until(lambda: sum(handled.values()) >= len(ids), 60, "every message handled")
        wait_until(lambda: not ({"ready", "leased", "dead"} & set(states(engine, "g"))), 30)
    [audit] = monitor.audit(engine, "g")
    assert audit["count"] == len(dead) and audit["message_ids"] == dead
    assert set(handled) == set(ids) and set(handled.values()) == {1}


# -- escaping -----------------------------------------------------------------------

SCRIPT = "<script>alert(1)</script>"
ATTR = '" autofocus onfocus="alert(1)'


def test_hostile_text_on_the_confirmation_and_in_the_filter_round_trip(engine, serve):
    """A hostile key, payload value and error text: escaped on the messages page's
    inputs, hidden fields and pager links, and on the confirmation page; the
    hidden fields carry the filter back exactly, so the confirmation counts the
    rows the page showed."""
    group(engine)
    hostile = f"{SCRIPT}{ATTR}&amp;'"
    ids = [pgq.publish(engine, "t", {"v": hostile, "i": i}, key=hostile) for i in range(3)]
    kill(engine, ids, "message", last_error=hostile)
    server = serve(token=TOKEN)
    cookie = login(server)
    filters = {"state": "dead", "key": hostile, "field": "v", "value": hostile}
    filters["error"] = hostile
    page = get(server, query(**filters, limit="2"), Cookie=cookie)
    assert page.status == 200 and shown(page.body) == ids[:2]
    for body in (page.body,):
        assert "<script>alert" not in body and 'onfocus="' not in body
    nxt = re.search(r'id="next" href="([^"]+)"', page.body)
    assert nxt, page.body[-3000:]
    following = get(server, html.unescape(nxt[1]), Cookie=cookie)
    assert shown(following.body) == ids[2:]
    fields = hidden(page.body, "bulk-form")
    assert {k: fields[k] for k in filters} == filters
    confirm = _confirm(server, cookie, page.body, "filter", "purge")
    assert "<script>alert" not in confirm and 'onfocus="' not in confirm
    assert re.search(r'id="count"><strong>3</strong>', confirm), confirm
    back = hidden(confirm, "confirm-form")
    assert {k: back[k] for k in filters} == filters
    same = {"Cookie": cookie, "Origin": origin(server)}
    done = post(server, "/groups/g/purge", {**back, "reason": SCRIPT}, **same)
    assert done.status == 303
    [audit] = monitor.audit(engine, "g")
    assert (audit["count"], audit["reason"]) == (3, SCRIPT)
    after = get(server, done.header("Location"))
    assert "<script>alert" not in after.body and "purged 3" in after.body


def test_a_hostile_dedupe_key_is_shown_visible_carried_exactly_and_requeued(engine, serve):
    """A dedupe key holding markup, an attribute break-out and control characters:
    no markup and no raw control character on the page (the input shows it made
    visible), the bulk form's hidden field carries it exactly, and the
    confirmation counts and the requeue changes exactly its one row."""
    group(engine)
    hostile = f"{SCRIPT}{ATTR}\x1b[2J\tacct\u202e"
    mine = pgq.publish(engine, "t", {"i": 1}, dedupe_key=hostile)
    lookalike = pgq.publish(engine, "t", {"i": 2}, dedupe_key=hostile.replace("\t", "\\t"))
    kill(engine, [mine, lookalike], "message")
    server = serve(token=TOKEN)
    cookie = login(server)
    page = get(server, query(state="dead", dedupe=hostile), Cookie=cookie)
    assert page.status == 200 and shown(page.body) == [mine]
    assert "<script>alert" not in page.body and 'onfocus="' not in page.body
    assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f\u202e]", page.body)
    field = re.search(r'<input name="dedupe" value="([^"]*)">', page.body)
    assert field and "\\x1b[2J" in html.unescape(field[1]), page.body[:3000]
    assert hidden(page.body, "bulk-form")["dedupe"] == hostile
    confirm = _confirm(server, cookie, page.body, "filter", "requeue")
    assert "<script>alert" not in confirm and "\x1b" not in confirm
    assert re.search(r'id="count"><strong>1</strong>', confirm), confirm
    back = hidden(confirm, "confirm-form")
    assert back["dedupe"] == hostile
    same = {"Cookie": cookie, "Origin": origin(server)}
    done = post(server, "/groups/g/requeue", {**back, "reason": "fixed"}, **same)
    assert done.status == 303, done.body[:2000]
    [audit] = monitor.audit(engine, "g")
    assert audit["message_ids"] == [mine]
    now = {m: r.state for m, r in rows(engine, "g").items()}
    assert (now[mine], now[lookalike]) == ("ready", "dead")


def test_hostile_topics_page_arguments(engine, board, serve):
    server = serve()
    for removed in ("\x00", "g'--", SCRIPT, "x" * 5000):
        for done in ("1", "-1", "9" * 40, "x"):
            answer = get(
                server, "/topics?" + urllib.parse.urlencode({"removed": removed, "done": done})
            )
            assert answer.status == 200, (removed[:20], done, answer.body[:1000])
            assert "<script>alert" not in answer.body and 'id="result"' not in answer.body
