"""Import VL-BERT's checkpoints (github.com/jackroos/VL-BERT) as a `vl-bert` model with the reference embeddings.

Its files are what its Checkpoint callback saves, read here with weights_only (plain tensors and containers):
`{'state_dict': model.state_dict(), 'optimizer': ..., ...}` of the DistributedDataParallel model (`module.` before
every key; a bare state dict, or keys without `module.`, read alike). The released files and the task models:
  vl-bert-{base,large}-{e2e,prec}.model  ResNetVLBERTForPretrainingMultitask: vlbert.* with its masked-LM head
                                         (mlm_head, decoder tied to the word embeddings) and masked-region
                                         classification head (mvrc_head); e2e ones also hold the ResNet-101 of its
                                         Fast R-CNN feature head
  a fine-tuned VQA model                 ResNetVLBERT of vqa/: final_mlp reads the hidden state of the [MASK] answer
                                         slot ("mlm" classifier: BERT's prediction transform then the answers, or "1fc")
  a fine-tuned RefCOCO+ model            ResNetVLBERT of refcoco/: final_mlp scores every region (Linear-GELU, Linear)

Key map (VL-BERT -> vlserve; `p` = "module." or ""):
  p vlbert.{word,position,token_type}_embeddings     encoder.embeddings.{same}
  p vlbert.end_embedding                             encoder.embeddings.end_embedding
  p object_linguistic_embeddings                     encoder.embeddings.object_embedding
  p image_feature_extractor.obj_downsample.1         encoder.embeddings.visual_fc   (its input: [geometry; feature])
  p vlbert.visual_ln_{text,object}, embedding_LayerNorm  encoder.embeddings.visual_ln_*, LayerNorm
  p vlbert.encoder.layer.i                           encoder.layer.i (query/key/value fused into qkv)
  p vlbert.pooler.dense                              encoder.pooler.dense (only with_pooler configs have one)
  p vlbert.mlm_head.predictions.*                    heads.mlm.{transform, bias}
  p vlbert.mvrc_head.{transform.dense, region_cls_pred}  heads.mrc.{transform.dense, decoder}
  p vlbert.relationsip_head.caption_image_relationship   heads.itm.seq_relationship
  p final_mlp.{0 (transform), 2} (VQA "mlm")         heads.vqa.cls.{0, 1};  final_mlp.1 ("1fc") -> heads.vqa.cls
  p final_mlp.{0.dense, 2} (RefCOCO+)                heads.refer.{transform.dense, score}
Deliberately unused (listed in the manifest's ignored_keys): the e2e files' ResNet-101 (image_feature_extractor.
backbone / roi_head_feature_extractor / head: vlserve's detector gives the region features), and the pretraining
model's object_mask_visual_embedding, object_mask_word_embedding and aux_text_visual_embedding (what it puts in place
of masked regions and on text-only corpus rows: inputs of pretraining, never of inference).

Sizes come from the tensors; the number of attention heads, which no shape shows, from the yaml config the model was
built with (cfgs/<task>/*.yaml: NETWORK.VLBERT), given with --config or found beside the weights as <name>.yaml, else
from BERT-base's (768 wide: 12 heads) or BERT-large's (1024: 16). A config that disagrees with the tensors is refused.
The tokenizer: a vocab.txt beside the weights, else bert-base-uncased's.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import yaml

from ..config import EncoderConfig, HeadConfig, ModelConfig
from .hf_common import (
    HFImportError,
    HFSource,
    build_encoder_config,
    layer_count,
    load_pickle,
    read_answers,
    write_checkpoint,
)
from .keymap import KeyMap, bert_layer, linear

FORMAT = "vl-bert"
GEOMETRY = 2048  # FastRCNN.coordinate_embeddings(boxes, 256): 4 coordinates x (256 sines + 256 cosines)
HEADS_BY_WIDTH = {768: 12, 1024: 16}  # bert-base-uncased, bert-large-uncased: what its configs build on
UNUSED = {  # key prefix (after `module.`) -> why vlserve does not import it
    "image_feature_extractor.backbone.": "the e2e Fast R-CNN's ResNet-101: vlserve's detector gives the features",
    "image_feature_extractor.roi_head_feature_extractor.": "the e2e Fast R-CNN's res5 head",
    "image_feature_extractor.head.": "the e2e Fast R-CNN's res5 head (again, with its pooling)",
    "object_mask_visual_embedding.": "pretraining only: the feature of a masked region",
    "object_mask_word_embedding.": "pretraining only: the object embedding of a masked region",
    "aux_text_visual_embedding.": "pretraining only: the visual embedding of text-only corpus rows",
}
OTHER_FORMATS = {  # first key of a checkpoint this importer does not read -> the command that does
    "lxrt_encoder.": "an airsplay/lxmert fine-tuned model: import it with `vlserve import lxmert`",
    "module.bert.": "an airsplay/lxmert pretraining snapshot: import it with `vlserve import lxmert`",
    "bert.": "an airsplay/lxmert or BERT checkpoint, not VL-BERT's",
    "lxmert.": "transformers' LXMERT weights: import their directory with `vlserve import hf-lxmert`",
    "visual_bert.": "transformers' VisualBERT weights: import their directory with `vlserve import hf-visualbert`",
}


def load_release(path: Path) -> dict[str, torch.Tensor]:
    """The state dict of a VL-BERT checkpoint file: `{'state_dict': ...}` (what its training saves) or a bare one,
    unpickled with weights_only (tensors and plain containers only)."""
    data = load_pickle(path)
    state = data.get("state_dict", data) if isinstance(data, dict) else data
    if not isinstance(state, dict) or not state or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
    ):
        raise HFImportError(f"{path}: not a VL-BERT checkpoint (a dictionary with a 'state_dict' of tensors by name)")
    return state


def read_yaml(path: Path) -> dict[str, Any]:
    """NETWORK.VLBERT of a VL-BERT yaml config, with NETWORK's CLASSIFIER_TYPE beside it."""
    try:
        data = yaml.safe_load(path.read_text())
    except RecursionError:
        raise HFImportError(f"{path}: unreadable config (nested too deeply)") from None
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise HFImportError(f"{path}: unreadable config ({type(exc).__name__})") from None
    network = data.get("NETWORK") if isinstance(data, dict) else None
    vlbert = network.get("VLBERT") if isinstance(network, dict) else None
    if not isinstance(vlbert, dict):
        raise HFImportError(f"{path}: not a VL-BERT config (no NETWORK.VLBERT section)")
    return {**vlbert, "CLASSIFIER_TYPE": network.get("CLASSIFIER_TYPE")}


