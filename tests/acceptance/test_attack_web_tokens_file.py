"""Attack: a tokens file without end; tokens a guesser tries first.

`pgq web --admin --tokens-file` reads the whole file into memory
(`pgq.cli.web._read_tokens`: `f.read()`). Pointed at `/dev/zero` (or a symlink
to it, or any huge file) it takes all the memory it can get, then dies with a
`MemoryError` traceback and exit 1 (without a memory limit: the OOM killer, on
a machine the database may share), where bad input is one line and exit 2. A
real `pgq web` process under a 1 GiB address-space limit, so that the test
cannot exhaust the machine.
"""

from __future__ import annotations

import resource
import signal
import subprocess

import pytest
from helpers import PGQ, assert_usage_error, finish, spawn_pgq, wait_until

pytest.importorskip("flask")

MEMORY = 1 << 30
"""Bytes of address space the `pgq web` process may have."""


def _limited() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY, MEMORY))


@pytest.mark.parametrize("link", [False, True], ids=["dev-zero", "symlink-to-dev-zero"])
def test_a_tokens_file_without_end_is_one_line(engine, pgq_env, tmp_path, link):
    path = "/dev/zero"
    if link:
        (tmp_path / "tokens").symlink_to("/dev/zero")
        path = str(tmp_path / "tokens")
    proc = subprocess.run(
        [*PGQ, "web", "--admin", "--port", "0", "--tokens-file", path],
        env=pgq_env,
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=_limited,
    )
    assert_usage_error(proc.returncode, proc.stderr, contains="tokens file")


@pytest.mark.parametrize(
    "token",
    [
        "0123456789abcdef",  # a sequence
        "abcdefghijklmnop",  # the alphabet
        "qwertyuiopasdfgh",  # a keyboard row
        "password12345678",  # the first guess of every list
        "changeme-changeme",  # a word, twice
    ],
)
def test_a_guessable_admin_token_stops_it_at_start(engine, pgq_env, tmp_path, token):
    """The strength rule counts characters (16, 8 different) and so takes tokens a
    guesser tries first; with five guesses a minute per loopback address
    (test_attack_web_throttle) a local guesser finds them in seconds."""
    log = tmp_path / "web.log"
    proc = spawn_pgq({**pgq_env, "PGQ_WEB_TOKEN": token}, "web", "--admin", "--port", "0", log=log)
    try:
        wait_until(
            lambda: proc.poll() is not None or "pgq web: http" in log.read_text(),
            30,
            "pgq web to stop or listen",
            interval=0.1,
        )
    finally:
        if proc.poll() is None:  # it serves: the token was taken
            proc.send_signal(signal.SIGINT)
        finish(proc, 30)
    err = log.read_text()
    assert_usage_error(proc.returncode, err, contains="too weak")
    assert token not in err
