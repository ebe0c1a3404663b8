"""The dashboard's admin tokens, one per person, and their strength rule (issue 21)."""

from __future__ import annotations

import pytest

pytest.importorskip("flask")

from pgq.errors import UsageError
from pgq.web.guard import Guard
from pgq.web.tokens import admin_tokens, parse_tokens, weakness

ALICE = "alice-token-0123456789"
BOB = "bob-token-9876543210xyz"
HOST = "127.0.0.1:8080"


# -- strength -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "token",
    [
        " " * 16,  # accepted before: the report
        "\t" * 20,
        "a" * 16,
        "abababababababababab",
        "abcdefg" * 3,  # 7 different characters
        "x" * 15,
        "0123456789abcde",  # 15
        "0123456789 abcdef",  # a space inside
        "0123456789abcdef\n",  # a newline from `echo` into a file
        "0123456789abcdef\x1b",
    ],
)
def test_weak_tokens_are_refused(token):
    assert weakness(token) is not None
    with pytest.raises(UsageError) as refused:
        admin_tokens({"PGQ_WEB_TOKEN": token})
    message = str(refused.value)
    assert "too weak" in message and "at least 16 characters" in message
    assert token.strip() == "" or token not in message  # never echoed
    assert "\n" not in message


@pytest.mark.parametrize("token", ["0123456789abcdef", "abcdefgh" * 2, "Zx9!Zx9!ab#cdefg"])
def test_strong_enough_tokens_pass(token):
    assert weakness(token) is None
    assert admin_tokens({"PGQ_WEB_TOKEN": token}) == {"admin": token}


# -- named tokens ---------------------------------------------------------------------


def test_tokens_name_their_people_from_every_source():
    environ = {"PGQ_WEB_TOKEN": "admin-token-abcdefgh", "PGQ_WEB_TOKENS": f"alice:{ALICE}"}
    file_text = f"# the on-call engineers\n\nbob:{BOB}\n  carol.d:carol#token-0123456789\n"
    assert admin_tokens(environ, file_text) == {
        "admin": "admin-token-abcdefgh",
        "alice": ALICE,
        "bob": BOB,
        "carol.d": "carol#token-0123456789",  # `#` inside a token is the token's
    }
    assert parse_tokens(f"alice:{ALICE} bob:{BOB}", "$PGQ_WEB_TOKENS") == {
        "alice": ALICE,
        "bob": BOB,
    }


@pytest.mark.parametrize(
    ("environ", "file_text", "says"),
    [
        ({}, None, "--admin needs a token"),
        ({"PGQ_WEB_TOKENS": ""}, "# nobody\n", "--admin needs a token"),
        ({"PGQ_WEB_TOKENS": ALICE}, None, "NAME:TOKEN"),
        ({}, f"ok:{BOB}\n:{ALICE}\n", "tokens file ($PGQ_WEB_TOKENS_FILE) line 2: each entry"),
        ({}, f"bad name:{ALICE}", "NAME:TOKEN"),
        ({"PGQ_WEB_TOKENS": f"alice:{ALICE}"}, f"alice:{BOB}", "'alice' is given a token twice"),
        ({"PGQ_WEB_TOKENS": f"alice:{ALICE} bob:{ALICE}"}, None, "same token"),
        ({}, "alice:" + " " * 16, "the token of 'alice' is too weak"),
        ({}, "alice:aaaaaaaaaaaaaaaaaaaaaaaa", "the token of 'alice' is too weak"),
    ],
)
def test_bad_token_lists_are_one_line_naming_where(environ, file_text, says):
    with pytest.raises(UsageError) as refused:
        admin_tokens(environ, file_text)
    message = str(refused.value)
    assert says in message, message
    assert "\n" not in message and ALICE not in message and BOB not in message


# -- the guard names the person ---------------------------------------------------------


def test_a_session_and_a_bearer_token_name_their_person():
    g = Guard({"alice": ALICE, "bob": BOB})
    s = g.login(ALICE)
    assert s is not None and s.user == "alice"
    same = {"Origin": f"http://{HOST}"}
    assert g.changer(cookie=s.id, headers=same, form_csrf=s.csrf, host=HOST) == "alice"
    bearer = {"Authorization": f"Bearer {BOB}"}
    assert g.changer(cookie=None, headers=bearer, form_csrf=None, host=HOST) == "bob"
    assert g.user_of(ALICE + "x") is None and g.user_of("") is None
    assert Guard(ALICE).user_of(ALICE) == "admin"  # the one token of $PGQ_WEB_TOKEN
