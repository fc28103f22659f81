"""Import VOLTA's checkpoints (github.com/e-bug/volta) as `vilbert`, `lxmert`, `visualbert` or `vl-bert` models.

VOLTA builds every architecture from one config json listing, per sublayer, which attention it has (text-text `tt`,
text-vision `tv`, vision-text `vt`, vision-vision `vv`) and which feed-forward streams (`t_ff`, `v_ff`); its
`volta/train_utils.py` saves `torch.save(model.state_dict())`:
  pytorch_model_*.bin   BertForVLPreTraining (bert.*, cls.*) or BertForVLTasks (bert.*, clfs_dict.TASKxx.*)
The config is not in the weights file: it is one of VOLTA's config/*.json (--config, or the one beside the weights).
ViLBERT-style configs (image_embeddings "vilbert": text layers, image layers, co-attention layers whose queries
attend to the other stream only, each stream with its own weights, the whole image as a first region, 5-d locations,
the two ReLU poolers' outputs multiplied) map onto the `vilbert` preset: config/ctrl_vilbert_base.json,
vilbert_base.json. LXMERT-style configs (image_embeddings "lxmert": language and object-relationship layers, then
cross-modality layers of a shared text-vision attention, both self-attentions and both feed-forwards) map onto the
`lxmert` preset with its VOLTA fields (EncoderConfig.pooler_style, whole_image_region, box_dims):
config/ctrl_lxmert.json (whole image first, 5-d locations, poolers multiplied), lxmert.json and original_lxmert.json
(VOLTA's conversion of LXMERT: 4-d boxes, the text's ReLU pooler alone). VisualBERT-style configs (image_embeddings
"visualbert": one stack whose every sublayer is shared by both streams with one LayerNorm, i.e. BERT over text then
regions) map onto the `visualbert` preset with pooler_style and whole_image_region: config/ctrl_visualbert_base.json.
VL-BERT-style configs (image_embeddings "vl-bert": VisualBERT's one shared stack over VL-BERT's embeddings, whose last
region slot is [END] and lends every text token its visual feature) map onto the `vl-bert` preset with
vlbert_embedding "volta", pooler_style and whole_image_region: config/ctrl_vl-bert_base.json. UNITER-style configs
(their own image embeddings) and VL-BERT-style ones laid out otherwise (vl-bert_base.json: the whole image last, no
pooler) are refused naming what they are.

Mapping (VOLTA -> vlserve), sublayer n an attention and n + 1 its feed-forward (cross-modality: n, n + 1, n + 2):
  bert.embeddings.*                     -> encoder.embeddings.* (visualbert: also visual_projection,
                                           visual_token_type_embeddings, visual_position_embeddings from projection,
                                           token_type_embeddings_visual, position_embeddings_visual)
                                           (vl-bert: also visual_fc from obj_downsample.1, object_embedding
                                           from object_linguistic_embeddings, mask_visual_embedding from
                                           object_mask_visual_embedding, end_embedding, visual_ln_{text,object})
  bert.v_embeddings.*                   -> encoder.v_embeddings.* (vilbert); encoder.visn_fc.{visn_fc,
                                           visn_layer_norm, box_fc, box_layer_norm} from image_embeddings, ImgLayerNorm,
                                           image_location_embeddings, LocLayerNorm (lxmert)
  text layer i at sublayer n            -> encoder.layer.i: attention.qkv = [query; key; value], attention.dense
                                           and .LayerNorm = attention_output.{dense,LayerNorm}, ffn.fc1 =
                                           layer.{n+1}.intermediate.dense, ffn.fc2/LayerNorm = layer.{n+1}.output.*
  image layer j                         -> encoder.v_layer.j (vilbert), encoder.r_layers.j (lxmert): the same from
                                           the v_* modules (visualbert, vl-bert: the v_* names are the same
                                           modules, checked equal)
  co-attention k (vilbert)              -> encoder.c_layer.k: text_attention.query = query, .kv = [v_key; v_value],
                                           .dense/.LayerNorm = attention_output.{dense,LayerNorm}; image_attention
                                           .query = v_query, .kv = [key; value], .dense/.LayerNorm = v_dense,
                                           v_LayerNorm; text_ffn / image_ffn from layer.{n+1}
  cross-modality k (lxmert)             -> encoder.x_layers.k: visual_attention from layer.n's query, [key; value],
                                           attention_output (its v_* names are the same modules: checked equal),
                                           lang_self_att / visn_self_att from layer.{n+1}, lang_ffn / visn_ffn from
                                           layer.{n+2}
  bert.{t,v}_pooler.dense               -> encoder.{t,v}_pooler.dense (encoder.pooler.dense: an LXMERT-style tanh one)
Heads of BertForVLPreTraining: cls.predictions -> mlm (decoder tied to the word embeddings); cls.bi_seq_relationship
-> itm, its two rows swapped (VOLTA's label 0 is the matching caption, vlserve's logits are [no match, match]);
cls.imagePredictions (transform + decoder_dict "0", the detector-distribution KL target; or "6"/"3", class targets)
-> mrc (without the transform's LayerNorm, image_head_ln false: classifier "dense_gelu"), and decoder_dict "1"/"5" (feature regression) -> mrfr; cls.qaPredictions -> image_qa.
Heads of BertForVLTasks, by VOLTA's task ids (config_tasks/*.yml) and checked against their shapes:
  VL-classifier (TASK1 VQA, TASK2 GenomeQA, TASK15 GQA) -> vqa (Linear - GELU - LayerNorm - Linear, hidden
      clf_hidden_size); VL-binary-classifier of NLVR2 (TASK12) -> nlvr2 (pair mode: the two images' pooled vectors);
  V-logit (TASK9-11 RefCOCO, RefCOCO+, RefCOCOg) -> refer (one score per region; the whole-image row dropped);
  VL-logit of retrieval (TASK7, TASK8, TASK20) -> rank (an itm-kind head: logits [0, score], whose difference is
      VOLTA's retrieval score).
Task heads with no vlserve endpoint (visual entailment, VCR, GuessWhat, ...), a second head of a kind, and the
pretraining targets vlserve has no head for (attributes "4", NCE "2") are listed in the manifest's
`import.ignored_keys`; any other tensor is an error.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..config import HeadConfig, ModelConfig
from .hf_common import (
    HFImportError,
    HFSource,
    bert_fields,
    build_encoder_config,
    load_weight_file,
    name_answers,
    read_config,
    stated_layer_norm_eps,
    write_checkpoint,
)
from .keymap import KeyMap, bert_embeddings, fused, linear

FORMAT = "volta"
# VOLTA's task ids (config_tasks/*.yml) whose heads vlserve serves -> the head kind
TASK_KINDS = {
    "TASK1": "vqa", "TASK2": "vqa", "TASK15": "vqa",  # VQA, GenomeQA, GQA (VL-classifier)
    "TASK12": "nlvr2",  # NLVR2 (VL-binary-classifier)
    "TASK9": "refer", "TASK10": "refer", "TASK11": "refer",  # RefCOCO, RefCOCO+, RefCOCOg (V-logit)
    "TASK7": "rank", "TASK8": "rank", "TASK20": "rank",  # COCO, Flickr30k, WIT retrieval (VL-logit)
}
OTHER_FORMATS = {  # a key of a checkpoint this importer does not read -> the command that does
    "bert.encoder.c_layer.0.biattention.query1.weight": "a vilbert-multi-task checkpoint: import it with `vlserve import vilbert`",
    "lxrt_encoder.model.bert.embeddings.word_embeddings.weight": "an airsplay/lxmert checkpoint: import it with `vlserve import lxmert`",
    "module.bert.encoder.x_layers.0.visual_attention.att.query.weight": "an airsplay/lxmert checkpoint: import it with `vlserve import lxmert`",
}
FOREIGN_PREFIXES = {
    "lxmert.": "transformers' LXMERT weights: import their directory with `vlserve import hf-lxmert`",
    "visual_bert.": "transformers' VisualBERT weights: import their directory with `vlserve import hf-visualbert`",
}
CLASS_TARGETS = {"0": "kl", "6": "ce", "3": "ce"}  # decoder_dict targets read as region classes (volta/losses.py)
FEATURE_TARGETS = ("1", "5")  # regression of the region feature (mse, huber)


@dataclass
class Layout:
    """Where each vlserve layer sits among VOLTA's sublayers (attention sublayer numbers, feed-forward at n + 1)."""

    text: list[int] = field(default_factory=list)
    image: list[int] = field(default_factory=list)
    co: list[int] = field(default_factory=list)
    text_before_co: list[int] = field(default_factory=list)  # text layers run before each co-attention layer
    image_before_co: list[int] = field(default_factory=list)  # image layers run before each co-attention layer


