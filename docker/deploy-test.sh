#!/usr/bin/env bash
# `make deploy-test`: Docker up (docker/dockerd-up.sh), the images (docker/build.sh --rehearsal), locust at the pin of
# pyproject's `load` extra in its own virtual environment (loadtests/locust-venv.sh), then the rehearsal (docker/deploy_test.py; arguments pass on,
# e.g. --record). Build caches live in $VLSERVE_DOCKER_CACHE (default /var/cache/vlserve-docker).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
CACHE=${VLSERVE_DOCKER_CACHE:-/var/cache/vlserve-docker}
docker/dockerd-up.sh
docker/build.sh --rehearsal
LOCUST=$(PYTHON=$PYTHON loadtests/locust-venv.sh)
MODELS=${VLSERVE_REHEARSAL_MODELS:-$HOME/.cache/vlserve/zoo/demo}
[ -d "$MODELS/encoder" ] || vlserve zoo build --profile demo
exec $PYTHON docker/deploy_test.py --models "$MODELS" --locust "$LOCUST" "$@"
