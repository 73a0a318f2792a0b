"""Every script in ``lua/`` touches only keys it received in KEYS.

Redis Cluster (and Dragonfly) route a script by its declared keys and refuse, or silently
break on, a key the script builds itself. This test reads each script, finds every
``redis.call``/``redis.pcall``, and checks that each argument in a key position is derived
from ``KEYS``:

- ``KEYS[...]`` itself, ``unpack(KEYS, ...)``;
- a local variable or function parameter whose every assignment (or, for a parameter,
  every call site's argument) is derived from KEYS;
- an element of a table whose every insertion (``t[i] = x``, ``table.insert``, a table
  constructor) is derived from KEYS, and ``unpack`` of such a table;
- the value variable of ``for _, v in ipairs(t)`` over such a table.

Limits (it is a static check of a small, plain subset of Lua, not an interpreter):

- Flow- and scope-insensitive: one name means one variable across the file, and *every*
  assignment to it must be derived from KEYS. That errs on the safe side: a name reused
  for a non-key value is reported and should be renamed.
- Key positions come from the command table below; a command not listed fails the test
  (add it, with its key positions, rather than guess). The command name must be a string
  literal; ``redis.call`` used indirectly (aliased, passed around) fails.
- For ``MSET`` with an ``unpack``-ed table, the table's insertions are taken in source order
  and the 1st, 3rd, ... must be keys: it assumes the key/value pairs are inserted in one
  place, key first (as ``claim.lua`` does).
- Values returned by functions (other than the parameter rule above), tables passed to or
  returned from functions, and ``KEYS`` being reassigned are not followed: such code is
  reported as not derived from KEYS.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from broker.redis.scripts import lua_source

LUA_DIR = Path(__file__).resolve().parent.parent / "lua"

# Key positions (1-based among the arguments after the command name).
KEYLESS = {"TIME", "PING", "ECHO"}
ALL_KEYS = {"DEL", "UNLINK", "EXISTS", "MGET", "TOUCH"}
PAIRS = {"MSET", "MSETNX"}  # key value key value ...
FIRST_TWO = {"RPOPLPUSH", "LMOVE", "BLMOVE", "SMOVE", "RENAME", "RENAMENX", "COPY"}
_FIRST = """
GET SET SETEX PSETEX SETNX GETDEL GETEX GETSET INCR INCRBY DECR DECRBY INCRBYFLOAT APPEND
STRLEN EXPIRE PEXPIRE EXPIREAT PEXPIREAT TTL PTTL PERSIST TYPE
LPUSH RPUSH LPUSHX RPUSHX LPOP RPOP LLEN LRANGE LREM LINDEX LSET LTRIM LPOS LINSERT
ZADD ZREM ZSCORE ZMSCORE ZCARD ZRANGE ZRANGEBYSCORE ZREVRANGEBYSCORE ZREMRANGEBYSCORE
ZCOUNT ZRANK ZINCRBY ZPOPMIN ZPOPMAX
HGET HSET HDEL HGETALL HMGET HINCRBY HLEN HEXISTS SADD SREM SISMEMBER SMEMBERS SCARD
XADD XLEN XTRIM
"""
FIRST = set(_FIRST.split())

BINARY = {"+", "-", "*", "/", "%", "^", "..", "==", "~=", "<", "<=", ">", ">=", "and", "or",
          "//", "&", "|", "~", "<<", ">>"}
UNARY = {"not", "-", "#", "~"}
BLOCK_END = {"end", "else", "elseif", "until", "<eof>"}

TOKEN = re.compile(r"""
    (?P<space>\s+)
  | (?P<comment>--\[(?P<ceq>=*)\[.*?\](?P=ceq)\]|--[^\n]*)
  | (?P<long>\[(?P<leq>=*)\[.*?\](?P=leq)\])
  | (?P<string>"(?:\\.|[^"\\\n])*"|'(?:\\.|[^'\\\n])*')
  | (?P<number>0[xX][0-9a-fA-F]+|\d+\.?\d*(?:[eE][+-]?\d+)?|\.\d+)
  | (?P<name>[A-Za-z_]\w*)
  | (?P<op>\.\.\.|\.\.|==|~=|<=|>=|<<|>>|//|::|[-+*/%^#&~|<>=(){}\[\];:,.])
""", re.VERBOSE | re.DOTALL)


@dataclass(frozen=True)
class Tok:
    kind: str  # name, string, number, op, eof
    text: str
    line: int


def tokenize(source: str) -> list[Tok]:
    tokens: list[Tok] = []
    position, line = 0, 1
    while position < len(source):
        match = TOKEN.match(source, position)
        if not match:
            raise SyntaxError(f"line {line}: cannot tokenize {source[position:position + 20]!r}")
        kind = match.lastgroup
        text = match.group()
        if kind in ("long", "string"):
            tokens.append(Tok("string", text, line))
        elif kind in ("number", "name", "op"):
            tokens.append(Tok(kind, text, line))
        line += text.count("\n")
        position = match.end()
    tokens.append(Tok("eof", "<eof>", line))
    return tokens


Span = tuple[int, int]  # token indexes [start, end)


@dataclass
class Call:
    callee: Span
    args: list[Span]
    line: int


@dataclass
class Facts:
    """What the parser saw, name by name (scope-insensitive)."""

    values: dict[str, list[Span | None]] = field(default_factory=dict)  # None: not a key
    elements: dict[str, list[str]] = field(default_factory=dict)  # v <- element of table t
    tables: set[str] = field(default_factory=set)  # names given a table constructor
    inserts: dict[str, list[Span]] = field(default_factory=dict)
    params: dict[str, list[str]] = field(default_factory=dict)  # function -> parameter names
    calls: list[Call] = field(default_factory=list)
    indirect: list[int] = field(default_factory=list)  # lines using redis.call indirectly


class Parser:
    """A recursive-descent walk over Lua statements that records assignments and calls."""

    def __init__(self, tokens: list[Tok]) -> None:
        self.t = tokens
        self.i = 0
        self.facts = Facts()

    # -- helpers
    def peek(self, offset: int = 0) -> Tok:
        return self.t[min(self.i + offset, len(self.t) - 1)]

    def at(self, *texts: str) -> bool:
        tok = self.peek()
        return tok.kind in ("name", "op", "eof") and tok.text in texts

    def expect(self, text: str) -> None:
        if not self.at(text):
            tok = self.peek()
            raise SyntaxError(f"line {tok.line}: expected {text!r}, found {tok.text!r}")
        self.i += 1

    def name(self) -> str:
        tok = self.peek()
        if tok.kind != "name":
            raise SyntaxError(f"line {tok.line}: expected a name, found {tok.text!r}")
        self.i += 1
        return tok.text

    # -- statements
    def block(self) -> None:
        while not self.at(*BLOCK_END):
            self.statement()

    def statement(self) -> None:
        tok = self.peek()
        word = tok.text if tok.kind == "name" else None
        if self.at(";"):
            self.i += 1
        elif word == "local":
            self.i += 1
            if self.at("function"):
                self.i += 1
                self.funcbody(self.name())
            else:
                names = [self.name()]
                while self.at(","):
                    self.i += 1
                    names.append(self.name())
                spans: list[Span] = []
                if self.at("="):
                    self.i += 1
                    spans = self.explist()
                self.assign([(name, None) for name in names], spans)
        elif word == "function":
            self.i += 1
            name = self.name()
            while self.at(".", ":"):
                self.i += 1
                name = self.name()
            self.funcbody(name)
        elif word == "if":
            self.i += 1
            self.exp()
            self.expect("then")
            self.block()
            while self.at("elseif"):
                self.i += 1
                self.exp()
                self.expect("then")
                self.block()
            if self.at("else"):
                self.i += 1
                self.block()
            self.expect("end")
        elif word == "while":
            self.i += 1
            self.exp()
            self.expect("do")
            self.block()
            self.expect("end")
        elif word == "do":
            self.i += 1
            self.block()
            self.expect("end")
        elif word == "for":
            self.for_statement()
        elif word == "repeat":
            self.i += 1
            self.block()
            self.expect("until")
            self.exp()
        elif word == "return":
            self.i += 1
            if not self.at(*BLOCK_END, ";"):
                self.explist()
            if self.at(";"):
                self.i += 1
        elif word == "break":
            self.i += 1
        elif word == "goto":
            self.i += 1
            self.name()
        elif self.at("::"):
            self.i += 1
            self.name()
            self.expect("::")
        else:
            self.expression_statement()

    def for_statement(self) -> None:
        self.i += 1
        names = [self.name()]
        if self.at("="):
            self.i += 1
            self.explist()
            self.facts.values.setdefault(names[0], []).append(None)
        else:
            while self.at(","):
                self.i += 1
                names.append(self.name())
            self.expect("in")
            spans = self.explist()
            table = self.iterated_table(spans)
            for position, name in enumerate(names):
                if position == 1 and table:
                    self.facts.elements.setdefault(name, []).append(table)
                else:
                    self.facts.values.setdefault(name, []).append(None)
        self.expect("do")
        self.block()
        self.expect("end")

    def iterated_table(self, spans: list[Span]) -> str | None:
        """``t`` for ``ipairs(t)`` / ``pairs(t)``, else None."""
        if len(spans) != 1:
            return None
        toks = self.texts(spans[0])
        if len(toks) == 4 and toks[0] in ("ipairs", "pairs") and toks[1] == "(" \
                and toks[3] == ")":
            return toks[2]
        return None

    def expression_statement(self) -> None:
        targets = [self.suffixed()]
        while self.at(","):
            self.i += 1
            targets.append(self.suffixed())
        if self.at("="):
            self.i += 1
            spans = self.explist()
            self.assign([self.target(span) for span in targets], spans)

    def target(self, span: Span) -> tuple[str, Span | None]:
        """(name, None) for ``name = ...``; (table, span) for ``table[...] = ...``."""
        toks = self.texts(span)
        if len(toks) == 1:
            return toks[0], None
        if len(toks) >= 3 and toks[1] == "[" and self.closes(span[0] + 1, span[1] - 1):
            return toks[0], span
        return f"<field {' '.join(toks)}>", None

    def assign(self, targets: list[tuple[str, Span | None]], spans: list[Span]) -> None:
        for position, (name, indexed) in enumerate(targets):
            span = spans[position] if position < len(spans) else None
            if position == len(spans) - 1 and len(targets) > len(spans):
                span = None  # a multi-value call spread over several names: not followed
            if indexed is not None:
                self.facts.inserts.setdefault(name, []).append(span or (0, 0))
            elif span is not None and self.texts(span)[:1] == ["{"]:
                self.facts.tables.add(name)
                self.facts.inserts.setdefault(name, []).extend(self.constructor_items(span))
            else:
                self.facts.values.setdefault(name, []).append(span)

    def funcbody(self, name: str) -> None:
        self.expect("(")
        params: list[str] = []
        while not self.at(")"):
            if self.at("..."):
                self.i += 1
                params.append("...")
            else:
                params.append(self.name())
            if self.at(","):
                self.i += 1
        self.i += 1
        self.facts.params.setdefault(name, []).extend(params)
        self.block()
        self.expect("end")

    # -- expressions
    def explist(self) -> list[Span]:
        spans = [self.exp()]
        while self.at(","):
            self.i += 1
            spans.append(self.exp())
        return spans

    def exp(self) -> Span:
        start = self.i
        self.operand()
        while self.peek().kind in ("op", "name") and self.peek().text in BINARY:
            self.i += 1
            self.operand()
        return start, self.i

    def operand(self) -> None:
        while self.peek().kind in ("op", "name") and self.peek().text in UNARY:
            self.i += 1
        tok = self.peek()
        if tok.kind in ("number", "string") or self.at("nil", "true", "false", "..."):
            self.i += 1
        elif self.at("function"):
            self.i += 1
            self.funcbody(f"<anonymous line {tok.line}>")
        elif self.at("{"):
            self.constructor()
        else:
            self.suffixed()

    def constructor(self) -> None:
        self.expect("{")
        while not self.at("}"):
            if self.at("["):
                self.i += 1
                self.exp()
                self.expect("]")
                self.expect("=")
            elif self.peek().kind == "name" and self.peek(1).text == "=" \
                    and self.peek(1).kind == "op":
                self.i += 2
            self.exp()
            if self.at(",", ";"):
                self.i += 1
        self.i += 1

    def constructor_items(self, span: Span) -> list[Span]:
        """The positional items of a constructor ``{a, b}``; a keyed field counts as not a key."""
        saved, self.i = self.i, span[0] + 1
        items: list[Span] = []
        while self.i < span[1] - 1:
            if self.at("[") or (self.peek(1).text == "=" and self.peek(1).kind == "op"):
                items.append((0, 0))
                self.i = span[1] - 1
                break
            items.append(self.exp())
            if self.at(",", ";"):
                self.i += 1
        self.i = saved
        return items

    def suffixed(self) -> Span:
        start = self.i
        if self.at("("):
            self.i += 1
            self.exp()
            self.expect(")")
        else:
            name = self.name()
            if name == "redis" and self.at(".") and self.peek(1).text in ("call", "pcall") \
                    and self.peek(2).text != "(":
                self.facts.indirect.append(self.peek().line)
        while True:
            if self.at("."):
                self.i += 1
                self.name()
            elif self.at("["):
                self.i += 1
                self.exp()
                self.expect("]")
            elif self.at(":"):
                self.i += 1
                self.name()
                self.call_args(start)
            elif self.at("(", "{") or self.peek().kind == "string":
                self.call_args(start)
            else:
                return start, self.i

    def call_args(self, callee_start: int) -> None:
        callee = (callee_start, self.i)
        line = self.peek().line
        args: list[Span] = []
        if self.at("("):
            self.i += 1
            if not self.at(")"):
                args = self.explist()
            self.expect(")")
        elif self.at("{"):
            start = self.i
            self.constructor()
            args = [(start, self.i)]
        else:
            args = [(self.i, self.i + 1)]
            self.i += 1
        self.facts.calls.append(Call(callee, args, line))

    # -- token utilities
    def texts(self, span: Span) -> list[str]:
        return [tok.text for tok in self.t[span[0]:span[1]]]

    def closes(self, open_index: int, close_index: int) -> bool:
        """True if the bracket at ``open_index`` is closed exactly at ``close_index``."""
        depth = 0
        for index in range(open_index, close_index + 1):
            text = self.t[index].text if self.t[index].kind == "op" else ""
            depth += text in ("(", "[", "{")
            depth -= text in (")", "]", "}")
            if depth == 0:
                return index == close_index
        return False


class KeyAnalysis:
    """Decides which expressions are derived from KEYS, from the parser's facts."""

    def __init__(self, parser: Parser) -> None:
        self.p = parser
        self.f = parser.facts
        for call in self.f.calls:  # call sites assign the parameters of local functions
            callee = parser.texts(call.callee)
            if len(callee) == 1 and callee[0] in self.f.params:
                for position, param in enumerate(self.f.params[callee[0]]):
                    span = call.args[position] if position < len(call.args) else None
                    self.f.values.setdefault(param, []).append(span)
        self.keys: set[str] = set()
        self.tables: set[str] = {"KEYS"}
        self._solve()

    def _solve(self) -> None:
        changed = True
        while changed:
            changed = False
            for name in set(self.f.values) | set(self.f.elements) | self.f.tables:
                if name not in self.keys and self._is_key_name(name):
                    self.keys.add(name)
                    changed = True
                if name not in self.tables and self._is_key_table(name):
                    self.tables.add(name)
                    changed = True

    def _is_key_name(self, name: str) -> bool:
        values = self.f.values.get(name, [])
        elements = self.f.elements.get(name, [])
        # ``x = x`` (a parameter passed on to a function with the same parameter name)
        # adds nothing: without skipping it, the least fixpoint would never include x.
        values = [span for span in values if span is None or self.p.texts(span) != [name]]
        if name in self.f.tables or not (values or elements):
            return False
        return all(span is not None and self.is_key(span) for span in values) \
            and all(table in self.tables for table in elements)

    def _is_key_table(self, name: str) -> bool:
        if name not in self.f.tables or self.f.values.get(name) or self.f.elements.get(name):
            return False
        return all(self.is_key(span) for span in self.f.inserts.get(name, []))

    def is_key(self, span: Span) -> bool:
        toks = self.p.texts(span)
        if len(toks) == 1:
            return toks[0] in self.keys
        if len(toks) >= 4 and toks[1] == "[" and self.p.closes(span[0] + 1, span[1] - 1):
            return toks[0] in self.tables
        if toks[:1] == ["("] and self.p.closes(span[0], span[1] - 1):
            return self.is_key((span[0] + 1, span[1] - 1))
        return False

    def unpacked(self, span: Span) -> str | None:
        """``t`` for ``unpack(t, ...)`` / ``table.unpack(t, ...)``, else None."""
        toks = self.p.texts(span)
        if toks[:2] == ["table", "."]:
            toks = toks[2:]
        if len(toks) >= 4 and toks[0] == "unpack" and toks[1] == "(" and toks[-1] == ")":
            return toks[2]
        return None

    def is_keys_spread(self, span: Span) -> bool:
        table = self.unpacked(span)
        return table is not None and table in self.tables

    def pairs_ok(self, span: Span) -> bool:
        """An unpacked MSET table whose 1st, 3rd, ... insertions are keys."""
        table = self.unpacked(span)
        if table is None:
            return False
        if table in self.tables:
            return True
        inserts = self.f.inserts.get(table, [])
        return bool(inserts) and len(inserts) % 2 == 0 \
            and all(self.is_key(insert) for insert in inserts[::2])


def key_violations(source: str) -> list[str]:
    """One message per redis.call/pcall key argument not derived from KEYS."""
    parser = Parser(tokenize(source))
    parser.block()
    if not parser.at("<eof>"):
        raise SyntaxError(f"line {parser.peek().line}: unexpected {parser.peek().text!r}")
    analysis = KeyAnalysis(parser)
    problems = [f"line {line}: redis.call used indirectly" for line in parser.facts.indirect]
    for call in parser.facts.calls:
        if parser.texts(call.callee) not in (["redis", ".", "call"], ["redis", ".", "pcall"]):
            continue
        problems += _check_call(parser, analysis, call)
    return problems


def _check_call(parser: Parser, analysis: KeyAnalysis, call: Call) -> list[str]:
    shown = lambda span: " ".join(parser.texts(span))  # noqa: E731
    if not call.args or parser.t[call.args[0][0]].kind != "string" \
            or call.args[0][1] - call.args[0][0] != 1:
        return [f"line {call.line}: command name is not a string literal"]
    command = parser.t[call.args[0][0]].text.strip("'\"").upper()
    args = call.args[1:]
    if command in KEYLESS:
        return []
    if command in ALL_KEYS:
        positions = list(range(len(args)))
    elif command in FIRST:
        positions = [0]
    elif command in FIRST_TWO:
        positions = [0, 1]
    elif command in PAIRS:
        if len(args) == 1:
            if analysis.pairs_ok(args[0]):
                return []
            return [f"line {call.line}: {command} {shown(args[0])}: keys not from KEYS"]
        positions = list(range(0, len(args), 2))
    else:
        return [f"line {call.line}: command {command} is not in the key table of this test"]
    problems = []
    for position in positions:
        if position >= len(args):
            break
        span = args[position]
        if analysis.is_key(span) or analysis.is_keys_spread(span):
            if analysis.unpacked(span):
                break  # a spread covers every position after it
            continue
        problems.append(
            f"line {call.line}: {command} key argument {shown(span)!r} is not derived from KEYS"
        )
    return problems


# -- the scripts ------------------------------------------------------------------------


SCRIPTS = sorted(LUA_DIR.glob("*.lua"))


def test_there_are_scripts():
    assert len(SCRIPTS) >= 8


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda path: path.name)
def test_script_touches_only_declared_keys(path: Path):
    assert key_violations(lua_source(path.stem)) == []  # its helpers included


