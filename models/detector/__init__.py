"""Region detector returning bottom-up-attention style RegionFeatures: vlserve's EfficientNet-Lite0 Faster R-CNN
or the imported bottom-up-attention ResNet C4 detector (DetectorConfig.family)."""
from .config import DetectorConfig
from .model import RegionDetector

__all__ = ["DetectorConfig", "RegionDetector"]
