"""Full-size public checkpoints with seeded random weights, written in their public formats (no download needed):
the frcnn-vg detector (config.yaml + pytorch_model.bin with the keys and shapes of the reference's ResNet-101 C4
module tree, tests/fixtures/frcnn_vg/full_size_keys.json, and Visual Genome's 1600/400 vocab files) and
transformers' LxmertForQuestionAnswering / LxmertForPreTraining at LxmertConfig()'s defaults (BERT-base: hidden
768, 9/5/5 layers, 2048-d regions, 3129 VQA answers), saved with save_pretrained beside bert-base-uncased's vocab.

The random detector is initialised so that it behaves like a detector, not like noise: He-initialised convolutions,
identity batch norms, residual branches scaled down (0.2) so 33 bottlenecks keep activations in range, the stem
scaled to caffe's 0..255 pixel range, and detectron's small initial RPN and box predictors (std 0.01 / 0.001), so
proposals are anchors moved a little, all the RPN may keep survive its NMS and the 36 most confident regions are
kept. Its classes are not meaningful: every region's feature is mostly their common mean, so most regions get the
same class; the encoder does not care.
"""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch
import yaml

FULL_SIZE = Path(__file__).resolve().parents[1] / "fixtures" / "frcnn_vg" / "full_size_keys.json"
NUM_ANSWERS = 3129  # VQA's trainval_label2ans.json
RESIDUAL_SCALE = 0.2  # the last batch norm of each bottleneck: keeps 33 residual additions from blowing up
PIXEL_SCALE = 1 / 64  # caffe input is pixels minus the mean (about +-100): scale the stem to unit-size outputs


def frcnn_vg_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """Seeded random tensors with exactly the keys and shapes of the reference's full-size detector."""
    from models.detector.butd import cell_anchors

    full = json.loads(FULL_SIZE.read_text())
    anchors = full["config"]["ANCHOR_GENERATOR"]
    g = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    for key, shape in full["tensors"].items():
        shape = tuple(shape)
        if key.endswith("num_batches_tracked"):
            value = torch.zeros(shape, dtype=torch.int64)
        elif key.endswith("cell_anchors.0"):
            value = cell_anchors(tuple(anchors["SIZES"][0]), tuple(anchors["ASPECT_RATIOS"][0]))
        elif key.endswith("norm.running_mean") or key.endswith("norm.bias") or key.endswith(".bias"):
            value = torch.zeros(shape)
        elif key.endswith("norm.running_var"):
            value = torch.ones(shape)
        elif key.endswith("norm.weight"):
            value = torch.full(shape, RESIDUAL_SCALE if ".conv3.norm." in key else 1.0)
        elif key.startswith("proposal_generator.rpn_head.") and "conv" not in key:
            value = 0.01 * torch.randn(shape, generator=g)  # objectness and anchor deltas, as detectron initialises
        elif key.endswith("bbox_pred.weight"):
            value = 0.001 * torch.randn(shape, generator=g)
        elif key.endswith("cls_score.weight") or key.endswith("attr_score.weight"):
            value = 0.05 * torch.randn(shape, generator=g)
        elif key.endswith("cls_embedding.weight"):
            value = torch.randn(shape, generator=g)
        else:  # convolutions and fc_attr: He initialisation (fan in)
            fan_in = math.prod(shape[1:])
            value = math.sqrt(2.0 / fan_in) * torch.randn(shape, generator=g)
            if key == "backbone.stem.conv1.weight":
                value *= PIXEL_SCALE
        state[key] = value
    return state


def write_frcnn_vg(src: Path, seed: int = 0, proposals: int | None = None) -> Path:
    """A directory in unc-nlp/frcnn-vg-finetuned's format plus the VG vocab files (1600 objects, 400 attributes).
    `proposals` replaces the config's RPN.POST_NMS_TOPK_TEST (300): the RoI head runs res5 on every proposal."""
    full = json.loads(FULL_SIZE.read_text())
    if proposals is not None:
        full["config"]["RPN"]["POST_NMS_TOPK_TEST"] = proposals
    src.mkdir(parents=True, exist_ok=True)
    (src / "config.yaml").write_text(yaml.safe_dump(full["config"]))
    # the bottom-up-attention vocab format: one class per line, synonyms after commas
    (src / "objects_vocab.txt").write_text("".join(f"object{i},thing{i}\n" for i in range(1600)))
    (src / "attributes_vocab.txt").write_text("".join(f"attribute{i}\n" for i in range(400)))
    torch.save(frcnn_vg_state(seed), src / "pytorch_model.bin")
    return src


def answers_table(path: Path) -> Path:
    """VQA's trainval_label2ans.json form: a JSON list of 3129 answers."""
    path.write_text(json.dumps([f"answer {i}" for i in range(NUM_ANSWERS)]))
    return path


@torch.no_grad()
def write_hf_lxmert(src: Path, cls_name: str, seed: int = 0, num_qa_labels: int | None = None) -> Path:
    """transformers' `cls_name` at LxmertConfig()'s defaults (full size; num_qa_labels 9500, the pretraining answer
    head's, unless given), seeded, saved with save_pretrained beside bert-base-uncased's vocab.txt (as the hub's
    unc-nlp repositories ship it)."""
    import transformers

    from models.tokenizer import VLTokenizer

    torch.manual_seed(seed)
    # BERT-base sizes, l/r/x layers 9/5/5, visual_feat_dim 2048, 1600 objects / 400 attributes
    config = transformers.LxmertConfig(**({} if num_qa_labels is None else {"num_qa_labels": num_qa_labels}))
    model = getattr(transformers, cls_name)(config).eval()
    model.save_pretrained(src)
    del model
    shutil.copyfile(VLTokenizer.pretrained_minilm().vocab_file, src / "vocab.txt")
    return src
