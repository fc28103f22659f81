"""Export: checkpoint directory -> model repository (ONNX graphs per task, detector graph, TensorRT engines,
manifest, parity report). Imports models/ only.

Entry point: export.repository.export_repository (what `vlserve export` runs). Reading a repository is
models.repository's (the service reads repositories and never imports the writer). This package module imports
none of its submodules, so importing one (export.engines) does not load the writer and the ONNX export code.
"""