def read_vl_bert(src: str | Path, config: str | Path | None = None) -> HFSource:
    """The tensors of a VL-BERT .model file and its yaml config (given, or <name>.yaml beside it, or none)."""
    path = Path(src)
    if path.is_dir():
        raise HFImportError(f"{path}: a directory; give the .model file (vl-bert-base-e2e.model, a fine-tuned model)")
    if not path.is_file():
        raise HFImportError(f"{path}: no such file")
    state = load_release(path)
    cfg_path = Path(config) if config is not None else path.with_suffix(".yaml")
    if config is not None and not cfg_path.is_file():
        raise HFImportError(f"{cfg_path}: no such file")
    settings = read_yaml(cfg_path) if cfg_path.is_file() else {}
    return HFSource(path=path.parent, config=settings, state=state, weights_file=path.name,
                    config_file=str(cfg_path.resolve()) if cfg_path.is_file() else cfg_path.name)


def layout_prefix(source: HFSource) -> str:
    """"module." (saved from DistributedDataParallel, as the releases are) or ""; another format fails naming it."""
    for p in ("module.", ""):
        if source.has(f"{p}vlbert.word_embeddings.weight"):
            return p
    if any(k.startswith("bert.encoder.layer.0.attention_self.") for k in source.state):  # VOLTA's sublayer names
        raise HFImportError(f"{source.weights_path}: a VOLTA checkpoint: import it with `vlserve import volta`")
    first = next(iter(source.state), "")
    for other, what in OTHER_FORMATS.items():
        if first.startswith(other):
            raise HFImportError(f"{source.weights_path}: {what}")
    raise HFImportError(f"{source.weights_path}: not a VL-BERT checkpoint (no vlbert.word_embeddings.weight at the "
                        f"top or under module.; first tensor: {first or 'none'})")


