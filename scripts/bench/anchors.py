"""The anchors' side of the parent: their bench venv and their child command.

The anchors (floor, pgqueuer, procrastinate, awa: `anchor_systems/`) run in a
venv of their own, `.venv-bench/` at the checkout's root by default, which
this module creates on demand from `requirements-anchors.txt` next to it and
brings up to date whenever that file changes (a copy of it inside the venv
records what was installed). They never share pgq's venv: pgqueuer installs
a `pgq` console script that would shadow ours.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from scripts.bench.anchor_systems import DEFAULT_SYSTEMS, SYSTEMS, VERSION_DISTS
from scripts.bench.common import BENCH_DIR, ROOT, log
from scripts.bench.harness import run_cmd

RUNNER = BENCH_DIR / "anchor_systems"
REQUIREMENTS = BENCH_DIR / "requirements-anchors.txt"
DEFAULT_ANCHORS_VENV = ROOT / ".venv-bench"
ANCHOR_SYSTEMS = DEFAULT_SYSTEMS
KNOWN_SYSTEMS = list(SYSTEMS)
STAMP = "requirements-anchors.txt"
"""The copy of the requirements last installed, inside the venv."""


def anchors_python(args: Any) -> Path:
    return Path(args.anchors_venv) / "bin" / "python"


def anchor_program(args: Any) -> str:
    """The anchors' child program: ours, or `--anchors PATH` (same command line)."""
    return str(args.anchors) if getattr(args, "anchors", None) else str(RUNNER)


def anchor_child(phase: str, system: str, dsn: str, n: int, args: Any) -> dict:
    """Run one phase of anchor `system` in the bench venv and return its result."""
    cmd = [
        str(anchors_python(args)),
        anchor_program(args),
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
    """Create the bench venv, or reinstall into it, unless it already holds
    exactly what `requirements-anchors.txt` pins."""
    venv = Path(args.anchors_venv)
    py = anchors_python(args)
    stamp = venv / STAMP
    wanted = REQUIREMENTS.read_text()
    if py.exists() and stamp.exists() and stamp.read_text() == wanted:
        return
    if not py.exists():
        log(f"creating the bench venv {venv} ...")
        subprocess.run([_base_python(), "-m", "venv", str(venv)], check=True)
    log(f"installing {REQUIREMENTS.relative_to(ROOT)} into {venv} ...")
    subprocess.run(
        [
            str(py),
            "-m",
            "pip",
            "install",
            "-q",
            "--disable-pip-version-check",
            "-r",
            str(REQUIREMENTS),
        ],
        check=True,
    )
    stamp.write_text(wanted)


def _base_python() -> str:
    """A python3 to create the bench venv with (the one this venv was made from)."""
    return getattr(sys, "_base_executable", None) or shutil.which("python3") or sys.executable


def anchor_versions(args: Any) -> dict[str, str | None]:
    """The anchors' package versions, as installed in the bench venv."""
    code = (
        "import importlib.metadata as m, json\n"
        "out = {}\n"
        f"for name in {VERSION_DISTS!r}:\n"
        "    try: out[name] = m.version(name)\n"
        "    except m.PackageNotFoundError: out[name] = None\n"
        "print(json.dumps(out))"
    )
    try:
        p = subprocess.run([str(anchors_python(args)), "-c", code], capture_output=True, text=True)
        return json.loads(p.stdout)
    except (OSError, ValueError):
        return {}
