"""`vlserve extract`: folders of images to feature files, bad files reported and skipped, resume, TSV output."""
import json
import shutil
import os
import threading

import numpy as np
import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

from models.detector import DetectorConfig, RegionDetector
from models.detector.io import save_detector
from models.feature_files import FeatureFile, read_obj_tsv
from tests.models.test_feature_files import damage_value
from vlserve.cli import app

runner = CliRunner()


@pytest.fixture(scope="module")
def detector_dir(tmp_path_factory):
    torch.manual_seed(0)
    cfg = DetectorConfig(classes=["circle", "square"], attributes=["red"], min_size=64, max_size=128,
                         rpn_pre_nms_top_n=100, rpn_post_nms_top_n=30, num_boxes=8)
    path = tmp_path_factory.mktemp("det") / "detector"
    save_detector(RegionDetector(cfg), path)
    return path


@pytest.fixture
def folder(tmp_path):
    d = tmp_path / "images"
    (d / "sub").mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name, size in [("a.png", (64, 64)), ("b.jpg", (48, 80)), ("sub/c.png", (90, 60))]:
        Image.fromarray(rng.integers(0, 255, (*size, 3), dtype=np.uint8)).save(d / name)
    (d / "empty.png").write_bytes(b"")
    (d / "notes.png").write_bytes(b"not an image at all")
    (d / "readme.txt").write_text("ignored: not an image suffix")
    return d


def run(*args):
    return runner.invoke(app, ["extract", *map(str, args)])


def test_folder_to_feature_file_reports_bad_files(detector_dir, folder, tmp_path):
    out = tmp_path / "feats.vlfeat"
    result = run(folder, "--detector", detector_dir, "--out", out, "--batch-size", "2")
    assert result.exit_code == 1, result.output
    assert "skipped" in result.stderr and "empty.png" in result.stderr and "notes.png" in result.stderr
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["written"] == 3 and summary["failed"] == 2
    with FeatureFile(out) as f:
        assert sorted(f) == ["a", "b", "c"]
        assert f["b"].image_hw == (48, 80) and f["b"].boxes.shape == (8, 4)
        assert f.meta["detector"] == summary["detector"]


def test_resume_skips_what_is_done(detector_dir, folder, tmp_path):
    out = tmp_path / "feats.vlfeat"
    run(folder / "a.png", "--detector", detector_dir, "--out", out)
    result = run(folder / "a.png", folder / "b.jpg", "--detector", detector_dir, "--out", out)
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary == {**summary, "written": 1, "already_done": 1, "failed": 0}


def test_a_disk_that_fills_is_one_line_and_the_records_written_resume(detector_dir, tmp_path, small_disk):
    """A full disk said "[Errno 28] No space left on device", naming no file."""
    many = tmp_path / "many"
    many.mkdir()
    rng = np.random.default_rng(1)
    for i in range(40):
        Image.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(many / f"{i:02d}.png")
    out = small_disk("64k") / "feats.vlfeat"
    full = run(many, "--detector", detector_dir, "--out", out, "--batch-size", "4")
    assert full.exit_code == 2 and full.stderr.splitlines()[-1] == (
        f"error: {out}: cannot write the features (No space left on device); the records written are kept: run "
        "again to resume"), full.output
    with FeatureFile(out) as f:
        kept = len(f)
    assert 0 < kept < 40
    moved = tmp_path / "feats.vlfeat"
    shutil.copyfile(out, moved)  # room again
    resumed = run(many, "--detector", detector_dir, "--out", moved, "--batch-size", "4")
    assert resumed.exit_code == 0, resumed.output
    assert json.loads(resumed.stdout.strip().splitlines()[-1])["already_done"] == kept
    with FeatureFile(moved) as f:
        assert len(f) == 40


