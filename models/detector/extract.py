"""Batch extraction of region features for folders of images, resumable, to our record file or obj36 TSV.

An output is written by one run at a time (its write lock; a second run is refused) and resumed by a later run with
the same settings: what it holds is checked before anything is added (every record's CRC, the TSV's rows, the id
scheme), and in stem mode each id's image is remembered by its sha256 in `OUT.sources`, so a later image with the
name of a done one is told apart rather than taken as done.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import stat
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from ..feature_files import (
    FIELDNAMES, FeatureFileWriter, FeatureFormatError, lock_for_writing, obj_row_prefix_columns, read_obj_tsv,
    write_obj_tsv,
)
from ..images import DEFAULT_MAX_PIXELS, ImageError, load_image
from ..region_features import RegionFeatures
from .model import RegionDetector

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff"}
_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass
class ExtractionReport:
    written: int = 0  # images extracted in this run
    already_done: int = 0  # images found in the output from an earlier, interrupted run
    failed: list[tuple[str, str]] = field(default_factory=list)  # (path, reason) of images that could not be read
    # or that the detector failed on
    duplicates: list[tuple[str, str]] = field(default_factory=list)  # (path, earlier input with the same bytes): the
    # record of that input is theirs
    redone: list[str] = field(default_factory=list)  # ids whose record in the output failed its CRC, written again
    corrupt: list[str] = field(default_factory=list)  # ids whose record in the output fails its CRC and that this
    # run did not write again (no input has the id, or its image failed)


class Input(NamedTuple):
    path: Path
    image_id: str
    sha256: str  # of the file's bytes


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
    """Files as given, plus everything with an image suffix under the given folders, sorted; a path met again (a file
    also inside a given folder, a folder given twice) is listed once. Entries of a folder that are not regular files
    (a symlink loop, a dangling link, a FIFO) are listed too, so that image_ids reports them rather than they vanish."""
    found: list[Path] = []
    for item in inputs:
        if item.is_dir():
            found += sorted(p for p in item.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and not p.is_dir())
        elif item.exists():
            found.append(item)
        else:
            raise FileNotFoundError(f"no such file or folder: {item}")
    seen: set[Path] = set()
    unique = []
    for p in found:
        if p.absolute() not in seen:
            seen.add(p.absolute())
            unique.append(p)
    return unique


def _hash_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _stem_problem(stem: str, fmt: str) -> str | None:
    """Why a file stem cannot be an image id in this output format, or None."""
    try:
        stem.encode("utf-8")
    except UnicodeEncodeError:  # the name's bytes are not UTF-8 (Python holds them as surrogates)
        return "its file name is not UTF-8, so it cannot be an image id; rename it, or use --ids sha256"
    if fmt == "tsv" and any(c in stem for c in "\t\r\n"):
        return ("its file name holds a tab or a line break, which an obj36 TSV img_id cannot; rename it, or use "
                "--ids sha256")
    return None


def image_ids(paths: list[Path], mode: str, report: ExtractionReport, fmt: str = "vlfeat",
              progress: bool = False) -> list[Input]:
    """The inputs to extract, with their id: the file stem or the sha256 of the bytes (the service's image_id); the
    sha256 of each is read either way (it tells images apart across runs in stem mode).

    Only regular files are read (a FIFO would block the run); the others, files that cannot be read, and in stem mode
    names that cannot be an id in `fmt`, go to report.failed. A file with the bytes of an earlier one of the same id
    goes to report.duplicates (one record per id); in stem mode two files of one id and other bytes are ValueError.
    """
    keyed: list[Input] = []
    for p in tqdm(paths, desc="read", unit="img", disable=not progress, leave=False, delay=2):  # shown if it lasts
        try:
            regular = stat.S_ISREG(p.stat().st_mode)
        except OSError as exc:
            report.failed.append((str(p), f"cannot read {p}: {exc.strerror or exc}"))
            continue
        if not regular:
            report.failed.append((str(p), "not a regular file (a FIFO, device or socket is not read)"))
            continue
        if mode != "sha256" and (problem := _stem_problem(p.stem, fmt)):
            report.failed.append((str(p), problem))
            continue
        try:
            digest = _hash_file(p)
        except OSError as exc:
            report.failed.append((str(p), f"cannot read {p}: {exc.strerror or exc}"))
            continue
        keyed.append(Input(p, digest if mode == "sha256" else p.stem, digest))
    seen: dict[str, Input] = {}
    unique = []
    for item in keyed:
        first = seen.setdefault(item.image_id, item)
        if first is item:
            unique.append(item)
        elif first.sha256 == item.sha256:
            report.duplicates.append((str(item.path), str(first.path)))
        else:
            raise ValueError(f"two images share the id {item.image_id!r} ({first.path} and {item.path}); "
                             "use --ids sha256")
    return unique


def is_sha256_id(image_id: str) -> bool:
    return _SHA256.fullmatch(image_id) is not None


def _tsv_done(path: Path) -> set[str]:
    """Ids already in a TSV, after cutting off a torn last line left by an interrupted run.

    Every whole line must be an obj36 row, and the unfinished last line the start of one (obj_row_prefix_columns);
    when no whole row shows that the file is an obj36 TSV, that start must also reach the num_boxes column (past the
    id, the image size and four base64 columns): a short line of tab-separated text is more likely a user's file than
    a run stopped within its first few hundred bytes. Anything else is refused (FeatureFormatError) with the file as
    it is: a file that may not be ours is never cut.
    """
    lines, end, size = 0, 0, 0  # whole lines, the byte after the last of them, the file's size
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            if (n := chunk.count(b"\n")) > 0:
                lines, end = lines + n, size + chunk.rfind(b"\n") + 1
            size += len(chunk)
        done = {image_id for image_id, _ in read_obj_tsv(path, topk=lines)}
        if end == size:
            return done
        f.seek(end)
        columns = obj_row_prefix_columns(iter(lambda: f.read(1 << 20), b""))
    if columns is None or (lines == 0 and columns < FIELDNAMES.index("num_boxes")):
        raise FeatureFormatError(f"{path} line {lines + 1}: neither an obj36 TSV row nor the start of one "
                                 "(the file is left as it is)")
    with open(path, "r+b") as f:
        f.truncate(end)
    return done


def _check_id_scheme(path: Path, done: set[str], inputs: list[Input], mode: str) -> None:
    """Refuse a resume that would mix id schemes in an output that does not record its scheme (a TSV, a .vlfeat whose
    meta has no "ids"): sha256 ids are 64 hex digits, stems nearly never are; an output with no ids fits either."""
    stems = sorted(i for i in done if not is_sha256_id(i))
    if mode == "sha256" and stems:
        raise FeatureFormatError(f"{path} holds ids that are not sha256 digests (such as {stems[0]!r}): it was "
                                 "written with --ids stem; resume it with --ids stem, or write to another --out")
    if mode == "stem" and done and not stems and not all(is_sha256_id(i.image_id) for i in inputs):
        raise FeatureFormatError(f"{path} holds sha256 ids only: it was written with --ids sha256; resume it with "
                                 "--ids sha256, or write to another --out")


class SourceList:
    """`OUT.sources`, beside an output written in stem mode: one JSON line {"id", "sha256"} per image written (the
    last line of an id counts), the line before its record, so every done id whose line is there can be checked.

    Written under the output's lock; a torn last line (an interrupted run) is cut before appending, and a file of
    that name that is not such a list is refused as it is.
    """

    def __init__(self, out: Path):
        self.path = out.with_name(out.name + ".sources")
        self._f = None
        self._keep = 0  # bytes of the list to keep when the first line is added

    def read(self) -> tuple[dict[str, str], int]:
        """({id: sha256}, the byte after the last whole line); empty if there is no list."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return {}, 0
        end = data.rfind(b"\n") + 1
        sources = {}
        for number, line in enumerate(data[:end].split(b"\n")[:-1], 1):
            try:
                entry = json.loads(line)
                image_id, digest = entry["id"], entry["sha256"]
                if not isinstance(image_id, str) or not is_sha256_id(digest):
                    raise ValueError
            except (ValueError, TypeError, KeyError, RecursionError):
                raise FeatureFormatError(f"{self.path} line {number}: not a line of the list of sources vlserve "
                                         "extract keeps beside its output (the file is left as it is)") from None
            sources[image_id] = digest
        return sources, end

    def begin(self, new: bool) -> dict[str, str]:
        """What the list holds, for an output that has records (`new`: one that has none, whose list starts anew
        with the first line added)."""
        sources, self._keep = self.read()  # read even when new: a file of that name that is not a list is refused
        if new:
            sources, self._keep = {}, 0
        return sources

    def add(self, image_id: str, digest: str) -> None:
        if self._f is None:  # the file is made or cut only once there is a line to write
            self._f = open(self.path, "r+b" if self.path.exists() else "wb")
            self._f.truncate(self._keep)
            self._f.seek(self._keep)
        self._f.write(json.dumps({"id": image_id, "sha256": digest}).encode() + b"\n")
        self._f.flush()

    def close(self) -> None:
        """Flush and fsync the list, as the output's writer does its records: a done id keeps its line on disk."""
        if self._f is not None and not self._f.closed:
            try:
                self._f.flush()
                os.fsync(self._f.fileno())
            finally:
                self._f.close()


def _check_sources(out: Path, done: set[str], inputs: list[Input], sources: dict[str, str]) -> None:
    """Refuse (ValueError) inputs whose id is done in `out` from other bytes: another image of the same name."""
    other = [i for i in inputs if i.image_id in done and sources.get(i.image_id, i.sha256) != i.sha256]
    if other:
        named = ", ".join(f"{i.path} ({i.image_id!r})" for i in other[:3])
        more = f" and {len(other) - 3} more" if len(other) > 3 else ""
        raise ValueError(f"{named}{more}: another image has that id in {out} (other bytes); rename it, write to "
                         "another --out, or use --ids sha256")


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
    if ids not in ("stem", "sha256"):
        raise ValueError(f"unknown id scheme {ids!r}; choose stem or sha256")
    report = ExtractionReport()
    paths = find_images(inputs)
    writer = lock = None
    sources = SourceList(out) if ids == "stem" else None
    try:
        # the output, locked for this run before any input is read (a second run is refused at once), and what it
        # holds; then the inputs, and the checks that need them
        meta = {"detector": fingerprint, "ids": ids}
        if fmt == "vlfeat":
            # a .vlfeat whose meta names the detector only does not record its id scheme: checked like a TSV
            writer = FeatureFileWriter(out, meta=meta, also_resumes=lambda there: there == {"detector": fingerprint})
            done, new = set(writer.written), not writer.written and not writer.corrupt
            corrupt = set(writer.corrupt)
        else:
            lock = lock_for_writing(out)
            done = _tsv_done(out)
            new, corrupt = not done, set()
        unrecorded = writer is None or writer.meta != meta  # the output does not say which id scheme wrote it
        if unrecorded and ids == "sha256":  # needs no input: refused before they are read
            _check_id_scheme(out, done | corrupt, [], ids)
        keyed = image_ids(paths, ids, report, fmt, progress)
        if unrecorded and ids == "stem":
            _check_id_scheme(out, done | corrupt, keyed, ids)
        if sources is not None:
            _check_sources(out, done, keyed, sources.begin(new))
        todo = [i for i in keyed if i.image_id not in done]
        report.already_done = len(keyed) - len(todo)
        written: set[str] = set()

        # extract batch by batch; each batch is on disk before the next starts
        with logging_redirect_tqdm(), tqdm(total=len(todo), desc="extract", unit="img", disable=not progress) as bar:
            for chunk in _batches(todo, batch_size):
                images, loaded = [], []
                for item in chunk:
                    try:
                        images.append(load_image(item.path, max_pixels))
                        loaded.append(item)
                    except ImageError as exc:
                        report.failed.append((str(item.path), str(exc)))
                extracted = []
                for item, rf in zip(loaded, extract_each(detector, images, batch_size) if images else []):
                    if isinstance(rf, Exception):
                        report.failed.append((str(item.path), f"the detector failed on it: {rf}"))
                    else:
                        extracted.append((item, rf))
                if sources is not None:  # before the records: a done id always has its line
                    for item, _ in extracted:
                        sources.add(item.image_id, item.sha256)
                if writer:
                    for item, rf in extracted:
                        writer.append(item.image_id, rf)
                else:
                    write_obj_tsv(out, [(item.image_id, rf) for item, rf in extracted], append=True)
                written.update(item.image_id for item, _ in extracted)
                bar.update(len(chunk))
        report.written = len(written)
        report.redone = sorted(corrupt & written)
        report.corrupt = sorted(corrupt - written)
    finally:
        with ExitStack() as closing:  # closed last to first: the sources list is on disk before the output's records
            for f in (writer, lock, sources):
                if f is not None:
                    closing.callback(f.close)
    return report

