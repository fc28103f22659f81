"""The bottom-up-attention detector (family "butd"): the ResNet C4 Faster R-CNN of Visual Genome that the public
LXMERT and VisualBERT checkpoints were trained on, as ported to PyTorch for transformers' demos (frcnn-vg).

    image ─► ResNet stem, res2-res4 (stride 16) ─► RPN: 3x3 conv, objectness + deltas per anchor
          ─► top pre-NMS proposals, clipped, NMS ─► post-NMS proposals
          ─► RoIPool (14 x 14 on res4) ─► res5 (stride 1, dilation 2) ─► mean ─► 2048-d region feature
          ─► class logits (K + 1, background last), class-specific box deltas (4K), attribute logits (A + 1) read
             from the feature and the embedding of the proposal's best class

Built from torch/torchvision operators: torchvision's Bottleneck blocks (the stride moved to the first 1x1 conv, as
the MSRA/caffe ResNet has it), roi_pool, nms and BoxCoder. Batch norms are frozen and computed as eval-mode
batch_norm, the operation the reference runs, so the same weights give the same numbers. The RPN's NMS stops once
it has the proposals it keeps (select.nms_first: the same ones, 1 ms instead of 80).

For serving, `fast_convolutions` rewrites the ResNet in place: each frozen batch norm folded into the convolution
before it (one pass over the activations instead of two), channels-last activations (oneDNN's native layout, no
reorder per convolution), RoIPool as one gather (roi_pool.py), res5 run on RES5_CHUNK proposals at a time (its
activations stay in the caches) and, on CPUs with native bfloat16 dot products, bfloat16 weights and activations in
res5, 92% of the detector's FLOPs (res5 runs at 14 x 14 on each of 300 proposals). The backbone, the RPN and the
predictors stay float32, so the proposals are exactly float32's and only the region features (and the scores read
from them) carry bfloat16's rounding. That rounding moves a proposal's best-class score by up to a few percent, and
many proposals' scores crowd the last chosen one, so a plain bfloat16 res5 would choose other regions on many
photos; with frcnn-vg's selection, `ButdRoIHeads.settle` recomputes in float32 the few proposals whose part in the
choice lies within that error, and the regions chosen are float32's. On a GPU the serving form keeps float32 in
NCHW (cuDNN's NHWC float32 dilated convolutions are many times slower), pools with torchvision's kernel, runs res5
on all proposals at once and the RPN's NMS as the kernel (docs/BENCHMARKS.md, "on a GPU").
"""
from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from torch import nn
from torchvision.models.detection._utils import BoxCoder, _topk_min
from torchvision.models.resnet import Bottleneck
from torchvision.ops import batched_nms, clip_boxes_to_image, roi_pool
from torchvision.ops.misc import FrozenBatchNorm2d

from ..layers import eager
from .config import RESNET_BLOCKS, DetectorConfig
from .roi_pool import ImageRoIPool, roi_pool_channels_last
from .select import best_class_nms, choose_regions, nearest_cut, nms_first, uncertain_choices

STRIDE = 16  # res4's stride: stem 4, res3 2, res4 2
BOX_CLAMP = math.log(1000.0 / 16)  # largest log-scale a box delta may apply
# How far a bfloat16 res5 moves what the region choice reads, with a margin over the largest measured (full-size
# detector, calibrated weights, 16 photos; benchmarks/butd.py --agreement): best-class scores by up to 3.5% (relative),
# overlaps near the NMS threshold by up to 0.0044.
BF16_SCORE_ERROR = 0.05
BF16_IOU_ERROR = 0.01
# Proposals recomputed per round of ButdRoIHeads.settle: rounds of 8 recompute a third fewer than all the uncertain
# ones at once (16 photos, benchmarks/butd.py --agreement: 8-37 a photo, median 20, against 11-58, median 28), a round
# costing about one proposal's time.
SETTLE_ROUND = 8
RES5_CHUNK = 16  # proposals per res5 pass in the serving form (ButdRoIHeads._res5_features)


