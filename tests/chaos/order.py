"""The ordered-group rule of the history checker (DESIGN §7, decision 0044): for every
key, handling intervals never overlap and follow frontier order.

    violations = order.check(engine, out, "g", faults=history.fault_windows(...))
    assert violations == [], violations

It reads the attempt logs (`chaos.handlers`: a `start` line, then `ok` or `failed`,
per attempt) and the keys and frontier positions of the messages (`message.key`,
`message.xid`: a message's delivery rows carry its publishing transaction's xid). For
each key of group `group`:

- **overlap**: two attempts of different messages of the key ran at the same time.
  An attempt that has no end line was cut by a `kill -9`: it ends when its process
  was killed (`kill_times`), else at the end of the logs. An overlap is explained
  when a fault window (a pause past the lease, a network fault) covers either
  attempt: a stale member's handler runs on after its lease was taken over, which
  no lease-based queue can prevent, only fence;
- **order**: an attempt of a message started before the first `ok` of an earlier
  message of its key (in (xid, id) order) that did not die. Never explained: the
  earlier message was unresolved when the later one was leased.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import Engine, select

from pgq import schema as t

from .handlers import FAILED, OK, START
from .history import Attempt, FaultWindow, read_attempts


@dataclass(frozen=True)
class Interval:
    """One attempt: from its `start` line to its `ok`/`failed` line (or its process's death)."""

    id: int
    pid: int
    member: str
    start: float
    end: float
    ended: bool


def frontier_order(engine: Engine, topic: str) -> dict[str, list[int]]:
    """Key -> the ids of `topic`'s keyed messages in frontier order ((xid, id))."""
    m, tp = t.message, t.topic
    query = (
        select(m.c.key, m.c.id)
        .join(tp, tp.c.id == m.c.topic_id)
        .where(tp.c.name == topic, m.c.key.is_not(None))
        .order_by(m.c.xid, m.c.id)
    )
    order: dict[str, list[int]] = defaultdict(list)
    with engine.connect() as conn:
        for key, mid in conn.execute(query):
            order[key].append(int(mid))
    return dict(order)


def intervals(
    attempts: Sequence[Attempt], group: str, kill_times: Mapping[int, float]
) -> dict[int, list[Interval]]:
    """Message id -> its attempts in `group` as intervals, by start."""
    last = max((a.at for a in attempts), default=0.0)
    open_: dict[tuple[int, int, int], Attempt] = {}
    found: dict[int, list[Interval]] = defaultdict(list)
    for a in attempts:
        if a.group != group:
            continue
        slot = (a.pid, a.id, a.attempt)
        if a.event == START:
            open_[slot] = a
        elif a.event in (OK, FAILED) and slot in open_:
            s = open_.pop(slot)
            found[a.id].append(Interval(a.id, a.pid, a.member, s.at, a.at, True))
    for (pid, mid, _), s in open_.items():
        end = kill_times.get(pid, last)
        found[mid].append(Interval(mid, pid, s.member, s.at, end, False))
    for runs in found.values():
        runs.sort(key=lambda i: i.start)
    return found


def check(
    engine: Engine,
    out: Path,
    topic: str,
    group: str,
    *,
    faults: Iterable[FaultWindow] = (),
    kill_times: Mapping[int, float] | None = None,
    dead: Iterable[int] = (),
) -> list[str]:
    """Every violation of the rule in `group` of `topic` (empty when it held)."""
    attempts, _ = read_attempts(out)
    runs = intervals(attempts, group, kill_times or {})
    first_ok = {
        a.id: a.at for a in reversed(attempts) if a.group == group and a.event == OK
    }  # reversed: the earliest `ok` is written last
    windows = list(faults)
    died = set(dead)

    def explained(i: Interval) -> bool:
        return any(
            w.overlaps(i.start, i.end) and w.member in (None, i.member)
            for w in windows
            if w.kind != "kill9"
        )

    violations: list[str] = []
    for key, ids in frontier_order(engine, topic).items():
        # order: nothing of a message starts before every earlier one finished
        done_by = 0.0  # the latest first-`ok` among the earlier messages
        for mid in ids:
            for run in runs.get(mid, []):
                if run.start < done_by:
                    violations.append(
                        f"order: key {key} message {mid} started at {run.start:.6f} before"
                        f" an earlier message of its key first finished ({done_by:.6f})"
                    )
            if mid not in died and mid in first_ok:
                done_by = max(done_by, first_ok[mid])
        # overlap: no two messages of the key at once
        keyed = sorted((r for mid in ids for r in runs.get(mid, [])), key=lambda r: r.start)
        latest: Interval | None = None
        for run in keyed:
            if latest is not None and run.start < latest.end and run.id != latest.id:
                if not (explained(run) or explained(latest)):
                    seen = "; ".join(
                        f"{r.id}@{r.member}/{r.pid} {r.start:.6f}-{r.end:.6f}"
                        + ("" if r.ended else " (cut)")
                        for r in keyed
                    )
                    violations.append(
                        f"overlap: key {key} message {latest.id} ({latest.member},"
                        f" {latest.start:.6f}-{latest.end:.6f}) and message {run.id}"
                        f" ({run.member}, from {run.start:.6f}); the key's attempts: {seen}"
                    )
            if latest is None or run.end > latest.end:
                latest = run
    return violations
