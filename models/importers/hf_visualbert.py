"""Import transformers' VisualBert* checkpoints (the public uclanlp/visualbert-* format) as a `visualbert` model.

Mapping (transformers -> vlserve), `visual_bert.` prefix present on task models only:
  embeddings.*                        -> encoder.embeddings.* (same names)
  encoder.layer.{i}.attention.self.{query,key,value} -> encoder.layer.{i}.attention.qkv (fused)
  encoder.layer.{i}.{attention.output,intermediate,output} -> encoder.layer.{i}.{attention,ffn}
  pooler.dense                        -> encoder.pooler.dense
  cls (QuestionAnswering)             -> heads.vqa.cls  (linear, reads the answer slot at mask.sum - 2)
  cls (VisualReasoning)               -> heads.nlvr2.cls (linear, one pass over both images' regions)
  cls (MultipleChoice)                -> heads.multiple_choice.cls
  cls.predictions / cls.seq_relationship (PreTraining, RegionToPhraseAlignment) -> heads.mlm / heads.itm
  attention.{query,key} (RegionToPhraseAlignment) -> heads.grounding.{query,key}; attention.value is unused
Our visualbert preset gives every region segment 1 and visual position 0, as transformers does without
`image_text_alignment`. Our pad_token_id stays 0 (the vocab's [PAD]); transformers' VisualBertConfig default of 1
only marks an embedding row whose gradient is zeroed and changes no output.
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
from .keymap import KeyMap, bert_embeddings, bert_layer, linear

FORMAT = "hf-visualbert"
ARCHITECTURES = (
    "VisualBertModel", "VisualBertForPreTraining", "VisualBertForQuestionAnswering",
    "VisualBertForVisualReasoning", "VisualBertForMultipleChoice", "VisualBertForRegionToPhraseAlignment",
)
# The classifier `cls.weight` means a different head in each task model: config.json's architecture tells which.
_CLASSIFIER_TASK = {
    "VisualBertForQuestionAnswering": "vqa",
    "VisualBertForVisualReasoning": "nlvr2",
    "VisualBertForMultipleChoice": "multiple_choice",
}
_FIXED_OUTPUTS = {"nlvr2": 2, "multiple_choice": 1}  # outputs of our heads whose width is not configurable


def encoder_keymap(p: str, num_layers: int) -> KeyMap:
    """Our visualbert encoder from a VisualBertModel whose keys start with `p`."""
    emb = f"{p}embeddings"
    keymap = bert_embeddings("encoder.embeddings", emb)
    for name in ("visual_token_type_embeddings", "visual_position_embeddings"):
        keymap[f"encoder.embeddings.{name}.weight"] = [f"{emb}.{name}.weight"]
    keymap |= linear("encoder.embeddings.visual_projection", f"{emb}.visual_projection")
    for i in range(num_layers):
        keymap |= bert_layer(f"encoder.layer.{i}", f"{p}encoder.layer.{i}")
    return keymap | linear("encoder.pooler.dense", f"{p}pooler.dense")


def classifier_head(source: HFSource, architecture: str | None) -> tuple[str, HeadConfig] | None:
    """The task head behind `cls.weight` (VQA, NLVR2 or multiple choice), or None without one."""
    if architecture is None and source.has("cls.weight"):
        raise HFImportError(
            f"{source.config_path}: field 'architectures' is missing; it is needed to tell whether cls.weight "
            "is a VQA, NLVR2 or multiple-choice classifier"
        )
    if architecture not in _CLASSIFIER_TASK:
        return None  # a stray cls.weight is then listed among the ignored keys
    task = _CLASSIFIER_TASK[architecture]
    rows = source.rows("cls.weight")
    if task == "vqa":
        # trained with a softmax over the answers (KL divergence of its log-softmax to the soft scores: VisualBERT's
        # and transformers' VisualBertForQuestionAnswering), so it scores with one: vqa_loss "ce"
        return task, HeadConfig(kind="vqa", num_labels=rows, pool="answer_slot", classifier="linear", vqa_loss="ce")
    if rows != _FIXED_OUTPUTS[task]:
        raise HFImportError(
            f"{source.weights_path}: cls.weight has {rows} outputs; vlserve's {task} head has {_FIXED_OUTPUTS[task]}"
        )
    if task == "nlvr2":
        return task, HeadConfig(kind="nlvr2", classifier="linear", nlvr2_mode="joint")
    return task, HeadConfig(kind="multiple_choice")


def import_visualbert(src: str | Path, out: str | Path, answers: Path | None = None) -> Path:
    """Convert a transformers VisualBert* directory into a vlserve checkpoint directory; returns `out`.
    `answers`: the answer table of the VQA head (hf_common.read_answers)."""
    source = read_source(src, "visual_bert")
    architecture = source.architecture(ARCHITECTURES, FORMAT)
    if source.get("bypass_transformer", bool, default=False):
        raise HFImportError(f"{source.config_path}: bypass_transformer=true is not supported")
    p = source.prefix("visual_bert")
    fields = bert_fields(source) | dict(
        num_layers=stated_layers(source, "num_hidden_layers", f"{p}encoder.layer"),
        visual_feat_dim=source.get("visual_embedding_dim"),
    )
    encoder = build_encoder_config(source, "visualbert", fields)
    keymap = encoder_keymap(p, encoder.num_layers)

    heads, head_keys = pretraining_heads(source, f"{p}embeddings.word_embeddings.weight")
    keymap |= head_keys
    labels: dict = {"heads": {}}
    if (found := classifier_head(source, architecture)) is not None:
        task, head = found
        heads[task] = head
        keymap |= linear(f"heads.{task}.cls", "cls")
    if architecture == "VisualBertForRegionToPhraseAlignment" or source.has("attention.query.weight"):
        heads["grounding"] = HeadConfig(kind="grounding")
        keymap |= linear("heads.grounding.query", "attention.query") | linear("heads.grounding.key", "attention.key")
    name_answers(source, heads, labels, answers)

    weights = source.take(keymap)
    config = ModelConfig(encoder=encoder, heads=heads)
    return write_checkpoint(source, out, config, weights, labels, FORMAT, architecture, answers)
