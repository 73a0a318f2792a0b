"""A Python model of the PHP "queue 5" Redis consumer, for mixed-fleet tests.

It drives Redis the way appwrite/appwrite ``packages/queue/src/Broker/Redis.php`` does
(b138cde, plus the coalescing of cbc09797 and the reap bounds of 78c2d3cd): same keys,
same script semantics, same envelope bytes. The Lua below is written for this model from
the documented behaviour (the queue-5 wire notes); it is not PHP's text.

PHP semantics that shape the bytes are kept: ``json_decode($raw, true)`` (objects and
lists are both arrays, big integers become floats), the coercive typed properties of
``Message`` (so ``"pid": 7`` is the pid ``"7"``), ``(int)`` casts, and ``json_encode``
with default flags (``\\/``, ``\\uXXXX``, ``[]`` for an empty array). A PHP worker that
dies is modelled by dropping this object at any point; ``receive_reserve_only`` stops
between the reservation and the claim. ``adapter`` picks the worker's renewal: Swoole renews
its claims, Workerman and KubernetesJob never do (``extend`` is a no-op), so their claims
lapse while a long handler runs; ``reap_after`` defaults to queue 5's 90,000 s. ``clock`` is
PHP's ``time()`` (a test moves it forward to stand for a handler's run time: what a sweep
then sees as its publish age).
"""

from __future__ import annotations

import json
import math
import random
import re
import secrets
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import redis

LIMIT = 1000  # REAP_LIMIT: batch bound, reap limit, Lua chunk size
#: ``Broker\Redis``'s constructor default ``$reapAfter``: "Minimum publish age for recovery
#: without a live heartbeat. Keep conservative until all workers and adapters heartbeat."
REAP_AFTER = 90_000
#: Adapters that inherit ``Adapter::withAckExtension()``, which only runs the handler: they
#: never call ``extend()``, so their claim keys lapse while a long handler still runs.
NON_RENEWING = ("workerman", "kubernetes-job")
POP_TIMEOUT = 2  # retry()'s BRPOP timeout, seconds


class NotOwned(RuntimeError):
    """PHP: RuntimeException('Queue delivery is no longer owned by this consumer')."""


class SettlementFailed(RuntimeError):
    """PHP: RedisException('Queue settlement failed') -- the script's item was an error."""


class PhpError(TypeError):
    """A PHP TypeError/Error that PHP would not catch (e.g. reap over a bad stored job)."""


# --------------------------------------------------------------------------- Lua scripts
_TYPES = """
local function check(want, keys, what)
  for i = 1, #want do
    local t = redis.call('TYPE', keys[i]).ok
    if t ~= 'none' and t ~= want[i] then return redis.error_reply('WRONGTYPE queue ' .. what) end
  end
end
local function counters(keys, what)
  for _, k in ipairs(keys) do
    local v = redis.call('GET', k)
    if v and not string.match(v, '^%-?%d+$') then return redis.error_reply(what) end
  end
end
"""

# KEYS ready, registry, reservation, processing, total, in-flight; ARGV n, lease, wait, cont.
RESERVE = _TYPES + """
local bad = check({'list', 'zset', 'list', 'list', 'string', 'string'}, KEYS, 'reservation')
if bad then return bad end
local now = tonumber(redis.call('TIME')[1])
if ARGV[4] == '1' then
  local due = redis.call('ZSCORE', KEYS[2], KEYS[3])
  if not due or tonumber(due) <= now then return redis.error_reply('Queue reservation expired') end
end
local taken = {}
while #taken < tonumber(ARGV[1]) do
  local raw = redis.call('RPOPLPUSH', KEYS[1], KEYS[3])
  if not raw then break end
  taken[#taken + 1] = raw
end
if #taken > 0 or tonumber(ARGV[3]) > 0 then
  redis.call('ZADD', KEYS[2], now + tonumber(ARGV[2]) + tonumber(ARGV[3]), KEYS[3])
end
return taken
"""

