"""`pgq.Consumer`: one member of a consumer group, and its threads.

    fetcher ──claims──▶ buffered-claim pool ──▶ workers (handler) ──outcomes──▶ acker
    maintenance: heartbeat, lease extension, sweep, frontier, pruning, timeouts

Shutdown runs in a fixed order under one deadline: stop claiming, release the
rows no worker started, let running handlers finish, flush outcomes, run a
last maintenance pass, leave the group.
"""

from __future__ import annotations

import logging
import os
import queue
import secrets
import socket
import time
from collections.abc import Callable
from typing import Any

from sqlalchemy import Connection, Engine

from pgq.classify import make_classifier
from pgq.connect import conninfo_of, schema_of
from pgq.consumer.acker import Acker
from pgq.consumer.fetcher import Fetcher, Listener
from pgq.consumer.gate import Gate
from pgq.consumer.maintenance import Maintenance
from pgq.consumer.member import Member
from pgq.consumer.model import Claimed, Outcome
from pgq.consumer.pool import ClaimPool
from pgq.consumer.prober import Prober
from pgq.consumer.workers import Workers
from pgq.errors import DatabaseUnavailable, DuplicateMember, UsageError
from pgq.message import Message, RunSummary, StopReason
from pgq.settings import load_settings
from pgq.store import BreakerView, GroupStore, run_once
from pgq.topics import check_name, group_info

logger = logging.getLogger("pgq.consumer")

CONNECTIONS_NEEDED = 6
"""Pooled connections one member may use at once: fetcher, acker, maintenance,
prober, and short ones (release, the final pass). LISTEN and the probe lock use
their own connections outside the pool."""


