"""``failed`` / ``dead`` / ``poison JOB ACTION``: list, show, delete and retry the jobs that
stopped, on Redis (``broker.redis.admin``) and NATS (``broker.nats.admin``).

    failed JOB list [--limit N] [--json]              oldest first
    failed JOB show PID [--json]
    failed JOB delete PID... | --count N | --all [--dry-run] [--json]
    failed JOB retry PID... | --count N | --all [--reset-attempts] [--dry-run] [--json]
    dead JOB ...                                      the same for the dead list
    poison JOB list | show POSITION | delete --count N | --all   (Redis)

Exit codes: 0 done; 1 something named or selected was not there (retried or deleted
meanwhile), was left (undecodable, changed meanwhile), ``show`` found nothing, or the broker
failed; 2 a wrong command line (nothing changed).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import AsyncIterator
from typing import Any

import nats.errors
import redis.exceptions

from broker.base import MAX_BATCH, BrokerError, BrokerRefused
from broker.nats import admin as nats_dead
from broker.nats.setup import DUPLICATE_WINDOW
from broker.redis.admin import lists as redis_lists
from broker.redis.admin.retry import retry
from broker.stopped import Job
from supervisor import exits, logs
from supervisor.config import Config
from supervisor.ops.jobs import NAMED_AT_MOST, PREVIEW_CHARS, job_dict, list_lines, show_lines
from supervisor.ops.opening import json_for_terminal, redis_broker

#: Jobs a listing shows unless ``--limit`` says otherwise.
LIST_DEFAULT = 20
ACTIONS = {
    "failed": ("list", "show", "delete", "retry"),
    "dead": ("list", "show", "delete", "retry"),
    "poison": ("list", "show", "delete"),
}
HELP = {
    "failed": "list, show, delete or retry failed jobs (NATS: the dead stream)",
    "dead": "list, show, delete or retry dead jobs (NATS: the dead stream)",
    "poison": "list, show or delete undecodable messages (Redis)",
}


class UsageError(Exception):
    """A command line that names nothing to act on, or a list this broker does not have."""


# -- entry points -----------------------------------------------------------------------------


async def failed(config: Config, args: argparse.Namespace) -> int:
    return await _run(config, args, "failed")


async def dead(config: Config, args: argparse.Namespace) -> int:
    return await _run(config, args, "dead")


async def poison(config: Config, args: argparse.Namespace) -> int:
    return await _run(config, args, "poison")


async def _run(config: Config, args: argparse.Namespace, source: str) -> int:
    if config.broker.kind == "nats":
        if source == "poison":
            raise UsageError(f"poison is a Redis list; NATS parks undecodable messages in the "
                             f"dead stream: use dead ({config.broker.safe_url})")
        return await _nats(config, args, source)

    async with redis_broker(config, source) as broker:
        try:
            return await _redis(config, args, source, broker)
        except redis.exceptions.ResponseError as error:
            if "WRONGTYPE" not in str(error):
                raise
            # The server's text names no key: say which, and that nothing was changed.
            key = redis_lists.list_key(broker.keys, source)
            kind = _text(await broker.client.type(key))
            if kind in ("list", "none"):
                raise
            raise BrokerError(
                f"{key} holds a {kind}, not a list of pids as queue 5 writes it, so the "
                f"command stopped there. Something other than queue 5 or this supervisor "
                f"wrote it: look at it with redis-cli (TYPE, DUMP) before deleting it"
            ) from error


async def nats_retry(config: Config, args: argparse.Namespace) -> int:
    """The ``retry`` command on NATS: the oldest ``--limit`` dead letters back to work."""
    redrive = argparse.Namespace(action="retry", pids=[], count=args.limit, all=False,
                                 dry_run=args.dry_run, json=False, reset_attempts=True)
    return await _nats(config, redrive, args.source)


# -- Redis ------------------------------------------------------------------------------------


async def _redis(config: Config, args: argparse.Namespace, source: str, broker: Any) -> int:
    client, scripts, keys = broker.client, broker.scripts, broker.keys
    limit, queue = config.supervisor.envelope_limit(), config.job.queue
    if args.action == "list":
        total, jobs = await redis_lists.list_jobs(client, scripts, keys, source, args.limit,
                                                  limit)
        return _print_list(args, source, queue, total, jobs)
    if args.action == "show":
        if source == "poison" and not args.pid.isdecimal():
            raise UsageError(f"poison show takes a position (0 = the oldest), not {args.pid!r}")
        job = await redis_lists.show_job(client, scripts, keys, source, args.pid, limit)
        return _print_show(args, source, queue, job)
    if source == "poison":
        if args.pids:
            raise UsageError("poison delete takes --count N or --all (its entries have no pid)")
        _selection(args)
        dropped = await redis_lists.delete_poison(client, keys,
                                                  None if args.all else args.count, args.dry_run)
        verb = "would delete" if args.dry_run else "deleted"
        return _print(args, {"queue": queue, "list": source, "dry_run": args.dry_run,
                             "deleted": dropped},
                      [f"{verb} the {dropped} oldest poison entries of {queue}"], exits.OK)
    count: int | None = None if _selection(args) else args.count
    if args.action == "delete":
        if args.pids:
            report = await redis_lists.delete(client, scripts, keys, source, args.pids,
                                              args.dry_run)
        else:
            report = await redis_lists.delete_oldest(client, scripts, keys, source, count,
                                                     args.dry_run)
        return _print_delete(args, source, queue, report.deleted, report.missing,
                             report.as_dict())
    if count is None and not args.pids:  # --all: what the list holds now
        count = await client.llen(redis_lists.list_key(keys, source))
    moved = await retry(client, scripts, keys, source=source, reset_attempts=args.reset_attempts,
                        max_record_bytes=limit, pids=args.pids or None,
                        limit=count if count is not None else MAX_BATCH,
                        dry_run=args.dry_run)
    attempts = "reset to 0" if args.reset_attempts else "+ 1, as queue 5 retries"
    lines = [f"{_verb(args, 'moved')} {moved.moved} {source} jobs of {queue} back to the "
             f"ready list (attempts {attempts}){_named(moved.moved_pids)}"]
    if moved.expired:
        lines.append(f"{_verb(args, 'dropped')} {moved.expired} pids whose job record had "
                     f"expired (job_ttl): nothing left to run")
    if moved.malformed:
        lines.append(f"left {moved.malformed} job records where they are: undecodable, not "
                     f"writable as PHP writes JSON, over the job's envelope limit, or a pid "
                     f"that is not UTF-8 text (remove those with redis-cli LREM)")
    if moved.skipped:
        lines.append(f"skipped {moved.skipped} that changed meanwhile (left in {source})")
    lines += _missing(source, moved.missing)
    return _print(args, {"queue": queue, "list": source, "dry_run": args.dry_run,
                         **moved.as_dict()}, lines, exits.LEFT if moved.left else exits.OK)


# -- NATS -------------------------------------------------------------------------------------


async def _nats(config: Config, args: argparse.Namespace, source: str) -> int:
    queue = config.job.queue
    async with nats_dead.dead_stream(config.broker.url, config.broker.tls, queue,
                                     source) as stream:
        where = f"dead stream {stream.names.dead_stream}"
        if args.action == "list":
            jobs = [letter.job async for letter in stream.letters(args.limit)]
            return _print_list(args, source, queue, await stream.total(), jobs, where)
        if args.action == "show":
            letters, _ = await stream.find([args.pid])
            return _print_show(args, source, queue, letters[0].job if letters else None, where)
        count = None if _selection(args) else args.count
        report = nats_dead.Moved()
        # One dead letter in memory at a time (each may be megabytes), unless named.
        async for letter in _selected(stream, args.pids, count, report):
            if args.action == "delete":
                await nats_dead.remove(stream, letter, report, args.dry_run)
            else:
                await _redrive(stream, letter, report, args.dry_run)
        if args.action == "delete":
            return _print_delete(args, source, queue, report.done, report.missing,
                                 report.as_dict("deleted"), where)
        return _print_redrive(args, source, queue, stream.names, report)


async def _selected(stream: nats_dead.DeadStream, pids: list[str], count: int | None,
                    report: nats_dead.Moved) -> AsyncIterator[nats_dead.Letter]:
    """The dead letters named (the names that matched none go to ``report.missing``), or
    the oldest ``count`` (None: all stored when this began)."""
    if not pids:
        async for letter in stream.letters(count):
            yield letter
        return
    letters, report.missing = await stream.find(pids)
    for letter in letters:
        yield letter


async def _redrive(stream: nats_dead.DeadStream, letter: nats_dead.Letter,
                   report: nats_dead.Moved, dry_run: bool) -> None:
    named = nats_dead.name(letter.job)
    try:
        await nats_dead.retry(stream, letter, report, dry_run)
    except BrokerRefused:
        raise
    except (BrokerError, nats.errors.Error, OSError) as error:
        # A lost reply or a dropped connection mid-way: without this, the operator read
        # "nats: timeout" alone, not which letter, what had moved, nor what to do.
        raise BrokerError(
            f"re-driving dead letter {named} (seq {letter.job.seq}) failed: {error!r}. "
            f"{len(report.done)} moved before it{_named(report.done)}. It is still in "
            f"{stream.names.dead_stream}, and in {stream.names.subject} too if its publish "
            f"reached the server: run the same retry again within "
            f"{DUPLICATE_WINDOW:g} s and the server keeps one copy of it (its message id)"
        ) from error


def _print_redrive(args: argparse.Namespace, source: str, queue: str, names: Any,
                   report: nats_dead.Moved) -> int:
    lines = [f"{_verb(args, 'moved')} {len(report.done)} dead letters of {queue} from "
             f"{names.dead_stream} to {names.subject} (each published and acknowledged, "
             f"then deleted from {names.dead_stream}; JetStream counts attempts afresh)"
             f"{_named(report.done)}"]
    if report.duplicates:
        lines.append(f"{report.duplicates} of them had been published already by another "
                     f"retry within the duplicate window: not published twice")
    if report.malformed:
        lines.append(f"left {len(report.malformed)} undecodable dead letters (no envelope to "
                     f"run; delete them by seq): {', '.join(report.malformed[:NAMED_AT_MOST])}")
    lines += _missing(f"{source} ({names.dead_stream})", report.missing)
    left = report.missing or report.malformed
    return _print(args, {"queue": queue, "list": source, "stream": names.dead_stream,
                         "dry_run": args.dry_run, **report.as_dict("moved")}, lines,
                  exits.LEFT if left else exits.OK)


# -- output -----------------------------------------------------------------------------------


def _print_list(args: argparse.Namespace, source: str, queue: str, total: int,
                jobs: list[Job], where: str = "") -> int:
    at = f" ({where})" if where else ""
    if args.json:
        return _print(args, {"queue": queue, "list": source, "order": "oldest first",
                             "total": total, "jobs": [job_dict(job) for job in jobs]}, [],
                      exits.OK)
    title = f"{source} jobs of {queue}{at}: {total}, the oldest {len(jobs)} shown, oldest first"
    if source == "poison":
        lines = [title] + [f"  {job.position}  {job.size:,} bytes  {_bytes(job.raw)}"
                           + (f"  reason {logs.clean(job.reason, PREVIEW_CHARS)}"
                              if job.reason else "")
                           for job in jobs]
    else:
        lines = list_lines(title, jobs, time.time())
    return _print(args, {}, lines, exits.OK)


def _bytes(raw: bytes | None) -> str:
    return logs.clean((raw or b"").decode("utf-8", "replace"), PREVIEW_CHARS)


def _print_show(args: argparse.Namespace, source: str, queue: str, job: Job | None,
                where: str = "") -> int:
    if job is None:
        print(f"no {source} job {logs.clean(args.pid)} in {queue}"
              f"{f' ({where})' if where else ''}: retried, deleted or expired meanwhile, "
              f"or never there")
        return exits.LEFT
    if args.json:
        return _print(args, {"queue": queue, "list": source, **job_dict(job, whole=True)}, [],
                      exits.OK)
    return _print(args, {}, show_lines(f"{source} job", job, time.time()), exits.OK)


def _print_delete(args: argparse.Namespace, source: str, queue: str, done: list[str],
                  missing: list[str], report: dict[str, Any], where: str = "") -> int:
    at = f" ({where})" if where else " (each with its job record and failure record)"
    lines = [f"{_verb(args, 'deleted')} {len(done)} {source} jobs of {queue}{at}"
             f"{_named(done)}", *_missing(source, missing)]
    return _print(args, {"queue": queue, "list": source, "dry_run": args.dry_run, **report},
                  lines, exits.LEFT if missing else exits.OK)


def _missing(source: str, missing: list[str]) -> list[str]:
    if not missing:
        return []
    return [f"not in {source}, so untouched (retried or deleted meanwhile, or never there): "
            f"{_list(missing)}"]


def _named(pids: list[str]) -> str:
    return f": {_list(pids)}" if pids else ""


def _list(pids: list[str]) -> str:
    shown = ", ".join(logs.clean(pid, 80) for pid in pids[:NAMED_AT_MOST])
    more = len(pids) - NAMED_AT_MOST
    return shown + (f" ... and {more} more" if more > 0 else "")


def _verb(args: argparse.Namespace, done: str) -> str:
    would = {"moved": "would move", "deleted": "would delete", "dropped": "would drop"}
    return f"{would[done]} (dry run, nothing changed)" if args.dry_run else done


def _print(args: argparse.Namespace, state: dict[str, Any], lines: list[str], code: int) -> int:

    if getattr(args, "json", False):
        print(json_for_terminal(state))
    else:
        print("\n".join(logs.escape(line) for line in lines))
    return code


def _selection(args: argparse.Namespace) -> bool:
    """True for ``--all``; refuses a line that selects nothing or twice."""
    chosen = [bool(args.pids), args.count is not None, args.all]
    if sum(chosen) != 1:
        raise UsageError(f"{args.action} needs exactly one of: pids, --count N, --all")
    return bool(args.all)


# -- arguments --------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser, source: str, positive: Any) -> None:
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    listing = actions.add_parser("list", help="the oldest jobs, one line each")
    listing.add_argument("--limit", type=positive, default=LIST_DEFAULT,
                         help=f"show at most this many (default {LIST_DEFAULT})")
    show = actions.add_parser("show", help="one job whole: envelope, error, traceback")
    show.add_argument("pid", help="position from the oldest (0 = oldest)" if source == "poison"
                      else "the job's pid (NATS: or seq:N, its dead stream sequence)")
    for action in ACTIONS[source][2:]:
        sub = actions.add_parser(action, help=f"{action} jobs by pid, the oldest N, or all")
        sub.add_argument("pids", nargs="*", metavar="PID",
                         help="pids (NATS: or seq:N); or use --count / --all")
        sub.add_argument("--count", type=positive, help="the oldest N")
        sub.add_argument("--all", action="store_true", help="all the list holds now")
        sub.add_argument("--dry-run", action="store_true", help="say what would change")
        if action == "retry":
            sub.add_argument("--reset-attempts", action="store_true",
                             help="start them again at attempts 0 (default: attempts + 1; "
                                  "NATS: always afresh, JetStream counts deliveries)")
    for sub in (listing, show, *(actions.choices[a] for a in ACTIONS[source][2:])):
        sub.add_argument("--json", action="store_true", help="print one JSON object")


def _text(value: bytes | str) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value
