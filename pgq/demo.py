"""`pgq demo`: the circuit breaker's whole story, live, in well under a minute.

In a scratch schema (`pgq_demo_<random>`, dropped at the end) a producer
publishes a steady stream of orders, a few of them poison (they always raise
`ValueError`). Three embedded members run a handler that calls a simulated
dependency. The demo cuts the dependency: the members' local breakers trip,
the quorum opens the group, one elected prober probes with real messages while
the others wait, and rows that died of the outage are pending reconciliation
(what `pgq check` says is printed). The dependency comes back: the next probe
succeeds, the prober closes the group and refunds the outage's rows, and the
queue drains. Only the poison stays dead.

Why a steady producer rather than one big batch: with a backlog, members try
fresh rows first, so every row fails once and the breakers trip before any row
uses up its attempts: nothing would die and be refunded. With steady traffic
the retries of the first failed rows compete only with the new arrivals, as
they do in a real outage.

`run_demo` tells the story line by line to the `out` callable it is given (by
default nowhere: the library never prints) and returns a `DemoResult`. The
`pgq demo` command (`pgq.cli.demo`) is a thin layer over it that passes `click.echo`.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import queue
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine

from pgq.consumer import PROBE_THREAD, Consumer
from pgq.monitor import DEFAULT_MAX_REFUNDS, breaker_info, check, dead, status
from pgq.records import BreakerState, LocalBreakerState, Message
from pgq.store import (
    connect,
    create_topic,
    database_now,
    drop_schema,
    migrate,
    publish_many,
    subscribe,
)

__all__ = ["DEMO_SETTINGS", "QUICK", "WATCHED", "DemoResult", "Pace", "run_demo"]

TOPIC = "orders"
GROUP = "billing"
MEMBERS = 3
WORKERS = 4
HANDLER_SECONDS = 0.005
"""What each call of the demo handler takes (a dependency call)."""
RATE = 100
"""Messages the producer publishes per second."""


@dataclass(frozen=True, slots=True)
class Pace:
    """How long each act lasts, in seconds."""

    cut_after: float = 2.0
    """Healthy traffic before the dependency is cut."""
    outage: float = 2.0
    """At least this long the group stays open (probing) before the dependency comes back."""
    deadline: float = 50.0
    """The whole demo gives up after this long."""


QUICK = Pace()
"""The pace of `pgq demo`: the whole story in about seven seconds."""

WATCHED = Pace(cut_after=6.0, outage=12.0, deadline=120.0)
"""The pace of `pgq demo --web`: slow enough to watch each state on the dashboard."""
TICK = 0.05
PROGRESS_EVERY = 0.5

DEMO_SETTINGS: dict[str, Any] = {
    "breaker_heartbeat": 0.2,
    "breaker_member_ttl": 1.5,
    "breaker_open_for": 0.5,
    "breaker_probe_interval": 0.3,
    "breaker_probe_interval_max": 1.0,
    "breaker_window": 30,
    "breaker_min_calls": 15,
    "retry_backoff": 0.05,
    "retry_backoff_max": 0.3,
    "max_attempts": 3,
    "lease": 5.0,
    "poll_interval": 0.1,
    "shutdown_grace": 5.0,
}
"""Short consumer settings: the breaker trips, probes and closes within seconds."""

Out = Callable[[str], Any]
"""Where the demo's narration goes, one line per call (`pgq demo` passes `click.echo`)."""


def _silent(line: str) -> None:
    """The default `Out`: the library prints nothing unless given somewhere to print."""


@dataclass(frozen=True, slots=True)
class DemoResult:
    """What the demo showed. `ok` is false (and `problem` says why) when the story
    did not happen: the group never opened or closed, nothing was refunded, the
    queue did not drain, or rows other than the poison ones stayed dead."""

    ok: bool
    problem: str | None
    published: int
    poison: int
    handled: int
    done: int
    dead: int
    refunded: int
    pending_peak: int
    """Most dead rows pending reconciliation seen while the group was open."""
    time_to_open: float | None
    """Seconds from the dependency cut to the group opening (database clock)."""
    time_to_close: float | None
    """Seconds from the dependency's return to the group closing (database clock)."""
    probes: int
    probers: tuple[str, ...]
    seconds: float


class _Dependency:
    """The simulated downstream service the handler calls: up or down."""

    def __init__(self) -> None:
        self.up = threading.Event()
        self.up.set()

    def call(self) -> None:
        time.sleep(HANDLER_SECONDS)
        if not self.up.is_set():
            raise ConnectionError("inventory service unreachable")


