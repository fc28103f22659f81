"""Region-feature files: our append-only record file for extraction runs, and the LXMERT `obj36` TSV.

Record file (one file per extraction run, suffix `.vlfeat` by convention), all integers little-endian:

    header  MAGIC (8 bytes) | u32 format version | u32 n | n bytes of JSON meta (e.g. detector fingerprint)
    record  RECORD_MAGIC (4 bytes) | u32 k | u64 v | k bytes image id (UTF-8) | v bytes RegionFeatures.to_bytes()
            | u32 CRC32 of id + value

Records are only ever appended, so an interrupted run leaves at worst one torn record at the end: readers
ignore it (`FeatureFile.truncated_bytes` says how much) and `FeatureFileWriter` cuts it off before
resuming. The same image id written twice resolves to the last record. Damage to the structure before the tail
raises FeatureFormatError on opening; a record whose bytes fail their CRC raises when it is read, and a resuming
writer checks every record's CRC, so such a record is written again rather than counted as done. A writer holds
an exclusive lock on the file (`lock_for_writing`) while it is open: a second writer is refused (or waits), not
interleaved; on a file system without flock(2) it goes on unlocked, with a warning.

obj36 TSV (airsplay/lxmert, bottom-up-attention): one image per line, tab separated, no header, columns
FIELDNAMES; array columns are base64 of raw little-endian numpy bytes (ids int64, confidences and boxes
float32, features float32 (num_boxes, D)). Only the real regions are written (no padding rows, no
whole-image feature); reading gives float32 features and N = num_boxes.
"""
from __future__ import annotations

import base64
import binascii
import csv
import errno
import fcntl
import json
import logging
import os
import stat
import struct
import sys
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import BinaryIO

import numpy as np

from .region_features import FeatureFormatError, RegionFeatures

MAGIC = b"VLSFEAT\n"
FILE_VERSION = 1  # of the record layout; the values carry their own RegionFeatures format version
RECORD_MAGIC = b"REC\x00"
_FILE_HEADER = struct.Struct("<8sII")  # magic, version, meta length
_RECORD_HEADER = struct.Struct("<4sIQ")  # magic, id length, value length
_CRC = struct.Struct("<I")
# flock(2) errors that say the file system cannot lock (Lustre without -o flock, some NFS, FUSE and 9p mounts), not
# that another process holds the lock
_NO_LOCKING = {errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.EBADF}

log = logging.getLogger(__name__)


class FileLockedError(OSError):
    """Another process holds the write lock of an output file."""


