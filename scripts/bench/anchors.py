"""The anchors (floor, pgqueuer, procrastinate): their own venv, their child command.

The anchors run `../shared/bench/anchors.py --child ...` in their OWN venv
(default `.venv-anchors/`, created on demand from the
`requirements-anchors.txt` next to anchors.py): pgqueuer installs a `pgq`
console script that would clash with ours.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from scripts.bench.common import ROOT, log
from scripts.bench.harness import run_cmd

DEFAULT_ANCHORS = ROOT.parent / "shared" / "bench" / "anchors.py"
DEFAULT_ANCHORS_VENV = ROOT / ".venv-anchors"
ANCHOR_SYSTEMS = ["floor", "floor-2conn", "pgqueuer", "pgqueuer-b100", "procrastinate"]
ANCHOR_VERSIONS = ["pgqueuer", "procrastinate", "asyncpg", "uvloop", "psycopg-pool"]


def anchors_python(args: Any) -> Path:
    return Path(args.anchors_venv) / "bin" / "python"


def anchor_child(phase: str, system: str, dsn: str, n: int, args: Any) -> dict:
    """Run one phase of anchor `system` in the anchors' venv and return its result."""
    cmd = [
        str(anchors_python(args)),
        str(args.anchors),
        "--child",
        phase,
        "--system",
        system,
        "--dsn",
        dsn,
        "--n",
        str(n),
        "--enqueue-batch",
        str(args.batch),
        "--opts",
        "{}",
    ]
    return run_cmd(cmd, args.timeout)


def ensure_anchors_venv(args: Any) -> None:
    """Create the anchors' venv unless it already imports what they need."""
    py = anchors_python(args)
    req = Path(args.anchors).parent / "requirements-anchors.txt"
    if not Path(args.anchors).exists():
        sys.exit(f"anchors harness not found at {args.anchors} (use --anchors)")
    if py.exists():
        probe = [str(py), "-c", "import pgqueuer, procrastinate, asyncpg, psutil"]
        if subprocess.run(probe, capture_output=True).returncode == 0:
            return
    log(f"creating the anchors venv {args.anchors_venv} from {req} ...")
    subprocess.run([_base_python(), "-m", "venv", str(args.anchors_venv)], check=True)
    subprocess.run([str(py), "-m", "pip", "install", "-q", "-r", str(req)], check=True)


def _base_python() -> str:
    """A python3 to create the anchors venv with (the one this venv was made from)."""
    return getattr(sys, "_base_executable", None) or shutil.which("python3") or sys.executable


def anchor_versions(args: Any) -> dict[str, str | None]:
    """The anchors' package versions, as installed in their venv."""
    code = (
        "import importlib.metadata as m, json\n"
        f"names = {ANCHOR_VERSIONS!r}\n"
        "out = {}\n"
        "for n in names:\n"
        "    try: out[n] = m.version(n)\n"
        "    except Exception: out[n] = None\n"
        "print(json.dumps(out))"
    )
    try:
        p = subprocess.run([str(anchors_python(args)), "-c", code], capture_output=True, text=True)
        return json.loads(p.stdout)
    except Exception:
        return {}
