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
from dataclasses import asdict, dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from .checkpoint import CONFIG, LABELS, MANIFEST, CheckpointError, verify_manifest
from .config import ModelConfig
from .tokenizer import VLTokenizer

KIND = "onnx-repository"  # manifest "kind" of a model repository
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
        graph = (self.manifest.get("detector") or {}).get("graph")
        return self.path / graph if graph else None


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
    """Whether `path` holds a model repository (manifest kind "onnx-repository"), without verifying it."""
    try:
        return json.loads((Path(path) / MANIFEST).read_text()).get("kind") == KIND
    except (OSError, ValueError, AttributeError):
        return False


def load_repository(path: str | Path) -> Repository:
    """Verify a repository's manifest (every file present with its sha256, every graph and engine among them, an
    opset onnxruntime runs) and read its config, tokenizer, labels and graph specs. RepositoryError names the
    file or field at fault."""
    path = Path(path)
    try:
        manifest = verify_manifest(path)
    except CheckpointError as exc:
        raise RepositoryError(str(exc)) from None
    if manifest.get("kind") != KIND:
        raise RepositoryError(f"{path}: not a model repository (manifest kind {manifest.get('kind')!r}); "
                              f"`vlserve export` makes one from a checkpoint directory")
    opset, limit = manifest.get("opset"), supported_opset()
    if not isinstance(opset, int) or opset > limit:
        import onnxruntime

        raise RepositoryError(f"{path / MANIFEST}: the graphs use ONNX opset {opset!r} but onnxruntime "
                              f"{onnxruntime.__version__} supports opsets up to {limit}; upgrade onnxruntime "
                              f"or export again with --opset {limit}")
    try:
        config = ModelConfig.from_dict(json.loads((path / CONFIG).read_text()))
        labels = json.loads((path / LABELS).read_text())
        graphs = {task: GraphSpec.from_dict(g) for task, g in manifest["graphs"].items()}
        parity = json.loads((path / PARITY).read_text())
    except (ValueError, KeyError, TypeError) as exc:
        raise RepositoryError(f"{path}: invalid repository metadata ({exc})") from None
    for task, spec in graphs.items():
        if task not in config.heads:
            raise RepositoryError(f"{path / MANIFEST}: graph {task!r} has no head in {CONFIG}")
    try:
        named = graph_files(manifest["graphs"], manifest.get("engines") or {})
    except (KeyError, TypeError) as exc:
        raise RepositoryError(f"{path / MANIFEST}: invalid graph or engine entry ({exc})") from None
    unverified = [name for name in named if name not in manifest["files"]]
    if unverified:  # a file the manifest serves but does not hash would escape verification
        raise RepositoryError(f"{path / MANIFEST}: {unverified[0]} is served but has no sha256 in the manifest")
    return Repository(path=path, manifest=manifest, config=config, tokenizer=VLTokenizer.from_dir(path),
                      labels=labels, graphs=graphs, parity=parity)