def lock_for_writing(path: str | os.PathLike, wait: bool = False) -> BinaryIO:
    """`path` opened for reading and writing (created empty if absent) with an exclusive lock held until it is closed.

    Two runs appending to one file would write over each other's records; the second is refused instead
    (FileLockedError), or with `wait` blocks until the first has closed it. The lock is flock(2) on the file itself, so
    it goes with the process: a killed run leaves no stale lock behind. On a file system that cannot flock, the file
    is opened unlocked and a warning says so. Opening changes nothing in an existing file.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # a FIFO or device would block or swallow what is written
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            raise FileLockedError(f"{path}: another process is writing it (wait for it to end, or write to another "
                                  "file)") from None
        except OSError as exc:
            if exc.errno not in _NO_LOCKING:
                raise
            log.warning("cannot lock %s on this file system (%s): do not run two writers at once", path,
                        exc.strerror or exc)
        return os.fdopen(fd, "r+b")
    except BaseException:
        os.close(fd)
        raise


# --- record file ---

def _read_file_header(f) -> tuple[dict, int]:
    """(meta, offset of the first record); FeatureFormatError for a foreign or other-version file."""
    raw = f.read(_FILE_HEADER.size)
    if len(raw) < _FILE_HEADER.size:
        raise FeatureFormatError("too short for the header of a vlserve feature file")
    magic, version, meta_len = _FILE_HEADER.unpack(raw)
    if magic != MAGIC:
        raise FeatureFormatError("not a vlserve feature file (bad magic)")
    if version != FILE_VERSION:
        raise FeatureFormatError(f"feature file version {version}, this code reads {FILE_VERSION}")
    meta_raw = f.read(meta_len)
    try:
        meta = json.loads(meta_raw)
    except (ValueError, RecursionError) as e:
        raise FeatureFormatError(f"feature file meta is not JSON: {e}") from None
    if len(meta_raw) < meta_len or not isinstance(meta, dict):
        raise FeatureFormatError("feature file meta is not a JSON object")
    return meta, _FILE_HEADER.size + meta_len


def _record_crc(f, offset: int, key_len: int, value_len: int) -> tuple[int, int]:
    """(stored CRC, computed CRC) of the record at `offset`."""
    f.seek(offset + _RECORD_HEADER.size)
    body = f.read(key_len + value_len)
    stored = f.read(_CRC.size)
    if len(stored) < _CRC.size:
        return -1, zlib.crc32(body)
    return _CRC.unpack(stored)[0], zlib.crc32(body)


def _zeros_to_end(f, offset: int) -> bool:
    f.seek(offset)
    while chunk := f.read(1 << 20):
        if chunk.count(0) != len(chunk):
            return False
    return True


def _scan(f, start: int, size: int) -> tuple[dict[str, tuple[int, int, int]], int]:
    """Index {image_id: (record offset, id length, value length)} and the offset where good records end.

    Checks structure (magic, lengths) and the CRC of the last record only, so opening stays cheap:
    a torn tail is left out, damage before it raises FeatureFormatError.
    """
    records: list[tuple[str, int, int, int]] = []
    offset = start
    while offset < size:
        f.seek(offset)
        raw = f.read(_RECORD_HEADER.size)
        if len(raw) < _RECORD_HEADER.size:
            break  # torn header at the tail
        magic, key_len, value_len = _RECORD_HEADER.unpack(raw)
        end = offset + _RECORD_HEADER.size + key_len + value_len + _CRC.size
        if end > size:
            break  # torn record at the tail (its lengths may be garbage too)
        if magic != RECORD_MAGIC:
            if _zeros_to_end(f, offset):
                break  # a crash can leave the tail zero-filled
            raise FeatureFormatError(f"bad record magic at byte {offset}")
        try:
            image_id = f.read(key_len).decode("utf-8")
        except UnicodeDecodeError:
            raise FeatureFormatError(f"image id at byte {offset} is not UTF-8") from None
        records.append((image_id, offset, key_len, value_len))
        offset = end
    if records and offset == size:  # complete length, but the last write may still be torn
        stored, computed = _record_crc(f, *records[-1][1:])
        if stored != computed:
            offset = records.pop()[1]
    return {image_id: tuple(rest) for image_id, *rest in records}, offset


class FeatureFile(Mapping[str, RegionFeatures]):
    """Read-only mapping image_id -> RegionFeatures over a record file; values are read on access."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._f = open(self.path, "rb")
        try:
            self.meta, start = _read_file_header(self._f)
            size = os.fstat(self._f.fileno()).st_size
            self._index, end = _scan(self._f, start, size)
            self.truncated_bytes = size - end  # a torn last record left by an interrupted run
        except FeatureFormatError as e:
            self._f.close()
            raise FeatureFormatError(f"{self.path}: {e}") from None
        except BaseException:
            self._f.close()
            raise

    def __getitem__(self, image_id: str) -> RegionFeatures:
        offset, key_len, value_len = self._index[image_id]
        stored, computed = _record_crc(self._f, offset, key_len, value_len)
        if stored != computed:
            raise FeatureFormatError(f"{self.path}: record {image_id!r} at byte {offset} is corrupt (CRC)")
        self._f.seek(offset + _RECORD_HEADER.size + key_len)
        return RegionFeatures.from_bytes(self._f.read(value_len))

    def corrupt_ids(self) -> list[str]:
        """Ids whose record fails its CRC. Reads every record, which opening does not (it checks the structure and
        the last record only)."""
        corrupt = []
        for image_id, (offset, key_len, value_len) in self._index.items():
            stored, computed = _record_crc(self._f, offset, key_len, value_len)
            if stored != computed:
                corrupt.append(image_id)
        return corrupt

    def __iter__(self) -> Iterator[str]:
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, image_id: object) -> bool:
        return image_id in self._index

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> FeatureFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _meta_difference(there: dict, here: dict) -> str:
    """The meta entries that differ, as a refused resume names them: "written with detector 'a', this run writes
    detector 'b'"."""
    keys = sorted(k for k in there.keys() | here.keys() if there.get(k) != here.get(k))

    def entries(meta: dict) -> str:
        return ", ".join(f"{k} {meta[k]!r}" if k in meta else f"no {k}" for k in keys)

    return f"written with {entries(there)}, this run writes {entries(here)}"


