"""Least-privilege Redis ACL users: one for the supervisor, one per operator command.

Redis checks every command a client sends, with its keys, against the user's ACL, and so it
does every ``redis.call`` inside a Lua script. The roles below are the one list of what each
side needs: ``python -m supervisor acl JOB`` prints them as ``ACL SETUSER`` lines for the
job's namespace and queue, docs/acl.md shows that output (a test compares the two), and the
end-to-end test creates exactly these users and fails on any entry in ``ACL LOG``.

Key patterns name one queue's keys, never the whole namespace (``broker.redis.keys``:
``{ns}.{kind}.{q}`` and ``{ns}.{kind}.{q}.{suffix}``). Access is ``~`` (read and write),
``%R~`` (read only: status, check) or ``%W~`` (write only: publish, whose LPUSH reads
nothing). A key handed to a script needs both: EVALSHA declares its keys read-write. A role
may add read-only patterns to its others (``read_keys``: the dashboard reads much and
writes only what its actions change).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from broker.redis import seeds
from broker.redis.keys import QueueKeys, glob_escape
from broker.redis.scripts import lua_source

#: Every user: connect() sends PING. (The broker's clients send no CLIENT SETINFO: see
#: broker.redis.)
CONNECT = ("ping",)
#: Only when the URL names a database other than 0: redis-py selects it on each connection.
SELECT = ("select",)
#: A Redis Cluster client reads the slot map and the command table, and follows ASK
#: redirections while a slot migrates.
CLUSTER = ("cluster|slots", "command", "asking")
#: Only with ``[broker] wait_replicas``: the writers wait for replicas after their writes.
WAIT = ("wait",)
WAITERS = ("job", "publish")

#: Why the Python side sends each command (commands only scripts run are explained by them).
WHY = {
    "ping": "connect: is the server there",
    "select": "the URL names a database other than 0",
    "cluster|slots": "Cluster only: the slot map",
    "command": "Cluster only: the command table (key positions)",
    "asking": "Cluster only: follow ASK while a slot migrates",
    "wait": "wait_replicas only: replicas confirm a write (WAIT) before it counts",
    "evalsha": "every state change is a Lua script, run by its SHA",
    "script|load": "load a script again after NOSCRIPT (server restart, SCRIPT FLUSH)",
    "blmove": "wait on an idle queue: ready list -> the registered reservation",
    "zrem": "drop an empty reservation after that wait",
    "set": "the fleet's reap lock (SET NX EX), the sweep cursor and the running jobs' copy",
    "del": "the running jobs' copy at a stop",
    "llen": "sizes of lists",
    "lrange": "read list windows (processing, failed, reservations)",
    "get": "the sweep cursor; counters, supervisor records and their running jobs (status)",
    "mget": "claims and owners of the pids a sweep looks at (job records go through records.lua)",
    "time": "the server's clock (recovery age, reservation deadlines)",
    "lpush": "publish: envelopes onto the ready list",
    "scan": "find keys by prefix (owner records, reservation lists, supervisor records)",
    "zcard": "count registered reservations and retries waiting for their backoff (status, "
             "check, the metrics)",
    "zrange": "list registered reservations and their deadlines; the next delayed retry's "
              "due time (status)",
    "pttl": "time left of a supervisor record and of its running jobs' copy",
    "zadd": "a stop abandons an idle wait, or a reservation made ahead is given back: the "
            "reservation is marked expired",
    "memory|usage": "status: a reservation list's size, so that its payloads are read only "
                    "when small",
    "strlen": "a record's length, so that one over the envelope limit is never read",
    "lindex": "the progress line: age of the next ready message (oldest.lua: only its length "
              "when it is over the size limit)",
    "client|id": "the blocking connection's id, named by CLIENT UNBLOCK at a stop",
    "client|unblock": "a stop ends its own idle wait (BLMOVE) at once, then unregisters it "
                      "(it can unblock any client of the server)",
    "hmget": "a sweep: which owner tokens are our supervisors' (the token registry); poison "
             "list/show and the dashboard: why each entry was poisoned (the reason store)",
    "hrandfield": "a sweep: a sample of the token registry, to forget long-gone supervisors",
    "hdel": "a sweep forgets long-gone supervisors (the token registry)",
    "hscan": "check: the token registry, to tell our leftovers from other consumers' work "
             "and which supervisors are alive",
    "hvals": "the metrics: supervisors alive (the token registry's renewal times)",
    "lpos": "failed/dead show, and retry or delete by pid: is the pid in the list",
    "ltrim": "poison delete: drop the oldest entries (the newest are kept)",
    "hlen": "dashboard: how many supervisors the token registry holds",
    "hgetall": "dashboard: the token registry (at most 1,000), to count live supervisors",
    "exists": "dashboard: which registered supervisors' records still exist",
    "getrange": "dashboard: the first bytes of a job record (a bounded preview)",
    "ttl": "dashboard: when a job record expires (job_ttl)",
}


def _fixed(attribute: str) -> Callable[[QueueKeys], str]:
    return lambda keys: glob_escape(getattr(keys, attribute))


def _under(prefix: Callable[[QueueKeys], str]) -> Callable[[QueueKeys], str]:
    """Every key ``<prefix>.<anything>``: the per-pid, per-token and per-consumer keys."""
    return lambda keys: glob_escape(prefix(keys)) + "*"


#: The key patterns of one queue, by the names the "Redis keys" table (docs/redis.md) uses.
PATTERNS: dict[str, Callable[[QueueKeys], str]] = {
    "queue.{q}": _fixed("ready"),
    "reservations.{q}": _fixed("reservations"),
    "reservations.{q}.*": _under(lambda keys: keys.reservation("")),
    "processing.{q}": _fixed("processing"),
    "jobs.{q}.*": _under(lambda keys: keys.job("")),
    "owners.{q}.*": _under(lambda keys: keys.owner("")),
    "claims.{q}.*": _under(lambda keys: keys.claim("")),
    "pending.{q}.*": _under(lambda keys: keys.pending("")),
    "failed.{q}": _fixed("failed"),
    "dead.{q}": _fixed("dead"),
    "poison.{q}": _fixed("poison"),
    "stats.{q}.*": _under(lambda keys: keys.stat("")),
    "stats.{q}.processing": lambda keys: glob_escape(keys.stat("processing")),
    "reap-lock.{q}": _fixed("reap_lock"),
    "reap-cursor.{q}": _fixed("reap_cursor"),
    "supervisors.{q}.*": _under(lambda keys: keys.supervisor("")),
    "supervisor-running.{q}.*": _under(lambda keys: keys.running("")),
    "supervisor-tokens.{q}": _fixed("supervisor_tokens"),
    "supervisor-delayed.{q}": _fixed("delayed"),
    "supervisor-errors.{q}.*": _under(lambda keys: keys.error("")),
    "supervisor-failures.{q}.*": _under(lambda keys: keys.failures("")),
    "supervisor-poison-reasons.{q}": _fixed("poison_reasons"),
    "supervisor-poison-times.{q}": _fixed("poison_times"),
    "consumers.{q}.*": _under(lambda keys: keys.legacy_consumer("")),
}


@dataclass(frozen=True, slots=True)
class Role:
    """One Redis user: what it is for, its commands (Python's and its scripts') and keys."""

    name: str
    purpose: str
    commands: tuple[str, ...]  # ACL names, lower case; "command|subcommand"
    access: str  # "~", "%R~" or "%W~"
    keys: tuple[str, ...]  # names in PATTERNS
    scripts: tuple[str, ...] = ()  # lua/ scripts it runs: their commands are in `commands`
    read_keys: tuple[str, ...] = ()  # names in PATTERNS it only reads (%R~), beside `keys`


#: What recover's sweeps touch (drain runs the same sweeps, then check's reads).
_SWEEP_KEYS = (
    "queue.{q}", "reservations.{q}", "reservations.{q}.*", "processing.{q}", "dead.{q}",
    "stats.{q}.processing", "jobs.{q}.*", "owners.{q}.*", "claims.{q}.*", "pending.{q}.*",
    "reap-cursor.{q}", "supervisor-tokens.{q}", "supervisors.{q}.*", "consumers.{q}.*",
    "supervisor-delayed.{q}", "supervisor-errors.{q}.*", "supervisor-failures.{q}.*",
)
_SWEEP_COMMANDS = (
    "evalsha", "script|load", "llen", "lrange", "get", "mget", "time", "set",
    "hmget", "hrandfield", "hdel",
    # expired.lua, recover.lua, reclaim.lua, records.lua, promote.lua
    "type", "zrangebyscore", "zscore", "zrem", "lpop", "rpush", "decrby", "del", "exists",
    "expire", "lpush", "lrem", "strlen", "lset", "lindex", "rpop",
)
_SWEEP_SCRIPTS = ("expired", "recover", "reclaim", "records", "promote")

ROLES: tuple[Role, ...] = (
    Role(
        "job", "the supervisor (python -m supervisor JOB)",
        (
            "evalsha", "script|load", "blmove", "zrem", "set", "llen", "lrange", "get", "mget",
            "time", "lindex", "hmget", "hrandfield", "hdel",
            "client|id", "client|unblock",
            # reserve, claim, settle, extend and the sweep's scripts
            "type", "rpop", "lpush", "zadd", "zscore", "lpop", "rpush", "mset", "setex", "del",
            "incrby", "decrby", "expire", "lrem", "ltrim", "exists", "zrangebyscore", "hset",
            "strlen", "lset", "zpopmin",
            # the metrics' sample (broker.redis.gauges)
            "zcard", "hvals",
        ),
        "~",
        (
            "queue.{q}", "reservations.{q}", "reservations.{q}.*", "processing.{q}",
            "jobs.{q}.*", "owners.{q}.*", "claims.{q}.*", "pending.{q}.*", "failed.{q}",
            "dead.{q}", "poison.{q}", "stats.{q}.*", "reap-lock.{q}", "reap-cursor.{q}",
            "supervisors.{q}.*", "supervisor-tokens.{q}", "consumers.{q}.*",
            "supervisor-delayed.{q}", "supervisor-errors.{q}.*", "supervisor-running.{q}.*",
            "supervisor-failures.{q}.*", "supervisor-poison-reasons.{q}",
            "supervisor-poison-times.{q}",
        ),
        ("reserve", "claim", "settle", "extend", "oldest", *_SWEEP_SCRIPTS),
    ),
    Role("publish", "python -m supervisor publish", ("lpush",), "%W~", ("queue.{q}",)),
    Role(
        "status", "python -m supervisor status",
        ("llen", "get", "scan", "zcard", "zrange", "time", "pttl", "lrange", "memory|usage"),
        "%R~",
        (
            "queue.{q}", "processing.{q}", "failed.{q}", "dead.{q}", "poison.{q}",
            "stats.{q}.*", "reservations.{q}", "reservations.{q}.*", "supervisors.{q}.*",
            "supervisor-delayed.{q}", "supervisor-running.{q}.*",
        ),
    ),
    Role("recover", "python -m supervisor recover", _SWEEP_COMMANDS, "~", _SWEEP_KEYS,
         _SWEEP_SCRIPTS),
    Role(
        "retry", "python -m supervisor retry",
        ("evalsha", "script|load", "lrange", "type", "get", "strlen", "lrem", "lpush", "del"),
        "~", ("failed.{q}", "dead.{q}", "queue.{q}", "jobs.{q}.*", "supervisor-errors.{q}.*",
              "supervisor-failures.{q}.*"),
        ("retry", "records"),
    ),
    *(Role(
        source, f"python -m supervisor {source} (list, show, delete, retry)",
        ("evalsha", "script|load", "llen", "lrange", "lpos", "pttl",
         # records.lua, retry.lua, delete.lua
         "type", "get", "strlen", "lrem", "lpush", "del"),
        "~", (f"{source}.{{q}}", "queue.{q}", "jobs.{q}.*", "supervisor-errors.{q}.*",
              "supervisor-failures.{q}.*"),
        ("retry", "records", "delete"),
    ) for source in ("failed", "dead")),
    Role("poison", "python -m supervisor poison (list, show, delete)",
         ("evalsha", "script|load", "llen", "ltrim", "type", "lrange", "hmget"), "~",
         ("poison.{q}",), ("peek",), read_keys=("supervisor-poison-reasons.{q}",)),
    Role("drain", "python -m supervisor drain (finds this host's supervisors by their "
         "records, stops them, then recovers)",
         (*_SWEEP_COMMANDS, "zcard", "zrange", "scan", "pttl", "hscan"), "~",
         _SWEEP_KEYS, _SWEEP_SCRIPTS),
    Role("check", "python -m supervisor check",
         ("zcard", "zrange", "scan", "llen", "time", "hscan", "mget", "get", "pttl"),
         "%R~", ("reservations.{q}", "reservations.{q}.*", "owners.{q}.*",
                 "supervisor-tokens.{q}", "supervisor-delayed.{q}", "supervisors.{q}.*")),
    Role("dashboard", "python -m supervisor dashboard (its reads; retry, delete and drain "
         "when it has a token)",
         (
             "llen", "get", "zcard", "hlen", "hgetall", "exists", "lpos", "lrange", "strlen",
             "getrange", "ttl", "pttl", "memory|usage", "zrange", "time", "ltrim", "hmget",
             # oldest.lua (the oldest ready message's age), records.lua, retry.lua,
             # delete.lua, peek.lua (a poison search: each entry's first bytes)
             "evalsha", "script|load", "type", "lindex", "lrem", "lpush", "del",
         ),
         "~",
         ("queue.{q}", "failed.{q}", "dead.{q}", "poison.{q}", "jobs.{q}.*",
          "supervisor-errors.{q}.*", "supervisor-failures.{q}.*"),
         ("oldest", "records", "retry", "delete", "peek"),
         read_keys=("supervisor-poison-reasons.{q}", "processing.{q}", "stats.{q}.*",
                    "supervisor-delayed.{q}",
                    "supervisor-tokens.{q}", "supervisors.{q}.*", "reservations.{q}",
                    "reservations.{q}.*", "owners.{q}.*", "claims.{q}.*",
                    "supervisor-running.{q}.*")),
)
BY_NAME = {role.name: role for role in ROLES}

PASSWORD = "<password>"
_LUA_CALL = re.compile(r"redis\.p?call\(\s*'([A-Za-z]+)'")


def user_name(queue: str, role: str) -> str:
    return f"{queue}-{role}"


def commands(role: Role, *, select: bool = False, cluster: bool = False,
             wait: bool = False) -> list[str]:
    """Every command the role's user may run, in the order the rules list them."""
    extra = (*(SELECT if select else ()), *(CLUSTER if cluster else ()),
             *(WAIT if wait and role.name in WAITERS else ()))
    return list(dict.fromkeys((*CONNECT, *extra, *role.commands)))


