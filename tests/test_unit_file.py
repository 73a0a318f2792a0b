"""conf/queue-supervisor@.service: the install's interpreter by absolute path, a dedicated user,
a state directory, and the sandbox; checked by systemd-analyze where it is installed.

systemd does not run in the test environment, so nothing here starts the unit;
docs/operations.md says how it was run under a real systemd (scripts/unit-sandbox.sh).
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
UNIT = ROOT / "conf" / "queue-supervisor@.service"

#: Directives the unit must set, with their exact values.
HARDENING = {
    "NoNewPrivileges": "yes",
    "CapabilityBoundingSet": "",
    "AmbientCapabilities": "",
    "ProtectSystem": "strict",
    "ProtectHome": "yes",
    "PrivateTmp": "yes",
    "PrivateDevices": "yes",
    "PrivateUsers": "yes",
    "PrivateMounts": "yes",
    "ProtectKernelTunables": "yes",
    "ProtectKernelModules": "yes",
    "ProtectKernelLogs": "yes",
    "ProtectControlGroups": "yes",
    "ProtectClock": "yes",
    "ProtectHostname": "yes",
    "ProtectProc": "invisible",
    "ProcSubset": "pid",
    "RestrictAddressFamilies": "AF_UNIX AF_INET AF_INET6",
    "RestrictNamespaces": "yes",
    "RestrictRealtime": "yes",
    "RestrictSUIDSGID": "yes",
    "LockPersonality": "yes",
    "MemoryDenyWriteExecute": "yes",
    "RemoveIPC": "yes",
    "SystemCallArchitectures": "native",
    "UMask": "0077",
}
#: Exposure (systemd-analyze security, tenths) above which the test fails: 1.1 when written.
MAX_EXPOSURE = 15


def parse(text: str) -> dict[str, dict[str, list[str]]]:
    """Sections of a unit file, each key with every value it is given (keys may repeat)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        key, _, value = line.partition("=")
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


SERVICE = parse(UNIT.read_text())["Service"]


def last(key: str) -> str:
    """The value systemd uses for a single-valued directive: the last one set."""
    return SERVICE[key][-1]


def test_execstart_runs_the_installs_interpreter_by_absolute_path():
    argv = shlex.split(last("ExecStart"))
    assert argv[0].startswith("/") and argv[0] != "/usr/bin/env", argv
    assert argv[0].endswith("/bin/python")
    assert argv[1:] == ["-m", "supervisor", "/etc/queue-supervisor/%i.toml"]
    assert last("WorkingDirectory").startswith("/")


def test_systemctl_reload_sends_sighup_to_the_supervisor_alone():
    # SIGHUP replaces the handler processes (tests/test_sighup.py); $MAINPID is the supervisor.
    assert shlex.split(last("ExecReload")) == ["/bin/kill", "-HUP", "$MAINPID"]


def test_a_dedicated_user_and_a_state_directory_for_the_database():
    assert last("User") == last("Group") == "queue-supervisor"
    assert last("StateDirectory") == "queue-supervisor/%i"
    assert "STATS_USAGE_DB=%S/queue-supervisor/%i/stats-usage.sqlite" in SERVICE["Environment"]
    assert SERVICE["EnvironmentFile"] == ["-/etc/queue-supervisor/%i.env"]


def test_the_sandbox_directives_are_set():
    wrong = {key: SERVICE.get(key) for key, value in HARDENING.items()
             if SERVICE.get(key, [None])[-1] != value}
    assert not wrong, f"expected {[f'{k}={HARDENING[k]}' for k in wrong]}, found {wrong}"
    assert SERVICE["SystemCallFilter"] == ["@system-service", "~@privileged @resources"]
    assert last("SystemCallErrorNumber") == "EPERM"


def test_the_supervisors_own_service_settings_are_kept():
    assert (last("Type"), last("NotifyAccess"), last("KillMode")) == ("notify", "main", "mixed")
    # config error, init() failed, broker refused: restarting would only repeat them
    # (the codes themselves: tests/test_credentials.py)
    assert last("RestartPreventExitStatus") == "2 3 5"
    assert int(last("TimeoutStopSec")) > 30  # above the default shutdown_deadline


def test_descriptors_are_bounded_and_a_memory_ceiling_is_offered():
    assert int(last("LimitNOFILE")) >= 4096
    assert "#MemoryMax=" in UNIT.read_text()  # a value only the job's own peak can give


@pytest.fixture
def runnable_unit(tmp_path: Path) -> Path:
    """The unit as an instance, with an interpreter that exists here (verify checks it)."""
    if not shutil.which("systemd-analyze"):
        pytest.skip("systemd-analyze is not installed")
    python = shutil.which("python3") or "/usr/bin/python3"
    text = UNIT.read_text().replace("/opt/queue-supervisor/venv/bin/python", python)
    path = tmp_path / "queue-supervisor@stats-usage.service"
    path.write_text(text)
    return path


def test_systemd_analyze_verify_finds_nothing_wrong(runnable_unit):
    done = subprocess.run(["systemd-analyze", "verify", str(runnable_unit)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and not done.stderr.strip(), done.stderr


def test_systemd_analyze_security_exposure_stays_low(runnable_unit):
    done = subprocess.run(
        ["systemd-analyze", "security", "--offline=true", f"--threshold={MAX_EXPOSURE}",
         "--no-pager", str(runnable_unit)],
        capture_output=True, text=True, timeout=60,
    )
    if "unrecognized option" in done.stderr:
        pytest.skip("systemd-analyze security has no --offline here (systemd < 250)")
    assert done.returncode == 0, done.stdout[-600:] + done.stderr
