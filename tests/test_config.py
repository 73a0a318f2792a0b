"""The job configuration: defaults, legacy keys, the environment, and every kind of error.

Each error must be one line that names the file and the key, so that an operator can fix
the file from the message alone.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from supervisor import config
from supervisor.config import Config, ConfigError, load
from support.configs import MINIMAL, error_of, load_text, with_job, write
from worker.handler import resolve as resolve_handler

REPO = Path(__file__).resolve().parent.parent
# --- defaults and values ---------------------------------------------------------------------


def test_defaults(tmp_path):
    loaded = load_text(tmp_path, MINIMAL)
    assert loaded.path == str(tmp_path / "job.toml")
    assert loaded.warnings == ()
    assert loaded.broker.url == "redis://127.0.0.1:6379/0"
    assert loaded.broker.namespace == "utopia-queue"
    assert loaded.broker.cluster is False
    assert loaded.broker.block_timeout == 2.0
    assert loaded.broker.kind == "redis"
    job = loaded.job
    assert (job.queue, job.handler) == ("stats-usage", "examples.noop:handle")
    assert (job.coroutines, job.prefetch, job.max_attempts, job.job_ttl) == (1, 1, 3, 0)
    assert (job.handler_timeout, job.max_jobs_per_process, job.max_rss_mb) == (0, 0, 0)
    assert (job.flush_every, job.retry_backoff) == (100, 0.0)
    sup = loaded.supervisor
    assert (sup.shutdown_deadline, sup.lease, sup.maintenance_interval) == (30, 30, 5)
    assert (sup.recovery_age, sup.ring_slot_size, sup.ring_slots) == (90000, 256, 8192)
    assert (sup.max_envelope_bytes, sup.log_level) == (0, "info")
    # 0: no limit of its own, as in PHP; what half a ring carries is still the most.
    assert sup.envelope_limit() == 8192 // 2 * 256 - 4 - 18
    assert loaded.nats.ack_wait == 30


def test_derived_defaults_follow_their_source(tmp_path):
    loaded = load_text(tmp_path, with_job("coroutines = 4\nmax_attempts = 7\n"))
    assert loaded.job.prefetch == 4


def test_seconds_accept_int_and_float(tmp_path):
    loaded = load_text(
        tmp_path, with_job("lease = 4.5\nshutdown_deadline = 10\n", section="supervisor")
    )
    assert loaded.supervisor.lease == 4.5
    assert loaded.supervisor.shutdown_deadline == 10.0
    assert isinstance(loaded.supervisor.shutdown_deadline, float)


def test_config_is_frozen(tmp_path):
    loaded = load_text(tmp_path, MINIMAL)
    with pytest.raises(dataclasses.FrozenInstanceError):
        loaded.job.prefetch = 5  # type: ignore[misc]


def test_sections_built_in_code_fill_their_derived_defaults():
    job = config.JobConfig(queue="q", handler="m:f", coroutines=3, max_attempts=5)
    assert job.prefetch == 3
    assert Config(job=job).nats.ack_wait == 30


def test_the_quick_start_config_loads():
    loaded = load(REPO / "conf" / "stats-usage.toml", environ={})
    assert loaded.broker.url == "redis://127.0.0.1:6379/0"
    assert loaded.broker.namespace == "utopia-queue"
    assert loaded.job.queue == "stats-usage"
    assert loaded.job.handler == "examples.stats_usage:handle"
    assert (loaded.job.coroutines, loaded.job.prefetch) == (1, 100)
    # It writes the supervisor defaults out: they must not drift from the declarations.
    assert loaded.supervisor == config.SupervisorConfig()


def test_describe_lists_every_key():
    table = config.describe()
    for key in config.KEYS:
        assert f"`[{key.section}] {key.name}`" in table
    assert "maxCoroutines" in table and config.ENV_BROKER_URL in table


# --- legacy keys -----------------------------------------------------------------------------


def test_legacy_keys_are_mapped_with_a_warning(tmp_path):
    text = with_job("maxCoroutines = 4\nbatch = 10\n")
    with pytest.warns(DeprecationWarning, match="is deprecated") as caught:
        loaded = load_text(tmp_path, text)
    assert (loaded.job.coroutines, loaded.job.prefetch) == (4, 10)
    assert len(loaded.warnings) == 2
    assert [str(warning.message) for warning in caught] == list(loaded.warnings)
    path = str(tmp_path / "job.toml")
    assert loaded.warnings[0].startswith(f"{path}: [job] maxCoroutines is deprecated")
    assert "coroutines = 4" in loaded.warnings[0]
    assert loaded.warnings[1].startswith(f"{path}: [job] batch is deprecated")
    assert "prefetch = 10" in loaded.warnings[1]


@pytest.mark.parametrize(
    ("lines", "prefetch"),
    [
        ("batch = 2\nmaxCoroutines = 8\n", 8),  # a batch below the handler count
        ("batch = 2\ncoroutines = 8\n", 8),  # the new name counts too
        ("batch = 20\n", 20),  # coroutines defaults to 1
    ],
)
def test_batch_becomes_the_larger_of_batch_and_coroutines(tmp_path, lines, prefetch):
    with pytest.warns(DeprecationWarning, match="is deprecated"):
        loaded = load_text(tmp_path, with_job(lines))
    assert loaded.job.prefetch == prefetch


@pytest.mark.parametrize(
    ("lines", "keys"),
    [
        ("maxCoroutines = 2\ncoroutines = 2\n", ("maxCoroutines", "coroutines")),
        ("batch = 10\nprefetch = 10\n", ("batch", "prefetch")),
    ],
)
def test_legacy_and_new_name_together_is_an_error(tmp_path, lines, keys):
    message = error_of(tmp_path, with_job(lines))
    assert all(key in message for key in keys)


def test_legacy_values_are_type_checked(tmp_path):
    message = error_of(tmp_path, with_job("batch = true\n"))
    assert "[job] batch = true" in message and "integer" in message
    message = error_of(tmp_path, with_job("maxCoroutines = 0\n"))
    assert "[job] maxCoroutines = 0" in message


def test_a_legacy_value_out_of_range_is_named_by_its_old_key(tmp_path, recwarn):
    message = error_of(tmp_path, with_job("maxCoroutines = 5000\n"))
    assert "[job] maxCoroutines = 5000 must be <= 1024" in message
    assert not recwarn.list  # no deprecation notice for a file that does not load


# --- environment -----------------------------------------------------------------------------


def test_environment_overrides_the_broker_url(tmp_path):
    environ = {"QUEUE_BROKER_URL": "nats://user:secret@nats.internal:4222"}
    loaded = load_text(tmp_path, MINIMAL, environ=environ)
    assert loaded.broker.url == "nats://user:secret@nats.internal:4222"
    assert loaded.broker.kind == "nats"
    assert "secret" not in repr(loaded)


def test_an_empty_environment_variable_is_ignored(tmp_path):
    loaded = load_text(tmp_path, MINIMAL, environ={"QUEUE_BROKER_URL": ""})
    assert loaded.broker.url == "redis://127.0.0.1:6379/0"


def test_a_bad_environment_url_names_the_variable_and_hides_the_password(tmp_path):
    environ = {"QUEUE_BROKER_URL": "http://user:secret@host:1"}
    message = error_of(tmp_path, MINIMAL, environ=environ)
    assert "QUEUE_BROKER_URL" in message and "[broker] url" in message
    assert '"http"' in message and "secret" not in message


def test_cluster_with_a_nats_url_from_the_environment_names_the_variable(tmp_path):
    text = MINIMAL + '[broker]\ncluster = true\nnamespace = "{utopia-queue}"\n'
    message = error_of(tmp_path, text, environ={"QUEUE_BROKER_URL": "nats://127.0.0.1:4222"})
    assert "[broker] cluster" in message and "QUEUE_BROKER_URL" in message


# --- errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (with_job("prefech = 4\n"), ["[job] prefech", "did you mean prefetch"]),
        (with_job("jobTtl = 60\n"), ["[job] jobTtl", "did you mean job_ttl"]),
        (with_job("lease = 30\n"), ["[job] lease", "belongs in [supervisor]"]),
        (with_job("urll = 'redis://h'\n", "broker"), ["[broker] urll", "did you mean url"]),
        (MINIMAL + "[jobs]\nqueue = 'x'\n", ["[jobs]", "did you mean [job]"]),
        (MINIMAL + "[worker]\n", ["unknown section [worker]"]),
        ("coroutines = 2\n" + MINIMAL, ["coroutines", "did you mean [job] coroutines"]),
        (MINIMAL.replace("[job]", "[[job]]"), ["job = ", "not a section"]),
    ],
)
def test_unknown_names_are_errors_with_a_suggestion(tmp_path, text, expected):
    message = error_of(tmp_path, text)
    for part in expected:
        assert part in message


@pytest.mark.parametrize(
    ("section", "line", "expected"),
    [
        ("job", "coroutines = true", "[job] coroutines = true is a boolean, expected an integer"),
        ("job", "coroutines = 2.0", "[job] coroutines = 2.0 is a float, expected an integer"),
        ("job", 'coroutines = "4"', '[job] coroutines = "4" is a string, expected an integer'),
        ("broker", "namespace = 5", "[broker] namespace = 5 is an integer, expected a string"),
        ("broker", "cluster = 1", "[broker] cluster = 1 is an integer, expected true or false"),
        ("supervisor", "lease = true", "[supervisor] lease = true is a boolean, expected a number"),
        ("supervisor", "lease = inf", "[supervisor] lease = inf is not a finite number"),
        ("supervisor", "log_level = [1]", "[supervisor] log_level = [1] is an array"),
        ("nats", "ack_wait = 1979-05-27", "[nats] ack_wait = "),
    ],
)
def test_wrong_types_are_errors(tmp_path, section, line, expected):
    assert expected in error_of(tmp_path, with_job(line + "\n", section))


@pytest.mark.parametrize(
    ("section", "line", "expected"),
    [
        ("job", "coroutines = 0", "[job] coroutines = 0 must be >= 1"),
        ("job", "max_attempts = 0", "[job] max_attempts = 0 must be >= 1"),
        ("job", "job_ttl = -1", "[job] job_ttl = -1 must be >= 0"),
        # Above what the scripts take (EXPIRE refuses about 9.2e15 s): issue 23.2.
        ("job", "job_ttl = 9300000000000000", "[job] job_ttl = 9300000000000000 must be <= "
         "2147483647"),
        ("supervisor", "lease = 1e16", "[supervisor] lease = 1e+16 must be <= 2147483647"),
        ("job", "flush_every = 0", "[job] flush_every = 0 must be >= 1"),
        ("job", "handler_timeout = -0.5", "[job] handler_timeout = -0.5 must be >= 0"),
        ("broker", 'namespace = ""', '[broker] namespace = "" must not be empty'),
        ("broker", 'namespace = "a b"', '[broker] namespace = "a b" must not contain spaces'),
        ("supervisor", "shutdown_deadline = 0", "[supervisor] shutdown_deadline = 0 must be > 0"),
        ("supervisor", "lease = 2.5", "[supervisor] lease = 2.5 must be >= 3"),
        ("supervisor", "ring_slot_size = 32", "[supervisor] ring_slot_size = 32 must be >= 64"),
        ("supervisor", "ring_slot_size = 100", "ring_slot_size = 100 must be a multiple of 8"),
        ("supervisor", 'log_level = "warn"', 'log_level = "warn" must be one of'),
        ("broker", "block_timeout = 0", "[broker] block_timeout = 0 must be > 0"),
    ],
)
def test_values_out_of_range_are_errors(tmp_path, section, line, expected):
    assert expected in error_of(tmp_path, with_job(line + "\n", section))


@pytest.mark.parametrize(("queue", "problem"), [("", "must not be empty"), ("a b", "spaces")])
def test_bad_queue_names_are_errors(tmp_path, queue, problem):
    message = error_of(tmp_path, MINIMAL.replace('"stats-usage"', f'"{queue}"'))
    assert f'[job] queue = "{queue}"' in message and problem in message


def test_log_level_suggests_the_closest_level(tmp_path):
    message = error_of(tmp_path, with_job('log_level = "warn"\n', "supervisor"))
    assert "did you mean warning" in message


def test_prefetch_below_coroutines_is_an_error(tmp_path):
    message = error_of(tmp_path, with_job("coroutines = 4\nprefetch = 1\n"))
    expected = (
        f"{tmp_path / 'job.toml'}: [job] prefetch = 1 is below coroutines = 4; prefetch bounds "
        "all unacknowledged deliveries, so it must be >= coroutines"
    )
    assert message == expected


def test_a_ring_too_small_for_two_envelopes_is_an_error(tmp_path):
    text = with_job(
        "ring_slot_size = 64\nring_slots = 1024\nmax_envelope_bytes = 524288\n", "supervisor"
    )
    message = error_of(tmp_path, text)
    for part in ("ring_slot_size", "ring_slots", "max_envelope_bytes", "65536", "1048576"):
        assert part in message


def test_a_ring_above_a_gib_is_an_error_that_says_why(tmp_path):
    message = error_of(tmp_path, with_job(f"ring_slots = {2**40}\n", "supervisor"))
    for part in ("ring_slot_size * ring_slots", str(2**40), "above 1073741824 (1 GiB)",
                 "largest envelope", "512 MiB"):
        assert part in message
    message = error_of(tmp_path, with_job(f"ring_slot_size = {2**33}\n", "supervisor"))
    assert "ring_slot_size * ring_slots" in message
    at_most = load_text(tmp_path, with_job(f"ring_slot_size = 64\nring_slots = {2**24}\n",
                                           "supervisor"))
    assert at_most.supervisor.ring_slot_size * at_most.supervisor.ring_slots == 2**30


def test_without_an_envelope_limit_half_the_ring_is_the_limit(tmp_path):
    text = with_job("ring_slot_size = 64\nring_slots = 1024\n", "supervisor")
    loaded = load_text(tmp_path, text)
    assert loaded.supervisor.envelope_limit() == 512 * 64 - 22
    explicit = load_text(tmp_path, with_job("max_envelope_bytes = 4096\n", "supervisor"))
    assert explicit.supervisor.envelope_limit() == 4096
    message = error_of(tmp_path, with_job("max_envelope_bytes = 10\n", "supervisor"))
    assert "must be 0 (no limit) or >= 1024" in message


@pytest.mark.parametrize("max_deliver", [-1, 3, 5])
def test_retired_max_deliver_is_ignored_with_a_warning_that_says_why(tmp_path, max_deliver):
    """Configs written for the old NATS protocol still load after an upgrade; the budget
    now comes from the consumer (queue 5's MaxDeliver and spare delivery)."""
    text = with_job("max_attempts = 5\n") + f"[nats]\nmax_deliver = {max_deliver}\n"
    with pytest.warns(DeprecationWarning, match="max_deliver is no longer used"):
        loaded = load_text(tmp_path, text,
                           environ={"QUEUE_BROKER_URL": "nats://127.0.0.1:4222"})
    assert loaded.job.max_attempts == 5
    [warning] = loaded.warnings
    assert "[nats] max_deliver is no longer used and is ignored" in warning
    assert "MaxDeliver = [job] max_attempts + 1" in warning and warning.endswith("remove it")


def test_ack_wait_must_span_two_renewals_with_nats_only(tmp_path):
    text = with_job("lease = 60\n", "supervisor") + "[nats]\nack_wait = 30\n"
    assert load_text(tmp_path, text).nats.ack_wait == 30  # Redis: [nats] is unused
    message = error_of(tmp_path, text, environ={"QUEUE_BROKER_URL": "nats://127.0.0.1:4222"})
    assert "[nats] ack_wait = 30.0" in message and "[supervisor] lease = 60.0" in message


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("http://127.0.0.1:6379", 'scheme "http"'),
        ("127.0.0.1:6379", "is not a URL"),
        ("redis://", "names no host"),
        ("redis://:6379/0", "names no host"),
        ("redis://127.0.0.1:port/0", "is not a valid URL"),
        ("redis://127.0.0.1:6379/cache", 'database "cache"'),
        ("nats://", "names no host"),
    ],
)
def test_bad_urls_are_errors(tmp_path, url, expected):
    message = error_of(tmp_path, with_job(f'url = "{url}"\n', "broker"))
    assert "[broker] url = " in message and expected in message


