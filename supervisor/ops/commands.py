"""``python -m supervisor COMMAND CONF ...``: the operator commands and their output.

Exit codes: 0 done (``check``/``drain``: nothing left behind), 1 something remains or the
broker failed, 2 a bad configuration, argument or input (nothing was changed), 5 the broker
refused the credentials or settings of the URL (as the supervisor's own exit code 5).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import sys
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import nats.errors
import redis.exceptions

from broker.base import MAX_BATCH, BrokerError, BrokerRefused
from broker.redis import acl as redis_acl
from broker.redis.admin import status as redis_status
from broker.redis.admin.retry import SOURCES, retry
from broker.redis.keys import QueueKeys
from broker.redis.recovery import promote
from supervisor import exits, logs
from supervisor.config import Config, ConfigError, load
from supervisor.ops import drain as processes
from supervisor.ops import failed_commands, program_name, running, version
from supervisor.ops.opening import Unsupported, json_for_terminal, opened_broker, redis_broker
from supervisor.ops.publish import InputError, SizeLimit, publish_all, read_payloads
from supervisor.ops.recover import forget_stopped, recover

#: Names of leftover keys printed per kind by ``check`` and ``drain``.
LIST_AT_MOST = 20
#: Characters of a reserved payload shown by ``status`` (``--json`` shows them whole); a
#: person's terminal gets them, and every other name read from the broker, escaped.
PAYLOAD_CHARS = 120

log = logging.getLogger("supervisor.ops")


# -- the commands -----------------------------------------------------------------------------


async def status(config: Config, args: argparse.Namespace) -> int:
    if config.broker.kind == "nats":
        from supervisor.ops import nats_status

        state = await nats_status.queue_status(config)
        lines = nats_status.describe(state)
    else:
        async with redis_broker(config, "status") as broker:
            state = await redis_status.queue_status(broker.client, broker.keys)
            await running.add_redis_copies(broker.client, broker.keys, state["supervisors"])
        lines = describe_status(state)
    state["url"] = config.broker.safe_url  # which broker, never with its credentials
    lines.insert(1, f"  broker        {state['url']}")
    # Names, pids and counters come from the broker, where anyone with write access may
    # have put a terminal escape: every line is escaped as a whole, whoever composed it.
    if args.json:
        print(json_for_terminal(state))
    else:
        print("\n".join(logs.escape(line) for line in lines))
    return exits.OK


async def recover_now(config: Config, args: argparse.Namespace) -> int:
    async with redis_broker(config, "recover") as broker:
        report, finished = await recover(broker, args.timeout)
    print(
        f"recovered {report.total} deliveries of {config.job.queue}: "
        f"{report.expired_reservations} from expired reservations, "
        f"{report.dead_consumers} whose claim lapsed, {report.legacy} legacy"
    )
    if report.promoted:
        print(f"moved {report.promoted} delayed retries whose backoff was over to the ready "
              "list")
    if not finished:
        print(f"stopped after {args.timeout:g}s: maintenance was still busy or locked")
    return exits.OK if finished else exits.LEFT


async def retry_jobs(config: Config, args: argparse.Namespace) -> int:
    if config.broker.kind == "nats":  # failed and dead jobs are in the dead stream
        return await failed_commands.nats_retry(config, args)
    async with redis_broker(config, "retry") as broker:
        report = await retry(
            broker.client, broker.scripts, broker.keys, source=args.source,
            limit=args.limit, reset_attempts=args.reset_attempts,
            max_record_bytes=config.supervisor.envelope_limit(), dry_run=args.dry_run,
        )
    attempts = "reset to 0" if args.reset_attempts else "+ 1, as queue 5 retries"
    moved = "would move (dry run, nothing changed)" if args.dry_run else "moved"
    print(f"{moved} {report.moved} {args.source} jobs of {config.job.queue} back to the ready "
          f"list (attempts {attempts})")
    if report.expired:
        print(f"dropped {report.expired} pids whose job record had expired (job_ttl)")
    if report.malformed:
        print(f"left {report.malformed} job records where they are: undecodable, not "
              f"writable as PHP writes JSON, or over the job's envelope limit")
    if report.skipped:
        print(f"skipped {report.skipped} that changed meanwhile")
    return exits.OK


async def publish(config: Config, args: argparse.Namespace) -> int:
    try:
        payloads = read_input(args.file, envelope_limit(config))
    except (InputError, OSError) as error:
        print(logs.error_line(error), file=sys.stderr)
        return exits.USAGE
    async with opened_broker(config, "publish") as broker:
        pids = await publish_all(broker, config.job.queue, payloads)
    print(f"published {len(pids)} messages to {config.job.queue}")
    if args.verbose:
        print("\n".join(pids))
    return exits.OK


async def drain(config: Config, args: argparse.Namespace) -> int:
    # Long enough for a supervisor killed just before: its lease, then its blocking
    # receive's registration (block_timeout more), besides the stops of this host's.
    timeout = args.timeout or (config.supervisor.shutdown_deadline + config.supervisor.lease
                               + math.ceil(config.broker.block_timeout) + 15)
    deadline = time.monotonic() + timeout
    if config.broker.kind == "nats":
        return await drain_nats(config, timeout, deadline)
    async with redis_broker(config, "drain") as broker:
        records = await redis_status.supervisors(broker.client, broker.keys, show=MAX_BATCH)
        if not await stop_this_hosts(config.job.queue, [r["where"] for r in records], timeout):
            return exits.LEFT
        recovered, promoted, left = await recover_until_empty(broker, deadline)
        forgotten = await forget_stopped(broker) if left.empty else 0
    print(f"recovered {recovered} deliveries")
    print(f"moved {promoted} delayed retries to the ready list (PHP workers never read the "
          "delayed set)")
    if forgotten:
        print(f"forgot {forgotten} stopped supervisors' entries in the token registry (no "
              "sweep of ours is left to forget them)")
    print("\n".join(describe_leftovers(left, config.job.queue)))
    return exits.OK if left.empty else exits.LEFT


async def stop_this_hosts(queue: str, records: list[str], timeout: float) -> bool:
    """SIGTERM this host's supervisors among ``records`` ("host pid") and wait for them to
    exit; name the others. False (said why) if some of ours are still running."""
    found, elsewhere = processes.find_supervisors(queue, records)
    print(f"stopping {len(found)} supervisors of {queue}"
          + (f": pids {', '.join(str(p.pid) for p in found)}" if found else ""))
    if elsewhere:
        shown = ", ".join(logs.clean(record) for record in elsewhere)  # broker data
        print(f"running on other hosts (drain there too): {shown}")
        print(f"waiting up to {timeout:g}s for them to stop: `drain` succeeds only once "
              "no supervisor of ours is alive on the queue")
    _, alive = await asyncio.to_thread(processes.stop, found, timeout)
    if alive:
        print(f"still running after {timeout:g}s: pids {', '.join(str(p.pid) for p in alive)}")
    return not alive


async def drain_nats(config: Config, timeout: float, deadline: float) -> int:
    """NATS keeps every delivery, retry and dead letter itself (a stopped supervisor's are
    redelivered to whoever consumes): stop this host's supervisors, then wait until no
    supervisor of ours answers."""
    from supervisor.ops import nats_status

    answered, _ = await nats_status.alive(config)
    if not await stop_this_hosts(config.job.queue, answered, timeout):
        return exits.LEFT
    while True:
        answered, figures = await nats_status.alive(config)
        if not answered or time.monotonic() >= deadline:
            break
    print("\n".join(nats_status.describe_alive(config.job.queue, answered, figures)))
    return exits.LEFT if answered else exits.OK


async def check(config: Config, args: argparse.Namespace) -> int:
    if config.broker.kind == "nats":
        from supervisor.ops import nats_status

        answered, figures = await nats_status.alive(config)
        print("\n".join(nats_status.describe_alive(config.job.queue, answered, figures)))
        return exits.LEFT if answered else exits.OK
    async with redis_broker(config, "check") as broker:
        left = await redis_status.leftovers(broker.client, broker.keys, LIST_AT_MOST)
    print("\n".join(describe_leftovers(left, config.job.queue)))
    return exits.OK if left.empty else exits.LEFT


async def acl(config: Config, args: argparse.Namespace) -> int:
    """Print the ACL SETUSER lines of the job's and the operator commands' Redis users: on
    stdout only those, so that they can be piped into redis-cli."""
    if config.broker.kind != "redis":
        raise Unsupported(f"acl is for Redis only ({config.broker.safe_url})")
    keys = QueueKeys(config.broker.namespace, config.job.queue)
    lines = redis_acl.setuser_lines(
        keys, select=redis_acl.selects_database(config.broker.url), cluster=config.broker.cluster,
        roles=args.roles or None, wait=config.broker.wait_replicas > 0,
    )
    where = "on every node of the Cluster" if config.broker.cluster else "with redis-cli"
    print(f"# Redis users of queue {keys.queue} (namespace {keys.namespace}): replace "
          f"{redis_acl.PASSWORD}, run {where}; see docs/acl.md", file=sys.stderr)
    print("\n".join(lines))
    return exits.OK


async def recover_until_empty(
    broker: Any, deadline: float
) -> tuple[int, int, redis_status.Leftovers]:
    """Recover until no reservation, owner record or delayed retry is left, or the deadline
    passed; returns what was recovered, the delayed retries moved to the ready list (all of
    them, due or not: no supervisor is left to promote them) and what is left.

    Owner records of a supervisor of ours that was killed instead of stopped are only
    recoverable once its claims and its record expired (up to one lease): hence the
    retries. Other consumers' (PHP workers') records are theirs and not waited for. The
    sweeps do not wait for the fleet's reap lock (see ``supervisor.ops.recover``).
    """
    recovered = promoted = 0
    while True:
        report, _ = await recover(broker, max(deadline - time.monotonic(), 1.0))
        recovered += report.total
        promoted += report.promoted
        promoted += await promote(broker.scripts, broker.keys, everything=True, rounds=0)
        left = await redis_status.leftovers(broker.client, broker.keys, LIST_AT_MOST)
        if left.empty or time.monotonic() >= deadline:
            return recovered, promoted, left
        await asyncio.sleep(0.5)


# -- output -----------------------------------------------------------------------------------


def describe_status(state: dict[str, Any]) -> list[str]:
    reservations, stats = state["reservations"], state["stats"]
    lines = [
        f"queue {state['queue']} (namespace {state['namespace']})",
        f"  ready         {state['ready']}",
        f"  processing    {state['processing']} (owner records: {state['owners']})",
        f"  running       {_running(state['supervisors'])}",
        f"  delayed       {_delayed(state['delayed'])}",
        f"  reservations  {reservations['count']} lists, {reservations['payloads']} payloads, "
        f"{reservations['expired']} expired",
    ]
    for item in reservations["lists"]:
        lines.append(f"    {logs.clean(item['key'])}  {item['size']} payloads, "
                     f"{_expiry(item['expires_in_ms'])}")
        lines += [f"      {logs.clean(payload, PAYLOAD_CHARS)}" for payload in item["payloads"]]
    lines += [
        f"  failed        {state['failed']}",
        f"  dead          {state['dead']}",
        f"  poison        {state['poison']}",
        f"  supervisors   {len(state['supervisors'])}",
    ]
    for record in state["supervisors"]:
        lines.append(f"    {logs.clean(record['id'])}  {logs.clean(record['where'])}  "
                     f"{_record_expiry(record['ttl_ms'])}")
        lines += [f"      {line}" for line in running.copy_lines(record.get("running"))]
    if state["previous_format"]:
        lines.append(f"  previous-format supervisors still running: {state['previous_format']}"
                     " (stop them: docs/php-queue5.md,"
                     " \"Upgrading from this project's previous format\")")
    lines.append("  stats         " + "  ".join(f"{k} {_count(v)}" for k, v in stats.items()))
    return lines


def _running(records: list[dict[str, Any]]) -> str:
    """What the supervisors' copies say runs, in one line (each job below its supervisor)."""
    copies = [record["running"] for record in records if record.get("running")]
    return running.summary([job for copy in copies for job in copy["jobs"]],
                           sum(copy["running"] for copy in copies))


