"""Names and error texts with escape sequences reach the terminal raw.

What it shows: a handler's exception text (stored in `delivery.last_error`) and
names written by an older version or another client (member, topic and group
names) are printed as they are by `pgq members`, `status`, `dead` and
`breaker`: an OSC sequence (`ESC ] 0 ; owned BEL`) sets the terminal's title
even when the output is piped into a pager or a log, a C1 CSI (U+009B) or a
right-to-left override hides text, and a newline forges a table row.

Expected (DESIGN §7: "Text that came from users or handlers ... is printed
with control characters escaped, so no output can move the cursor or forge a
line"): no control character in any human output line, no forged line; the
`--json` output is exact JSON that gives back the very same text.

Run: .venv/bin/python scripts/attacks/terminal_injection.py (~10 s)
Exit 0 once fixed, 1 while the defect exists. Severity: terminal/log injection.
"""

import json

from _common import Schema, verdict

import pgq

OSC = "\x1b]0;owned\x07"
ERROR = f"{OSC}\nFORGED error line"
MEMBERS = [f"evil{OSC}", "x\nFORGED  yes  closed", "csi\x9b2J", "rtl\u202eevil", "cr\rok"]


def fail(msg: pgq.Message) -> None:
    raise ValueError(ERROR)


def bad_lines(out: str) -> list[str]:
    """Output lines that hold a control character or start a forged row."""
    return [
        line
        for line in out.split("\n")
        if line.startswith("FORGED") or any(not ch.isprintable() for ch in line)
    ]


problems = []
with Schema("termesc") as s:
    pgq.create_topic(s.engine, "t")
    pgq.subscribe(s.engine, "g", "t")
    # what an older version (or another client) could have written
    gid = s.sql(f'SELECT id FROM "{s.name}".consumer_group WHERE name = :g', g="g")[0][0]
    for name in MEMBERS:
        s.sql(
            f'INSERT INTO "{s.name}".member (group_id, name, host, pid)'
            " VALUES (:gid, :name, 'old-host', 1) RETURNING name",
            gid=gid,
            name=name,
        )
    tid = s.sql(f'INSERT INTO "{s.name}".topic (name) VALUES (:t) RETURNING id', t=f"t{OSC}")
    s.sql(
        f'INSERT INTO "{s.name}".consumer_group (name, topic_id) VALUES (:g, :tid) RETURNING id',
        g="g2\nFORGED group",
        tid=tid[0][0],
    )
    pgq.publish(s.engine, "t", {"n": 1})
    pgq.Consumer(s.engine, "g", fail, workers=1, max_attempts=1).run(until_empty=True)

    for args in (
        ["members", "g"],
        ["status", "g"],
        ["status"],
        ["dead", "g"],
        ["breaker", "g"],
        ["check", "g"],
    ):
        r = s.pgq(*args, input=b"", timeout=30)  # bytes: a CR must not pass as a newline
        for line in bad_lines(r.stdout.decode()):
            problems.append(f"pgq {' '.join(args)}: raw line {line!r}")
    members = json.loads(s.pgq("members", "g", "--json").stdout)
    if not set(MEMBERS) <= {m["name"] for m in members}:
        problems.append(f"pgq members --json: names {[m['name'] for m in members]!r}")
    dead = json.loads(s.pgq("dead", "g", "--json").stdout)
    if [d["error"] for d in dead] != [f"ValueError: {ERROR}"]:
        problems.append(f"pgq dead --json: errors {[d['error'] for d in dead]!r}")
verdict(problems, "names and error texts are shown with control characters escaped")
