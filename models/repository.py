"""Reading a model repository (what `vlserve export` writes from a checkpoint directory); export/ writes them.

Layout: graphs/<task>.onnx (one graph per task head, the variant to serve on CPU), graphs/<task>.fp16.onnx
(with fp16: the variant for the CUDA and TensorRT execution providers), engines/<task>.plan (--format tensorrt:
standalone TensorRT engines), config.json, labels.json and the tokenizer files copied from the checkpoint,
parity.json (measured against torch), detector/ (with --detector: its graph, config and labels), manifest.json
(kind "onnx-repository"; sha256 of every file, opset, versions, each graph's inputs, outputs and precision, the
engines' TensorRT version, GPU and profiles, the source checkpoint and the detector it expects).

onnxruntime and onnx are imported where a graph is opened, so reading the metadata needs neither.
"""
from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from .checkpoint import CONFIG, LABELS, MANIFEST, REPOSITORY_KIND, CheckpointError, _check_labels, unreadable, verify_manifest
from .config import ModelConfig
from .tokenizer import VLTokenizer

KIND = REPOSITORY_KIND  # manifest "kind" of a model repository
PARITY = "parity.json"
GRAPHS = "graphs"
ENGINES = "engines"
DETECTOR_DIR = "detector"
DEFAULT_OPSET = 17  # LayerNormalization is an operator from 17 on (the optimizer's fusions look for it)
CPU_DISABLED_FUSIONS = ("SkipLayerNormFusion",)  # session-time fusions CPU sessions skip (export/optimize.py says why)


class RepositoryError(CheckpointError):
    """A model repository that cannot be loaded; the message names the file or field at fault."""


@dataclass(frozen=True)
class InputSpec:
    name: str
    dtype: str  # "int64" or "float32"
    shape: tuple[str | int, ...]  # symbolic names for dynamic axes


@dataclass(frozen=True)
class GraphSpec:
    """What one exported graph takes and gives; stored in the repository manifest."""

    task: str
    kind: str
    inputs: tuple[InputSpec, ...]
    outputs: tuple[InputSpec, ...]

    @property
    def input_names(self) -> list[str]:
        return [i.name for i in self.inputs]

    def to_dict(self) -> dict:
        return {"task": self.task, "kind": self.kind, "inputs": [asdict(i) for i in self.inputs],
                "outputs": [asdict(o) for o in self.outputs]}

    @classmethod
    def from_dict(cls, data: dict) -> GraphSpec:
        def specs(rows):
            return tuple(InputSpec(r["name"], r["dtype"], tuple(r["shape"])) for r in rows)
        return cls(data["task"], data["kind"], specs(data["inputs"]), specs(data["outputs"]))


def masked_mean(region_features: np.ndarray, region_mask: np.ndarray) -> np.ndarray:
    """Mean of the real regions' features: the whole-image feature the encoder uses when none is given."""
    m = region_mask.astype(np.float32)[..., None]
    return (region_features * m).sum(-2) / np.maximum(m.sum(-2), 1.0)