def refuse_unsupported(source: HFSource, p: str) -> None:
    """Config switches of VL-BERT that its released configs leave off and vlserve does not build, told by a tensor."""
    unsupported = {
        f"{p}vlbert.visual_1x1_text.weight": "visual_size differs from hidden_size (a visual_1x1 projection)",
        f"{p}vlbert.visual_scale_text": "visual_ln is off (scalar visual scales instead of LayerNorms)",
        f"{p}vlbert.special_word_embeddings.weight": "word_embedding_frozen is on (special words embedded apart)",
        f"{p}image_feature_extractor.object_embed.weight": "IMAGE_SEMANTIC is on (class embeddings in the features)",
        f"{p}final_mlp.4.weight": "its VQA classifier is the '2fc' one",
    }
    for key, what in unsupported.items():
        if source.has(key):
            raise HFImportError(f"{source.weights_path}: {what}, which vlserve does not build (tensor {key})")
    rows = source.shape(f"{p}object_linguistic_embeddings.weight")[0]
    if rows != 1:
        raise HFImportError(f"{source.weights_path}: object_linguistic_embeddings has {rows} rows: object_word_embed_mode "
                            "other than 2 (one object embedding), which vlserve does not build")


def encoder_fields(source: HFSource, p: str) -> dict[str, Any]:
    """EncoderConfig fields: sizes from the tensors, the number of heads from the yaml; a yaml that disagrees fails."""
    v = f"{p}vlbert."
    vocab, hidden = source.shape(f"{v}word_embeddings.weight")
    visual_out, visual_in = source.shape(f"{p}image_feature_extractor.obj_downsample.1.weight")
    if visual_out != hidden or visual_in <= GEOMETRY:
        raise HFImportError(f"{source.weights_path}: obj_downsample maps {visual_in} values to {visual_out}, not "
                            f"{GEOMETRY} geometry values and a region feature to the hidden size {hidden}")
    found = dict(
        vocab_size=vocab, hidden_size=hidden, max_position_embeddings=source.shape(f"{v}position_embeddings.weight")[0],
        type_vocab_size=source.shape(f"{v}token_type_embeddings.weight")[0],
        num_hidden_layers=layer_count(source, f"{v}encoder.layer"),
        intermediate_size=source.shape(f"{v}encoder.layer.0.intermediate.dense.weight")[0],
        visual_size=visual_out,
    )
    cfg = source.config
    for name, value in found.items():
        said = source.get(name, default=None)  # an integer when stated
        if said is not None and said != value:
            raise HFImportError(f"{source.config_path}: {name} is {said}, but the weights have {value}")
    for name, want in (("hidden_act", "gelu"), ("visual_ln", True), ("obj_pos_id_relative", True),
                       ("position_padding_idx", -1), ("word_embedding_frozen", False)):
        if cfg.get(name, want) != want:
            raise HFImportError(f"{source.config_path}: {name} is {cfg[name]!r}; vlserve builds VL-BERT with {want!r}")
    heads = source.get("num_attention_heads", default=HEADS_BY_WIDTH.get(hidden))
    if heads is None:
        raise HFImportError(f"{source.weights_path}: hidden size {hidden} is neither BERT-base's nor BERT-large's: give "
                            "the yaml config it was built with (--config; no tensor shows the number of attention heads)")
    if heads <= 0 or hidden % heads:
        raise HFImportError(f"{source.config_path}: num_attention_heads {heads!r} does not divide the hidden size {hidden}")
    return dict(
        vocab_size=vocab, hidden_size=hidden, num_layers=found["num_hidden_layers"], num_heads=heads,
        intermediate_size=found["intermediate_size"], max_position_embeddings=found["max_position_embeddings"],
        type_vocab_size=found["type_vocab_size"], layer_norm_eps=1e-12, visual_feat_dim=visual_in - GEOMETRY,
        dropout=source.get("hidden_dropout_prob", float, default=0.1),
        attention_dropout=source.get("attention_probs_dropout_prob", float, default=0.1),
        vlbert_embedding="reference", geometry_dim=GEOMETRY, pooler=source.has(f"{v}pooler.dense.weight"),
    )