def test_tsv_output_matches_the_feature_file(detector_dir, folder, tmp_path):
    run(folder / "a.png", folder / "sub", "--detector", detector_dir, "--out", tmp_path / "f.vlfeat")
    result = run(folder / "a.png", folder / "sub", "--detector", detector_dir, "--out", tmp_path / "f.tsv", "--format", "tsv")
    assert result.exit_code == 0, result.output
    rows = dict(read_obj_tsv(tmp_path / "f.tsv"))
    with FeatureFile(tmp_path / "f.vlfeat") as f:
        assert sorted(rows) == sorted(f) == ["a", "c"]
        for key, rf in rows.items():
            n = rf.num_boxes
            assert n == f[key].num_boxes
            np.testing.assert_allclose(rf.boxes, f[key].boxes[:n])
            np.testing.assert_allclose(rf.features[:n], f[key].features[:n].astype(np.float32), atol=2e-2)  # fp16 at rest


def test_usage_errors_exit_2(detector_dir, folder, tmp_path):
    assert run(folder, "--detector", tmp_path / "nope", "--out", tmp_path / "x").exit_code == 2
    assert run(tmp_path / "missing", "--detector", detector_dir, "--out", tmp_path / "x").exit_code == 2
    assert run(folder, "--detector", detector_dir, "--out", tmp_path / "x", "--format", "csv").exit_code == 2
    (folder / "sub" / "a.png").write_bytes((folder / "b.jpg").read_bytes())  # another image named a
    dup = run(folder, "--detector", detector_dir, "--out", tmp_path / "x")
    assert dup.exit_code == 2 and "share the id 'a'" in dup.stderr


def test_an_image_the_detector_fails_on_is_reported_and_the_rest_written(detector_dir, folder, tmp_path):
    """extract_folder with the detector made to fail on one image's height (an injected fault): that image is listed
    with the detector's error, the images batched with it are written with the regions they get alone."""
    from models.detector.extract import extract_folder
    from models.detector.io import load_detector

    detector, fingerprint = load_detector(detector_dir)

    class FailsOnHeight48:
        def extract(self, images, batch_size=8):
            if any(image.shape[0] == 48 for image in images):
                raise RuntimeError("this image breaks the detector")
            return detector.extract(images, batch_size)

    out = tmp_path / "feats.vlfeat"
    report = extract_folder(FailsOnHeight48(), fingerprint, [folder], out, batch_size=8, progress=False)
    failed = dict(report.failed)
    assert report.written == 2 and len(failed) == 3, report
    assert "breaks the detector" in failed[str(folder / "b.jpg")]
    with FeatureFile(out) as f:
        assert sorted(f) == ["a", "c"]
        alone = detector.extract([np.asarray(Image.open(folder / "a.png").convert("RGB"))])[0]
        np.testing.assert_allclose(f["a"].boxes, alone.boxes, atol=1e-3)


def test_out_an_existing_directory_is_one_line(detector_dir, folder, tmp_path):
    out = tmp_path / "features"
    out.mkdir()
    result = run(folder / "a.png", "--detector", detector_dir, "--out", out)
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    assert result.stderr == f"error: {out}: is a directory; --out takes the feature file to write or resume\n"
    assert not list(out.iterdir())


def test_out_that_cannot_be_opened_is_one_line(detector_dir, folder, tmp_path):
    (tmp_path / "afile").write_text("not a directory")
    result = run(folder / "a.png", "--detector", detector_dir, "--out", tmp_path / "afile" / "feats.vlfeat")
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1
    assert "Not a directory" in result.stderr


