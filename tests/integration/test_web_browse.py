"""The dashboard as a job browser (issue 23): the messages page's bulk requeue and
purge, the topics page and `unsubscribe`, over raw HTTP against real PostgreSQL.

Each change goes through the guard every change goes through (admin mode, a
session's CSRF token from a same-site page, or a Bearer token) and is audited by
the store functions behind the CLI, under the person's name.
"""

from __future__ import annotations

import http.client
import re
import urllib.parse

import pytest

pytest.importorskip("flask")

import test_web
from helpers import states
from test_web import TOKEN, csrf_of, get, login, origin, post

import pgq
from pgq import monitor

dead = test_web.dead
serve = test_web.serve
"""test_web's fixtures: group `g` with three dead rows (message errors); servers."""

ALICE = "alice-7f3c9e1b5a2d8064"


def hidden(page: str, form_id: str) -> dict[str, str]:
    """The hidden fields of form `form_id` on `page` (one value per name, the last)."""
    form = re.search(rf'<form[^>]*id="{form_id}".*?</form>', page, re.S)
    assert form, page[:3000]
    return dict(re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)">', form[0]))


def test_a_bulk_requeue_of_a_filter_is_confirmed_with_its_count_and_audited_by_name(
    engine, dead, serve
):
    server = serve(users={"alice": ALICE})
    cookie = login(server, ALICE)
    same = {"Cookie": cookie, "Origin": origin(server)}
    page = get(server, "/groups/g/messages?state=dead&field=n&value=1", Cookie=cookie)
    assert page.status == 200 and 'id="bulk-form"' in page.body
    assert page.body.count('name="ids"') == 1  # one checkbox: n=1 matches one row
    form = {**hidden(page.body, "bulk-form"), "scope": "filter", "action": "requeue"}
    assert form["field"] == "n" and form["value"] == "1" and form["state"] == "dead"
    confirm = post(server, "/groups/g/messages/confirm", form, **same)
    assert confirm.status == 200, confirm.body
    assert re.search(r'id="count"><strong>1</strong> dead row matches', confirm.body)
    fields = hidden(confirm.body, "confirm-form")
    assert fields["match"] == "1" and fields["upto"] == str(dead[1])
    pgq.publish(engine, "t", {"n": 1})  # a later match: not in what was confirmed
    done = post(server, "/groups/g/requeue", {**fields, "reason": "n=1 fixed"}, **same)
    assert done.status == 303, done.body
    [row] = monitor.audit(engine, "g")
    assert (row["action"], row["count"], row["message_ids"]) == ("requeue", 1, [dead[1]])
    assert (row["actor"], row["reason"]) == ("alice (pgq web)", "n=1 fixed")
    assert states(engine, "g") == {"dead": 2, "ready": 2}
    # the group page says what was done
    assert f"requeued 1 (audit {row['id']})" in get(server, done.header("Location")).body