def encoder_keymap(p: str, layers: int, pooler: bool) -> KeyMap:
    v, e = f"{p}vlbert.", "encoder.embeddings"
    keymap: KeyMap = {f"{e}.{n}.weight": [f"{v}{n}.weight"]
                      for n in ("word_embeddings", "position_embeddings", "token_type_embeddings", "end_embedding")}
    keymap[f"{e}.object_embedding.weight"] = [f"{p}object_linguistic_embeddings.weight"]
    keymap |= linear(f"{e}.visual_fc", f"{p}image_feature_extractor.obj_downsample.1")
    for name in ("visual_ln_text", "visual_ln_object"):
        keymap |= linear(f"{e}.{name}", f"{v}{name}")
    keymap |= linear(f"{e}.LayerNorm", f"{v}embedding_LayerNorm")
    for i in range(layers):
        keymap |= bert_layer(f"encoder.layer.{i}", f"{v}encoder.layer.{i}")
    if pooler:
        keymap |= linear("encoder.pooler.dense", f"{v}pooler.dense")
    return keymap


def task_heads(source: HFSource, p: str) -> tuple[dict[str, HeadConfig], KeyMap, str]:
    """The heads the file holds, their key map, and the reference model they tell."""
    heads: dict[str, HeadConfig] = {}
    keymap: KeyMap = {}
    v, f = f"{p}vlbert.", f"{p}final_mlp"
    if source.has(f"{v}mlm_head.predictions.transform.dense.weight"):
        heads["mlm"] = HeadConfig(kind="mlm")
        keymap |= linear("heads.mlm.transform.dense", f"{v}mlm_head.predictions.transform.dense")
        keymap |= linear("heads.mlm.transform.LayerNorm", f"{v}mlm_head.predictions.transform.LayerNorm")
        keymap["heads.mlm.bias"] = [f"{v}mlm_head.predictions.bias"]
        source.tied(f"{v}mlm_head.predictions.decoder.weight", f"{v}word_embeddings.weight")
    if source.has(f"{v}mvrc_head.region_cls_pred.weight"):
        classes = source.shape(f"{v}mvrc_head.region_cls_pred.weight")[0]
        heads["mrc"] = HeadConfig(kind="mrc", num_labels=classes, classifier="dense_gelu", mrc_loss="kl")
        keymap |= linear("heads.mrc.transform.dense", f"{v}mvrc_head.transform.dense")
        keymap |= linear("heads.mrc.decoder", f"{v}mvrc_head.region_cls_pred")
    if source.has(f"{v}relationsip_head.caption_image_relationship.weight"):
        heads["itm"] = HeadConfig(kind="itm")
        keymap |= linear("heads.itm.seq_relationship", f"{v}relationsip_head.caption_image_relationship")
    if heads:
        return heads, keymap, "ResNetVLBERTForPretrainingMultitask"
    if source.has(f"{f}.0.LayerNorm.weight"):  # VQA, CLASSIFIER_TYPE "mlm"
        answers = source.shape(f"{f}.2.weight")[0]
        heads["vqa"] = HeadConfig(kind="vqa", num_labels=answers, pool="answer_segment", classifier="bert")
        keymap |= linear("heads.vqa.cls.0.dense", f"{f}.0.dense") | linear("heads.vqa.cls.0.LayerNorm", f"{f}.0.LayerNorm")
        keymap |= linear("heads.vqa.cls.1", f"{f}.2")
        return heads, keymap, "ResNetVLBERT (vqa)"
    if source.has(f"{f}.0.dense.weight"):  # RefCOCO+: a score per region
        if source.shape(f"{f}.2.weight")[0] != 1:
            raise HFImportError(f"{source.weights_path}: {f}.2 has {source.shape(f'{f}.2.weight')[0]} outputs, not one "
                                "score per region (RefCOCO+)")
        heads["refer"] = HeadConfig(kind="refer", classifier="dense_gelu")
        keymap |= linear("heads.refer.transform.dense", f"{f}.0.dense") | linear("heads.refer.score", f"{f}.2")
        return heads, keymap, "ResNetVLBERT (refcoco)"
    if source.has(f"{f}.1.weight"):  # VQA, CLASSIFIER_TYPE "1fc"
        heads["vqa"] = HeadConfig(kind="vqa", num_labels=source.shape(f"{f}.1.weight")[0], pool="answer_segment",
                                  classifier="linear")
        keymap |= linear("heads.vqa.cls", f"{f}.1")
        return heads, keymap, "ResNetVLBERT (vqa)"
    return heads, keymap, "VisualLinguisticBert"


