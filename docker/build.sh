#!/usr/bin/env bash
# `make image`: the service image, with no registry needed.
#   1. the base: $VLSERVE_BASE (default python:3.11-slim) when present locally, else vlserve/python:3.11-bookworm
#      built from Debian by docker/base-image.sh (debootstrap + docker import, this machine's CA certificates);
#   2. docker/wheelhouse/ filled from this machine's pip configuration (docker/wheelhouse.sh);
#   3. docker build -f docker/Dockerfile (installs with --no-index from the wheelhouse), tagged $VLSERVE_IMAGE
#      (default vlserve:latest); PROFILE=demo bakes that model set into the image. The image the tag named before is
#      removed when nothing else uses it.
# `docker/build.sh --rehearsal` also builds the Redis and HAProxy images of docker/deploy_test.py.
set -euo pipefail
cd "$(dirname "$0")/.."
IMAGE=${VLSERVE_IMAGE:-vlserve:latest}
BASE=${VLSERVE_BASE:-python:3.11-slim}
if ! docker image inspect "$BASE" >/dev/null 2>&1; then
    echo "base image $BASE: not present locally; using a Debian bookworm stand-in"
    BASE=vlserve/python:3.11-bookworm
    docker/base-image.sh "$BASE"
fi
docker/wheelhouse.sh
export DOCKER_BUILDKIT=0  # the classic builder: finds the imported base locally, never asks a registry
LOGS=${VLSERVE_DOCKER_CACHE:-/var/cache/vlserve-docker}
mkdir -p "$LOGS"
build() {  # build DOCKERFILE TAG [ARGS...]: quiet, its log kept (and its tail shown when it fails)
    local file=$1 tag=$2 log="$LOGS/build-${2//[\/:]/_}.log" t0=$SECONDS
    shift 2
    if [ "$file" = docker/Dockerfile ]; then  # the repository as context (.dockerignore keeps what it copies)
        docker build -f "$file" --build-arg BASE="$BASE" "$@" -t "$tag" . >"$log" 2>&1 || { tail -40 "$log"; exit 1; }
    else  # no context at all
        docker build --build-arg BASE="$BASE" "$@" -t "$tag" - <"$file" >"$log" 2>&1 || { tail -40 "$log"; exit 1; }
    fi
    echo "image $tag: $(docker image inspect -f '{{.Size}}' "$tag" | awk '{printf "%.2f GB", $1/1e9}'), $((SECONDS - t0)) s (base $BASE; log $log)"
}
# The deps stage first, tagged: it is the cache of the next build, and untagged it would be pruned below (no image
# has it as a parent; the app stage copies from it).
build docker/Dockerfile vlserve/deps:latest --target deps
build docker/Dockerfile "$IMAGE" ${PROFILE:+--build-arg PROFILE="$PROFILE"}
# The images these tags named before (6 GB when the dependencies changed) are untagged now: removed, with the stages
# only they used. Only untagged images of this Dockerfile (its label); nothing tagged, nothing of another project.
docker image prune -f --filter label=org.opencontainers.image.title=vlserve >/dev/null
if [ "${1:-}" = "--rehearsal" ]; then
    build docker/redis.Dockerfile vlserve/redis:rehearsal
    build docker/haproxy.Dockerfile vlserve/haproxy:rehearsal
fi