class FrozenBN(FrozenBatchNorm2d):
    """torchvision's frozen BatchNorm (statistics and affine as buffers) computed as eval-mode batch_norm."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps)


@torch.no_grad()
def fold_batch_norms(module: nn.Module) -> int:
    """Fold every frozen batch norm that directly follows a bias-free convolution (stem, bottlenecks, shortcuts)
    into it: w' = w * g / sqrt(v + eps), b' = b - m * g / sqrt(v + eps); the norm becomes an identity. Returns how
    many were folded. Same function, different rounding (about 1e-6 relative)."""
    folded = 0

    def fold(conv: nn.Conv2d, bn: FrozenBN) -> None:
        scale = bn.weight * torch.rsqrt(bn.running_var + bn.eps)
        conv.weight.mul_(scale[:, None, None, None])
        conv.bias = nn.Parameter(bn.bias - bn.running_mean * scale, requires_grad=False)

    for parent in module.modules():
        if isinstance(parent, Bottleneck):
            pairs = [("conv1", "bn1"), ("conv2", "bn2"), ("conv3", "bn3")]
        elif isinstance(parent, Stem):
            pairs = [("conv1", "bn1")]
        elif isinstance(parent, nn.Sequential) and len(parent) == 2 and isinstance(parent[1], FrozenBN):
            pairs = [("0", "1")]  # a projection shortcut
        else:
            continue
        for conv_name, bn_name in pairs:
            conv, bn = getattr(parent, conv_name), getattr(parent, bn_name)
            if isinstance(bn, FrozenBN) and isinstance(conv, nn.Conv2d) and conv.bias is None:
                fold(conv, bn)
                setattr(parent, bn_name, nn.Identity())
                folded += 1
    return folded


def fast_convolutions(backbone: ResNetC4, heads: ButdRoIHeads, res5_dtype: torch.dtype, settle: bool = True) -> None:
    """The serving form of the ResNet convolutions (module docstring): batch norms folded, channels-last, res5 in
    `res5_dtype`; below float32 with `settle` and frcnn-vg's selection, a float32 copy of res5 for settle()."""
    # channels-last, except float32 on a GPU: cuDNN's float32 NHWC dilated 3x3 took 465 ms where NCHW took 10 (H200,
    # res5's shape on 300 proposals); in bfloat16 NHWC is the faster there too
    gpu = heads.cls_score.weight.device.type == "cuda"
    layout = torch.contiguous_format if res5_dtype == torch.float32 and gpu else torch.channels_last
    for part in (backbone, heads.res5):
        fold_batch_norms(part)
        part.to(memory_format=layout)
    if settle and res5_dtype != torch.float32 and heads.config.selection == "argmax-nms":
        heads.exact_res5 = copy.deepcopy(heads.res5)  # float32, for ButdRoIHeads.settle
        if gpu:  # float32 on a GPU: NCHW (above)
            heads.exact_res5.to(memory_format=torch.contiguous_format)
    heads.res5.to(dtype=res5_dtype)
    backbone.input_layout = heads.res5_layout = layout


def bottleneck(in_ch: int, width: int, out_ch: int, c: DetectorConfig, stride: int = 1) -> Bottleneck:
    """torchvision's Bottleneck with a given bottleneck width and output width; a projection shortcut whenever the
    width changes (the caffe ResNet's rule); the stride in the first 1x1 conv when the config says so."""
    planes = out_ch // 4
    base_width = width * 64 // (c.resnet_groups * planes)
    shortcut = None
    if in_ch != out_ch:
        shortcut = nn.Sequential(nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=False), FrozenBN(out_ch))
    block = Bottleneck(in_ch, planes, stride, shortcut, c.resnet_groups, base_width, norm_layer=FrozenBN)
    if block.conv2.out_channels != width:
        raise ValueError(f"a bottleneck of width {width} with {c.resnet_groups} groups and {out_ch} outputs does "
                         "not fit torchvision's Bottleneck")
    if c.resnet_stride_in_1x1:
        block.conv1.stride, block.conv2.stride = (stride, stride), (1, 1)
    return block