# KEYS registry, reservation, processing, total, in-flight, poison, (job, claims, owner)*;
# ARGV lease, token, good count, (raw, pid)*, poison raw*.
CLAIM = _TYPES + """
local now = tonumber(redis.call('TIME')[1])
local due = redis.call('ZSCORE', KEYS[1], KEYS[2])
if not due or tonumber(due) <= now then return redis.error_reply('Queue reservation expired') end
local want = {'zset', 'list', 'list', 'string', 'string', 'list'}
for i = 7, #KEYS do want[i] = 'string' end
local bad = check(want, KEYS, 'claim') or counters({KEYS[4], KEYS[5]}, 'Invalid queue counter')
if bad then return bad end
local good = tonumber(ARGV[3])
for n = 1, good do
  local job, claims, owner = KEYS[3 * n + 4], KEYS[3 * n + 5], KEYS[3 * n + 6]
  redis.call('SET', job, ARGV[2 * n + 2])
  redis.call('SET', owner, ARGV[2])
  redis.call('SET', claims, ARGV[2], 'EX', ARGV[1])
  redis.call('LPUSH', KEYS[3], ARGV[2 * n + 3])
end
for i = 2 * good + 4, #ARGV do redis.call('LPUSH', KEYS[6], ARGV[i]) end
redis.call('INCRBY', KEYS[4], good)
redis.call('INCRBY', KEYS[5], good)
redis.call('DEL', KEYS[2])
redis.call('ZREM', KEYS[1], KEYS[2])
return good
"""

# Per item, KEYS claims, job, processing, in-flight, outcome counter, target list, owner,
# marker (the owner key when unkeyed); ARGV token, pid, op, job ttl, keyed ('1' or '').
SETTLE = _TYPES + """
local function settle(k, a)
  local op = a[3]
  if op ~= 'commit' and op ~= 'reject' and op ~= 'release' then
    return redis.error_reply('Invalid queue operation')
  end
  local bad = check({'string', 'string', 'list', 'string', 'string', 'list', 'string', 'string'},
    k, 'settlement') or counters({k[4], k[5]}, 'Invalid queue counter')
  if bad then return bad end
  if redis.call('GET', k[7]) ~= a[1] then return 0 end
  local raw = redis.call('GET', k[2])
  if op ~= 'commit' and not raw then
    return redis.error_reply('Queue delivery payload is missing')
  end
  if redis.call('LREM', k[3], 1, a[2]) == 0 then return 0 end
  if a[5] == '1' and op ~= 'release' and redis.call('GET', k[8]) == a[2] then
    redis.call('DEL', k[8])
  end
  redis.call('DEL', k[1], k[7])
  if op == 'release' then
    redis.call('RPUSH', k[6], raw)
    redis.call('DEL', k[2])
  elseif op == 'commit' then
    redis.call('DEL', k[2])
  else
    redis.call('LPUSH', k[6], a[2])
    if tonumber(a[4]) > 0 then redis.call('EXPIRE', k[2], a[4]) end
  end
  redis.call('DECR', k[4])
  if op ~= 'release' then redis.call('INCR', k[5]) end
  return 1
end
local out = {}
for item = 0, #KEYS / 8 - 1 do
  local k, a = {}, {}
  for j = 1, 8 do k[j] = KEYS[item * 8 + j] end
  for j = 1, 5 do a[j] = ARGV[item * 5 + j] end
  local ok, res = pcall(settle, k, a)
  if not ok then res = type(res) == 'table' and res or redis.error_reply(tostring(res)) end
  out[#out + 1] = res
end
return out
"""

# KEYS (claims, owner)*; ARGV lease, token*.
EXTEND = """
for n = 1, #KEYS / 2 do
  if redis.call('GET', KEYS[2 * n]) == ARGV[n + 1] then
    redis.call('SET', KEYS[2 * n - 1], ARGV[n + 1], 'EX', ARGV[1])
  end
end
return 1
"""

EXPIRED = """
return redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', redis.call('TIME')[1], 'LIMIT', 0, ARGV[1])
"""

# KEYS registry, ready, reservation*; ARGV limit.
RECOVER = """
for i = 2, #KEYS do
  local t = redis.call('TYPE', KEYS[i]).ok
  if t ~= 'none' and t ~= 'list' then return redis.error_reply('WRONGTYPE queue recovery') end
end
local now, limit, moved = tonumber(redis.call('TIME')[1]), tonumber(ARGV[1]), 0
for i = 3, #KEYS do
  local due = redis.call('ZSCORE', KEYS[1], KEYS[i])
  if due and tonumber(due) <= now then
    while moved < limit do
      local raw = redis.call('LPOP', KEYS[i])
      if not raw then break end
      redis.call('RPUSH', KEYS[2], raw)
      moved = moved + 1
    end
    if redis.call('LLEN', KEYS[i]) == 0 then redis.call('ZREM', KEYS[1], KEYS[i]) end
    if moved >= limit then break end
  end
end
return moved
"""

