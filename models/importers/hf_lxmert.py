"""Import transformers' Lxmert* checkpoints (the public unc-nlp/lxmert-* format) as an `lxmert` model.

Mapping (transformers -> vlserve), `lxmert.` prefix present on task models only:
  embeddings.*                              -> encoder.embeddings.*
  encoder.visn_fc.*                         -> encoder.visn_fc.* (same names)
  encoder.{layer,r_layers}.{i}.*            -> encoder.{layer,r_layers}.{i} (BERT layers, qkv fused)
  encoder.x_layers.{i}.visual_attention.{att,output} -> encoder.x_layers.{i}.visual_attention (kv fused)
  encoder.x_layers.{i}.{lang,visn}_self_att -> encoder.x_layers.{i}.{lang,visn}_self_att
  encoder.x_layers.{i}.{lang,visn}_{inter,output} -> encoder.x_layers.{i}.{lang,visn}_ffn
  pooler.dense                              -> encoder.pooler.dense
  answer_head.logit_fc.{0,2,3}              -> heads.vqa.cls (QuestionAnswering) or heads.image_qa.cls (PreTraining:
                                               lxmert-base-uncased's 9500-way image-QA objective, never served as /vqa)
  cls.predictions / cls.seq_relationship    -> heads.mlm / heads.itm
  obj_predict_head.transform + decoder_dict.obj  -> heads.mrc (masked region class, 'ce' over the detector's objects)
  obj_predict_head.transform + decoder_dict.feat -> heads.mrfr (masked region feature regression)
  obj_predict_head.decoder_dict.attr        -> not imported (vlserve has no attribute head): listed as ignored
The shared object-head transform is copied into both mrc and mrfr. `--answers` names the answer head's outputs
(hf_common.read_answers).
"""
from __future__ import annotations

from pathlib import Path

from ..config import HeadConfig, ModelConfig
from .hf_common import (
    HFImportError,
    HFSource,
    bert_fields,
    build_encoder_config,
    name_answers,
    pretraining_heads,
    read_source,
    stated_layers,
    write_checkpoint,
)
from .keymap import KeyMap, bert_embeddings, bert_layer, cross_attention, feed_forward, linear, self_attention

FORMAT = "hf-lxmert"
ARCHITECTURES = ("LxmertModel", "LxmertForPreTraining", "LxmertForQuestionAnswering")
LAYER_NORM_EPS = 1e-12  # transformers' Lxmert modules hard-code it (config.json has no field)


def encoder_keymap(p: str, num_layers: int, num_image_layers: int, num_cross_layers: int) -> KeyMap:
    """Our lxmert encoder from an LxmertModel whose keys start with `p`."""
    keymap = bert_embeddings("encoder.embeddings", f"{p}embeddings")
    for name in ("visn_fc", "visn_layer_norm", "box_fc", "box_layer_norm"):
        keymap |= linear(f"encoder.visn_fc.{name}", f"{p}encoder.visn_fc.{name}")
    for stack, count in (("layer", num_layers), ("r_layers", num_image_layers)):
        for i in range(count):
            keymap |= bert_layer(f"encoder.{stack}.{i}", f"{p}encoder.{stack}.{i}")
    for i in range(num_cross_layers):
        dst, src = f"encoder.x_layers.{i}", f"{p}encoder.x_layers.{i}"
        keymap |= cross_attention(f"{dst}.visual_attention", f"{src}.visual_attention.att", f"{src}.visual_attention.output")
        for stream in ("lang", "visn"):
            keymap |= self_attention(f"{dst}.{stream}_self_att", f"{src}.{stream}_self_att.self", f"{src}.{stream}_self_att.output")
            keymap |= feed_forward(f"{dst}.{stream}_ffn", f"{src}.{stream}_inter", f"{src}.{stream}_output")
    return keymap | linear("encoder.pooler.dense", f"{p}pooler.dense")


