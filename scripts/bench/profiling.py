"""Reading a py-spy raw profile of a consumer child: CPU per message by thread role.

`py-spy record -f raw` writes one line per distinct stack, `frame;frame;... count`,
each frame `function (file)`, outermost first. A stack belongs to the thread
role of its outermost `pgq/consumer/` frame past the shared `Role.run` (the
fetcher claims, the acker writes outcomes, ...); worker stacks are split
further by what the worker was doing. The table is keyed on pgq's file
layout: when the consumer's modules move, update `THREAD_FILES`.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

THREAD_FILES = {
    "fetcher.py": "fetcher (claim)",
    "acker.py": "acker (outcome write)",
    "heartbeat.py": "heartbeat (member row, group breaker)",
    "maintenance.py": "maintenance (leases, frontier, retention)",
    "prober.py": "prober",
    "workers.py": "worker",
    "consumer.py": "main thread (run/start/shutdown)",
    "runtime.py": "main thread (run/start/shutdown)",
}
"""The module of a thread's outermost pgq.consumer frame -> the thread's role."""
SHARED_FILES = {"member.py"}
"""Modules every thread starts in (`Role.run`), which say nothing about the role."""
_CONSUMER_FRAME = re.compile(r"\(pgq/consumer/([^)]+)\)$")
_HANDLER_FRAME = re.compile(r"handler \([^)]*children\.py\)$")


def role(frames: list[str]) -> str:
    """The thread role a stack (outermost frame first) was sampled in."""
    for frame in frames:
        m = _CONSUMER_FRAME.search(frame)
        if m is None or m.group(1) in SHARED_FILES:
            continue
        name = THREAD_FILES.get(m.group(1), f"thread in pgq/consumer/{m.group(1)}")
        return _worker_role(frames) if name == "worker" else name
    if any("(psycopg/" in f for f in frames):
        return (
            "driver frames py-spy could not tie to a thread role"
            " (psycopg generators: claim/ack I/O)"
        )
    return "other"


def _worker_role(frames: list[str]) -> str:
    if any(_HANDLER_FRAME.search(f) for f in frames):
        return "worker: handler call"
    if any(f.startswith("report (pgq/consumer/workers.py)") for f in frames):
        return "worker: report outcome (gate, tally, acker submit)"
    if any(f.startswith("ClaimPool.take ") for f in frames):
        return "worker: take from pool (lock, condition)"
    return "worker: other (loop, admit, attempt bookkeeping)"


def analyze_profile(path: str, rate: int, n: int) -> dict[str, Any]:
    """Samples by role, top self frames and top inclusive frames, in µs per message
    (a sample at `rate` Hz is 1/rate s of CPU; the run handled `n` messages)."""
    stacks: Counter[tuple[str, ...]] = Counter()
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        stack, _, cnt = line.rpartition(" ")
        frames = [f for f in stack.split(";") if f]
        # drop the leading "process ..." / "thread (0x...)" pseudo-frames
        frames = [f for f in frames if not f.startswith(("process ", "thread ("))]
        stacks[tuple(frames)] += int(cnt)
    total = sum(stacks.values())
    per = 1e6 / rate / n  # µs of CPU per message per sample
    roles: Counter[str] = Counter()
    leaf: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    role_leaf: dict[str, Counter[str]] = defaultdict(Counter)
    for frames, cnt in stacks.items():
        r = role(list(frames))
        roles[r] += cnt
        if frames:
            leaf[frames[-1]] += cnt
            role_leaf[r][frames[-1]] += cnt
        for f in set(frames):
            incl[f] += cnt
    return {
        "samples": total,
        "rate": rate,
        "n": n,
        "us_per_msg_total": total * per,
        "roles": [(r, c, c * per, c / total * 100) for r, c in roles.most_common()],
        "leaf": [(f, c, c * per, c / total * 100) for f, c in leaf.most_common(25)],
        "inclusive": [(f, c, c * per, c / total * 100) for f, c in incl.most_common(40)],
        "role_leaf": {
            r: [(f, c * per) for f, c in cnt.most_common(8)] for r, cnt in role_leaf.items()
        },
    }
