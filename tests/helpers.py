"""Shared test helpers: bounded waiting, row states, a fake clock, and the `pgq` command
(in-process through click's runner, or as a real subprocess).

Importable from every test module (the tests directory is on `sys.path`
through its conftest); fixtures live in `tests/fixtures/`. Nothing here sleeps
in hope: `wait_until` polls a condition up to a deadline and fails the test
with a message when it passes.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import quote

from sqlalchemy import Connection, Engine, func, select, text, update

import pgq
from pgq import schema as t
from pgq.sql import frontier as frontier_sql
from pgq.store import GroupStore, group_info, placement

if TYPE_CHECKING:
    from click.testing import Result

T = TypeVar("T")

TESTS_DIR = Path(__file__).resolve().parent

_SCRIPT = Path(sys.executable).with_name("pgq")
PGQ = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "pgq.cli"]
"""The real `pgq` command of this virtual environment."""

FAST = {
    "breaker_heartbeat": 0.2,
    "breaker_member_ttl": 1.0,
    "retry_backoff": 0.05,
    "poll_interval": 0.1,
}
"""Short consumer settings for tests (keyword spelling)."""

LONE_OUTAGE = {
    **FAST,
    "workers": 2,
    "breaker_min_members": 1,
    "breaker_window": 4,
    "breaker_min_calls": 4,
    "breaker_open_for": 0.2,
    "breaker_open_for_max": 0.4,
    "breaker_probe_interval": 0.3,
    "breaker_probe_interval_max": 0.6,
}
"""`FAST`, and a breaker that one member trips alone within four calls and probes
every 0.3-0.6 s: an outage, its probes and its close in about a second."""

TX_OUTAGE = {
    **FAST,
    "workers": 2,
    "breaker_min_members": 1,
    "breaker_window": 4,
    "breaker_min_calls": 4,
    "breaker_failure_rate": 0.5,
    "breaker_probe_interval": 0.2,
}
"""`FAST`, and a breaker that one member of two workers trips alone within four calls
and probes every 0.2 s (its open time the default): the transactional handlers'
outages (a dependency down, then up)."""


def wait_until(
    predicate: Callable[[], T],
    timeout: float,
    message: str = "",
    interval: float = 0.02,
    describe: Callable[[], object] | None = None,
) -> T:
    """Poll `predicate` until it returns something truthy (returned), or fail after `timeout`.

    `describe`, when given, is called on failure and its result added to the message.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            detail = f": {describe()}" if describe is not None else ""
            raise AssertionError(
                f"timed out after {timeout:g}s waiting for {message or predicate}{detail}"
            )
        time.sleep(interval)


def waiting_on(engine: Engine, pid: int, query_like: str = "%") -> list[int]:
    """The backends waiting for a lock that backend `pid` holds, directly or behind
    another waiter (a row's second waiter waits on the first one's tuple lock), whose
    statement is `LIKE query_like`: to wait until a statement is stuck behind a
    test's lock."""

    with engine.connect() as conn:
        found = conn.execute(
            text(
                "WITH RECURSIVE behind(pid) AS ("
                " SELECT pid FROM pg_stat_activity"
                " WHERE CAST(:pid AS int) = ANY(pg_blocking_pids(pid))"
                " UNION SELECT a.pid FROM pg_stat_activity a"
                " JOIN behind b ON b.pid = ANY(pg_blocking_pids(a.pid)))"
                " SELECT a.pid FROM pg_stat_activity a JOIN behind USING (pid)"
                " WHERE a.query LIKE :like"
            ),
            {"pid": pid, "like": query_like},
        ).scalars()
        return list(found)


def reap(proc: subprocess.Popen[str], timeout: float = 10.0) -> None:
    """Kill `proc` if it still runs (resuming it first, should it be paused), wait for
    it, and close its pipes, also when it had exited on its own: a pipe left open
    is a `ResourceWarning` when the `Popen` is collected, during whichever test runs
    then (under filterwarnings=error, that test fails)."""
    import signal

    if proc.poll() is None:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
    proc.wait(timeout)
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()


