"""Import the original LXMERT repository's checkpoints (github.com/airsplay/lxmert) as an `lxmert` model.

Its files are `torch.save(model.state_dict())` pickles, read here with weights_only (plain tensors only):
  *_LXRT.pth  the pretraining model LXRTPretraining, saved through nn.DataParallel (`module.` before every key):
              bert.*, cls.*, obj_predict_head.*, answer_head.* (the 9500-way image-QA head over
              data/lxmert/all_ans.json); or the encoder alone (LXRTEncoder.save: bert.*)
  BEST.pth    a fine-tuned VQAModel / GQAModel (src/tasks/vqa.py, gqa.py): lxrt_encoder.model.bert.* (with
              `module.` after `model.` when fine-tuned with --multiGPU) and the answer classifier logit_fc.*
Mapping (original -> vlserve): LXRTModel's bert.* carries the names transformers kept for lxmert.*
(hf_lxmert.encoder_keymap); cls, obj_predict_head and answer_head map as in hf_lxmert (answer_head is the image_qa
pretraining head, never served as /vqa); logit_fc.{0,2,3} -> heads.vqa.cls. The masked-LM decoder is tied to the
word embeddings and has no bias; obj_predict_head.decoder_dict.attr is listed as ignored (vlserve has no attribute
head). An NLVR2Model's classifier (2H -> 2H -> 2) has no vlserve counterpart and is refused.

Sizes come from the tensors: widths from their shapes, layer counts from their keys (the reference takes them from
--llayers/--xlayers/--rlayers and saves them nowhere). The number of attention heads, which no shape shows, comes
from a bert_config.json beside the weights (the file the reference's BertConfig reads), else from bert-base-uncased's
config, which the reference always builds from. The tokenizer: a vocab.txt beside the weights, else bert-base-uncased's.
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
    load_weight_file,
    name_answers,
    pretraining_heads,
    read_config,
    write_checkpoint,
)
from .hf_lxmert import LAYER_NORM_EPS, answer_head, encoder_keymap, object_heads

FORMAT = "lxmert"
FILES = "snap/vqa/BEST.pth, model_LXRT.pth"  # its files, named when a directory is given
BERT_CONFIG = "bert_config.json"
BERT_BASE_UNCASED = dict(  # bert-base-uncased's bert_config.json: LXRTEncoder and LXRTPretraining build from it
    vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
    hidden_act="gelu", hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1, max_position_embeddings=512,
    type_vocab_size=2, initializer_range=0.02,
)
# where LXRTModel's tensors sit -> where the pretraining heads sit, None for a fine-tuned model (heads: logit_fc)
LAYOUTS = {
    "module.bert.": "module.",  # LXRTPretraining or LXRTEncoder.model under nn.DataParallel (the public _LXRT.pth)
    "bert.": "",  # the same on one GPU
    "lxrt_encoder.model.bert.": None,  # VQAModel / GQAModel (BEST.pth)
    "lxrt_encoder.model.module.bert.": None,  # the same fine-tuned with --multiGPU
}
OTHER_FORMATS = {  # first key prefix of a checkpoint this importer does not read -> the command that does
    "lxmert.": "transformers' LXMERT weights: import their directory with `vlserve import hf-lxmert`",
    "visual_bert.": "transformers' VisualBERT weights: import their directory with `vlserve import hf-visualbert`",
}


def read_original(src: str | Path, files: str = FILES) -> HFSource:
    """The tensors of an original LXMERT .pth file and the BERT config it was built with; `files`: the names of the
    format's files, said when a directory is given."""
    path = Path(src)
    if path.is_dir():
        raise HFImportError(f"{path}: a directory; give the .pth file ({files})")
    if not path.is_file():
        raise HFImportError(f"{path}: no such file")
    state = load_weight_file(path)
    cfg_path = path.parent / BERT_CONFIG
    config = read_config(cfg_path) if cfg_path.is_file() else dict(BERT_BASE_UNCASED)
    return HFSource(path=path.parent, config=config, state=state, weights_file=path.name, config_file=BERT_CONFIG)


def encoder_prefix(source: HFSource) -> str:
    """The LAYOUTS key under which the file holds LXRTModel; another format fails saying which it is."""
    if any(source.has(f"{p}v_embeddings.image_embeddings.weight") for p in ("bert.", "module.bert.")):
        raise HFImportError(f"{source.weights_path}: a vilbert-multi-task checkpoint (ViLBERT's image stream): import it "
                            "with `vlserve import vilbert`")
    for prefix in LAYOUTS:
        if source.has(f"{prefix}embeddings.word_embeddings.weight"):
            return prefix
    first = next(iter(source.state), "")
    for other, what in OTHER_FORMATS.items():
        if first.startswith(other):
            raise HFImportError(f"{source.weights_path}: {what}")
    raise HFImportError(
        f"{source.weights_path}: not an airsplay/lxmert checkpoint (no bert.embeddings.word_embeddings.weight at the "
        f"top, under module. or under lxrt_encoder.model.; first tensor: {first or 'none'})"
    )