class FeatureFileWriter:
    """Appends records to a feature file, holding its write lock until closed; an existing file is resumed (meta must
    match unless it holds no records, torn tail cut).

    `written` holds the ids whose record is whole and passes its CRC; `corrupt` the ids whose (last) record fails it,
    which a resume writes again (the new record is the one readers get).
    """

    def __init__(self, path: str | os.PathLike, meta: dict | None = None, *,
                 also_resumes: Callable[[dict], bool] | None = None, wait: bool = False):
        """`also_resumes`: whether an existing file's meta other than `meta` is resumed too (`self.meta` is then the
        file's meta); `wait`: block while another process writes the file rather than raise FileLockedError."""
        self.path = Path(path)
        meta = {} if meta is None else json.loads(json.dumps(meta))  # JSON-normalized, to compare on resume
        self._f = lock_for_writing(self.path, wait=wait)
        try:
            self.written: set[str] = set()
            self.corrupt: list[str] = []
            if os.fstat(self._f.fileno()).st_size > 0:
                with FeatureFile(self.path) as existing:
                    if len(existing) and existing.meta != meta:
                        if also_resumes is None or not also_resumes(existing.meta):
                            raise FeatureFormatError(f"{self.path}: {_meta_difference(existing.meta, meta)}; a "
                                                     "feature file is resumed only with the settings that began it")
                        meta = existing.meta
                    self.corrupt = existing.corrupt_ids()
                    self.written = set(existing).difference(self.corrupt)
                    good_end = os.fstat(self._f.fileno()).st_size - existing.truncated_bytes
                    if not len(existing):  # no records: the header is written anew with this meta
                        good_end = 0
                self._f.truncate(good_end)
                self._f.seek(good_end)
            if self._f.tell() == 0:  # new, created by a run stopped before its header was written, or with no records
                meta_raw = json.dumps(meta, sort_keys=True).encode()
                self._f.write(_FILE_HEADER.pack(MAGIC, FILE_VERSION, len(meta_raw)) + meta_raw)
                self._f.flush()
        except BaseException:
            self._f.close()
            raise
        self.meta = meta

    def __contains__(self, image_id: str) -> bool:
        return image_id in self.written

    def append(self, image_id: str, features: RegionFeatures) -> None:
        """Write one record and flush it, so an interruption loses at most this record."""
        key, value = image_id.encode("utf-8"), features.to_bytes()
        crc = zlib.crc32(value, zlib.crc32(key))
        self._f.write(_RECORD_HEADER.pack(RECORD_MAGIC, len(key), len(value)) + key + value + _CRC.pack(crc))
        self._f.flush()
        self.written.add(image_id)

    def close(self, fsync: bool = True) -> None:
        if self._f.closed:
            return
        self._f.flush()
        if fsync:
            os.fsync(self._f.fileno())
        self._f.close()

    def __enter__(self) -> FeatureFileWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def write_feature_file(path: str | os.PathLike, items: Iterable[tuple[str, RegionFeatures]],
                       meta: dict | None = None) -> int:
    """Append (image_id, features) pairs to `path` (created or resumed); returns how many were written."""
    count = 0
    with FeatureFileWriter(path, meta) as writer:
        for image_id, features in items:
            writer.append(image_id, features)
            count += 1
    return count


def read_feature_file(path: str | os.PathLike) -> dict[str, RegionFeatures]:
    """Every record of a feature file, loaded into memory."""
    with FeatureFile(path) as f:
        return dict(f.items())


# --- LXMERT / bottom-up-attention obj36 TSV ---

FIELDNAMES = ["img_id", "img_h", "img_w", "objects_id", "objects_conf",
              "attrs_id", "attrs_conf", "num_boxes", "boxes", "features"]
# TSV column -> (RegionFeatures field, dtype in the file, whether it is (num_boxes, k) rather than (num_boxes,))
_TSV_ARRAYS = {
    "objects_id": ("obj_ids", np.dtype("<i8"), False),
    "objects_conf": ("obj_scores", np.dtype("<f4"), False),
    "attrs_id": ("attr_ids", np.dtype("<i8"), False),
    "attrs_conf": ("attr_scores", np.dtype("<f4"), False),
    "boxes": ("boxes", np.dtype("<f4"), True),
    "features": ("features", np.dtype("<f4"), True),
}


def _raise_csv_field_limit() -> None:
    """A features field (36 x 2048 float32 in base64) is ~400 KB, far over csv's default 128 KB limit."""
    limit = sys.maxsize
    while True:
        try:
            csv.field_size_limit(limit)
            return
        except OverflowError:  # C long is 32-bit on some platforms
            limit //= 2