def default_member_name() -> str:
    """`host:pid:xxxx`, unique enough to tell members apart in `pgq members`."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(2)}"


class Consumer:
    """A member of consumer group `group` that runs `handler` on its messages.

    Settings are keyword arguments (`workers=8`, `lease=30`, `breaker_quorum=0.5`,
    ...; see `pgq.settings.Settings`) and, optionally, a TOML `config` file;
    the library reads no environment variables (the CLI does).
    """

    def __init__(
        self,
        engine: Engine,
        group: str,
        handler: Callable[[Message], Any],
        workers: int = 8,
        name: str | None = None,
        classify: Callable[[BaseException], Any] | None = None,
        *,
        config: str | os.PathLike[str] | None = None,
        clock: Callable[[], float] = time.monotonic,
        **settings: Any,
    ) -> None:
        self.engine = engine
        self.group = check_name("group", group)
        self.handler = handler
        self.name = name or default_member_name()
        if not self.name or len(self.name) > 200:
            raise UsageError("invalid member name: 1-200 characters")
        self.settings = load_settings(config, env={}, overrides={"workers": workers, **settings})
        self.classify = make_classifier(classify)
        self.clock = clock
        self._member: Member | None = None
        self._threads: dict[str, Any] = {}
        self._summary: RunSummary | None = None
        self._ran_by_run = False
        self.clean = True
        """False after a shutdown that left handlers running or outcomes unwritten."""

    # -- public API -----------------------------------------------------------

    def run(
        self,
        until_empty: bool = False,
        max_messages: int | None = None,
        max_runtime: float | None = None,
    ) -> RunSummary:
        """Consume until asked to stop; return what was done.

        `until_empty` stops once nothing is ready and nothing is leased except
        by other live members; `max_messages` after that many finished attempts;
        `max_runtime` (seconds) starts a graceful stop. `stop()` from another
        thread (or a signal handler) ends the run too.
        """
        self._ran_by_run = True
        self.start(until_empty=until_empty, max_messages=max_messages)
        member = self._require_member()
        deadline = None if max_runtime is None else time.monotonic() + max_runtime
        while not member.stopping.wait(0.1):
            if deadline is not None and time.monotonic() >= deadline:
                member.request_stop("max_runtime")
        return self._shutdown(self._grace)

    def start(self, *, until_empty: bool = False, max_messages: int | None = None) -> None:
        """Join the group and start the member's threads (returns at once)."""
        if self._member is not None:
            raise UsageError("consumer already started")
        if max_messages is not None and max_messages < 1:
            raise UsageError("max_messages must be >= 1")
        s = self.settings
        self._check_pool()
        info = self._group_info(until_empty)
        store = GroupStore(info.id, self.group, info.topic, self.name, s.lease, s.max_reclaims)
        member = Member(
            engine=self.engine,
            settings=s,
            store=store,
            handler=self.handler,
            classify=self.classify,
            topic_id=info.topic_id,
            pool=ClaimPool(s.effective_prefetch),
            until_empty=until_empty,
            max_messages=max_messages,
        )
        joined = run_once(self.engine, store.join, s.breaker_member_ttl)
        if not joined:
            raise DuplicateMember(
                f"a live member named {self.name!r} is already running in group {self.group!r}"
            )
        self._member = member
        self._grace = s.shutdown_grace
        self._gate = Gate(s, self._gate_changed, self.clock)
        view = run_once(self.engine, store.breaker)
        self._gate.see_group(view.state, view.epoch)
        self._build_threads(member)
        logger.info(
            "member joined group=%s member=%s workers=%d prefetch=%d",
            self.group,
            self.name,
            s.workers,
            s.effective_prefetch,
        )

    def stop(self, timeout: float | None = None, reason: StopReason = "signal") -> RunSummary:
        """Stop gracefully; `timeout` overrides `shutdown_grace`.

        When `run()` is blocking in another thread, this only asks it to stop
        (and returns what is known so far); otherwise it shuts down here.
        """
        if timeout is not None:
            self._grace = timeout
        member = self._member
        if member is None:
            raise UsageError("consumer is not running")
        member.request_stop(reason)
        if self._ran_by_run:
            return self._snapshot(member, 0)
        return self._shutdown(self._grace)

    def request_stop(self, reason: StopReason = "signal") -> None:
        """Ask a running consumer to stop (safe from a signal handler)."""
        if self._member is not None:
            self._member.request_stop(reason)

    def abort(self) -> None:
        """Release what no worker started, then stop without waiting (second signal)."""
        member = self._member
        if member is None:
            return
        member.request_stop("signal")
        self._release(member, member.pool.close())
        member.halt.set()

    def __enter__(self) -> Consumer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._member is not None and self._summary is None:
            self.stop()

    # -- internals ------------------------------------------------------------

    def _require_member(self) -> Member:
        if self._member is None:
            raise UsageError("consumer is not running")
        return self._member

    def _check_pool(self) -> None:
        """Warn when the engine's pool cannot hold what a member uses at once."""
        pool = self.engine.pool
        size = getattr(pool, "size", None)
        overflow = getattr(pool, "_max_overflow", -1)
        if callable(size) and overflow >= 0 and size() + overflow < CONNECTIONS_NEEDED:
            logger.warning(
                "engine pool too small pool=%d needed=%d: threads will wait for connections",
                size() + overflow,
                CONNECTIONS_NEEDED,
            )

    def _group_info(self, until_empty: bool) -> Any:
        """The group row, waiting out an unreachable database (bounded by `lease`
        with `until_empty`: a cron run gives up and exits 75)."""
        give_up = time.monotonic() + self.settings.lease if until_empty else None
        delay = 0.2
        while True:
            try:
                return group_info(self.engine, self.group)
            except DatabaseUnavailable as exc:
                if give_up is not None and time.monotonic() + delay > give_up:
                    raise
                logger.warning("database unavailable at start, retrying error=%s", exc)
                time.sleep(delay)
                delay = min(delay * 2, 5.0)

    def _build_threads(self, member: Member) -> None:
        s = self.settings
        outcomes: queue.SimpleQueue[Outcome | None] = queue.SimpleQueue()
        gate = self._gate

        def report(outcome: Outcome) -> None:
            gate.observe(outcome)
            member.count_outcome(outcome)
            outcomes.put(outcome)

        def admit(row: Claimed) -> bool:
            if gate.admit(row):
                return True
            member.defer(row)
            self._gate_changed()
            return False

        workers = Workers(member, report, admit, self.clock)
        acker = Acker(member, outcomes)
        listener = Listener(conninfo_of(self.engine), schema_of(self.engine), member.store.topic)
        fetcher = Fetcher(member, listener, gate, lambda rows: self._release(member, rows))
        maintenance = Maintenance(member, self.clock)
        maintenance.add("heartbeat", s.breaker_heartbeat, self._heartbeat)
        maintenance.add("extend-leases", max(0.05, s.lease / 3), maintenance.extend_leases)
        maintenance.add("sweep", max(0.05, min(1.0, s.lease / 3)), maintenance.sweep)
        maintenance.add("frontier", 1.0, maintenance.advance_frontier)
        maintenance.add("statistics", 10.0, maintenance.refresh_statistics)
        maintenance.add("prune", 60.0, maintenance.prune)
        maintenance.add("retention", 60.0, maintenance.expire_messages)
        maintenance.add("handler-timeouts", min(0.5, s.handler_timeout / 4), workers.check_timeouts)
        self._threads = {
            "workers": workers,
            "acker": acker,
            "fetcher": fetcher,
            "maintenance": maintenance,
        }
        acker.start()
        workers.start()
        maintenance.start()
        fetcher.start()

    def _gate_changed(self) -> None:
        """A breaker changed: wake the fetcher (releases or resumes), heartbeat now."""
        fetcher: Fetcher | None = self._threads.get("fetcher")
        if fetcher is not None:
            fetcher.wake.set()
        if self._member is not None:
            self._member.pool.wake()  # a fetcher waiting for space re-checks the gate now
        maintenance: Maintenance | None = self._threads.get("maintenance")
        if maintenance is not None:
            maintenance.poke("heartbeat")

    def _heartbeat(self) -> None:
        """Record liveness and the local breaker; open the group on quorum; follow it."""
        member = self._require_member()
        gate, store, s = self._gate, member.store, self.settings
        local, tripped = gate.local_report()

        def beat(conn: Connection) -> tuple[BreakerView, int | None]:
            store.heartbeat(conn, local, tripped)
            view = store.breaker(conn)
            if view.state == "CLOSED" and local == "open" and tripped == view.epoch:
                return view, store.open_on_quorum(conn, view.epoch, s)
            return view, None

        maintenance: Maintenance = self._threads["maintenance"]
        view, opened = maintenance.conn.run(beat)
        if opened is not None:
            logger.warning("group breaker opened by quorum group=%s epoch=%d", self.group, opened)
            gate.see_group("OPEN", opened)
        else:
            gate.see_group(view.state, view.epoch)
        if gate.group_open or view.reconcile_epoch is not None:
            self._ensure_prober(member)

    def _ensure_prober(self, member: Member) -> None:
        prober: Prober | None = self._threads.get("prober")
        if prober is not None and prober.is_alive():
            return
        if member.stopping.is_set():
            return
        prober = Prober(member, self._gate, one_shot=member.until_empty, clock=self.clock)
        self._threads["prober"] = prober
        prober.start()

    def snapshot(self) -> RunSummary:
        """The running counts so far (for metrics)."""
        return self._snapshot(self._require_member(), 0)

    def breaker_states(self) -> dict[str, bool]:
        """Which breakers are open now, as this member sees them."""
        return {"local_breaker": self._gate.local.is_open, "group_breaker": self._gate.group_open}

    def _release(self, member: Member, rows: list[Claimed]) -> int:
        """Hand unstarted rows back (no charge); returns how many were released."""
        if not rows:
            return 0
        leases = [row.lease for row in rows]
        try:
            n = run_once(self.engine, member.store.release, leases)
        except DatabaseUnavailable as exc:
            logger.warning("could not release rows count=%d error=%s", len(rows), exc)
            return 0
        member.let_go([row.id for row in rows])
        with member.lock:
            member.tally.released += n
        logger.info("released unstarted rows count=%d", n)
        return n

    def _shutdown(self, grace: float) -> RunSummary:
        member = self._require_member()
        if self._summary is not None:
            return self._summary
        deadline = time.monotonic() + grace
        member.request_stop("signal")
        fetcher: Fetcher = self._threads["fetcher"]
        workers: Workers = self._threads["workers"]
        acker: Acker = self._threads["acker"]
        maintenance: Maintenance = self._threads["maintenance"]
        # release what no worker started before waiting for anything; then what
        # the fetcher's last claim (if one was in flight) added after that
        self._release(member, member.pool.close() + member.take_deferred())
        fetcher.join(max(0.0, deadline - time.monotonic()))
        self._release(member, member.pool.drain() + member.take_deferred())
        overran = workers.join(deadline)
        acker.stop()
        acker.join(max(1.0, deadline - time.monotonic()))
        member.halt.set()
        acker.join(5.0)
        maintenance.stop()
        maintenance.join(5.0)
        prober: Prober | None = self._threads.get("prober")
        if prober is not None:
            prober.join(max(1.0, deadline - time.monotonic()))
        for name, thread in (("fetcher", fetcher), ("acker", acker)):
            if thread.is_alive():
                logger.warning("thread overran shutdown thread=%s", name)
        if overran:
            logger.warning(
                "handlers still running at the end of the grace period count=%d", len(overran)
            )
        self.clean = (
            not overran and acker.unwritten == 0 and not acker.is_alive() and not member.crashed
        )
        waiting = self._final_pass(member)
        self._summary = self._snapshot(member, waiting)
        logger.info(
            "member left group=%s member=%s summary=%s", self.group, self.name, self._summary
        )
        return self._summary

    def _final_pass(self, member: Member) -> int:
        """Advance the frontier, leave the group; return rows waiting for a retry."""
        store, ttl = member.store, member.settings.breaker_member_ttl
        try:
            run_once(self.engine, store.advance_frontier)
            run_once(self.engine, store.leave)
            return run_once(self.engine, store.drain_state, ttl).waiting_retry
        except DatabaseUnavailable as exc:
            logger.warning("final maintenance pass failed error=%s", exc)
            return 0

    def _snapshot(self, member: Member, waiting: int) -> RunSummary:
        with member.lock:
            t = member.tally
            return RunSummary(
                handled=t.handled,
                done=t.done,
                retried=t.retried,
                dead=t.dead,
                released=t.released,
                reclaimed=t.reclaimed,
                waiting_retry=waiting,
                stop_reason=member.stop_reason or "signal",
            )
