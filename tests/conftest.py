"""The fixtures of every test layer, defined once in `tests/fixtures/`.

This top-level conftest also puts `tests/` on `sys.path`, so test modules
import `helpers` (plain helpers) and the plugins below resolve.
"""

from __future__ import annotations

pytest_plugins = [
    "fixtures.cli",
    "fixtures.database",
    "fixtures.groups",
    "fixtures.pgbouncer",
    "fixtures.processes",
]
