"""The job configuration: one TOML file per job, read into frozen dataclasses.

This module declares the keys (a field of its section's dataclass per key: type, default,
rules, one line of documentation), the rules that involve several keys, and ``load``.
How a declaration is read, checked and documented is ``supervisor.schema``; whether a broker
URL is usable, ``broker.urls``. The loader, its error messages and ``describe()`` (the key
table of docs/configuration.md) all read the declarations, so a key cannot be documented one way and
validated another.

Every problem is a ``ConfigError`` whose message is one line naming the file and the key:
the CLI prints it and exits with code 2 before anything is consumed.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from broker.failure import RECORD_TTL_WITHOUT_JOB_TTL
from broker.redis.keys import MAX_TTL, hash_tag
from broker.retry import BACKOFF_MAX
from broker.tls import TlsFileError, TlsSettings, check_files
from broker.urls import broker_kind, redact, split_servers, url_problem
from supervisor.schema import (
    NO_SPACES,
    NOT_EMPTY,
    REQUIRED,
    CrossCheck,
    Key,
    Rule,
    Values,
    above,
    at_least,
    at_most,
    fill_same_as,
    key_table,
    keys_of,
    multiple_of,
    one_of,
    parse_toml,
    read_text,
    setting,
    show,
)
from supervisor.schema import ConfigError as ConfigError  # what callers of load() catch
from worker import handler as handler_paths
from worker.handler import Handler
from worker.protocol import DELIVER_OVERHEAD
from worker.ring import Ring

if TYPE_CHECKING:
    from broker.redis.replication import Replication


#: When set and not empty, overrides ``[broker] url`` (so that secrets stay out of files).
ENV_BROKER_URL = "QUEUE_BROKER_URL"
#: The TLS keys of [broker] that name files (relative paths: to the job file's folder).
TLS_FILE_KEYS = ("tls_ca", "tls_cert", "tls_key")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
#: Old ``[job]`` names still read, with a deprecation warning: old name -> new name.
LEGACY_KEYS = {"maxCoroutines": "coroutines", "batch": "prefetch"}
#: Keys no longer used, accepted with a warning that says why: (section, name) -> reason.
RETIRED_KEYS = {
    ("nats", "max_deliver"): (
        "the attempt budget is read from the consumer (queue 5's MaxDeliver and spare "
        "delivery); a consumer the supervisor creates gets MaxDeliver = [job] max_attempts + 1"
    ),
}
#: The most one handler ring may take (ring_slot_size * ring_slots): half a ring is the
#: largest envelope it carries, and no broker keeps a message above 512 MiB (Redis's string
#: limit; NATS's max_payload is at most 64 MiB), so a larger ring only holds memory.
MAX_RING_BYTES = 2**30


# --- rules of single keys ------------------------------------------------------------------


ZERO_OR_AT_LEAST_1024 = Rule(
    "0 or >= 1024",
    lambda value: None if value == 0 or value >= 1024 else "must be 0 (no limit) or >= 1024",
)
BROKER_URL = Rule("redis:// rediss:// nats:// tls://", url_problem)
# Where the file is and what it holds is checked once the job file's folder is known
# (relative paths are relative to it): see _tls_files_usable.
PEM_FILE = Rule("a file path, relative to the job file's folder; empty: none",
               lambda value: None)


def handler_problem(spec: str) -> str | None:
    try:
        handler_paths.split(spec)
    except handler_paths.HandlerError as error:
        return str(error)
    return None


HANDLER_SPEC = Rule('"pkg.mod:func" or "pkg.mod.func"', handler_problem)


#: An async handler's call is cancelled at handler_timeout; one still running this much later
#: (it blocks its event loop, or ignores the cancellation) is killed with its process.
CANCEL_GRACE = 2.0


# --- the sections ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BrokerConfig:
    url: str = setting(
        "redis://127.0.0.1:6379/0",
        f"broker URL: redis://, rediss:// (TLS), nats://, tls:// (TLS); {ENV_BROKER_URL} "
        "overrides. Several comma-separated: the servers of a NATS cluster, or seed nodes "
        "of a Redis Cluster (any one reachable at start is enough)",
        BROKER_URL,
    )
    namespace: str = setting(
        "utopia-queue",
        "prefix of every Redis key ({ns}.queue.{q}); on a Cluster it needs a {hash tag}",
        NOT_EMPTY,
        NO_SPACES,
    )
    cluster: bool = setting(False, "true: the Redis URL is a Redis Cluster node")
    block_timeout: float = setting(
        2.0, "longest a receive blocks on an idle queue (s)", above(0), at_most(60)
    )
    wait_replicas: int = setting(
        0, "Redis replicas that must confirm a write before it counts (WAIT): publishes, the "
        "registration before a blocking receive, claims and settlements; 0 = none "
        "(replication stays asynchronous: a failover can take back the last writes)",
        at_least(0), at_most(16),
    )
    wait_timeout: float = setting(
        1.0, "longest a write waits for wait_replicas (s); a publish not confirmed by then "
        "fails (publish again), a consumer's write is logged and counted", above(0),
        at_most(60),
    )
    tls_ca: str = setting(
        "", "PEM file of the CA certificates that sign the broker's certificate, trusted "
        "besides the system's; empty: the system's only", PEM_FILE,
    )
    tls_cert: str = setting(
        "", "PEM file of this client's certificate, for servers that require one (mutual "
        "TLS); needs tls_key", PEM_FILE,
    )
    tls_key: str = setting(
        "", "PEM file of the private key of tls_cert (not encrypted; keep it mode 0600)",
        PEM_FILE,
    )
    tls_verify_hostname: bool = setting(
        True, "the broker's certificate must name the URL's host; false is UNSAFE: any "
        "certificate the CA signed is accepted, so its holder can pose as the broker",
    )

    @property
    def kind(self) -> str:
        """``"redis"`` or ``"nats"``: which broker adapter serves this URL."""
        return broker_kind(self.url)

    @property
    def tls(self) -> TlsSettings:
        return TlsSettings(self.tls_ca, self.tls_cert, self.tls_key, self.tls_verify_hostname)

    @property
    def replication(self) -> Replication:
        # Here, not at the top: it loads redis-py, which a NATS job never needs.
        from broker.redis.replication import Replication

        return Replication(self.wait_replicas, self.wait_timeout)

    @property
    def safe_url(self) -> str:
        """The URL with its password or token hidden, for logs and messages."""
        return redact(self.url)

    def __repr__(self) -> str:
        return (
            f"BrokerConfig(url={self.safe_url!r}, namespace={self.namespace!r}, "
            f"cluster={self.cluster!r}, block_timeout={self.block_timeout!r}, "
            f"wait_replicas={self.wait_replicas!r}, wait_timeout={self.wait_timeout!r}, "
            f"tls_ca={self.tls_ca!r}, tls_cert={self.tls_cert!r}, tls_key={self.tls_key!r}, "
            f"tls_verify_hostname={self.tls_verify_hostname!r})"
        )


@dataclass(frozen=True, slots=True)
class JobConfig:
    queue: str = setting(REQUIRED, "queue name (the {q} of the Redis keys)", NOT_EMPTY, NO_SPACES)
    handler: str = setting(REQUIRED, "handler function, imported before forking", HANDLER_SPEC)
    coroutines: int = setting(
        1, "handler processes (forked); each runs one delivery at a time, or tasks_per_process "
        "with an async def handler", at_least(1), at_most(1024)
    )
    tasks_per_process: int = setting(
        1, "deliveries one handler process runs at once; above 1 only for an async def "
        "handler (one event loop per process): coroutines * tasks_per_process in all",
        at_least(1), at_most(10000),
    )
    prefetch: int = setting(
        None,
        "bound on unacknowledged deliveries: buffered + running + awaiting confirmation",
        at_least(1),
        same_as="coroutines * tasks_per_process",
    )
    max_attempts: int = setting(
        3, "runs before a job goes to failed (Redis) or dead (NATS: the budget of a consumer "
        "the supervisor creates; an existing consumer's own budget wins)", at_least(1)
    )
    job_ttl: int = setting(
        0, "seconds a failed/dead payload and its failure record are kept; 0 = the payload "
        f"forever, the record {RECORD_TTL_WITHOUT_JOB_TTL // 86_400} days", at_least(0),
        at_most(MAX_TTL),
    )
    handler_timeout: float = setting(
        0.0, "hard limit of one handler call (s); 0 = none. An async handler's call is "
        f"cancelled then, and its process killed if it has not ended {CANCEL_GRACE:g} s later",
        at_least(0)
    )
    slow_job_after: float = setting(
        60.0, "a job running longer than this (s) is logged as a warning, again each time "
        "its run time doubles (at least hourly); 0 = never. status, the dashboard and the "
        "metrics mark it too", at_least(0), at_most(MAX_TTL),
    )
    max_jobs_per_process: int = setting(
        0, "recycle a handler process after this many jobs; 0 = never", at_least(0)
    )
    max_rss_mb: int = setting(
        0, "recycle a handler process above this resident memory (MiB); 0 = no limit", at_least(0)
    )
    flush_every: int = setting(
        100, "call the handler's flush() at least every this many messages", at_least(1)
    )
    retry_backoff: float = setting(
        0.0, "base delay before a failed job is retried (s), doubling per run up to "
        "retry_backoff_max; 0 = at once (Redis: queue 5's immediate requeue). Redis waits "
        "between half and all of it (jitter); on NATS a consumer's own backoff list wins",
        at_least(0), at_most(MAX_TTL),
    )
    retry_backoff_max: float = setting(
        BACKOFF_MAX, "the longest a retry waits (s), however often the job failed",
        above(0), at_most(MAX_TTL),
    )

    def __post_init__(self) -> None:
        fill_same_as(self, lambda name: getattr(self, name))


@dataclass(frozen=True, slots=True)
class SupervisorConfig:
    shutdown_deadline: float = setting(
        30.0, "seconds a graceful stop may take before running handlers are killed", above(0)
    )
    lease: float = setting(
        30.0, "claim lease (s): a delivery not renewed for this long is recovered; renewed "
        "every lease/3 (whole seconds on Redis)", at_least(3), at_most(MAX_TTL),
    )
    maintenance_interval: float = setting(
        5.0, "seconds between recovery sweeps (on Redis the expiry of the fleet's reap lock, "
        "shared with PHP workers)", above(0),
    )
    progress_interval: float = setting(
        60.0, "seconds between progress lines in the log (rate, counts, outstanding, age of "
        "the oldest ready message); 0 = none", at_least(0),
    )
    recovery_age: int = setting(
        90000,
        "publish age (s) after which a delivery whose claim lapsed is recovered unless its "
        "owner is one of our supervisors (queue 5's reapAfter: a queue-5 worker that never "
        "renews may still run it)",
        at_least(1),
    )
    ring_slot_size: int = setting(
        256, "bytes per ring slot; larger payloads span several slots", at_least(64), multiple_of(8)
    )
    ring_slots: int = setting(8192, "slots per ring", at_least(2))
    max_envelope_bytes: int = setting(
        0,
        "larger envelopes are malformed and go to poison; 0 = no limit of its own, as in PHP "
        "(one must still fit half a ring: ring_slot_size * ring_slots / 2, less 22 bytes)",
        ZERO_OR_AT_LEAST_1024,
    )
    log_level: str = setting("info", "least severe level logged", one_of(LOG_LEVELS))
    metrics_port: int = setting(
        0, "port of /metrics (Prometheus), /healthz and /readyz; 0 = off", at_least(0),
        at_most(65535),
    )
    metrics_host: str = setting(
        "127.0.0.1", "address /metrics, /healthz and /readyz bind to", NOT_EMPTY, NO_SPACES
    )

    def envelope_limit(self) -> int:
        """The size above which an envelope is malformed: ``max_envelope_bytes``, or when
        that is 0, the largest a DELIVER record in half a ring carries. Larger ones could not
        be handed to a handler at all (or only after its ring drained completely)."""
        if self.max_envelope_bytes:
            return self.max_envelope_bytes
        half_ring = self.ring_slots // 2 * self.ring_slot_size
        return half_ring - Ring.RECORD_HEADER - DELIVER_OVERHEAD


@dataclass(frozen=True, slots=True)
class NatsConfig:
    ack_wait: float = setting(
        30.0, "AckWait (s) of a consumer the supervisor creates (an existing one keeps its "
        "own): redelivery after this long without ack or renewal", above(0)
    )
    replicas: int = setting(
        1, "copies of each message (num_replicas) of the streams the supervisor creates, "
        "one per server of a JetStream cluster (an existing stream keeps its own)",
        at_least(1), at_most(5),
    )


SECTIONS: dict[str, type] = {
    "broker": BrokerConfig,
    "job": JobConfig,
    "supervisor": SupervisorConfig,
    "nats": NatsConfig,
}


@dataclass(frozen=True, slots=True)
class Config:
    """One job's configuration; ``warnings`` holds deprecation notices for the log."""

    job: JobConfig
    broker: BrokerConfig = field(default_factory=BrokerConfig)
    supervisor: SupervisorConfig = field(default_factory=SupervisorConfig)
    nats: NatsConfig = field(default_factory=NatsConfig)
    path: str = "<memory>"
    warnings: tuple[str, ...] = ()
    #: ``[job] handler`` as ``load`` imported it to check it (None: not imported, as asked;
    #: the supervisor asks so: its handler servers import it, see worker.forkserver).
    handler: Handler | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        def lookup(dotted: str) -> Any:
            section, _, name = dotted.partition(".")
            return getattr(getattr(self, section), name)

        for section in SECTIONS:
            filled = fill_same_as(getattr(self, section), lookup, copy=True)
            object.__setattr__(self, section, filled)


