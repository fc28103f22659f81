"""vlserve models: encoder presets, heads, tokenizer and checkpoint I/O. Imports no other vlserve package."""
from .config import FORMAT_VERSION, HEAD_KINDS, PRESETS, RANK_HEAD, EncoderConfig, HeadConfig, ModelConfig
from .inputs import VLInputs
from .outputs import EncoderOutput, ModelOutput
from .registry import SIZES, create_model, encoder_config
from .vl_model import VLModel

__all__ = [
    "FORMAT_VERSION", "HEAD_KINDS", "PRESETS", "RANK_HEAD", "SIZES", "EncoderConfig", "EncoderOutput", "HeadConfig",
    "ModelConfig", "ModelOutput", "VLInputs", "VLModel", "create_model", "encoder_config",
]
