"""The layering the file list promises: checked on the source, not taken on trust.

- only `pgq/store/` imports the driver (psycopg) or the statements (`pgq.sql`);
- `pgq/consumer/` in particular imports neither;
- `pgq.records` (the records every layer passes) imports nothing from pgq;
- no import circle anywhere in `pgq/`, counting imports inside functions too
  (a lazy import hides a circle; it does not remove it). Imports under
  `if TYPE_CHECKING:` are not run and do not count.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "pgq"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def imports(name: str) -> Iterator[str]:
    """The modules `name` imports (absolute names), skipping TYPE_CHECKING blocks."""
    path = MODULES[name]
    tree = ast.parse(path.read_text(), str(path))
    skip = _type_checking_lines(tree)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                yield sub if sub in MODULES else base


def pgq_imports(name: str) -> set[str]:
    return {m for m in imports(name) if m in MODULES and m != name}


def test_the_source_tree_is_found():
    assert {"pgq.store", "pgq.consumer.fetcher", "pgq.records", "pgq.sql.claim"} <= set(MODULES)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_only_the_store_imports_the_driver_or_the_statements(name):
    if name.startswith(("pgq.store", "pgq.sql")):
        return
    bad = {m for m in imports(name) if m.split(".")[0] == "psycopg" or m.startswith("pgq.sql")}
    assert not bad, f"{name} imports {sorted(bad)}: go through pgq.store"


def test_records_import_nothing_from_pgq():
    assert pgq_imports("pgq.records") == set()


def test_there_is_no_import_circle():
    graph = {name: pgq_imports(name) for name in MODULES}
    # a module's package __init__ runs first: that edge is implicit, not an import
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = [*path[path.index(nxt) :], nxt]
                raise AssertionError("import circle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_only_pgq_otel_imports_opentelemetry(name):
    """The `otel` extra is optional: one package imports it, and guards the import."""
    if name.startswith("pgq.otel"):
        return
    bad = {m for m in imports(name) if m.split(".")[0] == "opentelemetry"}
    assert not bad, f"{name} imports {sorted(bad)}: go through pgq.otel"


def test_test_modules_outside_packages_have_unique_names():
    """pytest imports a test file outside a package by its bare name: two files of one
    name (tests/citus/test_ordered.py beside tests/integration/test_ordered.py) stop
    the whole run at collection ("import file mismatch")."""
    tests = ROOT / "tests"
    loose = [p for p in tests.rglob("test_*.py") if not (p.parent / "__init__.py").exists()]
    names = [p.name for p in loose]
    twice = sorted({n for n in names if names.count(n) > 1})
    assert twice == [], [str(p.relative_to(ROOT)) for p in loose if p.name in twice]
