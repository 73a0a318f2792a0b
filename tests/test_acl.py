"""The Redis ACL lists (``broker.redis.acl``): complete for the scripts, explained, and what
docs/acl.md shows. That they suffice at run time is ``tests/test_acl_e2e.py``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from broker.redis import acl
from broker.redis.keys import QueueKeys
from broker.redis.scripts import LUA_DIR, lua_source
from supervisor import cli
from supervisor.ops import COMMANDS
from support.supervision import write_config

ROOT = Path(__file__).resolve().parent.parent
PAGE = (ROOT / "docs" / "acl.md").read_text()
EXAMPLE = QueueKeys("utopia-queue", "stats-usage")  # conf/stats-usage.toml's queue


def test_every_redis_call_in_the_scripts_names_its_command_literally():
    # script_commands() reads names from the text: a computed name would escape the check.
    for path in LUA_DIR.glob("*.lua"):
        text = lua_source(path.stem)  # its helpers included
        calls = len(re.findall(r"redis\.p?call\(", text))
        literal = len(re.findall(r"redis\.p?call\(\s*'[A-Za-z]+'", text))
        assert calls == literal, path.name


@pytest.mark.parametrize("role", acl.ROLES, ids=lambda role: role.name)
def test_each_user_may_run_every_command_of_its_scripts(role):
    for script in role.scripts:
        missing = acl.script_commands(script) - set(role.commands)
        assert not missing, f"{role.name} runs {script}.lua, which calls {sorted(missing)}"


def test_the_job_runs_every_script_but_the_operators_and_each_script_has_a_user():
    scripts = {path.stem for path in LUA_DIR.glob("*.lua")}
    operators_only = {"retry", "delete", "peek"}  # failed, dead, poison, retry commands
    assert set(acl.BY_NAME["job"].scripts) == scripts - operators_only
    assert set().union(*(role.scripts for role in acl.ROLES)) == scripts


def test_there_is_a_user_per_operator_command_that_talks_to_redis():
    assert set(acl.BY_NAME) == {"job", "dashboard", *COMMANDS} - {"acl"}


def test_every_command_is_explained_and_every_key_pattern_exists():
    for role in acl.ROLES:
        assert role.access in ("~", "%R~", "%W~")
        assert set(role.keys) | set(role.read_keys) <= set(acl.PATTERNS), role.name
        assert not set(role.keys) & set(role.read_keys), role.name
        assert len(set(role.commands)) == len(role.commands), role.name
        in_scripts = set().union(*(acl.script_commands(s) for s in role.scripts))
        unexplained = set(role.commands) - set(acl.WHY) - in_scripts
        assert not unexplained, f"{role.name}: say in WHY what {sorted(unexplained)} are for"
    assert not set(acl.CONNECT + acl.SELECT + acl.CLUSTER) - set(acl.WHY)


def test_patterns_name_exactly_the_keys_broker_keys_builds():
    rules = acl.patterns(acl.BY_NAME["job"], EXAMPLE)
    assert "~utopia-queue.queue.stats-usage" in rules
    assert "~utopia-queue.jobs.stats-usage.*" in rules
    assert "~utopia-queue.reservations.stats-usage.*" in rules
    assert all(".stats-usage" in rule for rule in rules)  # one queue, never the namespace
    # Glob characters in a namespace or queue are matched literally.
    odd = acl.patterns(acl.BY_NAME["publish"], QueueKeys("ns[1]", "q*"))
    assert odd == [r"%W~ns\[1\].queue.q\*"]


def test_read_only_and_write_only_users():
    assert acl.BY_NAME["status"].access == acl.BY_NAME["check"].access == "%R~"
    assert acl.BY_NAME["publish"].access == "%W~"
    for name in ("status", "check", "publish"):
        assert not {"evalsha", "script|load", "set", "del"} & set(acl.BY_NAME[name].commands)


def test_select_only_for_a_database_other_than_0_and_cluster_commands_only_on_a_cluster():
    assert not acl.selects_database("redis://127.0.0.1:6379/0")
    assert not acl.selects_database("redis://127.0.0.1:6379")
    assert acl.selects_database("redis://u:p@127.0.0.1:6379/2")
    role = acl.BY_NAME["check"]
    assert "select" not in acl.commands(role)
    assert "select" in acl.commands(role, select=True)
    assert "cluster|slots" in acl.commands(role, cluster=True)


@pytest.mark.usefixtures("no_url_override")
def test_acl_command_prints_the_lines_for_the_job_file(tmp_path, capsys):
    conf = write_config(tmp_path, "redis://127.0.0.1:6379/3", handler="examples.noop:handle",
                        job={"queue": "mail"}, broker={"namespace": "{app}"})
    assert cli.main(["acl", str(conf), "--role", "publish", "--role", "check"]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines() == [
        "ACL SETUSER mail-publish reset on ><password> +ping +select +lpush "
        "%W~{app}.queue.mail",
        "ACL SETUSER mail-check reset on ><password> +ping +select +zcard "
        "+zrange +scan +llen +time +hscan +mget +get +pttl %R~{app}.reservations.mail "
        "%R~{app}.reservations.mail.* %R~{app}.owners.mail.* %R~{app}.supervisor-tokens.mail "
        "%R~{app}.supervisor-delayed.mail %R~{app}.supervisors.mail.*",
    ]
    assert "replace <password>" in err  # the note goes to stderr: stdout pipes into redis-cli


def test_acl_command_refuses_a_nats_job(tmp_path, capsys):
    conf = write_config(tmp_path, "nats://127.0.0.1:1", handler="examples.noop:handle")
    assert cli.main(["acl", str(conf)]) == 2
    assert "Redis only" in capsys.readouterr().err


def _block_after(marker: str, text: str) -> str:
    """The fenced code block that follows ``marker`` in ``text``."""
    start = text.index(marker)
    match = re.compile(r"```[a-z]*\n(.*?)```", re.S).search(text, start)
    assert match, marker
    return match.group(1)


@pytest.mark.usefixtures("no_url_override")
def test_the_docs_show_the_lines_and_the_table_these_lists_make(capsys):
    assert cli.main(["acl", str(ROOT / "conf" / "stats-usage.toml")]) == 0
    printed = capsys.readouterr().out
    shown = _block_after("<!-- acl: python -m supervisor acl conf/stats-usage.toml -->", PAGE)
    assert shown == printed
    marker = ('<!-- generated by: python -c "import broker.redis.acl as a; '
              'print(a.describe())" -->\n')
    table = PAGE[PAGE.index(marker) + len(marker):].split("\n\n", 1)[0] + "\n"
    assert table == acl.describe()


def test_wait_replicas_grants_wait_to_the_writers_only():
    job, publish, status = (acl.BY_NAME[name] for name in ("job", "publish", "status"))
    assert "wait" not in acl.commands(job)
    assert "wait" in acl.commands(job, wait=True) and "wait" in acl.commands(publish, wait=True)
    assert "wait" not in acl.commands(status, wait=True)
    assert "wait" in acl.WHY