def rows(engine: Engine, group: str) -> dict[int, Any]:
    """The delivery rows of `group` by message id (every column of `pgq.delivery`)."""
    d = t.delivery
    gid = group_info(engine, group).id  # by id: one shard on Citus
    with engine.connect() as conn:
        found = conn.execute(select(d).where(d.c.group_id == gid).order_by(d.c.message_id)).all()
    return {r.message_id: r for r in found}


def state_of(found: dict[int, Any], mid: int) -> str:
    """The state of message `mid` in `rows()`'s answer `found`: a message of the group
    without a row was finished (the ack deletes what it finishes, keeping one row per
    batch; the frontier prunes that one)."""
    row = found.get(mid)
    return "done" if row is None else str(row.state)


def states(engine: Engine, group: str) -> Counter[str]:
    """How many delivery rows of `group` are in each state."""
    return Counter(r.state for r in rows(engine, group).values())


def wait_for_frontier(
    engine: Engine, group: str, target: int, timeout: float = 30.0, *, advance: bool = False
) -> None:
    """Wait until `group`'s `committed` is `target`.

    The frontier only passes transactions older than the cluster-wide xmin, so
    another session on a shared server can hold it up for a while: the
    timeout is generous, and the failure names the backend holding it.

    `advance`: no member runs any more (its run returned), so advance the
    frontier here as a member's maintenance would: a run's last pass may have
    met another session's transaction on a shared server, and nothing else
    moves the frontier after it.
    """
    deadline = time.monotonic() + timeout
    gid = group_info(engine, group).id if advance else None
    while True:
        if gid is not None:
            with engine.begin() as conn:
                conn.execute(frontier_sql.rebase_rows(), {"gid": gid})
                conn.execute(frontier_sql.rebase_frontier(), {"gid": gid})
                conn.execute(frontier_sql.advance_frontier(), {"gid": gid})
        status = pgq.status(engine, group)
        if status["committed"] == target:
            return
        if time.monotonic() >= deadline:
            raise AssertionError(
                f"committed is {status['committed']}, not {target}, after {timeout:g}s;"
                f" frontier held by {status['frontier_held_by']}"
            )
        time.sleep(0.05)


def pin_frontier(engine: Engine, topic: str) -> int:
    """Publish a message nobody may claim for an hour; return its id.

    The committed frontier stops before it, so the `done` rows of messages
    published after it are not pruned: the one row each ack batch keeps (its last)
    stays readable; the others the ack deletes at once (`state_of`). It stays
    `ready` (waiting), so subtract it from the ready counts.
    """
    return pgq.publish(engine, topic, {"pin": True}, delay=3600)


def db_now(engine: Engine) -> Any:
    """The database clock (leases and retry times use it)."""
    with engine.connect() as conn:
        return conn.exec_driver_sql("SELECT now()").scalar_one()


