"""The helpers copied across ``lua/`` scripts stay identical.

A Redis script cannot import another, and each file stays self-contained so that any client
(the PHP workers, redis-cli) can load it as it is; so the small validation helpers
(``whole``, ``wrong_type``, ``bad_counter``) are copies on purpose. This test finds every
function defined in more than one script and fails until all its copies are the same text
again: a fix made to one copy reaches the others, or the test says which scripts lag.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path

LUA_DIR = Path(__file__).resolve().parent.parent / "lua"

# A top-level definition (``local function f(``, ``function f(``, ``local f = function(``) up
# to the first ``end`` at the start of a line: the scripts indent every inner block.
_DEFINITION = re.compile(
    r"^(?:local\s+)?(?:function\s+(?P<name>\w+)|(?P<alias>\w+)\s*=\s*function)\s*\(.*?^end\b",
    re.MULTILINE | re.DOTALL,
)


def helpers(text: str) -> dict[str, str]:
    """Name -> the definition's text, for every top-level function of a script."""
    return {match["name"] or match["alias"]: match.group() for match in _DEFINITION.finditer(text)}


def copies() -> dict[str, dict[str, str]]:
    """Helper name -> {script: definition}, for every helper defined in two scripts or more."""
    found: dict[str, dict[str, str]] = {}
    for path in sorted(LUA_DIR.glob("*.lua")):
        for name, text in helpers(path.read_text(encoding="utf-8")).items():
            found.setdefault(name, {})[path.name] = text
    return {name: by_script for name, by_script in found.items() if len(by_script) > 1}


def test_the_shared_helpers_are_found():
    """The finder sees the copies the scripts are known to share (else the test below
    would pass by finding nothing)."""
    shared = copies()
    assert {"whole", "wrong_type", "bad_counter"} <= set(shared)
    assert set(shared["whole"]) >= {"claim.lua", "reserve.lua", "settle.lua", "recover.lua"}


def test_copies_of_a_helper_are_byte_identical():
    drifted = []
    for name, by_script in sorted(copies().items()):
        (first, reference), *others = sorted(by_script.items())
        for script, text in others:
            if text != reference:
                diff = "\n".join(difflib.unified_diff(
                    reference.splitlines(), text.splitlines(), first, script, lineterm=""))
                drifted.append(f"{name}() differs between {first} and {script}:\n{diff}")
    assert not drifted, "\n\n".join(drifted)


def test_a_drifted_copy_is_reported():
    """The comparison itself: one changed character in one copy is a difference."""
    script = (LUA_DIR / "settle.lua").read_text(encoding="utf-8")
    original = helpers(script)["whole"]
    changed = helpers(script.replace("#value <= 10", "#value <= 11"))["whole"]
    assert changed != original and changed.startswith("local function whole(")
