"""The history checker: after a chaos run, was anything lost, stuck, or run twice unexplained?

    summary = history.check(
        engine, "chaos", out,                     # topic, directory of the attempt logs
        record=drivers.record,                    # or published=[ids]
        faults=history.fault_windows(members.events, proxy.faults),
        lease=2.0, member_ttl=1.0, cli_env=env,   # env: `pgq status --json` runs with it
    )
    print(summary)
    assert summary.lost == [] and summary.ok, summary

It reads the handler logs (`chaos.handlers`: one `start` and one `ok` line per
attempt, per member process) and the database, and checks, for every group of
the topic and every published id the group must have (see `expected`):

- the id is resolved: `done` (its row, or no row because it was pruned behind the
  frontier and a handler logged `ok` for it) or `dead` with an error class;
  otherwise it is **lost** (no row and never handled, or still ready/leased);
- every extra `ok` (a duplicate handling) is explained: the row's `reclaims` > 0,
  or a member that handled the message was killed, or paused past its lease, or
  the network failed (a proxy fault) around the handlings; else **unexplained**;
  and per group the duplicates never outnumber `totals.reclaimed`;
- no delivery row exists without its message (**orphans**, any group of the schema);
- no row is leased by a member that is not live, past its lease's expiry;
- `pgq status GROUP --json` agrees with the logs: `done` = the ids handled and not
  dead, `dead` = the dead rows, and after the drain nothing ready, leased or lagging;
- with `frontier=` a `chaos.frontier.FrontierWatch` that sampled the run: no
  group's frontier ever passed a ready or leased row, nor moved back;
- with `effects=` (group -> effect table, `create_effects`): those groups'
  members are transactional (`tests/tx_member.py`, single or batch): each writes
  one effect row per message in the transaction that acks it, and logs no
  attempts. Their effect rows are their history: every id the group must have and
  that is not dead has exactly one effect row (**effects** = messages, 0
  duplicates, 0 missing), whatever was killed, paused or cut: a duplicate is never
  excused there, a stale attempt's writes must have rolled back.

On a Citus schema (`pgq init --distributed`) the checker reads the same things
with statements Citus can run: orphans are found by comparing the two tables'
ids (`delivery` and `message` are not co-located), not by a join.

Which ids a group must have: every published id, except, for a group a driver
subscribed (`start="earliest"`), an id whose publish had committed before the
subscribe began and that was already gone (deleted by retention) right after it
returned. Anything else missing is lost, whatever retention did.

Times are wall-clock (`time.time()`) throughout: the members, the proxy and the
drivers run on this machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from helpers import PGQ, across_groups, spans_groups
from sqlalchemy import Engine, select, text

import pgq
from pgq import schema as t
from pgq.store import group_info, placement

from .drivers import Published, Record
from .frontier import FrontierWatch

REPORTS: list[str] = []
"""Reports a test wants shown at the end of the pytest run (`publish`)."""


def publish(report: str) -> None:
    """Show `report` in the terminal summary of this pytest run, and append it to the
    file `$CHAOSQ_REPORT` when that is set (for notes after long runs)."""
    REPORTS.append(report)
    path = os.environ.get("CHAOSQ_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')}\n{report}\n\n")


@dataclass(frozen=True)
class Attempt:
    """One line of an attempt log."""

    at: float
    pid: int
    member: str
    group: str
    id: int
    attempt: int
    event: str  # start | ok | failed


def read_attempts(out: Path) -> tuple[list[Attempt], int]:
    """Every attempt line under `out` (files `attempts-*`), sorted by time; and the
    number of lines that did not parse."""
    found: list[Attempt] = []
    bad = 0
    for path in sorted(out.glob("attempts-*")):
        for line in path.read_text(errors="replace").splitlines():
            parts = line.split()
            if len(parts) != 7:
                bad += 1
                continue
            try:
                at, pid, member, group, mid, attempt, event = parts
                found.append(
                    Attempt(float(at), int(pid), member, group, int(mid), int(attempt), event)
                )
            except ValueError:
                bad += 1
    found.sort(key=lambda a: a.at)
    return found, bad


def read_ids(out: Path, group: str, event: str = "ok") -> list[int]:
    """The ids logged with `event` in `group`, in time order (duplicates kept)."""
    return [a.id for a in read_attempts(out)[0] if a.group == group and a.event == event]


@dataclass(frozen=True)
class FaultWindow:
    """A fault over [start, end] (wall clock): `kill9` or `pause` of `member`, or a
    network fault (`cut`, `stall`, `refuse`: member None, it hits everyone)."""

    kind: str
    member: str | None
    start: float
    end: float

    def overlaps(self, start: float, end: float) -> bool:
        return self.start <= end and self.end >= start


def fault_windows(
    proc_events: Iterable[Any] = (), proxy_faults: Iterable[Any] = (), lease: float = 0.0
) -> list[FaultWindow]:
    """Fault windows from `procs.Members.events` and `proxy.Proxy.faults`.

    A pause counts only when it lasted at least `lease` (past its lease); one
    never resumed lasts until now.
    """
    now = time.time()
    windows: list[FaultWindow] = []
    stopped: dict[str, float] = {}
    for event in sorted(proc_events, key=lambda e: e.at):
        if event.kind == "kill9":
            windows.append(FaultWindow("kill9", event.member, event.at, event.at))
            stopped.pop(event.member, None)
        elif event.kind == "stop":
            stopped[event.member] = event.at
        elif event.kind == "cont" and event.member in stopped:
            start = stopped.pop(event.member)
            if event.at - start >= lease:
                windows.append(FaultWindow("pause", event.member, start, event.at))
    windows += [FaultWindow("pause", m, start, now) for m, start in stopped.items()]
    for fault in proxy_faults:
        end = fault.end if fault.end is not None else now
        windows.append(FaultWindow(fault.kind, None, fault.start, end))
    return windows


@dataclass
class GroupResult:
    """What the checker found in one group."""

    expected: int = 0
    excused: int = 0
    done: int = 0
    dead: int = 0
    handled: int = 0  # ok lines
    duplicates: int = 0
    status: dict[str, Any] = field(default_factory=dict)


@dataclass
class EffectResult:
    """A transactional group's effect rows against its messages."""

    messages: int = 0  # ids the group must have, not dead
    effects: int = 0  # effect rows
    duplicates: int = 0  # effect rows beyond the first of an id
    missing: int = 0  # ids (not dead) without an effect row
    unexpected: int = 0  # effect rows of ids the group need not have, or dead


