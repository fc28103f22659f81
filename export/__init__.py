"""Export: checkpoint directory -> model repository (ONNX graphs per task, manifest, parity report). Imports models/ only."""
from .encoder import DEFAULT_OPSET, EXPORTED_KINDS, GraphSpec, export_task, graph_feed, graph_spec, synthetic_batch

__all__ = ["DEFAULT_OPSET", "EXPORTED_KINDS", "GraphSpec", "export_task", "graph_feed", "graph_spec", "synthetic_batch"]