class FakeClock:
    """A monotonic clock for injected-clock code that only moves when told to."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


# -- the `pgq` command ------------------------------------------------------------


def invoke(
    env: Mapping[str, str], *args: str, stdin: str | bytes | None = None, **extra_env: str
) -> Result:
    """Run `pgq *args` in-process on the database and schema of `env` (a `pgq_env`).

    Only `PGQ_DSN` and `PGQ_SCHEMA` are taken from `env`; `extra_env` adds
    variables and `stdin` is the command's input.
    """
    from click.testing import CliRunner

    from pgq.cli import cli

    only = {k: env[k] for k in ("PGQ_DSN", "PGQ_SCHEMA")}
    return CliRunner().invoke(cli, list(args), env={**only, **extra_env}, input=stdin)


@contextlib.contextmanager
def server_home(prefix: str, name: str = "") -> Iterator[Path]:
    """A fresh `$PGQ_HOME` for an embedded server, `name` inside a new temp directory.

    Not under pytest's `tmp_path` (a new pytest session resets that to 0700 under
    a running server). Afterwards its server is stopped and its data removed,
    wherever pgq kept it (as root, when other users cannot reach the home, the
    data lives under /var/lib/pgq). With `name`, the temp directory is made
    traversable, so that even as root the data stays under the home.
    """
    from pgq import embedded

    base = Path(tempfile.mkdtemp(prefix=prefix))
    home = base / name if name else base
    if name:
        base.chmod(0o755)
    try:
        yield home
    finally:
        data_dir = embedded.status(home).data_dir
        embedded.stop(home)
        shutil.rmtree(base, ignore_errors=True)
        if not data_dir.is_relative_to(base):
            shutil.rmtree(data_dir, ignore_errors=True)


def assert_usage_error(code: int, stderr: str, *, contains: str = "") -> None:
    """Exit 2 with exactly one stderr line, `pgq: error: ...`, and no traceback."""
    assert code == 2, stderr
    lines = stderr.splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("pgq: error: "), stderr
    assert "Traceback" not in stderr
    assert contains in lines[0]


def consumer_env(pgq_env: Mapping[str, str], out: Path, **extra: object) -> dict[str, str]:
    """Environment for a `pgq consume` subprocess using `tests/handlers.py`.

    `out` is where the handlers record what they did; `extra` sets more
    variables (settings as `PGQ_LEASE=...`, handler knobs as `TESTQ_...`).
    """
    env = dict(pgq_env)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS_DIR), env.get("PYTHONPATH")]))
    env["TESTQ_DIR"] = str(out)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def spawn_pgq(env: Mapping[str, str], *args: str, log: Path | None = None) -> subprocess.Popen[str]:
    """Start `pgq *args`; its stderr goes to the file `log` when given, else to a pipe."""
    stderr: Any = log.open("w") if log is not None else subprocess.PIPE
    try:
        return subprocess.Popen(
            [*PGQ, *args],
            env=dict(env),
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
    finally:
        if log is not None:
            stderr.close()


def spawn_tx_member(env: Mapping[str, str], log: Path) -> subprocess.Popen[str]:
    """Start `tests/tx_member.py` (a member with a transactional handler) driven by the
    `TXQ_*` variables of `env`; its stderr goes to the file `log`."""
    with log.open("w") as stderr:
        return subprocess.Popen(
            [sys.executable, str(TESTS_DIR / "tx_member.py")],
            env=dict(env),
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )


def finish(proc: subprocess.Popen[str], timeout: float) -> tuple[int, str, str]:
    """Wait for `proc` (killing it past `timeout`): (exit code, stdout, stderr)."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"process did not exit within {timeout:g}s:\n{err}") from None
    return proc.returncode, out, err or ""


def read_ids(out: Path, kind: str, tag: str = "*") -> list[int]:
    """The message ids the handlers recorded under `kind` (of process `tag`, default all)."""
    ids: list[int] = []
    for path in sorted(out.glob(f"{kind}-{tag}")):
        ids.extend(int(line.split()[0]) for line in path.read_text().splitlines() if line)
    return ids


def read_attempts(out: Path, kind: str, tag: str = "*") -> dict[int, list[int]]:
    """Message id -> the `attempt` of each handler call recorded under `kind` (of process
    `tag`, default all): what a finished message's attempts were, now that its row is gone."""
    seen: dict[int, list[int]] = {}
    for path in sorted(out.glob(f"{kind}-{tag}")):
        for line in path.read_text().splitlines():
            mid, _, attempt = line.split()
            seen.setdefault(int(mid), []).append(int(attempt))
    return seen


def expire_all(engine: Engine, topic: str = "orders") -> int:
    """Retention (retention 0) of `topic` as a member runs it, until nothing is left."""
    with engine.connect() as conn:
        topic_id = conn.execute(select(t.topic.c.id).where(t.topic.c.name == topic)).scalar_one()
    store = GroupStore(0, "-", topic, "retention", 30.0, 3)
    total = 0
    with engine.connect() as conn:
        while True:
            with conn.begin():
                deleted = store.expire_messages(conn, topic_id, 0.0)
            if not deleted:
                return total
            total += deleted


