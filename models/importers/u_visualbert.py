"""Import the weakly-supervised VisualBERT's checkpoints (github.com/uclanlp/visualbert, unsupervised_visualbert: Li
et al. 2021, "Unsupervised Vision-and-Language Pre-training Without Parallel Images and Captions") as a
`u-visualbert` model with the published embedding style.

Its files are `torch.save(model.state_dict())` pickles, read here with weights_only (plain tensors only):
  *_LXRT.pth  the pretraining model LXRTPretraining saved through nn.DataParallel (`module.` before every key; none on
              one GPU): bert.*, cls.* (masked LM, whose prediction also reconstructs the tags, and ITM),
              obj_predict_head.* (object, attribute and feature heads), symbolic_head.*; the published
              CC_Unsupervised_LXRT.pth. Trained with lxmert_style_nlvr (its NLVR2 setting) the ITM classifier is
              cls.seq_relationship_new, reading the two images' pooled vectors.
  vqa.pth     a fine-tuned VQAModel (src/tasks/vqa.py): lxrt_encoder.model.bert.* with `module.` after `model.` and
              after `bert.` when fine-tuned with --multiGPU (the published snap/vqa.pth), and logit_fc.*
Mapping (reference -> vlserve), `p` the prefix of LXRTModel (bert.):
  p.embeddings.{word,position,token_type}_embeddings, LayerNorm -> encoder.embeddings.* (text)
  p.embeddings.visn_fc, visn_layer_norm     -> encoder.embeddings.visual_projection, visual_layer_norm
  p.embeddings.box_fc, box_layer_norm       -> encoder.embeddings.box_projection, box_layer_norm
  p.embeddings.tag_layer_norm               -> encoder.embeddings.tag_layer_norm
  p.encoder.layer.{i}                       -> encoder.layer.{i} (BERT layers, qkv fused)
  p.pooler.dense                            -> encoder.pooler.dense
  cls.predictions                           -> heads.mlm, and copied into heads.tag (tag reconstruction decodes the
                                               tag tokens with the same module); decoder tied to the word embeddings
  cls.seq_relationship                      -> heads.itm
  cls.seq_relationship_new                  -> heads.nlvr2 (pair mode, linear classifier on the concatenated pooled)
  obj_predict_head (transform copied into each) decoder_dict.obj / attr / feat -> heads.mrc / attr (kind mrc) / mrfr
  logit_fc.{0,2,3}                          -> heads.vqa.cls
Tensors its forward never reads at the flags of its published configs, listed under ignored_keys:
  p.embeddings.symbolic_embedding           use_bert_input_for_tags: tags are embedded with the word table
  p.embeddings.{token_type,position}_embeddings_visual  use_segment_embedding_for_vision_and_tag and oscar_style off
  p.encoder.visn_fc.*                       LXMERT's region encoder; hybrid_embedding embeds regions in embeddings
  symbolic_head.*                           use_bert_input_for_tags: tags are reconstructed by cls, not by it
Anything else left over is another model's tensor and an error.

Sizes come from the tensors: widths from their shapes, the layer count from their keys. The number of attention
heads, which no shape shows, comes from a bert_config.json beside the weights (the file the reference's BertConfig
reads), else from bert-base-uncased's config, which the reference always builds from. The tokenizer: a vocab.txt
beside the weights, else bert-base-uncased's.
"""
from __future__ import annotations

from pathlib import Path

from ..config import HeadConfig, ModelConfig
from .hf_common import (
    HFImportError,
    HFSource,
    bert_fields,
    build_encoder_config,
    layer_count,
    name_answers,
    pretraining_heads,
    write_checkpoint,
)
from .hf_lxmert import LAYER_NORM_EPS, answer_head, object_heads
from .keymap import KeyMap, bert_embeddings, bert_layer, linear
from .lxmert_original import read_original, word_embedding_size