def graph_feed(spec: GraphSpec, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The arrays `spec`'s graph takes, from a runtime batch (keys it does not read are dropped).

    Optional inputs the batch lacks get what the torch model does without them: image_feature = mean of the
    real regions, tag_ids = -1 (no tag), phrase_index = -1.
    """
    feed = {}
    for inp in spec.inputs:
        value = batch.get(inp.name)
        if value is None:
            if inp.name == "image_feature":
                value = masked_mean(np.asarray(batch["region_features"], np.float32), np.asarray(batch["region_mask"]))
            elif inp.name in ("tag_ids", "phrase_index"):
                value = np.full(np.shape(batch["region_mask"]) + (1,) * (len(inp.shape) - np.ndim(batch["region_mask"])), -1, np.int64)
            else:
                raise ValueError(f"graph {spec.task!r} needs input {inp.name!r}")
        feed[inp.name] = np.ascontiguousarray(value, dtype=np.int64 if inp.dtype == "int64" else np.float32)
    return feed


@dataclass
class Repository:
    path: Path
    manifest: dict[str, Any]
    config: ModelConfig
    tokenizer: VLTokenizer
    labels: dict[str, Any]
    graphs: dict[str, GraphSpec]  # task -> inputs / outputs of its graph
    parity: dict[str, Any] = field(default_factory=dict)

    def graph_path(self, task: str, fp16: bool = False) -> Path:
        """`task`'s graph: the one served on CPU (fp32 or int8), or its fp16 variant (KeyError when not exported)."""
        entry = self.manifest["graphs"][task]
        if not fp16:
            return self.path / entry["file"]
        if "fp16" not in entry:
            raise KeyError(f"the repository has no fp16 graph of {task!r} (export it with --fp16)")
        return self.path / entry["fp16"]["file"]

    def has_fp16(self, task: str) -> bool:
        return "fp16" in self.manifest["graphs"][task]

    @property
    def engines(self) -> dict[str, Any]:
        """The standalone TensorRT engines (--format tensorrt): TensorRT version, GPU, ranges, per-task files and
        profiles; {} when the repository has none."""
        return self.manifest.get("engines") or {}

    def engine_path(self, task: str) -> Path:
        return self.path / self.engines["graphs"][task]["file"]

    @property
    def tasks(self) -> dict[str, str]:
        return {task: spec.kind for task, spec in self.graphs.items()}

    @property
    def detector_path(self) -> Path | None:
        """The exported detector graph, when the export was given the detector (`--detector`)."""
        graph = detector_graph(self.manifest, self.path)
        return self.path / graph[0] if graph else None


def detector_graph(manifest: dict[str, Any], path: Path) -> list[str]:
    """The detector graph a repository's manifest serves (`detector.graph`, with --detector), as a list of none or
    one file name; RepositoryError when the entry is not an object or the name not a string."""
    detector = manifest.get("detector")
    if detector is None:
        return []
    if not isinstance(detector, dict):
        raise RepositoryError(f"{path / MANIFEST}: field 'detector' is {type(detector).__name__}, not an object")
    graph = detector.get("graph")
    if graph is None:
        return []
    if not isinstance(graph, str) or not graph:
        raise RepositoryError(f"{path / MANIFEST}: field 'detector.graph' is {graph!r}, not a file name")
    return [graph]


def graph_files(graphs: dict[str, dict], engine_fields: dict) -> list[str]:
    """Every graph and engine file a manifest's "graphs" and "engines" entries name."""
    files = [g["file"] for g in graphs.values()] + [g["fp16"]["file"] for g in graphs.values() if "fp16" in g]
    return files + [e["file"] for e in (engine_fields.get("graphs") or {}).values()]


# ---- onnxruntime ---------------------------------------------------------------------------------------

@cache
def supported_opset() -> int:
    """Newest ai.onnx opset this onnxruntime loads (probed with a one-node graph; ORT has no API for it)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    best = 0
    for opset in range(DEFAULT_OPSET, 64):
        value = helper.make_tensor_value_info
        graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "probe",
                                  [value("x", TensorProto.FLOAT, [1])], [value("y", TensorProto.FLOAT, [1])])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
        model.ir_version = 10  # an IR version every onnxruntime of these opsets reads: only the opset is probed
        try:
            ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        except Exception:  # noqa: BLE001 - any refusal means this opset is past what it supports
            break
        best = opset
    return best


@cache
def supported_ir_version() -> int:
    """Newest ONNX IR version this onnxruntime loads (probed as supported_opset; ORT has no API for it)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    best = 0
    value = helper.make_tensor_value_info
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "probe",
                              [value("x", TensorProto.FLOAT, [1])], [value("y", TensorProto.FLOAT, [1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", DEFAULT_OPSET)])
    for ir_version in range(8, 64):  # 8: the first IR version of opset 17
        model.ir_version = ir_version
        try:
            ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        except Exception:  # noqa: BLE001 - any refusal means this IR version is past what it supports
            break
        best = ir_version
    return best


def onnxruntime_reason(exc: BaseException) -> str:
    """onnxruntime's reason for refusing a graph, without its error-code prefix, the graph's path and the C++
    source location: "Unsupported model IR version: 20, max supported IR version: 13"."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    text = re.sub(r"^\[ONNXRuntimeError\] : \d+ : \w+ : ", "", text)
    text = re.sub(r"^Load model from .*? failed: ?", "", text)
    return re.sub(r"^\S+\.(cc|h):\d+ \S+?\(.*?\) ", "", text)


def check_graph(path: Path) -> None:
    """RepositoryError naming the graph when onnx cannot parse it, it holds no graph with inputs and outputs, or it
    needs a newer IR version or opset than this onnxruntime loads: what can be known of a graph without an onnxruntime
    session (initializers stay unread). Protobuf parses any empty message, so a 0-byte file is a ModelProto without
    a graph (which onnxruntime refuses: "No graph was found in the protobuf")."""
    import onnx

    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError and onnx's own: the file is no ONNX graph
        raise RepositoryError(f"{path}: not an ONNX graph onnx can parse ({type(exc).__name__}: "
                              f"{' '.join(str(exc).split())[:200]})") from None
    if not model.HasField("graph"):
        size = path.stat().st_size
        raise RepositoryError(f"{path}: not an ONNX graph (a {size}-byte ONNX model with no graph in it)")
    missing = [what for what, values in (("inputs", model.graph.input), ("outputs", model.graph.output)) if not values]
    if missing:
        raise RepositoryError(f"{path}: not a servable ONNX graph (its graph has no {' and no '.join(missing)})")
    import onnxruntime

    if model.ir_version > supported_ir_version():
        raise RepositoryError(f"{path}: the graph's ONNX IR version {model.ir_version} is newer than onnxruntime "
                              f"{onnxruntime.__version__} loads (up to {supported_ir_version()})")
    opset = max((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), default=0)
    if opset > supported_opset():
        raise RepositoryError(f"{path}: the graph uses ONNX opset {opset} but onnxruntime {onnxruntime.__version__} "
                              f"supports opsets up to {supported_opset()}")


def open_graph(path: Path, threads: int = 1, providers: list | None = None, spin: bool = True):
    """`session` over a repository's graph; a graph onnxruntime refuses (corrupt, an IR version or operator it does
    not have) is one RepositoryError naming the graph and onnxruntime's reason."""
    try:
        return session(path, threads, providers, spin)
    except Exception as exc:  # noqa: BLE001 - onnxruntime's pybind errors derive from Exception only
        raise RepositoryError(f"{path}: onnxruntime cannot load the graph ({onnxruntime_reason(exc)})") from None


def session(path: Path, threads: int = 1, providers: list | None = None, spin: bool = True):
    """An onnxruntime InferenceSession with all graph optimizations and `threads` intra-op threads.

    spin=False: idle intra-op threads sleep instead of spinning (a service runs several sessions side by side).
    """
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    if not spin:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3  # errors only
    providers = providers or ["CPUExecutionProvider"]
    cpu_only = all((p[0] if isinstance(p, tuple) else p) == "CPUExecutionProvider" for p in providers)
    return ort.InferenceSession(str(path), options, providers=providers,
                                disabled_optimizers=list(CPU_DISABLED_FUSIONS) if cpu_only else None)


# ---- loading -------------------------------------------------------------------------------------------

def is_repository(path: str | Path) -> bool:
    """Whether `path` holds a model repository (manifest kind "onnx-repository"), without verifying it. A
    manifest.json that exists but is no JSON object is neither a repository nor a checkpoint: CheckpointError saying
    so, which the service reports as it is, whichever runtime asked."""
    mpath = Path(path) / MANIFEST
    try:
        manifest = json.loads(mpath.read_text(encoding="utf-8"))
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError as exc:
        raise unreadable(exc, Path(path), mpath) from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise CheckpointError(f"{mpath}: not a valid manifest ({exc})") from None
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{mpath}: not a valid manifest (a JSON {type(manifest).__name__}, not an object)")
    return manifest.get("kind") == KIND


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise RepositoryError(f"{path}: invalid JSON ({exc})") from None


def load_repository(path: str | Path) -> Repository:
    """Verify a repository's manifest (every file present with its sha256, every graph, the detector's included, and
    engine among them, an integer opset onnxruntime runs) and read its config, tokenizer, labels and graph specs.
    RepositoryError names the file or field at fault."""
    path = Path(path)
    if not path.is_dir():
        raise RepositoryError(f"model repository directory not found: {path}")
    try:
        manifest = verify_manifest(path)
    except CheckpointError as exc:
        raise RepositoryError(str(exc)) from None
    if manifest.get("kind") != KIND:
        raise RepositoryError(f"{path}: not a model repository (manifest kind {manifest.get('kind')!r}); "
                              f"`vlserve export` makes one from a checkpoint directory")
    opset = manifest.get("opset")
    if not isinstance(opset, int) or isinstance(opset, bool):
        raise RepositoryError(f"{path / MANIFEST}: field 'opset' is {opset!r}, not an integer (the ONNX opset of "
                              f"the graphs)")
    limit = supported_opset()
    if opset > limit:
        import onnxruntime

        raise RepositoryError(f"{path / MANIFEST}: the graphs use ONNX opset {opset!r} but onnxruntime "
                              f"{onnxruntime.__version__} supports opsets up to {limit}; upgrade onnxruntime "
                              f"or export again with --opset {limit}")
    try:
        config = ModelConfig.from_dict(_read_json(path / CONFIG))
    except ValueError as exc:
        if isinstance(exc, RepositoryError):
            raise
        raise RepositoryError(f"{path / CONFIG}: {exc}") from None
    labels = _read_json(path / LABELS)
    try:
        _check_labels(config, labels)
    except CheckpointError as exc:
        raise RepositoryError(f"{path}: {exc}") from None
    try:
        graphs = {task: GraphSpec.from_dict(g) for task, g in manifest["graphs"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise RepositoryError(f"{path / MANIFEST}: invalid graph entry ({exc})") from None
    parity = _read_json(path / PARITY)
    for task, spec in graphs.items():
        if task not in config.heads:
            raise RepositoryError(f"{path / MANIFEST}: graph {task!r} has no head in {CONFIG}")
    try:
        named = graph_files(manifest["graphs"], manifest.get("engines") or {})
    except (KeyError, TypeError) as exc:
        raise RepositoryError(f"{path / MANIFEST}: invalid graph or engine entry ({exc})") from None
    named += detector_graph(manifest, path)
    unverified = [name for name in named if name not in manifest["files"]]
    if unverified:  # a file the manifest serves but does not hash would escape verification
        raise RepositoryError(f"{path / MANIFEST}: {unverified[0]} is served but has no sha256 in the manifest")
    return Repository(path=path, manifest=manifest, config=config, tokenizer=VLTokenizer.from_dir(path),
                      labels=labels, graphs=graphs, parity=parity)
