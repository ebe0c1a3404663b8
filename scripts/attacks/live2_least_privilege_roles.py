"""Today's new statements under the roles `pgq grant` makes: a `--consumer` role
draws token blocks (`nextval` on lease_token), reads the lock holders (`pg_locks`,
`to_regclass` of the member table) and drains with `--until-empty`; an `--admin`
role runs `pgq status --json`, `pgq members` and `pgq breaker` while a member of the
consumer role runs and during an outage (the prober named from pg_locks).

Run: .venv/bin/python scripts/attacks/live2_least_privilege_roles.py (~30 s)
Exit 1 when a granted role cannot do its job.
"""

import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import DSN, ROOT, Schema, states, verdict
from sqlalchemy import text

import pgq

HANDLER = r"""
import os, pgq
def handle(msg):
    if os.path.exists(os.environ["ATK_DOWN"]):
        raise pgq.SystemicError("down")
"""

problems: list[str] = []
tag = secrets.token_hex(3)
roles = {"consumer": f"atk_c_{tag}", "admin": f"atk_a_{tag}"}
admin_engine = pgq.connect(DSN)
with admin_engine.begin() as c:
    for r in roles.values():
        c.execute(text(f'CREATE ROLE "{r}" LOGIN'))
try:
    with Schema("l2priv") as s:
        d = Path(tempfile.mkdtemp())
        (d / "atk_h.py").write_text(HANDLER)
        down = d / "down"
        pgq.create_topic(s.engine, "t")
        pgq.subscribe(s.engine, "g", "t")
        for job, r in roles.items():
            g = s.pgq("grant", r, f"--{job}")
            if g.returncode:
                problems.append(f"grant --{job}: {g.stderr.strip()}")
        pgq.publish_many(s.engine, "t", [{"i": i} for i in range(30)])

        def dsn(role: str) -> str:
            return DSN.replace("postgres@", f"{role}@", 1)

        def run(role: str, *args: str, **extra: str):
            return s.pgq(
                *args,
                PGQ_DSN=dsn(role),
                PYTHONPATH=os.pathsep.join([str(d), str(ROOT)]),
                ATK_DOWN=str(down),
                **extra,
            )

        r = run(
            roles["consumer"],
            "consume",
            "g",
            "--handler",
            "atk_h:handle",
            "--until-empty",
            "--name",
            "c1",
        )
        print("consumer drain rc", r.returncode, states(s, "g"), r.stderr.strip().splitlines()[-1:])
        if r.returncode != 0 or states(s, "g").get("ready"):
            problems.append(f"consumer role drain: rc={r.returncode} {r.stderr[-400:]}")
        # an outage: two consumer-role members, then the admin role reads status
        down.touch()
        pgq.publish_many(s.engine, "t", [{"i": i} for i in range(60)])
        env = {k: v for k, v in os.environ.items() if not k.startswith("PGQ_")}
        env.update(
            PGQ_DSN=dsn(roles["consumer"]),
            PGQ_SCHEMA=s.name,
            ATK_DOWN=str(down),
            PYTHONPATH=os.pathsep.join([str(d), str(ROOT)]),
            PGQ_BREAKER_HEARTBEAT="0.3",
            PGQ_BREAKER_MEMBER_TTL="2",
            PGQ_BREAKER_MIN_CALLS="3",
            PGQ_BREAKER_WINDOW="5",
            PGQ_RETRY_BACKOFF="0.1",
            PGQ_RETRY_BACKOFF_MAX="0.2",
            PGQ_MAX_ATTEMPTS="100",
            PGQ_BREAKER_PROBE_INTERVAL="0.5",
            PGQ_BREAKER_PROBE_INTERVAL_MAX="1",
        )
        ms = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    "from pgq.cli import main; main()",
                    "consume",
                    "g",
                    "--handler",
                    "atk_h:handle",
                    "--name",
                    n,
                ],
                env=env,
                cwd=d,
                stdout=open(d / f"{n}.log", "w"),
                stderr=subprocess.STDOUT,
            )
            for n in ("c2", "c3")
        ]
        try:
            opened = None
            end = time.monotonic() + 25
            while time.monotonic() < end:
                st = run(roles["admin"], "status", "g", "--json")
                if st.returncode:
                    problems.append(f"admin status: rc={st.returncode} {st.stderr[-400:]}")
                    break
                j = json.loads(st.stdout)
                grp = j["groups"][0] if "groups" in j else j
                if grp["breaker"]["state"] == "OPEN" and grp["breaker"]["prober"]:
                    opened = grp["breaker"]
                    live = [m["name"] for m in grp["members"] if m.get("live")]
                    print("admin status in the outage: breaker", opened, "live members", live)
                    if sorted(live) != ["c2", "c3"]:
                        problems.append(
                            f"admin status shows live members {live}, expected c2 and c3"
                        )
                    break
                time.sleep(0.5)
            if not opened:
                problems.append("setup: no OPEN breaker with a prober seen within 25 s")
            for args in (("members", "g"), ("breaker", "g"), ("check", "g")):
                r = run(roles["admin"], *args)
                print(
                    f"admin {' '.join(args)}: rc={r.returncode}",
                    (r.stdout.strip().splitlines() or [""])[0][:100],
                )
                if (
                    r.returncode not in (0, 1, 2)
                    or "Traceback" in r.stderr
                    or "permission" in r.stderr
                ):
                    problems.append(f"admin {args}: rc={r.returncode} {r.stderr[-300:]}")
        finally:
            for m in ms:
                m.kill()
                m.wait()
        for n in ("c2", "c3"):
            log = (d / f"{n}.log").read_text()
            if "permission denied" in log or "Traceback" in log:
                problems.append(
                    f"{n}: {[ln for ln in log.splitlines() if 'ermission' in ln or 'Error' in ln][:3]}"
                )
finally:
    with admin_engine.begin() as c:
        for r in roles.values():
            c.execute(text(f'DROP OWNED BY "{r}"'))
            c.execute(text(f'DROP ROLE "{r}"'))
    admin_engine.dispose()

verdict(problems, "granted consumer and admin roles with today's token and liveness statements")
