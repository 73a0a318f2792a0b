#!/usr/bin/env bash
# Install what this project needs on a Debian machine with Python >= 3.11: redis-server and
# redis-cli (Debian packages, only when missing) and the project with its test extras.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v redis-server >/dev/null || ! command -v redis-cli >/dev/null; then
    echo "installing redis-server and redis-tools (apt)" >&2
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server redis-tools >/dev/null
fi
python -m pip install -q --disable-pip-version-check --root-user-action=ignore -e '.[test]'
