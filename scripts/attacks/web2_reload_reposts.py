"""Reloading the page a requeue or purge answered runs the change again.

A dashboard form's POST was answered with the result page itself (200), so
the browser's reload (and Forward, and a restored tab) sent the same POST
again: a `requeue --all` reloaded an hour later requeues whatever is dead by
then, under the first reason, and writes a second audit row. In Chromium here:
log in, requeue every dead row, reload the answer: two audit rows (the second
requeued the rows that died after the first).

Expected (Post/Redirect/Get): the change answers 303 to a GET page; reloading
it changes nothing. Exits 1 while the defect exists.
"""

from __future__ import annotations

import sys
import time

from _browser import chromium
from _common import Schema
from _web import TOKEN, dashboard

import pgq
from pgq import monitor


def kill(s: Schema, ids: list[int]) -> None:
    from helpers import kill as kill_rows

    kill_rows(s.engine, ids, "message")


def main() -> int:
    s = Schema("web2_reload")
    try:
        pgq.create_topic(s.engine, "t")
        pgq.subscribe(s.engine, "g", "t")
        ids = pgq.publish_many(s.engine, "t", [{"n": i} for i in range(4)])
        kill(s, ids[:2])
        with dashboard(s, token=TOKEN) as server, chromium() as driver:
            driver.get(server.url + "login")
            driver.find_element("css selector", 'input[name="token"]').send_keys(TOKEN)
            driver.find_element("css selector", "form button").click()
            driver.get(server.url + "groups/g")
            form = driver.find_element("css selector", "#requeue-form")
            form.find_element("css selector", 'input[name="all"]').click()
            form.find_element("css selector", 'input[name="reason"]').send_keys("fixed")
            form.find_element("css selector", "button").click()
            deadline = time.monotonic() + 10
            while not driver.find_elements("css selector", "#result"):
                assert time.monotonic() < deadline, "no answer to the requeue"
                time.sleep(0.05)
            kill(s, ids[2:])  # later, other rows die
            driver.refresh()  # the operator reloads the answer
            time.sleep(1.0)
        audit = monitor.audit(s.engine, "g")
    finally:
        s.close()
    if len(audit) != 1:
        counts = [(a["action"], a["count"], a["reason"]) for a in audit]
        print(f"DEFECT: reloading the answer ran the requeue again: audit {counts}")
        return 1
    print("held: reloading the answer to a requeue changes nothing")
    return 0


if __name__ == "__main__":
    sys.exit(main())