# -- the checker itself -------------------------------------------------------------------


GOOD = """
local function wrong_type(key, expected)
  local actual = redis.call('TYPE', key)['ok']
  if actual ~= expected then return redis.error_reply('bad') end
end
local ready, registry = KEYS[1], KEYS[2]
local err = wrong_type(ready, 'list') or wrong_type(KEYS[3], 'zset')
local owners, records = {}, {}
for i = 1, 3 do owners[i] = KEYS[3 + i] end
for i = 1, 3 do
  records[#records + 1] = KEYS[6 + i]
  records[#records + 1] = ARGV[i]
end
redis.call('MGET', unpack(owners))
redis.call('MSET', unpack(records))
for _, key in ipairs(owners) do redis.call('DEL', key) end
redis.call('LPUSH', ready, unpack(ARGV))
redis.call('MGET', unpack(KEYS, 2))
local now = redis.call('TIME')
return redis.call('ZADD', registry, now[1], ARGV[1])
"""

BAD = {
    "built": "redis.call('GET', KEYS[1] .. ':x')",
    "argv": "local k = ARGV[1]\nredis.call('DEL', k)",
    "reassigned": "local k = KEYS[1]\nk = 'other'\nredis.call('GET', k)",
    "table": "local t = {}\nt[1] = KEYS[1]\nt[2] = ARGV[1]\nredis.call('DEL', unpack(t))",
    "pairs": "local t = {}\nt[1] = ARGV[1]\nt[2] = KEYS[1]\nredis.call('MSET', unpack(t))",
    "param": "local function f(k) return redis.call('GET', k) end\nf(KEYS[1])\nf('x')",
    "second": "redis.call('LMOVE', KEYS[1], 'elsewhere', 'RIGHT', 'LEFT')",
    "unknown": "redis.call('SUNIONSTORE', KEYS[1], KEYS[2])",
    "dynamic": "local cmd = 'GET'\nredis.call(cmd, KEYS[1])",
    "indirect": "local call = redis.call\ncall('GET', 'x')",
}


def test_checker_accepts_keys_from_keys():
    assert key_violations(GOOD) == []


@pytest.mark.parametrize("name", sorted(BAD))
def test_checker_reports_keys_not_from_keys(name: str):
    assert key_violations(BAD[name]), name
