"""Topic and group names with a trailing newline are accepted and stored.

What it shows: `NAME_RE` is `^...$` used with `re.match`; `$` also matches before a
trailing "\\n", so `pgq.create_topic(engine, "orders\\n")`, `pgq subscribe "billing\\n" t`
create a topic / group whose name ends in a newline. `pgq subscribe` then prints the raw
newline ("group billing\\n on topic t": a forged second line), and the group is a twin of
"billing" that every tool shows as the same text.

Expected (DESIGN §7: names match the pattern "as a whole string (a trailing newline is not
a match)"): refused, exit 2, one line. Actual: accepted (exit 0), stored.

Run: .venv/bin/python scripts/attacks/names_trailing_newline_accepted.py (~5 s)
Exit 0 once fixed, 1 while the defect exists. Severity: cosmetic / validation.
"""

from _common import Schema, verdict

import pgq

problems = []
with Schema("nl") as s:
    pgq.create_topic(s.engine, "t")
    try:
        pgq.create_topic(s.engine, "orders\n")
        problems.append("pgq.create_topic accepted 'orders\\n'")
    except Exception:
        pass
    r = s.pgq("subscribe", "billing\n", "t")
    if r.returncode != 2:
        problems.append(f"pgq subscribe 'billing\\n' t exited {r.returncode}, stdout {r.stdout!r}")
    names = [row[0] for row in s.sql(f'SELECT name FROM "{s.name}".consumer_group')]
    names += [row[0] for row in s.sql(f'SELECT name FROM "{s.name}".topic')]
    bad = [n for n in names if n.endswith("\n")]
    if bad:
        problems.append(f"names stored with a trailing newline: {bad!r}")
verdict(problems, "names with a trailing newline are refused")