@pytest.mark.parametrize(
    "url", ["redis://h", "rediss://u:p@h:6380/2", "nats://h:4222", "tls://token@h:4222"]
)
def test_good_urls_load(tmp_path, url):
    assert load_text(tmp_path, with_job(f'url = "{url}"\n', "broker")).broker.url == url


def test_a_url_password_never_appears_in_an_error(tmp_path):
    message = error_of(tmp_path, with_job('url = "redis://:hunter2@h:6379/x"\n', "broker"))
    assert "hunter2" not in message and "***" in message


def test_cluster_with_a_nats_url_is_an_error(tmp_path):
    text = with_job('url = "nats://h:4222"\ncluster = true\nnamespace = "{q}"\n', "broker")
    message = error_of(tmp_path, text)
    assert "[broker] cluster = true" in message and "[broker] url" in message


def test_cluster_needs_a_hash_tag_in_the_namespace(tmp_path):
    message = error_of(tmp_path, with_job("cluster = true\n", "broker"))
    assert "[broker] cluster = true" in message and "namespace" in message
    assert '"{utopia-queue}"' in message
    text = with_job('cluster = true\nnamespace = "{utopia-queue}"\n', "broker")
    assert load_text(tmp_path, text).broker.cluster is True


@pytest.mark.parametrize("missing", ["queue", "handler"])
def test_missing_required_keys_are_errors(tmp_path, missing):
    text = "\n".join(line for line in MINIMAL.splitlines() if not line.startswith(missing))
    assert f"missing required key [job] {missing}" in error_of(tmp_path, text)


