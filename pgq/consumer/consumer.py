"""`pgq.Consumer`: one member of a consumer group — the public API only.

The threads and the shutdown order live in `runtime.py`; this class joins
the group, starts a `Runtime`, waits, and stops it.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from sqlalchemy import Connection, Engine

from pgq.classify import make_classifier
from pgq.consumer.gate import Gate
from pgq.consumer.handling import Handling
from pgq.consumer.member import Member
from pgq.consumer.numbers import GroupNumbers, Numbers
from pgq.consumer.pool import ClaimPool
from pgq.consumer.runtime import Runtime
from pgq.consumer.timing import Timings
from pgq.consumer.transactions import Transactions
from pgq.errors import DatabaseUnavailable, DuplicateMember, UsageError
from pgq.logcontext import get_logger, log_fields
from pgq.names import check_member_name, check_name
from pgq.otel.tracing import consumer_tracing
from pgq.records import BreakerView, GroupInfo, RunSummary, StopReason
from pgq.settings import ADAPTIVE, Settings, load_settings
from pgq.store import (
    GroupStore,
    MemberLinks,
    RoleConnection,
    SessionLock,
    group_info,
    member_links,
    member_lock,
)
from pgq.store.privileges import require_consumer_privileges

logger = get_logger("pgq.consumer")

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])

MAX_WAIT_RETRIES = 30 * 86400.0
"""The longest `wait_retries`: 30 days, like the longest snooze."""

IDLE_IN_TRANSACTION_MIN = 5.0
"""The least `idle_in_transaction_session_timeout` of a member's sessions (the
timeout is `lease`, but no less): long enough for a process that is merely slow."""


def default_member_name() -> str:
    """`host:pid:xxxx`, unique enough to tell members apart in `pgq members`."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(2)}"


def _member_fields(method: F) -> F:
    """`method` of `Consumer`, its log events bound to the group and the member."""

    @functools.wraps(method)
    def bound(self: Consumer, *args: Any, **kwargs: Any) -> Any:
        with log_fields(group=self.group, member=self.name):
            return method(self, *args, **kwargs)

    return bound  # type: ignore[return-value]


def build_settings(
    settings: Settings | None,
    config: str | os.PathLike[str] | None,
    overrides: dict[str, Any],
) -> Settings:
    """The one `Settings` a consumer runs with: `settings` as given, or the
    defaults under the `config` file under keyword overrides (no environment)."""
    given = {k: v for k, v in overrides.items() if v is not None}
    if settings is None:
        return load_settings(config, env={}, overrides=given)
    if config is not None or given:
        raise UsageError("pass settings= alone, or a config file and keyword settings")
    return settings


