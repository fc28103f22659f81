#!/usr/bin/env bash
# Locust at the pin of pyproject's `load` extra, in a virtual environment of its own (it pulls gevent and flask, which
# the service's environment does without): created or updated when its version is not the pin, then its executable's
# path printed. Used by `make install` (tests/service/test_locust.py runs it) and docker/deploy-test.sh.
# Where: $VLSERVE_LOCUST_VENV, else $VLSERVE_DOCKER_CACHE/locust-venv (default /var/cache/vlserve-docker/locust-venv).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VLSERVE_LOCUST_VENV:-${VLSERVE_DOCKER_CACHE:-/var/cache/vlserve-docker}/locust-venv}
PIN=$($PYTHON -c "import tomllib; print(*[r for r in tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['load'] if r.startswith('locust')])")
if ! "$VENV/bin/locust" --version 2>/dev/null | grep -q "locust ${PIN#locust==} "; then
    mkdir -p "$(dirname "$VENV")" && $PYTHON -m venv "$VENV" && "$VENV/bin/pip" install -q "$PIN" \
        2> >(grep -v "^WARNING: Location" >&2) >&2
fi
echo "$VENV/bin/locust"
