"""Member names with control characters (newline, ESC, U+2028) are accepted.

What it shows: `check_member_name` only checks the length. `pgq consume --name
$'a\\nb'` (or `pgq.Consumer(..., name="x\\x1b[2J")`) runs, the name is stored in the
member table and the rows' `lease_owner`, and logs print it in key=value lines, where a
newline forges a log line.

Expected (DESIGN §7: "member names are 1-200 printable characters, no control
characters"): exit 2 with one line. Actual: accepted, exit 0.

Run: .venv/bin/python scripts/attacks/member_name_control_chars_accepted.py (~10 s)
Exit 0 once fixed, 1 while the defect exists. Severity: cosmetic / validation.
"""

from _common import Schema, verdict

import pgq

problems = []
with Schema("mname") as s:
    pgq.create_topic(s.engine, "t")
    pgq.subscribe(s.engine, "g", "t")
    for name in ("a\nb", "x\x1b[2J", "line\u2028sep", "tab\there"):
        r = s.pgq(
            "consume",
            "g",
            "--handler",
            "attack_handlers:ok",
            "--until-empty",
            "--name",
            name,
            timeout=30,
        )
        if r.returncode != 2:
            problems.append(f"--name {name!r}: exit {r.returncode} (expected 2)")
    stored = [row[0] for row in s.sql(f'SELECT name FROM "{s.name}".member')]
    if stored:
        problems.append(f"member names stored: {stored!r}")
verdict(problems, "member names with control characters are refused")
