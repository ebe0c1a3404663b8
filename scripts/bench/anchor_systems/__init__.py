"""The anchors pgq is compared with, run from this repository alone.

Each anchor is one module here with two functions, both run in a child process
of the bench venv (`.venv-bench/`, from `scripts/bench/requirements-anchors.txt`):

    enqueue(dsn, n, batch, opts) -> dict   schema installed untimed, then N jobs
                                           {"i": k} in calls of `batch` (timed)
    consume(dsn, n, opts) -> dict          worker built untimed, then run until
                                           all N are done and it has returned
                                           (timed), then the database counted

A consume result carries the `Meter` fields plus `handler_calls`,
`handler_distinct`, `db_done`, `db_done_distinct`, `db_left` (what
`harness.exactly_once` checks) and a one-line `config`.

The systems (the method is the one of the reference harness in
../shared/bench, which this package does not need):

  floor          no framework: psycopg 3, one autocommit connection, claim 100
                 rows with FOR UPDATE SKIP LOCKED, one ack statement per claim
  floor-2conn    the same loop on 2 connections in 2 threads
  pgqueuer       pgqueuer's defaults: one PgQueuer on one asyncpg connection,
                 batch_size=10, drain mode, uvloop
  pgqueuer-b100  the same with batch_size=100 (as many rows per claim as floor)
  procrastinate  one worker, concurrency 10, psycopg pool, wait=False
  awa            awa-pg (PyO3 bindings of the Rust awa queue): COPY enqueue,
                 one queue of 10 workers, stopped once the handler has seen N
                 and awa counts N completed (awa has no drain mode)

`SYSTEMS` is imported by the parent (the project venv) for the names only: the
runner modules, and their queue libraries, are imported in the child alone.
"""

from __future__ import annotations

SYSTEMS: dict[str, tuple[str, dict]] = {
    # name: (module in this package, the options it is run with)
    "floor": ("floor", {"conns": 1}),
    "floor-2conn": ("floor", {"conns": 2}),
    "pgqueuer": ("pgqueuer_runner", {"batch_size": 10}),
    "pgqueuer-b100": ("pgqueuer_runner", {"batch_size": 100}),
    "procrastinate": ("procrastinate_runner", {"concurrency": 10}),
    "awa": ("awa_runner", {"workers": 10}),
}

DEFAULT_SYSTEMS = ["floor", "floor-2conn", "pgqueuer", "pgqueuer-b100", "procrastinate"]
"""What `--compare` runs without `--systems` (awa is opt-in: `--systems ...,awa`)."""

VERSION_DISTS = [
    "pgqueuer",
    "asyncpg",
    "uvloop",
    "procrastinate",
    "psycopg",
    "psycopg-pool",
    "awa-pg",
]
"""The packages whose versions the compare table's footer reports."""