# KEYS owner, claims, job, processing, in-flight, target (ready or dead), marker (or owner);
# ARGV expected owner ('' = none), pid, replacement ('' = dead), job ttl, keyed, successor.
RECLAIM = _TYPES + """
local bad = check({'string', 'string', 'string', 'list', 'string', 'list', 'string'}, KEYS,
  'reclaim') or counters({KEYS[5]}, 'Invalid queue counter')
if bad then return bad end
if (redis.call('GET', KEYS[1]) or '') ~= ARGV[1] then return 0 end
if redis.call('EXISTS', KEYS[2]) == 1 or redis.call('EXISTS', KEYS[3]) == 0 then return 0 end
if redis.call('LREM', KEYS[4], 1, ARGV[2]) == 0 then return 0 end
local held = ARGV[5] == '1' and redis.call('GET', KEYS[7]) == ARGV[2]
redis.call('DEL', KEYS[1], KEYS[2])
redis.call('DECR', KEYS[5])
if ARGV[3] == '' then
  redis.call('LPUSH', KEYS[6], ARGV[2])
  if tonumber(ARGV[4]) > 0 then redis.call('EXPIRE', KEYS[3], ARGV[4]) end
  if held then redis.call('DEL', KEYS[7]) end
else
  redis.call('LPUSH', KEYS[6], ARGV[3])
  redis.call('DEL', KEYS[3])
  if held then redis.call('SET', KEYS[7], ARGV[6], 'KEEPTTL') end
end
return 1
"""

# KEYS marker, ready; ARGV envelope, ttl, pid.
COALESCE = _TYPES + """
local bad = check({'string', 'list'}, KEYS, 'coalesce')
if bad then return bad end
if not redis.call('SET', KEYS[1], ARGV[3], 'NX', 'EX', ARGV[2]) then return 0 end
redis.call('LPUSH', KEYS[2], ARGV[1])
return 1
"""

SCRIPTS = {"reserve": RESERVE, "claim": CLAIM, "settle": SETTLE, "extend": EXTEND,
           "expired": EXPIRED, "recover": RECOVER, "reclaim": RECLAIM, "coalesce": COALESCE}


# --------------------------------------------------------------------------- PHP values
_INT_MAX = 2**63 - 1
_NUMERIC = re.compile(rb"[ \t\n\r\v\f]*[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?")


def php_float(value: float, exp: str = "e") -> str:
    """PHP's shortest float text (serialize_precision -1): ``1.0e+25``, ``0.5``, ``2``."""
    if value == 0:
        return "-0" if math.copysign(1, value) < 0 else "0"
    if not math.isfinite(value):
        raise ValueError("Inf and NaN cannot be JSON encoded")
    _, digits, exponent = Decimal(repr(abs(value))).normalize().as_tuple()
    text, point = "".join(map(str, digits)), len(digits) + int(exponent)
    prefix = "-" if value < 0 else ""
    if point > 17 or point < -3:
        mantissa = text[0] + "." + (text[1:] or "0")
        return f"{prefix}{mantissa}{exp}{'-' if point - 1 < 0 else '+'}{abs(point - 1)}"
    if point <= 0:
        return f"{prefix}0.{'0' * -point}{text}"
    whole, frac = text[:point].ljust(point, "0"), text[point:]
    return prefix + whole + ("." + frac if frac else "")


# json_encode writes 512 nested levels; php_json_encode recurses through two frames a level.
sys.setrecursionlimit(max(sys.getrecursionlimit(), 4000))


