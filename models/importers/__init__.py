"""Importers of public checkpoint formats into vlserve checkpoint directories."""