def create_effects(engine: Engine, schema: str, group: str) -> str:
    """The effect table of transactional group `group` (no unique key: a duplicate
    effect is a second row); its quoted name, for `tx_member.py` and `check`."""
    table = f'"{schema}"."effects_{group}"'
    with engine.begin() as conn:
        conn.execute(
            text(
                f"CREATE TABLE {table} (message_id bigint NOT NULL, attempt int, member text,"
                " at timestamptz NOT NULL DEFAULT clock_timestamp())"
            )
        )
    return table


def read_effects(engine: Engine, group: str, table: str) -> list[Attempt]:
    """The effect rows of `table` as the `ok` attempts of `group`, in commit-time order."""
    with engine.connect() as conn:
        found = conn.execute(
            text(
                f"SELECT message_id, attempt, member, extract(epoch FROM at) FROM {table}"
                " ORDER BY at"
            )
        ).all()
    return [
        Attempt(float(at), 0, member or "?", group, int(mid), int(n or 0), "ok")
        for mid, n, member, at in found
    ]


@dataclass
class Summary:
    """The verdict. `lost` must be empty and `problems` too (`ok`)."""

    topic: str
    published: int = 0
    groups: dict[str, GroupResult] = field(default_factory=dict)
    retained: int = 0  # messages the retention driver deleted
    handled: int = 0  # ok lines, all groups
    distinct: int = 0  # (group, id) handled at least once
    duplicates: Counter[str] = field(default_factory=Counter)  # explanation -> count
    duplicate_details: list[str] = field(default_factory=list)
    unexplained: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    dead: list[str] = field(default_factory=list)  # "group id class reclaims attempts error"
    dead_after_ok: list[str] = field(default_factory=list)
    orphans: list[str] = field(default_factory=list)
    stale_leases: list[str] = field(default_factory=list)
    status_mismatch: list[str] = field(default_factory=list)
    frontier: list[str] = field(default_factory=list)  # passed an unresolved row, moved back
    effects: dict[str, EffectResult] = field(default_factory=dict)  # transactional groups
    effect_details: list[str] = field(default_factory=list)  # duplicate or missing effects
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def expected(self) -> int:
        return sum(g.expected for g in self.groups.values())

    def __str__(self) -> str:
        lines = [
            f"history of topic {self.topic!r}: published={self.published}"
            f" groups={len(self.groups)} deliveries_expected={self.expected}"
            f" handled={self.handled} distinct={self.distinct}"
            f" duplicates={sum(self.duplicates.values())} lost={len(self.lost)}"
            f" dead={len(self.dead)} orphans={len(self.orphans)} retained={self.retained}"
            f" verdict={'OK' if self.ok else 'FAIL'}",
        ]
        for name, g in self.groups.items():
            lines.append(
                f"  group {name}: expected={g.expected} excused_by_retention={g.excused}"
                f" done={g.done} dead={g.dead} handled={g.handled} duplicates={g.duplicates}"
                f" status_counts={g.status.get('counts')} totals={g.status.get('totals')}"
            )
        for name, e in self.effects.items():
            lines.append(
                f"  effects of transactional group {name}: messages={e.messages}"
                f" effects={e.effects} duplicates={e.duplicates} missing={e.missing}"
                f" unexpected={e.unexpected}"
            )
        if self.duplicates:
            lines.append(f"  duplicates explained by: {dict(self.duplicates)}")
        for title, items in (
            ("problems", self.problems),
            ("lost", self.lost),
            ("unexplained duplicates", self.unexplained),
            ("dead", self.dead),
            ("dead although a handler succeeded", self.dead_after_ok),
            ("orphan delivery rows", self.orphans),
            ("stale leases", self.stale_leases),
            ("status mismatches", self.status_mismatch),
            ("frontier passed an unresolved message (or moved back)", self.frontier),
            ("effects duplicated or missing", self.effect_details),
            ("notes", self.notes),
        ):
            if items:
                shown = items[:15]
                more = f" (+{len(items) - len(shown)} more)" if len(items) > len(shown) else ""
                lines.append(f"  {title}{more}:")
                lines += [f"    {item}" for item in shown]
        return "\n".join(lines)

    def assert_ok(self) -> None:
        assert self.ok, str(self)