# --- the key table ---------------------------------------------------------------------------


#: Every key, in file order: the one table that validation and documentation share.
KEYS: tuple[Key, ...] = keys_of(SECTIONS)


# --- loading ---------------------------------------------------------------------------------


def load(
    path: str | os.PathLike[str],
    environ: Mapping[str, str] = os.environ,
    import_handler: bool = True,
) -> Config:
    """Read, validate and return the job configuration in ``path``; raises ConfigError."""
    text = read_text(path)
    return loads(text, str(path), environ, import_handler, directory=Path(path).parent)


def loads(
    text: str,
    path: str = "<string>",
    environ: Mapping[str, str] = os.environ,
    import_handler: bool = True,
    directory: str | os.PathLike[str] = ".",
) -> Config:
    """Like ``load`` for TOML text already read; ``path`` names it in messages, relative
    file paths (the TLS keys) are relative to ``directory`` (``load``: the file's folder)."""
    values = _JobFile(path)
    values.read(parse_toml(text, path))
    values.resolve_files(Path(directory))
    values.override_url(environ)
    values.cross_check(CROSS_CHECKS)
    handler = values.import_handler() if import_handler else None
    for message in values.warnings:  # only for a file that loads: an error comes first
        warnings.warn(message, DeprecationWarning, stacklevel=2)
    return values.build(handler)


