"""Batch extraction of region features for folders of images, resumable, to our record file or obj36 TSV."""
from __future__ import annotations

import hashlib
import logging
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from ..feature_files import FeatureFileWriter, FeatureFormatError, read_obj_tsv, write_obj_tsv
from ..images import DEFAULT_MAX_PIXELS, ImageError, load_image
from ..region_features import RegionFeatures
from .model import RegionDetector

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff"}


@dataclass
class ExtractionReport:
    written: int = 0  # images extracted in this run
    already_done: int = 0  # images found in the output from an earlier, interrupted run
    failed: list[tuple[str, str]] = field(default_factory=list)  # (path, reason) of images that could not be read
    # or that the detector failed on
    duplicates: list[tuple[str, str]] = field(default_factory=list)  # (path, earlier input with the same bytes) in
    # sha256 mode: the record of that input is theirs


def extract_each(detector: RegionDetector, images: list, batch_size: int) -> list[RegionFeatures | Exception]:
    """The detector's regions of each image, batched; should a batch fail, its images run again one at a time
    (extraction is batch-invariant: the others get the regions the batch would have given them), so an image that
    breaks the detector costs its own result only: its exception stands in its place, for the caller to report."""
    if len(images) == 1:
        return [_extract_alone(detector, images[0])]
    try:
        return detector.extract(images, batch_size)
    except Exception:
        log.exception("detector: a batch of %d images failed; running them one at a time", len(images))
    return [_extract_alone(detector, image) for image in images]


def _extract_alone(detector: RegionDetector, image) -> RegionFeatures | Exception:
    try:
        return detector.extract([image])[0]
    except Exception as exc:
        return exc


def find_images(inputs: list[Path]) -> list[Path]:
    """Files as given, plus every file with an image suffix under the given folders, sorted."""
    found: list[Path] = []
    for item in inputs:
        if item.is_dir():
            found += sorted(p for p in item.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
        elif item.exists():
            found.append(item)
        else:
            raise FileNotFoundError(f"no such file or folder: {item}")
    return found


def _hash_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def image_ids(paths: list[Path], mode: str, report: ExtractionReport) -> list[tuple[Path, str]]:
    """(path, id) of each input to extract: its file stem (unique among the inputs, else ValueError) or the sha256 of
    its bytes (the service's image_id). Only regular files are read (a FIFO would block the run); the others, and in
    sha256 mode files that cannot be read, go to report.failed. A file with the bytes of an earlier one goes to
    report.duplicates: one record per id."""
    keyed: list[tuple[Path, str]] = []
    for p in paths:
        try:
            regular = stat.S_ISREG(p.stat().st_mode)
        except OSError as exc:
            report.failed.append((str(p), f"cannot read {p}: {exc.strerror or exc}"))
            continue
        if not regular:
            report.failed.append((str(p), "not a regular file (a FIFO, device or socket is not read)"))
            continue
        if mode != "sha256":
            keyed.append((p, p.stem))
            continue
        try:
            keyed.append((p, _hash_file(p)))
        except OSError as exc:
            report.failed.append((str(p), f"cannot read {p}: {exc.strerror or exc}"))
    seen: dict[str, Path] = {}
    unique = []
    for p, i in keyed:
        if i not in seen:
            seen[i] = p
            unique.append((p, i))
        elif mode == "sha256":
            report.duplicates.append((str(p), str(seen[i])))
        else:
            raise ValueError(f"two images share the id {i!r} ({seen[i]} and {p}); use --ids sha256")
    return unique


def _tsv_done(path: Path) -> set[str]:
    """Ids already in a TSV, after cutting off a torn last line left by an interrupted run. The whole lines are read
    as rows first and the torn one must start like a row (an id, then a tab), so a file that is not such a TSV is
    refused (FeatureFormatError) as it is, never cut."""
    if not path.exists():
        return set()
    lines, end, size = 0, 0, 0  # whole lines, the byte after the last of them, the file's size
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            if (n := chunk.count(b"\n")) > 0:
                lines, end = lines + n, size + chunk.rfind(b"\n") + 1
            size += len(chunk)
        f.seek(end)
        torn = f.read(min(size - end, 4096))
    done = {image_id for image_id, _ in read_obj_tsv(path, topk=lines)}
    if end < size:
        if b"\t" not in torn:
            raise FeatureFormatError(f"{path} line {lines + 1}: neither an obj36 TSV row nor the start of one "
                                     "(the file is left as it is)")
        with open(path, "r+b") as f:
            f.truncate(end)
    return done


def _batches(items: list, size: int) -> Iterator[list]:
    for s in range(0, len(items), size):
        yield items[s : s + size]


def extract_folder(
    detector: RegionDetector,
    fingerprint: str,
    inputs: list[Path],
    out: Path,
    fmt: str = "vlfeat",
    batch_size: int = 8,
    ids: str = "stem",
    max_pixels: int = DEFAULT_MAX_PIXELS,
    progress: bool = True,
) -> ExtractionReport:
    """Extract every image under inputs into out; images already in out are skipped (resume)."""
    if fmt not in ("vlfeat", "tsv"):
        raise ValueError(f"unknown output format {fmt!r}; choose vlfeat or tsv")
    report = ExtractionReport()
    keyed = image_ids(find_images(inputs), ids, report)
    writer = FeatureFileWriter(out, meta={"detector": fingerprint}) if fmt == "vlfeat" else None
    done = set(writer.written) if writer else _tsv_done(out)
    todo = [(p, k) for p, k in keyed if k not in done]
    report.already_done = len(keyed) - len(todo)
    try:
        bar = tqdm(total=len(todo), desc="extract", unit="img", disable=not progress)
        for chunk in _batches(todo, batch_size):
            images, loaded = [], []
            for path, key in chunk:
                try:
                    images.append(load_image(path, max_pixels))
                    loaded.append((path, key))
                except ImageError as exc:
                    report.failed.append((str(path), str(exc)))
            done = []
            for (path, key), rf in zip(loaded, extract_each(detector, images, batch_size) if images else []):
                if isinstance(rf, Exception):
                    report.failed.append((str(path), f"the detector failed on it: {rf}"))
                else:
                    done.append((key, rf))
            if writer:
                for key, rf in done:
                    writer.append(key, rf)
            else:
                write_obj_tsv(out, done, append=True)
            report.written += len(done)
            bar.update(len(chunk))
        bar.close()
    finally:
        if writer:
            writer.close()
    return report

