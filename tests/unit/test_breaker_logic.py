"""Pure breaker logic: the local breaker and the group's quorum arithmetic (DESIGN §6)."""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Callable, Iterable
from fractions import Fraction

import pytest
from helpers import FakeClock
from hypothesis import given, settings
from hypothesis import strategies as st

from pgq.breaker import LocalBreaker, group_should_open, probe_delay, trip_threshold


def cycle(values: Iterable[float]) -> Callable[[], float]:
    it = itertools.cycle(list(values))
    return lambda: next(it)


def make(clock: FakeClock, rng_value: float = 0.0, **kwargs: object) -> LocalBreaker:
    params: dict = {"window": 10, "min_calls": 4, "failure_rate": 0.5, "open_for": 4.0}
    params["open_for_max"] = 20.0
    params.update(kwargs)
    return LocalBreaker(clock=clock, rng=lambda: rng_value, **params)


def trip(b: LocalBreaker) -> None:
    while not b.is_open:
        b.record(True)


# --- LocalBreaker: tripping --------------------------------------------------------


def test_starts_closed() -> None:
    b = make(FakeClock())
    assert (b.state, b.is_open, b.probe_in_flight, b.trips) == ("closed", False, False, 0)
    assert b.opened_at is None and b.probe_at is None
    assert b.try_probe() is False


def test_does_not_trip_below_min_calls() -> None:
    clock = FakeClock(7.0)
    b = make(clock)
    assert [b.record(True) for _ in range(3)] == [False, False, False]
    assert b.state == "closed"
    assert b.record(True) is True
    assert (b.state, b.trips, b.opened_at) == ("open", 1, 7.0)


def test_trips_when_share_reaches_rate() -> None:
    b = make(FakeClock(), window=4, min_calls=4, failure_rate=0.5)
    assert [b.record(s) for s in (False, False, True)] == [False, False, False]
    assert b.record(True) is True  # 2/4 == 0.5


def test_does_not_trip_below_rate() -> None:
    b = make(FakeClock(), window=4, min_calls=4, failure_rate=0.5)
    for s in (True, False, False, False, True, False, False, False):
        assert b.record(s) is False
    assert b.state == "closed"


def test_window_slides() -> None:
    b = make(FakeClock(), window=4, min_calls=2, failure_rate=0.75)
    for s in (False, False, False, False, True, True):  # window [F, F, T, T]: 0.5
        assert b.record(s) is False
    assert b.record(True) is True  # window [F, T, T, T]: 0.75


def test_systemic_entries_leave_the_window() -> None:
    b = make(FakeClock(), window=3, min_calls=3, failure_rate=1.0)
    for s in (True, True, False, True, True):  # windows: TTF, TFT, FTT
        assert b.record(s) is False
    assert b.record(True) is True  # TTT


def test_decimal_rate_means_the_fraction() -> None:
    b = make(FakeClock(), window=10, min_calls=10, failure_rate=0.3)
    for s in [False] * 7 + [True] * 2:
        assert b.record(s) is False
    assert b.record(True) is True  # 3/10 >= 0.3


def test_record_is_ignored_while_open() -> None:
    b = make(FakeClock())
    trip(b)
    assert b.record(True) is False
    assert b.record(False) is False
    assert (b.state, b.trips) == ("open", 1)


# --- LocalBreaker: probing ----------------------------------------------------------


def test_probe_waits_for_jittered_open_period() -> None:
    clock = FakeClock(0.0)
    b = make(clock, rng_value=0.0)  # jitter 0.5: 4 s -> 2 s
    trip(b)
    assert b.probe_at == 2.0
    clock.now = 1.999
    assert b.try_probe() is False
    clock.now = 2.0
    assert b.try_probe() is True
    assert b.probe_in_flight is True
    assert b.try_probe() is False
    clock.advance(1000)
    assert b.try_probe() is False


def test_jitter_comes_from_rng() -> None:
    clock = FakeClock(0.0)
    b = make(clock, rng_value=0.5)  # jitter 0.75: 4 s -> 3 s
    trip(b)
    assert b.probe_at == 3.0


def test_failed_probes_double_the_period_up_to_the_cap() -> None:
    clock = FakeClock(0.0)
    b = make(clock, rng_value=0.0, open_for=4.0, open_for_max=10.0)
    trip(b)
    waits = [b.probe_at]
    for _ in range(4):
        clock.now = b.probe_at
        assert b.try_probe() is True
        b.probe_result("systemic")
        assert (b.state, b.probe_in_flight) == ("open", False)
        waits.append(b.probe_at - clock.now)
    # 4×0.5, 8×0.5, min(10, 16)×0.5, 10×0.5, 10×0.5
    assert waits == [2.0, 4.0, 5.0, 5.0, 5.0]
    assert b.opened_at == 0.0
    assert b.trips == 1