def patterns(role: Role, keys: QueueKeys) -> list[str]:
    """The role's key rules for one queue, e.g. ``~utopia-queue.queue.stats-usage``."""
    return ([role.access + PATTERNS[name](keys) for name in role.keys]
            + ["%R~" + PATTERNS[name](keys) for name in role.read_keys])


def rules(role: Role, keys: QueueKeys, password: str = PASSWORD, *, select: bool = False,
          cluster: bool = False, wait: bool = False) -> list[str]:
    """The ACL SETUSER arguments after the user name. ``reset`` first: no command, key or
    channel is left from an earlier definition, so running it again re-creates the user."""
    allowed = [f"+{name}" for name in commands(role, select=select, cluster=cluster,
                                               wait=wait)]
    return ["reset", "on", f">{password}", *allowed, *patterns(role, keys)]


def setuser_lines(keys: QueueKeys, password: str = PASSWORD, *, select: bool = False,
                  cluster: bool = False, roles: Sequence[str] | None = None,
                  wait: bool = False) -> list[str]:
    """One ``ACL SETUSER`` line per role (``roles``: only these), for ``redis-cli`` (on every
    node of a Cluster: ACL users are not replicated)."""
    return [
        " ".join(["ACL SETUSER", user_name(keys.queue, role.name),
                  *rules(role, keys, password, select=select, cluster=cluster,
                         wait=wait)])
        for role in ROLES if roles is None or role.name in roles
    ]


