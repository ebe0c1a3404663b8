"""The dashboard's SVG charts print names with their control characters raw.

What it shows: every text a page prints goes through `visible` (control and
format characters escaped, as the CLI prints them) by the Jinja `finalize`
hook, except text that Python code formats into `Markup` itself:

- `charts.sparkline(label=...)`: the overview passes `'throughput of ' ~ g.group`
  and `'lag of ' ~ g.group`; `Markup.format` escapes the markup but not the
  controls, so a group name holding ESC or U+202E reaches the SVG's
  `aria-label` and `<title>` raw (overview and its `?live=1` fragment);
- `timeline.Timeline.svg`: a probe's `<title>` is `probe failed at ... by
  {member}`, so a prober's name with controls reaches the group page raw.

Names with control characters are what only an older version or another
client could write (pgq refuses them now); the CLI escapes them
(tests/integration/test_hostile_output.py), so the dashboard must too. A
screen reader reads the aria-label; a bidi override reorders what the eye
reads around it in the tooltip.

Expected: every page free of raw control/format characters (shown as `\\x1b`,
`\\u202e`). Run: .venv/bin/python scripts/attacks/web_svg_titles_raw.py (~3 s).
Exit 1 while the defect exists, 0 once fixed. Severity: text forgery (cosmetic).
"""

from _common import Schema, verdict
from _web import dashboard, request
from sqlalchemy import insert, select

import pgq
from pgq import schema as t

NAME = "evil\x1b[2J\u202etxt"

problems = []
with Schema("websvg") as s:
    pgq.create_topic(s.engine, "t")
    pgq.subscribe(s.engine, "g", "t")
    with s.engine.begin() as conn:
        gid = conn.scalar(select(t.consumer_group.c.id).where(t.consumer_group.c.name == "g"))
        conn.execute(insert(t.probe).values(group_id=gid, epoch=1, member=NAME, outcome="failed"))
        tid = conn.scalar(insert(t.topic).values(name="t2").returning(t.topic.c.id))
        conn.execute(insert(t.consumer_group).values(name=NAME, topic_id=tid))
    with dashboard(s) as server:
        for path in ("/", "/?live=1", "/groups/g", "/groups/g?live=1"):
            body = request(server.url, "GET", path).body
            raw = sorted({repr(c) for c in body if not c.isprintable() and c != "\n"})
            if raw:
                at = min(i for i, c in enumerate(body) if not c.isprintable() and c != "\n")
                problems.append(f"GET {path}: raw {raw} in {body[max(at - 50, 0) : at + 5]!r}")
verdict(problems, "no page prints a control or format character raw")