def stage(count: int, in_ch: int, width: int, out_ch: int, c: DetectorConfig, stride: int) -> nn.Sequential:
    blocks = [bottleneck(in_ch, width, out_ch, c, stride)]
    blocks += [bottleneck(out_ch, width, out_ch, c) for _ in range(count - 1)]
    return nn.Sequential(*blocks)


class Stem(nn.Module):
    """7x7 stride-2 conv, frozen BN, ReLU, 3x3 stride-2 max pool (caffe's: no padding, ceil mode)."""

    def __init__(self, c: DetectorConfig):
        super().__init__()
        self.conv1 = nn.Conv2d(3, c.resnet_stem_channels, 7, stride=2, padding=3, bias=False)
        self.bn1 = FrozenBN(c.resnet_stem_channels)
        self.caffe_maxpool = c.resnet_caffe_maxpool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        if self.caffe_maxpool:
            return F.max_pool2d(x, kernel_size=3, stride=2, padding=0, ceil_mode=True)
        return F.max_pool2d(x, kernel_size=3, stride=2, padding=1)


class ResNetC4(nn.Module):
    """Stem and res2-res4: (B, 3, H, W) -> (B, 4 res2_channels, ~H/16, ~W/16)."""

    def __init__(self, c: DetectorConfig):
        super().__init__()
        blocks = RESNET_BLOCKS[c.resnet_depth]
        out, width = c.resnet_res2_channels, c.resnet_bottleneck_channels
        self.stem = Stem(c)
        self.res2 = stage(blocks[0], c.resnet_stem_channels, width, out, c, stride=1)
        self.res3 = stage(blocks[1], out, 2 * width, 2 * out, c, stride=2)
        self.res4 = stage(blocks[2], 2 * out, 4 * width, 4 * out, c, stride=2)
        self.out_channels = 4 * out
        self.input_layout = torch.contiguous_format  # channels_last once fast_convolutions has run

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Images in any dtype -> res4 in the weights' dtype and layout. A CPU takes a batch one image at a time: a
        photo's activations then stay in the caches (8 photos of 600 x 800: 343 ms a photo against 444 as one batch,
        2 cores), and res4 is the same."""
        if x.shape[0] > 1 and x.device.type == "cpu":
            return torch.cat([self(image) for image in x.split(1)])
        x = x.to(dtype=self.stem.conv1.weight.dtype, memory_format=self.input_layout)
        return self.res4(self.res3(self.res2(self.stem(x))))


def cell_anchors(sizes: tuple[int, ...], ratios: tuple[float, ...]) -> torch.Tensor:
    """(A, 4) anchors centred on 0, size-major: area size^2, height / width = ratio, unrounded."""
    rows = []
    for size in sizes:
        for ratio in ratios:
            w = math.sqrt(size * size / ratio)
            h = ratio * w
            rows.append([-w / 2, -h / 2, w / 2, h / 2])
    return torch.tensor(rows, dtype=torch.float64).float()


def grid_anchors(cells: torch.Tensor, height, width, offset: float) -> torch.Tensor:
    """(H W A, 4) anchors over a feature map, row-major over cells, anchor-minor (the RPN's output order)."""
    xs = torch.arange(width, dtype=torch.float32, device=cells.device) * STRIDE + offset * STRIDE
    ys = torch.arange(height, dtype=torch.float32, device=cells.device) * STRIDE + offset * STRIDE
    ys, xs = torch.meshgrid(ys, xs, indexing="ij")
    shifts = torch.stack([xs.reshape(-1), ys.reshape(-1)] * 2, dim=1)  # (H W, 4)
    return (shifts[:, None, :] + cells[None, :, :]).reshape(-1, 4)


class ButdRPN(nn.Module):
    """Region proposals: per anchor an objectness logit and box deltas; the top pre-NMS proposals of each image,
    clipped, without tiny ones, after NMS, best first."""

    def __init__(self, c: DetectorConfig, in_channels: int):
        super().__init__()
        self.config = c
        hidden = c.rpn_channels if c.rpn_channels > 0 else in_channels
        anchors = cell_anchors(c.anchor_sizes[0], c.aspect_ratios)
        self.conv = nn.Conv2d(in_channels, hidden, 3, padding=1)
        self.objectness = nn.Conv2d(hidden, anchors.shape[0], 1)
        self.deltas = nn.Conv2d(hidden, 4 * anchors.shape[0], 1)
        self.register_buffer("cell_anchors", anchors)  # imported with the weights: the checkpoint's anchors are used
        self.box_coder = BoxCoder(c.rpn_box_weights, bbox_xform_clip=BOX_CLAMP)

    def forward(self, features: torch.Tensor, image_sizes: list[tuple[int, int]]) -> list[torch.Tensor]:
        c = self.config
        b, _, fh, fw = features.shape
        hidden = F.relu(self.conv(features.float()))  # float32 whatever the backbone's dtype
        logits = self.objectness(hidden).permute(0, 2, 3, 1).reshape(b, -1)  # (B, H W A)
        deltas = self.deltas(hidden)
        deltas = deltas.view(b, -1, 4, fh, fw).permute(0, 3, 4, 1, 2).reshape(-1, 4)  # (B H W A, 4)
        anchors = grid_anchors(self.cell_anchors, fh, fw, c.anchor_offset)
        boxes = self.box_coder.decode_single(deltas, anchors.repeat(b, 1)).view(b, -1, 4)  # (B, H W A, 4)
        # top pre-NMS anchors of each image by objectness (a full sort, then the first k)
        logits, order = logits.sort(dim=1, descending=True)
        k = _topk_min(logits, c.rpn_pre_nms_top_n, 1)  # a graph value when exported: the image size is dynamic
        logits, order = logits[:, :k], order[:, :k]
        proposals = []
        for i, (h, w) in enumerate(image_sizes):
            scores, found = logits[i], clip_boxes_to_image(boxes[i][order[i]], (h, w))
            sides = found[:, 2:] - found[:, :2]
            big = (sides > c.rpn_min_size).all(dim=1)
            scores, found = scores[big], found[big]
            if eager() and found.device.type == "cpu":  # the same indices as below, found without suppressing the
                keep = nms_first(found, scores, c.rpn_nms_thresh, c.rpn_post_nms_top_n)  # boxes after the last taken
            else:  # traced or exported: the graph's NonMaxSuppression; a GPU's kernel is fast (and nms_first syncs)
                keep = batched_nms(found, scores, torch.zeros_like(scores, dtype=torch.int64), c.rpn_nms_thresh)
                keep = keep[: c.rpn_post_nms_top_n]
            scores, best = scores[keep].sort(descending=True)
            proposals.append(found[keep][best])
        return proposals


class ButdRoIHeads(nn.Module):
    """RoIPool on res4, res5, spatial mean -> region features; class, box and attribute predictions."""

    def __init__(self, c: DetectorConfig, in_channels: int):
        super().__init__()
        self.config = c
        d, k, a = c.feature_dim, len(c.classes), len(c.attributes)
        self.res5 = stage(3, in_channels, 8 * c.resnet_bottleneck_channels, d, c, stride=2)
        self.res5_layout = torch.contiguous_format  # channels_last once fast_convolutions has run
        self.exact_res5: nn.Sequential | None = None  # float32 res5 beside a bfloat16 one (fast_convolutions)
        if c.res5_dilated:  # bottom-up attention's VG head: the first 1x1 conv and shortcut at stride 1, 3x3s dilated
            first = self.res5[0]
            first.conv1.stride = first.downsample[0].stride = (1, 1)
            for block in self.res5:
                block.conv2.padding = block.conv2.dilation = (2, 2)
        self.cls_score = nn.Linear(d, k + 1)  # column k = background
        self.bbox_pred = nn.Linear(d, 4 * k)
        self.cls_embedding = nn.Embedding(k + 1, d // 8)
        self.fc_attr = nn.Linear(d + d // 8, d // 4)
        self.attr_score = nn.Linear(d // 4, a + 1)  # the last column is dropped when predicting
        self.box_coder = BoxCoder(c.box_weights, bbox_xform_clip=BOX_CLAMP)

    def features(self, res4: torch.Tensor, boxes: list[torch.Tensor]) -> torch.Tensor:
        """(R, D) float32 features of boxes (per image, resized-image pixels), res5 in its weights' dtype, one image
        at a time: a photo's 300 proposals already fill the GEMMs, a batch's at once would hold GBs of activations
        (each (R, 2048, 14, 14) float32 tensor is 3.9 GB at 8 photos), and each image's regions come out exactly as
        when it is alone."""
        return torch.cat([self._image_features(res4[i : i + 1], b, self.res5) for i, b in enumerate(boxes)])

    def settle(self, res4: torch.Tensor, proposals: list[torch.Tensor], image_sizes: list[tuple[int, int]],
               features: torch.Tensor) -> torch.Tensor:
        """With res5 in bfloat16 (exact_res5 set): per image, the features of the proposals whose part in the region
        choice lies within bfloat16's error (select.uncertain_choices) recomputed by the float32 res5, SETTLE_ROUND at a
        time, nearest the cut first, until none is left; the regions then chosen are float32's, most of the features
        stay bfloat16's. (R, D).
        The choice reads each proposal's best class and that class's box only, so only those box deltas are
        computed (best_boxes)."""
        c, out, start = self.config, [], 0
        for i, props in enumerate(proposals):
            feats = features[start : start + props.shape[0]].clone()
            start += props.shape[0]
            logits = self.cls_score(feats)
            exact = torch.zeros(props.shape[0], dtype=torch.bool, device=props.device)
            pool = None
            while True:
                boxes, scores = self.best_boxes(feats, props, logits, image_sizes[i])
                conf, _ = best_class_nms(boxes, scores, c.region_nms_thresh)
                keep = choose_regions(conf, c.num_boxes, c.adaptive, c.min_boxes, c.max_boxes, c.conf_thresh)
                redo = uncertain_choices(boxes, scores, c.region_nms_thresh, keep, BF16_SCORE_ERROR, BF16_IOU_ERROR,
                                         c.conf_thresh if c.adaptive else None, exact)
                idx = redo.nonzero().flatten()
                if idx.numel() == 0:
                    break
                idx = nearest_cut(idx, scores, keep, SETTLE_ROUND)  # once exact, their neighbours' margins halve
                if pool is None:  # this image's float32 pooling, its bins computed once for every round
                    pool = ImageRoIPool(res4[i].float(), props, c.roi_size, 1.0 / STRIDE)
                feats[idx] = self._res5_features(pool(idx), self.exact_res5)
                logits[idx] = self.cls_score(feats[idx])
                exact[idx] = True
            out.append(feats)
        return torch.cat(out) if out else features

    def best_boxes(self, feats: torch.Tensor, proposals: torch.Tensor, logits: torch.Tensor, resized_hw):
        """decode() for what frcnn-vg's region choice reads, and its regions' boxes: (R, K, 4) boxes of which only
        each proposal's best class is computed (the other classes repeat it: an expanded view), and the foreground
        probabilities (R, K). 4 of bbox_pred's 6400 rows a proposal: 40 ms less a photo than forward's (2 cores)."""
        r, k = logits.shape[0], logits.shape[1] - 1
        scores = F.softmax(logits, -1)[:, :-1]
        best = scores.argmax(1)
        rows = self.bbox_pred.weight.view(k, 4, -1)[best]  # (R, 4, D)
        deltas = torch.bmm(rows, feats[:, :, None]).squeeze(2) + self.bbox_pred.bias.view(k, 4)[best]
        boxes = clip_boxes_to_image(self.box_coder.decode_single(deltas, proposals), resized_hw)
        return boxes[:, None].expand(r, k, 4), scores

    def _image_features(self, res4: torch.Tensor, boxes: torch.Tensor, res5: nn.Sequential) -> torch.Tensor:
        rois = torch.cat([torch.zeros_like(boxes[:, :1]), boxes], dim=1)
        if self.res5_layout == torch.channels_last:  # the serving form: the same pooling, in res5's dtype and layout
            res4 = res4.to(dtype=res5[0].conv1.weight.dtype, memory_format=torch.channels_last)
            return self._res5_features(roi_pool_channels_last(res4, rois, self.config.roi_size, 1.0 / STRIDE), res5)
        pooled = roi_pool(res4.float(), rois, self.config.roi_size, 1.0 / STRIDE)  # (R, C, S, S)
        return res5(pooled).mean(dim=(2, 3))

    def _res5_features(self, pooled: torch.Tensor, res5: nn.Sequential) -> torch.Tensor:
        """The serving form's res5 and spatial mean: (R, C, S, S) channels-last -> (R, D) float32, RES5_CHUNK
        proposals at a time: a block's input, output and residual then stay in the caches (a photo's bfloat16
        detector 9% faster than with all 300 at once, 2 cores), and its activations take tens of MB, not GBs. A GPU
        takes them at once (chunks would only add kernel launches)."""
        if not res5[0].conv2.weight.is_contiguous(memory_format=torch.channels_last):  # float32 on a GPU
            pooled = pooled.contiguous()
        parts = []
        for chunk in pooled.split(RES5_CHUNK) if pooled.device.type == "cpu" else (pooled,):
            out = res5(chunk)
            if out.dtype == torch.float32:
                parts.append(out.mean(dim=(2, 3)))
                continue
            # bfloat16: the spatial sum as a product with ones (float32 accumulation, one rounding), several times
            # faster than a reduction, which first copies the whole (R, D, S, S) map to float32
            cells = out.permute(0, 2, 3, 1).reshape(out.shape[0], -1, out.shape[1])  # a view of channels-last
            parts.append(torch.matmul(out.new_ones((1, cells.shape[1])), cells).squeeze(1).float() / cells.shape[1])
        return torch.cat(parts) if parts else pooled.new_zeros((0, self.cls_score.in_features), dtype=torch.float32)

    def forward(self, features: torch.Tensor, box_deltas: bool = True):
        """(R, D) -> class logits (R, K+1), box deltas (R, 4K) (None without `box_deltas`: best_boxes computes the
        ones a region choice reads), attribute logits (R, A+1). Attributes read the embedding of each region's best
        class, background included."""
        class_logits = self.cls_score(features)
        box_deltas = self.bbox_pred(features) if box_deltas else None
        embedding = self.cls_embedding(class_logits.max(-1).indices)
        attr_logits = self.attr_score(F.relu(self.fc_attr(torch.cat([features, embedding], dim=-1))))
        return class_logits, box_deltas, attr_logits

    def decode(self, box_deltas: torch.Tensor, proposals: torch.Tensor, class_logits: torch.Tensor, resized_hw):
        """Class-specific boxes (R, K, 4) clipped to the image, and foreground probabilities (R, K)."""
        r, k = class_logits.shape[0], class_logits.shape[1] - 1
        boxes = self.box_coder.decode_single(box_deltas, proposals).reshape(r, k, 4)
        return clip_boxes_to_image(boxes, resized_hw), F.softmax(class_logits, -1)[:, :-1]

    @staticmethod
    def attributes(attr_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The best attribute and its probability, a softmax without the last column."""
        return F.softmax(attr_logits[:, :-1], -1).max(-1)
