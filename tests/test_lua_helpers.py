"""The helpers copied across ``lua/`` scripts stay identical.

A Redis script cannot import another, and each file stays self-contained so that any client
(the PHP workers, redis-cli) can load it as it is; so the small validation helpers
(``whole``, ``wrong_type``, ``bad_counter``) are copies on purpose. This test finds every
function defined in more than one script and fails until all its copies are the same text
again: a fix made to one copy reaches the others, or the test says which scripts lag.
The scripts' bounds are copies too, of Python's ``MAX_BATCH`` and ``MAX_TTL``, and so is
the score from which a reservation's deadline is in milliseconds.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path

from broker.base import MAX_BATCH
from broker.redis.keys import MAX_TTL, MS_DEADLINES_FROM

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


# Bounds a script puts on its arguments: whole(x, low, HIGH), "n > HIGH" and "#KEYS - 2 >
# HIGH" in the checks before the first write, and named ones ("local MAX_ITEMS = HIGH").
_WHOLE_BOUND = re.compile(r"\bwhole\((?P<arg>[^,]+),\s*\d+,\s*(?P<high>\w+)\)")
_COUNT_BOUND = re.compile(
    r"^if .*?(?:\bn|#KEYS - 2) > (?P<high>\d+)|^local MAX_ITEMS = (?P<items>\d+)", re.MULTILINE)
_TTL_NAME = re.compile(r"\blocal MAX_TTL = (?P<high>\d+)")
#: recover.lua's grace is in seconds but compared with millisecond deadlines: bounded by the
#: ten digits whole() reads, not by MAX_TTL (checked in tests/test_lua_args.py).
OTHER_BOUNDS = {("recover.lua", "ARGV[2] or '0'"): 9999999999}


def _code(text: str) -> str:
    return "\n".join(line.split("--", 1)[0] for line in text.splitlines())


def test_the_scripts_bounds_are_pythons_max_batch_and_max_ttl():
    """Every count a script takes is bounded by MAX_BATCH and every lease, TTL or offset by
    MAX_TTL: Python sends groups of MAX_BATCH and validates TTLs against MAX_TTL, so a
    script with another bound refuses (or lets through) what Python thinks it may send."""
    wrong, counts = [], 0
    for path in sorted(LUA_DIR.glob("*.lua")):
        code = _code(path.read_text(encoding="utf-8"))
        for match in _WHOLE_BOUND.finditer(code):
            high = match["high"]
            value = MAX_TTL if high == "MAX_TTL" else int(high)
            allowed = {MAX_BATCH, MAX_TTL, OTHER_BOUNDS.get((path.name, match["arg"].strip()))}
            if value not in allowed:
                wrong.append(f"{path.name}: {match.group()}")
        for match in _COUNT_BOUND.finditer(code):
            counts += 1
            if int(match["high"] or match["items"]) != MAX_BATCH:
                wrong.append(f"{path.name}: {match.group()} (MAX_BATCH is {MAX_BATCH})")
        for match in _TTL_NAME.finditer(code):
            if int(match["high"]) != MAX_TTL:
                wrong.append(f"{path.name}: {match.group()} (MAX_TTL is {MAX_TTL})")
    assert wrong == []
    assert counts >= 4  # extend, reclaim, recover, retry: the finder still finds them


def test_the_scripts_read_millisecond_deadlines_from_where_python_does():
    """expired.lua, recover.lua and ``check``/``inspect`` (Python) must agree on which
    registry scores are milliseconds, or one would call a reservation expired that the
    other holds live."""
    found = {}
    for name in ("expired.lua", "recover.lua"):
        code = _code((LUA_DIR / name).read_text(encoding="utf-8"))
        found[name] = {float(number) for number in re.findall(r"\b(\d+e\d+|\d{11,})\b", code)}
    assert found == {"expired.lua": {MS_DEADLINES_FROM}, "recover.lua": {MS_DEADLINES_FROM}}