FORMAT = "u-visualbert"
FILES = "snap/vqa.pth, CC_Unsupervised_LXRT.pth"  # its published files, named when a directory is given
# where LXRTModel's tensors sit -> where the pretraining heads sit, None for a fine-tuned VQA model (head: logit_fc)
LAYOUTS = {
    "module.bert.": "module.",  # LXRTPretraining under nn.DataParallel (the published *_LXRT.pth)
    "bert.": "",  # the same on one GPU
    "lxrt_encoder.model.module.bert.module.": None,  # VQAModel fine-tuned with --multiGPU (the published vqa.pth)
    "lxrt_encoder.model.module.bert.": None,  # VQAModel whose encoder alone went through DataParallel
    "lxrt_encoder.model.bert.": None,  # VQAModel on one GPU
}
UNUSED = {  # tensors the reference saves but its forward never reads at its published flags -> why
    "embeddings.symbolic_embedding.weight": "tags are embedded with the word table (use_bert_input_for_tags)",
    "embeddings.token_type_embeddings_visual.weight": "no segment on regions and tags",
    "embeddings.position_embeddings_visual.weight": "no position on regions and tags",
    "encoder.visn_fc.": "LXMERT's region encoder; hybrid_embedding embeds the regions in embeddings",
}
UNUSED_HEADS = ("symbolic_head.",)  # tags are reconstructed by cls (use_bert_input_for_tags)
EMBEDDINGS = {  # our embeddings module <- the reference's BertEmbeddingsWithVisualEmbedding
    "visual_projection": "visn_fc", "visual_layer_norm": "visn_layer_norm", "box_projection": "box_fc",
    "box_layer_norm": "box_layer_norm", "tag_layer_norm": "tag_layer_norm",
}
OTHER_FORMATS = {  # first key prefix of a checkpoint this importer does not read -> the command that does
    "lxmert.": "transformers' LXMERT weights: import their directory with `vlserve import hf-lxmert`",
    "visual_bert.": "transformers' VisualBERT weights: import their directory with `vlserve import hf-visualbert`",
}


def encoder_prefix(source: HFSource) -> str:
    """The LAYOUTS key under which the file holds LXRTModel with the weakly-supervised VisualBERT's embeddings;
    another format fails saying which it is."""
    for prefix in LAYOUTS:
        if source.has(f"{prefix}embeddings.word_embeddings.weight"):
            if source.has(f"{prefix}embeddings.visn_fc.weight"):
                return prefix
            if source.has(f"{prefix}encoder.visn_fc.visn_fc.weight"):
                raise HFImportError(
                    f"{source.weights_path}: an airsplay/lxmert checkpoint (regions embedded by encoder.visn_fc, no "
                    "tag embeddings): import it with `vlserve import lxmert`"
                )
    first = next(iter(source.state), "")
    for other, what in OTHER_FORMATS.items():
        if first.startswith(other):
            raise HFImportError(f"{source.weights_path}: {what}")
    raise HFImportError(
        f"{source.weights_path}: not a uclanlp/visualbert unsupervised_visualbert checkpoint (no "
        f"bert.embeddings.visn_fc.weight at the top, under module. or under lxrt_encoder.model.; first tensor: "
        f"{first or 'none'})"
    )


def encoder_fields(source: HFSource, p: str) -> dict:
    """EncoderConfig fields: widths and the layer count from the tensors, heads and dropout from the BERT config,
    whose sizes must agree with the tensors'."""
    vocab_size, hidden = word_embedding_size(source, p)
    for sub in ("x_layers", "r_layers"):
        if layer_count(source, f"{p}encoder.{sub}"):
            raise HFImportError(f"{source.weights_path}: has {p}encoder.{sub}: a two-stream LXMERT, not the single "
                                "VisualBERT stack (visualbert_style)")
    box_dim = source.shape(f"{p}embeddings.box_fc.weight")[1]
    if box_dim != 4:
        raise HFImportError(f"{source.weights_path}: {p}embeddings.box_fc takes {box_dim} values, not a 4-d box")
    fields = bert_fields(source, layer_norm_eps=LAYER_NORM_EPS) | dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=source.shape(f"{p}encoder.layer.0.intermediate.dense.weight")[0],
        max_position_embeddings=source.shape(f"{p}embeddings.position_embeddings.weight")[0],
        type_vocab_size=source.shape(f"{p}embeddings.token_type_embeddings.weight")[0],
        num_layers=layer_count(source, f"{p}encoder.layer"),
        visual_feat_dim=source.shape(f"{p}embeddings.visn_fc.weight")[1],
        region_tags=True,  # fine-tuned and pretrained with the detector's tags (add_tags, use_visual_tag_flag)
        embedding_style="published",
    )
    config_sizes = {"vocab_size": vocab_size, "hidden_size": hidden, "intermediate_size": fields["intermediate_size"]}
    for name, size in config_sizes.items():
        stated = source.get(name, default=size)
        if stated != size:
            raise HFImportError(f"{source.config_path}: {name} is {stated}, but the weights' is {size}")
    return fields


def unused_keys(source: HFSource, p: str, head_p: str | None) -> set[str]:
    prefixes = [f"{p}{key}" for key in UNUSED] + [f"{head_p}{key}" for key in UNUSED_HEADS if head_p is not None]
    return {key for key in source.state if any(key.startswith(prefix) for prefix in prefixes)}


