"""A DSN libpq cannot parse puts its password in the one-line error (and in `pgq check`).

What it shows: `check_dsn` (pgq/store/engine.py) copies libpq's parse error into
`BadDsn`, and libpq quotes the token it choked on, often the whole URI:
`postgresql://u:SECRET@[::1]x/db` gives
`pgq: error: invalid database address: unexpected character "x" ... in URI ...:
"postgresql://u:SECRET@[::1]x/db"`; a bad percent escape in the password
(`u:SEC%zzRET@`) or `%00` quotes the password alone (`"SEC%zzRET"`), which no
`://user:` pattern could scrub. `pgq check` prints the same on stdout, where
Nagios stores it; a systemd unit's stderr goes to the journal.

Expected (issue 11: "No secrets ever"): the line names the problem without
the password. Run: .venv/bin/python scripts/attacks/dsn_password_in_error_line.py
(~5 s). Exit 1 while the defect exists, 0 once fixed. Severity: secret leak.
"""

from _common import Schema, verdict

SECRET = "S3CRETpw"
DSNS = [
    f"postgresql://postgres:{SECRET}@[::1]x:5432/postgres",
    f"postgresql://postgres:{SECRET[:3]}%zz{SECRET[3:]}@127.0.0.1:5432/postgres",
    f"postgresql://postgres:{SECRET}%00x@127.0.0.1:5432/postgres",
]
CHUNK = SECRET[3:]  # what every variant of the password contains

problems = []
with Schema("dsnleak") as s:
    for dsn in DSNS:
        for args in (("status",), ("check", "g"), ("consume", "g", "--handler", "x:y")):
            r = s.pgq(*args, PGQ_DSN=dsn, timeout=30)
            out = r.stdout + r.stderr
            if CHUNK in out:
                line = next(x for x in out.splitlines() if CHUNK in x)
                problems.append(f"pgq {args[0]} with {dsn!r}: {line[:160]}")
verdict(problems, "an unparsable DSN's password never reaches the error line")
