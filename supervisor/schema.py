"""How a configuration key is declared, read from TOML, checked and named in a message.

``supervisor.config`` declares the keys with this; adding a key changes that module only.
A key is a field of its section's frozen dataclass, made with ``setting``: the annotation
is its type, the field holds its default, its rules and one line of documentation.
``keys_of`` turns the sections into the one table that ``Values`` (reading a file) and
``key_table`` (docs/configuration.md's) share, so a key cannot be documented one way and validated
another.

Every problem is a ``ConfigError`` whose message is one line naming the file and the key.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import tomllib
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import MISSING, field
from pathlib import Path
from typing import Any, NamedTuple

from broker.urls import redact

#: The default of a key that every file must set.
REQUIRED = MISSING


class ConfigError(Exception):
    """The configuration cannot be used; the message is one line naming the file and key."""


# --- rules: each says in a few words what it allows, and why a value is refused ------------


class Rule(NamedTuple):
    text: str  # what is allowed, for describe()
    check: Callable[[Any], str | None]  # the reason a value is refused, or None


def at_least(low: float) -> Rule:
    return Rule(f">= {low}", lambda value: None if value >= low else f"must be >= {low}")


def above(low: float) -> Rule:
    return Rule(f"> {low}", lambda value: None if value > low else f"must be > {low}")


def at_most(high: float) -> Rule:
    return Rule(f"<= {high}", lambda value: None if value <= high else f"must be <= {high}")


def multiple_of(step: int) -> Rule:
    return Rule(
        f"multiple of {step}",
        lambda value: None if value % step == 0 else f"must be a multiple of {step}",
    )


def one_of(choices: tuple[str, ...]) -> Rule:
    def check(value: str) -> str | None:
        if value in choices:
            return None
        return f"must be one of {', '.join(choices)}{_did_you_mean(value, choices)}"

    return Rule(", ".join(choices), check)


NOT_EMPTY = Rule("not empty", lambda value: None if value.strip() else "must not be empty")
NO_SPACES = Rule(
    "no spaces", lambda value: "must not contain spaces" if re.search(r"\s", value) else None
)


# --- declaring keys --------------------------------------------------------------------------


def setting(default: Any, doc: str, *rules: Rule, same_as: str | None = None) -> Any:
    """Declare one key: default (REQUIRED, or None with ``same_as``), doc and rules.

    ``same_as`` names the key whose value is the default: ``"coroutines"`` in the same
    section, ``"job.max_attempts"`` in another one, or a product of keys of the same section
    (``"coroutines * tasks_per_process"``).
    """
    metadata = {"doc": doc, "rules": rules, "same_as": same_as}
    return field(default=None if same_as else default, metadata=metadata)


def fill_same_as(section: Any, lookup: Callable[[str], Any], copy: bool = False) -> Any:
    """Give keys declared ``same_as`` another key, and left unset, that key's value.

    In place for keys of the same section (from ``__post_init__``); as a copy for keys of
    another section (from ``Config``, which sees all sections).
    """
    changes = {}
    for spec in dataclasses.fields(section):
        same_as = spec.metadata.get("same_as")
        if same_as and ("." in same_as) == copy and getattr(section, spec.name) is None:
            changes[spec.name] = math.prod(lookup(name) for name in same_as.split(" * "))
    if copy:
        return dataclasses.replace(section, **changes) if changes else section
    for name, value in changes.items():
        object.__setattr__(section, name, value)
    return section


class Key(NamedTuple):
    section: str
    name: str
    kind: type  # int, float (seconds: int or float accepted), bool or str
    default: Any  # REQUIRED, or None when same_as names the default
    same_as: str | None
    rules: tuple[Rule, ...]
    doc: str

    @property
    def label(self) -> str:
        return f"[{self.section}] {self.name}"


def keys_of(sections: Mapping[str, type]) -> tuple[Key, ...]:
    """Every key of the section dataclasses, in file order."""
    return tuple(key for section, cls in sections.items() for key in _keys_of(section, cls))


def _keys_of(section: str, cls: type) -> list[Key]:
    hints = typing.get_type_hints(cls)
    return [
        Key(
            section,
            spec.name,
            hints[spec.name],
            spec.default,
            spec.metadata["same_as"],
            spec.metadata["rules"],
            spec.metadata["doc"],
        )
        for spec in dataclasses.fields(cls)
    ]


def _qualified(key: Key) -> list[str]:
    """The ``section.name`` of each key whose product ``key`` defaults to."""
    assert key.same_as
    return [name if "." in name else f"{key.section}.{name}" for name in key.same_as.split(" * ")]


class CrossCheck(NamedTuple):
    doc: str
    check: Callable[[Values], str | None]


# --- reading a file --------------------------------------------------------------------------


def read_text(path: str | os.PathLike[str]) -> str:
    """The text of the file at ``path``; raises ConfigError."""
    name = str(path)
    try:
        data = Path(path).read_bytes()
    except OSError as error:
        raise ConfigError(f"{name}: cannot read the file: {error.strerror or error}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(f"{name}: not UTF-8 text (byte {error.start})") from None


def parse_toml(text: str, path: str) -> dict[str, Any]:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{path}: invalid TOML: {error}") from None


class Values:
    """The values read so far, by section, and how to name each key in a message.

    A subclass adapts a section before it is read (``adapt``: keys renamed or retired).
    """

    def __init__(self, path: str, keys: tuple[Key, ...]) -> None:
        self.path = path
        self.keys = keys
        self.by_section: dict[str, dict[str, Any]] = {key.section: {} for key in keys}
        self.labels: dict[tuple[str, str], str] = {}  # keys read under another name
        self.warnings: list[str] = []

    def fail(self, message: str) -> typing.NoReturn:
        raise ConfigError(f"{self.path}: {message}")

    def label(self, section: str, name: str) -> str:
        return self.labels.get((section, name), f"[{section}] {name}")

    def __getitem__(self, dotted: str) -> Any:
        section, _, name = dotted.partition(".")
        return self.by_section[section][name]

    def key(self, dotted: str) -> Key:
        return next(key for key in self.keys if f"{key.section}.{key.name}" == dotted)

    def adapt(self, section: str, table: dict[str, Any]) -> None:
        """Change ``table``, a section as the file has it, before its keys are read."""

    def old_names(self, section: str) -> Iterable[str]:
        """Names ``adapt`` still reads in ``section``, offered by "did you mean" too."""
        return ()

    def read(self, document: dict[str, Any]) -> None:
        for section, table in document.items():
            if section not in self.by_section:
                self.fail(_misplaced(self.keys, section, table))
            if not isinstance(table, dict):
                self.fail(f"{section} = {show(table)} is not a section; write [{section}]")
        for section in self.by_section:
            table = dict(document.get(section, {}))
            self.adapt(section, table)
            self.read_section(section, table)
        self.fill_defaults()

    def read_section(self, section: str, table: dict[str, Any]) -> None:
        known = {key.name: key for key in self.keys if key.section == section}
        for name, value in table.items():
            key = known.get(name)
            if key is None:
                self.fail(_unknown_key(self.keys, section, name, self.old_names(section)))
            self.by_section[section][name] = self.validated(key, value, self.label(section, name))
        for key in known.values():
            if key.default is REQUIRED and key.name not in table:
                self.fail(f"missing required key {key.label}")

    def validated(self, key: Key, value: Any, label: str) -> Any:
        problem = _type_problem(value, key.kind)
        for rule in key.rules:
            problem = problem or rule.check(value)
        if problem:
            self.fail(f"{label} = {show(value)} {problem}")
        return float(value) if key.kind is float else value

    def fill_defaults(self) -> None:
        for key in self.keys:
            values = self.by_section[key.section]
            if key.name not in values and key.default is not REQUIRED:
                values[key.name] = (
                    math.prod(self[name] for name in _qualified(key)) if key.same_as
                    else key.default
                )

    def cross_check(self, checks: Iterable[CrossCheck]) -> None:
        for rule in checks:
            problem = rule.check(self)
            if problem:
                self.fail(problem)


# --- messages --------------------------------------------------------------------------------


def show(value: Any) -> str:
    """A value as TOML would write it (URLs without their secrets)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + redact(value).replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, dict):
        return "{...}"
    return repr(value)