def encoder_keymap(p: str, num_layers: int) -> KeyMap:
    keymap = bert_embeddings("encoder.embeddings", f"{p}embeddings")
    for ours, theirs in EMBEDDINGS.items():
        keymap |= linear(f"encoder.embeddings.{ours}", f"{p}embeddings.{theirs}")
    for i in range(num_layers):
        keymap |= bert_layer(f"encoder.layer.{i}", f"{p}encoder.layer.{i}")
    return keymap | linear("encoder.pooler.dense", f"{p}pooler.dense")


def pretraining_model_heads(source: HFSource, p: str, head_p: str, feat_dim: int) -> tuple[dict[str, HeadConfig], KeyMap]:
    """LXRTPretraining's heads: masked LM (also the tag head), ITM or NLVR2, object, attribute and feature heads."""
    heads, keymap = pretraining_heads(source, f"{p}embeddings.word_embeddings.weight", head_p)
    if "mlm" in heads:  # the tag objective decodes the tag tokens with cls.predictions
        heads["tag"] = HeadConfig(kind="tag")
        keymap |= {key.replace("heads.mlm.", "heads.tag.", 1): src for key, src in keymap.items() if key.startswith("heads.mlm.")}
    nlvr2 = f"{head_p}cls.seq_relationship_new"
    if source.has(f"{nlvr2}.weight"):
        heads["nlvr2"] = HeadConfig(kind="nlvr2", classifier="linear", nlvr2_mode="pair", pool="pooled")
        keymap |= linear("heads.nlvr2.cls", nlvr2)
    obj_heads, obj_keys = object_heads(source, feat_dim, head_p)
    heads |= obj_heads
    keymap |= obj_keys
    attr = f"{head_p}obj_predict_head"
    if source.has(f"{attr}.decoder_dict.attr.weight"):
        heads["attr"] = HeadConfig(kind="mrc", num_labels=source.rows(f"{attr}.decoder_dict.attr.weight"), mrc_loss="ce")
        keymap |= linear("heads.attr.transform.dense", f"{attr}.transform.dense")
        keymap |= linear("heads.attr.transform.LayerNorm", f"{attr}.transform.LayerNorm")
        keymap |= linear("heads.attr.decoder", f"{attr}.decoder_dict.attr")
    return heads, keymap


def convert(source: HFSource, answers: Path | None = None) -> tuple[ModelConfig, dict, dict, str]:
    """Our config, tensors and labels from a checkpoint of the reference, and the reference model it was saved from."""
    p = encoder_prefix(source)
    head_p = LAYOUTS[p]
    encoder = build_encoder_config(source, "u-visualbert", encoder_fields(source, p))
    keymap = encoder_keymap(p, encoder.num_layers)
    heads: dict[str, HeadConfig] = {}
    if head_p is not None:
        heads, head_keys = pretraining_model_heads(source, p, head_p, encoder.visual_feat_dim)
        keymap |= head_keys
        model = "LXRTPretraining" + (" (lxmert_style_nlvr)" if "nlvr2" in heads else "")
    else:
        if source.has("logit_fc.0.weight") and (reads := source.shape("logit_fc.0.weight")[1]) != encoder.hidden_size:
            raise HFImportError(f"{source.weights_path}: logit_fc reads {reads} "
                                f"values, not the pooled {encoder.hidden_size}")
        if source.has("logit_fc.3.weight"):
            heads["vqa"], qa_keys = answer_head(source, "vqa", "logit_fc")
            keymap |= qa_keys
        model = "VQAModel"
    labels: dict = {"heads": {}}
    name_answers(source, heads, labels, answers)
    weights = source.take(keymap)
    extra = [key for key in source.ignored() if key not in unused_keys(source, p, head_p)]
    if extra:  # the reference's modules save nothing else: another model's tensor is an error, not a warning
        raise HFImportError(f"{source.weights_path}: unexpected tensor {extra[0]} ({len(extra)} not part of {model})")
    return ModelConfig(encoder=encoder, heads=heads), weights, labels, model


def import_u_visualbert(src: str | Path, out: str | Path, answers: Path | None = None) -> Path:
    """Convert a uclanlp/visualbert unsupervised_visualbert .pth file into a vlserve checkpoint directory; returns
    `out`. `answers`: the answer table of its VQA head (hf_common.read_answers)."""
    source = read_original(src, FILES)
    config, weights, labels, model = convert(source, answers)
    return write_checkpoint(source, out, config, weights, labels, FORMAT, model, answers)