class _Story:
    """The shared state of one demo run: dependency, producer, members, events."""

    def __init__(self, engine: Engine, messages: int, poison: int) -> None:
        self.engine = engine
        self.messages = messages
        # the poison comes late in the stream, so that it dies after the outage: then
        # `pgq check` during the outage shows the WARNING alone, and after the drain
        # the poison as the only real dead letters (CRITICAL)
        first = messages * 7 // 10
        step = max(1, (messages - first) // (poison + 1))
        self.poison_at = {first + step * (k + 1) for k in range(poison)}
        self.poison_ids: set[int] = set()
        self.published = 0
        self.dependency = _Dependency()
        self.events: queue.SimpleQueue[tuple[str, int, BaseException | None]] = queue.SimpleQueue()
        self.stop = threading.Event()
        self.producer_error: BaseException | None = None

    def handler(self, member: str) -> Callable[[Message], None]:
        """The handler member `member` runs: poison fails at once, the rest call
        the dependency. Calls made by the group's prober are reported as probes."""

        def handle(msg: Message) -> None:
            probe = threading.current_thread().name == PROBE_THREAD
            try:
                if isinstance(msg.payload, dict) and msg.payload.get("poison"):
                    time.sleep(HANDLER_SECONDS)
                    raise ValueError(f"order {msg.id}: unreadable payload (poison)")
                self.dependency.call()
            except Exception as exc:
                if probe:
                    self.events.put((member, msg.id, exc))
                raise
            if probe:
                self.events.put((member, msg.id, None))

        return handle

    def produce(self) -> None:
        """Publish `messages` orders at `RATE` per second in small batches."""
        batch = max(1, RATE // 10)
        started = time.monotonic()
        try:
            while self.published < self.messages and not self.stop.is_set():
                n = min(batch, self.messages - self.published)
                numbers = range(self.published, self.published + n)
                payloads = [
                    {"order": i, "poison": True} if i in self.poison_at else {"order": i}
                    for i in numbers
                ]
                ids = publish_many(self.engine, TOPIC, payloads)
                self.poison_ids.update(
                    mid for mid, p in zip(ids, payloads, strict=True) if p.get("poison")
                )
                self.published += n
                due = started + self.published / RATE
                self.stop.wait(max(0.0, due - time.monotonic()))
        except Exception as exc:  # reported by the main loop
            self.producer_error = exc


def _seconds(start: dt.datetime | None, end: str | None) -> float | None:
    if start is None or end is None:
        return None
    return max(0.0, (dt.datetime.fromisoformat(end) - start).total_seconds())


def _history_at(info: dict[str, Any], state: str, epoch: int | None) -> str | None:
    for h in info["history"]:
        if h["state"] == state and (epoch is None or h["epoch"] == epoch):
            return str(h["at"])
    return None


def _progress(t: float, story: _Story, s: dict[str, Any]) -> str:
    c = s["counts"]
    return (
        f"{t:5.1f}s  published {story.published:4d}  done {c['done']:4d}"
        f"  ready {c['ready']:4d}  leased {c['leased']:3d}"
        f"  dead {c['dead']:3d} (systemic {c['dead_systemic']:3d})"
        f"  breaker {s['breaker']['state']}"
    )


@contextlib.contextmanager
def _members(engine: Engine, story: _Story) -> Iterator[list[Consumer]]:
    """Start the demo's members; stop them all on the way out (even on errors)."""
    consumers: list[Consumer] = []
    try:
        for i in range(1, MEMBERS + 1):
            name = f"demo-{i}"
            c = Consumer(
                engine, GROUP, story.handler(name), workers=WORKERS, name=name, **DEMO_SETTINGS
            )
            c.start()
            consumers.append(c)
        yield consumers
    finally:
        story.stop.set()
        for c in consumers:
            with contextlib.suppress(Exception):
                c.stop(timeout=DEMO_SETTINGS["shutdown_grace"])


def run_demo(
    dsn: str,
    out: Out = _silent,
    *,
    messages: int = 600,
    poison: int = 5,
    pace: Pace | None = None,
    watch: Callable[[Engine], contextlib.AbstractContextManager[Any]] | None = None,
) -> DemoResult:
    """Run the breaker story on the server at `dsn`, telling it line by line to `out`.

    Works in a fresh schema `pgq_demo_<random>` that is dropped at the end, so
    it never touches real data. Takes about 7 seconds at the default `pace`, `QUICK`.
    `watch`, when given, is entered with the demo's engine once the group
    exists and left before the schema is dropped (`pgq demo --web` serves the
    dashboard in it). Raises `PgqError` when the database cannot be used; a
    story that did not happen is `DemoResult.ok` false with the reason in
    `problem`.
    """
    schema = f"pgq_demo_{secrets.token_hex(4)}"
    engine = connect(dsn, schema=schema, pool_size=12)
    try:
        migrate(engine)
        create_topic(engine, TOPIC)
        subscribe(engine, GROUP, TOPIC)
        out(
            f"schema {schema}: topic {TOPIC}, group {GROUP}; {MEMBERS} members x {WORKERS}"
            f" workers; {messages} orders at {RATE}/s, {poison} of them poison"
        )
        with watch(engine) if watch is not None else contextlib.nullcontext():
            return _run(engine, out, messages, poison, pace or QUICK)
    finally:
        with contextlib.suppress(Exception):
            drop_schema(engine, schema)
        engine.dispose()


class _Narrator:
    """Watches the group once per tick, moves the story on and says what happens."""

    def __init__(self, engine: Engine, story: _Story, out: Out, pace: Pace) -> None:
        self.engine, self.story, self.out, self.pace = engine, story, out, pace
        self.max_refunds = int(DEMO_SETTINGS.get("breaker_max_refunds", DEFAULT_MAX_REFUNDS))
        self.cut_at: dt.datetime | None = None
        self.restored_at: dt.datetime | None = None
        self.open_epoch: int | None = None
        self.close_epoch: int | None = None
        self.opened = 0.0
        self.pending_peak = 0
        self.probes = 0
        self.probers: list[str] = []  # members whose group probes ran
        self.elected: set[str] = set()  # probers seen in the breaker row
        self.refunded = 0
        self.checked = False
        self.next_progress = 0.0

    def say(self, t: float, text: str) -> None:
        self.out(f"{t:5.1f}s  {text}")

    def tick(self, t: float, s: dict[str, Any]) -> bool:
        """One look at status `s` at `t` seconds; True once the story is over."""
        story, b = self.story, s["breaker"]
        if self.cut_at is not None and self.open_epoch is None and b["state"] == BreakerState.OPEN:
            self.open_epoch, self.opened = b["epoch"], time.monotonic()
            tripped = sum(1 for m in s["members"] if m["local_breaker"] == LocalBreakerState.OPEN)
            self.say(
                t,
                f"group breaker OPEN (epoch {self.open_epoch}): {tripped} of"
                f" {len(s['members'])} members tripped; nobody claims, unstarted rows released",
            )
        if b["state"] == BreakerState.OPEN and b["prober"] and b["prober"] not in self.elected:
            self.elected.add(b["prober"])
            self.say(t, f"prober elected: {b['prober']} holds the probe lock")
        while not story.events.empty():
            member, mid, error = story.events.get()
            self.probes += 1
            if member not in self.probers:
                self.probers.append(member)
            verdict = f"failed: {type(error).__name__}" if error else "succeeded"
            self.say(t, f"probe by {member} on message {mid} {verdict}")
        if t >= self.next_progress:
            self.out(_progress(t, story, s))
            self.next_progress = t + PROGRESS_EVERY
        if self.cut_at is None and t >= self.pace.cut_after:
            story.dependency.up.clear()
            self.cut_at = database_now(self.engine)
            self.say(t, "dependency DOWN: every call now raises ConnectionError")
        if self.open_epoch is not None and self.restored_at is None:
            self._while_open(t, s)
        if (
            self.restored_at is not None
            and self.close_epoch is None
            and b["state"] == BreakerState.CLOSED
        ):
            self.close_epoch = b["epoch"]
            self.say(t, f"group breaker CLOSED (epoch {self.close_epoch}) by the prober")
        if self.close_epoch is not None and not self.refunded:
            self.refunded = _refunded(self.engine)
            if self.refunded:
                self.say(
                    t,
                    f"reconciliation refunded {self.refunded} rows: the outage's dead and"
                    " waiting systemic rows are ready again, their charges refunded",
                )
        if self.close_epoch is None or story.published < story.messages or s["lag"]:
            return False
        self.out(_progress(t, story, s))
        line = check(self.engine, GROUP, self.max_refunds)[1]
        self.say(t, f"pgq check {GROUP}: {line} (the poison: real dead letters)")
        return True

    def _while_open(self, t: float, s: dict[str, Any]) -> None:
        self.pending_peak = max(self.pending_peak, s["counts"]["dead_systemic"])
        open_for = time.monotonic() - self.opened
        outage = self.pace.outage
        if not self.checked and open_for >= outage * 0.75:
            self.checked = True
            self.say(t, f"pgq check {GROUP}: {check(self.engine, GROUP, self.max_refunds)[1]}")
        if open_for >= outage and (self.probes or open_for >= 3 * outage):
            self.story.dependency.up.set()
            self.restored_at = database_now(self.engine)
            self.say(t, "dependency UP again")

    def stuck(self, s: dict[str, Any]) -> str:
        """Why the story did not finish in time."""
        if self.cut_at is None:
            return "the demo did not get to cut the dependency"
        if self.open_epoch is None:
            return "the group breaker never opened after the dependency was cut"
        if self.restored_at is None:
            return "the dependency was never restored"
        if self.close_epoch is None:
            return "the group breaker never closed after the dependency came back"
        return f"the queue did not drain: lag {s['lag']}"


def _run(engine: Engine, out: Out, messages: int, poison: int, pace: Pace) -> DemoResult:
    story = _Story(engine, messages, poison)
    narrator = _Narrator(engine, story, out, pace)
    ttl = DEMO_SETTINGS["breaker_member_ttl"]
    started = time.monotonic()
    problem: str | None = None
    producer = threading.Thread(target=story.produce, name="pgq-demo-producer", daemon=True)
    with _members(engine, story) as consumers:
        out(f"members {', '.join(c.name for c in consumers)} joined; dependency UP")
        producer.start()
        while True:
            t = time.monotonic() - started
            s = status(engine, GROUP, member_ttl=ttl)
            if narrator.tick(t, s):
                break
            if story.producer_error is not None:
                problem = f"publishing failed: {story.producer_error}"
                break
            if t >= pace.deadline:
                problem = narrator.stuck(s)
                break
            time.sleep(TICK)
        summaries = [c.stop(timeout=DEMO_SETTINGS["shutdown_grace"]) for c in consumers]

    final = status(engine, GROUP, member_ttl=ttl)
    info = breaker_info(engine, GROUP, history_limit=100)
    refunded = sum(h["refunded"] for h in info["history"] if h["state"] == BreakerState.CLOSED)
    dead_rows = dead(engine, GROUP, limit=len(story.poison_ids) + 100)
    unexpected = [r["message_id"] for r in dead_rows if r["message_id"] not in story.poison_ids]
    if problem is None:
        if narrator.open_epoch is None:
            problem = "the group breaker never opened"
        elif narrator.close_epoch is None:
            problem = "the group breaker never closed"
        elif refunded == 0:
            problem = "nothing was refunded when the group closed"
        elif unexpected:
            problem = f"rows other than the poison stayed dead: {unexpected[:10]}"
    result = DemoResult(
        ok=problem is None,
        problem=problem,
        published=story.published,
        poison=len(story.poison_ids),
        handled=sum(x.handled for x in summaries),
        done=final["counts"]["done"],
        dead=final["counts"]["dead"],
        refunded=refunded,
        pending_peak=narrator.pending_peak,
        time_to_open=_seconds(
            narrator.cut_at, _history_at(info, BreakerState.OPEN, narrator.open_epoch)
        ),
        time_to_close=_seconds(
            narrator.restored_at, _history_at(info, BreakerState.CLOSED, narrator.close_epoch)
        ),
        probes=narrator.probes,
        probers=tuple(narrator.probers),
        seconds=time.monotonic() - started,
    )
    for line in summary_lines(result):
        out(line)
    return result


def _refunded(engine: Engine) -> int:
    info = breaker_info(engine, GROUP, history_limit=100)
    return sum(h["refunded"] for h in info["history"] if h["state"] == BreakerState.CLOSED)


def _secs(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}s"


def summary_lines(r: DemoResult) -> list[str]:
    """The demo's closing summary, one line per figure."""
    probers = ", ".join(r.probers) or "-"
    dead_note = "the poison: class message" if r.dead == r.poison else f"{r.poison} poison"
    return [
        "summary",
        f"  published      {r.published} orders ({r.poison} poison)",
        f"  handled        {r.handled} attempts",
        f"  done           {r.done}",
        f"  dead           {r.dead} ({dead_note})",
        f"  pending        {r.pending_peak} dead systemic rows at most while OPEN",
        f"  refunded       {r.refunded} rows on close",
        f"  time to open   {_secs(r.time_to_open)} (dependency cut -> group OPEN)",
        f"  time to close  {_secs(r.time_to_close)} (dependency back -> group CLOSED)",
        f"  probes         {r.probes} by {probers}",
        f"  took           {r.seconds:.1f}s",
    ]