def _type_problem(value: Any, kind: type) -> str | None:
    if isinstance(value, bool) != (kind is bool):
        return f"is {_toml_type(value)}, expected {_KIND_NAMES[kind]}"
    if kind is float and isinstance(value, int | float):
        return None if math.isfinite(value) else "is not a finite number"
    if not isinstance(value, kind):
        return f"is {_toml_type(value)}, expected {_KIND_NAMES[kind]}"
    return None


_KIND_NAMES = {
    int: "an integer",
    float: "a number (seconds)",
    bool: "true or false",
    str: "a string",
}


def _toml_type(value: Any) -> str:
    kinds = (
        (bool, "a boolean"),
        (int, "an integer"),
        (float, "a float"),
        (str, "a string"),
        (list, "an array"),
        (dict, "a table"),
    )
    return next((name for kind, name in kinds if isinstance(value, kind)), "a date/time")


def _fold(name: str) -> str:
    """Compare names regardless of case, ``_`` and ``-`` (jobTtl ~ job_ttl)."""
    return re.sub(r"[^a-z0-9]", "", name.lower())


def _did_you_mean(name: str, candidates: Iterable[str], form: str = "{}") -> str:
    folded = {_fold(candidate): candidate for candidate in candidates}
    match = difflib.get_close_matches(_fold(name), folded, n=1, cutoff=0.6)
    return f"; did you mean {form.format(folded[match[0]])}?" if match else ""


