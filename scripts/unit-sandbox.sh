#!/bin/bash
# Runs conf/queue-supervisor@.service, sandbox and all, under a real systemd on a machine (or
# container) where systemd is not PID 1: systemd becomes PID 1 of private pid, mount, cgroup
# and UTS namespaces, with only this unit (plus a drop-in sending its output to a file, as
# there is no journald), the system user in an overlay of /etc, the checkout at
# /opt/queue-supervisor with a virtualenv of Debian's python3, and a private redis-server
# whose only user is the job's least-privilege ACL user. Nothing outside the temp directory
# is written, apart from a cgroup directory, removed at the end.
#
# It publishes stats-usage messages, starts the service, and checks: every message handled
# and summed in the state directory's SQLite file, the service's process unprivileged (uid,
# no capabilities, NoNewPrivs, seccomp), a killed handler replaced, no watchdog restart,
# a clean stop, an empty ACL LOG. Then it prints `systemd-analyze security` of the unit.
#
#   sudo bash scripts/unit-sandbox.sh            # needs root, unshare, overlayfs, cgroup2,
#                                                # redis-server, systemd, python3-venv
# Environment: MESSAGES (2000), RUN_SECONDS (40: longer than WatchdogSec=30), VENV (reuse a
# virtualenv with the dependencies instead of making one with pip).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)

# -- the inner side: PID 1 of the new namespaces ---------------------------------------------
if [ "${1:-}" = --inner ]; then
  B=$2
  mount --make-rprivate /
  mount -t proc proc /proc
  mount --bind -o ro /proc/sys /proc/sys
  mount -t tmpfs tmpfs /run
  mount -t cgroup2 cgroup2 /sys/fs/cgroup
  mount -t overlay overlay -o "lowerdir=/etc,upperdir=$B/etc,workdir=$B/etc-work" /etc
  mount --bind "$B/units" /etc/systemd/system
  for dir in system system-generators system-preset; do
    mount --bind "$B/empty" "/usr/lib/systemd/$dir"
  done
  mount -t tmpfs tmpfs /opt
  mkdir /opt/queue-supervisor
  mount -t overlay overlay -o "lowerdir=$ROOT,upperdir=$B/opt,workdir=$B/opt-work" /opt/queue-supervisor
  mount --bind "$B/var-lib" /var/lib
  mount --bind "$B/console.log" /dev/console
  export container=qs-unit-sandbox
  exec /lib/systemd/systemd --system --unit=sandbox.target --log-target=console
fi

MESSAGES=${MESSAGES:-2000}
RUN_SECONDS=${RUN_SECONDS:-40}
B=$(mktemp -d /tmp/qs-unit-sandbox.XXXXXX)
UNIT=queue-supervisor@sandbox.service
if [ "$(stat -fc %T /sys/fs/cgroup)" = cgroup2fs ]; then CGROOT=/sys/fs/cgroup; else CGROOT=/sys/fs/cgroup/unified; fi
CG=$CGROOT/qs-unit-sandbox-$$
PID1= REDIS=

say() { printf '%s\n' "$*"; }
fail() { say "FAIL: $*"; exit 1; }
inside() { nsenter -t "$PID1" -m -p -- "$@"; }

cleanup() {
  set +e
  if [ -n "$PID1" ]; then
    # Stop the service while its broker is still there, then power the namespace off.
    inside systemctl stop "$UNIT" 2>/dev/null
    kill -s SIGRTMIN+14 "$PID1" 2>/dev/null
    for _ in $(seq 100); do kill -0 "$PID1" 2>/dev/null || break; sleep 0.1; done
  fi
  [ -n "$REDIS" ] && kill "$REDIS" 2>/dev/null
  [ -d "$CG" ] && find "$CG" -depth -type d -exec rmdir {} \; 2>/dev/null
  [ -d "$CG" ] && say "left behind: $CG (processes still in it)"
  rm -rf "$B"
}
trap cleanup EXIT

