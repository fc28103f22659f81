"""VLModel: one encoder preset plus any number of named task heads (one checkpoint serves every endpoint)."""
from __future__ import annotations

import torch
from torch import nn

from .config import ModelConfig
from .heads import build_head
from .inputs import VLInputs, check_inputs
from .outputs import EncoderOutput, ModelOutput
from .single_stream import SingleStreamEncoder
from .two_stream import LxmertEncoder, StreamStates, VilbertEncoder

ENCODERS = {
    "visualbert": SingleStreamEncoder,
    "vl-bert": SingleStreamEncoder,
    "u-visualbert": SingleStreamEncoder,
    "lxmert": LxmertEncoder,
    "vilbert": VilbertEncoder,
}


class VLModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.encoder = ENCODERS[config.encoder.preset](config.encoder)
        word_embeddings = self.encoder.embeddings.word_embeddings
        self.heads = nn.ModuleDict({name: build_head(h, config.encoder, word_embeddings) for name, h in config.heads.items()})
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        # BERT initialisation: N(0, 0.02) weights, zero biases, unit LayerNorm
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
            if isinstance(module, nn.Embedding) and module.padding_idx is not None:
                nn.init.zeros_(module.weight[module.padding_idx])
        elif isinstance(module, nn.LayerNorm):
            nn.init.constant_(module.weight, getattr(module, "init_scale", 1.0))  # ScaledLayerNorm: its own start
            nn.init.zeros_(module.bias)

    @property
    def tasks(self) -> list[str]:
        return list(self.heads)

    def forward_features(self, inputs: VLInputs, output_attentions: bool = False, pooled_only: bool = False,
                         task_token: int = -1) -> EncoderOutput:
        """The encoder's output; with `pooled_only` (and an encoder that can: single-stream) only its pooled vector is
        sure to be there (the last layer runs for the first token alone)."""
        only = {"pooled_only": True} if pooled_only and getattr(self.encoder, "pools_first_token", False) else {}
        if task_token >= 0:  # ViLBERT 12-in-1: the head's task token (HeadConfig.task_token)
            only["task_token"] = task_token
        return self.encoder(**inputs.encoder_kwargs(), output_attentions=output_attentions, **only)

    def match_streams(self, task: str, text: StreamStates, image: StreamStates) -> torch.Tensor:
        """An image-text matching head's logits (B, 2) from a two-stream encoder's streams, each encoded apart
        (encode_text, encode_image): their cross layers, then the head. The image stream's last positions are its
        regions (a whole-image token, where the encoder has one, comes first), and their mask is what the head pools
        with."""
        enc = self.encoder.fuse(text, image)
        region_mask = image.mask[:, image.mask.shape[1] - enc.image.shape[1]:]  # (B, N)
        return self.heads[task].match(enc, region_mask)

    def forward_head(self, task: str, enc: EncoderOutput, inputs: VLInputs):
        return self.heads[task](enc, inputs)

    def forward(self, inputs: VLInputs, task: str, labels=None, output_attentions: bool = False) -> ModelOutput:
        if task not in self.heads:
            raise KeyError(f"model has no head {task!r}; it has: {', '.join(self.heads) or 'none'}")
        head = self.heads[task]
        enc_cfg = self.config.encoder
        check_inputs(inputs, vocab_size=enc_cfg.vocab_size, type_vocab_size=enc_cfg.type_vocab_size,
                     feature_dim=enc_cfg.visual_feat_dim, text_positions=enc_cfg.text_positions,
                     weight_dtype=self.encoder.embeddings.word_embeddings.weight.dtype,
                     choices=head.head.kind == "multiple_choice", pairs=head.head.kind == "nlvr2")
        prepared = head.prepare(inputs)
        enc = self.forward_features(prepared, output_attentions, pooled_only=head.pooled_only,
                                    task_token=head.head.task_token)
        logits = head.unprepare(self.forward_head(task, enc, prepared), inputs)
        loss = head.loss(logits.float(), labels, inputs) if labels is not None else None  # float32 under bf16 autocast too
        return ModelOutput(logits=logits, loss=loss, encoder=enc)