def _unknown_key(keys: tuple[Key, ...], section: str, name: str, old: Iterable[str]) -> str:
    elsewhere = [key for key in keys if key.name == name]
    if elsewhere:
        return f"unknown key [{section}] {name}; it belongs in [{elsewhere[0].section}]"
    names = [key.name for key in keys if key.section == section]
    names += list(old)
    return f"unknown key [{section}] {name}{_did_you_mean(name, names)}"


def _misplaced(keys: tuple[Key, ...], name: str, value: Any) -> str:
    """The message for a top-level name that is not one of our sections."""
    if not isinstance(value, dict):
        owners = [key.label for key in keys if key.name == name]
        hint = f"; did you mean {owners[0]}?" if owners else ""
        return f"key {name} is outside any section{hint}"
    sections = dict.fromkeys(key.section for key in keys)
    return f"unknown section [{name}]{_did_you_mean(name, sections, form='[{}]')}"


# --- documentation ---------------------------------------------------------------------------


def key_table(keys: Iterable[Key]) -> list[str]:
    """Every key as the lines of a markdown table."""
    return [
        "| key | type | default | allowed | meaning |",
        "|---|---|---|---|---|",
        *(
            f"| `{key.label}` | {_KIND_LABELS[key.kind]} | {_default_text(key)} "
            f"| {_allowed_text(key)} | {key.doc} |"
            for key in keys
        ),
    ]


_KIND_LABELS = {int: "integer", float: "seconds", bool: "boolean", str: "string"}


def _allowed_text(key: Key) -> str:
    if key.kind is bool:
        return "true, false"
    return "; ".join(rule.text for rule in key.rules) or "any"


def _default_text(key: Key) -> str:
    if key.default is REQUIRED:
        return "required"
    if key.same_as:
        return f"= `{key.same_as.rpartition('.')[2]}`"
    return f"`{show(key.default)}`"
