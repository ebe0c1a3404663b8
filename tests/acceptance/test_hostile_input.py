"""Hostile or careless input cannot hurt (issue 21): a setting that defeats its own
purpose, a config file that never ends, a secret in the DSN, a signal at any moment.

Every test runs the real `pgq` command (a subprocess, or click's runner where no
signal or process matters) and bounds it in time.
"""

from __future__ import annotations

import os
import resource
import subprocess
import time

import pytest
from helpers import PGQ, assert_usage_error, invoke


@pytest.mark.parametrize(
    ("variable", "value", "words"),
    [
        ("PGQ_LEASE", "0.01", "PGQ_LEASE in the environment: '0.01' (must be at least 1 second)"),
        ("PGQ_POLL_INTERVAL", "1ms", "(must be at least 0.05 seconds)"),
        ("PGQ_BREAKER_HEARTBEAT", "0.001", "(must be at least 0.1 seconds)"),
        ("PGQ_RETENTION", "1s", "(must be at least 60 seconds)"),
    ],
)
def test_a_duration_below_its_bound_stops_consume_with_one_line(pgq_env, variable, value, words):
    """Reported: `lease = 0.01` was accepted and a lone member dead-lettered its own rows."""
    result = invoke(
        pgq_env, "consume", "billing", "--handler", "handlers:record", **{variable: value}
    )
    assert_usage_error(result.exit_code, result.output, contains=words)


# -- config files that never end -----------------------------------------------------


def _limit_memory() -> None:
    """In the child: at most 1 GiB of address space, so a file read whole fails fast."""
    resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))


@pytest.mark.parametrize("kind", ["/dev/zero", "fifo", "big"])
def test_a_config_file_that_never_ends_is_one_line_and_exit_2(pgq_env, tmp_path, kind):
    """Reported: `--config /dev/zero` grew to ~4 GB in 6 s."""
    if kind == "/dev/zero":
        path = kind
    elif kind == "fifo":
        path = str(tmp_path / "pgq.toml")
        os.mkfifo(path)
    else:
        path = str(tmp_path / "pgq.toml")
        with open(path, "wb") as fp:
            fp.truncate(2 << 30)  # 2 GiB, sparse
    started = time.monotonic()
    done = subprocess.run(
        [*PGQ, "--config", path, "consume", "billing", "--handler", "handlers:record"],
        env=pgq_env,
        capture_output=True,
        text=True,
        timeout=15,
        preexec_fn=_limit_memory,
    )
    assert time.monotonic() - started < 10
    reason = "larger than 1 MiB" if kind == "big" else "not a regular file"
    assert_usage_error(done.returncode, done.stderr, contains=f"{path}: {reason}")