class _JobFile(Values):
    """The values of one job file: its keys, the names it still reads, and what it asks
    for beyond its values (files, the environment, the handler)."""

    def __init__(self, path: str) -> None:
        super().__init__(path, KEYS)

    def adapt(self, section: str, table: dict[str, Any]) -> None:
        if section == "job":
            self.map_legacy(table)
        for (retired_section, name), reason in RETIRED_KEYS.items():
            if retired_section == section and table.pop(name, None) is not None:
                self.warnings.append(
                    f"{self.path}: [{section}] {name} is no longer used and is ignored: "
                    f"{reason}; remove it")

    def old_names(self, section: str) -> list[str]:
        return list(LEGACY_KEYS) if section == "job" else []

    def map_legacy(self, table: dict[str, Any]) -> None:
        """Read ``maxCoroutines`` as coroutines, ``batch`` as prefetch = max(batch, coroutines)."""
        for old, new in LEGACY_KEYS.items():
            if old in table and new in table:
                self.fail(f"[job] sets both {old} (deprecated) and {new}; keep only {new}")
            if old in table:
                self.validated(_LEGACY_KEY, table[old], f"[job] {old}")
                self.labels[("job", new)] = f"[job] {old}"
        if "maxCoroutines" in table:
            table["coroutines"] = table.pop("maxCoroutines")
            self.deprecate("maxCoroutines", f"coroutines = {table['coroutines']}")
        if "batch" in table:
            coroutines = table.get("coroutines", 1)
            self.validated(self.key("job.coroutines"), coroutines, self.label("job", "coroutines"))
            table["prefetch"] = max(table.pop("batch"), coroutines)
            self.deprecate("batch", f"prefetch = {table['prefetch']} (max of batch and coroutines)")

    def deprecate(self, old: str, replacement: str) -> None:
        self.warnings.append(f"{self.path}: [job] {old} is deprecated; write {replacement}")

    def resolve_files(self, directory: Path) -> None:
        """Make file paths absolute, relative ones from ``directory``: the supervisor and
        the operator commands then find the same files from any working directory."""
        broker = self.by_section["broker"]
        for name in TLS_FILE_KEYS:
            if broker[name]:
                broker[name] = str(directory.absolute() / Path(broker[name]).expanduser())

    def override_url(self, environ: Mapping[str, str]) -> None:
        url = environ.get(ENV_BROKER_URL, "")
        if not url:
            return
        problem = url_problem(url)
        if problem:
            self.fail(f"{ENV_BROKER_URL} = {show(url)} (overrides [broker] url) {problem}")
        self.by_section["broker"]["url"] = url
        self.labels[("broker", "url")] = ENV_BROKER_URL

    def import_handler(self) -> Handler:
        spec = self["job.handler"]
        try:
            handler = handler_paths.load(spec)
        except handler_paths.HandlerError as error:
            self.fail(f"[job] {error}")
        problem = tasks_problem(self["job.tasks_per_process"], spec, handler.is_async,
                                self.label("job", "tasks_per_process"))
        if problem:
            self.fail(problem)
        return handler

    def build(self, handler: Handler | None = None) -> Config:
        sections = {name: SECTIONS[name](**values) for name, values in self.by_section.items()}
        return Config(**sections, path=self.path, warnings=tuple(self.warnings), handler=handler)


