"""Region detector: EfficientNet-Lite0 Faster R-CNN returning bottom-up-attention style RegionFeatures."""
from .config import DetectorConfig
from .model import RegionDetector

__all__ = ["DetectorConfig", "RegionDetector"]
