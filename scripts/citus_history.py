"""The history checker on a Citus cluster, for as long as you ask.

    python scripts/citus_history.py --seconds 300 [--dsn postgresql://postgres@127.0.0.1:9701/postgres]
        [--report history.txt] [--single] [--growth move | --growth add:HOST:PORT]

Runs `tests/chaos/test_topics.py` (two topics with three groups each, concurrent
publishers, some committing out of id order, retention, a `kill -9` and a cut of
every connection per cycle, a watch on every group's frontier, then a drain and
the history checker) in a child pytest against the coordinator, in distributed
mode (`PGQ_TEST_DISTRIBUTED=1`: the schema is placed with
`pgq.migrate(engine, distributed=True)`, in the coordinator's database). Prints
the checker's report (lost, unexplained duplicates, the frontier watch's
findings) and exits with the child's status. `--single` runs the same on a plain
server (`--dsn` then names it) for comparison. The schema is dropped afterwards.
`--growth` changes the cluster a third into the run (`tests/chaos/growth.py`):
`move` moves group `taa`'s shard to the other worker (after making the node it
leaves run ahead in xids), `add:HOST:PORT` adds that node (a server with the citus
extension, in no cluster) and rebalances. A move needs `wal_level = logical` on the
nodes for Citus's default, non-blocking transfer.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DSN = os.environ.get("PGQ_CITUS_DSN") or "postgresql://postgres@127.0.0.1:9701/postgres"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=300.0, help="how long the chaos lasts")
    parser.add_argument("--dsn", default=DEFAULT_DSN, help="the Citus coordinator")
    parser.add_argument("--report", help="also append the checker's report to this file")
    parser.add_argument("--single", action="store_true", help="a plain server, not distributed")
    parser.add_argument("--growth", default="", help="move, or add:HOST:PORT (see above)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="pgq-history-") as tmp:
        report = args.report or str(Path(tmp) / "report.txt")
        env = {k: v for k, v in os.environ.items() if k != "PGQ_CITUS_DSN"}
        env.update(
            PGQ_TEST_DSN=args.dsn,
            PGQ_TEST_DISTRIBUTED="0" if args.single else "1",
            CHAOSQ_TOPICS_SECONDS=str(args.seconds),
            CHAOSQ_REPORT=report,
            CHAOSQ_GROWTH=args.growth,
        )
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rN"]
        cmd.append("tests/chaos/test_topics.py")
        try:
            code = subprocess.run(
                cmd, cwd=ROOT, env=env, timeout=args.seconds * 1.5 + 300
            ).returncode
        except subprocess.TimeoutExpired:
            sys.stderr.write(f"still running after {args.seconds * 1.5 + 300:g}s: stopped\n")
            code = 124
        if not args.report and Path(report).exists():
            sys.stdout.write(Path(report).read_text())
    return code


if __name__ == "__main__":
    sys.exit(main())