def test_tsv_resume_cuts_a_torn_last_row(detector_dir, folder, tmp_path):
    """An interrupted run leaves half a row: the next run cuts it off and writes the rest."""
    out = tmp_path / "f.tsv"
    run(folder / "a.png", "--detector", detector_dir, "--out", out, "--format", "tsv")
    whole = out.read_bytes()
    out.write_bytes(whole + whole[: len(whole) // 2])  # a second row, torn
    result = run(folder / "a.png", folder / "sub", "--detector", detector_dir, "--out", out, "--format", "tsv")
    assert result.exit_code == 0, result.output
    assert sorted(dict(read_obj_tsv(out))) == ["a", "c"] and out.read_bytes().startswith(whole)


@pytest.mark.parametrize("text", [b"my precious notes\nline two", b"one line, no newline"])
def test_tsv_output_over_another_file_is_refused_and_left_as_it_is(detector_dir, folder, tmp_path, text):
    out = tmp_path / "notes.txt"
    out.write_bytes(text)
    result = run(folder / "a.png", "--detector", detector_dir, "--out", out, "--format", "tsv")
    assert result.exit_code == 2 and "notes.txt line" in result.stderr, result.output
    assert out.read_bytes() == text


def summary_of(result) -> dict:
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("ids", ["stem", "sha256"])
def test_a_file_that_cannot_be_read_is_skipped_in_either_id_mode(detector_dir, folder, tmp_path, ids):
    """/proc/self/mem: a regular file whose read fails (EIO at offset 0)."""
    out = tmp_path / "feats.vlfeat"
    result = run(folder / "a.png", "/proc/self/mem", "--detector", detector_dir, "--out", out, "--ids", ids)
    assert result.exit_code == 1, result.output
    assert "skipped /proc/self/mem: cannot read /proc/self/mem" in result.stderr
    assert summary_of(result) == {**summary_of(result), "written": 1, "failed": 1}
    with FeatureFile(out) as f:
        assert len(f) == 1


@pytest.mark.parametrize("fmt", ["vlfeat", "tsv"])
def test_sha256_ids_write_one_record_for_files_of_the_same_bytes(detector_dir, folder, tmp_path, fmt):
    (folder / "copy.png").write_bytes((folder / "a.png").read_bytes())
    (folder / "alias.png").symlink_to("a.png")
    out = tmp_path / f"feats.{fmt}"
    result = run(folder / "a.png", folder / "copy.png", folder / "alias.png", "--detector", detector_dir, "--out", out,
                 "--format", fmt, "--ids", "sha256")
    assert result.exit_code == 0, result.output
    assert summary_of(result) == {**summary_of(result), "written": 1, "duplicates": 2, "failed": 0}
    assert [line for line in result.stderr.splitlines() if line.startswith("duplicate ")] == [
        f"duplicate {folder / name}: the same bytes as {folder / 'a.png'}, whose record it shares"
        for name in ("copy.png", "alias.png")]
    if fmt == "tsv":
        assert len(out.read_text().splitlines()) == 1
    else:
        with FeatureFile(out) as f:
            assert len(f) == 1


def test_more_threads_than_torch_takes_exit_2(detector_dir, folder, tmp_path):
    result = run(folder / "a.png", "--detector", detector_dir, "--out", tmp_path / "x", "--threads", 100000000000)
    assert result.exit_code == 2 and "Invalid value for '--threads'" in result.output, result.output
    assert not (tmp_path / "x").exists()


def test_tsv_output_over_a_feature_file_is_one_line_naming_it(detector_dir, folder, tmp_path):
    out = tmp_path / "feats.vlfeat"
    run(folder / "a.png", "--detector", detector_dir, "--out", out)
    before = out.read_bytes()
    result = run(folder / "a.png", "--detector", detector_dir, "--out", out, "--format", "tsv")
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    assert result.stderr.startswith(f"error: {out}: not an obj36 TSV feature file (") and result.stderr.count("\n") == 1
    assert out.read_bytes() == before


@pytest.fixture
def fifo(tmp_path):
    """A FIFO named fifo.png; should the command open it, a writer opens and closes it at once, so the read ends
    (empty) instead of blocking the test."""
    path = tmp_path / "fifo.png"
    os.mkfifo(path)
    stop = threading.Event()

    def unblock():
        while not stop.wait(0.05):
            try:
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))  # ENXIO while no reader has it open
            except OSError:
                pass

    thread = threading.Thread(target=unblock, daemon=True)
    thread.start()
    yield path
    stop.set()
    thread.join()


@pytest.mark.parametrize("ids", ["stem", "sha256"])
def test_a_fifo_is_skipped_unread(detector_dir, folder, tmp_path, fifo, ids):
    out = tmp_path / "feats.vlfeat"
    result = run(folder / "a.png", fifo, "--detector", detector_dir, "--out", out, "--ids", ids)
    assert result.exit_code == 1, result.output
    assert f"skipped {fifo}: not a regular file" in result.stderr
    assert summary_of(result) == {**summary_of(result), "written": 1, "failed": 1}


# --- one writer at a time, and resumes that check what the output holds ---

