"""Hostile names and payloads on Citus, as on one server.

Names: 63-character topic and group names with dots, dashes and underscores (the longest
the name rule allows), names differing only in case, a member name with quotes, a
backslash, `%`, a space, an emoji and 160 characters. Payloads through `pgq publish`
(stdin, JSON lines) and `pgq.publish_many`: NUL (`\\u0000`) in a string, a lone
surrogate, 4,000-digit integers, 1e308, deeply nested arrays, a 4 MB string, astral
characters, `key` and `headers`; each consumed by a group on each worker and compared.

Expected: the same answers as one server (a refused payload: exit 2 or `InvalidPayload`,
one line, nothing written; an accepted one: delivered to every group equal to what was
published), no traceback, no Citus error text leaking as a crash.
Observed: printed; exit 1 on a traceback, a payload delivered different from what was
published, or an answer that differs from one server's.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from citus_common import CitusSchema, groups_on_each_worker, verdict

import pgq

problems: list[str] = []

PAYLOADS = [
    {"s": "astral \U0001f600 \u2028 \u202e rtl"},
    {"big": int("9" * 4000)},
    {"f": 1.5e-300, "neg": -1},  # 1e308 comes back as the integer 10**308: jsonb, one server too
    {"deep": json.loads("[" * 200 + "]" * 200)},
    {"huge": "x" * (4 * 1024 * 1024)},
    {"quote": "'; DROP TABLE message; --", "dollar": "$$ $a$"},
    "just a string",
    None,
    [1, 2, 3],
]
REFUSED = [{"nul": "a\x00b"}, {"lone": "\ud800"}]


def one_server_answer(payload: object) -> str:
    """What one server says (the local PostgreSQL at 5432)."""
    import _common

    s = _common.Schema("hostile1")
    try:
        pgq.create_topic(s.engine, "t")
        pgq.publish(s.engine, "t", payload)
        return "accepted"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        s.close()


def main() -> None:
    with CitusSchema("hostile") as s, tempfile.TemporaryDirectory() as tmpd:
        long_topic = "T" + "._-x" * 15 + "zz"
        assert len(long_topic) == 63, len(long_topic)
        pgq.create_topic(s.engine, long_topic)
        pgq.create_topic(s.engine, long_topic.lower())
        placed = groups_on_each_worker(s, long_topic, "G" + "-._y" * 15 + "_")
        groups = [g for v in placed.values() for g in v]
        print("topic on", s.topic_port(long_topic), {g: s.group_port(g) for g in groups})
        ids: dict[int, object] = {}
        for p in PAYLOADS:
            ids[
                pgq.publish(
                    s.engine, long_topic, p, key="k\u00e9y\U0001f600", headers={"h": "\u2028"}
                )
            ] = p
        for p in REFUSED:
            try:
                pgq.publish(s.engine, long_topic, p)
                got = "accepted"
            except Exception as exc:
                got = f"{type(exc).__name__}: {exc}"
            local = one_server_answer(p)
            print(f"publish {p!r:.40}: Citus {got!r:.160}; one server {local!r:.160}")
            if got.split(":")[0] != local.split(":")[0]:
                problems.append(
                    f"payload {p!r:.40}: Citus says {got!r:.200}, one server {local!r:.200}"
                )
        lines = '{"a": 1}\n{"nul": "\\u0000"}\n{"b": 2}\n'
        r = s.pgq("publish", long_topic, "-", input=lines)
        print(
            f"pgq publish (a NUL escape among lines): rc={r.returncode} {r.stdout.strip()} {r.stderr.strip()[:300]}"
        )
        if "Traceback" in r.stderr:
            problems.append(f"pgq publish: traceback {r.stderr[-500:]}")
        for g in groups:
            member = "m'\"\\% \U0001f600 " + "z" * 150
            r = s.pgq(
                "consume",
                g,
                "--handler",
                "citus_handlers:record",
                "--until-empty",
                "--name",
                member,
                timeout=60,
                ATK_DIR=tmpd,
                ATK_TAG=g[-4:],
            )
            print(f"consume {g} as odd member: rc={r.returncode} {r.stderr.strip()[-300:]}")
            if r.returncode != 0 or "Traceback" in r.stderr:
                problems.append(
                    f"consume {g} (odd member name): rc={r.returncode} {r.stderr[-400:]}"
                )
            got = {}
            f = Path(tmpd, f"ok-{g[-4:]}")
            for line in f.read_text().splitlines() if f.exists() else []:
                mid, _a, _p, body = line.split(" ", 3)
                got[int(mid)] = json.loads(body)
            for mid, p in ids.items():
                if mid not in got:
                    problems.append(f"{g}: message {mid} ({str(p)[:40]}) never delivered")
                elif got[mid] != p:
                    problems.append(
                        f"{g}: message {mid} delivered as {str(got[mid])[:60]}, published {str(p)[:60]}"
                    )
            for cmd in (["status", g], ["members", "--all", g], ["show", g, str(min(ids))]):
                r = s.pgq(*cmd, timeout=60)
                if r.returncode != 0 or "Traceback" in r.stderr:
                    problems.append(
                        f"pgq {' '.join(cmd)[:80]}: rc={r.returncode} {r.stderr[-300:]}"
                    )
    verdict(problems, "hostile names and payloads on Citus")


if __name__ == "__main__":
    main()