def set_rows(engine: Engine, ids: list[int], **values: Any) -> None:
    """Write `values` into the delivery rows of the messages `ids` (every group)."""
    d = t.delivery
    with across_groups(engine) as conn:
        conn.execute(update(d).where(d.c.message_id.in_(ids)).values(**values))


def kill(engine: Engine, ids: list[int], error_class: str, **values: Any) -> None:
    """Make rows dead the way the consumer would (attempts used up, an error kept)."""
    fields = {
        "state": "dead",
        "attempts": 3,
        "error_class": error_class,
        "last_error": f"{error_class} failure",
        "error_epoch": 0,
        # systemic failures are the outage's charges; any other failure clears them
        "refundable_attempts": 3 if error_class == "systemic" else 0,
        "updated_at": func.now(),  # a death is a change (outcomes stamp it so)
        **values,
    }
    set_rows(engine, ids, **fields)


def run_machine(
    base: type, pg_dsn: str, schema: str, machine_settings: Any, seen: Counter[str]
) -> None:
    """Run the hypothesis state machine `base` (its steps use `self.engine`) against a
    fresh, migrated schema; prints what it exercised (`seen`) for pytest -s / -rP."""
    from hypothesis.stateful import run_state_machine_as_test

    engine = pgq.connect(pg_dsn, schema=schema, pool_pre_ping=False)
    try:
        pgq.migrate(engine)
        machine = type(base.__name__, (base,), {"engine": engine})
        run_state_machine_as_test(machine, settings=machine_settings)
    finally:
        print("exercised:", dict(sorted(seen.items())))
        engine.dispose()


def store_of(
    engine: Engine, group: str = "g", member: str = "m", lease: float = 30.0
) -> GroupStore:
    """Group `group`'s statements as member `member` runs them (not joined)."""
    info = group_info(engine, group)
    return GroupStore(
        info.id, group, info.topic, member, lease, 3, topic_id=info.topic_id, ordered=info.ordered
    )


STRICT_OPTION = "-c citus.multi_task_query_log_level=error"
"""The libpq `options` that make a connection refuse a multi-task statement: a
statement Citus would split into several tasks fails instead of running."""


def strict_dsn(dsn: str) -> str:
    """`dsn` (a URL) whose every connection refuses a multi-task statement
    (`STRICT_OPTION`), unless it says a level of its own already."""
    if not dsn or "multi_task_query_log_level" in dsn:
        return dsn
    return dsn + ("&" if "?" in dsn else "?") + "options=" + quote(STRICT_OPTION)


CITUS_DSN = strict_dsn(os.environ.get("PGQ_CITUS_DSN", ""))
"""The Citus coordinator the `citus` tests run on (`.ci/run` starts one and sets it),
every connection of it refusing a multi-task statement (`strict_dsn`): a test's own
statements over several groups say so (`across_groups`, `citus_owner`)."""

STRICT_CITUS_DSN = CITUS_DSN
"""`CITUS_DSN` (the name the routing tests use for the engine they check)."""


def citus_worker_dsn(port: int) -> str:
    """`CITUS_DSN` pointed at the worker on `port` (of the same host)."""
    import psycopg

    params = psycopg.conninfo.conninfo_to_dict(CITUS_DSN)
    params["port"] = str(port)
    return psycopg.conninfo.make_conninfo("", **params)


def citus_owner(**kwargs: Any) -> Any:
    """A psycopg connection to `CITUS_DSN` for a test's own setup and reads over
    several groups or topics: the multi-task check off for this session only."""
    import psycopg

    conn = psycopg.connect(CITUS_DSN, **kwargs)
    conn.execute("SET citus.multi_task_query_log_level = off")
    if not kwargs.get("autocommit"):
        conn.commit()
    return conn


