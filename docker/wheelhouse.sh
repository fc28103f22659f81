#!/usr/bin/env bash
# Fill docker/wheelhouse/ with every wheel the image installs, at the pins of pyproject.toml, using this machine's pip
# configuration (its local wheel folders and index); the image build then installs from it with --no-index, without
# reaching any index itself. The wheels are downloaded once into $VLSERVE_WHEEL_CACHE (default
# ~/.cache/vlserve/wheels; re-running only fetches what is missing) and hard-linked into the git-ignored folder, so a
# clone's wheelhouse costs no disk of its own (3.1 GB of wheels: torch and the CUDA libraries it links against).
# The folder ends holding exactly the wheels pip resolved for the current pins.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
WH=docker/wheelhouse
CACHE=${VLSERVE_WHEEL_CACHE:-$HOME/.cache/vlserve/wheels}
mkdir -p "$WH" "$CACHE"
deps=$($PYTHON -c "import tomllib; print(' '.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))")
download() {  # pip download into the cache; prints the path of every wheel it resolved (fetched or already there)
    $PYTHON -m pip download --progress-bar off --only-binary=:all: -d "$CACHE" "$@" 2> >(grep -v "^WARNING: Location" >&2) \
        | sed -n -e 's/^Saved //p' -e 's/^ *File was already downloaded //p'
}
# setuptools: the build backend of `pip install .` (pyproject's build-system), needed offline too.
# async-timeout: redis needs it below Python 3.11.3 (Debian bookworm's python3 is 3.11.2), which this host may not be.
wheels=$( { download $deps "setuptools>=77" wheel "async-timeout>=4.0.3"; \
            download --no-deps $($PYTHON scripts/pins.py --no-deps); } | sort -u)
[ -n "$wheels" ] || { echo "wheelhouse: pip resolved no wheels" >&2; exit 1; }
find "$WH" -name '*.whl' -delete
# Linked where the cache shares the file system, else copied.
for w in $wheels; do ln "$w" "$WH/" 2>/dev/null || cp "$w" "$WH/"; done
echo "wheelhouse: $(ls "$WH"/*.whl | wc -l) wheels, $(du -shL "$WH" | cut -f1) (linked from $CACHE)"
