#!/usr/bin/env bash
# `make deploy-test`: Docker up (docker/dockerd-up.sh), the images (docker/build.sh --rehearsal), locust at the pin of
# pyproject's `load` extra in its own virtual environment, then the rehearsal (docker/deploy_test.py; arguments pass on,
# e.g. --record). Build caches live in $VLSERVE_DOCKER_CACHE (default /var/cache/vlserve-docker).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
CACHE=${VLSERVE_DOCKER_CACHE:-/var/cache/vlserve-docker}
docker/dockerd-up.sh
docker/build.sh --rehearsal
LOCUST_PIN=$($PYTHON -c "import tomllib; print(*[r for r in tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['load'] if r.startswith('locust')])")
if ! "$CACHE/locust-venv/bin/locust" --version 2>/dev/null | grep -q "locust ${LOCUST_PIN#locust==} "; then
    mkdir -p "$CACHE" && $PYTHON -m venv "$CACHE/locust-venv" && "$CACHE/locust-venv/bin/pip" install -q "$LOCUST_PIN" \
        2> >(grep -v "^WARNING: Location" >&2)
fi
MODELS=${VLSERVE_REHEARSAL_MODELS:-$HOME/.cache/vlserve/zoo/demo}
[ -d "$MODELS/encoder" ] || vlserve zoo build --profile demo
exec $PYTHON docker/deploy_test.py --models "$MODELS" --locust "$CACHE/locust-venv/bin/locust" "$@"