def test_an_empty_file_misses_the_job(tmp_path):
    assert "missing required key [job] queue" in error_of(tmp_path, "")


def test_a_toml_syntax_error_names_the_line(tmp_path):
    message = error_of(tmp_path, MINIMAL + "coroutines 4\n")
    assert "invalid TOML" in message and "line 5" in message


def test_a_missing_file_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match=r"nope\.toml: cannot read the file: No such file"):
        load(tmp_path / "nope.toml", environ={})


def test_a_directory_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match=r"cannot read the file"):
        load(tmp_path, environ={})


def test_a_file_that_is_not_utf8_is_an_error(tmp_path):
    path = tmp_path / "job.toml"
    path.write_bytes(b'[job]\nqueue = "\xff"\n')
    with pytest.raises(ConfigError, match=r"job\.toml: not UTF-8"):
        load(path, environ={})


# --- handlers --------------------------------------------------------------------------------


@pytest.fixture
def handler_modules(tmp_path, monkeypatch):
    """A package of handler modules on sys.path: good, broken and not callable."""
    package = tmp_path / "handlers_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "good.py").write_text("def handle(message):\n    pass\nvalue = 3\n")
    (package / "broken.py").write_text("raise RuntimeError('no database\\nconfigured')\n")
    (package / "syntax.py").write_text("def handle(:\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "handlers_pkg"
    for name in [name for name in sys.modules if name.startswith("handlers_pkg")]:
        del sys.modules[name]


@pytest.mark.parametrize("spec", ["handlers_pkg.good:handle", "handlers_pkg.good.handle"])
def test_resolve_handler_accepts_both_forms(handler_modules, spec):
    assert resolve_handler(spec).__name__ == "handle"


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("handlers_pkg.missing:handle", "cannot be imported: ModuleNotFoundError: No module"),
        ("handlers_pkg.broken:handle", "RuntimeError: no database configured"),
        ("handlers_pkg.syntax:handle", "cannot be imported: SyntaxError"),
        ("handlers_pkg.good:nothing", "has no attribute nothing"),
        ("handlers_pkg.good:value", "is a int, not a callable"),
        ("handle", "is not of the form"),
        ("handlers_pkg.good:", "is not of the form"),
        ("a b:c", "is not of the form"),
    ],
)
def test_bad_handlers_are_errors(handler_modules, tmp_path, spec, expected):
    text = MINIMAL.replace("examples.noop:handle", spec)
    message = error_of(tmp_path, text)
    assert "[job] handler" in message and expected in message