@pytest.mark.parametrize("fmt", ["vlfeat", "tsv"])
def test_a_second_run_into_an_output_being_written_is_refused(detector_dir, folder, tmp_path, fmt):
    """Run 1 holds the output (its detector is made to wait inside a batch) while run 2 starts: run 2 is refused with
    one line and exit 2 and writes nothing; run 1 finishes, and every record it wrote reads back."""
    from models.detector.extract import extract_folder
    from models.detector.io import load_detector

    detector, fingerprint = load_detector(detector_dir)
    inside, release = threading.Event(), threading.Event()

    class Waits:
        def extract(self, images, batch_size=8):
            inside.set()
            assert release.wait(60)
            return detector.extract(images, batch_size)

    out = tmp_path / f"feats.{fmt}"
    first = {}
    thread = threading.Thread(target=lambda: first.update(report=extract_folder(
        Waits(), fingerprint, [folder / "a.png", folder / "b.jpg"], out, fmt=fmt, progress=False)))
    thread.start()
    try:
        assert inside.wait(60)
        second = run(folder / "sub", "--detector", detector_dir, "--out", out, "--format", fmt)
    finally:
        release.set()
        thread.join()
    assert second.exit_code == 2 and isinstance(second.exception, SystemExit), second.output
    assert second.stderr == (f"error: {out}: another process is writing it (wait for it to end, or write to another "
                             "file)\n")
    assert first["report"].written == 2
    if fmt == "vlfeat":
        with FeatureFile(out) as f:
            assert sorted(f) == ["a", "b"] and f.corrupt_ids() == []
    else:
        assert sorted(dict(read_obj_tsv(out))) == ["a", "b"]


def test_resume_writes_again_a_record_that_fails_its_crc(detector_dir, folder, tmp_path):
    out = tmp_path / "feats.vlfeat"
    run(folder / "a.png", folder / "b.jpg", folder / "sub", "--detector", detector_dir, "--out", out)
    damage_value(out, "a")
    result = run(folder / "a.png", folder / "b.jpg", folder / "sub", "--detector", detector_dir, "--out", out)
    assert result.exit_code == 0, result.output
    assert summary_of(result) == {**summary_of(result), "written": 1, "already_done": 2, "corrupt": 1}
    assert f"redone 'a': its record in {out} failed its CRC check; written again" in result.stderr
    with FeatureFile(out) as f:
        assert sorted(f) == ["a", "b", "c"] and f.corrupt_ids() == [] and f["a"].image_hw == (64, 64)


def test_a_corrupt_record_no_input_has_is_reported_with_exit_1(detector_dir, folder, tmp_path):
    out = tmp_path / "feats.vlfeat"
    run(folder / "a.png", folder / "b.jpg", "--detector", detector_dir, "--out", out)
    damage_value(out, "a")
    result = run(folder / "sub", "--detector", detector_dir, "--out", out)
    assert result.exit_code == 1, result.output
    assert f"corrupt 'a': its record in {out} fails its CRC check and this run did not write it again" in result.stderr
    assert summary_of(result) == {**summary_of(result), "written": 1, "corrupt": 1, "failed": 0}


@pytest.mark.parametrize("fmt", ["vlfeat", "tsv"])
def test_resume_with_another_image_of_a_done_name_is_refused(detector_dir, folder, tmp_path, fmt):
    """Stem ids across runs: another picture named a.png is refused (its sha256 is not the one OUT.sources keeps for
    'a'), as two such files in one run are; a copy of the same bytes under another folder is done."""
    out = tmp_path / f"feats.{fmt}"
    run(folder / "a.png", "--detector", detector_dir, "--out", out, "--format", fmt)
    before = out.read_bytes()
    other, same = tmp_path / "other", tmp_path / "same"
    other.mkdir(), same.mkdir()
    (other / "a.png").write_bytes((folder / "b.jpg").read_bytes())
    (same / "a.png").write_bytes((folder / "a.png").read_bytes())
    result = run(other / "a.png", folder / "sub", "--detector", detector_dir, "--out", out, "--format", fmt)
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    assert result.stderr == (f"error: {other / 'a.png'} ('a'): another image has that id in {out} (other bytes); "
                             "rename it, write to another --out, or use --ids sha256\n")
    assert out.read_bytes() == before
    again = run(same / "a.png", "--detector", detector_dir, "--out", out, "--format", fmt)
    assert again.exit_code == 0 and summary_of(again) == {**summary_of(again), "written": 0, "already_done": 1}


