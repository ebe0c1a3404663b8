"""The dashboard's admin actions name the person who made them, and token guesses
are throttled (issue 21): a real server over real PostgreSQL, raw HTTP.

Failed before per-person tokens: every change was audited as the one
`user@host (pgq web)` of whoever started `pgq web`, and `/login` answered a
sixth, seventh, ... wrong token with another 403, without end.
"""

from __future__ import annotations

import pytest

pytest.importorskip("flask")

import test_web
from test_web import csrf_of, get, login, origin, post

from pgq import monitor

ALICE = "alice-7f3c9e1b5a2d8064"
BOB = "bob-c4e9a17f03d85b26"

dead = test_web.dead
serve = test_web.serve
"""test_web's fixtures: group `g` with three dead rows; dashboard servers."""


def test_each_change_is_audited_under_the_name_of_whoever_made_it(engine, dead, serve):
    server = serve(users={"alice": ALICE, "bob": BOB})
    cookie = login(server, ALICE)
    page = get(server, "/groups/g", Cookie=cookie)
    assert 'id="user">alice<' in page.body
    form = {"ids": str(dead[0]), "reason": "alice's requeue", "csrf": csrf_of(server, cookie)}
    answer = post(server, "/groups/g/requeue", form, Cookie=cookie, Origin=origin(server))
    assert answer.status == 303, answer.everything()
    bearer = post(
        server, "/groups/g/purge", {"reason": "bob's purge"}, Authorization=f"Bearer {BOB}"
    )
    assert bearer.status == 200, bearer.everything()
    by_bob, by_alice = monitor.audit(engine, "g")  # newest first
    assert (by_alice["action"], by_alice["actor"]) == ("requeue", "alice (pgq web)")
    assert (by_bob["action"], by_bob["actor"]) == ("purge", "bob (pgq web)")


def test_the_single_token_is_the_person_admin(engine, dead, serve):
    server = serve(token=ALICE)
    answer = post(server, "/groups/g/purge", {"reason": "r"}, Authorization=f"Bearer {ALICE}")
    assert answer.status == 200, answer.everything()
    [row] = monitor.audit(engine, "g")
    assert row["actor"] == "admin (pgq web)"


def test_failed_logins_are_throttled_with_retry_after(engine, dead, serve):
    server = serve(users={"alice": ALICE})
    for _ in range(5):
        assert post(server, "/login", {"token": "guess-guess-guess-1"}).status == 403
    for attempt in (
        post(server, "/login", {"token": ALICE}),  # the right token too
        post(server, "/groups/g/purge", {"reason": "r"}, Authorization=f"Bearer {ALICE}"),
    ):
        assert attempt.status == 429, attempt.everything()
        assert 1 <= int(attempt.header("Retry-After")) <= 60
        assert "try again in" in attempt.body
        assert attempt.header("Set-Cookie") == ""
    assert monitor.audit(engine, "g") == []
    assert get(server, "/healthz").status == 200  # reading is never throttled
