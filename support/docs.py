"""The documentation as tests read it: the text of a page of the site (``docs/<name>``) or
of the README, the shell block after a heading, that block's commands
(tests/test_readme.py runs the README's and the operator commands' page's;
tests/test_readme_rollback.py runs one procedure word for word)."""

from __future__ import annotations

import re
from pathlib import Path

from support.supervision import ROOT

DOCS = ROOT / "docs"
README = "README.md"


def path(name: str) -> Path:
    """``README.md`` is the README; any other name a page of the site, e.g. ``tls.md``."""
    return ROOT / README if name == README else DOCS / name


def text(name: str) -> str:
    return path(name).read_text()


def pages() -> list[str]:
    """Every page of the site, by its name under docs/ (``handlers.md``)."""
    return sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))


def block_after(name: str, heading: str) -> str:
    """The ``sh`` block that follows ``heading`` (a whole line, ``## Quick start``) in the
    page ``name``."""
    page = text(name)
    start = re.search(rf"^{re.escape(heading)}$", page, re.M)
    assert start, f"{name} has no heading {heading!r}"
    match = re.compile(r"```sh\n(.*?)```", re.S).search(page, start.end())
    assert match, heading
    return match.group(1)


def commands(block: str) -> list[str]:
    """The command lines of a shell block (comments and continuations folded)."""
    joined = block.replace("\\\n", " ")
    return [line.split("  #")[0].strip() for line in joined.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]