def tasks_problem(tasks: int, spec: str, is_async: bool,
                  label: str = "[job] tasks_per_process") -> str | None:
    """Why the handler cannot run ``tasks`` deliveries at once in each process."""
    if tasks > 1 and not is_async:
        return (f'{label} = {tasks} needs an async def handler; "{spec}" is a plain def, one '
                "delivery at a time per process (raise coroutines instead, or make it async def)")
    return None


# The legacy keys are validated as the integers they always were.
_LEGACY_KEY = Key("job", "legacy", int, 1, None, (at_least(1),), "")


# --- rules that involve several keys ---------------------------------------------------------


def _prefetch_covers_coroutines(values: Values) -> str | None:
    prefetch, coroutines = values["job.prefetch"], values["job.coroutines"]
    tasks = values["job.tasks_per_process"]
    if prefetch >= coroutines * tasks:
        return None
    if tasks == 1:
        return (
            f"{values.label('job', 'prefetch')} = {prefetch} is below coroutines = "
            f"{coroutines}; prefetch bounds all unacknowledged deliveries, so it must be "
            ">= coroutines"
        )
    return (
        f"{values.label('job', 'prefetch')} = {prefetch} is below coroutines * "
        f"tasks_per_process = {coroutines} * {tasks} = {coroutines * tasks}; prefetch bounds "
        "all unacknowledged deliveries, so it must cover every task of every process"
    )