def read_volta(src: str | Path, config: str | Path | None) -> HFSource:
    """The tensors of a VOLTA .bin file and the config json it was built from."""
    path = Path(src)
    if path.is_dir():
        raise HFImportError(f"{path}: a directory; give the weights file (pytorch_model_best.bin, pytorch_model_9.bin)")
    if not path.is_file():
        raise HFImportError(f"{path}: no such file")
    source = HFSource(path=path.parent, config={}, state=load_weight_file(path), weights_file=path.name)
    check_format(source)  # another format's file says so before any config is looked for
    if config is None:
        beside = [p for p in sorted(path.parent.glob("*.json")) if _is_volta_config(p)]
        if len(beside) != 1:
            raise HFImportError(
                f"{path}: give the VOLTA config it was trained with (--config config/ctrl_vilbert_base.json); "
                f"{'none' if not beside else len(beside)} found beside it"
            )
        config = beside[0]
    cfg_path = Path(config).resolve()
    if not cfg_path.is_file():
        raise HFImportError(f"{cfg_path}: no such file")
    source.config, source.config_file = read_config(cfg_path), str(cfg_path)
    return source


def _is_volta_config(path: Path) -> bool:
    """A JSON object with VOLTA's sublayer lists (its config/*.json); anything else beside the weights is not one."""
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        return False
    return isinstance(config, dict) and "tt_attn_sublayers" in config


def check_format(source: HFSource) -> None:
    """A VOLTA model's tensors; another format's checkpoint fails saying which it is."""
    for key, what in OTHER_FORMATS.items():
        if source.has(key):
            raise HFImportError(f"{source.weights_path}: {what}")
    first = next(iter(source.state), "")
    for prefix, what in FOREIGN_PREFIXES.items():
        if first.startswith(prefix):
            raise HFImportError(f"{source.weights_path}: {what}")
    if not (source.has("bert.embeddings.word_embeddings.weight")
            and any(k.startswith("bert.encoder.layer.0.attention_self.") for k in source.state)):
        raise HFImportError(
            f"{source.weights_path}: not a VOLTA checkpoint (no bert.embeddings.word_embeddings.weight and "
            f"bert.encoder.layer.0.attention_self.*; first tensor: {first or 'none'})"
        )


def _ints(source: HFSource, name: str) -> set[int]:
    value = source.get(name, list, default=[])
    if not all(isinstance(v, int) for v in value):
        raise HFImportError(f"{source.config_path}: field {name!r} is {value!r}, expected a list of sublayer numbers")
    return set(value)


def _overrides(source: HFSource, name: str) -> dict[int, int]:
    value = source.get(name, dict, default={})
    try:
        return {int(k): v for k, v in value.items()}
    except ValueError:
        raise HFImportError(f"{source.config_path}: field {name!r} is {value!r}, expected layer numbers as its "
                            "keys") from None


