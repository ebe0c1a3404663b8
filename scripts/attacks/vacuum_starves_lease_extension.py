"""A member's VACUUM of a big `delivery` table runs on the maintenance thread, in
the same loop as lease extension: while it runs no lease of that member is
extended, so handlers that outlive `lease` minus the vacuum's duration lose their
rows to another member's sweep and run twice (decision 0021, `Maintenance.vacuum`).

Setup: one topic, group `g` with a 400,000-row backlog and 400,000 dead rows in
`delivery` (a second group's rows deleted: `vacuum_due` says yes). Two members of
`g` (`pgq consume`, lease 3 s, handlers of 1 s). Their sessions run with the
cost-based vacuum delay autovacuum uses by default (`vacuum_cost_delay = 2ms`,
set here in the DSN's `options`; a DBA setting it server-wide to throttle manual VACUUMs
has the same effect) -- or, without it, a table a few times bigger than this one:
the vacuum here takes ~1 s unthrottled per 1.2 M rows on this machine, so any
vacuum longer than the lease starves the extension the same way.

Expected: no lease expires while its handler runs (reclaims stay 0, every message
is handled once). Actual: while one member vacuums, its leases expire, the other
member's sweep reclaims them ("reclaimed expired leases"), the rows run again.

Run: .venv/bin/python scripts/attacks/vacuum_starves_lease_extension.py (~70 s)
Exit 0 once fixed, 1 while the defect exists.
"""

import collections
import os
import subprocess
import sys
import tempfile
import time


def handler(msg):  # `pgq consume --handler vacuum_starves_lease_extension:handler`
    with open(os.environ["ATK_CALLS"], "a") as f:
        f.write(f"{msg.id}\n")
    time.sleep(float(os.environ.get("ATK_SLEEP", "2.5")))


def main():
    from _common import DSN, PGQ, Schema, verdict
    from sqlalchemy import text

    import pgq

    backlog = int(os.environ.get("ATK_BACKLOG", "400000"))
    delay = os.environ.get("ATK_VACUUM_COST_DELAY", "2")
    problems = []
    with Schema("vacuum_lease") as s:
        pgq.create_topic(s.engine, "t")
        pgq.subscribe(s.engine, "g", "t")
        pgq.subscribe(s.engine, "junk", "t")
        for i in range(0, backlog, 10_000):
            pgq.publish_many(s.engine, "t", [{"n": j} for j in range(i, i + 10_000)])
        with s.engine.begin() as conn:
            conn.execute(
                text(
                    f'DELETE FROM "{s.name}".delivery d USING "{s.name}".consumer_group g'
                    " WHERE g.id = d.group_id AND g.name = 'junk'"
                )
            )
        time.sleep(2)  # the statistics collector sees the dead rows
        calls = tempfile.NamedTemporaryFile(prefix="atk_calls_", delete=False).name
        env = dict(
            PGQ_LEASE="3",
            PGQ_WORKERS="4",
            PGQ_BATCH_SIZE="4",
            PGQ_LOG_LEVEL="INFO",
            ATK_CALLS=calls,
        )
        if delay:  # in the DSN: pgq builds its own `options`, which overrides PGOPTIONS
            sep = "&" if "?" in DSN else "?"
            env["PGQ_DSN"] = f"{DSN}{sep}options=-c%20vacuum_cost_delay%3D{delay}"
        procs = [
            subprocess.Popen(
                [
                    PGQ,
                    "consume",
                    "g",
                    "--handler",
                    "vacuum_starves_lease_extension:handler",
                    "--max-runtime",
                    "40",
                ],
                env=s.env(**env),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for _ in range(2)
        ]
        logs = [p.communicate(timeout=120)[0] for p in procs]
        log = "\n".join(logs)
        vacuums = [ln for ln in log.splitlines() if "vacuumed delivery" in ln]
        reclaims = [ln for ln in log.splitlines() if "reclaimed expired leases" in ln]
        ids = collections.Counter(open(calls).read().split())
        os.unlink(calls)
        twice = {k: v for k, v in ids.items() if v > 1}
        print(f"handler calls={sum(ids.values())} distinct={len(ids)} vacuums={len(vacuums)}")
        for ln in vacuums + reclaims:
            print("  log:", ln[:200])
        if reclaims:
            problems.append(
                f"{len(reclaims)} sweep(s) reclaimed expired leases: {reclaims[0][:160]}"
            )
        if twice:
            problems.append(f"{len(twice)} messages handled more than once, e.g. {list(twice)[:5]}")
        if os.environ.get("ATK_VERBOSE"):
            print(log[-5000:])
    verdict(problems, "a member's VACUUM must not let its leases expire")


if __name__ == "__main__":
    sys.exit(main())