def test_handlers_are_not_imported_when_asked_not_to(handler_modules, tmp_path):
    text = MINIMAL.replace("examples.noop:handle", "handlers_pkg.broken:handle")
    assert load_text(tmp_path, text, import_handler=False).job.handler.endswith("broken:handle")


def test_a_malformed_handler_spec_fails_even_without_import(tmp_path):
    text = MINIMAL.replace("examples.noop:handle", "handle")
    assert "[job] handler" in error_of(tmp_path, text, import_handler=False)


def test_retry_backoff_works_on_both_brokers_with_a_cap(tmp_path):
    """Redis delays a retry in supervisor-delayed (issue 25.1); NATS NAKs with the delay.
    The cap defaults to an hour and bounds what a script accepts (MAX_TTL)."""
    text = with_job("retry_backoff = 2\n")
    assert load_text(tmp_path, text).job.retry_backoff == 2
    loaded = load_text(tmp_path, text, environ={"QUEUE_BROKER_URL": "nats://127.0.0.1:4222"})
    assert (loaded.job.retry_backoff, loaded.job.retry_backoff_max) == (2, 3600)
    assert "[job] retry_backoff_max" in error_of(tmp_path, with_job("retry_backoff_max = 0\n"))
    assert "[job] retry_backoff_max" in error_of(
        tmp_path, with_job(f"retry_backoff_max = {2**31}\n"))