def test_success_closes_and_resets() -> None:
    clock = FakeClock(0.0)
    b = make(clock, rng_value=0.0)
    trip(b)
    clock.now = b.probe_at
    assert b.try_probe()
    b.probe_result("systemic")
    clock.now = b.probe_at
    assert b.try_probe()
    b.probe_result("success")
    assert (b.state, b.probe_in_flight, b.opened_at, b.probe_at) == ("closed", False, None, None)
    # the window was cleared: min_calls fresh attempts are needed to trip again
    assert [b.record(True) for _ in range(4)] == [False, False, False, True]
    assert b.trips == 2
    assert b.probe_at == clock.now + 2.0  # period reset to open_for (× 0.5)


def test_inconclusive_probe_lets_the_next_go_at_once_period_unchanged() -> None:
    clock = FakeClock(0.0)
    b = make(clock, rng_value=0.0)
    trip(b)
    clock.now = b.probe_at
    assert b.try_probe()
    b.probe_result("systemic")  # one failed probe: period 8 × 0.5
    clock.now = b.probe_at
    assert b.try_probe()
    b.probe_result("inconclusive")
    assert (b.state, b.probe_in_flight) == ("open", False)
    assert b.try_probe() is True  # at once
    b.probe_result("systemic")  # two failed probes: 16 × 0.5
    assert b.probe_at == clock.now + 8.0


def test_abandoned_probe_lets_the_next_go_at_once_period_unchanged() -> None:
    clock = FakeClock(0.0)
    b = make(clock, rng_value=0.0)
    trip(b)
    clock.now = b.probe_at
    assert b.try_probe()
    b.abandon_probe()
    assert (b.state, b.probe_in_flight) == ("open", False)
    assert b.try_probe() is True
    b.probe_result("systemic")
    assert b.probe_at == clock.now + 4.0  # first failed probe: 8 × 0.5


def test_abandon_without_probe_is_a_noop() -> None:
    b = make(FakeClock())
    b.abandon_probe()
    assert b.state == "closed"


def test_probe_now_skips_the_wait() -> None:
    clock = FakeClock(0.0)
    b = make(clock)
    trip(b)
    assert b.try_probe() is False
    b.probe_now()
    assert b.try_probe() is True
    b.probe_now()  # in flight: no second probe
    assert b.try_probe() is False


def test_probe_now_when_closed_is_a_noop() -> None:
    b = make(FakeClock())
    b.probe_now()
    assert (b.state, b.try_probe(), b.probe_at) == ("closed", False, None)


def test_probe_result_needs_a_probe_in_flight() -> None:
    b = make(FakeClock())
    with pytest.raises(RuntimeError):
        b.probe_result("success")
    trip(b)
    with pytest.raises(RuntimeError):
        b.probe_result("systemic")


def test_probe_result_rejects_unknown_outcome() -> None:
    b = make(FakeClock())
    trip(b)
    b.probe_now()
    assert b.try_probe()
    with pytest.raises(ValueError, match="outcome"):
        b.probe_result("message")  # type: ignore[arg-type]
    assert b.probe_in_flight is True


