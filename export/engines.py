"""Building standalone TensorRT engines from a repository's ONNX graphs (`vlserve export --format tensorrt`);
models/engines.py runs them.

TensorRT's ONNX parser reads standard operators only, so an engine is built from the plain graph (no onnxruntime
contrib operators), with one optimisation profile per batch range (min / opt / max shapes of every input over
batch, text length, region count, choices, phrases). fp16 follows the TensorRT version: TensorRT 10 takes the
fp32 graph and BuilderFlag.FP16 (weak typing); TensorRT 11 removed that flag (strong typing only), so it takes
the graph converted to fp16 by onnxruntime's tooling, LayerNormalization kept fp32.
"""
from __future__ import annotations

from pathlib import Path

from models.engines import Profile, Ranges, input_shapes, strongly_typed, trt_logger
from models.repository import GraphSpec

SMALL_BATCH = 8  # the first profile covers batches up to this size, tuned for batch 1 (a lone request)
WORKSPACE_BYTES = 1 << 30  # builder scratch memory
KEEP_FP32_OPS = ("LayerNormalization",)  # fp16 graphs for strong typing: normalisation statistics overflow in fp16


def engine_profiles(spec: GraphSpec, ranges: Ranges) -> list[Profile]:
    """The optimisation profiles of `spec`'s engine: small batches (tuned for 1), then every batch (tuned for half)."""
    small = min(SMALL_BATCH, ranges.max_batch)
    batches = [(1, 1, small)]
    if ranges.max_batch > small:
        batches.append((1, max(1, ranges.max_batch // 2), ranges.max_batch))
    return [input_shapes(spec, ranges.axes(batch)) for batch in batches]


def profiles_to_json(profiles: list[Profile]) -> list[dict[str, dict[str, list[int]]]]:
    return [{name: dict(zip(("min", "opt", "max"), map(list, shapes))) for name, shapes in p.items()} for p in profiles]


class EngineBuildError(RuntimeError):
    """TensorRT could not parse a graph or build its engine; the message carries the parser's errors."""


def build_engine(onnx_path: Path, profiles: list[Profile], workspace_bytes: int = WORKSPACE_BYTES) -> bytes:
    """A serialized fp16 engine of the ONNX graph at `onnx_path` with the given optimisation profiles.

    The graph must be fp32 on TensorRT 10 (BuilderFlag.FP16 lowers it) and already fp16 on TensorRT 11
    (strongly typed: the graph's types are the engine's); `strongly_typed()` says which.
    """
    import tensorrt as trt

    strong = strongly_typed()
    builder = trt.Builder(trt_logger())
    flags = 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED) if strong else 0  # ignored (always on) in 11
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, trt_logger())
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise EngineBuildError(f"TensorRT's ONNX parser rejected {onnx_path.name}: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_bytes)
    if not strong:
        config.set_flag(trt.BuilderFlag.FP16)
    for shapes in profiles:
        profile = builder.create_optimization_profile()
        for name, (lo, opt, hi) in shapes.items():
            profile.set_shape(name, lo, opt, hi)
        config.add_optimization_profile(profile)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise EngineBuildError(f"TensorRT could not build an engine from {onnx_path.name} (its log above says why)")
    return bytes(serialized)
