"""Feature files: the append-only record file (resume, torn tails, damage) and the obj36 TSV."""
from __future__ import annotations

import base64
import csv
import os

import numpy as np
import pytest

from models.feature_files import (
    FIELDNAMES, FeatureFile, FeatureFileWriter, FileLockedError, decode_obj_row, encode_obj_row, lock_for_writing,
    obj_row_prefix_columns, read_feature_file, read_obj_tsv, write_feature_file, write_obj_tsv,
)
from models.region_features import FeatureFormatError, RegionFeatures

ARRAYS = ("boxes", "features", "obj_ids", "obj_scores", "attr_ids", "attr_scores")


def make_items(count: int = 4, n: int = 5, dim: int = 12, seed: int = 0) -> list[tuple[str, RegionFeatures]]:
    """(image_id, features) pairs with float32 features, all regions real (as obj36 files hold them)."""
    rng = np.random.default_rng(seed)
    items = []
    for i in range(count):
        h, w = int(rng.integers(40, 90)), int(rng.integers(40, 90))
        xy = rng.uniform(0, 20, (n, 2))
        items.append((f"COCO_val2014_{i:012d}", RegionFeatures(
            boxes=np.concatenate([xy, xy + rng.uniform(1, 20, (n, 2))], axis=1),
            features=rng.standard_normal((n, dim)).astype(np.float32),
            obj_ids=rng.integers(0, 1600, n), obj_scores=rng.uniform(size=n),
            attr_ids=rng.integers(0, 400, n), attr_scores=rng.uniform(size=n),
            image_hw=(h, w), num_boxes=n)))
    return items


def assert_identical(a: RegionFeatures, b: RegionFeatures) -> None:
    for name in ARRAYS:
        assert getattr(a, name).dtype == getattr(b, name).dtype, name
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
    assert (a.image_hw, a.num_boxes) == (b.image_hw, b.num_boxes)


# --- record file ---

def test_record_file_round_trip(tmp_path):
    path = tmp_path / "run.vlfeat"
    items = make_items()
    assert write_feature_file(path, items, meta={"detector": "abc"}) == 4
    with FeatureFile(path) as f:
        assert f.meta == {"detector": "abc"} and f.truncated_bytes == 0
        assert list(f) == [k for k, _ in items] and len(f) == 4 and items[2][0] in f
        for image_id, rf in items:
            assert_identical(f[image_id], rf.to_float16())
        with pytest.raises(KeyError):
            f["missing"]


def test_resume_after_a_torn_last_record(tmp_path):
    path = tmp_path / "run.vlfeat"
    items = make_items(count=5)
    write_feature_file(path, items[:3])
    good_size = os.path.getsize(path)
    write_feature_file(path, items[3:4])
    with open(path, "r+b") as f:  # interrupted while writing record 4
        f.truncate(good_size + 100)
    with FeatureFile(path) as f:
        assert list(f) == [k for k, _ in items[:3]] and f.truncated_bytes == 100
    with FeatureFileWriter(path) as writer:
        assert writer.written == {k for k, _ in items[:3]} and items[0][0] in writer
        for image_id, rf in items[3:]:
            writer.append(image_id, rf)
    back = read_feature_file(path)
    assert list(back) == [k for k, _ in items]
    for image_id, rf in items:
        assert_identical(back[image_id], rf.to_float16())


@pytest.mark.parametrize("tail", [b"R", b"REC\x00\x05", b"\x00" * 40])
def test_partial_header_or_zero_filled_tail_is_ignored(tmp_path, tail):
    path = tmp_path / "run.vlfeat"
    write_feature_file(path, make_items(count=2))
    with open(path, "ab") as f:
        f.write(tail)
    with FeatureFile(path) as f:
        assert len(f) == 2 and f.truncated_bytes == len(tail)