def _ring_holds_two_envelopes(values: Values) -> str | None:
    size, slots = values["supervisor.ring_slot_size"], values["supervisor.ring_slots"]
    largest = values["supervisor.max_envelope_bytes"]
    if size * slots >= 2 * largest:  # 0: no limit of its own, the ring sets it
        return None
    return (
        f"[supervisor] ring_slot_size * ring_slots = {size} * {slots} = {size * slots} bytes is "
        f"below 2 * max_envelope_bytes = {2 * largest}; a ring must hold two of the largest "
        "envelopes"
    )


def _ring_is_at_most_a_gib(values: Values) -> str | None:
    size, slots = values["supervisor.ring_slot_size"], values["supervisor.ring_slots"]
    if size * slots <= MAX_RING_BYTES:
        return None
    return (
        f"[supervisor] ring_slot_size * ring_slots = {size} * {slots} = {size * slots} bytes is "
        f"above {MAX_RING_BYTES} (1 GiB): half a ring is the largest envelope, and no broker "
        "keeps a message above 512 MiB; every handler process has two rings of this size"
    )


def _cluster_is_redis(values: Values) -> str | None:
    url = values["broker.url"]
    if not values["broker.cluster"] or broker_kind(url) == "redis":
        return None
    return (
        f"[broker] cluster = true means Redis Cluster, but {values.label('broker', 'url')} = "
        f"{show(url)} is a NATS URL"
    )