def style(source: HFSource) -> str:
    """"vilbert", "lxmert", "visualbert" or "vl-bert" (the styles vlserve imports); any other config fails naming what
    it is."""
    where = source.config_path
    embeddings = source.get("image_embeddings", str, default="vilbert")
    if source.get("model", str, default="bert") != "bert" or "roberta" in source.get("bert_model", str, default="bert"):
        raise HFImportError(f"{where}: a RoBERTa text encoder; vlserve's presets embed text as BERT does")
    if embeddings not in ("vilbert", "lxmert", "visualbert", "vl-bert"):
        name = {"uniter": "UNITER-style"}.get(embeddings, "other")
        raise HFImportError(
            f"{where}: image_embeddings {embeddings!r} ({name}): vlserve imports VOLTA's ViLBERT-, LXMERT-, "
            "VisualBERT- and VL-BERT-style configs (ctrl_vilbert_base, vilbert_base, ctrl_lxmert, lxmert, "
            "original_lxmert, ctrl_visualbert_base, ctrl_vl-bert_base); its UNITER embeddings (layer-normalised "
            "7-d locations summed with the features, segments) are no vlserve preset's"
        )
    fusion = source.get("fusion_method", str, default="mul")
    if embeddings == "vl-bert":
        vlbert_checks(source, fusion)
    checks = [
        (fusion == "mul" or (embeddings != "vilbert" and fusion == "text"),
         f"fusion_method {fusion!r}: vlserve pools a ViLBERT-style model as the product of its two poolers, an "
         "LXMERT- or VisualBERT-style one so or from the text's pooler alone ('text')"),
        (embeddings != "vilbert" or source.get("fusion_act", str, default="relu") == "relu",
         f"fusion_act {source.config.get('fusion_act')!r}: vlserve's vilbert poolers use ReLU"),
        (source.get("hidden_act", str, default="gelu") == "gelu" and source.get("v_hidden_act", str, default="gelu") == "gelu",
         "an activation other than GELU"),
        (fusion != "mul" or source.get("pooler_size", int, default=768) == source.get("v_pooler_size", int, default=1024),
         "pooler_size differs from v_pooler_size"),
        (not _overrides(source, "sublayer2intermediate_size") and not _overrides(source, "sublayer2v_intermediate_size"),
         "per-sublayer feed-forward widths"),
    ]
    if embeddings not in ("visualbert", "vl-bert"):
        checks.append((not _ints(source, "single_ln_sublayers"), "single-LayerNorm sublayers in a two-stream model"))
    if embeddings == "vilbert":
        checks += [
            (not _ints(source, "shared_sublayers"), "sublayers shared between the streams in a ViLBERT-style model"),
            (source.get("add_global_imgfeat", str, default="") == "first",
             f"add_global_imgfeat {source.config.get('add_global_imgfeat')!r}: vlserve's vilbert puts the whole image first"),
            (source.get("num_locs", int, default=5) == 5,
             f"num_locs {source.config.get('num_locs')}: vlserve's vilbert reads 5-d locations"),
        ]
    else:
        glob = source.config.get("add_global_imgfeat")
        checks += [
            (glob in (None, "first"), f"add_global_imgfeat {glob!r}: vlserve puts the whole image first or nowhere"),
            (fusion != "mul" or glob == "first", "fusion_method 'mul' without a whole-image region to pool"),
            (embeddings != "lxmert" or source.get("num_locs", int, default=5) in (4, 5),
             f"num_locs {source.config.get('num_locs')}: vlserve's lxmert reads 4- or 5-d locations"),
        ]
    for ok, what in checks:
        if not ok:
            raise HFImportError(f"{where}: {what}")
    return embeddings


def vlbert_checks(source: HFSource, fusion: str) -> None:
    """What vlserve's `vl-bert` preset with VOLTA's embeddings reads: the whole image first and pooled, one width."""
    where, glob = source.config_path, source.config.get("add_global_imgfeat")
    if glob != "first" or fusion not in ("mul", "text"):
        raise HFImportError(
            f"{where}: a VL-BERT-style config with add_global_imgfeat {glob!r} and fusion_method {fusion!r} (as "
            "vl-bert_base.json: the whole image last, no pooler, VQA read at the [MASK] slot); vlserve imports "
            "VOLTA's VL-BERT-style configs with the whole image first and a pooler (ctrl_vl-bert_base); the original "
            "VL-BERT itself imports from its authors' release with `vlserve import vl-bert`"
        )
    if source.get("v_hidden_size", int, default=768) != source.get("hidden_size", int, default=768):
        raise HFImportError(f"{where}: v_hidden_size differs from hidden_size (VOLTA's visual_1x1 projections); "
                            "vlserve's vl-bert has one width")
    if source.get("visual_target_weights", dict, default={}).get("6", 0) > 0:
        raise HFImportError(f"{where}: visual target 6 (masked-region classes, with VL-BERT's object_mask_word_embedding "
                            "on masked regions); vlserve's vl-bert imports VOLTA's with targets 0, 1, 3 or 5")


def vlbert_fields(source: HFSource, lay: Layout) -> dict:
    """EncoderConfig fields of a VL-BERT-style config: VisualBERT-style ones, VOLTA's embeddings, 8 x
    v_coordinate_embeddings_dim sin/cos values of box geometry (VOLTA's coordinate_embeddings)."""
    return visualbert_fields(source, lay) | dict(
        vlbert_embedding="volta", pooler=False, geometry_dim=8 * source.get("v_coordinate_embeddings_dim", int, default=256),
    )


def vlbert_keymap(lay: Layout, pooler: str, source: HFSource) -> KeyMap:
    keymap: KeyMap = {**bert_embeddings("encoder.embeddings", "bert.embeddings")}
    keymap |= linear("encoder.embeddings.visual_fc", "bert.embeddings.obj_downsample.1")
    keymap |= linear("encoder.embeddings.visual_ln_text", "bert.embeddings.visual_ln_text")
    keymap |= linear("encoder.embeddings.visual_ln_object", "bert.embeddings.visual_ln_object")
    for ours, theirs in (("object_embedding", "object_linguistic_embeddings"), ("end_embedding", "end_embedding"),
                         ("mask_visual_embedding", "object_mask_visual_embedding")):
        keymap[f"encoder.embeddings.{ours}.weight"] = [f"bert.embeddings.{theirs}.weight"]
    return keymap | shared_stack_keymap(lay, pooler, source)