def encode_obj_row(image_id: str, features: RegionFeatures) -> dict[str, str]:
    """One TSV row (FIELDNAMES -> text) with the real regions of `features`."""
    if any(c in image_id for c in "\t\r\n"):
        raise ValueError(f"img_id: {image_id!r} contains a tab or newline")
    real = features.trimmed()
    row = {"img_id": image_id, "img_h": str(real.image_hw[0]), "img_w": str(real.image_hw[1]),
           "num_boxes": str(real.num_boxes)}
    for column, (field, dtype, _) in _TSV_ARRAYS.items():
        row[column] = base64.b64encode(getattr(real, field).astype(dtype).tobytes()).decode("ascii")
    return row


def decode_obj_row(row: Mapping[str, str | None]) -> tuple[str, RegionFeatures]:
    """(img_id, RegionFeatures) from one TSV row; FeatureFormatError if it does not parse."""
    try:
        if row.get(None) or any(row.get(k) is None for k in FIELDNAMES):  # extra / missing columns
            raise ValueError(f"expected {len(FIELDNAMES)} tab-separated columns")
        num_boxes = int(row["num_boxes"])
        arrays = {}
        for column, (field, dtype, is_matrix) in _TSV_ARRAYS.items():
            flat = np.frombuffer(base64.b64decode(row[column], validate=True), dtype=dtype)
            if is_matrix:
                width = 4 if column == "boxes" else (flat.size // num_boxes if num_boxes else 0)
                arrays[field] = flat.reshape(num_boxes, width)
            else:
                arrays[field] = flat.reshape(num_boxes)
        image_hw = (int(row["img_h"]), int(row["img_w"]))
        return row["img_id"], RegionFeatures(**arrays, image_hw=image_hw, num_boxes=num_boxes)
    except (ValueError, TypeError, binascii.Error) as e:
        raise FeatureFormatError(f"obj36 TSV row {row.get('img_id')!r}: {e}") from None


_DIGITS = b"0123456789"
_BASE64 = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/="
# the bytes each column of a row holds as encode_obj_row writes it; None: the id, anything but a tab or line break
_COLUMN_BYTES = {"img_id": None, "img_h": _DIGITS, "img_w": _DIGITS, "num_boxes": _DIGITS,
                 **{column: _BASE64 for column in _TSV_ARRAYS}}


def obj_row_prefix_columns(chunks: Iterable[bytes]) -> int | None:
    """How many whole columns the bytes of an unfinished line hold, if they could be the start of a row that
    encode_obj_row writes (each column's bytes of its kind: digits, base64; at most len(FIELDNAMES) columns); None
    if they could not. What a write cut short leaves as a TSV's last line passes; most other text does not."""
    column, length = 0, 0  # the column being read, and its bytes so far
    for chunk in chunks:
        for i, piece in enumerate(chunk.split(b"\t")):
            if i:  # a tab ended the column
                if length == 0 and _COLUMN_BYTES[FIELDNAMES[column]] is _DIGITS:
                    return None  # a number column is never empty (a base64 one is for zero regions)
                column, length = column + 1, 0
                if column == len(FIELDNAMES):
                    return None
            allowed = _COLUMN_BYTES[FIELDNAMES[column]]
            if allowed is None:
                if b"\r" in piece:
                    return None
            elif piece.translate(None, allowed):  # bytes left once those of the column's kind are deleted
                return None
            length += len(piece)
    return column


def write_obj_tsv(path: str | os.PathLike, items: Iterable[tuple[str, RegionFeatures]], append: bool = False) -> int:
    """Write (img_id, features) pairs as obj36 TSV lines; returns how many were written."""
    count = 0
    with open(path, "a" if append else "w", newline="") as f:
        writer = csv.DictWriter(f, FIELDNAMES, delimiter="\t", lineterminator="\n")
        for image_id, features in items:
            writer.writerow(encode_obj_row(image_id, features))
            count += 1
    return count


def read_obj_tsv(path: str | os.PathLike, topk: int | None = None) -> Iterator[tuple[str, RegionFeatures]]:
    """Yield (img_id, RegionFeatures) per line (the first `topk` lines if given); bad lines -> FeatureFormatError, and
    so is a file that is not UTF-8 text (a binary file such as our record file)."""
    _raise_csv_field_limit()
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f, FIELDNAMES, delimiter="\t")
        try:
            for i, row in enumerate(reader):
                if topk is not None and i >= topk:
                    return
                try:
                    yield decode_obj_row(row)
                except FeatureFormatError as e:
                    raise FeatureFormatError(f"{path} line {reader.line_num}: {e}") from None
        except (UnicodeDecodeError, csv.Error) as e:  # read a chunk at a time: no line to name
            raise FeatureFormatError(f"{path}: not an obj36 TSV feature file ({e})") from None
