"""``python -m supervisor dashboard JOB.toml [JOB.toml ...]``: serve the dashboard.

Exit codes: 0 stopped (SIGINT/SIGTERM), 2 a bad job file or argument, or a ``--listen``
address that is not loopback without a token (nothing served).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from supervisor import exits, logs
from supervisor.config import ConfigError, load
from supervisor.dashboard.auth import ENV_TOKEN
from supervisor.ops import program_name, version

log = logging.getLogger("supervisor.dashboard")

DEFAULT_LISTEN = "127.0.0.1:8370"
#: The Host names a loopback dashboard answers (a tunnel's local end gives one of these).
LOOPBACK_NAMES = ["127.0.0.1", "localhost", "::1", "[::1]"]


def parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=f"{program_name()} dashboard",
        description="a live web page of the jobs' queues, supervisors and failed jobs")
    parser.add_argument("configs", nargs="+", metavar="JOB.toml", help="the jobs' TOML files")
    parser.add_argument("--listen", default=DEFAULT_LISTEN, metavar="HOST:PORT",
                        help=f"address to serve on (default {DEFAULT_LISTEN}, this host only)")
    parser.add_argument("--token", default=None,
                        help=f"secret that every page asks for (a login) and that enables "
                        f"actions (retry, delete, drain); better in the environment variable "
                        f"{ENV_TOKEN}, which ps does not show. Without one the dashboard is "
                        f"read-only, its pages open to whoever reaches the port, and it "
                        f"serves on loopback only")
    parser.add_argument("--interval", type=float, default=5.0,
                        help="seconds between samples of each queue (default 5)")
    parser.add_argument("--refresh", type=float, default=5.0,
                        help="seconds between a page's live updates (default 5)")
    parser.add_argument("--version", action="version", version=version())
    args = parser.parse_args(argv)
    host, colon, port = args.listen.rpartition(":")
    if not colon or not port.isdecimal() or not host:
        parser.error(f"--listen {args.listen!r} is not HOST:PORT")
    args.host, args.port = host.strip("[]"), int(port)
    if not 0.5 <= args.interval <= 3600 or not 0.5 <= args.refresh <= 3600:
        parser.error("--interval and --refresh are seconds between 0.5 and 3600")
    return args


def main(argv: Sequence[str]) -> int:
    args = parse(argv)
    try:
        configs = [load(path, import_handler=False) for path in args.configs]
    except ConfigError as error:
        print(logs.error_line(error), file=sys.stderr)
        return exits.USAGE
    logs.setup(configs[0].supervisor.log_level)
    for library in ("redis", "nats", "asyncio", "uvicorn.access"):
        logging.getLogger(library).setLevel(max(logging.WARNING, logging.root.level))
    token = args.token or os.environ.get(ENV_TOKEN) or None

    try:
        import uvicorn

        from supervisor.dashboard.app import Dashboard, create_app
    except ImportError as error:
        print(logs.error_line(f"the dashboard needs the extra 'dashboard' ({error.name} is not "
                              f"installed): pip install 'queue-supervisor[dashboard]'"),
              file=sys.stderr)
        return exits.USAGE
    from supervisor.metrics_http import exposure_warning

    exposed = exposure_warning(args.host) is not None
    if exposed and token is None:
        print(logs.error_line(
            f"dashboard --listen {args.listen} is not a loopback address and no token is set: "
            f"anyone who reaches it would read the jobs' payloads and errors. Set {ENV_TOKEN} "
            f"(every page then needs a login) or bind 127.0.0.1"), file=sys.stderr)
        return exits.USAGE
    if exposed:
        log.warning("dashboard --listen %s is not a loopback address: anyone who can reach "
                    "this host on port %d reads the queues, their payloads and errors (and "
                    "acts on them with the token, sent in clear over HTTP). Bind 127.0.0.1 "
                    "and reach it through an SSH tunnel or a proxy with TLS and "
                    "authentication", args.host, args.port)
    dashboard = Dashboard(configs, token, args.interval, args.refresh,
                          allowed_hosts=None if exposed else LOOPBACK_NAMES)
    app = create_app(dashboard)
    log.info("dashboard of %d queues on http://%s:%d/ (%s)", len(configs), args.host, args.port,
             "read-only: no token" if token is None
             else "every page needs a login with the token; actions enabled")
    if token is None:
        log.warning("dashboard without a token: the job data its pages show (payloads, "
                    "errors, pids) is readable by whoever reaches port %d of %s, every local "
                    "user included; set %s to require a login", args.port, args.host,
                    ENV_TOKEN)
    uvicorn.run(app, host=args.host, port=args.port, log_config=None, access_log=False,
                server_header=False, lifespan="on")
    return exits.OK
