"""The test-support layer stays one layer: shared helpers live in ``support/`` (and the PHP
models in ``tests/queue5*.py``), fixtures in ``tests/conftest.py``. A test module that
imports another runs that module's code and fixtures wherever it is imported, and a
helper copied into a second test file drifts from the first."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _test_modules() -> dict[str, Path]:
    return {f"tests.{path.stem}": path for path in sorted(TESTS.glob("test_*.py"))}


def imported(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def test_no_test_module_imports_another():
    modules = _test_modules()
    offenders = {name: sorted(imported(path) & set(modules)) for name, path in modules.items()}
    assert {name: found for name, found in offenders.items() if found} == {}


# A Redis Cluster client where the conftest's ``client`` is a plain one: not a copy.
OTHER_KIND = {("client", "tests.test_cluster"), ("client", "tests.test_cluster_failover")}


def test_no_test_file_redefines_a_conftest_fixture():
    """A conftest fixture defined again in a test file is a copy that drifts (per-file
    fixtures that only pass options to a conftest one, such as ``broker``, have names of
    their own)."""
    shared = fixtures_of(TESTS / "conftest.py")
    defined: defaultdict[str, list[str]] = defaultdict(list)
    for name, path in _test_modules().items():
        for fixture in fixtures_of(path) & shared:
            if (fixture, name) not in OTHER_KIND:
                defined[fixture].append(name)
    assert dict(defined) == {}


def fixtures_of(path: Path) -> set[str]:
    return {node.name for node in ast.parse(path.read_text(encoding="utf-8")).body
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            and any("fixture" in ast.unparse(d) for d in node.decorator_list)}