def test_a_retry_backoff_cap_that_reaches_recovery_age_is_refused_on_redis(tmp_path):
    """Issue 39.1: a retry waits up to retry_backoff_max; it must become ready well inside
    recovery_age (queue 5's reapAfter), the publish age past which a sweep takes a delivery
    from a worker that never renews. Without a backoff nothing waits; NATS has no age gate."""
    supervisor = "[supervisor]\nrecovery_age = 600\n"
    refused = with_job("retry_backoff = 5\nretry_backoff_max = 600\n") + supervisor
    message = error_of(tmp_path, refused)
    assert "[job] retry_backoff_max = 600.0" in message
    assert "[supervisor] recovery_age = 600" in message
    assert "below" in message
    # The default cap (3600 s) with a short recovery_age: the same, naming the default.
    message = error_of(tmp_path, with_job("retry_backoff = 5\n") + supervisor)
    assert "[job] retry_backoff_max = 3600.0" in message
    allowed = with_job("retry_backoff = 5\nretry_backoff_max = 599\n") + supervisor
    assert load_text(tmp_path, allowed).job.retry_backoff_max == 599
    assert load_text(tmp_path, with_job("") + supervisor).supervisor.recovery_age == 600
    nats = {"QUEUE_BROKER_URL": "nats://127.0.0.1:4222"}
    assert load_text(tmp_path, refused, environ=nats).job.retry_backoff_max == 600