def _delayed(delayed: dict[str, Any]) -> str:
    """Retries waiting for their backoff, and when the first is due (server clock)."""
    if not delayed["count"]:
        return "0"
    due = time.strftime("%H:%M:%S UTC", time.gmtime(delayed["next_due"]))
    if delayed["overdue"]:
        return (f"{delayed['count']} retries waiting for their backoff (the first was due at "
                f"{due}, {delayed['overdue']}s ago: only a running supervisor moves them to "
                "the ready list)")
    return f"{delayed['count']} retries waiting for their backoff (next due {due})"


def _count(value: int | str) -> str:
    """A counter as a number, or flagged: a corrupt one is worth seeing, as data."""
    return str(value) if isinstance(value, int) else f"invalid {logs.clean(repr(value))}"


#: What ``logs.escape`` escapes and orjson writes as it is (it escapes C0 controls only).
def describe_leftovers(left: redis_status.Leftovers, queue: str) -> list[str]:
    theirs = ([f"  (other consumers, such as queue-5 workers, hold {left.others.count} "
               "reservations and owner records: theirs to settle, not counted)"]
              if left.others.count else [])
    if left.empty:
        return [f"ok: no reservation and no owner record of {queue} remains of this "
                "project's supervisors, no delayed retry, and none of them is alive", *theirs]
    lines = [f"not empty: {queue} still has, of this project's supervisors"]
    if left.alive:
        lines.append(f"  {len(left.alive)} alive (stop them: `drain` on their host; one "
                     "killed counts until its lease lapses, then `drain` or `recover` takes "
                     "what it held)")
        lines += [f"    {_alive(supervisor)}" for supervisor in left.alive[:LIST_AT_MOST]]
        if len(left.alive) > LIST_AT_MOST:
            lines.append(f"    ... and {len(left.alive) - LIST_AT_MOST} more")
    if left.delayed:
        late = f", the oldest overdue by {left.overdue}s" if left.overdue else ""
        lines.append(f"  {left.delayed} delayed retries (waiting for their backoff{late}; PHP "
                     "workers never read them: `drain` moves them to the ready list)")
    for label, found in (
        ("registered reservations (`drain` waits for each to expire and returns what it "
         "holds)", left.registered),
        ("reservation lists", left.lists),
        ("owner records", left.owners),
        ("running supervisors of the previous format (stop them before this version runs; "
         "their recovery would take live deliveries)", left.previous),
    ):
        if found.count:
            lines.append(f"  {found.count} {label}")
            lines += [f"    {logs.clean(name)}" for name in found.names[:LIST_AT_MOST]]
            if found.count > LIST_AT_MOST:
                lines.append(f"    ... and {found.count - LIST_AT_MOST} more")
    return lines + theirs


