"""The writer of model repositories: a checkpoint directory exported to ONNX (graphs, detector, TensorRT engines),
each graph measured against torch, then a manifest. The layout and its reader are models/repository.py; an export
whose graphs miss the parity bounds writes nothing.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from models import engines as engine_runner
from models.checkpoint import CONFIG, LABELS, MANIFEST, WEIGHTS, load_checkpoint, write_manifest
from models.detector.io import load_detector
from models.detector.onnx import OnnxDetector
from models.file_modes import apply_umask
from models.repository import (DEFAULT_OPSET, DETECTOR_DIR, ENGINES, GRAPHS, KIND, PARITY, GraphSpec, Repository,
                               graph_files, load_repository, session, supported_opset)
from models.tokenizer import TOKENIZER_FILES

from . import engines
from .detector import detector_parity, export_detector, parity_images
from .encoder import DYNAMO_MIN_OPSET, EXPORTERS, MIN_OPSET, export_task, exportable_tasks
from .fused import fused_attention
from .optimize import float16_graph, optimize_graph, quantize_graph
from .parity import (FP16_MAX_ABS_DIFF, FP16_MIN_AGREEMENT, MAX_ABS_DIFF, MEASURED_REGIONS, MIN_AGREEMENT,
                     MIN_INT8_AGREEMENT, Parity, measure, measured_text)

FORMATS = ("onnx", "tensorrt")


class ExportError(RuntimeError):
    """The export cannot run with these options or this checkpoint; nothing was written."""


class ParityError(ExportError):
    """An exported graph misses the parity bounds against torch; nothing was written."""


def versions() -> dict[str, str]:
    import onnx
    import onnxruntime
    import onnxscript

    return {"onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__, "onnxscript": onnxscript.__version__,
            "torch": torch.__version__.split("+")[0]}


def runner(sess) -> Callable[[dict[str, np.ndarray]], np.ndarray]:
    return lambda feed: sess.run(None, feed)[0]


# ---- export -------------------------------------------------------------------------------------------

def _first_line(exc: Exception) -> str:
    """`Type: message`, the message's first line (exporter errors run on with the traced graph)."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def _check(task: str, variant: str, parity, max_diff: float | None, min_agreement: float) -> str | None:
    """The parity failure of one graph variant, or None."""
    if parity.nonfinite:  # NaN compares false with any bound: counted apart, a failure whatever the bounds
        return (f"graph {task!r} ({variant}): {parity.nonfinite} logits on {parity.examples} examples are NaN or "
                "infinite where torch's are not, or the reverse")
    if max_diff is not None and parity.max_abs_diff > max_diff:
        return (f"graph {task!r} ({variant}): max abs logit difference to torch {parity.max_abs_diff:.3g} "
                f"exceeds {max_diff:g}")
    if parity.agreement < min_agreement:
        return (f"graph {task!r} ({variant}): top-1 agreement with torch {parity.agreement:.2%} on "
                f"{parity.examples} examples is below {min_agreement:.2%}")
    return None


DETECTOR_BOX_PX = 1e-3  # exported detector boxes may differ from torch's by this many pixels


def _load_detector(detector_dir: Path, source: dict, visual_feat_dim: int):
    """The detector at `detector_dir` -> (detector, fingerprint), refused unless it gives the region features the
    checkpoint reads: their width always, the detector itself where the checkpoint's manifest records one (imported
    checkpoints do not)."""
    detector, fingerprint = load_detector(detector_dir)
    if detector.config.feature_dim != visual_feat_dim:
        raise ExportError(f"the checkpoint reads {visual_feat_dim}-d region features, but {detector_dir} gives "
                          f"{detector.config.feature_dim}-d")
    expected = (source.get("detector") or {}).get("fingerprint")
    if expected and expected != fingerprint:
        raise ExportError(f"the checkpoint expects region features of detector {expected}, but {detector_dir} is "
                          f"detector {fingerprint}")
    return detector, fingerprint