# --- async handlers --------------------------------------------------------------------------


ASYNC_JOB = """
[job]
queue = "q"
handler = "tests.handlers.aio:handle"
"""


def test_tasks_per_process_defaults_to_one_and_prefetch_covers_every_task(tmp_path):
    assert load_text(tmp_path, ASYNC_JOB).job.tasks_per_process == 1
    loaded = load_text(tmp_path, ASYNC_JOB + "coroutines = 2\ntasks_per_process = 100\n")
    assert (loaded.job.coroutines, loaded.job.tasks_per_process, loaded.job.prefetch) == (
        2, 100, 200)
    direct = config.JobConfig(queue="q", handler="m:f", coroutines=3, tasks_per_process=4)
    assert direct.prefetch == 12


def test_prefetch_below_every_task_is_an_error(tmp_path):
    message = error_of(tmp_path, ASYNC_JOB + "coroutines = 2\ntasks_per_process = 50\n"
                                             "prefetch = 60\n")
    assert message.endswith(
        "[job] prefetch = 60 is below coroutines * tasks_per_process = 2 * 50 = 100; prefetch "
        "bounds all unacknowledged deliveries, so it must cover every task of every process")


def test_tasks_per_process_above_one_needs_an_async_handler(tmp_path):
    message = error_of(tmp_path, with_job("tasks_per_process = 10\n"))
    assert "[job] tasks_per_process = 10 needs an async def handler" in message
    assert "examples.noop:handle" in message