def test_torn_last_record_of_full_length_is_dropped_by_its_crc(tmp_path):
    path = tmp_path / "run.vlfeat"
    items = make_items(count=3)
    write_feature_file(path, items[:2])
    size = os.path.getsize(path)
    write_feature_file(path, items[2:])
    with open(path, "r+b") as f:
        f.seek(size + (os.path.getsize(path) - size) // 2)
        f.write(b"\x00" * 32)
    with FeatureFile(path) as f:
        assert list(f) == [items[0][0], items[1][0]]
    write_feature_file(path, items[2:])
    assert list(read_feature_file(path)) == [k for k, _ in items]


def test_damage_before_the_tail_raises(tmp_path):
    path = tmp_path / "run.vlfeat"
    items = make_items(count=3)
    write_feature_file(path, items)
    record_sizes = [16 + len(k.encode()) + len(rf.to_bytes()) + 4 for k, rf in items]  # header, id, value, CRC
    header = os.path.getsize(path) - sum(record_sizes)
    first_value = header + 16 + len(items[0][0])
    data = bytearray(path.read_bytes())
    data[first_value + 200] ^= 0xFF  # inside the first record's value
    path.write_bytes(bytes(data))
    with FeatureFile(path) as f:
        assert len(f) == 3
        assert_identical(f[items[1][0]], items[1][1].to_float16())
        with pytest.raises(FeatureFormatError, match="CRC"):
            f[items[0][0]]
    data[header] ^= 0xFF  # the first record's magic
    path.write_bytes(bytes(data))
    with pytest.raises(FeatureFormatError, match="magic"):
        FeatureFile(path)


@pytest.mark.parametrize("content", [b"", b"VLS", b"PK\x03\x04" + b"\x00" * 40, b"VLSFEAT\n\x02\x00\x00\x00\x00\x00\x00\x00"])
def test_foreign_or_other_version_file_raises(tmp_path, content):
    path = tmp_path / "x.vlfeat"
    path.write_bytes(content)
    with pytest.raises(FeatureFormatError):
        FeatureFile(path)


def test_resume_with_other_meta_raises_naming_what_differs(tmp_path):
    path = tmp_path / "run.vlfeat"
    write_feature_file(path, make_items(count=1), meta={"detector": "a", "ids": "stem"})
    with pytest.raises(FeatureFormatError) as e:
        FeatureFileWriter(path, meta={"detector": "b", "ids": "stem"})
    assert str(e.value) == (f"{path}: written with detector 'a', this run writes detector 'b'; a feature file is "
                            "resumed only with the settings that began it")
    with pytest.raises(FeatureFormatError, match="written with no extra, this run writes extra 1"):
        FeatureFileWriter(path, meta={"detector": "a", "ids": "stem", "extra": 1})


def test_errors_opening_a_file_name_it(tmp_path):
    path = tmp_path / "photo.vlfeat"
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 40)
    with pytest.raises(FeatureFormatError) as e:
        FeatureFile(path)
    assert str(e.value) == f"{path}: not a vlserve feature file (bad magic)"
    with pytest.raises(FeatureFormatError, match=f"^{path}: "):
        FeatureFileWriter(path)
    assert path.read_bytes() == b"\x89PNG\r\n\x1a\n" + b"\x00" * 40


# --- one writer at a time ---

def test_a_second_writer_is_refused_while_the_first_is_open(tmp_path):
    path = tmp_path / "run.vlfeat"
    items = make_items(count=3)
    with FeatureFileWriter(path, meta={"detector": "a"}) as first:
        first.append(*items[0])
        with pytest.raises(FileLockedError, match=f"^{path}: another process is writing it"):
            FeatureFileWriter(path, meta={"detector": "a"})
        with pytest.raises(FileLockedError):
            lock_for_writing(path)
        first.append(*items[1])
    with FeatureFileWriter(path, meta={"detector": "a"}) as second:  # the lock goes with the first writer
        assert second.written == {items[0][0], items[1][0]}
        second.append(*items[2])
    assert list(read_feature_file(path)) == [k for k, _ in items]


def test_lock_for_writing_creates_nothing_but_an_empty_file_and_refuses_a_fifo(tmp_path):
    with lock_for_writing(tmp_path / "new.tsv") as f:
        assert f.read() == b""
    assert (tmp_path / "new.tsv").read_bytes() == b""
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(OSError, match="not a regular file"):
        lock_for_writing(tmp_path / "fifo")


# --- every record checked on resume ---