def _export_detector(detector, fingerprint: str, detector_dir: Path, tmp: Path, opset: int,
                     threads: int) -> tuple[dict, dict]:
    """Export the detector into tmp/detector/ -> (parity report, manifest fields)."""
    out = tmp / DETECTOR_DIR
    out.mkdir()
    export_detector(detector, out / "detector.onnx", opset=opset)
    for name in (CONFIG, LABELS):
        shutil.copyfile(detector_dir / name, out / name)
    exported = OnnxDetector.load(out / "detector.onnx", detector.config, threads)
    report = detector_parity(detector, exported, parity_images())
    fields = {"fingerprint": fingerprint, "graph": f"{DETECTOR_DIR}/detector.onnx", "config": f"{DETECTOR_DIR}/{CONFIG}",
              "labels": f"{DETECTOR_DIR}/{LABELS}"}
    return report, fields


def _check_detector(report: dict, max_diff: float) -> str | None:
    if report["nonfinite"]:  # NaN compares false with any bound: counted apart, a failure whatever the bounds
        return (f"detector: {report['nonfinite']} box, feature or score values are NaN or infinite where torch's are "
                "not, or the reverse")
    if report["same_region_count"] < 1 or report["same_classes"] < 1:
        return (f"detector: regions or classes differ from torch's on {1 - min(report['same_region_count'], report['same_classes']):.0%} "
                "of the images")
    if report["features"] > max_diff or report["image_feature"] > max_diff:
        return f"detector: max abs feature difference to torch {max(report['features'], report['image_feature']):.3g} exceeds {max_diff:g}"
    if report["boxes_px"] > DETECTOR_BOX_PX:
        return f"detector: boxes differ from torch's by up to {report['boxes_px']:.3g} px (bound {DETECTOR_BOX_PX:g})"
    return None


@dataclass(frozen=True)
class Bounds:
    """How close to torch each kind of graph must be (max abs logit difference, share of equal top-1s)."""

    max_abs_diff: float = MAX_ABS_DIFF  # fp32 and optimized graphs
    min_agreement: float = MIN_AGREEMENT
    int8_min_agreement: float = MIN_INT8_AGREEMENT  # int8: agreement only (a guard against broken quantization)
    fp16_max_abs_diff: float = FP16_MAX_ABS_DIFF  # fp16 graphs and TensorRT engines
    fp16_min_agreement: float = FP16_MIN_AGREEMENT


def fp16_providers() -> list[str]:
    """Where an fp16 graph's parity is measured: the CUDA execution provider when this onnxruntime has one."""
    import onnxruntime as ort

    cuda = "CUDAExecutionProvider"
    return [cuda, "CPUExecutionProvider"] if cuda in ort.get_available_providers() else ["CPUExecutionProvider"]


def _measure_fp16(model, spec: GraphSpec, path: Path, examples: int, threads: int) -> tuple[Parity | None, dict]:
    """Parity of an fp16 graph on CUDA if there is one, else on onnxruntime's CPU provider when it can run the
    graph -> (parity or None, report fields saying where it ran or why it did not)."""
    from onnxruntime.capi.onnxruntime_pybind11_state import NotImplemented as NoKernel

    providers = fp16_providers()
    try:
        sess = session(path, threads, providers)
    except NoKernel as exc:  # an fp16 kernel the CPU provider lacks; any other failure is the graph's and fails
        if providers[0] != "CPUExecutionProvider":
            raise
        reason = str(exc).strip().splitlines()[0]
        return None, {"fp16_parity": f"not measured: onnxruntime's CPU execution provider cannot run the fp16 graph "
                                     f"({reason}); it is measured where the CUDA execution provider is"}
    return measure(model, spec, runner(sess), examples), {"fp16_measured_on": providers[0]}


