#!/usr/bin/env bash
# Fill docker/wheelhouse/ with every wheel the image installs, at the pins of pyproject.toml, using this machine's pip
# configuration (its local wheel folders and index); the image build then installs from it with --no-index, without
# reaching any index itself. Re-running only fetches what is missing. The folder is git-ignored.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
WH=docker/wheelhouse
mkdir -p "$WH"
deps=$($PYTHON -c "import tomllib; print(' '.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))")
# setuptools: the build backend of `pip install .` (pyproject's build-system), needed offline too.
# async-timeout: redis needs it below Python 3.11.3 (Debian bookworm's python3 is 3.11.2), which this host may not be.
$PYTHON -m pip download -q --progress-bar off --only-binary=:all: -d "$WH" $deps "setuptools>=77" wheel "async-timeout>=4.0.3" \
    2> >(grep -v "^WARNING: Location" >&2)
$PYTHON -m pip download -q --progress-bar off --only-binary=:all: --no-deps -d "$WH" $($PYTHON scripts/pins.py --no-deps) \
    2> >(grep -v "^WARNING: Location" >&2)
echo "wheelhouse: $(ls "$WH"/*.whl | wc -l) wheels, $(du -sh "$WH" | cut -f1)"
