"""Fixtures the CLI tests share."""
from __future__ import annotations

import pytest

from tests.service.conftest import build_tiny_checkpoint, build_tiny_detector


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(detector dir, checkpoint dir): a tiny detector and a tiny visualbert checkpoint of its regions (no test writes
    into them)."""
    root = tmp_path_factory.mktemp("models")
    detector = build_tiny_detector(root / "det")
    build_tiny_checkpoint(root / "ckpt", detector.fingerprint)
    return root / "det", root / "ckpt"
