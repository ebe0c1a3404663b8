"""`pgq purge --older-than` reads Arabic-Indic digits and `1_000` as numbers.

What it shows: `parse_duration` (pgq/settings.py) tries `float(text)` first, and
Python's float() takes any Unicode decimal digit and underscores: `--older-than ٣`
(U+0663) is 3 seconds, `--older-than ١٠٠٠٠٠` is 100000, `1_000` is 1000. On a
destructive command a value that *looks* like something else purges more than meant
(requeue ids had the same defect, fixed in 97d127c: '٣' requeued id 3). The same
parser reads every duration setting (PGQ_LEASE=٣0 is a 30 s lease).

Expected: exit 2, one line, nothing purged. Fix: in `parse_duration`, accept a bare
number only when it is ASCII, e.g. `if re.fullmatch(r"[0-9]+(\\.[0-9]*)?|\\.[0-9]+", s)`
(or `s.isascii() and "_" not in s`) before `float(s)`.

Run: .venv/bin/python scripts/attacks/older_than_non_ascii_digits.py (~5 s). Exit 1
while the defect exists, 0 once fixed. Severity: validation (destructive command).
"""

from _common import Schema, verdict

import pgq

problems = []
with Schema("olderthan") as s:
    pgq.create_topic(s.engine, "t")
    pgq.subscribe(s.engine, "g", "t")
    for value in ("\u0663", "\u0661\u0660", "1_000", "\uff13"):
        r = s.pgq("purge", "g", "--dead", "--older-than", value, "--reason", "r")
        if r.returncode != 2:
            problems.append(f"--older-than {value!r}: exit {r.returncode}, {r.stdout.strip()!r}")
verdict(problems, "--older-than takes ASCII numbers only")