def php_json_encode(value: Any) -> str:
    """``json_encode($value)`` with default flags, for what ``json_decode`` produced."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return php_float(value)
    if isinstance(value, str):  # json_encode leaves DEL (0x7f) as it is; Python escapes it
        text = "\x7f".join(json.dumps(part)[1:-1] for part in value.split("\x7f"))
        return '"' + text.replace("/", "\\/") + '"'
    if isinstance(value, dict) and [str(k) for k in value] != [str(i) for i in range(len(value))]:
        items = (f"{php_json_encode(str(k))}:{php_json_encode(v)}" for k, v in value.items())
        return "{" + ",".join(items) + "}"
    items = value.values() if isinstance(value, dict) else value
    return "[" + ",".join(php_json_encode(v) for v in items) + "]"


def php_json_decode(raw: bytes) -> Any:
    """``json_decode($raw, true, 512, JSON_THROW_ON_ERROR)``; raises ValueError."""

    def integer(text: str) -> int | float:
        number = int(text)
        return number if -_INT_MAX - 1 <= number <= _INT_MAX else float(text)

    def invalid(name: str) -> Any:
        raise ValueError(name)

    try:
        value = json.loads(raw.decode("utf-8"), parse_int=integer, parse_constant=invalid)
    except RecursionError as error:
        raise ValueError("Maximum stack depth exceeded") from error
    stack = [(value, 0)]
    while stack:  # PHP refuses nesting deeper than 512 and unpaired surrogates
        item, depth = stack.pop()
        if isinstance(item, str):
            item.encode("utf-8")
        elif isinstance(item, dict | list):
            if depth >= 511:  # 512 nested containers in all are refused
                raise ValueError("Maximum stack depth exceeded")
            children = list(item.items()) if isinstance(item, dict) else [(None, v) for v in item]
            stack += [(k, depth) for k, _ in children if k is not None]
            stack += [(v, depth + 1) for _, v in children]
    return value


def _numeric(text: str, whole: bool = False) -> int | float | None:
    """The leading number of ``text`` (``whole``: only if nothing but white space follows)."""
    data = text.encode()
    match = _NUMERIC.match(data)
    if not match or (whole and data[match.end():].strip(b" \t\n\r\v\f")):
        return None
    if b"." in match.group(0) or match.group(3):
        return float(match.group(0))
    number = int(match.group(0))
    return number if -_INT_MAX - 1 <= number <= _INT_MAX else float(number)


def php_int_cast(value: Any) -> int:
    """``(int) $value``."""
    if isinstance(value, str):
        number = _numeric(value)
        if isinstance(number, float):  # strings saturate
            number = 0 if not math.isfinite(number) else int(number)
            return max(-_INT_MAX - 1, min(_INT_MAX, number))
        return number or 0
    if isinstance(value, float):  # floats wrap
        return 0 if not math.isfinite(value) else (int(value) + 2**63) % 2**64 - 2**63
    if isinstance(value, dict | list):
        return int(bool(value))
    return int(value or 0)


def _to_int(value: Any) -> int:
    """Assignment to a PHP ``int`` property in coercive mode."""
    if isinstance(value, bool | int):
        return int(value)
    number = _numeric(value, whole=True) if isinstance(value, str) else value
    if isinstance(number, int):
        return number
    if isinstance(number, float) and math.isfinite(number) and abs(number) < 2.0**63:
        return int(number)
    raise PhpError(f"cannot assign {value!r} to an int property")


def _to_str(value: Any) -> str:
    """Assignment to a PHP ``string`` property in coercive mode."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "1" if value else ""
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return php_string_of_float(value)
    raise PhpError(f"cannot assign {value!r} to a string property")


def php_string_of_float(value: float) -> str:
    """``(string) $float``: ``precision`` (14 significant digits), not serialize_precision."""
    if not math.isfinite(value):
        return "NAN" if math.isnan(value) else ("INF" if value > 0 else "-INF")
    if value == 0:
        return "-0" if math.copysign(1, value) < 0 else "0"
    mantissa, _, exponent = f"{abs(value):.13e}".partition("e")
    text, point = (mantissa[0] + mantissa[2:]).rstrip("0"), int(exponent) + 1
    prefix = "-" if value < 0 else ""
    if point > 14 or point < -3:
        sign = "-" if point - 1 < 0 else "+"
        return f"{prefix}{text[0]}.{text[1:] or '0'}E{sign}{abs(point - 1)}"
    if point <= 0:
        return f"{prefix}0.{'0' * -point}{text}"
    whole, frac = text[:point].ljust(point, "0"), text[point:]
    return prefix + whole + ("." + frac if frac else "")


def uniqid() -> str:
    """``uniqid('', true)``: 8 + 5 hex digits of the clock, then ``D.DDDDDDDD``."""
    now = time.time()
    return f"{int(now):08x}{int(now % 1 * 1_000_000):05x}{random.random() * 10:.8f}"


# --------------------------------------------------------------------------- the model
@dataclass
class Message:
    pid: str
    queue: str
    timestamp: int
    payload: dict[str, Any] | list[Any]
    attempts: int
    raw: bytes
    receipt: str = ""
    key: str | None = None