[ "$(id -u)" = 0 ] || fail "run as root"
mkdir -p "$B"/{units,empty,etc/queue-supervisor,etc-work,opt,opt-work,var-lib,redis}
touch "$B/console.log"

# Units: the one under test and empty stand-ins for the targets its defaults name.
for target in sandbox sysinit basic shutdown poweroff network-online multi-user sockets local-fs; do
  printf '[Unit]\nDescription=%s (sandbox)\nDefaultDependencies=no\n' "$target" \
    > "$B/units/$target.target"
done
cp "$ROOT/conf/queue-supervisor@.service" "$B/units/"
mkdir "$B/units/queue-supervisor@.service.d"
printf '[Service]\nStandardOutput=append:%s/out.log\nStandardError=inherit\n' "$B" \
  > "$B/units/queue-supervisor@.service.d/no-journald.conf"

# The system user (docs/operations.md), only in the overlay of /etc.
cp /etc/passwd /etc/group "$B/etc/"
echo 'queue-supervisor:x:64990:64990::/nonexistent:/usr/sbin/nologin' >> "$B/etc/passwd"
echo 'queue-supervisor:x:64990:' >> "$B/etc/group"

# The virtualenv at /opt/queue-supervisor/venv (the unit's ExecStart).
if [ -n "${VENV:-}" ]; then
  cp -a "$VENV" "$B/opt/venv"
else
  /usr/bin/python3 -m venv "$B/opt/venv"
  # The dependencies only: the code runs from the checkout (WorkingDirectory), which pip
  # would otherwise build in (and write to).
  mapfile -t deps < <("$B/opt/venv/bin/python" -c 'import sys, tomllib
print("\n".join(tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]))' "$ROOT/pyproject.toml")
  "$B/opt/venv/bin/pip" install -q "${deps[@]}"
fi
PY=$B/opt/venv/bin/python

