"""Export: checkpoint directory -> model repository (ONNX graphs per task, detector graph, manifest, parity report).

Imports models/ only. Entry points: export_repository (what `vlserve export` runs) and load_repository.
"""
from .encoder import DEFAULT_OPSET, EXPORTED_KINDS, GraphSpec, export_task, graph_feed, graph_spec, synthetic_batch
from .repository import (ExportError, ParityError, Repository, RepositoryError, export_repository, is_repository,
                         load_repository)

__all__ = [
    "DEFAULT_OPSET", "EXPORTED_KINDS", "ExportError", "GraphSpec", "ParityError", "Repository", "RepositoryError",
    "export_repository", "export_task", "graph_feed", "graph_spec", "is_repository", "load_repository", "synthetic_batch",
]
