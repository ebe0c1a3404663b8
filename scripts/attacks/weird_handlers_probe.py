"""Exploratory: one message per weird handler behaviour, in-process, reports what became
of each row and whether the member survived. (Used to find defects; each defect found
has its own script.)"""

import sys
import time

from _common import Schema

import pgq


class StrRaises(Exception):
    def __str__(self):
        raise RuntimeError("no str for you")


class StrRaisesBase(Exception):
    def __str__(self):
        raise KeyboardInterrupt


class MyBase(BaseException):
    pass


class BadRetry(pgq.RetryLater):
    def __init__(self):
        super().__init__(1)
        self.delay = "soon"


class BadSqlstate(Exception):
    @property
    def sqlstate(self):
        raise RuntimeError("boom")


class CauseLoop(Exception):
    pass


def loop():
    a = CauseLoop("a")
    b = CauseLoop("b")
    a.__cause__ = b
    b.__cause__ = a
    return a


cases = {
    "str_raises": lambda: StrRaises(),
    "str_raises_base": lambda: StrRaisesBase(),
    "systemexit": lambda: SystemExit(3),
    "keyboardinterrupt": lambda: KeyboardInterrupt(),
    "basesub": lambda: MyBase("x"),
    "retry_nan": lambda: pgq.RetryLater(float("nan")),
    "retry_inf": lambda: pgq.RetryLater(float("inf")),
    "retry_1e308": lambda: pgq.RetryLater(1e308),
    "retry_bad_attr": lambda: BadRetry(),
    "long_text": lambda: ValueError("x" * 5_000_000),
    "surrogate": lambda: ValueError("bad \ud800 \udfff \x00 nul"),
    "bad_sqlstate": lambda: BadSqlstate(),
    "cause_loop": lambda: loop(),
    "generatorexit": lambda: GeneratorExit(),
}
which = sys.argv[1:] or list(cases)
with Schema("weird") as s:
    pgq.create_topic(s.engine, "t")
    pgq.subscribe(s.engine, "g", "t")
    ids = {}
    for k in which:
        ids[pgq.publish(s.engine, "t", {"case": k})] = k

    def handler(msg):
        raise cases[msg.payload["case"]]()

    c = pgq.Consumer(
        s.engine,
        "g",
        handler,
        workers=2,
        name="w",
        max_attempts=1,
        breaker_min_members=99,
        **{"breaker_heartbeat": 0.2, "poll_interval": 0.1},
    )
    t0 = time.time()
    try:
        summ = c.run(until_empty=True, max_runtime=20)
        print("summary", summ)
    except BaseException as e:
        print("run raised", type(e).__name__, e)
    print("elapsed", round(time.time() - t0, 1))
    for r in s.sql(
        f'select message_id, state, error_class, left(last_error, 120), length(last_error), available_at - now() from "{s.name}".delivery order by message_id'
    ):
        print(ids.get(r[0]), r[1:])
