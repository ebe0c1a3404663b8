"""What every part of the bench shares: names, paths, and the measuring helpers.

No pgq here: the parent, every child and the renderers import it.
"""

from __future__ import annotations

import math
import os
import resource
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parents[1]
"""The pgq checkout the bench lives in (and measures)."""

TOPIC = "bench"
GROUP = "bench-g"
SCHEMA = "pgq"

RESULT = "@@RESULT@@"
"""A child prints this marker, then its result as one line of JSON."""
READY = "@@READY@@"
"""A consumer child started with a barrier prints this once it is ready to go."""


def consumer_opts(args: Any, workers: int) -> dict[str, Any]:
    """A pgq consumer child's options from the flags: `workers`, and `handler_ms` and
    `prefetch` only when given (`--handler-ms`, `--prefetch`; consume and compare)."""
    opts: dict[str, Any] = {"workers": workers}
    if getattr(args, "handler_ms", 0):
        opts["handler_ms"] = args.handler_ms
    if getattr(args, "prefetch", None) is not None:
        opts["prefetch"] = args.prefetch
    return opts


def prefetch_label(prefetch: int | str | None) -> str:
    """`prefetch=50`, `prefetch=auto`, or `prefetch default` when not passed."""
    return "prefetch default" if prefetch is None else f"prefetch={prefetch}"


def share_spread(counts: list[int]) -> float | None:
    """How far apart the processes' shares are: (max - min) / mean, in %."""
    total = sum(counts)
    if len(counts) < 2 or not total:
        return None
    return (max(counts) - min(counts)) / (total / len(counts)) * 100.0


def shares_text(counts: list[int]) -> str:
    """`shares 205/195, 5.0 % apart`: messages handled per process."""
    spread = share_spread(counts)
    apart = f", {spread:.1f} % apart" if spread is not None else ""
    return "shares " + "/".join(f"{c:,}" for c in counts) + apart


def batches(n: int, size: int, start: int = 0) -> Iterator[range]:
    """`range(start, start + n)` in slices of `size`."""
    for lo in range(start, start + n, size):
        yield range(lo, min(start + n, lo + size))


def rss_peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def cpu_s() -> float:
    """This process's CPU time so far (user + system)."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def sys_s() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_stime


def pct(values: list[float], p: float) -> float | None:
    """Nearest-rank percentile."""
    if not values:
        return None
    s = sorted(values)
    k = max(0, min(len(s) - 1, math.ceil(p / 100.0 * len(s)) - 1))
    return s[k]


def med(vals: list[Any]) -> Any:
    """Median of the values that are not None (None if there are none)."""
    vals = [v for v in vals if v is not None]
    return statistics.median(vals) if vals else None


def log(msg: str) -> None:
    """Progress for the person running the bench (stderr; stdout carries results)."""
    print(msg, file=sys.stderr, flush=True)


def busy_cores(before: Any, after: Any) -> tuple[float, float]:
    """Whole-machine busy and steal cores between two `psutil.cpu_times()`."""
    d = {f: getattr(after, f) - getattr(before, f) for f in after._fields}
    tot = sum(d.values()) - d.get("guest", 0) - d.get("guest_nice", 0)
    if tot <= 0:
        return float("nan"), float("nan")
    ncpu = os.cpu_count() or 1
    busy = tot - d["idle"] - d.get("iowait", 0) - d.get("steal", 0)
    return busy / tot * ncpu, d.get("steal", 0) / tot * ncpu


class Meter:
    """Wall time, this process's CPU time, and whole-machine busy cores (as anchors.py)."""

    def __enter__(self) -> Meter:
        self.cpu0 = cpu_s()
        self.sys0 = sys_s()
        self.m0 = psutil.cpu_times()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> bool:
        self.t1 = time.perf_counter()
        self.client_cpu = cpu_s() - self.cpu0
        self.client_sys = sys_s() - self.sys0
        self.busy, self.steal = busy_cores(self.m0, psutil.cpu_times())
        self.wall = self.t1 - self.t0
        return False

    def as_dict(self, prefix: str) -> dict[str, float]:
        return {
            f"{prefix}_s": self.wall,
            f"{prefix}_client_cpu_s": self.client_cpu,
            f"{prefix}_client_sys_s": self.client_sys,
            f"{prefix}_machine_busy_cores": self.busy,
            f"{prefix}_machine_steal_cores": self.steal,
        }