def test_two_files_of_one_stem_and_the_same_bytes_share_a_record(detector_dir, folder, tmp_path):
    (folder / "sub" / "a.png").write_bytes((folder / "a.png").read_bytes())
    result = run(folder / "a.png", folder / "sub", "--detector", detector_dir, "--out", tmp_path / "f.vlfeat")
    assert result.exit_code == 0, result.output
    assert f"duplicate {folder / 'sub' / 'a.png'}: the same bytes as {folder / 'a.png'}" in result.stderr
    assert summary_of(result) == {**summary_of(result), "written": 2, "duplicates": 1}


@pytest.mark.parametrize("fmt", ["vlfeat", "tsv"])
@pytest.mark.parametrize("first, then", [("stem", "sha256"), ("sha256", "stem")])
def test_resume_with_another_id_scheme_is_refused(detector_dir, folder, tmp_path, fmt, first, then):
    out = tmp_path / f"feats.{fmt}"
    run(folder / "a.png", "--detector", detector_dir, "--out", out, "--format", fmt, "--ids", first)
    before = out.read_bytes()
    result = run(folder / "a.png", folder / "b.jpg", "--detector", detector_dir, "--out", out, "--format", fmt,
                 "--ids", then)
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1
    assert (f"ids {first!r}" if fmt == "vlfeat" else f"written with --ids {first}") in result.stderr
    assert out.read_bytes() == before


# --- the TSV's torn last line ---

def test_tsv_resume_cuts_a_last_row_torn_inside_its_id(detector_dir, folder, tmp_path):
    out = tmp_path / "f.tsv"
    run(folder / "a.png", "--detector", detector_dir, "--out", out, "--format", "tsv")
    whole = out.read_bytes()
    out.write_bytes(whole + b"c")  # the next row cut after one byte of its id
    result = run(folder / "a.png", folder / "sub", "--detector", detector_dir, "--out", out, "--format", "tsv")
    assert result.exit_code == 0, result.output
    assert sorted(dict(read_obj_tsv(out))) == ["a", "c"] and out.read_bytes().startswith(whole)


@pytest.mark.parametrize("text", [b"name\tvalue", b"name\tvalue\t", b"id\t12\t34\tnot base64!", b"a\t1\t2\t"])
def test_a_tab_separated_file_that_is_not_an_obj36_tsv_is_left_as_it_is(detector_dir, folder, tmp_path, text):
    """Without a whole row, a line is taken for a torn row only once it holds the columns before num_boxes (an id, the
    image size, four base64 columns): b"a\\t1\\t2\\t" could be one, but nothing shows it is not a user's."""
    out = tmp_path / "notes.tsv"
    out.write_bytes(text)
    result = run(folder / "a.png", "--detector", detector_dir, "--out", out, "--format", "tsv")
    assert result.exit_code == 2 and "notes.tsv line 1" in result.stderr and result.stderr.count("\n") == 1
    assert out.read_bytes() == text


# --- names that cannot be an id ---

@pytest.mark.parametrize("fmt", ["vlfeat", "tsv"])
def test_a_name_that_is_not_utf8_is_skipped_naming_it_and_the_rest_written(detector_dir, folder, tmp_path, fmt):
    odd = os.path.join(os.fsencode(folder), b"odd\xff.png")
    with open(odd, "wb") as f:
        f.write((folder / "b.jpg").read_bytes())
    out = tmp_path / f"feats.{fmt}"
    result = run(folder, "--detector", detector_dir, "--out", out, "--format", fmt)
    assert result.exit_code == 1, result.output
    assert (f"skipped {folder}/odd\\xff.png: its file name is not UTF-8, so it cannot be an image id; rename it, or "
            "use --ids sha256\n") in result.stderr
    assert summary_of(result) == {**summary_of(result), "written": 3, "failed": 3}
    by_hash = run(folder, "--detector", detector_dir, "--out", tmp_path / f"h.{fmt}", "--format", fmt,
                  "--ids", "sha256")
    assert summary_of(by_hash) == {**summary_of(by_hash), "written": 3, "duplicates": 1, "failed": 2}, by_hash.output
    assert f"duplicate {folder}/odd\\xff.png: the same bytes as {folder / 'b.jpg'}" in by_hash.stderr