# -- reading the database -------------------------------------------------------------------


def _groups(engine: Engine, topic: str) -> list[str]:
    g, tp = t.consumer_group, t.topic
    with engine.connect() as conn:
        return list(
            conn.execute(
                select(g.c.name)
                .join(tp, tp.c.id == g.c.topic_id)
                .where(tp.c.name == topic)
                .order_by(g.c.id)
            ).scalars()
        )


def _rows(engine: Engine, topic: str) -> dict[str, dict[int, Any]]:
    d, g, tp = t.delivery, t.consumer_group, t.topic
    found: dict[str, dict[int, Any]] = defaultdict(dict)
    with across_groups(engine) as conn:  # every group of the topic
        result = conn.execute(
            select(g.c.name.label("group_name"), d)
            .join(g, g.c.id == d.c.group_id)
            .join(tp, tp.c.id == g.c.topic_id)
            .where(tp.c.name == topic)
        )
        for r in result:
            found[r.group_name][r.message_id] = r
    return found


def orphan_rows(engine: Engine) -> list[tuple[str, int, str]]:
    """Delivery rows (any group of the schema) whose message does not exist."""
    d, g, m = t.delivery, t.consumer_group, t.message
    if placement.distributed(engine):
        return _orphan_rows_apart(engine)
    with engine.connect() as conn:
        return [
            (r.name, int(r.message_id), r.state)
            for r in conn.execute(
                select(g.c.name, d.c.message_id, d.c.state)
                .join(g, g.c.id == d.c.group_id)
                .where(~select(m.c.id).where(m.c.id == d.c.message_id).exists())
                .order_by(d.c.message_id)
            )
        ]