def message(envelope: Any, raw: bytes, receipt: str = "") -> Message:
    """``new Message($envelope)``; PhpError where PHP throws TypeError/Error."""
    if not isinstance(envelope, dict) or not envelope:
        raise PhpError("not an envelope")
    payload = envelope.get("payload")
    if not isinstance(payload, dict | list):
        if payload is not None:
            raise PhpError("payload is not an array")
        payload = []
    if envelope.get("sequence") is not None:
        _to_int(envelope["sequence"])
    key, attempts = envelope.get("key"), envelope.get("attempts")
    return Message(
        pid=_to_str(envelope.get("pid")), queue=_to_str(envelope.get("queue")),
        timestamp=_to_int(envelope.get("timestamp")), payload=payload,
        attempts=0 if attempts is None else _to_int(attempts), raw=raw, receipt=receipt,
        key=None if key is None else _to_str(key),
    )


@dataclass
class Reservation:
    token: str
    key: str
    batch: list[bytes]


class Queue5Consumer:
    """One PHP ``Broker\\Redis`` serving one queue (sync, one settlement per script call)."""

    def __init__(
        self, client: redis.Redis, queue: str, namespace: str = "utopia-queue",
        claim_ttl: int = 90, reap_interval: int = 60, reap_after: int = REAP_AFTER,
        job_ttl: int = 0, max_attempts: int | None = None, newer_than: int | None = None,
        adapter: str = "swoole",
    ) -> None:
        """``adapter``: ``swoole`` renews its claims (a coroutine calls ``extend()``); one of
        NON_RENEWING never does (``extend`` is then a no-op, as in PHP)."""
        self.client, self.queue, self.namespace = client, queue, namespace
        self.adapter = adapter
        self.renews = adapter not in NON_RENEWING
        self.claim_ttl, self.reap_interval, self.reap_after = claim_ttl, reap_interval, reap_after
        self.job_ttl, self.max_attempts, self.newer_than = job_ttl, max_attempts, newer_than
        self.pop_timeout: float = POP_TIMEOUT
        self.clock: Callable[[], float] = time.time  # PHP's time()
        self.scripts = {name: client.register_script(src) for name, src in SCRIPTS.items()}

    # keys -------------------------------------------------------------------------------
    def key(self, kind: str, *rest: str) -> str:
        return ".".join((self.namespace, kind, self.queue, *rest))

    def marker(self, key: str) -> str:
        return self.key("pending", key.encode().hex())

    def _run(self, name: str, keys: list[str], args: list[Any]) -> Any:
        return self.scripts[name](keys=keys, args=args)

    def new_token(self) -> str:
        return secrets.token_hex(16)

    def new_pid(self) -> str:
        return uniqid()

    # receive ----------------------------------------------------------------------------
    def receive_reserve_only(self, n: int = 1, timeout: int = 0) -> Reservation:
        """receive() up to the claim: payloads sit in a registered reservation list."""
        token = self.new_token()
        reservation = self.key("reservations", token)
        keys = [self.key("queue"), self.key("reservations"), reservation,
                self.key("processing"), self.key("stats", "total"), self.key("stats", "processing")]
        count = min(LIMIT, max(1, n))
        try:
            batch = self._run("reserve", keys, [count, self.claim_ttl, max(0, timeout), 0])
            if not batch and timeout > 0:
                raw = self.client.brpoplpush(keys[0], reservation, timeout)
                if raw is not None:
                    batch = [raw]
                    if count > 1:
                        batch += self._run("reserve", keys, [count - 1, self.claim_ttl, 0, 1])
        except redis.RedisError:
            batch = []  # PHP backs off and returns [] on any RedisException here
        return Reservation(token, reservation, list(batch))

    def receive_frozen(self, n: int = 1, timeout: int = 1) -> Callable[[], list[Message]]:
        """receive() on an idle queue, frozen (SIGSTOP, a VM pause) after registering its
        blocking reservation and before sending BRPOPLPUSH; returns the rest of it, to run
        on thaw: the late BRPOPLPUSH, the continuation and the claim (which raises 'Queue
        reservation expired' once the deadline passed, leaving what moved in the list)."""
        token = self.new_token()
        reservation = self.key("reservations", token)
        keys = [self.key("queue"), self.key("reservations"), reservation,
                self.key("processing"), self.key("stats", "total"), self.key("stats", "processing")]
        count = min(LIMIT, max(1, n))
        assert self._run("reserve", keys, [count, self.claim_ttl, timeout, 0]) == []

        def thaw() -> list[Message]:
            raw = self.client.brpoplpush(keys[0], reservation, timeout)
            if raw is None:
                return []
            batch = [raw]
            if count > 1:
                try:
                    batch += self._run("reserve", keys, [count - 1, self.claim_ttl, 0, 1])
                except redis.RedisError:
                    return []  # as receive_reserve_only: PHP backs off, the move stays
            return self.claim(Reservation(token, reservation, batch))

        return thaw

    def receive(self, n: int = 1, timeout: int = 0) -> list[Message]:
        reserved = self.receive_reserve_only(n, timeout)
        return self.claim(reserved) if reserved.batch else []

    def claim(self, reserved: Reservation) -> list[Message]:
        """Decode as PHP does, then claim; a late claim raises 'Queue reservation expired'."""
        keys = [self.key("reservations"), reserved.key, self.key("processing"),
                self.key("stats", "total"), self.key("stats", "processing"), self.key("poison")]
        messages: list[Message] = []
        pairs: list[bytes | str] = []
        poison: list[bytes] = []
        for raw in reserved.batch:
            try:
                envelope = php_json_decode(raw)
                if not isinstance(envelope, dict) or any(
                        envelope.get(f) is None for f in ("pid", "queue", "timestamp")):
                    raise ValueError("Invalid queue envelope")
                envelope["timestamp"] = php_int_cast(envelope["timestamp"])
                msg = message(envelope, raw, reserved.token)
            except (ValueError, PhpError):
                poison.append(raw)
                continue
            messages.append(msg)
            keys += [self.key("jobs", msg.pid), self.key("claims", msg.pid),
                     self.key("owners", msg.pid)]
            pairs += [raw, msg.pid]
        self._run("claim", keys, [self.claim_ttl, reserved.token, len(messages), *pairs, *poison])
        return messages

    # settle -----------------------------------------------------------------------------
    def commit(self, msg: Message) -> None:
        self._settle(msg, "commit")

    def reject(self, msg: Message) -> None:
        self._settle(msg, "reject")

    def release(self, *msgs: Message) -> None:
        for msg in reversed(msgs):
            self._settle(msg, "release")

    def _settle(self, msg: Message, op: str) -> None:
        owner = self.key("owners", msg.pid)
        keys = [self.key("claims", msg.pid), self.key("jobs", msg.pid), self.key("processing"),
                self.key("stats", "processing"),
                self.key("stats", "success" if op == "commit" else "failed"),
                self.key("queue" if op == "release" else "failed"), owner,
                owner if msg.key is None else self.marker(msg.key)]
        args = [msg.receipt, msg.pid, op, self.job_ttl, "" if msg.key is None else "1"]
        (result,) = self._run("settle", keys, args)
        if isinstance(result, Exception):
            raise SettlementFailed(f"Queue settlement failed: {result}")
        if result != 1:
            raise NotOwned("Queue delivery is no longer owned by this consumer")

    def extend(self, *msgs: Message) -> None:
        if not self.renews:
            return  # Workerman / KubernetesJob: withAckExtension() only runs the handler
        for start in range(0, len(msgs), LIMIT):
            chunk = msgs[start:start + LIMIT]
            keys = [k for m in chunk
                    for k in (self.key("claims", m.pid), self.key("owners", m.pid))]
            self._run("extend", keys, [self.claim_ttl, *(m.receipt for m in chunk)])

    # publish ----------------------------------------------------------------------------
    def envelope(self, payload: dict[str, Any], **extra: Any) -> dict[str, Any]:
        return {"pid": self.new_pid(), "queue": self.queue, "timestamp": int(self.clock()),
                "payload": payload, **extra}

    def publish(self, payload: dict[str, Any]) -> str:
        envelope = self.envelope(payload)
        self.client.lpush(self.key("queue"), php_json_encode(envelope))
        return envelope["pid"]

    def coalesce(self, payload: dict[str, Any], key: str, ttl: int = 86400) -> bool:
        """True when published, False when a pending holder of ``key`` coalesced it."""
        if key == "":
            raise ValueError("Cannot coalesce with an empty key.")
        envelope = self.envelope(payload, key=key)
        result = self._run("coalesce", [self.marker(key), self.key("queue")],
                           [php_json_encode(envelope), ttl, envelope["pid"]])
        return result == 1

    # recovery ---------------------------------------------------------------------------
    def maintain(self) -> int | None:
        """One fleet sweep if this consumer wins the reap lock: the requeued count, else None.

        PHP runs this only for queues its broker has called receive() on; callers decide.
        """
        if not self.client.set(self.key("reap-lock"), str(int(self.clock())), nx=True,
                               ex=self.reap_interval):
            return None
        registry = self.key("reservations")
        expired = self._run("expired", [registry], [LIMIT])
        if expired:
            self._run("recover", [registry, self.key("queue"), *expired], [LIMIT])
        return self.reap(self.reap_after, limit=LIMIT, max_attempts=self.max_attempts,
                         newer_than=self.newer_than, scan=LIMIT * 2)

    def get_job(self, pid: str) -> Message | None:
        raw = self.client.get(self.key("jobs", pid))
        if raw is None:
            return None
        try:
            value = php_json_decode(raw)
        except ValueError:
            return None
        return message(value, raw) if isinstance(value, dict | list) else None

    def retry_payload(self, job: Message, pid: str, key: str | None = None) -> str:
        envelope: dict[str, Any] = {"pid": pid, "queue": self.queue,
                                    "timestamp": int(self.clock()), "payload": job.payload,
                                    "attempts": job.attempts + 1}
        if key is not None:
            envelope["key"] = key
        return php_json_encode(envelope)

    def reap(self, older_than: int = REAP_AFTER, limit: int | None = None,
             max_attempts: int | None = None, newer_than: int | None = None,
             scan: int | None = None) -> int:
        processing = self.key("processing")
        now = int(self.clock())
        requeued = 0
        size = self.client.llen(processing)
        if size == 0:
            return 0
        cursor = self.key("reap-cursor")
        parts = (self.client.get(cursor) or b"").decode().split(":") if scan is not None else []
        retained = php_int_cast(parts[0]) if parts else 0
        remaining = php_int_cast(parts[1]) if len(parts) > 1 else 0
        if retained < 0 or retained >= size or remaining <= 0:
            retained, remaining = 0, size
        remaining = min(remaining, size - retained)
        length = size if scan is None else min(max(1, scan), remaining)
        start = max(0, size - retained - length)
        window = self.client.lrange(processing, start, start + length - 1)
        for raw_pid in reversed(window):
            if limit is not None and requeued >= limit:
                break
            remaining -= 1
            pid = raw_pid.decode()
            owner_key, claims = self.key("owners", pid), self.key("claims", pid)
            job = self.get_job(pid)
            owner = self.client.get(owner_key)
            if job is None:
                if owner is not None:
                    raise RuntimeError("Queue delivery payload is missing")
                self.client.lrem(processing, 1, pid)
                continue
            if job.timestamp > now - older_than or self.client.get(claims) is not None:
                retained += 1
                continue
            dead = (max_attempts is not None and job.attempts >= max_attempts) or (
                newer_than is not None and job.timestamp < now - newer_than)
            successor = self.new_pid()
            keys = [owner_key, claims, self.key("jobs", pid), processing,
                    self.key("stats", "processing"), self.key("dead" if dead else "queue"),
                    owner_key if job.key is None else self.marker(job.key)]
            args = [owner or b"", pid, "" if dead else self.retry_payload(job, successor, job.key),
                    self.job_ttl, "" if job.key is None else "1", successor]
            moved = self._run("reclaim", keys, args)
            if moved and not dead:
                requeued += 1
            elif not moved:
                retained += 1
        if scan is not None:
            self.client.set(cursor, f"{retained}:{remaining}")
        return requeued

    def retry(self, limit: int | None = None, max_attempts: int | None = None,
              newer_than: int | None = None) -> None:
        """The manual failed-list sweep (BRPOP with PHP's 2 s wait; see ``pop_timeout``)."""
        start, processed = int(self.clock()), 0
        failed = self.key("failed")
        while limit is None or processed < limit:
            popped = self.client.brpop([failed], self.pop_timeout)
            if not popped:
                break
            pid = popped[1].decode()
            job = self.get_job(pid)
            if job is None:
                continue
            if job.timestamp >= start:
                self.client.rpush(failed, pid)
                break
            if (max_attempts is not None and job.attempts >= max_attempts) or (
                    newer_than is not None and job.timestamp < start - newer_than):
                self.client.lpush(self.key("dead"), pid)
                continue
            self.client.lpush(self.key("queue"), self.retry_payload(job, self.new_pid()))
            processed += 1