def test_async_hooks_beside_a_plain_handler_are_an_error(tmp_path):
    message = error_of(tmp_path, MINIMAL.replace("examples.noop", "tests.handlers.aio_sync_handle"))
    assert "defines async flush() but its handler is a plain def" in message


def test_the_example_job_runs_the_async_handler_with_its_commented_lines(tmp_path):
    text = (REPO / "conf" / "stats-usage.toml").read_text()
    async_handler = 'handler = "examples.stats_usage_async:handle"'
    text = text.replace('handler = "examples.stats_usage:handle"', "")
    text = text.replace(f"# {async_handler}", async_handler)
    text = text.replace("tasks_per_process = 1 ", "tasks_per_process = 50 ")
    loaded = load_text(tmp_path, text)
    assert (loaded.job.handler, loaded.job.tasks_per_process) == (
        "examples.stats_usage_async:handle", 50)
    assert loaded.job.prefetch == 100  # written in the file, and it covers 1 * 50


@pytest.mark.parametrize(("spec", "accepted"), [
    ("examples.noop:handle", True), ("examples.noop.handle", True),
    ("os:path.join", True),  # a dotted attribute after the colon
    ("os:path.nothing", False), ("examples.noop:nothing", False), ("no_such_module:f", False),
    ("examples.noop:", False), ("os.sep", False),  # a str, not a callable
])
def test_the_check_and_the_handler_process_accept_the_same_handlers(tmp_path, spec, accepted):
    """One loader for both: a spec the check lets through is one the process can load
    (before, "os:path.join" passed the check and the process refused it, exit 3)."""
    from worker.handler import HandlerError, load

    text = MINIMAL.replace('handler = "examples.noop:handle"', f'handler = "{spec}"')
    if accepted:
        load_text(tmp_path, text)
        assert callable(load(spec).call)
    else:
        error_of(tmp_path, text)
        with pytest.raises(HandlerError):
            load(spec)


# -- Redis Cluster seeds and wait_replicas ------------------------------------------------


def test_a_cluster_url_may_list_several_seeds(tmp_path):
    url = "redis://u:p@10.0.0.1:6379/0,redis://u:p@10.0.0.2:6379/0"
    text = with_job(f'url = "{url}"\ncluster = true\nnamespace = "{{q}}"\n', "broker")
    assert load_text(tmp_path, text).broker.url == url


@pytest.mark.parametrize(
    ("url", "cluster", "expected"),
    [
        ("redis://a:1,redis://b:2", "false", "set [broker] cluster = true"),
        ("redis://a:1,,redis://b:2", "true", "empty server 2 of 3"),
        ("redis://a:1,b:2", "true", "server 2 of 2 (b:2) is not a URL"),
        ("redis://a:1,rediss://b:2", "true", "mixes schemes"),
        ("redis://u:p@a:1,redis://u:q@b:2", "true", "different credentials"),
        ("redis://a:1,nats://b:2", "true", "mixes schemes nats://, redis://"),
    ],
)
def test_bad_seed_lists_are_errors(tmp_path, url, cluster, expected):
    text = with_job(f'url = "{url}"\ncluster = {cluster}\nnamespace = "{{q}}"\n', "broker")
    message = error_of(tmp_path, text)
    assert "[broker] url" in message and expected in message
    assert ":p@" not in message and ":q@" not in message  # no password shown


def test_wait_replicas_defaults_to_none(tmp_path):
    loaded = load_text(tmp_path, MINIMAL)
    assert (loaded.broker.wait_replicas, loaded.broker.wait_timeout) == (0, 1.0)
    assert not loaded.broker.replication.enabled


def test_wait_replicas_is_read(tmp_path):
    loaded = load_text(tmp_path, with_job("wait_replicas = 1\nwait_timeout = 0.5\n", "broker"))
    assert loaded.broker.replication.replicas == 1
    assert loaded.broker.replication.timeout_ms == 500


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("wait_replicas = -1", "[broker] wait_replicas = -1 must be >= 0"),
        ("wait_replicas = 1.5", "expected an integer"),
        ("wait_replicas = 17", "must be <= 16"),
        ("wait_timeout = 0", "[broker] wait_timeout = 0 must be > 0"),
        ("wait_timeout = 61", "must be <= 60"),
    ],
)
def test_bad_wait_settings_are_errors(tmp_path, line, expected):
    assert expected in error_of(tmp_path, with_job(line + "\n", "broker"))


