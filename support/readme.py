"""The README as tests read it: its text, the shell block after a heading, that block's
commands (tests/test_readme.py runs them; tests/test_readme_rollback.py runs one
procedure word for word)."""

from __future__ import annotations

import re

from support.supervision import ROOT

README = (ROOT / "README.md").read_text()


def block_after(heading: str) -> str:
    start = README.index(heading)
    match = re.compile(r"```sh\n(.*?)```", re.S).search(README, start)
    assert match, heading
    return match.group(1)


def commands(block: str) -> list[str]:
    """The command lines of a shell block (comments and continuations folded)."""
    text = block.replace("\\\n", " ")
    return [line.split("  #")[0].strip() for line in text.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]
