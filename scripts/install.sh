#!/usr/bin/env bash
# Install what this project needs on Debian (12 or later; as root, for apt): redis-server
# and redis-cli when missing, and the project with its test extras in a virtual environment,
# .venv (Debian's python3 refuses pip installs outside one: PEP 668). PYTHON picks the
# interpreter that makes it (python3 by default; 3.11 or later).
# Usage: install.sh [EXTRAS], the project's extras to install (default "test", what CI and
# the test command need); setup.sh asks for "clickhouse" only, the quick start's store.
# CI asks for "test,docs" (the documentation site is built too).
# Extras installed before stay: a .venv made for the tests also runs the quick start.
set -euo pipefail
cd "$(dirname "$0")/.."
extras=${1:-test}

apt_install() {
    echo "installing $* (apt)" >&2
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

if ! command -v redis-server >/dev/null || ! command -v redis-cli >/dev/null; then
    apt_install redis-server redis-tools
fi
python=${PYTHON:-$(command -v python3 || true)}
if [ -z "$python" ]; then
    apt_install python3 python3-venv
    python=$(command -v python3)
fi
if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    echo "error: $python is $("$python" --version 2>&1); this project needs Python 3.11 or later" >&2
    exit 1
fi
if [ ! -x .venv/bin/python ]; then
    if ! "$python" -c 'import ensurepip, venv' 2>/dev/null; then
        apt_install python3-venv
    fi
    "$python" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[$extras]"
