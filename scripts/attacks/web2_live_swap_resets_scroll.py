"""A live page cannot be read or copied from: every update resets what the reader did.

`static/live.js` replaced the page's live part with `innerHTML` every
refresh (2 s; 1 s in `pgq demo --web`), whatever it held. On a message page
the payload sits in a `<pre>` that scrolls inside itself (`max-height: 30rem`):
scrolled down to read a large payload, it jumped back to the top at the next
update; text selected to copy it (an error text, a payload) was unselected.
In Chromium here: a payload of 2,000 lines, `#payload` scrolled to 5,000 px
and its state word selected; after three updates the scroll is back at 0 and
the selection gone.

Expected: an update keeps the reader's scroll position (also when the part
changed) and selection (no update lands while text in it is selected; an
unchanged part is not replaced at all). Exits 1 while the defect exists.
"""

from __future__ import annotations

import sys
import time

from _browser import chromium
from _common import Schema
from _web import dashboard
from helpers import kill, set_rows

import pgq


def main() -> int:
    s = Schema("web2_live_scroll")
    problems = []
    try:
        pgq.create_topic(s.engine, "t")
        pgq.subscribe(s.engine, "g", "t")
        [mid] = pgq.publish_many(s.engine, "t", [{"lines": [f"line {i}" for i in range(2000)]}])
        with dashboard(s, refresh=0.3) as server, chromium() as driver:
            driver.get(f"{server.url}groups/g/messages/{mid}")
            time.sleep(1.0)  # live updates run
            driver.execute_script("document.getElementById('payload').scrollTop = 5000")
            before = driver.execute_script("return document.getElementById('payload').scrollTop")
            kill(s.engine, [mid], "message")  # the live part changes: it is swapped in
            deadline = time.monotonic() + 10
            while driver.find_element("id", "message-state").text != "dead":
                if time.monotonic() > deadline:
                    problems.append("the page never showed the message dead")
                    break
                time.sleep(0.05)
            time.sleep(1.0)  # more updates
            after = driver.execute_script("return document.getElementById('payload').scrollTop")
            if before < 4000:
                problems.append(f"could not scroll the payload (scrollTop {before})")
            if after != before:
                problems.append(f"an update scrolled the payload from {before} to {after}")
            driver.execute_script(
                "var r = document.createRange();"
                " r.selectNodeContents(document.getElementById('message-state'));"
                " var s = window.getSelection(); s.removeAllRanges(); s.addRange(r);"
            )
            chosen = driver.execute_script("return window.getSelection().toString()")
            set_rows(s.engine, [mid], state="ready")  # another change while it is selected
            time.sleep(1.5)  # several updates
            selected = driver.execute_script("return window.getSelection().toString()")
            if not chosen or selected != chosen:
                problems.append(f"an update dropped the selection {chosen!r} (now {selected!r})")
    finally:
        s.close()
    for p in problems:
        print("DEFECT:", p)
    if not problems:
        print("held: live updates keep the reader's scroll position and selection")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
