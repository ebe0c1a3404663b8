"""The dashboard's admin tokens, one per person, their strength rule, and the
throttle on failed attempts: exact, with an injected clock (issue 21)."""

from __future__ import annotations

import math
import os
import random
import threading

import pytest

pytest.importorskip("flask")

from pgq.cli.web import MAX_TOKENS_FILE, _read_tokens
from pgq.errors import UsageError
from pgq.web.guard import Guard, Throttled
from pgq.web.throttle import Throttle, client_of
from pgq.web.tokens import MIN_BITS, admin_tokens, parse_tokens, strength, weakness

ALICE = "alice-7f3c9e1b5a2d8064"
BOB = "bob-c4e9a17f03d85b26"
HOST = "127.0.0.1:8080"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


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


@pytest.mark.parametrize(
    "token",
    [
        "0123456789abcdef",  # a run: passed the character count (the attack)
        "abcdefghijklmnop",
        "fedcba9876543210",  # a run backwards
        "qwertyuiopasdfgh",  # keyboard rows
        "QWERTYUIOPASDFGH",
        "password12345678",  # a common word, then a run
        "PassWord-Admin-Secret",
        "changeme-changeme",  # a repeat
        "abcdefgh" * 2,
        "Zx9!Zx9!ab#cdefg",
        "f3a9c2e7" * 3,  # a short random piece, repeated
    ],
)
def test_guessable_tokens_are_refused_with_the_rule(token):
    assert strength(token) < MIN_BITS
    message = weakness(token)
    assert message is not None and message.startswith("guessable: about ")
    with pytest.raises(UsageError) as refused:
        admin_tokens({"PGQ_WEB_TOKEN": token})
    text = str(refused.value)
    assert "too weak" in text and f"at least {MIN_BITS} bits" in text, text
    assert "openssl rand -hex 16" in text and token not in text


@pytest.mark.parametrize(
    "token", ["4f9a1c7e2b8d6035", "Zx9!Qm4#Lp7$Rt2&", "k8Vq2Lr5Wn7Zt3Hx", ALICE, BOB]
)
def test_strong_enough_tokens_pass(token):
    assert weakness(token) is None
    assert admin_tokens({"PGQ_WEB_TOKEN": token}) == {"admin": token}


def test_random_hex_tokens_always_pass():
    """`openssl rand -hex 16`, as the rule suggests: even its least lucky draws (a
    seeded generator, so a run is repeatable; the least of 20,000 draws scored ~90)."""
    draw = random.Random(2026)
    tokens = [f"{draw.getrandbits(128):032x}" for _ in range(2000)]
    assert [t for t in tokens if weakness(t) is not None] == []
    assert min(strength(t) for t in tokens) > MIN_BITS + 16


def test_strength_counts_guessable_characters_one_bit():
    assert strength("k8Vq2Lr5Wn7Zt3Hx") == pytest.approx(16 * math.log2(62))
    assert strength("abcd") == pytest.approx(math.log2(26) + 3)  # a run
    assert strength("asdf") == pytest.approx(math.log2(26) + 3)  # a keyboard row
    # a piece seen before: guessable from its second character on
    assert strength("k8Vq-k8Vq") == pytest.approx(6 * math.log2(95) + 3)
    assert strength("Password") == pytest.approx(math.log2(52) + 7)  # a word
    assert strength("\u00e9t\u00e9") == pytest.approx(3 * math.log2(126))  # non-ASCII


# -- named tokens ---------------------------------------------------------------------