def _export_graph(model, task: str, graphs: Path, work: Path, opset: int, exporter: str, optimize: bool,
                  quantize: str | None, fp16: bool, examples: int, threads: int,
                  bounds: Bounds) -> tuple[GraphSpec, dict, dict, list]:
    """graphs/<task>.onnx (fp32, optimized or int8) and, with fp16, graphs/<task>.fp16.onnx, each variant measured
    against torch; intermediate graphs go to `work` -> (spec, parity report, manifest entry, failures)."""
    fp32 = work / f"{task}.fp32.onnx"
    spec = export_task(model, task, fp32, opset=opset, exporter=exporter)
    report = {"fp32": measure(model, spec, runner(session(fp32, threads)), examples)}
    failures = [_check(task, "fp32", report["fp32"], bounds.max_abs_diff, bounds.min_agreement)]
    served, extra = fp32, {}
    if optimize:  # attention exported as fused operators, then onnxruntime's other fusions
        with_attention, optimized = work / f"{task}.attention.onnx", work / f"{task}.opt.onnx"
        with fused_attention(model):
            export_task(model, task, with_attention, opset=opset, exporter="torchscript")
        extra["fused_operators"] = optimize_graph(with_attention, optimized, model.config.encoder)
        report["optimized"] = measure(model, spec, runner(session(optimized, threads)), examples)
        failures.append(_check(task, "optimized", report["optimized"], bounds.max_abs_diff, bounds.min_agreement))
        served = optimized
    full_precision = served  # the fp32 graph (optimized or not) the fp16 one is converted from
    if quantize == "int8":
        int8 = work / f"{task}.int8.onnx"
        quantize_graph(served, int8)
        report["int8"] = measure(model, spec, runner(session(int8, threads)), examples)
        failures.append(_check(task, "int8", report["int8"], None, bounds.int8_min_agreement))
        extra["int8_agreement_change_points"] = round(100 * (report["int8"].agreement - report["fp32"].agreement), 3)
        served = int8
    try:  # the same bytes under a second name, no room needed twice (the work graph may be read again: engines)
        os.link(served, graphs / f"{task}.onnx")
    except OSError:  # a file system without hard links
        shutil.copyfile(served, graphs / f"{task}.onnx")
    variant = "int8" if quantize else ("optimized" if optimize else "fp32")
    entry = {"file": f"{GRAPHS}/{task}.onnx", "variant": variant, "precision": "int8" if quantize else "fp32"}
    if fp16:
        half = graphs / f"{task}.fp16.onnx"
        float16_graph(full_precision, half)
        parity, where = _measure_fp16(model, spec, half, examples, threads)
        extra.update(where)
        if parity is not None:
            report["fp16"] = parity
            failures.append(_check(task, "fp16", parity, bounds.fp16_max_abs_diff, bounds.fp16_min_agreement))
        entry["fp16"] = {"file": f"{GRAPHS}/{task}.fp16.onnx", "precision": "fp16",
                         "from": "optimized" if optimize else "fp32", "io": "fp32"}
    return spec, {"served": variant, **{k: v.to_dict() for k, v in report.items()}, **extra}, entry, failures


def _split_rows(run: Callable[[dict[str, np.ndarray]], np.ndarray], max_rows: int):
    """`run` over a feed cut into batches of at most `max_rows` rows (an engine's largest batch)."""
    def split(feed: dict[str, np.ndarray]) -> np.ndarray:
        rows = len(next(iter(feed.values())))
        return np.concatenate([run({k: v[i:i + max_rows] for k, v in feed.items()}) for i in range(0, rows, max_rows)])
    return split