def damage_value(path, image_id: str) -> None:
    """Damage the value of image_id's record (not the last one), as a bad disk or an overlapping writer would."""
    with FeatureFile(path) as f:
        offset, key_len, value_len = f._index[image_id]
    data = bytearray(path.read_bytes())
    data[offset + 16 + key_len + value_len // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_resuming_writer_counts_a_record_that_fails_its_crc_as_not_written(tmp_path):
    """Opening checks the last record's CRC only; a resume checks every record, so one damaged in the middle is
    written again (the new record is the one read) rather than taken as done."""
    path = tmp_path / "run.vlfeat"
    items = make_items(count=3)
    write_feature_file(path, items)
    damage_value(path, items[1][0])
    with FeatureFile(path) as f:
        assert len(f) == 3 and f.corrupt_ids() == [items[1][0]]
    with FeatureFileWriter(path) as writer:
        assert writer.corrupt == [items[1][0]] and writer.written == {items[0][0], items[2][0]}
        writer.append(*items[1])
    with FeatureFile(path) as f:
        assert f.corrupt_ids() == []
        assert_identical(f[items[1][0]], items[1][1].to_float16())


def test_last_record_of_an_id_wins(tmp_path):
    path = tmp_path / "run.vlfeat"
    (a, first), (_, second) = make_items(count=2)
    write_feature_file(path, [(a, first), (a, second)])
    back = read_feature_file(path)
    assert list(back) == [a]
    assert_identical(back[a], second.to_float16())


# --- obj36 TSV ---

def test_tsv_round_trip_is_identical(tmp_path):
    path = tmp_path / "val_obj36.tsv"
    items = make_items(count=3, n=36, dim=64)
    assert write_obj_tsv(path, items) == 3
    back = list(read_obj_tsv(path))
    assert [k for k, _ in back] == [k for k, _ in items]
    for (_, rf), (_, got) in zip(items, back):
        assert_identical(got, rf)
    assert [k for k, _ in read_obj_tsv(path, topk=2)] == [items[0][0], items[1][0]]


def test_tsv_lines_are_the_lxmert_layout(tmp_path):
    """Decoded exactly as airsplay/lxmert's load_obj_tsv does: base64 -> np.frombuffer(dtype) -> reshape."""
    path = tmp_path / "obj36.tsv"
    (image_id, rf), = make_items(count=1, n=3, dim=8)
    write_obj_tsv(path, [(image_id, rf)])
    line = path.read_text()
    assert line.endswith("\n") and line.count("\n") == 1
    columns = dict(zip(FIELDNAMES, line.rstrip("\n").split("\t"), strict=True))
    assert columns["img_id"] == image_id and (int(columns["img_h"]), int(columns["img_w"])) == rf.image_hw
    assert int(columns["num_boxes"]) == 3
    decode = lambda col, dtype: np.frombuffer(base64.b64decode(columns[col]), dtype=dtype)  # noqa: E731
    np.testing.assert_array_equal(decode("objects_id", np.int64), rf.obj_ids)
    np.testing.assert_array_equal(decode("attrs_conf", np.float32), rf.attr_scores)
    np.testing.assert_array_equal(decode("boxes", np.float32).reshape(3, 4), rf.boxes)
    np.testing.assert_array_equal(decode("features", np.float32).reshape(3, -1), rf.features)


def test_tsv_writes_only_real_regions_as_float32(tmp_path):
    path = tmp_path / "obj36.tsv"
    (image_id, rf), = make_items(count=1, n=4)
    padded = rf.replace(num_boxes=2).pad_to(6).to_float16()
    write_obj_tsv(path, [(image_id, padded)])
    (_, back), = read_obj_tsv(path)
    assert back.max_boxes == back.num_boxes == 2 and back.features.dtype == np.float32
    np.testing.assert_array_equal(back.features, padded.features[:2].astype(np.float32))


def test_tsv_append_and_zero_boxes(tmp_path):
    path = tmp_path / "obj36.tsv"
    items = make_items(count=2)
    write_obj_tsv(path, items[:1])
    empty = items[1][1].replace(num_boxes=0).trimmed()
    write_obj_tsv(path, [("empty", empty)], append=True)
    back = dict(read_obj_tsv(path))
    assert list(back) == [items[0][0], "empty"] and back["empty"].num_boxes == 0


def test_tsv_reader_raises_the_csv_field_limit(tmp_path):
    path = tmp_path / "obj36.tsv"
    items = make_items(count=1, n=36, dim=2048)  # ~400 KB features field, over csv's default 128 KB
    write_obj_tsv(path, items)
    csv.field_size_limit(131072)
    assert_identical(next(read_obj_tsv(path))[1], items[0][1])


@pytest.mark.parametrize("column, value", [
    ("num_boxes", "x"), ("num_boxes", "6"), ("boxes", "!!!notbase64"), ("objects_conf", "AAAA"), ("img_h", "0"),
])
def test_tsv_bad_rows_raise_feature_format_error(tmp_path, column, value):
    path = tmp_path / "obj36.tsv"
    write_obj_tsv(path, make_items(count=2))
    lines = path.read_text().splitlines()
    columns = lines[1].split("\t")
    columns[FIELDNAMES.index(column)] = value
    path.write_text(lines[0] + "\n" + "\t".join(columns) + "\n")
    with pytest.raises(FeatureFormatError, match="line 2"):
        list(read_obj_tsv(path))


def test_tsv_truncated_line_raises_feature_format_error(tmp_path):
    path = tmp_path / "obj36.tsv"
    write_obj_tsv(path, make_items(count=2))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 50])
    with pytest.raises(FeatureFormatError):
        list(read_obj_tsv(path))
    with pytest.raises(FeatureFormatError):
        decode_obj_row({"img_id": "a"})
    with pytest.raises(ValueError, match="img_id"):
        write_obj_tsv(tmp_path / "b.tsv", [("a\tb", make_items(count=1)[0][1])])