@pytest.mark.parametrize(
    "kwargs",
    [
        {"window": 0},
        {"min_calls": 0},
        {"window": 5, "min_calls": 6},
        {"failure_rate": 0.0},
        {"failure_rate": 1.5},
        {"open_for": 0.0},
        {"open_for": 10.0, "open_for_max": 5.0},
    ],
)
def test_rejects_bad_parameters(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        LocalBreaker(**kwargs)


def test_defaults() -> None:
    b = LocalBreaker(clock=FakeClock(0.0), rng=lambda: 0.0)
    assert [b.record(True) for _ in range(5)] == [False] * 4 + [True]
    assert b.probe_at == 2.5  # open_for 5 × 0.5


def test_only_one_thread_wins_the_probe() -> None:
    b = make(FakeClock(0.0))
    trip(b)
    b.probe_now()
    barrier = threading.Barrier(16)
    wins: list[bool] = []

    def contend() -> None:
        barrier.wait()
        wins.append(b.try_probe())

    threads = [threading.Thread(target=contend) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wins.count(True) == 1


def test_concurrent_records_are_all_counted() -> None:
    b = make(FakeClock(), window=4000, min_calls=4000, failure_rate=1.0)

    def work() -> None:
        for _ in range(500):
            b.record(True)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert (b.state, b.trips) == ("open", 1)  # the 4000th record tripped it, exactly once


# --- LocalBreaker: properties against a reference model -----------------------------


class Model:
    """The §6.1 rules written as plainly as possible, with exact fractions."""

    def __init__(self, window: int, min_calls: int, rate: Fraction, open_for: float, cap: float):
        self.window, self.min_calls, self.rate = window, min_calls, rate
        self.open_for, self.cap = open_for, cap
        self.since_close: list[bool] = []
        self.open = False
        self.in_flight = False
        self.failed = 0
        self.probe_at = 0.0

    def start_period(self, now: float, r: float) -> None:
        self.probe_at = now + min(self.cap, self.open_for * 2**self.failed) * (0.5 + 0.5 * r)

    def record(self, systemic: bool, now: float, rng: Callable[[], float]) -> bool:
        if self.open:
            return False
        self.since_close.append(systemic)
        last = self.since_close[-self.window :]
        if len(last) >= self.min_calls and Fraction(sum(last), len(last)) >= self.rate:
            self.open, self.failed = True, 0
            self.start_period(now, rng())
            return True
        return False

    def try_probe(self, now: float) -> bool:
        if self.open and not self.in_flight and now >= self.probe_at:
            self.in_flight = True
            return True
        return False

    def result(self, outcome: str, now: float, rng: Callable[[], float]) -> None:
        self.in_flight = False
        if outcome == "success":
            self.open, self.failed, self.since_close = False, 0, []
        elif outcome == "systemic":
            self.failed += 1
            self.start_period(now, rng())


record_op = st.tuples(st.just("record"), st.booleans())
outcome = st.sampled_from(["success", "systemic", "inconclusive"])
ops = st.lists(
    st.one_of(
        record_op,
        record_op,
        st.tuples(st.just("record"), st.just(True)),
        st.tuples(st.just("advance"), st.integers(0, 400).map(lambda q: q / 4)),
        st.tuples(st.just("wait"), st.none()),  # until the breaker's probe time
        st.tuples(st.just("probe"), st.none()),
        st.tuples(st.just("probe_and_report"), outcome),
        st.tuples(st.just("result"), outcome),
        st.tuples(st.just("abandon"), st.none()),
        st.tuples(st.just("probe_now"), st.none()),
    ),
    min_size=20,
    max_size=150,
)


@settings(max_examples=300, deadline=None)
@given(
    window=st.integers(1, 12),
    data=st.data(),
    rate_twentieths=st.integers(1, 20),
    open_for=st.integers(1, 40).map(lambda q: q / 4),
    cap_factor=st.integers(1, 64),
    rng_values=st.lists(
        st.floats(min_value=0.0, max_value=1.0, exclude_max=True), min_size=1, max_size=5
    ),
    steps=ops,
)
def test_local_breaker_matches_model(
    window: int,
    data: st.DataObject,
    rate_twentieths: int,
    open_for: float,
    cap_factor: int,
    rng_values: list[float],
    steps: list[tuple[str, object]],
) -> None:
    min_calls = data.draw(st.integers(1, window), label="min_calls")
    rate = Fraction(rate_twentieths, 20)
    cap = open_for * cap_factor
    clock = FakeClock(0.0)
    b = LocalBreaker(
        window=window,
        min_calls=min_calls,
        failure_rate=float(rate),
        open_for=open_for,
        open_for_max=cap,
        clock=clock,
        rng=cycle(rng_values),
    )
    model = Model(window, min_calls, rate, open_for, cap)
    model_rng = cycle(rng_values)
    recorded_since_close = 0
    trips = 0

    for op, arg in steps:
        report = op == "result"
        if op == "record":
            assert isinstance(arg, bool)
            was_open = b.is_open
            tripped = b.record(arg)
            assert tripped == model.record(arg, clock.now, model_rng)
            if not was_open:
                recorded_since_close += 1
            if tripped:
                trips += 1
                # never open with fewer than min_calls recorded since the last close
                assert recorded_since_close >= min_calls
                assert b.opened_at == clock.now
                assert b.probe_at is not None and b.probe_at - clock.now <= cap
        elif op == "advance":
            assert isinstance(arg, float)
            clock.advance(arg)
        elif op == "wait":
            if b.probe_at is not None:
                clock.now = max(clock.now, b.probe_at)
        elif op in ("probe", "probe_and_report"):
            in_flight = b.probe_in_flight
            got = b.try_probe()
            assert got == model.try_probe(clock.now)
            if in_flight:
                assert got is False  # at most one probe in flight
            report = got and op == "probe_and_report"
        elif op == "abandon":
            b.abandon_probe()
            model.in_flight = False
        elif op == "probe_now":
            b.probe_now()
            if model.open and not model.in_flight:
                model.probe_at = clock.now

        if report:
            if not b.probe_in_flight:
                with pytest.raises(RuntimeError):
                    b.probe_result(arg)  # type: ignore[arg-type]
            else:
                b.probe_result(arg)  # type: ignore[arg-type]
                model.result(str(arg), clock.now, model_rng)
                if arg == "success":
                    assert b.state == "closed"  # success always closes
                    recorded_since_close = 0
                else:
                    assert b.state == "open"
                if arg == "systemic":
                    assert b.probe_at is not None and b.probe_at - clock.now <= cap

        assert b.is_open == model.open
        assert b.state == ("open" if model.open else "closed")
        assert b.probe_in_flight == model.in_flight
        assert b.trips == trips
        if b.is_open:
            assert b.probe_at == model.probe_at
        else:
            assert b.probe_at is None and b.opened_at is None


# --- global breaker arithmetic -------------------------------------------------------


@pytest.mark.parametrize(
    ("live", "quorum", "min_members", "expected"),
    [
        (30, 0.1, 1, 3),  # 0.1 × 30 is 3.0000000000000004 in floats
        (100, 0.07, 1, 7),  # 7.000000000000001 in floats
        (7, 5 / 7, 1, 5),
        (10, 0.5, 2, 5),
        (3, 0.5, 2, 2),
        (5, 0.5, 1, 3),
        (1, 0.5, 1, 1),
        (0, 0.5, 1, 1),
        (10, 1.0, 1, 10),
        (10, 0.0, 0, 0),
        (3, 1 / 3, 1, 1),
        (6, 2 / 3, 1, 4),
    ],
)
def test_trip_threshold(live: int, quorum: float, min_members: int, expected: int) -> None:
    assert trip_threshold(live, quorum, min_members) == expected


@pytest.mark.parametrize(
    ("live", "quorum", "min_members"), [(-1, 0.5, 1), (3, -0.1, 1), (3, 1.1, 1), (3, 0.5, -1)]
)
def test_trip_threshold_rejects_bad_input(live: int, quorum: float, min_members: int) -> None:
    with pytest.raises(ValueError):
        trip_threshold(live, quorum, min_members)


def test_group_should_open() -> None:
    assert group_should_open(3, 30, 0.1, 1) is True
    assert group_should_open(2, 30, 0.1, 1) is False
    assert group_should_open(1, 1, 0.5, 1) is True  # single consumer: a local trip is a group trip
    assert group_should_open(1, 4, 0.5, 2) is False
    assert group_should_open(0, 0, 0.0, 0) is False  # threshold 0, but nobody tripped
    assert group_should_open(1, 5, 0.0, 0) is True


quorums = st.integers(1, 1000).flatmap(lambda d: st.integers(0, d).map(lambda k: Fraction(k, d)))


@given(live=st.integers(0, 10_000), quorum=quorums, min_members=st.integers(0, 50))
def test_trip_threshold_matches_exact_fractions(
    live: int, quorum: Fraction, min_members: int
) -> None:
    threshold = trip_threshold(live, float(quorum), min_members)
    assert threshold == max(min_members, math.ceil(quorum * live))
    assert threshold >= min_members
    assert threshold <= max(min_members, live)


@given(
    live=st.integers(0, 500),
    quorum=quorums,
    min_members=st.integers(0, 20),
    tripped=st.integers(0, 500),
)
def test_group_should_open_is_monotonic_and_exact(
    live: int, quorum: Fraction, min_members: int, tripped: int
) -> None:
    opens = group_should_open(tripped, live, float(quorum), min_members)
    assert opens == (tripped > 0 and tripped >= max(min_members, math.ceil(quorum * live)))
    if opens:
        assert group_should_open(tripped + 1, live, float(quorum), min_members)
    if tripped == 0:
        assert not opens


# --- group probe backoff ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("failures", "expected"),
    [(0, 0.0), (1, 5.0), (2, 10.0), (3, 20.0), (6, 160.0), (7, 300.0), (10**9, 300.0)],
)
def test_probe_delay(failures: int, expected: float) -> None:
    assert probe_delay(failures, 5.0, 300.0) == expected


def test_probe_delay_rejects_negative_failures() -> None:
    with pytest.raises(ValueError):
        probe_delay(-1, 5.0, 300.0)


@given(failures=st.integers(1, 5000), base=st.floats(0.001, 1e4), maximum=st.floats(0.001, 1e4))
def test_probe_delay_bounded_and_monotonic(failures: int, base: float, maximum: float) -> None:
    d = probe_delay(failures, base, maximum)
    assert min(base, maximum) <= d <= maximum
    assert d <= probe_delay(failures + 1, base, maximum)