def _cluster_namespace_has_hash_tag(values: Values) -> str | None:
    namespace = values["broker.namespace"]
    if not values["broker.cluster"] or hash_tag(namespace):
        return None
    return (
        f"[broker] cluster = true needs a hash tag in namespace = {show(namespace)} so that "
        f'all keys of a queue share one slot, e.g. namespace = "{{{namespace}}}" '
        "(a new namespace means new key names: move existing jobs first)"
    )


def _seed_list_needs_cluster(values: Values) -> str | None:
    url = values["broker.url"]
    count = len(split_servers(url))
    if count == 1 or broker_kind(url) == "nats":
        return None
    label = values.label("broker", "url")
    if values["broker.cluster"]:
        return None
    return (
        f"{label} lists {count} Redis URLs, which are the seed nodes of a Redis Cluster; "
        "set [broker] cluster = true, or give one URL"
    )


def _wait_replicas_needs_redis(values: Values) -> str | None:
    replicas = values["broker.wait_replicas"]
    if not replicas or broker_kind(values["broker.url"]) == "redis":
        return None
    return (
        f"[broker] wait_replicas = {replicas} works on Redis only (WAIT); JetStream "
        "confirms a publish or an ack once its stream's replicas have it"
    )


def _backoff_below_recovery_age(values: Values) -> str | None:
    """Issue 39.1: a retry must become ready well before queue 5's publish-age gate could
    take it from a worker that never renews (promote.lua stamps it when it becomes ready;
    this bounds what a retry can cost that gate if anything ever moves it unstamped)."""
    backoff, cap = values["job.retry_backoff"], values["job.retry_backoff_max"]
    age = values["supervisor.recovery_age"]
    if not backoff or cap < age or broker_kind(values["broker.url"]) != "redis":
        return None
    return (
        f"{values.label('job', 'retry_backoff_max')} = {show(cap)} reaches "
        f"{values.label('supervisor', 'recovery_age')} = {show(age)}; a retry waits up to "
        "retry_backoff_max, and recovery_age is queue 5's reapAfter, the publish age past "
        "which a sweep takes a delivery from a worker that never renews: set "
        "retry_backoff_max below recovery_age"
    )


def _ack_wait_covers_renewal(values: Values) -> str | None:
    ack_wait, lease = values["nats.ack_wait"], values["supervisor.lease"]
    if broker_kind(values["broker.url"]) != "nats" or ack_wait >= 2 * lease / 3:
        return None
    return (
        f"[nats] ack_wait = {show(ack_wait)} is below 2/3 of [supervisor] lease = "
        f"{show(lease)}; deliveries are renewed every lease/3, so ack_wait must span two "
        "renewals"
    )