def layout(source: HFSource) -> Layout:
    """Text, image and co-attention layers from the sublayer lists; a pattern that is not a ViLBERT fails naming it."""
    where = source.config_path
    tt, tv, vt, vv = (_ints(source, f"{k}_attn_sublayers") for k in ("tt", "tv", "vt", "vv"))
    t_ff, v_ff = _ints(source, "t_ff_sublayers"), _ints(source, "v_ff_sublayers")
    out = Layout()
    for n in sorted(tt | tv | vt | vv):
        if (n + 1 in t_ff) != (n in tt | tv) or (n + 1 in v_ff) != (n in vv | vt):
            raise HFImportError(f"{where}: attention sublayer {n} is not followed by the feed-forward of its streams")
        if n in tv or n in vt:
            if not (n in tv and n in vt) or n in tt or n in vv:
                raise HFImportError(
                    f"{where}: sublayer {n} mixes attentions ({', '.join(k for k, s in zip(('tt', 'tv', 'vt', 'vv'), (tt, tv, vt, vv)) if n in s)}); "
                    "vlserve's vilbert has co-attention layers (tv and vt alone) and single-stream layers only"
                )
            out.co.append(n)
            out.text_before_co.append(len(out.text))
            out.image_before_co.append(len(out.image))
            continue
        if n in tt:
            out.text.append(n)
        if n in vv:
            out.image.append(n)
    expected = sorted(tt | tv | vt | vv | t_ff | v_ff)
    if expected != list(range(len(expected))) or (t_ff | v_ff) & (tt | tv | vt | vv):
        raise HFImportError(f"{where}: sublayer numbers are not contiguous attention / feed-forward pairs")
    return out


def shared_fields(source: HFSource) -> dict:
    """The EncoderConfig fields every VOLTA config states the same way (vocabulary, positions, norms, dropout, region
    feature width), with BERT's and VOLTA's defaults."""
    return dict(
        vocab_size=source.get("vocab_size"),
        max_position_embeddings=source.get("max_position_embeddings", default=512),
        type_vocab_size=source.get("type_vocab_size", default=2),
        layer_norm_eps=stated_layer_norm_eps(source),
        dropout=source.get("hidden_dropout_prob", float, default=0.1),
        attention_dropout=source.get("attention_probs_dropout_prob", float, default=0.1),
        visual_feat_dim=source.get("v_feature_size", default=2048),
    )


def encoder_fields(source: HFSource, lay: Layout) -> dict:
    """EncoderConfig fields of the config (the tensors' shapes are checked against them when the model is built)."""
    where = source.config_path
    # EncoderConfig reads a 0 image width, head count or pooler width as another stream's
    hidden, v_hidden = source.get("hidden_size"), source.get("v_hidden_size", default=768, least=1)
    heads, v_heads = source.get("num_attention_heads"), source.get("v_num_attention_heads", default=12, least=1)
    widths, t_heads = _overrides(source, "sublayer2attn_hidden_size"), _overrides(source, "sublayer2num_attention_heads")
    v_widths, vt_heads = _overrides(source, "sublayer2v_attn_hidden_size"), _overrides(source, "sublayer2v_num_attention_heads")
    if set(widths) - set(lay.co) or set(t_heads) - set(lay.co) or set(v_widths) - set(lay.co) or set(vt_heads) - set(lay.co):
        raise HFImportError(f"{where}: per-sublayer attention sizes outside the co-attention layers")
    co = {(widths.get(n, hidden), t_heads.get(n, heads), v_widths.get(n, v_hidden), vt_heads.get(n, v_heads)) for n in lay.co}
    if len(co) > 1:
        raise HFImportError(f"{where}: co-attention layers of different widths or heads")
    co_width, co_heads, co_v_width, co_v_heads = co.pop() if co else (v_hidden, v_heads, v_hidden, v_heads)
    if (co_width, co_heads) != (co_v_width, co_v_heads) or co_v_width != v_hidden:
        raise HFImportError(f"{where}: co-attention width {co_width} / {co_v_width} with {co_heads} / {co_v_heads} "
                            f"heads; VOLTA itself needs both equal and the image stream's width {v_hidden}")
    return shared_fields(source) | dict(
        hidden_size=hidden,
        num_heads=heads,
        intermediate_size=source.get("intermediate_size"),
        image_hidden_size=v_hidden,
        image_num_heads=v_heads,
        image_intermediate_size=source.get("v_intermediate_size", default=3072, least=1),
        num_layers=len(lay.text),
        num_image_layers=len(lay.image),
        num_cross_layers=len(lay.co),
        coattention_text_layers=tuple(lay.text_before_co),
        # ViLBERT's own order (one image layer after each co-attention layer but the last) is the preset's default
        coattention_image_layers=() if lay.image_before_co == list(range(len(lay.co))) else tuple(lay.image_before_co),
        coattention_hidden_size=co_width,
        coattention_num_heads=co_heads,
        pooler_size=source.get("pooler_size", default=768, least=1),
        img_from_regions=True,  # [IMG] = the mean of the regions' features, as VOLTA's feature readers make it
    )


def _sub(n: int) -> str:
    return f"bert.encoder.layer.{n}"