def _build_engines(model, specs: dict[str, GraphSpec], work: Path, out: Path, ranges: engine_runner.Ranges,
                   examples: int, bounds: Bounds, log: Callable[[str], None]) -> tuple[dict, dict, list]:
    """engines/<task>.plan from each task's plain graph (work/<task>.fp32.onnx: standard operators only), each run
    on this GPU against torch -> (manifest fields, parity report, failures). Needs TensorRT and a CUDA GPU."""
    env = engine_runner.environment()
    (out / ENGINES).mkdir()
    entries, report, failures = {}, {}, []
    for task, spec in specs.items():
        source, built_from = work / f"{task}.fp32.onnx", "fp32 graph, BuilderFlag.FP16"
        if env["typing"] == "strong":  # TensorRT 11+: the graph's types are the engine's
            source, built_from = work / f"{task}.trt.fp16.onnx", "fp16 graph (LayerNormalization fp32), strongly typed"
            float16_graph(work / f"{task}.fp32.onnx", source, keep_fp32_ops=engines.KEEP_FP32_OPS)
        profiles = engines.engine_profiles(spec, ranges)
        log(f"building the TensorRT engine of {task} ({len(profiles)} optimisation profiles)")
        plan = out / ENGINES / f"{task}.plan"
        try:
            plan.write_bytes(engines.build_engine(source, profiles))
        except engines.EngineBuildError as exc:
            raise ExportError(str(exc)) from None
        engine = engine_runner.TensorrtEngine(plan)
        try:
            parity = measure(model, spec, _split_rows(engine.run, ranges.max_batch), examples)
        finally:
            engine.close()
        report[task] = parity.to_dict()
        failures.append(_check(task, "tensorrt", parity, bounds.fp16_max_abs_diff, bounds.fp16_min_agreement))
        entries[task] = {"file": f"{ENGINES}/{task}.plan", "precision": "fp16", "built_from": built_from,
                         "profiles": engines.profiles_to_json(profiles)}
        log(f"  {task} engine: max|diff| {parity.max_abs_diff:.2e} top-1 {parity.agreement:.2%}")
    return {**env, "precision": "fp16", "ranges": asdict(ranges), "graphs": entries}, report, failures


def _check_options(fmt: str, quantize: str | None, opset: int, exporter: str) -> None:
    """ExportError for options this export cannot honour here, before any work."""
    if fmt not in FORMATS:
        raise ExportError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if fmt == "tensorrt":
        reason = engine_runner.unavailable("cuda")
        if reason:
            raise ExportError(f"--format tensorrt builds TensorRT engines on a CUDA GPU, but {reason}; "
                              "export --format onnx here (VLSERVE_RUNTIME=tensorrt then builds engines at start-up "
                              "through onnxruntime's TensorRT execution provider)")
    if quantize not in (None, "int8"):
        raise ExportError(f"unknown quantization {quantize!r}; the only one is int8")
    if exporter not in EXPORTERS:
        raise ExportError(f"unknown exporter {exporter!r}; choose one of {', '.join(EXPORTERS)}")
    if opset < MIN_OPSET:
        raise ExportError(f"opset {opset} is too old: the graphs' attention needs opset {MIN_OPSET} or newer")
    if exporter == "dynamo" and opset < DYNAMO_MIN_OPSET:
        raise ExportError(f"--exporter dynamo writes opset {DYNAMO_MIN_OPSET} graphs: pass --opset {DYNAMO_MIN_OPSET} "
                          f"or newer, or use the torchscript exporter for opset {opset}")
    if opset > supported_opset():
        raise ExportError(f"opset {opset} is newer than onnxruntime {versions()['onnxruntime']} supports "
                          f"(up to {supported_opset()})")


def _check_bounds(bounds: Bounds) -> None:
    """ExportError for parity bounds no measurement can be held to, before any work: a difference bound must be a
    finite number above 0, an agreement bound a share from 0 to 1 (NaN compares false with every measurement, so it
    would pass any graph; an agreement above 1 would fail every one after the whole export)."""
    for name, value in asdict(bounds).items():
        option = "--" + name.replace("_", "-")
        if name.endswith("max_abs_diff"):
            if not (math.isfinite(value) and value > 0):
                raise ExportError(f"{option} must be a finite number above 0, got {value}")
        elif not 0 <= value <= 1:  # NaN fails this too
            raise ExportError(f"{option} must be a share of examples from 0 to 1, got {value}")


def _check_ranges(ranges: engine_runner.Ranges, text_positions: int) -> None:
    """ExportError unless TensorRT engines over `ranges` hold every parity batch of an encoder with `text_positions`."""
    longest = measured_text(text_positions)
    if ranges.max_batch < 1 or ranges.max_text < longest or ranges.max_regions < MEASURED_REGIONS:
        raise ExportError(f"engine ranges need --max-batch >= 1, --max-text >= {longest} and --max-regions "
                          f">= {MEASURED_REGIONS} (the parity batches reach those sizes), got {asdict(ranges)}")


