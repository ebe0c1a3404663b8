"""Shared plumbing for the attack scripts: a fresh schema per attack on the local
PostgreSQL, the `pgq` command, and the chaos toolkit of `tests/chaos` on sys.path.

`PGQ_ATTACK_DSN` overrides the server (default postgresql://postgres@127.0.0.1:5432/postgres).
Every script drops its schema at the end (keep it with `PGQ_ATTACK_KEEP=1`).
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
for p in (str(ROOT), str(TESTS)):
    if p not in sys.path:
        sys.path.insert(0, p)

DSN = os.environ.get("PGQ_ATTACK_DSN", "postgresql://postgres@127.0.0.1:5432/postgres")
PGQ = str(Path(sys.executable).with_name("pgq"))
if not Path(PGQ).exists():
    PGQ = str(ROOT / ".venv" / "bin" / "pgq")

from sqlalchemy import text  # noqa: E402

import pgq  # noqa: E402


class Schema:
    """A fresh pgq schema `atk_<name>_<random>`, migrated; dropped on exit."""

    def __init__(self, name: str) -> None:
        self.name = f"atk_{name}_{secrets.token_hex(3)}"
        self.engine = pgq.connect(DSN, schema=self.name)
        pgq.migrate(self.engine)

    def env(self, **extra: object) -> dict[str, str]:
        env = dict(os.environ)
        env["PGQ_DSN"] = DSN
        env["PGQ_SCHEMA"] = self.name
        env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), str(TESTS), str(ROOT)])
        env.update({k: str(v) for k, v in extra.items()})
        return env

    def pgq(
        self, *args: str, input: str | bytes | None = None, timeout: float = 60, **extra: object
    ):
        """Run `pgq *args`; past `timeout` it is killed and `returncode` is None."""
        try:
            return subprocess.run(
                [PGQ, *args],
                env=self.env(**extra),
                input=input,
                capture_output=True,
                timeout=timeout,
                text=not isinstance(input, bytes),
            )
        except subprocess.TimeoutExpired as exc:
            err = exc.stderr or b""
            if isinstance(err, bytes):
                err = err.decode(errors="replace")
            out = exc.stdout or b""
            if isinstance(out, bytes):
                out = out.decode(errors="replace")
            return subprocess.CompletedProcess(
                exc.cmd, None, out, err + f"\n<killed after {timeout:g}s>"
            )

    def sql(self, stmt: str, **params: object):
        with self.engine.begin() as conn:
            return conn.execute(text(stmt), params).all()

    def close(self) -> None:
        self.engine.dispose()
        if os.environ.get("PGQ_ATTACK_KEEP"):
            print(f"kept schema {self.name}")
            return
        admin = pgq.connect(DSN)
        with admin.begin() as conn:
            conn.execute(text(f'DROP SCHEMA IF EXISTS "{self.name}" CASCADE'))
        admin.dispose()

    def __enter__(self) -> Schema:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def states(s: Schema, group: str) -> dict[str, int]:
    rows = s.sql(
        f'SELECT d.state, count(*) FROM "{s.name}".delivery d JOIN "{s.name}".consumer_group g'
        " ON g.id = d.group_id WHERE g.name = :g GROUP BY d.state",
        g=group,
    )
    return {r[0]: r[1] for r in rows}


def verdict(problems: list[str], what: str) -> None:
    """Print the verdict and exit 1 when `problems` (the defect is there), else 0."""
    if problems:
        print(f"DEFECT ({what}):")
        for p in problems:
            print(f"  - {p}")
        sys.exit(1)
    print(f"held: {what}")
    sys.exit(0)