def _stream_layer(dst: str, n: int, v: str) -> KeyMap:
    """A self-attention + feed-forward layer of one stream (`v` = "" text, "v_" image) at sublayers n, n + 1."""
    a, f = _sub(n), _sub(n + 1)
    return {
        **fused(f"{dst}.attention.qkv", [f"{a}.attention_self.{v}{p}" for p in ("query", "key", "value")]),
        **linear(f"{dst}.attention.dense", f"{a}.attention_output.{v}dense"),
        **linear(f"{dst}.attention.LayerNorm", f"{a}.attention_output.{v}LayerNorm"),
        **_ffn(f"{dst}.ffn", f, v),
    }


def _ffn(dst: str, f: str, v: str) -> KeyMap:
    return {
        **linear(f"{dst}.fc1", f"{f}.intermediate.{v}dense"),
        **linear(f"{dst}.fc2", f"{f}.output.{v}dense"),
        **linear(f"{dst}.LayerNorm", f"{f}.output.{v}LayerNorm"),
    }


def _co_layer(dst: str, n: int) -> KeyMap:
    a, f = _sub(n), _sub(n + 1)
    return {
        **linear(f"{dst}.text_attention.query", f"{a}.attention_self.query"),
        **fused(f"{dst}.text_attention.kv", [f"{a}.attention_self.v_key", f"{a}.attention_self.v_value"]),
        **linear(f"{dst}.text_attention.dense", f"{a}.attention_output.dense"),
        **linear(f"{dst}.text_attention.LayerNorm", f"{a}.attention_output.LayerNorm"),
        **linear(f"{dst}.image_attention.query", f"{a}.attention_self.v_query"),
        **fused(f"{dst}.image_attention.kv", [f"{a}.attention_self.key", f"{a}.attention_self.value"]),
        **linear(f"{dst}.image_attention.dense", f"{a}.attention_output.v_dense"),
        **linear(f"{dst}.image_attention.LayerNorm", f"{a}.attention_output.v_LayerNorm"),
        **_ffn(f"{dst}.text_ffn", f, ""),
        **_ffn(f"{dst}.image_ffn", f, "v_"),
    }


def encoder_keymap(lay: Layout) -> KeyMap:
    keymap: KeyMap = {**bert_embeddings("encoder.embeddings", "bert.embeddings")}
    keymap |= linear("encoder.v_embeddings.image_embeddings", "bert.v_embeddings.image_embeddings")
    keymap |= linear("encoder.v_embeddings.image_location_embeddings", "bert.v_embeddings.image_location_embeddings")
    keymap |= linear("encoder.v_embeddings.LayerNorm", "bert.v_embeddings.LayerNorm")
    for i, n in enumerate(lay.text):
        keymap |= _stream_layer(f"encoder.layer.{i}", n, "")
    for j, n in enumerate(lay.image):
        keymap |= _stream_layer(f"encoder.v_layer.{j}", n, "v_")
    for k, n in enumerate(lay.co):
        keymap |= _co_layer(f"encoder.c_layer.{k}", n)
    keymap |= linear("encoder.t_pooler.dense", "bert.t_pooler.dense")
    keymap |= linear("encoder.v_pooler.dense", "bert.v_pooler.dense")
    return keymap


def _mlp(source: HFSource, name: str, src: str) -> tuple[int, KeyMap]:
    """VOLTA's SimpleClassifier / LxmertAnswerHead (logit_fc.{0,2,3}) -> our mlp classifier; its hidden width."""
    keymap = {**linear(f"heads.{name}.cls.0", f"{src}.0"), **linear(f"heads.{name}.cls.2", f"{src}.2"),
              **linear(f"heads.{name}.cls.3", f"{src}.3")}
    return source.rows(f"{src}.0.weight"), keymap


def task_heads(source: HFSource, pooled: int, image_width: int) -> tuple[dict[str, HeadConfig], KeyMap, list[str], set[str]]:
    """BertForVLTasks' clfs_dict heads: ours, their key map, the rank heads to widen, the task keys left unused."""
    tasks = sorted({k.split(".")[1] for k in source.state if k.startswith("clfs_dict.")},
                   key=lambda t: int(t[4:]) if t[4:].isdigit() else 1 << 30)
    heads: dict[str, HeadConfig] = {}
    keymap: KeyMap = {}
    ranks: list[str] = []
    for task in tasks:
        kind = TASK_KINDS.get(task)
        p = f"clfs_dict.{task}"
        if kind is None or kind in heads:
            continue  # no endpoint, or a second head of a served kind: left unused, listed in the manifest
        if kind in ("vqa", "nlvr2"):
            if not source.has(f"{p}.logit_fc.0.weight"):
                raise HFImportError(f"{source.weights_path}: {p} is not the classifier VOLTA builds for {task}")
            reads = source.shape(f"{p}.logit_fc.0.weight")[1]
            if reads != pooled * (2 if kind == "nlvr2" else 1):
                raise HFImportError(f"{source.weights_path}: {p}.logit_fc.0 reads {reads} values, not the "
                                    f"{'two ' if kind == 'nlvr2' else ''}pooled {pooled} of {task}'s head")
            hidden, head_keys = _mlp(source, kind, f"{p}.logit_fc")
            labels = source.rows(f"{p}.logit_fc.3.weight")
            heads[kind] = HeadConfig(kind=kind, num_labels=labels if kind == "vqa" else 0, classifier_hidden=hidden)
            keymap |= head_keys
        else:
            if not source.has(f"{p}.weight"):
                raise HFImportError(f"{source.weights_path}: {p} is not the one linear layer vlserve reads for {task} "
                                    "(a two-layer V-logit head has no vlserve counterpart)")
            reads = tuple(source.state[f"{p}.weight"].shape)
            want = (1, image_width if kind == "refer" else pooled)
            if reads != want:
                raise HFImportError(f"{source.weights_path}: tensor {p}.weight has shape {reads}, {task} needs {want}")
            if kind == "refer":
                heads["refer"] = HeadConfig(kind="refer")
                keymap |= linear("heads.refer.score", p)
            else:
                heads["rank"] = HeadConfig(kind="itm")
                # two rows from the one: check_shapes sees half of (2, P) per source; the first row is zeroed below
                keymap |= {"heads.rank.seq_relationship.weight": [f"{p}.weight"] * 2,
                           "heads.rank.seq_relationship.bias": [f"{p}.bias"] * 2}
                ranks.append("heads.rank.seq_relationship")
    mapped = {s for srcs in keymap.values() for s in srcs}
    unused = {k for k in source.state if k.startswith("clfs_dict.") and k not in mapped}
    return heads, keymap, ranks, unused