# --- a TSV's torn last line ---

def test_obj_row_prefix_columns_takes_every_start_of_a_row_and_little_else():
    (image_id, rf), = make_items(count=1, n=3, dim=8)
    row = "\t".join(encode_obj_row(image_id, rf)[k] for k in FIELDNAMES).encode()
    assert obj_row_prefix_columns([row]) == len(FIELDNAMES) - 1  # a whole row but its line break
    for cut in range(len(row)):
        assert obj_row_prefix_columns([row[:cut]]) == row[:cut].count(b"\t"), cut
    assert obj_row_prefix_columns([row[:50], row[50:120]]) == row[:120].count(b"\t")  # chunks split anywhere
    zero = "\t".join(encode_obj_row("z", rf.replace(num_boxes=0).trimmed())[k] for k in FIELDNAMES).encode()
    assert obj_row_prefix_columns([zero]) == len(FIELDNAMES) - 1  # empty base64 columns of zero regions
    for text in [b"name\tvalue", b"a\t\t", b"a\t12\t34\tnot base64", b"a\r\t1", row + b"\tmore"]:
        assert obj_row_prefix_columns([text]) is None, text


@pytest.mark.parametrize("code", ["ENOSYS", "ENOLCK", "EOPNOTSUPP"])
def test_a_file_system_that_cannot_lock_is_written_unlocked_with_a_warning(tmp_path, monkeypatch, caplog, code):
    import errno
    import fcntl

    def cannot_lock(fd, operation):
        raise OSError(getattr(errno, code), os.strerror(getattr(errno, code)))

    monkeypatch.setattr(fcntl, "flock", cannot_lock)
    path = tmp_path / "run.vlfeat"
    items = make_items(count=2)
    with caplog.at_level("WARNING", logger="models.feature_files"):
        assert write_feature_file(path, items, meta={"detector": "a"}) == 2
    assert list(read_feature_file(path)) == [k for k, _ in items]
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and warnings[0].startswith(f"cannot lock {path} on this file system")
    assert warnings[0].endswith("do not run two writers at once")


def test_a_lock_error_other_than_unsupported_is_raised(tmp_path, monkeypatch):
    import fcntl

    def denied(fd, operation):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(fcntl, "flock", denied)
    with pytest.raises(PermissionError):
        lock_for_writing(tmp_path / "run.vlfeat")


def test_a_file_with_no_records_takes_the_meta_of_its_next_writer(tmp_path):
    path = tmp_path / "run.vlfeat"
    FeatureFileWriter(path, meta={"detector": "a", "ids": "stem"}).close()  # a run stopped before its first record
    items = make_items(count=1)
    assert write_feature_file(path, items, meta={"detector": "a", "ids": "sha256"}) == 1
    with FeatureFile(path) as f:
        assert f.meta == {"detector": "a", "ids": "sha256"} and list(f) == [items[0][0]]


def test_also_resumes_takes_another_meta_and_keeps_it(tmp_path):
    path = tmp_path / "run.vlfeat"
    items = make_items(count=2)
    write_feature_file(path, items[:1], meta={"detector": "a"})
    with FeatureFileWriter(path, meta={"detector": "a", "ids": "stem"},
                           also_resumes=lambda there: there == {"detector": "a"}) as w:
        assert w.meta == {"detector": "a"} and w.written == {items[0][0]}
        w.append(*items[1])
    with FeatureFile(path) as f:
        assert f.meta == {"detector": "a"} and list(f) == [k for k, _ in items]
    with pytest.raises(FeatureFormatError, match="written with no ids, this run writes ids 'stem'"):
        FeatureFileWriter(path, meta={"detector": "a", "ids": "stem"}, also_resumes=lambda there: False)
