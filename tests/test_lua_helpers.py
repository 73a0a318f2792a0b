"""The helpers several ``lua/`` scripts share have one copy, in ``lua/includes/``.

A Redis script cannot import another, so the small validation helpers (``whole``,
``wrong_type``, ``bad_counter``) live one per file in ``lua/includes/`` and a script names
each it needs with an include line (``--- @include "includes/whole"``, BullMQ's form), which
the loader (``broker.redis.scripts.lua_source``) replaces by the helper's text. These tests
check that what Redis runs stayed byte for byte what it was when the helpers were copies
(same text, so the same SHA1 for EVALSHA, the same argument checks), and that no script
pastes a shared helper again.
The scripts' bounds are copies too, of Python's ``MAX_BATCH`` and ``MAX_TTL``, and so is
the score from which a reservation's deadline is in milliseconds.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from broker.base import MAX_BATCH
from broker.redis.keys import MAX_TTL, MS_DEADLINES_FROM
from broker.redis.scripts import LUA_DIR as LOADED_FROM
from broker.redis.scripts import lua_source

LUA_DIR = Path(__file__).resolve().parent.parent / "lua"
INCLUDES = LUA_DIR / "includes"

#: SHA1 of each script's loaded text when its helpers were still pasted into it (main before
#: the includes): the text Redis runs, hence its EVALSHA digest, is unchanged. A deliberate
#: change to a script or a helper updates its digest here.
LOADED_SHA1 = {
    "claim": "1c249a9d9e94adbd9f7e13a8d2de9f41ccd8e748",
    "delete": "b1b4ca4a7e02f656550cc05f494ae18428ae2dfe",
    "expired": "3f3819ab614b53dae18c69be538be1373c56ea29",
    "extend": "c25dce5e8dce2eab4dc58d56be1ab82f56294e33",
    "oldest": "b1977c31c2631aa998c3c915453105b46c69b76d",
    "peek": "feaad97bd112050060b5d025def2dd04820cd356",
    "promote": "5078b19fc11b5fdb82762afaabf384c42f4d7ee1",
    "reclaim": "a00e31a4f1aa7960a6316ad432f9600d9e9b3f53",
    "records": "ae771da2842d61f04c86f305849381c2d2c268f3",
    "recover": "61cce5c06ee7c6cc6055fc3d8245aed671618269",
    "reserve": "5dffd796ac5e22b1c2fea52e4692be82071b40b7",
    "retry": "82cdd0905749f9cdb7e1f20124fb9a844a4cc02e",
    "settle": "4991776550cd72aec59279bace6adc7486092d44",
}

# A top-level definition (``local function f(``, ``function f(``, ``local f = function(``) up
# to the first ``end`` at the start of a line: the scripts indent every inner block.
_DEFINITION = re.compile(
    r"^(?:local\s+)?(?:function\s+(?P<name>\w+)|(?P<alias>\w+)\s*=\s*function)\s*\(.*?^end\b",
    re.MULTILINE | re.DOTALL,
)
_INCLUDE_LINE = re.compile(r'^--- @include "(?P<path>[^"]*)"', re.MULTILINE)


def helpers(text: str) -> dict[str, str]:
    """Name -> the definition's text, for every top-level function of a script."""
    return {match["name"] or match["alias"]: match.group() for match in _DEFINITION.finditer(text)}


def scripts() -> list[Path]:
    return sorted(LUA_DIR.glob("*.lua"))


def test_the_loader_reads_this_checkout():
    assert LOADED_FROM.resolve() == LUA_DIR.resolve()


def test_every_loaded_script_is_byte_identical_to_before_the_includes():
    loaded = {path.stem: hashlib.sha1(lua_source(path.stem).encode()).hexdigest()
              for path in scripts()}
    assert loaded == LOADED_SHA1


def test_each_include_holds_one_helper_named_as_its_file():
    found = sorted(INCLUDES.glob("*.lua"))
    assert {path.stem for path in found} >= {"whole", "wrong_type", "bad_counter"}
    for path in found:
        text = path.read_text(encoding="utf-8")
        assert list(helpers(text)) == [path.stem], path.name
        assert text.endswith("end\n"), path.name  # inlined as whole lines
        assert not _INCLUDE_LINE.search(text), path.name  # one level only


def test_every_include_line_names_a_helper_and_every_helper_is_used():
    used = set()
    for path in scripts():
        for match in _INCLUDE_LINE.finditer(path.read_text(encoding="utf-8")):
            assert (LUA_DIR / f"{match['path']}.lua").is_file(), f"{path.name}: {match.group()}"
            used.add(match["path"])
        assert not _INCLUDE_LINE.search(lua_source(path.stem)), path.name  # all inlined
    assert used == {f"includes/{path.stem}" for path in INCLUDES.glob("*.lua")}


def test_no_script_pastes_a_shared_helper():
    """A helper of lua/includes/ defined again inside a script would be a copy that drifts:
    the script includes it instead."""
    shared = {path.stem for path in INCLUDES.glob("*.lua")}
    pasted = [f"{path.name}: {name}" for path in scripts()
              for name in helpers(path.read_text(encoding="utf-8")) if name in shared]
    assert pasted == []


def test_the_helpers_are_where_the_scripts_need_them():
    """The finder still sees the helpers in the loaded text (else the test above would pass
    by finding nothing)."""
    assert set(helpers(lua_source("settle"))) >= {"whole", "wrong_type", "bad_counter"}
    for name in ("claim", "reserve", "settle", "recover"):
        assert "whole" in helpers(lua_source(name))
        assert "whole" not in helpers((LUA_DIR / f"{name}.lua").read_text(encoding="utf-8"))


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
        code = _code(lua_source(path.stem))
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
        code = _code(lua_source(name.removesuffix(".lua")))
        found[name] = {float(number) for number in re.findall(r"\b(\d+e\d+|\d{11,})\b", code)}
    assert found == {"expired.lua": {MS_DEADLINES_FROM}, "recover.lua": {MS_DEADLINES_FROM}}