def selects_database(url: str) -> bool:
    """True if redis-py sends SELECT on each connection of this URL (database not 0); of a
    list of cluster seeds, the first (its settings are the client's)."""
    return bool(seeds.settings(url).get("db") or 0)


def script_commands(name: str) -> set[str]:
    """The commands ``lua/<name>.lua`` calls (lower case), read from its text as loaded
    (its helpers included)."""
    text = lua_source(name)
    return {command.lower() for command in _LUA_CALL.findall(text)}


def describe() -> str:
    """The table of docs/acl.md: each command, what it is for, and which users get it."""
    users: dict[str, list[str]] = {}
    for role in ROLES:
        for name in commands(role):
            users.setdefault(name, []).append(role.name)
    in_scripts: dict[str, list[str]] = {}
    for role in ROLES:
        for script in role.scripts:
            for name in script_commands(script):
                if script not in in_scripts.setdefault(name, []):
                    in_scripts[name].append(script)
    lines = ["| command | what for | users |", "|---|---|---|"]
    for name in [*users, *SELECT, *CLUSTER]:
        why = WHY.get(name, "")
        scripts = sorted(in_scripts.get(name, []))
        if scripts:
            why = "; ".join(filter(None, [why, "in " + ", ".join(f"{s}.lua" for s in scripts)]))
        given = ", ".join(users[name]) if name in users else "every user, when needed"
        cell = name.replace("|", "\\|")  # a bare | would end the table cell
        lines.append(f"| `{cell}` | {why} | {given} |")
    return "\n".join(lines) + "\n"