DISTRIBUTED = os.environ.get("PGQ_TEST_DISTRIBUTED", "") not in ("", "0")
"""Whether this run places every test schema on a Citus cluster (`PGQ_TEST_DISTRIBUTED=1`,
tests/fixtures/database.py): its connections then refuse multi-task statements."""


@contextlib.contextmanager
def across_groups(engine: Engine) -> Iterator[Connection]:
    """A transaction for a test's own statements over several groups or topics (rows
    counted for an assert, time moved by hand on every row): on a Citus run they may
    run on several shards, which pgq's own statements may not."""
    with engine.begin() as conn:
        spans_groups(conn)
        yield conn


def spans_groups(conn: Connection) -> None:
    """`across_groups` for the rest of `conn`'s transaction, begun already."""
    if DISTRIBUTED or (CITUS_DSN and placement.distributed(conn)):
        conn.execute(text("SET LOCAL citus.multi_task_query_log_level = off"))


def citus_marks() -> list[Any]:
    """`pytestmark` of a module of tests on the Citus cluster: marked `citus`, skipped
    without `PGQ_CITUS_DSN`."""
    import pytest

    return [
        pytest.mark.citus,
        pytest.mark.skipif(
            not CITUS_DSN,
            reason="PGQ_CITUS_DSN is not set: no Citus coordinator to test on"
            " (../shared/citus/cluster.sh start, then"
            " PGQ_CITUS_DSN=postgresql://postgres@127.0.0.1:9701/postgres)",
        ),
    ]


# -- a commit held on the server, for the transactional handlers' attacks -------------


def commits_wait(engine: Engine, schema: str, lock: tuple[int, int]) -> None:
    """Deferred triggers on `delivery`: every transaction that ends a lease (an ack:
    the row updated from leased, or deleted while leased) waits, at its COMMIT, for
    the advisory lock `lock` (shared), so a test holding it holds every such commit
    on the server (`commit_waiting` tells when one waits)."""
    key = ", ".join(map(str, lock))
    with engine.begin() as conn:
        conn.execute(
            text(
                f'CREATE FUNCTION "{schema}".commit_waits() RETURNS trigger LANGUAGE plpgsql'
                f" AS $$ BEGIN PERFORM pg_advisory_xact_lock_shared({key}); RETURN NULL; END $$"
            )
        )
        for event, when in (
            ("UPDATE", "OLD.lease_owner IS NOT NULL AND NEW.lease_owner IS NULL"),
            ("DELETE", "OLD.lease_owner IS NOT NULL"),
        ):
            conn.execute(
                text(
                    f"CREATE CONSTRAINT TRIGGER commit_waits_{event.lower()} AFTER {event}"
                    f' ON "{schema}".delivery DEFERRABLE INITIALLY DEFERRED FOR EACH ROW'
                    f' WHEN ({when}) EXECUTE FUNCTION "{schema}".commit_waits()'
                )
            )


def commit_waiting(holder: Any, lock: tuple[int, int]) -> bool:
    """A commit waits for `lock` (`commits_wait`); `holder` is a psycopg connection."""
    found = holder.execute(
        "SELECT count(*) FROM pg_locks l JOIN pg_database db ON db.oid = l.database"
        " WHERE db.datname = current_database() AND l.locktype = 'advisory'"
        " AND l.classid = %s AND l.objid = %s AND l.objsubid = 2 AND NOT l.granted",
        lock,
    ).fetchone()
    return found is not None and found[0] > 0


# -- a transaction held open in a thread (publishers racing on keys) ------------------

JOIN = 30.0
"""Seconds an `OpenTransaction` may take to connect, return or end once asked."""


