"""The project's modules import each other without a circle.

A circle makes the import order matter (a module half-initialised when the other reads
it) and hides which module owns what; the handler process's modules (``worker``) once had
one (``worker.aio`` imported ``worker.runner``, which imported it back). The graph is read
from the source with ``ast``: every ``import`` and ``from ... import`` of a project module,
at module level or inside a function (those run too, later), except the ones under
``if TYPE_CHECKING:`` (never run).
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("supervisor", "worker", "broker", "support", "examples", "bench")


def project_modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the project's packages."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def imported_modules(path: Path, module: str, modules: set[str]) -> set[str]:
    """The project modules ``module`` imports: for ``from pkg import name``, ``pkg.name``
    when that is a module, else ``pkg`` (the name is one of its attributes); for
    ``import a.b``, the longest of ``a.b``, ``a`` that is a module."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in _runtime_nodes(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.add(_longest_module(alias.name, modules))
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, module, is_package)
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                found.add(submodule if submodule in modules else _longest_module(base, modules))
    return {name for name in found if name and name != module}


def _longest_module(name: str, modules: set[str]) -> str:
    parts = name.split(".")
    while parts and ".".join(parts) not in modules:
        parts.pop()
    return ".".join(parts)


def _runtime_nodes(tree: ast.AST) -> Iterator[ast.AST]:
    """Every node that may run: all of them but the body of ``if TYPE_CHECKING:``."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                yield child
                yield from _runtime_nodes(child)
            continue
        yield node
        yield from _runtime_nodes(node)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    parts = module.split(".") if is_package else module.split(".")[:-1]
    parts = parts[: len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


@functools.cache
def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports."""
    modules = project_modules()
    names = set(modules)
    return {module: imported_modules(path, module, names) for module, path in modules.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for other in sorted(graph.get(module, ())):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in on_stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return sorted(found)


@pytest.mark.slow
def test_function_level_imports_count() -> None:
    """The CLI imports the handler process's entry point inside a function."""
    assert "worker.runner" in import_graph()["supervisor.cli"]


def test_the_handler_process_modules_import_only_downwards() -> None:
    """As gunicorn's workers: the entry point picks a loop, each loop builds on the base,
    and nothing imports back up (nor one loop the other)."""
    graph = import_graph()
    assert graph["worker.base"] & {"worker.runner", "worker.sync", "worker.aio"} == set()
    assert graph["worker.sync"] & {"worker.runner", "worker.aio"} == set()
    assert graph["worker.aio"] & {"worker.runner", "worker.sync"} == set()
    assert {"worker.base", "worker.sync", "worker.aio"} <= graph["worker.runner"]


def test_the_project_imports_no_circle() -> None:
    assert circles(import_graph()) == []


#: The layers, lowest first: a module may import its own layer and the ones below, never one
#: above. broker/ knows nothing of ours but itself; worker/ (the handler process) builds on
#: broker/ (envelope, failure records); supervisor/ on both. support/, examples/ and bench/
#: are their clients (tests, the example handler, the benchmarks): nothing of the three
#: layers may import them.
LAYERS = ("broker", "worker", "supervisor")
CLIENTS = ("support", "examples", "bench", "tests")


def test_the_layers_import_only_downwards() -> None:
    graph = import_graph()
    upward = sorted(
        (module, other) for module, imported in graph.items()
        if (layer := module.split(".")[0]) in LAYERS
        for other in imported
        if (other.split(".")[0] in LAYERS
            and LAYERS.index(other.split(".")[0]) > LAYERS.index(layer))
        or other.split(".")[0] in CLIENTS
    )
    assert upward == [], "imports that climb a layer (module, what it imports): " + repr(upward)


def test_the_ring_imports_nothing_of_ours() -> None:
    """The shared-memory ring is a struct module (as Dramatiq's canteen): both sides of a
    fork use it, and it must not drag the project in."""
    assert import_graph()["worker.ring"] == set()


def test_every_package_of_ours_is_in_the_wheel() -> None:
    """A new package folder left out of pyproject's list is missing from the installed
    wheel (scripts/wheel-check.sh fails with ModuleNotFoundError): said here at once."""
    import tomllib

    root = Path(__file__).resolve().parent.parent
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"][
        "packages"])
    found = {".".join(init.parent.relative_to(root).parts)
             for top in ("supervisor", "worker", "broker", "examples")
             for init in (root / top).rglob("__init__.py")}
    assert found - listed == set(), "packages missing from [tool.setuptools] packages"
