"""Detector checkpoint directory (config.json, model.safetensors, labels.json, manifest.json) and fingerprint."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from safetensors import SafetensorError

from ..checkpoint import (CONFIG, DETECTOR_KIND, LABELS, WEIGHTS, CheckpointError, load_state_strict, load_weights, save_weights, unreadable,
                          verify_manifest, write_manifest)
from .config import DetectorConfig
from .model import RegionDetector

KIND = DETECTOR_KIND  # manifest.json's kind of a detector directory


def fingerprint_of(manifest: dict) -> str:
    """Detector identity for feature-cache keys: changes whenever its weights or config change."""
    files = manifest["files"]
    return hashlib.sha256(f"{files[CONFIG]}:{files[WEIGHTS]}".encode()).hexdigest()[:16]


def save_detector(detector: RegionDetector, out_dir: str | Path, extra: dict | None = None) -> str:
    """Write the detector directory; returns its fingerprint."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = detector.config
    (out / CONFIG).write_text(json.dumps(cfg.to_dict(), indent=2))
    state = {k: v.detach().cpu().contiguous() for k, v in detector.state_dict().items()}
    save_weights(state, out / WEIGHTS)
    (out / LABELS).write_text(json.dumps({"objects": cfg.classes, "attributes": cfg.attributes}, indent=2))
    manifest = write_manifest(out, [CONFIG, WEIGHTS, LABELS], {"kind": KIND, "feature_dim": cfg.feature_dim, **(extra or {})})
    return fingerprint_of(manifest)


def load_detector(path: str | Path, device: str = "cpu") -> tuple[RegionDetector, str]:
    """Verify and load a detector directory -> (detector in eval mode, fingerprint)."""
    path = Path(path)
    manifest = verify_manifest(path, "detector")
    kind = manifest.get("kind")
    if kind != KIND:
        what = ("an encoder checkpoint (its manifest names no kind; are the encoder's and the detector's directories "
                "swapped?)" if kind is None else f"a directory of kind {kind!r}")
        raise CheckpointError(f"{path} is not a detector directory but {what}")
    try:
        cfg = DetectorConfig.from_dict(json.loads((path / CONFIG).read_text(encoding="utf-8")))
    except OSError as exc:  # a file the manifest does not list may be missing
        raise unreadable(exc, path, path / CONFIG) from None
    except (ValueError, TypeError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CheckpointError(f"{path / CONFIG}: {exc}") from None
    detector = RegionDetector(cfg, pretrained_backbone=False)
    try:
        state = load_weights(path / WEIGHTS)
    except OSError as exc:
        raise unreadable(exc, path, path / WEIGHTS) from None
    except SafetensorError as exc:
        raise CheckpointError(f"{path / WEIGHTS}: unreadable ({exc})") from None
    load_state_strict(detector, state, path / WEIGHTS)
    return detector.to(device).eval(), fingerprint_of(manifest)
