"""Graph rewrites after export: onnxruntime's transformer optimizer (fusions), int8 dynamic quantization and fp16."""
from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from models import EncoderConfig


@contextmanager
def quiet() -> Iterator[None]:
    """Silence onnxruntime's optimizer and quantizer, which log every pass at INFO/WARNING on their own loggers."""
    logging.disable(logging.WARNING)
    try:
        yield
    finally:
        logging.disable(logging.NOTSET)


def optimize_graph(src: Path, dst: Path, enc: EncoderConfig) -> dict[str, int]:
    """Fuse GELU with its bias add and the LayerNorms (model_type "bert"); returns the graph's fused-op counts.

    Attention comes already fused from the export (export/fused.py): the optimizer's attention pass only
    knows transformers' BERT layout. Its other passes do not depend on widths or head counts.

    Residual adds stay Add + LayerNormalization, not SkipLayerNormalization: onnxruntime's CPU kernel for the
    fused op took 3.4 ms where Add + LayerNormalization took 0.7-0.8 ms (batch 32 x 56 tokens x 768), so the
    fusion made visualbert-base's int8 graph 12% slower at batch 32 (docs/BENCHMARKS.md). CPU sessions keep it
    unfused (models.repository.CPU_DISABLED_FUSIONS); GPU sessions fuse it again when they load the graph.
    """
    from onnxruntime.transformers.fusion_options import FusionOptions
    from onnxruntime.transformers.optimizer import optimize_model

    options = FusionOptions("bert")
    options.enable_skip_layer_norm = options.enable_bias_skip_layer_norm = False
    with quiet():
        model = optimize_model(str(src), model_type="bert", num_heads=enc.num_heads, hidden_size=enc.hidden_size,
                               opt_level=1, use_gpu=False,  # level 1: graph-level fusions, CPU kernels only
                               optimization_options=options)
        model.save_model_to_file(str(dst))
        return {op: n for op, n in (model.get_fused_operator_statistics() or {}).items() if n}


INT8_OPS = ("MatMul", "Gemm", "Attention")  # operator types int8 quantization rewrites
INT8_PER_CHANNEL = True  # one weight scale per output column instead of per tensor


def quantize_graph(src: Path, dst: Path) -> None:
    """int8 dynamic quantization: QInt8 weights of MatMul, Gemm and the fused self-attention (its packed QKV
    GEMM becomes QAttention), one scale per output channel, activations quantized at run time.

    Leaving Attention in fp32 kept a quarter of every layer's GEMM work in fp32: visualbert-base at batch 32 ran
    2.09x transformers, with it 2.97x. Per-channel weight scales cost no measurable time. On the demo model they
    kept the refer accuracy change at -0.41 points where per-tensor scales lost 0.71 (bound: 0.5).
    """
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    # fused contrib ops (after --optimize) have no shape-inference types: their outputs are float32
    with quiet():
        quantize_dynamic(str(src), str(dst), weight_type=QuantType.QInt8, op_types_to_quantize=list(INT8_OPS),
                         per_channel=INT8_PER_CHANNEL,
                         extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})


def float16_graph(src: Path, dst: Path, keep_fp32_ops: tuple[str, ...] = ()) -> None:
    """fp16 weights and arithmetic, graph inputs and outputs kept fp32 (the runtime contract does not change).

    onnxruntime's transformers tooling types the graph by symbolic shape inference first, so the fused contrib
    operators of --optimize convert too. `keep_fp32_ops`: operator types left in fp32 besides its default list.
    """
    import onnx
    from onnxruntime.transformers.float16 import DEFAULT_OP_BLOCK_LIST
    from onnxruntime.transformers.onnx_model import OnnxModel

    with quiet():
        model = OnnxModel(onnx.load(str(src)))
        model.convert_float_to_float16(keep_io_types=True, op_block_list=[*DEFAULT_OP_BLOCK_LIST, *keep_fp32_ops])
        model.save_model_to_file(str(dst))