def pretraining_heads(source: HFSource, visual_feat_dim: int) -> tuple[dict[str, HeadConfig], KeyMap, set[str]]:
    """BertForVLPreTraining's cls heads, and the cls keys vlserve has no head for."""
    heads: dict[str, HeadConfig] = {}
    keymap: KeyMap = {}
    if source.has("cls.predictions.transform.dense.weight"):
        heads["mlm"] = HeadConfig(kind="mlm")
        keymap |= linear("heads.mlm.transform.dense", "cls.predictions.transform.dense")
        keymap |= linear("heads.mlm.transform.LayerNorm", "cls.predictions.transform.LayerNorm")
        keymap["heads.mlm.bias"] = ["cls.predictions.bias"]
        source.tied("cls.predictions.decoder.weight", "bert.embeddings.word_embeddings.weight")
    if source.has("cls.bi_seq_relationship.weight"):
        if source.rows("cls.bi_seq_relationship.weight") != 2:
            raise HFImportError(f"{source.weights_path}: cls.bi_seq_relationship has "
                                f"{source.rows('cls.bi_seq_relationship.weight')} outputs, not ITM's 2")
        heads["itm"] = HeadConfig(kind="itm")
        keymap |= linear("heads.itm.seq_relationship", "cls.bi_seq_relationship")
    img = "cls.imagePredictions"
    norm = source.has(f"{img}.transform.LayerNorm.weight")  # image_head_ln; without it the class head is dense - GELU
    if source.has(f"{img}.transform.dense.weight"):
        for target, loss in CLASS_TARGETS.items():
            if source.has(f"{img}.decoder_dict.{target}.weight"):
                heads["mrc"] = HeadConfig(kind="mrc", num_labels=source.rows(f"{img}.decoder_dict.{target}.weight"),
                                          mrc_loss=loss, classifier="mlp" if norm else "dense_gelu")
                keymap |= linear("heads.mrc.transform.dense", f"{img}.transform.dense")
                keymap |= linear("heads.mrc.transform.LayerNorm", f"{img}.transform.LayerNorm") if norm else {}
                keymap |= linear("heads.mrc.decoder", f"{img}.decoder_dict.{target}")
                break
    if norm:  # vlserve's feature-regression head has the LayerNorm
        for target in FEATURE_TARGETS:
            if source.has(f"{img}.decoder_dict.{target}.weight") and source.rows(f"{img}.decoder_dict.{target}.weight") == visual_feat_dim:
                heads["mrfr"] = HeadConfig(kind="mrfr")
                keymap |= linear("heads.mrfr.transform.dense", f"{img}.transform.dense")
                keymap |= linear("heads.mrfr.transform.LayerNorm", f"{img}.transform.LayerNorm")
                keymap |= linear("heads.mrfr.decoder", f"{img}.decoder_dict.{target}")
                break
    if source.has("cls.qaPredictions.logit_fc.3.weight"):
        hidden, qa_keys = _mlp(source, "image_qa", "cls.qaPredictions.logit_fc")
        heads["image_qa"] = HeadConfig(kind="image_qa", num_labels=source.rows("cls.qaPredictions.logit_fc.3.weight"),
                                       classifier_hidden=hidden)
        keymap |= qa_keys
    mapped = {s for srcs in keymap.values() for s in srcs} | {"cls.predictions.decoder.weight"}
    unused = {k for k in source.state if k.startswith("cls.") and k not in mapped}
    return heads, keymap, unused


def lxmert_layout(source: HFSource) -> Layout:
    """LXMERT's sublayers: language (`text`) and object-relationship (`image`) layers side by side, then cross-modality
    layers (`co`) of three sublayers each: the shared text-vision attention, both self-attentions, both feed-forwards."""
    where = source.config_path
    tt, tv, vt, vv = (_ints(source, f"{k}_attn_sublayers") for k in ("tt", "tv", "vt", "vv"))
    t_ff, v_ff, shared = _ints(source, "t_ff_sublayers"), _ints(source, "v_ff_sublayers"), _ints(source, "shared_sublayers")
    attention, ffn = tt | tv | vt | vv, t_ff | v_ff
    if sorted(attention | ffn) != list(range(len(attention | ffn))) or attention & ffn:
        raise HFImportError(f"{where}: sublayer numbers are not contiguous attention and feed-forward sublayers")
    out, n, depth = Layout(), 0, len(attention | ffn)
    while n < depth:
        if n in tv or n in vt:
            cross = n in tv and n in vt and n in shared and n not in tt | vv
            self_att = n + 1 in tt and n + 1 in vv and n + 1 not in tv | vt | shared
            if not (cross and self_att and n + 2 in t_ff and n + 2 in v_ff):
                raise HFImportError(
                    f"{where}: sublayers {n}-{n + 2} are not an LXMERT cross-modality layer (shared tv+vt attention, "
                    "tt+vv self-attention, both feed-forwards)"
                )
            out.co.append(n)
            n += 3
            continue
        if out.co or n in shared or (n + 1 in t_ff) != (n in tt) or (n + 1 in v_ff) != (n in vv):
            raise HFImportError(f"{where}: sublayer {n} is neither a language / object-relationship layer before the "
                                "cross-modality layers nor part of one")
        if n in tt:
            out.text.append(n)
        if n in vv:
            out.image.append(n)
        n += 2
    return out


