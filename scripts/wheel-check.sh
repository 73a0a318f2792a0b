#!/usr/bin/env bash
# Build the wheel, install it into a fresh virtual environment outside the checkout and run a
# short job from there: what is installed must carry everything it needs (the Lua scripts
# above all), since nothing of the checkout is on the path. Uses a private redis-server.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-$root/.venv/bin/python}
work=$(mktemp -d)
pids=()
cleanup() { for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done; rm -rf "$work"; }
trap cleanup EXIT

# Built from a copy of what git tracks: no stale build/ folder of the checkout can leak in.
mkdir "$work/src"
git -C "$root" ls-files -z | tar -C "$root" --null -T - -cf - | tar -C "$work/src" -xf -
"$python" -m pip wheel -q --disable-pip-version-check --no-deps "$work/src" -w "$work/dist"
"$python" -m venv "$work/venv"
"$work/venv/bin/python" -m pip install -q --disable-pip-version-check "$work"/dist/*.whl
cd "$work"  # outside the checkout

port=$("$work/venv/bin/python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
redis-server --bind 127.0.0.1 --port "$port" --save "" --appendonly no >redis.log 2>&1 &
pids+=($!)
for _ in $(seq 50); do redis-cli -p "$port" ping >/dev/null 2>&1 && break; sleep 0.1; done
cat > job.toml <<TOML
[broker]
url = "redis://127.0.0.1:$port/0"
[job]
queue = "wheel-check"
handler = "examples.noop:handle"
prefetch = 20
TOML
count=200
for n in $(seq "$count"); do echo "{\"n\": $n}"; done | "$work/venv/bin/python" -m supervisor publish job.toml
# The console script, as an install should start it (docs/operations.md: "Other local users").
"$work/venv/bin/queue-supervisor" --help >/dev/null
"$work/venv/bin/queue-supervisor" job.toml >supervisor.log 2>&1 &
supervisor=$!
pids+=("$supervisor")
done_count=0
deadline=$((SECONDS + 60))
while [ "$SECONDS" -lt "$deadline" ] && kill -0 "$supervisor" 2>/dev/null; do
    done_count=$("$work/venv/bin/python" -m supervisor status job.toml --json \
        | "$work/venv/bin/python" -c 'import json, sys; print(json.load(sys.stdin)["stats"]["success"])')
    if [ "$done_count" -ge "$count" ]; then break; fi
    sleep 0.2
done
kill -TERM "$supervisor" 2>/dev/null || true
code=0; wait "$supervisor" || code=$?
if [ "$done_count" -lt "$count" ] || [ "$code" -ne 0 ]; then
    echo "wheel check failed: $done_count of $count jobs done, supervisor exit $code" >&2
    tail -20 supervisor.log >&2
    exit 1
fi
echo "wheel check: the installed wheel ran $done_count jobs outside the checkout (exit $code)"
