"""The command line: parse the flags, run the modes on one server, print and write results.

`--child PHASE` (hidden) is how the parent starts its children: the same entry
point, dispatched to `children.child_main`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import scripts.bench as package
from scripts.bench.anchors import ANCHOR_SYSTEMS, DEFAULT_ANCHORS_VENV, KNOWN_SYSTEMS
from scripts.bench.children import CHILDREN, child_main
from scripts.bench.common import log
from scripts.bench.harness import Server
from scripts.bench.modes import DEFAULT_N, MODES, all_ok
from scripts.bench.render import footer, write_md
from scripts.bench.targets import mode_targets
from scripts.bench.transactional import all_ok as transactional_ok
from scripts.bench.transactional import mode_transactional

RUNS = {**MODES, "targets": mode_targets, "transactional": mode_transactional}
"""Every mode by name: `targets` runs several of the others (`scripts/bench/targets.py`);
`transactional` is in `scripts/bench/transactional.py`."""


def ints(text: str) -> list[int]:
    """`20000,1_000_000,1e6` -> [20000, 1000000, 1000000]."""
    return [int(float(t)) for t in str(text).replace("_", "").split(",") if t.strip()]


def floats(text: str) -> list[float]:
    return [float(t) for t in str(text).split(",") if t.strip()]


def prefetches(text: str) -> list[int | str | None]:
    """`--compare-prefetch`: comma-separated `prefetch` values; `default` = not passed."""
    words = [t.strip() for t in text.split(",") if t.strip()]
    if not words:
        raise argparse.ArgumentTypeError("an empty list")
    return [None if w.lower() == "default" else prefetch(w) for w in words]


def prefetch(text: str) -> int | str:
    """`--prefetch`: an integer >= 1, `auto` (2 × workers) or `adaptive`, as `Consumer`
    takes it."""
    word = text.strip().lower()
    if word in ("auto", "adaptive"):
        return word
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not an integer, 'auto' or 'adaptive': {text!r}"
        ) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, 'auto' or 'adaptive': {text!r}")
    return value


def milliseconds(text: str) -> float:
    """`--handler-ms`: a number of milliseconds >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value >= 0:  # also rejects nan
        raise argparse.ArgumentTypeError(f"must be >= 0: {text!r}")
    return value