def test_a_bulk_purge_of_the_rows_ticked(engine, dead, serve):
    server = serve(token=TOKEN)
    cookie = login(server)
    same = {"Cookie": cookie, "Origin": origin(server)}
    csrf = csrf_of(server, cookie)
    ticked = {"csrf": csrf, "state": "dead", "action": "purge", "scope": "selected"}
    body = "&".join([f"{k}={v}" for k, v in ticked.items()] + [f"ids={dead[0]}", f"ids={dead[2]}"])
    parts = urllib.parse.urlsplit(server.url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    headers = {**same, "Content-Type": "application/x-www-form-urlencoded"}
    conn.request("POST", "/groups/g/messages/confirm", body=body, headers=headers)
    answer = conn.getresponse()
    page = answer.read().decode()
    conn.close()
    assert answer.status == 200, page
    assert "2 rows ticked" in page
    fields = hidden(page, "confirm-form")
    assert fields["ids"] == f"{dead[0]} {dead[2]}"
    done = post(server, "/groups/g/purge", {**fields, "reason": "junk"}, **same)
    assert done.status == 303, done.body
    [row] = monitor.audit(engine, "g")
    assert (row["action"], row["count"], sorted(row["message_ids"])) == (
        "purge",
        2,
        [dead[0], dead[2]],
    )
    assert states(engine, "g") == {"dead": 1}


@pytest.mark.parametrize(
    "path",
    ["/groups/g/messages/confirm", "/groups/g/requeue", "/groups/g/purge", "/groups/g/unsubscribe"],
)
def test_bulk_actions_and_unsubscribe_are_refused_without_csrf_and_when_read_only(
    engine, dead, serve, path
):
    form = {
        "state": "dead",
        "match": "1",
        "upto": str(dead[-1]),
        "action": "requeue",
        "scope": "filter",
        "reason": "refused",
        "force": "1",
    }
    read_only = serve()
    assert post(read_only, path, form).status == 403
    admin = serve(token=TOKEN)
    cookie = login(admin)
    csrf = csrf_of(admin, cookie)
    refused = {
        "no token": ({}, {"Cookie": cookie, "Origin": origin(admin)}),
        "wrong token": ({"csrf": "x" * 43}, {"Cookie": cookie, "Origin": origin(admin)}),
        "cross-site": ({"csrf": csrf}, {"Cookie": cookie, "Origin": "http://evil.example"}),
        "no session": ({"csrf": csrf}, {"Origin": origin(admin)}),
    }
    for name, (extra, headers) in refused.items():
        assert post(admin, path, {**form, **extra}, **headers).status == 403, name
    assert monitor.audit(engine, "g") == []
    assert states(engine, "g") == {"dead": 3}
    # the messages page draws no bulk form for a read-only dashboard or a visitor
    for server, headers in ((read_only, {}), (admin, {})):
        page = get(server, "/groups/g/messages?state=dead", **headers)
        assert page.status == 200 and 'id="bulk-form"' not in page.body
        assert 'name="ids"' not in page.body


def test_the_topics_page_and_unsubscribe_audited_by_name(engine, dead, serve):
    pgq.create_topic(engine, "lonely")
    pgq.subscribe(engine, "g2", "t")
    server = serve(users={"alice": ALICE})
    page = get(server, "/topics")
    assert page.status == 200
    row = re.search(r'<tr data-topic="t">.*?</tr>', page.body, re.S)
    assert row and '<td class="num">3</td>' in row[0]
    assert 'href="/groups/g"' in row[0] and 'href="/groups/g2"' in row[0]
    assert '<tr data-topic="lonely">' in page.body
    cookie = login(server, ALICE)
    same = {"Cookie": cookie, "Origin": origin(server)}
    assert 'id="unsubscribe-form"' in get(server, "/groups/g", Cookie=cookie).body
    form = {"csrf": csrf_of(server, cookie), "reason": "retired"}
    assert post(server, "/groups/g/unsubscribe", {**form, "reason": " "}, **same).status == 400
    done = post(server, "/groups/g/unsubscribe", form, **same)
    assert done.status == 303, done.body
    [row] = monitor.audit(engine, "g")
    assert (row["action"], row["count"], row["actor"], row["reason"]) == (
        "unsubscribe",
        3,
        "alice (pgq web)",
        "retired",
    )
    after = get(server, done.header("Location"))
    assert f"removed group g (3 rows) (audit {row['id']})" in after.body
    assert 'href="/groups/g"' not in after.body
    assert get(server, "/groups/g").status == 404


def test_unsubscribe_is_refused_while_a_member_is_live_unless_forced(engine, dead, serve):
    server = serve(token=TOKEN)
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    with pgq.Consumer(engine, "g", lambda msg: None, workers=1, poll_interval=0.05):
        refused = post(server, "/groups/g/unsubscribe", {"reason": "now"}, **bearer)
        assert refused.status == 400 and "live member" in refused.body
        forced = post(server, "/groups/g/unsubscribe", {"reason": "now", "force": "1"}, **bearer)
        assert forced.status == 200 and "removed group g" in forced.body
    assert [a["action"] for a in monitor.audit(engine, "g")] == ["unsubscribe"]


def test_the_new_pages_keep_the_headers_and_the_host_check(engine, dead, serve):
    """Framing, CSP, nosniff and the DNS-rebinding Host check hold on every new route."""
    server = serve(token=TOKEN)
    for path in ("/groups/g/messages?state=dead", "/topics"):
        page = get(server, path)
        assert page.status == 200, path
        assert page.header("X-Frame-Options") == "DENY"
        assert "frame-ancestors 'none'" in page.header("Content-Security-Policy")
        assert "script-src 'self'" in page.header("Content-Security-Policy")
        assert page.header("X-Content-Type-Options") == "nosniff"
        assert get(server, path, Host="evil.example").status == 400
    for path in ("/groups/g/messages/confirm", "/groups/g/unsubscribe"):
        form = {"reason": "x", "action": "requeue", "scope": "filter"}
        bearer = {"Authorization": f"Bearer {TOKEN}", "Host": "evil.example"}
        assert post(server, path, form, **bearer).status == 400
    assert monitor.audit(engine, "g") == []