@pytest.mark.parametrize("name", ["tab\there.png", "new\nline.png"])
def test_a_tsv_id_with_a_tab_or_line_break_is_skipped_and_the_rest_written(detector_dir, folder, tmp_path, name):
    (folder / name).write_bytes((folder / "b.jpg").read_bytes())
    out = tmp_path / "f.tsv"
    result = run(folder, "--detector", detector_dir, "--out", out, "--format", "tsv")
    assert result.exit_code == 1, result.output
    shown = name.replace("\t", "\\t").replace("\n", "\\n")
    assert (f"skipped {folder}/{shown}: its file name holds a tab or a line break, which an obj36 TSV img_id cannot; "
            "rename it, or use --ids sha256\n") in result.stderr
    assert sorted(dict(read_obj_tsv(out))) == ["a", "b", "c"]
    vlfeat = run(folder, "--detector", detector_dir, "--out", tmp_path / "f.vlfeat")  # any UTF-8 id is a record id
    with FeatureFile(tmp_path / "f.vlfeat") as f:
        assert sorted(f) == sorted(["a", "b", "c", name[:-4]]), vlfeat.output


# --- smaller things ---

def test_the_same_file_given_twice_is_extracted_once(detector_dir, folder, tmp_path):
    result = run(folder / "a.png", folder / "a.png", folder, "--detector", detector_dir, "--out", tmp_path / "f.vlfeat")
    assert result.exit_code == 1 and "share the id" not in result.stderr and "duplicate" not in result.stderr
    assert summary_of(result) == {**summary_of(result), "written": 3, "duplicates": 0}


def test_out_onto_a_file_that_is_not_a_feature_file_names_it(detector_dir, folder, tmp_path):
    out = tmp_path / "photo.vlfeat"
    out.write_bytes((folder / "a.png").read_bytes())
    result = run(folder / "a.png", "--detector", detector_dir, "--out", out)
    assert result.exit_code == 2 and result.stderr == f"error: {out}: not a vlserve feature file (bad magic)\n"
    assert out.read_bytes() == (folder / "a.png").read_bytes()


def test_a_symlink_loop_with_an_image_suffix_is_reported(detector_dir, folder, tmp_path):
    (folder / "loop.png").symlink_to("loop.png")
    result = run(folder, "--detector", detector_dir, "--out", tmp_path / "f.vlfeat")
    assert result.exit_code == 1
    assert f"skipped {folder / 'loop.png'}: cannot read {folder / 'loop.png'}: Too many levels of symbolic links" \
        in result.stderr


def test_an_error_during_the_run_starts_its_own_line(detector_dir, folder, tmp_path, monkeypatch):
    """The progress bar is finished before the error line, not written over."""
    from models.feature_files import FeatureFileWriter

    def disk_full(self, image_id, features):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(FeatureFileWriter, "append", disk_full)
    result = run(folder, "--detector", detector_dir, "--out", tmp_path / "f.vlfeat")
    assert result.exit_code == 2
    assert result.stderr.splitlines()[-1] == (f"error: {tmp_path / 'f.vlfeat'}: cannot write the features (No space "
                                              "left on device); the records written are kept: run again to resume")


def test_a_sources_file_that_is_not_ours_is_refused_and_left_as_it_is(detector_dir, folder, tmp_path):
    out = tmp_path / "f.vlfeat"
    sources = tmp_path / "f.vlfeat.sources"
    sources.write_text("my list of sources\n")
    result = run(folder / "a.png", "--detector", detector_dir, "--out", out)
    assert result.exit_code == 2 and result.stderr.startswith(f"error: {sources} line 1: not a line of the list")
    assert sources.read_text() == "my list of sources\n"