def _alive(supervisor: dict[str, Any]) -> str:
    """One live supervisor: host and pid (from its record) and when it lapses unrenewed."""
    record, name = supervisor["where"], logs.clean(supervisor["id"])
    host, _, pid = (record or "").rpartition(" ")
    if host:
        where = f"host {logs.clean(host)} pid {logs.clean(pid)} ({name})"
    elif record is not None:
        where = f"{name} (its record says {logs.clean(record)!r})"
    else:
        where = f"{name} (no record: its token registry entry is current)"
    lapses = supervisor["lapses_in"]
    return where + (", record without expiry" if lapses is None else
                    f", lapses in {lapses}s unless it renews")


def _expiry(ms: int) -> str:
    return f"expires in {ms / 1000:.1f}s" if ms > 0 else f"expired {-ms / 1000:.1f}s ago"


def _record_expiry(ms: int) -> str:
    return "record without expiry" if ms < 0 else f"record expires in {ms / 1000:.1f}s"


# -- plumbing ---------------------------------------------------------------------------------


def read_input(file: str | None, limit: SizeLimit | None = None) -> list[dict[str, Any]]:
    if file in (None, "-"):
        return read_payloads(sys.stdin.buffer, "<stdin>", limit)
    with open(file, "rb") as lines:
        return read_payloads(lines, file, limit)


