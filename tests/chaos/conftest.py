"""Fixtures of the chaos toolkit: a proxy to this run's server, a directory for the
attempt logs, and member processes that never outlive the test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import pgq

from . import history
from .procs import InProcessMembers, Members
from .proxy import Proxy


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The history checker's summaries of this run, at the end, even without `-s`."""
    if history.REPORTS:
        terminalreporter.section("chaos history")
        for report in history.REPORTS:
            terminalreporter.write_line(report)


@pytest.fixture
def proxy(pg_dsn: str) -> Iterator[Proxy]:
    """A proxy in front of the test server; `proxy.dsn(pg_dsn)` goes through it."""
    with Proxy.for_dsn(pg_dsn) as p:
        yield p
    assert p.threads_alive() == 0


@pytest.fixture
def out(tmp_path: Path) -> Path:
    """Where the members' attempt logs (and stderr logs) go."""
    path = tmp_path / "out"
    path.mkdir()
    return path


@pytest.fixture
def members(pgq_env: dict[str, str], out: Path, proxy: Proxy, pg_dsn: str) -> Iterator[Members]:
    """Member processes whose connections all go through `proxy`."""
    with Members(pgq_env, out, dsn=proxy.dsn(pg_dsn)) as m:
        yield m


@pytest.fixture
def in_process(pg_dsn: str, schema: str, proxy: Proxy, out: Path) -> Iterator[InProcessMembers]:
    """In-process members through the proxy, stopped at the end (see `InProcessMembers`)."""
    engine = pgq.connect(proxy.dsn(pg_dsn), schema=schema)
    consumers = InProcessMembers(engine, out)
    try:
        yield consumers
    finally:
        consumers.stop()
        engine.dispose()
