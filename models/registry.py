"""Name -> builder registry of encoder presets and sizes: `create_model("lxmert", size="small", heads=...)`."""
from __future__ import annotations

from typing import Any

from .config import PRESETS, EncoderConfig, HeadConfig, ModelConfig
from .vl_model import VLModel

# Sizes are config, not code. "base" loads public checkpoints; "small" matches MiniLM-L6 (H384, 12 heads)
# so its text side can start from that pretrained BERT; "tiny" is for tests.
_SINGLE = {
    "base": dict(hidden_size=768, num_layers=12, num_heads=12, intermediate_size=3072, visual_feat_dim=2048),
    "small": dict(hidden_size=384, num_layers=6, num_heads=12, intermediate_size=1536, visual_feat_dim=512),
    "tiny": dict(hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64, visual_feat_dim=16, max_position_embeddings=128),
}
_TWO_STREAM = {
    "lxmert": {
        "base": dict(_SINGLE["base"], num_layers=9, num_image_layers=5, num_cross_layers=5),
        "small": dict(_SINGLE["small"], num_layers=6, num_image_layers=2, num_cross_layers=2),
        "tiny": dict(_SINGLE["tiny"], num_layers=2, num_image_layers=1, num_cross_layers=1),
    },
    "vilbert": {  # [IMG] is the mean of the regions, as vilbert-multi-task builds it (img_from_regions)
        "base": dict(_SINGLE["base"], img_from_regions=True, image_hidden_size=1024, image_num_heads=8,
                     image_intermediate_size=1024, num_image_layers=6, num_cross_layers=6,
                     coattention_text_layers=(6, 7, 8, 9, 10, 11)),
        "small": dict(_SINGLE["small"], img_from_regions=True, image_hidden_size=384, image_num_heads=6,
                      image_intermediate_size=768, num_image_layers=2, num_cross_layers=2, coattention_text_layers=(4, 5)),
        "tiny": dict(_SINGLE["tiny"], img_from_regions=True, image_hidden_size=48, image_num_heads=4,
                     image_intermediate_size=64, coattention_hidden_size=40, num_image_layers=2, num_cross_layers=2,
                     coattention_text_layers=(1, 2)),
    },
}
SIZES = tuple(_SINGLE)


def encoder_config(preset: str, size: str = "small", **overrides: Any) -> EncoderConfig:
    """The EncoderConfig of a registered preset at a registered size, with field overrides."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    table = _TWO_STREAM.get(preset, {s: v for s, v in _SINGLE.items()})
    if size not in table:
        raise ValueError(f"unknown size {size!r}; choose one of {', '.join(table)}")
    fields = dict(table[size])
    if preset == "vl-bert":
        fields["type_vocab_size"] = 3  # segments A, B and C (image)
        # its authors' embeddings (2048-d sin/cos box geometry, as jackroos/VL-BERT) and no pooler, as its released configs
        fields.update(vlbert_embedding="reference", geometry_dim=2048, pooler=False)
    if preset == "u-visualbert":
        # its authors' embeddings (uclanlp/visualbert's unsupervised_visualbert: regions LN(FC(feature)) + LN(FC(box)),
        # tags as sub-word tokens after them); "vlserve" (the dataclass default, which its trained checkpoints keep)
        # is VisualBERT's embedding with the tags summed into the regions
        fields["embedding_style"] = "published"
    fields.update(overrides)
    return EncoderConfig(preset=preset, size=size, **fields)


def create_model(preset: str, size: str = "small", heads: dict[str, HeadConfig | dict] | None = None, **overrides: Any) -> VLModel:
    if heads is not None and not isinstance(heads, dict):
        raise TypeError(f"heads must be a dict of task name -> HeadConfig or its fields, not {type(heads).__name__}")
    head_cfgs = {name: h if isinstance(h, HeadConfig) else HeadConfig(**h) for name, h in (heads or {}).items()}
    return VLModel(ModelConfig(encoder=encoder_config(preset, size, **overrides), heads=head_cfgs))
