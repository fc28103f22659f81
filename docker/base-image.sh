#!/usr/bin/env bash
# A stand-in for python:3.11-slim built from Debian bookworm (whose python3 is 3.11), for machines that reach no
# image registry: debootstrap --variant=minbase + python3/venv/pip, this machine's CA certificates (pip then works
# through a TLS-intercepting proxy), `docker import`ed as TAG. Does nothing when TAG is already present.
#   docker/base-image.sh [TAG]      (default vlserve/python:3.11-bookworm)
# The root filesystem is built under $VLSERVE_DOCKER_CACHE (default /var/cache/vlserve-docker), outside the repository.
set -euo pipefail
TAG=${1:-vlserve/python:3.11-bookworm}
if docker image inspect "$TAG" >/dev/null 2>&1; then
    echo "base image $TAG: present"
    exit 0
fi
command -v debootstrap >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap)

# The Debian mirror this machine's apt uses (deb822 .sources first, then one-line lists), else deb.debian.org.
MIRROR=$( (grep -hE '^URIs:' /etc/apt/sources.list.d/*.sources 2>/dev/null | awk '{print $2}' | grep -v security;
           grep -hE '^deb ' /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null | awk '{print $2}' | grep -E 'debian/?$') | head -1 || true)
MIRROR=${MIRROR:-http://deb.debian.org/debian}

CACHE=${VLSERVE_DOCKER_CACHE:-/var/cache/vlserve-docker}
ROOT=$CACHE/rootfs-bookworm-python
mkdir -p "$CACHE"
rm -rf "$ROOT"
echo "base image $TAG: debootstrap bookworm from $MIRROR into $ROOT"
debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,python-is-python3,ca-certificates,passwd \
    bookworm "$ROOT" "$MIRROR" >"$CACHE/debootstrap.log" 2>&1 || { tail -20 "$CACHE/debootstrap.log"; exit 1; }

# This machine's extra CA certificates (a proxy's), then the bundle regenerated inside the root.
if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
    cp /usr/local/share/ca-certificates/*.crt "$ROOT/usr/local/share/ca-certificates/"
fi
chroot "$ROOT" update-ca-certificates >/dev/null
# Like python:3.11-slim: pip may install into the interpreter (no PEP 668 marker); no apt lists or caches.
rm -f "$ROOT"/usr/lib/python3.*/EXTERNALLY-MANAGED
rm -rf "$ROOT"/var/lib/apt/lists/* "$ROOT"/var/cache/apt/*.bin "$ROOT"/var/cache/apt/archives/*.deb \
       "$ROOT"/usr/share/doc/* "$ROOT"/usr/share/man/* "$ROOT"/usr/share/locale/*

tar --numeric-owner -C "$ROOT" -c . | docker import \
    --change 'ENV LANG=C.UTF-8 PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
    --change 'CMD ["python3"]' \
    - "$TAG" >/dev/null
rm -rf "$ROOT"
echo "base image $TAG: $(docker image inspect -f '{{.Size}}' "$TAG" | awk '{printf "%.0f MB", $1/1e6}')"