def object_heads(source: HFSource, visual_feat_dim: int, p: str = "") -> tuple[dict[str, HeadConfig], KeyMap]:
    """LXMERT's object prediction head (at `{p}obj_predict_head`) split into our mrc (object classes) and mrfr
    (region features) heads."""
    heads: dict[str, HeadConfig] = {}
    keymap: KeyMap = {}
    src = f"{p}obj_predict_head"
    for task, name in (("mrc", "obj"), ("mrfr", "feat")):
        key = f"{src}.decoder_dict.{name}.weight"
        if not source.has(key):
            continue
        rows = source.rows(key)
        if task == "mrfr" and rows != visual_feat_dim:
            raise HFImportError(f"{source.weights_path}: {key} has {rows} outputs, not visual_feat_dim {visual_feat_dim}")
        heads[task] = HeadConfig(kind="mrc", num_labels=rows, mrc_loss="ce") if task == "mrc" else HeadConfig(kind="mrfr")
        keymap |= linear(f"heads.{task}.transform.dense", f"{src}.transform.dense")
        keymap |= linear(f"heads.{task}.transform.LayerNorm", f"{src}.transform.LayerNorm")
        keymap |= linear(f"heads.{task}.decoder", f"{src}.decoder_dict.{name}")
    return heads, keymap


def answer_head(source: HFSource, task: str, src: str) -> tuple[HeadConfig, KeyMap]:
    """LXMERT's answer classifier at `src` (Linear, GELU, LayerNorm, Linear: indices 0, 2, 3) as our `task` head."""
    head = HeadConfig(kind=task, num_labels=source.rows(f"{src}.3.weight"), pool="pooled", classifier="mlp")
    keymap: KeyMap = {}
    for i in (0, 2, 3):
        keymap |= linear(f"heads.{task}.cls.{i}", f"{src}.{i}")
    return head, keymap


def import_lxmert(src: str | Path, out: str | Path, answers: Path | None = None) -> Path:
    """Convert a transformers Lxmert* directory into a vlserve checkpoint directory; returns `out`.
    `answers`: the answer table of the answer head (hf_common.read_answers)."""
    source = read_source(src, "lxmert")
    architecture = source.architecture(ARCHITECTURES, FORMAT)
    if source.get("visual_pos_dim", default=4) != 4:
        raise HFImportError(f"{source.config_path}: visual_pos_dim must be 4 (normalized x1, y1, x2, y2)")
    p = source.prefix("lxmert")
    fields = bert_fields(source, layer_norm_eps=LAYER_NORM_EPS) | dict(
        num_layers=stated_layers(source, "l_layers", f"{p}encoder.layer"),
        num_image_layers=stated_layers(source, "r_layers", f"{p}encoder.r_layers"),
        num_cross_layers=stated_layers(source, "x_layers", f"{p}encoder.x_layers"),
        visual_feat_dim=source.get("visual_feat_dim"),
    )
    encoder = build_encoder_config(source, "lxmert", fields)
    keymap = encoder_keymap(p, encoder.num_layers, encoder.num_image_layers, encoder.num_cross_layers)

    heads, head_keys = pretraining_heads(source, f"{p}embeddings.word_embeddings.weight")
    keymap |= head_keys
    obj_heads, obj_keys = object_heads(source, encoder.visual_feat_dim)
    heads |= obj_heads
    keymap |= obj_keys
    labels: dict = {"heads": {}}
    if architecture == "LxmertForQuestionAnswering" or source.has("answer_head.logit_fc.3.weight"):
        # Beside pretraining heads (lxmert-base-uncased, whose config.json may name no architecture) the answer
        # head is LXMERT's image-QA objective over its 9500 pretraining answers; alone, a fine-tuned VQA/GQA head.
        pretraining = architecture == "LxmertForPreTraining" or (architecture != "LxmertForQuestionAnswering" and bool(heads))
        task = "image_qa" if pretraining else "vqa"
        heads[task], qa_keys = answer_head(source, task, "answer_head.logit_fc")
        keymap |= qa_keys
    name_answers(source, heads, labels, answers)

    weights = source.take(keymap)
    config = ModelConfig(encoder=encoder, heads=heads)
    return write_checkpoint(source, out, config, weights, labels, FORMAT, architecture, answers)