def test_wait_replicas_needs_redis(tmp_path):
    message = error_of(tmp_path, with_job('url = "nats://h:4222"\nwait_replicas = 1\n', "broker"))
    assert "[broker] wait_replicas = 1 works on Redis only" in message


# --- what loading a job's configuration imports ----------------------------------------------


def modules_after(code: str) -> set[str]:
    """The top-level packages a fresh interpreter has imported after running ``code``."""
    listing = "import sys; print(' '.join({name.split('.')[0] for name in sys.modules}))"
    script = f"{code}\n{listing}"
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                          text=True, timeout=60, check=True)
    return set(done.stdout.split())


def test_importing_the_config_loads_no_broker_client():
    loaded = modules_after("import supervisor.config")
    assert "redis" not in loaded and "nats" not in loaded


@pytest.mark.parametrize(("url", "kind", "other_client"), [
    ("nats://127.0.0.1:4222", "nats", "redis"),
    ("redis://127.0.0.1:6379/0", "redis", "nats"),
])
def test_loading_a_job_loads_no_client_of_the_other_broker(tmp_path, url, kind, other_client):
    path = write(tmp_path, with_job(f'url = "{url}"\n', "broker"))
    code = (f"from supervisor.config import load\n"
            f"assert load({str(path)!r}, environ={{}}).broker.kind == {kind!r}")
    assert other_client not in modules_after(code)


# --- the key table of docs/configuration.md ----------------------------------------------------

PAGE = (REPO / "docs" / "configuration.md").read_text()
#: Every page of the documentation and the README, where keys are named.
DOCUMENTED = "\n".join(path.read_text() for path in [REPO / "README.md",
                                                     *sorted((REPO / "docs").rglob("*.md"))])
KIND_WORDS = {int: "integer", float: "seconds", bool: "boolean", str: "string"}


def documented_key_rows() -> dict[str, list[str]]:
    """The table of keys (docs/configuration.md): label -> the other cells."""
    rows: dict[str, list[str]] = {}
    for line in PAGE.splitlines():
        if line.startswith("| `["):
            label, *cells = line.removeprefix("| ").removesuffix(" |").split(" | ")
            assert label.strip("`") not in rows, f"{label} is documented twice"
            rows[label.strip("`")] = cells
    return rows


def test_the_docs_document_every_declared_key_and_no_other():
    assert list(documented_key_rows()) == [key.label for key in config.KEYS]


@pytest.mark.parametrize("key", config.KEYS, ids=lambda key: key.label)
def test_the_docs_row_of_a_key_shows_its_declaration(key):
    kind, default, allowed, meaning = documented_key_rows()[key.label]
    assert kind == KIND_WORDS[key.kind]
    if key.default is config.REQUIRED:
        assert default == "required"
    elif key.same_as:
        assert default == f"= `{key.same_as.rpartition('.')[2]}`"
    else:
        shown = tomllib.loads(f"value = {default.strip('`')}")["value"]
        assert (type(shown), shown) == (type(key.default), key.default)
    rules = "true, false" if key.kind is bool else "; ".join(rule.text for rule in key.rules)
    assert allowed == (rules or "any")
    assert meaning == key.doc


def test_every_key_the_docs_name_is_declared():
    declared = {(key.section, key.name) for key in config.KEYS}
    named = set(re.findall(r"\[(broker|job|supervisor|nats)\] ([A-Za-z_*]+)", DOCUMENTED))
    for block in re.findall(r"```toml\n(.*?)```", DOCUMENTED, re.S):
        named |= {(section, name) for section, table in tomllib.loads(block).items()
                  for name in table}
    unknown = {(section, name) for section, name in named
               if not any(fnmatch.fnmatchcase(f"{s}.{n}", f"{section}.{name}")
                          for s, n in declared | set(config.RETIRED_KEYS))}
    assert unknown == set()