def test_a_torn_sources_line_is_cut_before_the_next_is_added(detector_dir, folder, tmp_path):
    out = tmp_path / "f.vlfeat"
    run(folder / "a.png", "--detector", detector_dir, "--out", out)
    sources = tmp_path / "f.vlfeat.sources"
    whole = sources.read_bytes()
    sources.write_bytes(whole + b'{"id": "b", "sha')  # a run stopped while writing the line of b
    result = run(folder / "a.png", folder / "b.jpg", "--detector", detector_dir, "--out", out)
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in sources.read_bytes().splitlines()]
    assert [entry["id"] for entry in lines] == ["a", "b"] and sources.read_bytes().startswith(whole)


# --- outputs written before the meta recorded the id scheme, and the order of a run's work ---

def write_without_ids(detector_dir, folder, out, ids: str) -> None:
    """`out` as a run whose meta held the detector only ({"detector": fingerprint}) wrote it, from a.png."""
    from models.detector.extract import extract_folder
    from models.detector.io import load_detector
    from models.feature_files import FeatureFileWriter

    detector, fingerprint = load_detector(detector_dir)
    extract_folder(detector, fingerprint, [folder / "a.png"], out.with_name("new.vlfeat"), ids=ids, progress=False)
    with FeatureFile(out.with_name("new.vlfeat")) as new, FeatureFileWriter(out, meta={"detector": fingerprint}) as w:
        for image_id in new:
            w.append(image_id, new[image_id])
    if ids == "stem":
        out.with_name(out.name + ".sources").write_bytes(out.with_name("new.vlfeat.sources").read_bytes())


@pytest.mark.parametrize("ids", ["stem", "sha256"])
def test_a_feature_file_whose_meta_has_no_ids_is_resumed_in_the_scheme_of_its_ids(detector_dir, folder, tmp_path,
                                                                                  ids):
    out = tmp_path / "old.vlfeat"
    write_without_ids(detector_dir, folder, out, ids)
    result = run(folder / "a.png", folder / "b.jpg", "--detector", detector_dir, "--out", out, "--ids", ids)
    assert result.exit_code == 0, result.output
    assert summary_of(result) == {**summary_of(result), "written": 1, "already_done": 1}
    with FeatureFile(out) as f:
        assert "ids" not in f.meta and len(f) == 2 and f.corrupt_ids() == []
        assert ("b" in f) == (ids == "stem")
    again = run(folder / "a.png", folder / "b.jpg", "--detector", detector_dir, "--out", out, "--ids", ids)
    assert again.exit_code == 0 and summary_of(again)["already_done"] == 2, again.output


@pytest.mark.parametrize("first, then", [("stem", "sha256"), ("sha256", "stem")])
def test_a_feature_file_whose_meta_has_no_ids_is_refused_to_the_other_scheme(detector_dir, folder, tmp_path, first,
                                                                             then):
    out = tmp_path / "old.vlfeat"
    write_without_ids(detector_dir, folder, out, first)
    before = out.read_bytes()
    result = run(folder / "a.png", folder / "b.jpg", "--detector", detector_dir, "--out", out, "--ids", then)
    assert result.exit_code == 2 and result.stderr.count("\n") == 1, result.output
    assert f"written with --ids {first}" in result.stderr
    assert out.read_bytes() == before


@pytest.mark.parametrize("fmt", ["vlfeat", "tsv"])
def test_a_second_run_is_refused_before_it_reads_an_input(detector_dir, folder, tmp_path, monkeypatch, fmt):
    import models.detector.extract as extract
    from models.feature_files import lock_for_writing

    def hashed(path):
        pytest.fail(f"read {path} before the output was locked")

    monkeypatch.setattr(extract, "_hash_file", hashed)
    out = tmp_path / f"feats.{fmt}"
    with lock_for_writing(out):  # a first run writing it
        result = run(folder, "--detector", detector_dir, "--out", out, "--format", fmt)
    assert result.exit_code == 2 and "another process is writing it" in result.stderr, result.output


def test_the_sources_list_is_fsynced_when_closed(tmp_path, monkeypatch):
    import models.detector.extract as extract

    synced = []
    monkeypatch.setattr(extract.os, "fsync", lambda fd: synced.append(fd))
    sources = extract.SourceList(tmp_path / "f.vlfeat")
    sources.begin(new=True)
    sources.add("a", "0" * 64)
    fd = sources._f.fileno()
    sources.close()
    assert synced == [fd] and sources._f.closed
