"""Facts the project spells in one place only, so that two copies cannot drift apart.

Each test here reads the source (``ast``) for a second spelling of a fact that has an
owner: the JetStream API subjects (``broker.nats.api``), how an exception reads in a log
line (``broker.errors.describe``).
"""

from __future__ import annotations

import ast
import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest

from broker.errors import describe
from broker.nats import api
from broker.nats.setup import QueueNames
from worker.handler import HandlerError, load

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("broker", "supervisor", "worker", "support", "bench", "examples")


def source_files() -> Iterator[Path]:
    for package in PACKAGES:
        yield from sorted((ROOT / package).rglob("*.py"))


def code_strings(path: Path) -> Iterator[tuple[int, str]]:
    """Every string literal of the module that is not a docstring (docstrings may name a
    subject to explain it; code must build it), with its line."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                docstrings.add(id(body[0].value))
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and (
                id(node) not in docstrings):
            yield node.lineno, node.value


@pytest.mark.slow
def test_jetstream_subjects_are_built_only_by_broker_nats_api():
    owner = ROOT / "broker" / "nats" / "api.py"
    elsewhere = [f"{path.relative_to(ROOT)}:{line}: {text!r}"
                 for path in source_files() if path != owner
                 for line, text in code_strings(path) if "$JS." in text]
    assert elsewhere == []


def test_the_subjects_are_jetstreams_spelling():
    """What the server answers on (nats-server's jsapi names), checked at the wire."""
    assert api.stream_info("S") == "$JS.API.STREAM.INFO.S"
    assert api.stream_create("S") == "$JS.API.STREAM.CREATE.S"
    assert api.stream_delete("S") == "$JS.API.STREAM.DELETE.S"
    assert api.stream_msg_get("S") == "$JS.API.STREAM.MSG.GET.S"
    assert api.stream_msg_delete("S") == "$JS.API.STREAM.MSG.DELETE.S"
    assert api.consumer_info("S", "C") == "$JS.API.CONSUMER.INFO.S.C"
    assert api.consumer_create("S", "C") == "$JS.API.CONSUMER.CREATE.S.C"
    assert api.consumer_pause("S", "C") == "$JS.API.CONSUMER.PAUSE.S.C"
    assert api.consumer_next("S", "C") == "$JS.API.CONSUMER.MSG.NEXT.S.C"
    assert api.max_deliveries_advisory("S") == "$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.S.*"
    names = QueueNames.of("stats-usage")
    assert names.next_subject == "$JS.API.CONSUMER.MSG.NEXT.Q_STATS-USAGE.worker"


def _is_type_name(node: ast.expr) -> bool:
    """``type(x).__name__``"""
    return (isinstance(node, ast.Attribute) and node.attr == "__name__"
            and isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Name)
            and node.value.func.id == "type")


@pytest.mark.slow
def test_exceptions_are_described_only_by_broker_errors():
    """``f"{type(error).__name__}: {error}"`` was written out in five modules; the copies
    already differed on an empty message ("RuntimeError:" in one, "RuntimeError" in the
    others)."""
    owner = ROOT / "broker" / "errors.py"
    elsewhere = []
    for path in source_files():
        if path == owner:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if not isinstance(node, ast.JoinedStr):
                continue
            parts = node.values
            for part, after in itertools.pairwise(parts):
                if (isinstance(part, ast.FormattedValue) and _is_type_name(part.value)
                        and isinstance(after, ast.Constant) and str(after.value).startswith(":")):
                    elsewhere.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert elsewhere == []


@pytest.mark.parametrize(("error", "text"), [
    (ValueError("bad pid"), "ValueError: bad pid"),
    (TimeoutError(), "TimeoutError"),
    (KeyError("k"), "KeyError: 'k'"),
])
def test_describe(error: BaseException, text: str):
    assert describe(error) == text


def test_a_handler_whose_import_raises_without_a_message_reads_as_the_others(
        tmp_path, monkeypatch):
    (tmp_path / "raises_bare.py").write_text("raise RuntimeError\n", encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(HandlerError) as raised:
        load("raises_bare:handle")
    assert str(raised.value).endswith("cannot be imported: RuntimeError")