class Consumer:
    """A member of consumer group `group` that runs `handler` on its messages.

    Settings come as one `Settings` object (`settings=`), or as keyword
    arguments (`workers=8`, `lease=30`, `breaker_quorum=0.5`, ...; see
    `pgq.settings.Settings`) over an optional TOML `config` file; the library
    reads no environment variables (the CLI does, when it builds `Settings`).

    `transactional=True`: `handler(msg, conn)` runs in a transaction on a
    connection of `engine`'s pool, and its writes commit with the message's `done`
    outcome, fenced by the lease (`pgq.consumer.transactions`): size that pool for
    `workers` connections, besides the member's own three. `batch_handler=fn`
    instead of `handler` (with `transactional=True`): `fn(msgs, conn)` gets up to
    `batch_size` messages and one transaction for all of them; raise
    `pgq.PartialFailure({id: exc})` to fail only some (all writes roll back, the
    others run again uncharged).
    """

    def __init__(
        self,
        engine: Engine,
        group: str,
        handler: Callable[..., Any] | None = None,
        workers: int | None = None,
        name: str | None = None,
        classify: Callable[[BaseException], Any] | None = None,
        *,
        transactional: bool = False,
        batch_handler: Callable[..., Any] | None = None,
        settings: Settings | None = None,
        config: str | os.PathLike[str] | None = None,
        clock: Callable[[], float] = time.monotonic,
        **overrides: Any,
    ) -> None:
        self.engine = engine
        self.group = check_name("group", group)
        self.name = check_member_name(name or default_member_name())
        self.settings = build_settings(settings, config, {"workers": workers, **overrides})
        if (handler is None) == (batch_handler is None):
            raise UsageError("give a handler or a batch_handler, not both")
        if batch_handler is not None and not transactional:
            raise UsageError("batch_handler= needs transactional=True")
        target = handler if handler is not None else batch_handler
        assert target is not None
        self.handling = Handling(target, make_classifier(classify), self.settings)
        self.transactions = (
            Transactions(engine, self.handling, batch=batch_handler is not None)
            if transactional
            else None
        )
        self.clock = clock
        self._gate: Gate | None = None
        self._runtime: Runtime | None = None
        self._early_stop: StopReason | None = None
        """A stop asked for before the member had started (a signal during start-up)."""
        self._summary: RunSummary | None = None
        self._ran_by_run = False
        self._grace = self.settings.shutdown_grace
        self._timings: Timings | None = None
        self._numbers: GroupNumbers | None = None

    @property
    def started(self) -> bool:
        """True once the member has joined its group (and still after it stopped):
        `snapshot()` and `breaker_states()` answer from then on."""
        return self._runtime is not None

    @property
    def clean(self) -> bool:
        """False after a shutdown that left handlers running or outcomes unwritten."""
        return self._runtime is None or self._runtime.clean

    # -- public API -----------------------------------------------------------

    @_member_fields
    def run(
        self,
        until_empty: bool = False,
        max_messages: int | None = None,
        max_runtime: float | None = None,
        wait_retries: float = 0.0,
    ) -> RunSummary:
        """Consume until asked to stop; return what was done.

        `until_empty` stops once nothing is ready and nothing is leased except
        by other live members; with `wait_retries` (seconds) it also waits for
        retries that come due within that long after the group first looks
        empty. `max_messages` stops after that many finished attempts;
        `max_runtime` (seconds) starts a graceful stop. `stop()` from another
        thread (or a signal handler) ends the run too. An exception raised in
        this thread while it waits (KeyboardInterrupt, an orchestrator's
        cancellation) shuts the member down as `stop()` would, then propagates.

        Raises `PermissionDenied` naming what is missing when the role lacks a
        privilege a member needs: at once, before joining, or once the member
        is down when a privilege is revoked while it runs (likewise
        `SchemaMissing` and `BadDsn`: nothing a retry could fix).
        """
        self._ran_by_run = True
        self.start(until_empty=until_empty, max_messages=max_messages, wait_retries=wait_retries)
        if self._runtime is None:  # asked to stop while starting
            return self._unstarted_summary()
        try:
            member = self._runtime.member
            deadline = None if max_runtime is None else time.monotonic() + max_runtime
            while not member.stopping.wait(0.1):
                if deadline is not None and time.monotonic() >= deadline:
                    member.request_stop("max_runtime")
        except BaseException:
            self._shutdown()
            raise
        summary = self._shutdown()
        self._raise_refusal()
        return summary

    @_member_fields
    def start(
        self,
        *,
        until_empty: bool = False,
        max_messages: int | None = None,
        wait_retries: float = 0.0,
    ) -> None:
        """Join the group and start the member's threads (returns at once).

        A stop asked for while this runs (a signal during start-up) is honoured:
        the member then does not start, or stops at once.
        """
        if self._runtime is not None:
            raise UsageError("consumer already started")
        if max_messages is not None and max_messages < 1:
            raise UsageError("max_messages must be >= 1")
        if not 0 <= wait_retries <= MAX_WAIT_RETRIES:  # NaN fails too
            raise UsageError("wait_retries must be from 0 to 30 days (in seconds)")
        s = self.settings
        links = member_links(
            self.engine,
            self.group,
            self.name,
            idle_in_transaction=max(IDLE_IN_TRANSACTION_MIN, s.lease),
        )
        try:
            info = self._group_info(links, until_empty)
        except BaseException:
            links.close()
            raise
        if info is None:
            links.close()
            return
        store = GroupStore(
            *(info.id, self.group, info.topic, self.name, s.lease, s.max_reclaims),
            topic_id=info.topic_id,
            ordered=info.ordered,
        )
        member = Member(
            links=links,
            settings=s,
            store=store,
            handling=self.handling,
            transactions=self.transactions,
            topic_id=info.topic_id,
            pool=ClaimPool(s.effective_prefetch),
            until_empty=until_empty,
            max_messages=max_messages,
            wait_retries=wait_retries,
            timings=self._timings,
            numbers=self._numbers,
            tracing=consumer_tracing(info.topic, self.group, self.name),
        )
        session = member_lock(links.session, info.id, self.name)
        try:
            joined = self._at_start(until_empty, lambda: self._join(links, store, session))
        except BaseException:
            session.release()
            links.close()
            raise
        if joined is None:  # asked to stop while joining
            session.release()
            links.close()
            return
        gate = Gate(s, self.clock)
        if member.tracing is not None:
            gate.events = member.tracing.breaker_event
        view = joined
        gate.see_group(view.state, view.epoch)
        runtime = Runtime(member, gate, session, self.clock)
        self._gate, self._runtime = gate, runtime
        runtime.start()
        logger.info(
            "member joined group=%s member=%s workers=%d prefetch=%s",
            self.group,
            self.name,
            s.workers,
            s.prefetch if s.prefetch == ADAPTIVE else s.effective_prefetch,
        )
        if self._early_stop is not None:
            member.request_stop(self._early_stop)

    @_member_fields
    def stop(self, timeout: float | None = None, reason: StopReason = "signal") -> RunSummary:
        """Stop gracefully; `timeout` overrides `shutdown_grace`.

        When `run()` is blocking in another thread, this only asks it to stop
        (and returns what is known so far); otherwise it shuts down here.
        """
        if timeout is not None:
            self._grace = timeout
        if self._summary is not None:
            return self._summary
        runtime = self._require()
        runtime.member.request_stop(reason)
        if self._ran_by_run:
            return runtime.summary(0)
        summary = self._shutdown()
        self._raise_refusal()
        return summary

    def request_stop(self, reason: StopReason = "signal") -> None:
        """Ask the consumer to stop (safe from a signal handler); before it has
        started, it will not start."""
        if self._early_stop is None:
            self._early_stop = reason
        if self._runtime is not None:
            self._runtime.member.request_stop(reason)

    @_member_fields
    def abort(self) -> None:
        """Second signal: release what no worker started and write the outcomes
        already finished, without waiting for anything else."""
        self.request_stop("signal")
        if self._runtime is not None:
            self._runtime.abort()

    def snapshot(self) -> RunSummary:
        """The running counts so far (for metrics)."""
        return self._require().summary(0)

    def measure(self) -> Timings:
        """Have the member record latency histograms (handler runs, claim statements,
        outcome writes; `pgq.consumer.timing`) and return them (the same ones on a
        second call). Call it before `start()`: the threads take their histograms
        when they start; a consumer that was never asked times nothing. The member
        then also reads its group's numbers every few seconds on its own connection
        (`group_numbers()`, `pgq.consumer.numbers`)."""
        if self._timings is None:
            self._timings = Timings()
            self._numbers = GroupNumbers()
        return self._timings

    def group_numbers(self) -> Numbers | None:
        """The group's numbers as the member last read them while measured (None
        before the first read, or when not measured)."""
        return None if self._numbers is None else self._numbers.latest()

    def in_flight(self) -> int:
        """Rows this member holds a lease on now (buffered, running, or waiting for
        their outcome to be written); 0 before it started."""
        return 0 if self._runtime is None else self._runtime.member.in_flight()

    def breaker_states(self) -> dict[str, bool]:
        """Which breakers are open now, as this member sees them."""
        gate = self._gate
        if gate is None:
            raise UsageError("consumer is not running")
        return {"local_breaker": gate.local.is_open, "group_breaker": gate.group_open}

    def __enter__(self) -> Consumer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._runtime is not None and self._summary is None:
            self.stop()

    # -- internals ------------------------------------------------------------

    def _unstarted_summary(self) -> RunSummary:
        self._summary = RunSummary(0, 0, 0, 0, 0, 0, 0, self._early_stop or "signal")
        return self._summary

    def _require(self) -> Runtime:
        if self._runtime is None:
            raise UsageError("consumer is not running")
        return self._runtime

    def _raise_refusal(self) -> None:
        """Raise the error that stopped the member when the database refused its
        work for good (a privilege revoked while it ran, ...)."""
        refused = self._runtime.refused if self._runtime is not None else None
        if refused is not None:
            raise refused

    def _shutdown(self) -> RunSummary:
        if self._summary is None:
            runtime = self._require()
            waiting = runtime.shutdown(self._grace)
            self._summary = runtime.summary(waiting)
            logger.info(
                "member left group=%s member=%s",
                self.group,
                self.name,
                extra=dataclasses.asdict(self._summary),
            )
        return self._summary

    def _group_info(self, links: MemberLinks, until_empty: bool) -> GroupInfo | None:
        """The group, once the role is known to have every privilege a member needs
        (else `PermissionDenied` naming them); None if asked to stop."""
        work = RoleConnection(links.work, "join", threading.Event())

        def read(conn: Connection) -> GroupInfo:
            require_consumer_privileges(conn)
            return group_info(conn, self.group)

        return self._at_start(until_empty, lambda: work.run(read))

    def _join(self, links: MemberLinks, store: GroupStore, session: SessionLock) -> BreakerView:
        """Take the member's session lock, register it and read the group's breaker.

        A try cut short by the database going away starts again from a new session:
        the one whose answer was lost ends with its connection, and with it its lock,
        so the next try takes the lock (and with it the name) over.
        """
        s = self.settings
        try:
            held = session.acquire()
            work = RoleConnection(links.work, "join", threading.Event())
            if not work.run(store.join, s.breaker_member_ttl, held):
                raise DuplicateMember(
                    f"a live member named {self.name!r} is already running in group {self.group!r}"
                )
            if not held:
                logger.warning(
                    "member name taken over from a silent process member=%s; its session"
                    " lock follows once that session ends",
                    self.name,
                )
            return work.run(store.breaker)
        except DatabaseUnavailable:
            session.release()
            links.session.discard()
            raise

    def _at_start(self, until_empty: bool, step: Callable[[], T]) -> T | None:
        """`step()`, waiting out an unreachable database with backoff (bounded by
        `lease` with `until_empty`: a cron run gives up and exits 75); None if asked
        to stop meanwhile."""
        give_up = time.monotonic() + self.settings.lease if until_empty else None
        delay = 0.2
        while self._early_stop is None:
            try:
                return step()
            except DatabaseUnavailable as exc:
                if give_up is not None and time.monotonic() + delay > give_up:
                    raise
                logger.warning("database unavailable at start, retrying error=%s", exc)
                pause = time.monotonic() + delay
                while self._early_stop is None and time.monotonic() < pause:
                    time.sleep(0.05)
                delay = min(delay * 2, 5.0)
        return None