def parent_main(args: argparse.Namespace) -> int:
    """Run the modes asked for; 0 when every run passed its checks, else 1."""
    modes = list(dict.fromkeys((["compare"] if args.compare else []) + args.modes))
    if not modes:
        sys.exit(
            "nothing to do: give a mode (compare, publish, consume, latency, sustained, backlog, "
            "tablesize, profile, targets, transactional) or --compare; see --help"
        )
    for m in modes:
        if m not in RUNS:
            sys.exit(f"unknown mode {m!r}; known: {', '.join(RUNS)}")
    n_given = args.n is not None
    args.n = ints(args.n) if n_given else [20_000]
    args.workers = ints(args.workers)
    args.procs = ints(args.procs)
    args.rate = floats(args.rate)
    args.anchors = Path(args.anchors) if args.anchors else None
    unknown = [s for s in args.systems.split(",") if s and s not in (*KNOWN_SYSTEMS, "none")]
    if unknown and args.anchors is None:
        sys.exit(f"unknown anchor(s) {', '.join(unknown)}; known: {', '.join(KNOWN_SYSTEMS)}")
    t0 = time.perf_counter()
    report: dict[str, Any] = {"argv": sys.argv[1:]}
    sections: list[str] = []
    srv = Server()
    try:
        report["meta"] = srv.meta()
        for m in modes:
            saved = args.n
            if not n_given and m in DEFAULT_N:
                args.n = DEFAULT_N[m]
            log(f"== {m}")
            sections += [*RUNS[m](srv, args, report), ""]
            args.n = saved
    finally:
        srv.close()
    report["meta"]["total_s"] = time.perf_counter() - t0
    text = "\n".join(sections + footer(report)) + "\n"
    print(text)
    if args.md:
        write_md(Path(args.md), args.md_section or "+".join(modes), text)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str))
    return 0 if all_ok(report) and transactional_ok(report) else 1


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="scripts/bench",
        description=package.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "modes",
        nargs="*",
        help="compare, publish, consume, latency, sustained, backlog, tablesize, profile, targets, "
        "transactional",
    )
    ap.add_argument(
        "--compare",
        action="store_true",
        help="pgq and the anchors in one table (same as mode 'compare')",
    )
    ap.add_argument(
        "--n",
        default=None,
        help="messages per run; a comma list for consume/backlog "
        "(default 20000; backlog 20000,1000000)",
    )
    ap.add_argument(
        "--workers",
        default="8",
        help="pgq Consumer workers; a comma list makes one entry each (default 8)",
    )
    ap.add_argument(
        "--procs",
        default="1",
        help="consume: consumer PROCESSES draining one backlog together, a comma list (default 1)",
    )
    ap.add_argument(
        "--handler-ms",
        type=milliseconds,
        default=0.0,
        metavar="MS",
        help="consume/compare: each pgq consumer's handler sleeps MS ms per message "
        "(default 0: a no-op handler; the anchors' handlers stay no-ops)",
    )
    ap.add_argument(
        "--compare-prefetch",
        type=prefetches,
        default=None,
        metavar="LIST",
        help="compare: one pgq entry per prefetch in LIST, e.g. 'default,adaptive' "
        "('default': not passed); overrides --prefetch there",
    )
    ap.add_argument(
        "--prefetch",
        type=prefetch,
        default=None,
        metavar="P",
        help="consume/compare: pgq Consumer(prefetch=P), an integer, 'auto' or 'adaptive' "
        "(default: not passed, the Consumer's own default)",
    )
    ap.add_argument(
        "--reps",
        type=int,
        default=3,
        help="runs per entry, round-robin; median reported (default 3)",
    )
    ap.add_argument(
        "--batch", type=int, default=1000, help="messages per publish_many / anchor enqueue call"
    )
    ap.add_argument(
        "--systems",
        default="",
        help=f"anchors for --compare (default {','.join(ANCHOR_SYSTEMS)}; "
        f"known: {','.join(KNOWN_SYSTEMS)}; 'none': pgq alone)",
    )
    ap.add_argument(
        "--payload", default="i,1k", help="publish: payload kinds, 'i' ({\"i\": n}) and/or '1k'"
    )
    ap.add_argument(
        "--single",
        type=int,
        default=2000,
        help="publish: single publish() calls timed (default 2000)",
    )
    ap.add_argument(
        "--latency-msgs", type=int, default=500, help="latency: messages published (default 500)"
    )
    ap.add_argument(
        "--interval",
        type=float,
        default=0.02,
        help="latency: seconds between publishes (default 0.02)",
    )
    ap.add_argument(
        "--idle-seconds", type=float, default=5.0, help="latency: idle CPU window (default 5)"
    )
    ap.add_argument(
        "--rate",
        default="1000,5000",
        help="sustained: target total msgs/s, comma list (default 1000,5000)",
    )
    ap.add_argument(
        "--duration", type=float, default=10.0, help="sustained: seconds of publishing (default 10)"
    )
    ap.add_argument(
        "--producers", type=int, default=2, help="sustained: publisher processes (default 2)"
    )
    ap.add_argument(
        "--total",
        type=int,
        default=2_000_000,
        help="tablesize: messages pushed through (default 2,000,000)",
    )
    ap.add_argument(
        "--chunk", type=int, default=100_000, help="tablesize: messages per chunk (default 100,000)"
    )
    ap.add_argument("--profile-out", default="", help="profile: raw py-spy output file")
    ap.add_argument(
        "--profile-rate", type=int, default=250, help="profile: py-spy samples/s (default 250)"
    )
    ap.add_argument(
        "--no-analyze",
        dest="analyze",
        action="store_false",
        help="skip the untimed ANALYZE between publish and consume",
    )
    ap.add_argument(
        "--anchors",
        default="",
        metavar="PATH",
        help="run the anchors with another program that takes the same child command line "
        "(e.g. a reference anchors.py; default: scripts/bench/anchor_systems)",
    )
    ap.add_argument(
        "--anchors-venv",
        default=str(DEFAULT_ANCHORS_VENV),
        help="the anchors' own venv (default .venv-bench/; created, or updated, on demand "
        "from scripts/bench/requirements-anchors.txt)",
    )
    ap.add_argument("--timeout", type=float, default=600, help="per child process timeout, seconds")
    ap.add_argument(
        "--md",
        default="",
        help="write the results markdown here; in an existing file only the section between "
        "'<!-- bench:NAME -->' and '<!-- /bench:NAME -->' is replaced (appended if missing)",
    )
    ap.add_argument(
        "--md-section", default="", help="NAME of that section (default: the modes, '+'-joined)"
    )
    ap.add_argument("--json", default="", help="write every raw measurement here")
    # internal: child processes
    ap.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    ap.add_argument("--dsn", help=argparse.SUPPRESS)
    ap.add_argument("--opts", default="", help=argparse.SUPPRESS)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.child:
        args.n = int(args.n or 0)
        return child_main(args)
    return parent_main(args)
