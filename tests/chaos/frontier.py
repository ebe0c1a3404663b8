"""A watch on the frontier while a chaos run goes on: it never passes an unresolved message.

    with FrontierWatch(engine, ["billing", "audit"]) as watch:   # samples in a thread
        ...                                                       # the run
    summary = history.check(..., frontier=watch)                  # its findings join the verdict

What `committed` promises (decisions 0003, 0010): every delivery row of the group
at or behind (`committed_xid`, `committed_id`) in (xid, id) order is resolved
(done or dead), so the frontier may prune behind it. The watch samples each group
in turn, every `interval` seconds: one statement reads the group's position and,
in the same snapshot, the ready or leased rows at or behind it. Any such row is a
**violation**; a position lower than the one sampled before is a **move back**.

The statement names only the group's rows, so on Citus it is routed to the node
that holds the group's shard and sees one snapshot there: the frontier's own
(decision 0023 §5). A position counts in the xids of the server that holds the
group (`xid_space`, decision 0047): one in another server's space (a shard that
just moved, not yet rebased by the group's next advance) promises nothing and is
not sampled, and positions are compared only within one space (a move starts the
frontier again in the new node's xids).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from typing import Any

from sqlalchemy import Engine, select, text

from pgq import schema as t
from pgq.store.engine import schema_of

_SAMPLE = """
SELECT f.committed_xid::text AS cx, f.committed_id AS cid, f.xid_space::text AS space,
       f.xid_space IS NOT DISTINCT FROM
           (pg_catalog.pg_control_system()).system_identifier # f.tableoid::bigint AS here,
       ARRAY(SELECT d.message_id::text || ' ' || d.state::text || ' xid ' || d.xid::text
             FROM {schema}.delivery d
             WHERE d.group_id = :gid AND d.state IN ('ready', 'leased')
               AND (d.xid, d.message_id) <= (f.committed_xid, f.committed_id)
             ORDER BY d.message_id
             LIMIT 5) AS behind
FROM {schema}.{table} f
WHERE f.{key} = :gid AND f.committed_id IS NOT NULL
"""


def frontier_table(engine: Engine) -> tuple[str, str]:
    """The table that holds the groups' positions, and its group id column."""
    with engine.connect() as conn:
        has_state = conn.execute(
            text(
                "SELECT EXISTS (SELECT FROM information_schema.columns WHERE table_schema = :s"
                " AND table_name = 'group_state' AND column_name = 'committed_id')"
            ),
            {"s": schema_of(engine)},
        ).scalar()
    return ("group_state", "group_id") if has_state else ("consumer_group", "id")


class FrontierWatch:
    """Samples each group's frontier in a thread; `violations`, `moved_back`, `errors`."""

    def __init__(self, engine: Engine, groups: Iterable[str], interval: float = 0.1) -> None:
        self.engine = engine
        self.groups = list(groups)
        self.interval = interval
        self.samples = 0
        self.advanced: dict[str, int] = {}  # group -> samples that saw it moved on
        self.rebased: dict[str, int] = {}  # group -> samples that saw it in a new xid space
        self.longest_still: dict[str, float] = {}  # group -> longest seconds it did not move
        self._moved_at: dict[str, float] = {}
        self.violations: list[str] = []
        self.moved_back: list[str] = []
        self.errors: list[str] = []
        self._last: dict[str, tuple[str, tuple[int, int]]] = {}  # group -> space, position
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-frontier", daemon=True)

    def _statement(self) -> tuple[Any, dict[str, int]]:
        schema = schema_of(self.engine)
        table, key = frontier_table(self.engine)
        with self.engine.connect() as conn:
            g = t.consumer_group
            found = conn.execute(select(g.c.name, g.c.id).where(g.c.name.in_(self.groups))).all()
        sample = text(_SAMPLE.format(schema=f'"{schema}"', table=table, key=key))
        return sample, {str(name): int(gid) for name, gid in found}

    def sample(self, conn: Any, statement: Any, group: str, gid: int) -> None:
        """One sample of `group`; records what it finds."""
        row = conn.execute(statement, {"gid": gid}).first()
        self.samples += 1
        if row is None:
            return
        if not row.here:  # another server's position: the next advance starts it again
            self._last[group] = ("elsewhere", self._last.get(group, ("", (0, 0)))[1])
            return
        now = (int(row.cx), int(row.cid))
        space, last = self._last.get(group, (row.space, None))
        if space != row.space:
            self.rebased[group] = self.rebased.get(group, 0) + 1
            last = None
        if last is not None and now < last:
            self.moved_back.append(f"{group}: frontier moved back from {last} to {now}")
        if last is None or now > last:  # moved on (or started again in a new space)
            at = time.monotonic()
            if last is not None:
                self.advanced[group] = self.advanced.get(group, 0) + 1
            if group in self._moved_at:
                still = at - self._moved_at[group]
                self.longest_still[group] = max(self.longest_still.get(group, 0.0), still)
            self._moved_at[group] = at
        self._last[group] = (row.space, max(now, last or now))
        if row.behind:
            self.violations.append(
                f"{group}: frontier (xid {now[0]}, id {now[1]}) at {time.time():.2f}"
                f" passed unresolved rows: {list(row.behind)}"
            )

    def _run(self) -> None:
        try:
            statement, gids = self._statement()
        except Exception as exc:  # reported with the verdict
            self.errors.append(f"could not prepare: {type(exc).__name__}: {exc}")
            return
        missing = sorted(set(self.groups) - set(gids))
        if missing:
            self.errors.append(f"groups not found: {missing}")
        while not self._stop.is_set():
            for group, gid in gids.items():
                try:
                    with self.engine.begin() as conn:
                        self.sample(conn, statement, group, gid)
                except Exception as exc:  # keep sampling; reported with the verdict
                    if len(self.errors) < 20:
                        self.errors.append(f"{group}: {type(exc).__name__}: {exc}".splitlines()[0])
                    self._stop.wait(0.5)
            self._stop.wait(self.interval)

    def start(self) -> FrontierWatch:
        self._thread.start()
        return self

    def stop(self, timeout: float = 15.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self._thread.is_alive():
            self.errors.append(f"the frontier watch did not stop within {timeout:g}s")

    def __enter__(self) -> FrontierWatch:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def describe(self) -> str:
        moved = ", ".join(f"{g}={n}" for g, n in sorted(self.advanced.items())) or "none"
        last = ", ".join(f"{g}=id {pos[1][1]}" for g, pos in sorted(self._last.items())) or "none"
        still = ", ".join(f"{g}={s:.1f}s" for g, s in sorted(self.longest_still.items())) or "none"
        return (
            f"frontier watch: samples={self.samples} advances seen: {moved}"
            f" last positions: {last} longest still: {still}"
            f" violations={len(self.violations)} moved_back={len(self.moved_back)}"
            f" errors={len(self.errors)}"
        )
