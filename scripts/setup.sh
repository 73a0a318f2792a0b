#!/usr/bin/env bash
# Quick-start set-up: install (into .venv, see install.sh), make sure a Redis listens on 127.0.0.1:6379, and publish some
# stats-usage demo messages for `python -m supervisor conf/stats-usage.toml` to consume.
set -euo pipefail
cd "$(dirname "$0")/.."

# The project and the stats-usage example's default store (chDB, the extra "clickhouse"),
# not the test extras (pytest, mypy, ruff, hypothesis, nats-server...): install.sh's default.
bash scripts/install.sh clickhouse
if ! redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1; then
    echo "starting redis-server on 127.0.0.1:6379" >&2
    redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no
    for _ in $(seq 50); do redis-cli -p 6379 ping >/dev/null 2>&1 && break; sleep 0.1; done
fi
.venv/bin/python -m examples.demo conf/stats-usage.toml --messages "${DEMO_MESSAGES:-1000}"
