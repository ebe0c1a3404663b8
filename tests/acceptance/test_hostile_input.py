"""Hostile or careless input cannot hurt (issue 21): a setting that defeats its own
purpose, a config file that never ends, a secret in the DSN, a signal at any moment.

Every test runs the real `pgq` command (a subprocess, or click's runner where no
signal or process matters) and bounds it in time.
"""

from __future__ import annotations

import pytest
from helpers import assert_usage_error, invoke


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