# ---- staging -------------------------------------------------------------------------------------------
# The repository is assembled in a hidden directory beside --out, `.<out name>.export-<host>-<pid>.<8 random
# characters>`, then renamed into place. Its export holds an exclusive flock on it while it runs (the kernel releases
# it when the process ends, SIGKILL included), so another export of the same --out can tell a live staging directory
# (locked: refused) from the remains of a killed one (unlocked and its pid gone: removed). Only a directory of this
# host is removed: on NFS mounted with local locks (nolock, local_lock=flock) another host's lock is not seen here and
# its pid means nothing here, so its directory is left. Exports beside one another set up their staging directories
# one at a time, under a flock on the parent directory held for that moment only.

STAGING = "export"


def _host() -> str:
    """This host's name as a file name may hold it: characters other than [A-Za-z0-9.-] become `_`."""
    return re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname()) or "_"


def _staging_name(out: Path) -> re.Pattern:
    """The names of export staging directories of `out` -> groups (host, pid); mkdtemp's random part is 8 of
    [a-z0-9_], and the pid is the last `-<digits>` before it, so a host name with `-` in it parses as it was
    written."""
    return re.compile(rf"\.{re.escape(out.name)}\.{STAGING}-([A-Za-z0-9._-]+)-(\d+)\.[a-z0-9_]{{8}}")


def _lock(fd: int, wait: bool = False) -> bool | None:
    """flock `fd` exclusively: True when taken, False when another open file holds it, None where the file system
    has no flock (then nothing is known)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except BlockingIOError:
        return False
    except OSError:
        return None
    return True


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # no such process; a number no pid has
        return False
    except PermissionError:  # another user's process
        pass
    return True


def _sweep(out: Path, log: Callable[[str], None]) -> None:
    """ExportError when another export is writing `out` (its staging directory is locked, or, where the file system
    has no flock, its pid is alive); staging directories of `out` left by exports that ended without removing them
    (SIGKILL, a power cut) on this host are removed. Nothing but this process's uid's directories of `out`'s staging
    name that name this host is removed: another host's lock may not be seen here (NFS with local locks) and its pid
    is not this host's, so its directory is left."""
    pattern, here = _staging_name(out), _host()
    try:
        entries = [e for e in out.parent.iterdir() if pattern.fullmatch(e.name)]
    except OSError:
        return
    for entry in entries:
        host, pid = pattern.fullmatch(entry.name).groups()
        pid = int(pid)
        try:
            fd = os.open(entry, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)  # a link or a file is no staging dir
        except OSError:
            continue
        try:
            taken = _lock(fd)
            live = not taken if taken is not None else _pid_alive(pid)
            if live:
                raise ExportError(f"{out}: another export (pid {pid}) is writing this repository (staging directory "
                                  f"{entry}); wait for it to end or choose another --out")
            if host != here:
                log(f"left {entry}: the staging directory of an export on host {host} (pid {pid}), which this host "
                    "cannot tell running or ended; remove it once that export has ended")
            elif taken and not _pid_alive(pid) and os.fstat(fd).st_uid == os.getuid():
                shutil.rmtree(entry, ignore_errors=True)
                log(f"removed {entry}: the staging directory of an export (pid {pid}) that ended without removing it")
        finally:
            os.close(fd)