def answer_names(source: HFSource, heads: dict[str, HeadConfig], answers: Path | None) -> dict[str, Any]:
    """labels.json's answers of the VQA head: VL-BERT's answers_vqa.txt (one per line), a JSON answer table, or numbers."""
    if "vqa" not in heads:
        if answers is not None:
            raise HFImportError(f"{answers}: the checkpoint has no VQA head to name")
        return {"heads": {}}
    count = heads["vqa"].num_labels
    if answers is None:
        names = [str(i) for i in range(count)]
    else:
        names = read_answers(answers)
        if Path(answers).suffix.lower() == ".txt":  # VL-BERT's own reader skips blank lines (Pythia's keeps them)
            names = [n for n in names if n]
    if len(names) != count:
        raise HFImportError(f"{answers}: {len(names)} answers, but the checkpoint's vqa head has {count} outputs")
    return {"heads": {"vqa": names}}


def convert(source: HFSource, answers: Path | None = None) -> tuple[ModelConfig, dict, dict, str]:
    """Our config, tensors and labels from a VL-BERT checkpoint, and the reference model it was saved from."""
    p = layout_prefix(source)
    refuse_unsupported(source, p)
    encoder: EncoderConfig = build_encoder_config(source, "vl-bert", encoder_fields(source, p))
    heads, head_keys, model = task_heads(source, p)
    labels = answer_names(source, heads, answers)
    weights = source.take(encoder_keymap(p, encoder.num_layers, encoder.pooler) | head_keys)
    unused = tuple(f"{p}{prefix}" for prefix in UNUSED)
    extra = [key for key in source.ignored() if not key.startswith(unused)]
    if extra:  # the reference's modules save nothing else: another model's tensor is an error, not a warning
        raise HFImportError(f"{source.weights_path}: unexpected tensor {extra[0]} ({len(extra)} not part of {model})")
    return ModelConfig(encoder=encoder, heads=heads), weights, labels, model


def import_vl_bert(src: str | Path, out: str | Path, answers: Path | None = None, config: Path | None = None) -> Path:
    """Convert a jackroos/VL-BERT .model file into a vlserve checkpoint directory; returns `out`. `answers`: the
    VQA head's answers (answers_vqa.txt, or a JSON table); `config`: the yaml it was trained with."""
    source = read_vl_bert(src, config)
    model_config, weights, labels, model = convert(source, answers)
    return write_checkpoint(source, out, model_config, weights, labels, FORMAT, model, answers)