def lxmert_fields(source: HFSource, lay: Layout) -> dict:
    """EncoderConfig fields of an LXMERT-style config: one width, head count and feed-forward width for both streams."""
    where = source.config_path
    sizes = {k: (source.get(k, default=768 if "hidden" in k else 3072 if "inter" in k else 12),
                 source.get(f"v_{k}", default=768 if "hidden" in k else 3072 if "inter" in k else 12))
             for k in ("hidden_size", "num_attention_heads", "intermediate_size")}
    for k, (t, v) in sizes.items():
        if t != v:
            raise HFImportError(f"{where}: {k} {t} but v_{k} {v}; vlserve's lxmert has one size for both streams")
    if any(_overrides(source, f"sublayer2{k}") for k in ("attn_hidden_size", "num_attention_heads",
                                                         "v_attn_hidden_size", "v_num_attention_heads")):
        raise HFImportError(f"{where}: per-sublayer attention sizes; vlserve's lxmert has one size for all layers")
    return pooling_fields(source, sizes["hidden_size"][0]) | shared_fields(source) | dict(
        hidden_size=sizes["hidden_size"][0],
        num_heads=sizes["num_attention_heads"][0],
        intermediate_size=sizes["intermediate_size"][0],
        num_layers=len(lay.text),
        num_image_layers=len(lay.image),
        num_cross_layers=len(lay.co),
        box_dims=source.get("num_locs", default=5),
    )


def pooling_fields(source: HFSource, hidden: int) -> dict:
    """pooler_style, whole_image_region and pooler_size of an LXMERT- or VisualBERT-style config."""
    fusion = source.get("fusion_method", str, default="mul")
    tanh = fusion == "text" and source.get("fusion_act", str, default="relu") == "tanh"
    if tanh and source.get("pooler_size", default=768) != hidden:
        raise HFImportError(f"{source.config_path}: a tanh pooler {source.get('pooler_size')} wide; vlserve's is as "
                            "wide as the text")
    return dict(
        pooler_style="tanh" if tanh else "relu_mul" if fusion == "mul" else "relu",
        whole_image_region=source.config.get("add_global_imgfeat") == "first",
        pooler_size=0 if tanh else source.get("pooler_size", default=768, least=1),  # 0 would read as hidden_size
    )


def lxmert_keymap(lay: Layout, pooler: str, source: HFSource) -> KeyMap:
    keymap: KeyMap = {**bert_embeddings("encoder.embeddings", "bert.embeddings")}
    for ours, theirs in (("visn_fc", "image_embeddings"), ("visn_layer_norm", "ImgLayerNorm"),
                         ("box_fc", "image_location_embeddings"), ("box_layer_norm", "LocLayerNorm")):
        keymap |= linear(f"encoder.visn_fc.{ours}", f"bert.v_embeddings.{theirs}")
    for i, n in enumerate(lay.text):
        keymap |= _stream_layer(f"encoder.layer.{i}", n, "")
    for j, n in enumerate(lay.image):
        keymap |= _stream_layer(f"encoder.r_layers.{j}", n, "v_")
    for k, n in enumerate(lay.co):
        a, x = _sub(n), f"encoder.x_layers.{k}"
        keymap |= linear(f"{x}.visual_attention.query", f"{a}.attention_self.query")
        keymap |= fused(f"{x}.visual_attention.kv", [f"{a}.attention_self.key", f"{a}.attention_self.value"])
        keymap |= linear(f"{x}.visual_attention.dense", f"{a}.attention_output.dense")
        keymap |= linear(f"{x}.visual_attention.LayerNorm", f"{a}.attention_output.LayerNorm")
        _tied_copies(source, [f"{a}.attention_self.{{}}{q}" for q in ("query", "key", "value")]
                     + [f"{a}.attention_output.{{}}{m}" for m in ("dense", "LayerNorm")])
        for side, v in (("lang", ""), ("visn", "v_")):
            s_att = f"{_sub(n + 1)}.attention_self.{v}"
            keymap |= fused(f"{x}.{side}_self_att.qkv", [f"{s_att}{q}" for q in ("query", "key", "value")])
            keymap |= linear(f"{x}.{side}_self_att.dense", f"{_sub(n + 1)}.attention_output.{v}dense")
            keymap |= linear(f"{x}.{side}_self_att.LayerNorm", f"{_sub(n + 1)}.attention_output.{v}LayerNorm")
            keymap |= _ffn(f"{x}.{side}_ffn", _sub(n + 2), v)
    return keymap | _pooler_keys(pooler)


def visualbert_layout(source: HFSource) -> Layout:
    """One stack over text and regions: every attention sublayer has all four attentions, shared, with one LayerNorm,
    followed by a shared feed-forward (as config/ctrl_visualbert_base.json, ctrl_vl-bert_base.json); `text` lists
    them."""
    where = source.config_path
    name = "VL-BERT" if source.get("image_embeddings", str, default="") == "vl-bert" else "VisualBERT"
    tt, tv, vt, vv = (_ints(source, f"{k}_attn_sublayers") for k in ("tt", "tv", "vt", "vv"))
    t_ff, v_ff = _ints(source, "t_ff_sublayers"), _ints(source, "v_ff_sublayers")
    shared, single = _ints(source, "shared_sublayers"), _ints(source, "single_ln_sublayers")
    depth = len(tt | tv | vt | vv | t_ff | v_ff)
    attention, ffn = set(range(0, depth, 2)), set(range(1, depth, 2))
    if not (tt == tv == vt == vv == attention and t_ff == v_ff == ffn and shared == single == attention | ffn):
        raise HFImportError(f"{where}: a {name}-style config whose sublayers are not one shared stack (all four "
                            "attentions, then the feed-forward, every sublayer shared with one LayerNorm)")
    return Layout(text=sorted(attention))