def _stage(out: Path, log: Callable[[str], None]) -> tuple[Path, int]:
    """The staging directory of an export to `out`, created beside it and locked -> (path, the locked descriptor,
    which the export closes when it ends). ExportError when `out` cannot be created there, another export is writing
    it, or it was filled since the export began."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        parent = os.open(out.parent, os.O_RDONLY | os.O_DIRECTORY)
    except FileExistsError as exc:  # a file where a parent directory should be
        raise ExportError(f"{out}: cannot create the repository: {exc.filename} is a file, not a directory") from None
    except OSError as exc:  # a read-only file system, no write permission
        raise ExportError(f"{out}: cannot create the repository in {out.parent} ({exc.strerror})") from None
    try:
        _lock(parent, wait=True)  # released when `parent` is closed
        _sweep(out, log)
        if out.exists() and (not out.is_dir() or any(out.iterdir())):  # written while this export loaded its models
            raise ExportError(f"{out} exists and is not an empty directory; choose a new --out")
        try:
            tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.{STAGING}-{_host()}-{os.getpid()}.", dir=out.parent))
        except OSError as exc:  # a read-only file system, no write permission
            raise ExportError(f"{out}: cannot create the repository in {out.parent} ({exc.strerror})") from None
        try:
            held = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY)
        except BaseException:
            tmp.rmdir()
            raise
        _lock(held)
        return tmp, held
    finally:
        os.close(parent)


def export_repository(
    model_dir: str | Path,
    out_dir: str | Path,
    fmt: str = "onnx",
    optimize: bool = False,
    quantize: str | None = None,
    fp16: bool = False,
    opset: int = DEFAULT_OPSET,
    exporter: str = "torchscript",
    examples: int = 1000,
    threads: int = 1,
    max_abs_diff: float = MAX_ABS_DIFF,
    min_agreement: float = MIN_AGREEMENT,
    int8_min_agreement: float = MIN_INT8_AGREEMENT,
    fp16_max_abs_diff: float = FP16_MAX_ABS_DIFF,
    fp16_min_agreement: float = FP16_MIN_AGREEMENT,
    engine_ranges: engine_runner.Ranges = engine_runner.Ranges(),
    detector_dir: str | Path | None = None,
    log: Callable[[str], None] = lambda message: None,
) -> Repository:
    """Export every task head of the checkpoint at `model_dir` into a repository at `out_dir`.

    fp32 graphs (and optimized ones) must stay within `max_abs_diff` of torch and agree on the top-1 of at
    least `min_agreement` of `examples` examples; int8 graphs must agree on `int8_min_agreement` (a guard
    against broken quantization; their accuracy change needs labels: benchmarks/exported_accuracy.py). With
    `fp16`, each task also gets an fp16 graph (for the CUDA / TensorRT execution providers; inputs and outputs
    stay fp32) within the fp16 bounds, measured on CUDA when onnxruntime has it, else on CPU where the CPU
    provider can run it. fmt "tensorrt" also builds fp16 TensorRT engines over `engine_ranges` on this machine's
    GPU, within the fp16 bounds. With `detector_dir` (the detector the checkpoint expects) the detector is
    exported too and must give the torch detector's regions (features within `max_abs_diff`, boxes within
    DETECTOR_BOX_PX pixels). Raises ExportError, leaving `out_dir` untouched, when any graph misses.
    """
    _check_options(fmt, quantize, opset, exporter)
    bounds = Bounds(max_abs_diff, min_agreement, int8_min_agreement, fp16_max_abs_diff, fp16_min_agreement)
    _check_bounds(bounds)
    model_dir, out = Path(model_dir), Path(out_dir)
    if out.is_symlink():  # the finished repository is renamed into --out's place, which a link cannot give up
        raise ExportError(f"{out} is a symbolic link (to {os.readlink(out)}); pass the directory itself as --out")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"{out} exists and is not an empty directory; choose a new --out")
    checkpoint = load_checkpoint(model_dir)
    model, config = checkpoint.model.float().eval(), checkpoint.model.config
    tasks = exportable_tasks(config)
    if not tasks:
        raise ExportError(f"{model_dir} has no task head to export (heads: {', '.join(config.heads) or 'none'})")
    if fmt == "tensorrt":
        _check_ranges(engine_ranges, config.encoder.text_positions)
    if detector_dir is not None:
        detector, fingerprint = _load_detector(Path(detector_dir), checkpoint.manifest, config.encoder.visual_feat_dim)
    torch.set_num_threads(threads)

    tmp, held = _stage(out, log)
    work = tmp / ".work"  # intermediate graphs, removed before the repository is moved into place
    try:
        (tmp / GRAPHS).mkdir()
        work.mkdir()
        graphs, specs, parity, failures = {}, {}, {}, []
        for task, kind in tasks.items():
            log(f"exporting {task} ({kind})")
            try:
                specs[task], parity[task], entry, failed = _export_graph(
                    model, task, tmp / GRAPHS, work, opset, exporter, optimize, quantize, fp16, examples, threads,
                    bounds)
            except ExportError:
                raise
            except OSError as exc:  # writing a graph (a full disk), no fault of the graph's
                raise ExportError(f"{out}: cannot write the repository ({exc.strerror or exc})") from exc
            except Exception as exc:  # the exporter's or onnxruntime's own failure: one line, not a traceback
                raise ExportError(f"graph {task!r}: {_first_line(exc)}") from exc
            failures += failed
            graphs[task] = {**entry, **specs[task].to_dict()}
            measured = {k: v for k, v in parity[task].items() if k in ("fp32", "optimized", "int8", "fp16")}
            log(f"  {task}: " + ", ".join(f"{k} max|diff| {v['max_abs_diff']:.2e} top-1 {v['agreement']:.2%}"
                                          for k, v in measured.items()))
        detector_fields, extra_reports = {}, {}
        if detector_dir is not None:
            try:
                report, detector_fields = _export_detector(detector, fingerprint, Path(detector_dir), tmp, opset,
                                                           threads)
            except Exception as exc:
                raise ExportError(f"detector: {_first_line(exc)}") from exc
            extra_reports["detector"] = report
            failures.append(_check_detector(report, max_abs_diff))
            log(f"  detector: boxes max|diff| {report['boxes_px']:.2e} px, features {report['features']:.2e}")
        failures = [f for f in failures if f]
        if failures:
            raise ParityError("parity check failed: " + "; ".join(failures))
        engine_fields = {}
        if fmt == "tensorrt":
            engine_fields, extra_reports["engines"], failed = _build_engines(
                model, specs, work, tmp, engine_ranges, examples, bounds, log)
            failures = [f for f in failed if f]
            if failures:
                raise ParityError("parity check failed: " + "; ".join(failures))
        shutil.rmtree(work)

        for name in (CONFIG, LABELS, *TOKENIZER_FILES):
            shutil.copyfile(model_dir / name, tmp / name)
        recorded = {"max_abs_diff": max_abs_diff, "min_agreement": min_agreement,
                    "int8_min_agreement": int8_min_agreement if quantize else None,
                    "fp16_max_abs_diff": fp16_max_abs_diff if fp16 or engine_fields else None,
                    "fp16_min_agreement": fp16_min_agreement if fp16 or engine_fields else None}
        (tmp / PARITY).write_text(json.dumps({"bounds": recorded, "graphs": parity, **extra_reports}, indent=2,
                                             allow_nan=False))  # NaN and Infinity are no JSON
        source = checkpoint.manifest
        files = [CONFIG, LABELS, *TOKENIZER_FILES, PARITY, *graph_files(graphs, engine_fields),
                 *(detector_fields.get(k) for k in ("graph", "config", "labels") if detector_fields)]
        fields = {
            "kind": KIND,
            "format": fmt,
            "preset": config.encoder.preset,
            "size": config.encoder.size,
            "visual_feat_dim": config.encoder.visual_feat_dim,
            "opset": opset,
            "exporter": exporter,
            "precision": "int8" if quantize else "fp32",
            "fp16": fp16,
            "optimized": optimize,
            "versions": versions(),
            "detector": {**(source.get("detector") or {}), **detector_fields},
            "source": {
                "path": str(model_dir.resolve()),
                "manifest_sha256": hashlib.sha256((model_dir / MANIFEST).read_bytes()).hexdigest(),
                "weights_sha256": (source.get("files") or {}).get(WEIGHTS, ""),
            },
            "graphs": graphs,
        }
        if engine_fields:
            fields["engines"] = engine_fields
        write_manifest(tmp, files, fields)
        apply_umask(tmp)  # the umask's modes, not mkdtemp's 0700 (the service image's user reads the repository)
        try:
            if out.exists():
                out.rmdir()
            tmp.replace(out)
        except OSError as exc:  # ENOTEMPTY, EEXIST: another writer, which ignores the staging locks, filled --out
            raise ExportError(f"{out}: another process wrote there while this export ran ({exc.strerror}); this "
                              "export's repository was discarded") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        os.close(held)  # the staging lock, now on --out itself or on nothing
    return load_repository(out)
