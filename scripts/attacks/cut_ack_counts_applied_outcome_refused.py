"""A cut connection makes the acker count outcomes it applied as `refused`, so the
RunSummary is untruthful (`done`/`retried` too low, `refused` too high).

An outcome statement that committed on the server but whose answer the cut lost is
retried (`RoleConnection.retrying`); the retry finds the lease already resolved, and
`Acker._settle` counts the outcome "refused ... lease lost (reclaimed by another
member)". Since 9ddad64 (single autocommitted statements) the whole statement's round
trip is that window (before: only the COMMIT's): measured 1,561 / 1,267 false refusals
against 300 / 577 at f4d680d in the same run.

One member (lease 10 s, nobody else, nothing paused), 20,000 messages, handlers that
succeed, fail once or snooze once (by id), every connection cut through the chaos
proxy every ~0.25 s for 8 s, then drained (`until_empty`). No lease can be lost, so
`refused` must be 0 and `done` must equal the rows done.

Exits 1 while refused > 0 or summary.done != the done rows.
"""

from __future__ import annotations

import collections
import logging
import random
import threading
import time

from _common import DSN, Schema, states, verdict
from chaos.proxy import Proxy

import pgq

N = 20000


def main() -> None:
    logging.getLogger("pgq").setLevel(logging.CRITICAL)  # thousands of 'outcome refused' lines
    problems: list[str] = []
    with Schema("cutack") as s, Proxy.for_dsn(DSN) as proxy:
        e = s.engine
        pgq.create_topic(e, "t")
        pgq.subscribe(e, "g", "t")
        for i in range(0, N, 5000):
            pgq.publish_many(e, "t", [{"i": j} for j in range(i, i + 5000)])
        pe = pgq.connect(proxy.dsn(DSN), schema=s.name)
        lock = threading.Lock()
        calls: collections.Counter[int] = collections.Counter()
        oks = 0

        def handle(msg: pgq.Message) -> None:
            nonlocal oks
            with lock:
                calls[msg.id] += 1
                first = calls[msg.id] == 1
                if msg.id % 3 == 0 or not first:
                    oks += 1
                    return
            if msg.id % 3 == 1:
                raise ValueError("boom")
            raise pgq.RetryLater(0.01)

        c = pgq.Consumer(
            pe,
            "g",
            handle,
            name="m",
            prefetch="adaptive",
            lease=10,
            poll_interval=0.1,
            retry_backoff=0.01,
            retry_backoff_max=0.01,
            max_attempts=10,
        )
        out: dict[str, pgq.RunSummary] = {}
        th = threading.Thread(target=lambda: out.setdefault("s", c.run(until_empty=True)))
        th.daemon = True
        th.start()
        t0 = time.time()
        cuts = 0
        while time.time() - t0 < 8 and th.is_alive():
            time.sleep(random.uniform(0.125, 0.375))
            cuts += proxy.cut() > 0
        th.join(120)
        if th.is_alive():
            c.stop()
            problems.append("the until_empty run did not finish in 120 s after the cuts")
        summary = out.get("s")
        st = states(s, "g")
        print(f"cuts={cuts} summary={summary} states={st} handler_oks={oks}")
        if summary is not None:
            if summary.refused:
                problems.append(
                    f"summary.refused={summary.refused} with one member, a 10 s lease and"
                    " nothing paused: outcomes that were applied, counted refused"
                )
            if summary.done != oks:
                problems.append(
                    f"summary.done={summary.done} but handlers succeeded {oks} times and"
                    f" every message is done ({st})"
                )
        pe.dispose()
    verdict(problems, "RunSummary counts stay truthful across connection cuts")


if __name__ == "__main__":
    main()
