"""Attack: `/login` takes cross-site POSTs.

Every change checks that the browser says the request came from this site
(`pgq.web.guard.same_origin`); `/login` does not. So any web page an operator
opens can make their browser post to `http://127.0.0.1:8080/login` (the
default address; a form needs no CORS):

- five wrong tokens, and the operator's address is throttled: their own right
  token is refused with 429 for a minute, again and again while the page stays
  open (through an SSH tunnel every operator is 127.0.0.1: all of them at once);
- a token of the attacker's own (a colleague's, a leaked old one) logs the
  operator's browser in as that person (login CSRF): what the operator then
  requeues or purges is audited under the attacker's name.

A real server over real PostgreSQL, raw HTTP with the headers a browser sends on
a cross-site form POST.
"""

from __future__ import annotations

import pytest

pytest.importorskip("flask")

import test_web
from test_web import origin, post

ALICE = "alice-token-0123456789"
MALLORY = "mallory-token-9876543210xyz"

dead = test_web.dead
serve = test_web.serve
"""test_web's fixtures: group `g` with three dead rows; dashboard servers."""

CROSS_SITE = {"Origin": "https://evil.example", "Sec-Fetch-Site": "cross-site"}
"""What a browser sends with a form another site's page posts to the dashboard."""


def test_cross_site_login_guesses_do_not_lock_the_operator_out(engine, dead, serve):
    server = serve(users={"alice": ALICE})
    for n in range(5):
        post(server, "/login", {"token": f"guess-guess-guess-{n}"}, **CROSS_SITE)
    mine = post(
        server,
        "/login",
        {"token": ALICE},
        Origin=origin(server),
        **{"Sec-Fetch-Site": "same-origin"},
    )
    assert mine.status == 303, mine.everything()


def test_a_cross_site_login_opens_no_session(engine, dead, serve):
    server = serve(users={"alice": ALICE, "mallory": MALLORY})
    answer = post(server, "/login", {"token": MALLORY}, **CROSS_SITE)
    assert answer.header("Set-Cookie") == "", answer.everything()
    assert answer.status == 403, answer.everything()
