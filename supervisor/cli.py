"""``python -m supervisor CONF``: run one job in the foreground until SIGTERM/SIGINT.

Order matters: the configuration is checked first, then the shared memory and the fork
server are created while this process is still single-threaded and holds no connection, and
only then does the asyncio loop start and connect to the broker. This process never imports
the handler: the fork server's first handler server does, and reports what it found (a
handler that does not import exits 2 before anything is consumed); a SIGHUP imports it anew
in another (worker.forkserver).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib
import logging
import os
import sys
from collections.abc import Coroutine, Sequence
from typing import Any, NoReturn

import setproctitle

from supervisor import exits, logs, metrics, systemd
from supervisor.config import ENV_BROKER_URL, Config, ConfigError, load
from supervisor.ops import COMMANDS, output_closed, program_name, version

log = logging.getLogger("supervisor")


def main(argv: Sequence[str] | None = None) -> int:
    try:
        code = start(argv)
        sys.stdout.flush()  # here, where a closed pipe can still be told from a failure
    except BrokenPipeError:
        return output_closed()
    return code


def start(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "dashboard":  # a web page of several jobs (its own options)
        from supervisor.dashboard.cli import main as dashboard

        return dashboard(argv[1:])
    if argv and argv[0] in COMMANDS:  # an operator command; anything else is a job file
        from supervisor.ops.commands import main as operate

        return operate(argv)
    parser = argparse.ArgumentParser(
        prog=program_name(),
        description=__doc__.split("\n")[0],
        epilog=f"operator commands: {program_name()} {{{','.join(COMMANDS)}}} CONF ... "
        f"(each has --help); the web dashboard: {program_name()} dashboard CONF [CONF ...]",
    )
    parser.add_argument("config", help="the job's TOML file, e.g. conf/stats-usage.toml")
    parser.add_argument("--version", action="version", version=version())
    args = parser.parse_args(argv)
    try:
        config = load(args.config, import_handler=False)  # the handler servers import it
    except ConfigError as error:
        print(logs.error_line(error), file=sys.stderr)
        return exits.CONFIG
    setup_logging(config)
    for warning in config.warnings:
        log.warning("%s", logs.Explanation(warning))
    return run(config)


def setup_logging(config: Config) -> None:
    logs.setup(config.supervisor.log_level)


def run(config: Config) -> int:
    from supervisor.arbiter import Arbiter
    from supervisor.brokers import make_broker
    from supervisor.config import tasks_problem
    from supervisor.handlers import RingMemoryError, make_places
    from worker.forkserver import ForkServer, Loaded, LoadError
    from worker.handler import Shape
    from worker.handler import load as load_handler
    from worker.runner import run as run_handler  # here: the fork server inherits it

    sup = config.supervisor
    try:
        places = make_places(config.job.coroutines, sup.ring_slots, sup.ring_slot_size)
    except RingMemoryError as error:
        print(logs.error_line(f"{config.path}: {error}; lower [supervisor] ring_slots or "
                              "ring_slot_size, or [job] coroutines"), file=sys.stderr)
        return exits.CONFIG

    def load_code() -> Loaded:
        """In each handler server, at start and at each reload: the handler imported from
        its files as they are now, and what its processes run."""
        importlib.invalidate_caches()  # the import system's view of the folders may be old
        handler = load_handler(config.job.handler)  # HandlerError: the reason, reported

        def handler_process(index: int) -> NoReturn:
            place = places[index]
            run_handler(
                index, place.to_child, place.to_parent, handler,
                flush_every=config.job.flush_every, queue=config.job.queue,
                tasks=config.job.tasks_per_process, timeout=config.job.handler_timeout,
                alone=config.job.coroutines == 1,
            )

        return Loaded(handler_process, handler.shape.encode())

    # First, before the environment changes: the title library finds the memory it may
    # overwrite by walking from argv into environ (NOTIFY_SOCKET may be the first entry).
    setproctitle.setproctitle(f"queue-supervisor: {config.job.queue} starting")
    # Read (and removed from the environment) before forking: handlers must not notify,
    # and must not see the broker's credentials (the config has them already).
    notifier = systemd.Notifier.from_environ()
    os.environ.pop(ENV_BROKER_URL, None)
    forkserver = ForkServer(load=load_code)
    try:
        # Before any thread, event loop or connection exists; returns once the first
        # handler server imported the handler.
        handler = Shape.decode(forkserver.start())
    except LoadError as error:
        print(logs.error_line(f"{config.path}: [job] {error}"), file=sys.stderr)
        return exits.CONFIG
    problem = tasks_problem(config.job.tasks_per_process, handler.spec, handler.is_async)
    if problem:
        forkserver.stop()
        print(logs.error_line(f"{config.path}: {problem}"), file=sys.stderr)
        return exits.CONFIG
    try:
        recorder = start_metrics(config)  # a thread: only now that the fork server exists
    except OSError as error:
        forkserver.stop()
        print(logs.error_line(f"{config.path}: [supervisor] metrics_port = "
                              f"{config.supervisor.metrics_port} cannot be served: {error}"),
              file=sys.stderr)
        return exits.CONFIG
    log.info("handler %s loaded from %s", handler.spec, handler.source())  # not before: a
    # failed check above is the one line of its output
    try:
        broker = make_broker(config, supervisor=True)
        arbiter = Arbiter(config, broker, places, forkserver, handler,
                          notifier=notifier, metrics=recorder)
        quiet_collector()  # after the fork server: handler processes keep CPython's own
        return asyncio_run(arbiter.run())
    finally:
        recorder.close()
        notifier.close()
        forkserver.stop()


#: The supervisor's young-object collection runs once per this many new container objects
#: (CPython: 700).
YOUNG_COLLECTION_EVERY = 10_000


def quiet_collector() -> None:
    """Fewer, cheaper cyclic garbage collections in the supervisor's loop.

    What exists before the loop starts (modules, the config, the handler's module) lives as
    long as the process: ``gc.freeze`` takes it out of the collector's sight, so that a full
    collection no longer walks it (about 11 ms each). Per job the supervisor makes a few
    containers that die young, freed by reference counting; a young collection every
    10,000 of them instead of 700 finds the same nothing. Measured with the no-op at
    prefetch 100: 72 ms of collection per 200,000 jobs before, 11 ms after.
    """
    gc.freeze()
    gc.set_threshold(YOUNG_COLLECTION_EVERY, 10, 10)


def start_metrics(config: Config) -> metrics.Metrics:
    from broker.urls import broker_kind

    sup = config.supervisor
    return metrics.start(config.job.queue, sup.metrics_port, sup.metrics_host,
                         broker_kind(config.broker.url))


def asyncio_run(coroutine: Coroutine[Any, Any, int]) -> int:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coroutine)
    return uvloop.run(coroutine)