def word_embedding_size(source: HFSource, p: str) -> tuple[int, int]:
    """Vocabulary and hidden size of the word embeddings under `p`; a width other than bert-base-uncased's needs the
    BERT config beside the weights (no tensor shows the number of attention heads)."""
    vocab_size, hidden = source.shape(f"{p}embeddings.word_embeddings.weight")
    if not source.config_path.is_file() and hidden != BERT_BASE_UNCASED["hidden_size"]:
        raise HFImportError(
            f"{source.weights_path}: hidden size {hidden}, not bert-base-uncased's 768: put the {BERT_CONFIG} the model "
            "was built with beside it (no tensor shows the number of attention heads)"
        )
    return vocab_size, hidden


def encoder_fields(source: HFSource, p: str) -> dict:
    """EncoderConfig fields: widths and layer counts from the tensors, heads and dropout from the BERT config."""
    vocab_size, hidden = word_embedding_size(source, p)
    ffn = (f"{p}encoder.layer.0.intermediate.dense.weight", f"{p}encoder.x_layers.0.lang_inter.dense.weight")
    intermediate = next((source.shape(k)[0] for k in ffn if source.has(k)), source.get("intermediate_size"))
    feat_dim = source.shape(f"{p}encoder.visn_fc.visn_fc.weight")[1]
    box_dim = source.shape(f"{p}encoder.visn_fc.box_fc.weight")[1]
    if box_dim != 4:
        raise HFImportError(f"{source.weights_path}: {p}encoder.visn_fc.box_fc takes {box_dim} values, not a 4-d box")
    return bert_fields(source, layer_norm_eps=LAYER_NORM_EPS) | dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate,
        max_position_embeddings=source.shape(f"{p}embeddings.position_embeddings.weight")[0],
        type_vocab_size=source.shape(f"{p}embeddings.token_type_embeddings.weight")[0],
        num_layers=layer_count(source, f"{p}encoder.layer"),
        num_image_layers=layer_count(source, f"{p}encoder.r_layers"),
        num_cross_layers=layer_count(source, f"{p}encoder.x_layers"),
        visual_feat_dim=feat_dim,
    )


def convert(source: HFSource, answers: Path | None = None) -> tuple[ModelConfig, dict, dict, str]:
    """Our config, tensors and labels from an original checkpoint, and the reference model it was saved from."""
    p = encoder_prefix(source)
    head_p = LAYOUTS[p]
    encoder = build_encoder_config(source, "lxmert", encoder_fields(source, p))
    keymap = encoder_keymap(p, encoder.num_layers, encoder.num_image_layers, encoder.num_cross_layers)
    heads: dict[str, HeadConfig] = {}
    if head_p is not None:  # the pretraining model: LXRTPretraining's heads beside its bert
        heads, head_keys = pretraining_heads(source, f"{p}embeddings.word_embeddings.weight", head_p)
        obj_heads, obj_keys = object_heads(source, encoder.visual_feat_dim, head_p)
        heads |= obj_heads
        keymap |= head_keys | obj_keys
        if source.has(f"{head_p}answer_head.logit_fc.3.weight"):
            heads["image_qa"], qa_keys = answer_head(source, "image_qa", f"{head_p}answer_head.logit_fc")
            keymap |= qa_keys
        model = "LXRTPretraining" if heads else "LXRTFeatureExtraction"
    else:  # a fine-tuned task model: lxrt_encoder + logit_fc
        if source.has("logit_fc.0.weight") and (reads := source.shape("logit_fc.0.weight")[1]) != encoder.hidden_size:
            raise HFImportError(
                f"{source.weights_path}: logit_fc reads {reads} values, not the "
                f"pooled {encoder.hidden_size}: an NLVR2Model (two images' pooled vectors), which vlserve cannot import"
            )
        if source.has("logit_fc.3.weight"):
            heads["vqa"], qa_keys = answer_head(source, "vqa", "logit_fc")
            keymap |= qa_keys
        model = "VQAModel/GQAModel"
    labels: dict = {"heads": {}}
    name_answers(source, heads, labels, answers)
    weights = source.take(keymap)
    unused = {f"{head_p or ''}obj_predict_head.decoder_dict.attr.{t}" for t in ("weight", "bias")}  # no attribute head
    extra = [key for key in source.ignored() if key not in unused]
    if extra:  # the reference's modules save nothing else: another model's tensor is an error, not a warning
        raise HFImportError(f"{source.weights_path}: unexpected tensor {extra[0]} ({len(extra)} not part of {model})")
    return ModelConfig(encoder=encoder, heads=heads), weights, labels, model


def import_lxmert_original(src: str | Path, out: str | Path, answers: Path | None = None) -> Path:
    """Convert an airsplay/lxmert .pth file into a vlserve checkpoint directory; returns `out`.
    `answers`: the answer table of its answer head (hf_common.read_answers)."""
    source = read_original(src)
    config, weights, labels, model = convert(source, answers)
    return write_checkpoint(source, out, config, weights, labels, FORMAT, model, answers)