class OpenTransaction(threading.Thread):
    """`fn(conn)` in one transaction on its own connection, in a thread; it commits
    (or rolls back) when told (`finish`), so transactions end in any order."""

    def __init__(self, engine: Engine, fn: Callable[[Connection], Any], name: str) -> None:
        super().__init__(name=name, daemon=True)
        self.engine, self.fn = engine, fn
        self.pid: int | None = None
        self.connected = threading.Event()
        self.done = threading.Event()  # fn returned (or raised)
        self.end = threading.Event()
        self.rollback = False
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with self.engine.connect() as conn:
                self.pid = conn.execute(text("SELECT pg_backend_pid()")).scalar_one()
                conn.commit()
                self.connected.set()
                conn.begin()
                try:
                    self.result = self.fn(conn)
                finally:
                    self.done.set()
                assert self.end.wait(JOIN), f"{self.name} was never told to end"
                conn.rollback() if self.rollback else conn.commit()
        except BaseException as exc:
            self.error = exc
        finally:
            self.connected.set()
            self.done.set()

    def finish(self, rollback: bool = False) -> Any:
        self.rollback = rollback
        self.end.set()
        self.join(JOIN)
        assert not self.is_alive(), f"{self.name} still running after {JOIN:g}s"
        if self.error is not None:
            raise self.error
        return self.result


def open_transaction(engine: Engine, fn: Callable[[Connection], Any], name: str) -> OpenTransaction:
    """Start an `OpenTransaction` and wait until it is connected."""
    tx = OpenTransaction(engine, fn, name)
    tx.start()
    assert tx.connected.wait(JOIN), f"{name} did not connect"
    return tx


def blocked(engine: Engine, tx: OpenTransaction) -> None:
    """Wait until `tx`'s statement waits for a lock (failing if it returned instead)."""

    def waits() -> bool:
        with engine.connect() as conn:
            return bool(
                conn.execute(
                    text("SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = :p"),
                    {"p": tx.pid},
                ).scalar()
            )

    wait_until(lambda: tx.done.is_set() or waits(), JOIN, f"{tx.name} to wait for a lock")
    assert not tx.done.is_set(), f"{tx.name} did not wait: {tx.result!r} {tx.error!r}"


def transactional_consumer(
    engine: Engine,
    handler: Callable[[pgq.Message, Connection], None],
    *,
    batch: bool = False,
    group: str = "billing",
    **settings: Any,
) -> pgq.Consumer:
    """A consumer of `group` with the transactional `handler(message, conn)`, or, with
    `batch`, with a batch handler that calls it on each message of its batch."""
    if not batch:
        return pgq.Consumer(engine, group, handler, transactional=True, **settings)

    def handle_batch(messages: list[pgq.Message], conn: Connection) -> None:
        for message in messages:
            handler(message, conn)

    return pgq.Consumer(engine, group, batch_handler=handle_batch, transactional=True, **settings)


class KeyRuns:
    """What handlers of an ordered group did: per key, (message id, start, end) of each
    successful handling, in the order they ended; and each batch's keys (a
    transactional batch handler's). `check` holds them to the rule (decision 0044)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_key: dict[str, list[tuple[int, float, float]]] = defaultdict(list)
        self.batches: list[list[str | None]] = []

    def ran(self, msg: pgq.Message, start: float) -> None:
        with self.lock:
            assert msg.key is not None
            self.by_key[msg.key].append((msg.id, start, time.monotonic()))

    def one(self, msg: pgq.Message) -> None:
        """A handler (`handler=`): the message ran."""
        self.ran(msg, time.monotonic())

    def batch(self, msgs: list[pgq.Message], conn: Any) -> None:
        """A transactional batch handler (`batch_handler=`): the messages ran."""
        start = time.monotonic()
        with self.lock:
            self.batches.append([m.key for m in msgs])
        for m in msgs:
            self.ran(m, start)

    def check(self, published: dict[str, list[int]]) -> None:
        """Each key's messages ran once each, in publish order, one at a time; no batch
        held two messages of a key."""
        for key, ids in published.items():
            seen = self.by_key[key]
            assert [i for i, _, _ in seen] == ids, (key, seen)
            for (_, _, end), (_, start, _) in itertools.pairwise(seen):
                assert start >= end, (key, seen)
        for keys in self.batches:
            assert len(keys) == len(set(keys)), f"a batch with two messages of a key: {keys}"