def envelope_limit(config: Config) -> SizeLimit:
    """What the job's supervisors accept (``SupervisorConfig.envelope_limit``), and why."""
    sup = config.supervisor
    source = (f"[supervisor] max_envelope_bytes = {sup.max_envelope_bytes}"
              if sup.max_envelope_bytes else
              f"half a handler's ring: [supervisor] ring_slot_size * ring_slots / 2 = "
              f"{sup.ring_slot_size} * {sup.ring_slots} / 2, less the record header")
    return SizeLimit(config.job.queue, sup.envelope_limit(), source)


Command = Callable[[Config, argparse.Namespace], Coroutine[Any, Any, int]]
COMMANDS: dict[str, tuple[Command, str]] = {
    "status": (status, "sizes, reservations, consumers and counters of the queue"),
    "recover": (recover_now, "run maintenance now until it recovers nothing"),
    "retry": (retry_jobs, "move failed (or dead) jobs back to the ready list (NATS: dead "
              "letters back to the work stream)"),
    "failed": (failed_commands.failed, failed_commands.HELP["failed"]),
    "dead": (failed_commands.dead, failed_commands.HELP["dead"]),
    "poison": (failed_commands.poison, failed_commands.HELP["poison"]),
    "publish": (publish, "publish JSON-lines payloads (one object per line)"),
    "drain": (drain, "stop this host's supervisors of the queue, recover (Redis), verify "
              "(rollback)"),
    "check": (check, "exit 1 while a supervisor of ours is alive on the queue, or its "
              "reservations, owner records or delayed retries remain"),
    "acl": (acl, "print the Redis ACL users (ACL SETUSER) of the job and of each command"),
}