def test_tokens_name_their_people_from_every_source():
    environ = {"PGQ_WEB_TOKEN": "admin-9d4f2b7e1c6a8350", "PGQ_WEB_TOKENS": f"alice:{ALICE}"}
    file_text = f"# the on-call engineers\n\nbob:{BOB}\n  carol.d:carol#d63a0f9e2b7c4185\n"
    assert admin_tokens(environ, file_text) == {
        "admin": "admin-9d4f2b7e1c6a8350",
        "alice": ALICE,
        "bob": BOB,
        "carol.d": "carol#d63a0f9e2b7c4185",  # `#` inside a token is the token's
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
    s = g.login(ALICE, "10.0.0.1")
    assert s is not None and s.user == "alice"
    same = {"Origin": f"http://{HOST}"}
    assert g.changer(cookie=s.id, headers=same, form_csrf=s.csrf, host=HOST) == "alice"
    bearer = {"Authorization": f"Bearer {BOB}"}
    assert g.changer(cookie=None, headers=bearer, form_csrf=None, host=HOST) == "bob"
    assert g.user_of(ALICE + "x") is None and g.user_of("") is None
    assert Guard(ALICE).user_of(ALICE) == "admin"  # the one token of $PGQ_WEB_TOKEN


# -- throttling ---------------------------------------------------------------------------


def test_five_failures_a_minute_then_429_until_the_oldest_leaves_the_window():
    clock = Clock()
    g = Guard({"alice": ALICE}, clock=clock)
    for k in range(5):
        clock.now = 1000.0 + k
        assert g.login("wrong", "10.0.0.1") is None
    clock.now = 1010.0
    with pytest.raises(Throttled) as throttled:
        g.login(ALICE, "10.0.0.1")  # the right token too: a guesser learns nothing
    assert throttled.value.retry_after == 50  # the first failure (1000) leaves at 1060
    bearer = {"Authorization": f"Bearer {ALICE}"}
    with pytest.raises(Throttled):
        g.changer(cookie=None, headers=bearer, form_csrf=None, host=HOST, address="10.0.0.1")
    assert g.login(ALICE, "10.0.0.2") is not None  # another client is not held back
    clock.now = 1059.5
    with pytest.raises(Throttled) as throttled:
        g.login(ALICE, "10.0.0.1")
    assert throttled.value.retry_after == 1
    clock.now = 1060.0
    assert g.login("wrong", "10.0.0.1") is None  # 1001..1004 and 1060: five in the minute
    with pytest.raises(Throttled) as throttled:
        g.login(ALICE, "10.0.0.1")
    assert throttled.value.retry_after == 1  # 1001 leaves at 1061
    clock.now = 1061.0
    assert g.login(ALICE, "10.0.0.1") is not None  # a success forgets the failures
    for _ in range(4):
        assert g.login("wrong", "10.0.0.1") is None
    assert g.throttle.retry_after("10.0.0.1") == 0


def test_a_bearer_failure_counts_as_a_login_failure():
    clock = Clock()
    g = Guard({"alice": ALICE}, clock=clock)
    bad = {"Authorization": "Bearer guess-guess-guess-guess"}
    for _ in range(5):
        assert g.changer(cookie=None, headers=bad, form_csrf=None, host=HOST, address="::1") is None
    with pytest.raises(Throttled):
        g.login(ALICE, "::1")


def test_an_ipv6_client_is_its_64_and_memory_stays_bounded():
    assert client_of("2001:db8:1:2:aaaa::1") == client_of("2001:db8:1:2:bbbb::7")
    assert client_of("2001:db8:1:3::1") != client_of("2001:db8:1:2::1")
    assert client_of("::ffff:10.0.0.1") == client_of("10.0.0.1") == "10.0.0.1"
    # any local process may connect from any of 127/8: every loopback address is one client
    loopback = {client_of(a) for a in ("127.0.0.1", "127.0.0.2", "127.255.1.9", "::1")}
    assert loopback == {client_of("::ffff:127.0.0.3")} == {"loopback"}
    clock = Clock()
    t = Throttle(limit=2, window=60, max_clients=100, clock=clock)
    for k in range(10_000):
        t.failed(f"10.{k // 65536}.{k // 256 % 256}.{k % 256}")
    assert len(t) == 100
    t.failed("10.9.9.9")
    t.failed("10.9.9.9")
    assert t.retry_after("10.9.9.9") == 60
    assert t.retry_after("10.0.0.0") == 0  # forgotten first: the least recent


# -- the tokens file -------------------------------------------------------------------


def test_a_tokens_file_is_read_up_to_a_mib_a_pipe_too(tmp_path):
    """A file without end (`/dev/zero`) was read whole: a MemoryError traceback."""
    big = tmp_path / "big"
    big.write_bytes(b"#" * MAX_TOKENS_FILE + b"\n")
    with pytest.raises(UsageError, match="larger than 1 MiB"):
        _read_tokens(str(big))
    big.write_bytes(b"#" * (MAX_TOKENS_FILE - 1) + b"\n")
    assert len(_read_tokens(str(big)) or "") == MAX_TOKENS_FILE
    with pytest.raises(UsageError, match="larger than 1 MiB"):
        _read_tokens("/dev/zero")
    fifo = tmp_path / "fifo"  # `--tokens-file <(pass show pgq-web)`
    os.mkfifo(fifo)
    writer = threading.Thread(target=fifo.write_text, args=(f"alice:{ALICE}\n",))
    writer.start()
    try:
        assert _read_tokens(str(fifo)) == f"alice:{ALICE}\n"
    finally:
        writer.join(10)