def _tls_keys_need_tls_url(values: Values) -> str | None:
    url = values["broker.url"]
    if urlsplit(url).scheme != "redis":
        return None  # rediss:// is TLS; on NATS the keys make nats:// require TLS
    tls = _tls_of(values)
    if not tls.configured:
        return None
    first = next(name for name in (*TLS_FILE_KEYS, "tls_verify_hostname")
                 if values[f"broker.{name}"] != values.key(f"broker.{name}").default)
    return (
        f"[broker] {first} is a TLS setting but {values.label('broker', 'url')} = "
        f"{show(url)} is plain TCP; write rediss:// to connect with TLS"
    )


def _tls_cert_with_key(values: Values) -> str | None:
    cert, key = values["broker.tls_cert"], values["broker.tls_key"]
    if bool(cert) == bool(key):
        return None
    given, missing = ("tls_cert", "tls_key") if cert else ("tls_key", "tls_cert")
    return f"[broker] {given} is set without {missing}: mutual TLS needs both"


def _tls_files_usable(values: Values) -> str | None:
    try:
        check_files(_tls_of(values))
    except TlsFileError as error:
        name = f"tls_{error.field}"
        return f"[broker] {name} = {show(values[f'broker.{name}'])} {error.problem}"
    return None


def _tls_of(values: Values) -> TlsSettings:
    return TlsSettings(values["broker.tls_ca"], values["broker.tls_cert"],
                       values["broker.tls_key"], values["broker.tls_verify_hostname"])


CROSS_CHECKS: tuple[CrossCheck, ...] = (
    CrossCheck("`[job] prefetch` >= `[job] coroutines * [job] tasks_per_process`",
               _prefetch_covers_coroutines),
    CrossCheck(
        "`ring_slot_size * ring_slots` >= `2 * max_envelope_bytes`", _ring_holds_two_envelopes
    ),
    CrossCheck("`ring_slot_size * ring_slots` <= 1 GiB (2 rings per handler process)",
               _ring_is_at_most_a_gib),
    CrossCheck("`cluster = true` only with a redis:// or rediss:// URL", _cluster_is_redis),
    CrossCheck(
        "`cluster = true` needs a `{hash tag}` in the namespace", _cluster_namespace_has_hash_tag
    ),
    CrossCheck(
        "with a NATS URL, `[nats] ack_wait` >= `2/3 * [supervisor] lease`", _ack_wait_covers_renewal
    ),
    CrossCheck("with a Redis URL and `[job] retry_backoff` > 0, `[job] retry_backoff_max` < "
               "`[supervisor] recovery_age`", _backoff_below_recovery_age),
    CrossCheck("several comma-separated Redis URLs only for a Redis Cluster (`cluster = true`)",
               _seed_list_needs_cluster),
    CrossCheck("`[broker] wait_replicas` > 0 only with a Redis URL", _wait_replicas_needs_redis),
    CrossCheck(
        "`[broker] tls_*` keys with a Redis URL need rediss:// (with redis:// they are an "
        "error, not an upgrade), with a NATS URL they make TLS required (for nats:// too)",
        _tls_keys_need_tls_url,
    ),
    CrossCheck("`tls_cert` and `tls_key` are set together", _tls_cert_with_key),
    CrossCheck(
        "every TLS file set is a readable PEM file (the key unencrypted and matching the "
        "certificate)", _tls_files_usable,
    ),
)


# --- documentation ---------------------------------------------------------------------------


def describe() -> str:
    """Every key as a markdown table, then the rules that involve several keys."""
    lines = [
        *key_table(KEYS),
        "",
        "Rules across keys: " + "; ".join(rule.doc for rule in CROSS_CHECKS) + ".",
        "",
        "Legacy `[job]` keys are still read, with a deprecation warning: `maxCoroutines` as "
        "`coroutines`, `batch` as `prefetch = max(batch, coroutines)`. Setting both a legacy "
        "key and its new name is an error, as is any unknown key.",
        *(f"`[{section}] {name}` is no longer used: it is ignored with a warning ({reason})."
          for (section, name), reason in RETIRED_KEYS.items()),
        f"`{ENV_BROKER_URL}`, when set and not empty, overrides `[broker] url`.",
    ]
    return "\n".join(lines) + "\n"