def visualbert_fields(source: HFSource, lay: Layout) -> dict:
    where = source.config_path
    for k in ("hidden_size", "num_attention_heads", "intermediate_size"):
        if source.get(k) != source.get(f"v_{k}", default=source.get(k)):
            raise HFImportError(f"{where}: {k} differs from v_{k}; one stack has one size")
    # style() has refused activations other than GELU, the one thing bert_fields checks
    return pooling_fields(source, source.get("hidden_size")) | bert_fields(source) | dict(
        visual_feat_dim=source.get("v_feature_size", default=2048),
        num_layers=len(lay.text),
    )


def visualbert_keymap(lay: Layout, pooler: str, source: HFSource) -> KeyMap:
    keymap: KeyMap = {**bert_embeddings("encoder.embeddings", "bert.embeddings")}
    keymap |= linear("encoder.embeddings.visual_projection", "bert.embeddings.projection")
    for ours, theirs in (("visual_token_type_embeddings", "token_type_embeddings_visual"),
                         ("visual_position_embeddings", "position_embeddings_visual")):
        keymap[f"encoder.embeddings.{ours}.weight"] = [f"bert.embeddings.{theirs}.weight"]
    return keymap | shared_stack_keymap(lay, pooler, source)


def shared_stack_keymap(lay: Layout, pooler: str, source: HFSource) -> KeyMap:
    """The layers of one shared stack (VisualBERT- and VL-BERT-style) and the poolers."""
    keymap: KeyMap = {}
    for i, n in enumerate(lay.text):
        keymap |= _stream_layer(f"encoder.layer.{i}", n, "")
        _tied_copies(source, [f"{_sub(n)}.attention_self.{{}}{q}" for q in ("query", "key", "value")]
                     + [f"{_sub(n)}.attention_output.{{}}{m}" for m in ("dense", "LayerNorm")]
                     + [f"{_sub(n + 1)}.intermediate.{{}}dense"]
                     + [f"{_sub(n + 1)}.output.{{}}{m}" for m in ("dense", "LayerNorm")])
    return keymap | _pooler_keys(pooler)


def _tied_copies(source: HFSource, modules: list[str]) -> None:
    """VOLTA's shared sublayers register each module under its vision name too (`{}` -> "v_"): copies, checked."""
    for module in modules:
        for part in ("weight", "bias"):
            source.tied(f"{module.format('v_')}.{part}", f"{module.format('')}.{part}")


def _pooler_keys(pooler: str) -> KeyMap:
    if pooler == "tanh":
        return linear("encoder.pooler.dense", "bert.t_pooler.dense")
    keymap = linear("encoder.t_pooler.dense", "bert.t_pooler.dense")
    return keymap | (linear("encoder.v_pooler.dense", "bert.v_pooler.dense") if pooler == "relu_mul" else {})


def convert(source: HFSource, answers: Path | None = None) -> tuple[ModelConfig, dict, dict, str]:
    """Our config, tensors and labels from a VOLTA checkpoint, and the reference model it was saved from."""
    check_format(source)
    kind = style(source)
    if kind == "vilbert":
        lay = layout(source)
        encoder = build_encoder_config(source, "vilbert", encoder_fields(source, lay))
        keymap = encoder_keymap(lay)
    elif kind == "lxmert":
        lay = lxmert_layout(source)
        encoder = build_encoder_config(source, "lxmert", lxmert_fields(source, lay))
        keymap = lxmert_keymap(lay, encoder.pooler_style, source)
    elif kind == "vl-bert":
        lay = visualbert_layout(source)
        encoder = build_encoder_config(source, "vl-bert", vlbert_fields(source, lay))
        keymap = vlbert_keymap(lay, encoder.pooler_style, source)
    else:
        lay = visualbert_layout(source)
        encoder = build_encoder_config(source, "visualbert", visualbert_fields(source, lay))
        keymap = visualbert_keymap(lay, encoder.pooler_style, source)
    if any(k.startswith("clfs_dict.") for k in source.state):
        heads, head_keys, ranks, unused = task_heads(source, encoder.pooled_size, encoder.image_width)
        model = "BertForVLTasks"
    else:
        (heads, head_keys, unused), ranks = pretraining_heads(source, encoder.visual_feat_dim), []
        model = "BertForVLPreTraining" if heads else "BertModel"
    keymap |= head_keys
    labels: dict = {"heads": {}}
    name_answers(source, heads, labels, answers)
    weights = source.take(keymap)
    for name in ranks:  # [0, score]: the match-minus-no-match difference /retrieve ranks by is VOLTA's score
        weights[f"{name}.weight"] = torch.cat([torch.zeros_like(weights[f"{name}.weight"][:1]), weights[f"{name}.weight"][1:]])
        weights[f"{name}.bias"] = torch.cat([torch.zeros_like(weights[f"{name}.bias"][:1]), weights[f"{name}.bias"][1:]])
    if "itm" in heads:  # VOLTA's label 0 is the matching caption; our logits are [no match, match]
        for part in ("weight", "bias"):
            weights[f"heads.itm.seq_relationship.{part}"] = weights[f"heads.itm.seq_relationship.{part}"].flip(0)
    extra = [key for key in source.ignored() if key not in unused]
    if extra:  # VOLTA's modules save nothing else: another model's tensor is an error, not a warning
        raise HFImportError(f"{source.weights_path}: unexpected tensor {extra[0]} ({len(extra)} not part of {model} "
                            f"built from {Path(source.config_file).name})")
    return ModelConfig(encoder=encoder, heads=heads), weights, labels, model


def import_volta(src: str | Path, out: str | Path, config: str | Path | None = None, answers: Path | None = None) -> Path:
    """Convert a VOLTA .bin file into a vlserve checkpoint directory; returns `out`. `config`: the VOLTA config json
    it was built from (else the one beside it); `answers`: the answer table of its VQA/GQA head."""
    source = read_volta(src, config)
    model_config, weights, labels, model = convert(source, answers)
    return write_checkpoint(source, out, model_config, weights, labels, FORMAT, model, answers)
