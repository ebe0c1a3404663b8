"""One phase of one anchor in this process: the bench's anchor child.

    <bench venv>/bin/python scripts/bench/anchor_systems --child enqueue|consume
        --system NAME --dsn DSN --n N [--enqueue-batch B] [--opts JSON]

(the reference harness's child command line, so `--anchors PATH` can swap in
another program that speaks it). Prints the `RESULT` marker and the phase's
result as one line of JSON; an exception is a result with `ok: false`.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import traceback
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]


def _import_path() -> None:
    """Run as a directory, Python puts this package's folder first on the path;
    the checkout's root takes its place so `scripts.bench` imports."""
    if not __package__:
        if sys.path and Path(sys.path[0]).resolve() == HERE:
            sys.path[0] = str(ROOT)
        else:
            sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    from scripts.bench.anchor_systems import SYSTEMS
    from scripts.bench.common import RESULT, rss_peak_mb

    ap = argparse.ArgumentParser(prog="scripts/bench/anchor_systems")
    ap.add_argument("--child", choices=["enqueue", "consume"], required=True)
    ap.add_argument("--system", choices=sorted(SYSTEMS), required=True)
    ap.add_argument("--dsn", required=True)
    ap.add_argument("--n", type=int, required=True)
    ap.add_argument("--enqueue-batch", type=int, default=1000)
    ap.add_argument("--opts", default="", help="JSON overriding the system's own options")
    args = ap.parse_args(argv)

    module, own = SYSTEMS[args.system]
    opts = {**own, **json.loads(args.opts or "{}")}
    try:
        runner = importlib.import_module(f"scripts.bench.anchor_systems.{module}")
        if args.child == "enqueue":
            out = runner.enqueue(args.dsn, args.n, args.enqueue_batch, opts)
        else:
            out = runner.consume(args.dsn, args.n, opts)
        out["rss_peak_mb"] = rss_peak_mb()
        out["ok"] = True
    except Exception:
        out = {"ok": False, "error": traceback.format_exc()}
    sys.stdout.write("\n" + RESULT + json.dumps(out) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR.*")
    _import_path()
    sys.exit(main())