def build_parser() -> argparse.ArgumentParser:

    parser = argparse.ArgumentParser(prog=program_name(), description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub = {name: commands.add_parser(name, help=doc, description=doc)
           for name, (_, doc) in COMMANDS.items()}
    versions = version()
    for command in sub.values():
        command.add_argument("config", help="the job's TOML file")
        command.add_argument("--version", action="version", version=versions)
    sub["status"].add_argument("--json", action="store_true", help="print one JSON object")
    sub["recover"].add_argument("--timeout", type=_seconds, default=60.0,
                                help="give up after this many seconds (default 60)")
    sub["retry"].add_argument("--limit", type=_positive, default=MAX_BATCH,
                              help=f"move at most this many jobs (default {MAX_BATCH})")
    sub["retry"].add_argument("--from", dest="source", choices=SOURCES, default="failed",
                              help="the list to take them from (default failed)")
    sub["retry"].add_argument("--reset-attempts", action="store_true",
                              help="start them again at attempts 0 (default: keep attempts)")
    sub["retry"].add_argument("--dry-run", action="store_true", help="say what would move")
    for name in failed_commands.ACTIONS:
        failed_commands.add_arguments(sub[name], name, _positive)
    sub["publish"].add_argument("file", nargs="?", help="JSON-lines file (default: stdin)")
    sub["publish"].add_argument("-v", "--verbose", action="store_true",
                                help="print the pid of every message")
    sub["acl"].add_argument("--role", dest="roles", action="append",
                            choices=list(redis_acl.BY_NAME),
                            help="print only this user (repeatable; default: all)")
    sub["drain"].add_argument(
        "--timeout", type=_seconds, default=None,
        help="seconds for the whole drain (default shutdown_deadline + lease + "
        "block_timeout + 15)")
    parser.set_defaults(subparsers=sub)
    return parser


def parse(argv: Sequence[str]) -> argparse.Namespace:
    """The arguments; a stray one is reported with the usage of its own command."""
    args, extra = build_parser().parse_known_args(argv)
    if extra:
        args.subparsers[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: Sequence[str]) -> int:
    args = parse(argv)
    try:
        config = load(args.config, import_handler=False)
    except ConfigError as error:
        print(logs.error_line(error), file=sys.stderr)
        return exits.USAGE
    logs.setup(config.supervisor.log_level)
    for library in ("redis", "nats", "asyncio", "urllib3"):
        # An operator command prints its answer; a client library's debug lines are noise.
        logging.getLogger(library).setLevel(max(logging.WARNING, logging.root.level))
    for warning in config.warnings:
        log.warning("%s", logs.Explanation(warning))
    command, _ = COMMANDS[args.command]
    try:
        return asyncio.run(command(config, args))
    except (Unsupported, failed_commands.UsageError) as error:
        print(logs.error_line(error), file=sys.stderr)
        return exits.USAGE
    except BrokerRefused as error:
        print(logs.error_line(f"{args.command} failed: {error}"), file=sys.stderr)
        return exits.REFUSED
    except BrokenPipeError:
        raise  # stdout's reader left (``| head``): not a broker failure; the CLI ends quietly
    except (BrokerError, redis.exceptions.RedisError, nats.errors.Error, OSError) as error:
        print(logs.error_line(f"{args.command} failed: {error}"), file=sys.stderr)
        return exits.LEFT


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return value