def _orphan_rows_apart(engine: Engine) -> list[tuple[str, int, str]]:
    """`orphan_rows` without joining `delivery` to `message` (on Citus they are not
    co-located): both tables' ids in one transaction, compared here."""
    d, g, m = t.delivery, t.consumer_group, t.message
    with engine.begin() as conn:
        conn.exec_driver_sql("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        spans_groups(conn)  # every topic's messages, every group's rows
        messages = set(conn.execute(select(m.c.id)).scalars())
        rows = conn.execute(
            select(g.c.name, d.c.message_id, d.c.state)
            .join(g, g.c.id == d.c.group_id)
            .order_by(d.c.message_id)
        ).all()
    return [(r.name, int(r.message_id), r.state) for r in rows if r.message_id not in messages]


def stale_leases(engine: Engine, group: str, member_ttl: float) -> list[str]:
    """Rows of `group` leased past their expiry by a member that is not live."""
    d, gid = t.delivery, group_info(engine, group).id
    live = {
        m["name"] for m in pgq.status(engine, group, member_ttl=member_ttl)["members"] if m["live"]
    }
    with engine.connect() as conn:
        now = conn.exec_driver_sql("SELECT now()").scalar_one()
        leased = conn.execute(
            select(d.c.message_id, d.c.lease_owner, d.c.lease_expires_at).where(
                d.c.group_id == gid, d.c.state == "leased"
            )
        ).all()
    return [
        f"{group} {r.message_id} leased by {r.lease_owner} (not live),"
        f" expired {(now - r.lease_expires_at).total_seconds():.1f}s ago"
        for r in leased
        if r.lease_owner not in live and r.lease_expires_at is not None and r.lease_expires_at < now
    ]


def cli_status(env: Mapping[str, str], group: str) -> dict[str, Any]:
    """`pgq status GROUP --json` as a real command."""
    out = subprocess.run(
        [*PGQ, "status", group, "--json"],
        env=dict(env),
        capture_output=True,
        text=True,
        timeout=60,
    )
    if out.returncode != 0:
        raise AssertionError(f"pgq status {group} --json exited {out.returncode}: {out.stderr}")
    status: dict[str, Any] = json.loads(out.stdout)
    return status


# -- the check -----------------------------------------------------------------------------


def expected(
    group: str, published: Mapping[int, Published | None], record: Record | None
) -> tuple[list[int], int]:
    """The ids `group` must have, and how many it is excused from (retained before it
    subscribed)."""
    sub = record.subscription(group) if record is not None else None
    if sub is None:
        return sorted(published), 0
    must: list[int] = []
    excused = 0
    for mid, pub in sorted(published.items()):
        if pub is not None and pub.committed < sub.began and mid not in sub.present_after:
            excused += 1
        else:
            must.append(mid)
    return must, excused


def _race_note(group: str, pub: Published | None, record: Record | None) -> str:
    """Whether the publish of a lost message overlapped the group's subscribe."""
    sub = record.subscription(group) if record is not None else None
    if pub is None or sub is None:
        return ""
    if pub.began <= sub.returned and pub.committed >= sub.began:
        how = "in an explicit transaction" if pub.in_tx else "autocommit"
        return f" (published {how} while {group} subscribed: the publish/subscribe race)"
    when = "before" if pub.committed < sub.began else "after"
    return f" (committed {when} {group} subscribed)"


def _explain(
    row: Any,
    starts: Sequence[Attempt],
    dup_end: float,
    faults: Sequence[FaultWindow],
    lease: float,
) -> str | None:
    """Why a message was handled again: the duplicate's attempt ended at `dup_end`;
    `starts` are the attempts of it that began until the duplicate's did (its
    own included). A fault explains it when it hit one of those members (or the
    network) between two leases before the first start and `dup_end`: the
    first holder lost its lease mid-handler or before its outcome was written,
    or the duplicate ran on a lease that had lapsed while its member was stopped."""
    if row is not None and row.reclaims > 0:
        return "reclaim"
    if not starts:
        return None
    window = (starts[0].at - 2 * lease, dup_end)
    handlers = {a.member for a in starts}
    for kind in ("kill9", "pause", "cut", "stall", "refuse"):
        for fault in faults:
            if fault.kind != kind or not fault.overlaps(*window):
                continue
            if fault.member is None or fault.member in handlers:
                return kind if fault.member is None else f"{kind} of {fault.member}"
    return None


def _check_effects(
    summary: Summary,
    group: str,
    must: Sequence[int],
    dead: set[int],
    by_key: Mapping[tuple[str, int], list[Attempt]],
) -> None:
    """A transactional group: one effect row per message it must have and that is
    not dead; none for anything else."""
    res = EffectResult()
    wanted = set(must) - dead
    res.messages = len(wanted)
    for (g, mid), found in by_key.items():
        if g != group:
            continue
        res.effects += len(found)
        if mid not in wanted:
            res.unexpected += len(found)
            summary.effect_details.append(f"{group} {mid}: {len(found)} effects, not expected")
        elif len(found) > 1:
            res.duplicates += len(found) - 1
            by = ", ".join(f"{a.member}#{a.attempt}@{a.at:.2f}" for a in found)
            summary.effect_details.append(f"{group} {mid}: {len(found)} effects by {by}")
    for mid in sorted(wanted):
        if not by_key.get((group, mid)):
            res.missing += 1
            summary.effect_details.append(f"{group} {mid}: no effect")
    summary.effects[group] = res


def check(
    engine: Engine,
    topic: str,
    out: Path,
    *,
    record: Record | None = None,
    published: Iterable[int] | None = None,
    faults: Sequence[FaultWindow] = (),
    lease: float = 2.0,
    member_ttl: float = 1.0,
    cli_env: Mapping[str, str] | None = None,
    settled: bool = True,
    frontier: FrontierWatch | None = None,
    effects: Mapping[str, str] | None = None,
    blocked: Sequence[tuple[float, float]] = (),
) -> Summary:
    """Check the history of `topic` (see the module docstring); never raises on a
    finding, returns them in the `Summary`.

    `published`: ids published besides those in `record`. `cli_env`: run the real
    `pgq status --json` with it (else `pgq.status` in-process). `settled`: the run
    has been drained, so nothing may be ready, leased or lagging. `frontier`: a
    watch that sampled the run (stopped by now); its findings join the verdict.
    `effects`: the transactional groups' effect tables (`create_effects`).
    `blocked`: spans of wall time (`time.time()`) in which the cluster blocked writes
    on purpose (a shard move): a publish refused then (its statement timed out
    waiting) is a note, not a problem; nothing of it committed.
    """
    pubs: dict[int, Published | None] = {}
    if record is not None:
        for p in record.published:
            if p.topic == topic:
                pubs[p.id] = p
    for mid in published or ():
        pubs.setdefault(int(mid), None)
    summary = Summary(topic, published=len(pubs))
    if record is not None and record.errors:
        summary.problems.append(f"drivers failed: {record.errors}")
    if record is not None and record.conflicts:
        during = [
            any(start <= at <= end for start, end in blocked)
            for at in record.refused_at or [0.0] * len(record.conflicts)
        ]
        if any(during):
            summary.notes.append(
                f"{sum(during)} publishes or retention batches refused while the cluster"
                " moved shards"
            )
        if not all(during):
            refused = [c for c, moved in zip(record.conflicts, during, strict=True) if not moved]
            summary.problems.append(
                f"{len(refused)} publishes refused (deadlock or timeout), e.g. {refused[:3]}"
            )
    if record is not None and record.retention:
        summary.retained = len(record.deleted())
        if not summary.retained:
            summary.notes.append(
                f"{len(record.retention)} retention passes deleted nothing"
                " (every group behind on every message the whole time, or retention blocked)"
            )

    attempts, bad = read_attempts(out)
    if bad:
        summary.notes.append(f"{bad} attempt-log lines did not parse")
    effects = dict(effects or {})
    attempts = [a for a in attempts if a.group not in effects]  # their effects tell
    for group, table in effects.items():
        attempts += read_effects(engine, group, table)
    by_key: dict[tuple[str, int], list[Attempt]] = defaultdict(list)
    for a in attempts:
        by_key[(a.group, a.id)].append(a)

    groups = _groups(engine, topic)
    rows = _rows(engine, topic)
    statuses: dict[str, dict[str, Any]] = {}
    if cli_env is not None:  # one `pgq status` process per group, all at once
        with ThreadPoolExecutor(max_workers=max(1, len(groups))) as pool:
            found = pool.map(lambda g: cli_status(cli_env, g), groups)
            statuses = dict(zip(groups, found, strict=True))

    for group in groups:
        res = GroupResult()
        summary.groups[group] = res
        grows = rows.get(group, {})
        must, res.excused = expected(group, pubs, record)
        res.expected = len(must)

        for mid in must:
            row = grows.get(mid)
            oks = [a for a in by_key.get((group, mid), []) if a.event == "ok"]
            if row is not None and row.state == "done":
                res.done += 1
            elif row is not None and row.state == "dead":
                res.dead += 1
                reason = f"{row.error_class} reclaims={row.reclaims} attempts={row.attempts}"
                item = f"{group} {mid} {reason} error={(row.last_error or '')[:80]!r}"
                summary.dead.append(item)
                if row.error_class is None:
                    summary.problems.append(f"dead without a reason: {item}")
                if oks:
                    summary.dead_after_ok.append(f"{item} handled ok {len(oks)}x")
            elif row is None and oks:
                res.done += 1  # pruned behind the frontier (or retained) once done
            elif row is None:
                summary.lost.append(
                    f"{group} {mid}: no delivery row and never handled"
                    + _race_note(group, pubs.get(mid), record)
                )
            else:
                owner = f" by {row.lease_owner}" if row.state == "leased" else ""
                handled = f", handled ok {len(oks)}x" if oks else ""
                summary.lost.append(
                    f"{group} {mid}: still {row.state}{owner} (attempts={row.attempts}"
                    f" reclaims={row.reclaims}{handled})"
                )

        # every handling of this group, published by the drivers or not
        handled_ids: set[int] = set()
        dead_ids = {mid for mid, r in grows.items() if r.state == "dead"}
        for (g, mid), group_attempts in by_key.items():
            if g != group:
                continue
            oks = [a for a in group_attempts if a.event == "ok"]
            res.handled += len(oks)
            if not oks:
                continue
            handled_ids.add(mid)
            if mid not in pubs:
                summary.notes.append(f"{group} {mid}: handled but not published by this run")
            if group in effects:
                continue  # `_check_effects`: a duplicate effect is never excused
            for dup in oks[1:]:
                res.duplicates += 1
                starts = [a for a in group_attempts if a.event == "start" and a.at <= dup.at]
                dup_start = max(
                    (a.at for a in starts if a.member == dup.member and a.pid == dup.pid),
                    default=dup.at,
                )
                # the handlings up to this one's start, this one's included: a member
                # paused mid-handler finishes after the reclaimer, and is the duplicate
                upto = [a for a in starts if a.at <= dup_start] or starts
                why = _explain(grows.get(mid), upto, dup.at, faults, lease)
                handlers = ", ".join(f"{a.member}@{a.at:.2f}" for a in oks)
                detail = f"{group} {mid}: ok by {handlers}"
                if why is None:
                    summary.unexplained.append(detail)
                else:
                    summary.duplicates[why] += 1
                    summary.duplicate_details.append(f"{detail} ({why})")
        summary.handled += res.handled
        summary.distinct += len(handled_ids)
        if group in effects:
            _check_effects(summary, group, must, dead_ids, by_key)

        status = statuses.get(group) or pgq.status(engine, group, member_ttl=member_ttl)
        res.status = status
        counts = status["counts"]
        done_by_logs = len(handled_ids - dead_ids)
        if counts["done"] != done_by_logs:
            summary.status_mismatch.append(
                f"{group}: status done={counts['done']}, the handler logs show"
                f" {done_by_logs} ids handled and not dead"
            )
        if counts["dead"] != len(dead_ids):
            summary.status_mismatch.append(
                f"{group}: status dead={counts['dead']}, {len(dead_ids)} dead rows"
            )
        if settled and (counts["ready"], counts["leased"], status["lag"]) != (0, 0, 0):
            summary.status_mismatch.append(
                f"{group}: not drained: ready={counts['ready']} leased={counts['leased']}"
                f" lag={status['lag']}"
            )
        reclaimed = status["totals"]["reclaimed"]
        if res.duplicates > reclaimed:
            summary.problems.append(
                f"{group}: {res.duplicates} duplicate handlings but only {reclaimed} reclaims"
            )
        summary.stale_leases += stale_leases(engine, group, member_ttl)

    summary.orphans = [f"{g} {mid} {state}" for g, mid, state in orphan_rows(engine)]
    if frontier is not None:
        summary.frontier = frontier.violations + frontier.moved_back
        summary.notes.append(frontier.describe())
        if frontier.errors:
            summary.problems.append(f"the frontier watch failed: {frontier.errors[:3]}")
        elif not frontier.samples:
            summary.problems.append("the frontier watch took no sample")

    for group, e in summary.effects.items():
        if (e.duplicates, e.missing, e.unexpected) != (0, 0, 0) or e.effects != e.messages:
            summary.problems.append(
                f"{group}: {e.effects} effects for {e.messages} messages"
                f" ({e.duplicates} duplicates, {e.missing} missing, {e.unexpected} unexpected)"
            )
    if summary.lost:
        summary.problems.append(f"{len(summary.lost)} deliveries lost")
    if summary.unexplained:
        summary.problems.append(f"{len(summary.unexplained)} unexplained duplicates")
    if summary.orphans:
        summary.problems.append(f"{len(summary.orphans)} delivery rows without their message")
    if summary.stale_leases:
        summary.problems.append(f"{len(summary.stale_leases)} stale leases")
    if summary.status_mismatch:
        summary.problems.append(f"{len(summary.status_mismatch)} status mismatches")
    if summary.frontier:
        summary.problems.append(
            f"{len(summary.frontier)} frontier samples passed an unresolved message or moved back"
        )
    return summary