# A private redis-server; the job runs as its ACL user (docs/acl.md).
PORT=$("$PY" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
redis-server --port "$PORT" --bind 127.0.0.1 --dir "$B/redis" --save '' --appendonly no \
  --logfile "$B/redis/log" &
REDIS=$!
sleep 0.5
JOB=$B/etc/queue-supervisor/sandbox.toml
sed -e "s#^url = .*#url = \"redis://127.0.0.1:$PORT/0\"#" -e 's#^queue = .*#queue = "sandbox"#' \
  "$ROOT/conf/stats-usage.toml" > "$JOB"
chgrp 64990 "$JOB" && chmod 640 "$JOB"  # as docs/operations.md: readable by the service's group
(cd "$ROOT" && "$PY" -m supervisor acl "$JOB" --role job 2>/dev/null) \
  | sed "s/<password>/sandbox-pw/" | redis-cli -p "$PORT" > /dev/null
echo "QUEUE_BROKER_URL=redis://sandbox-job:sandbox-pw@127.0.0.1:$PORT/0" \
  > "$B/etc/queue-supervisor/sandbox.env"
chmod 600 "$B/etc/queue-supervisor/sandbox.env"
admin() { redis-cli -p "$PORT" "$@"; }

# Boot.
mkdir "$CG"
(echo $BASHPID > "$CG/cgroup.procs"
 exec unshare --pid --fork --mount --cgroup --uts --propagation private \
   bash "$0" --inner "$B" > "$B/boot.log" 2>&1) &
sleep 3
PID1=$(ps -o pid= --ppid $! | tr -d ' ')
[ -n "$PID1" ] || fail "systemd did not start: $(cat "$B/boot.log" "$B/console.log")"
for _ in $(seq 50); do inside systemctl is-system-running >/dev/null 2>&1 && break; sleep 0.1; done

# Publish, run, check.
"$PY" - "$MESSAGES" > "$B/jobs.jsonl" <<'EOF'
import json, sys
for n in range(int(sys.argv[1])):
    print(json.dumps({"projectId": f"p{n % 7}", "metrics": [{"key": "executions", "value": 1}]}))
EOF
(cd "$ROOT" && QUEUE_BROKER_URL="redis://127.0.0.1:$PORT/0" "$PY" -m supervisor publish "$JOB" "$B/jobs.jsonl")
inside systemctl start "$UNIT" || fail "start: $(tail -20 "$B/out.log")"
say "started: $(inside systemctl show -p ActiveState,StatusText --value "$UNIT" | tr '\n' ' ')"
MAIN=$(inside systemctl show -p MainPID --value "$UNIT")
SERVICE_CG="$CG$(inside systemctl show -p ControlGroup --value "$UNIT")"
for pid in $(cat "$SERVICE_CG/cgroup.procs"); do  # the main process's pid out here
  grep -Eq "^NSpid:[[:space:]]+$pid[[:space:]]+$MAIN\$" "/proc/$pid/status" && MAIN_HOST=$pid
done
[ -n "${MAIN_HOST:-}" ] || fail "main process $MAIN not found in $SERVICE_CG"
grep -E '^(Uid|CapEff|CapBnd|NoNewPrivs|Seccomp):' "/proc/$MAIN_HOST/status"
grep -q '^Uid:[[:space:]]*0' "/proc/$MAIN_HOST/status" && fail "runs as root"
grep -q '^NoNewPrivs:[[:space:]]*1' "/proc/$MAIN_HOST/status" || fail "NoNewPrivs not set"
grep -q '^Seccomp:[[:space:]]*2' "/proc/$MAIN_HOST/status" || fail "no seccomp filter"
grep -q '^CapEff:[[:space:]]*0*$' "/proc/$MAIN_HOST/status" || fail "has capabilities"

handler_pid() {  # the handler's pid out here, by its title, among the service's processes
  for pid in $(cat "$SERVICE_CG/cgroup.procs"); do
    if tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null | grep -q "sandbox handler 0"; then
      echo "$pid"
    fi
  done | head -1 || true
}
handler=$(handler_pid)
kill -KILL "$handler"
for _ in $(seq 100); do
  new=$(handler_pid)
  [ -n "$new" ] && [ "$new" != "$handler" ] && break; sleep 0.1
done
[ -n "$new" ] && [ "$new" != "$handler" ] || fail "the killed handler was not replaced"
say "handler $handler killed, replaced by $new"

for _ in $(seq 600); do
  [ "$(admin GET utopia-queue.stats.sandbox.success)" = "$MESSAGES" ] && break; sleep 0.1
done
[ "$(admin GET utopia-queue.stats.sandbox.success)" = "$MESSAGES" ] || fail "not every message committed"
DB=$B/var-lib/queue-supervisor/sandbox/stats-usage.sqlite
total=$("$PY" -c "import sqlite3, sys; print(sqlite3.connect(sys.argv[1]).execute(\"select sum(value) from usage where metric = 'executions'\").fetchone()[0])" "$DB")
[ "$total" = "$MESSAGES" ] || fail "SQLite total $total, published $MESSAGES"
say "$MESSAGES messages committed, SQLite total $total in $(stat -c 'uid %u gid %g mode %a' "$DB") $DB"

sleep "$RUN_SECONDS"
restarts=$(inside systemctl show -p NRestarts --value "$UNIT")
[ "$restarts" = 0 ] || fail "restarted $restarts times (watchdog?)"
inside systemctl stop "$UNIT"
result=$(inside systemctl show -p Result,ExecMainStatus --value "$UNIT" | tr '\n' ' ')
[ "$result" = "success 0 " ] || fail "stop: $result"
say "ran ${RUN_SECONDS}s more without a restart; stopped: Result=success, exit 0"
[ "$(admin ACL LOG)" = "" ] || fail "ACL LOG: $(admin ACL LOG)"
say "ACL LOG empty"
errors=$(grep -c '"level":"error"' "$B/out.log" || true)
say "log lines at level error: $errors (1 expected: the killed handler)"
inside systemd-analyze security --no-pager "$UNIT" | tail -1
say "OK"
