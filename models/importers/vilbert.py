"""Import facebookresearch/vilbert-multi-task's checkpoints as a `vilbert` model.

Its files are `torch.save(model.state_dict())` pickles (train_concap.py, train_tasks.py), read with weights_only:
  pretrained_model.bin   BertForMultiModalPreTraining: bert.* and the pretraining heads cls.predictions (masked LM,
                         decoder tied to the word embeddings), cls.bi_seq_relationship (image-text matching, index 0 =
                         the caption belongs to the image) and cls.imagePredictions (masked region classification,
                         trained by KL to the detector's 1601-class distribution)
  multi_task_model.bin   VILBertForVLTasks (12-in-1, trained with task tokens): bert.* with
                         bert.embeddings.task_embeddings, and the task heads vil_prediction (VQA, 3129 answers),
                         vil_prediction_gqa (GQA, 1533), vil_logit (retrieval score), vil_binary_prediction (NLVR2),
                         vision_logit (referring expressions), vil_tri_prediction (visual entailment) and
                         linguisic_logit, beside the cls.* pretraining heads it was fine-tuned from
The model's sizes come from the vilbert-multi-task config json it was trained with (config/bert_base_6layer_6conect.json
for both published files): `--config`, else a config.json or bert_base_6layer_6conect.json beside the weights.

Mapping (reference -> vlserve): bert.embeddings / v_embeddings / encoder.layer / encoder.v_layer / t_pooler / v_pooler
-> encoder.*; each co-attention layer's biattention (query2 with key1/value1: text reads the image; query1 with
key2/value2: the image reads the text) and biOutput dense2/LayerNorm2, dense1/LayerNorm1 -> c_layer.k.text_attention /
image_attention; t_/v_intermediate and t_/v_output -> text_ffn / image_ffn. Heads: cls.predictions -> mlm,
cls.bi_seq_relationship -> itm (rows swapped: vlserve's index 1 is "matches"), cls.imagePredictions -> mrc;
vil_prediction -> vqa, vil_prediction_gqa -> gqa (a second vqa-kind head), vil_binary_prediction -> nlvr2,
vil_logit -> rank (an itm-kind head whose "matches" logit is the score and whose other logit is 0: /retrieve ranks by
their difference), vision_logit -> refer. Each 12-in-1 head carries the task token of one of its tasks
(vilbert_tasks.yml's task_id, TASK_TOKENS); the import's --task-token HEAD=ID picks another of the same head
(e.g. refer: 9 RefCOCO, 10 RefCOCO+, 11 RefCOCOg; rank: 7 COCO, 8 Flickr30k).

Listed in the manifest's import.ignored_keys, by name (unused_keys; the CLI says why: WHY_UNUSED): every co-attention layer's biOutput.q_dense1 and
q_dense2 (built, never called in the reference's forward); of the 12-in-1 model, vil_tri_prediction (visual
entailment: no vlserve endpoint), linguisic_logit (a per-word score no 12-in-1 task reads) and the cls.* pretraining
heads (carried over from pretraining; no 12-in-1 task reads them and none has a task token to run with). Any other
tensor is an error: the reference saves nothing else.
"""
from __future__ import annotations

from functools import partial
from pathlib import Path

import torch

from ..config import EncoderConfig, HeadConfig, ModelConfig
from ..vl_model import VLModel
from .hf_common import (
    HFImportError,
    HFSource,
    bert_fields,
    build_encoder_config,
    load_weight_file,
    name_answers,
    read_config,
    stated_layers,
    write_checkpoint,
)
from .keymap import KeyMap, bert_embeddings, bert_layer, feed_forward, fused, linear

FORMAT = "vilbert"
CONFIG_NAMES = ("config.json", "bert_base_6layer_6conect.json")  # looked for beside the weights without --config
LAYER_NORM_EPS = 1e-12  # BertLayerNorm(eps=1e-12) everywhere in vilbert/vilbert.py, whatever the config says
REFERENCE_DEFAULTS = dict(  # BertConfig's defaults in vilbert/vilbert.py, for fields a config json leaves out
    v_feature_size=2048, v_target_size=1601, v_hidden_size=768, v_num_hidden_layers=3, v_num_attention_heads=12,
    v_intermediate_size=3072, bi_hidden_size=1024, bi_num_attention_heads=16, v_hidden_act="gelu",
    v_biattention_id=[0, 1], t_biattention_id=[10, 11], fusion_method="mul", dynamic_attention=False,
    with_coattention=True, in_batch_pairs=False, model="bert",
)
TASK_TOKENS = {"vqa": 1, "gqa": 15, "rank": 7, "refer": 9, "nlvr2": 12}  # vilbert_tasks.yml: VQA, GQA,
# RetrievalCOCO, refcoco, NLVR2
OTHER_FORMATS = {  # a key of a checkpoint this importer does not read -> the command that does
    "lxrt_encoder.": "an airsplay/lxmert fine-tuned model: import it with `vlserve import lxmert`",
    "bert.encoder.x_layers.0.": "an airsplay/lxmert pretraining snapshot: import it with `vlserve import lxmert`",
    "lxmert.": "transformers' LXMERT weights: import their directory with `vlserve import hf-lxmert`",
    "visual_bert.": "transformers' VisualBERT weights: import their directory with `vlserve import hf-visualbert`",
}


def unused_keys(source: HFSource, cross_layers: int, task_model: bool) -> set[str]:
    """Source tensors deliberately not imported (see the module docstring)."""
    unused = {f"bert.encoder.c_layer.{k}.biOutput.q_dense{s}.{t}" for k in range(cross_layers) for s in (1, 2)
              for t in ("weight", "bias")}
    if task_model:
        unused |= {k for k in source.state if k.startswith(("vil_tri_prediction.", "linguisic_logit.", "cls."))}
    return unused


WHY_UNUSED = {  # a group of deliberately unused source tensors -> why (said by the CLI)
    "q_dense": "biOutput.q_dense1/q_dense2 of the co-attention layers: built, never called in the reference's forward",
    "vil_tri_prediction": "vil_tri_prediction: visual entailment, which vlserve has no endpoint for",
    "linguisic_logit": "linguisic_logit: a per-word score that no 12-in-1 task reads",
    "cls": "cls.*: the pretraining heads the 12-in-1 model was fine-tuned from; none of its tasks reads them",
}


def why_unused(keys: list[str]) -> list[str]:
    """The reasons (WHY_UNUSED) for the groups that ignored source keys fall in."""
    groups = {"q_dense" if ".q_dense" in key else key.split(".")[0] for key in keys}
    return [why for group, why in WHY_UNUSED.items() if group in groups]


def find_config(weights: Path, config: Path | None) -> Path:
    if config is not None:
        if not config.is_file():
            raise HFImportError(f"{config}: no such config file")
        return config
    for name in CONFIG_NAMES:
        if (weights.parent / name).is_file():
            return weights.parent / name
    raise HFImportError(
        f"{weights}: no ViLBERT config beside it (looked for {', '.join(CONFIG_NAMES)}): pass --config with the "
        "vilbert-multi-task config json it was trained with (config/bert_base_6layer_6conect.json for the published "
        "models)"
    )


def read_vilbert(src: str | Path, config: str | Path | None = None) -> HFSource:
    """The tensors of a vilbert-multi-task .bin file and the config json it was built from."""
    path = Path(src)
    if path.is_dir():
        raise HFImportError(f"{path}: a directory; give the .bin file (pretrained_model.bin, multi_task_model.bin)")
    if not path.is_file():
        raise HFImportError(f"{path}: no such file")
    state = load_weight_file(path)
    if state and all(k.startswith("module.") for k in state):  # saved from nn.DataParallel
        state = {k[len("module."):]: v for k, v in state.items()}
    cfg_path = find_config(path, Path(config) if config is not None else None).resolve()
    return HFSource(path=path.parent, config=read_config(cfg_path), state=state, weights_file=path.name,
                    config_file=str(cfg_path))


def check_format(source: HFSource) -> None:
    """A vilbert-multi-task model has bert.v_embeddings; another format fails saying which it is."""
    if source.has("bert.v_embeddings.image_embeddings.weight"):
        return
    for prefix, what in OTHER_FORMATS.items():
        if any(k.startswith(prefix) for k in source.state):
            raise HFImportError(f"{source.weights_path}: {what}")
    first = next(iter(source.state), "")
    raise HFImportError(
        f"{source.weights_path}: not a vilbert-multi-task checkpoint (no bert.v_embeddings.image_embeddings.weight; "
        f"first tensor: {first or 'none'})"
    )


def setting(source: HFSource, name: str, kind: type = int, least: int | None = None):
    return source.get(name, kind, default=REFERENCE_DEFAULTS[name], least=least)


def ids(source: HFSource, name: str, layers: int) -> tuple[int, ...]:
    """A list of layer ids 0..`layers` (the reference slices its layer lists with them: a negative id would count
    from the end and run the layers in another order)."""
    value = setting(source, name, list)
    if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i <= layers for i in value):
        raise HFImportError(f"{source.config_path}: field {name!r} is {value!r}, expected a list of layer indices "
                            f"from 0 to {layers}")
    return tuple(value)


def encoder_fields(source: HFSource) -> dict:
    """EncoderConfig fields from the config json; the task table's size from the weights (it is not in the json)."""
    for name, want in (("fusion_method", "mul"), ("model", "bert"), ("v_hidden_act", "gelu")):
        if setting(source, name, str) != want:
            raise HFImportError(f"{source.config_path}: {name} {setting(source, name, str)!r} is not supported "
                                f"(vlserve's vilbert runs {name} {want!r})")
    for name in ("dynamic_attention", "in_batch_pairs"):
        if setting(source, name, bool):
            raise HFImportError(f"{source.config_path}: {name} is not supported (vlserve's vilbert has no {name})")
    if not setting(source, "with_coattention", bool):
        raise HFImportError(f"{source.config_path}: with_coattention false is not supported")
    num_layers = stated_layers(source, "num_hidden_layers", "bert.encoder.layer")
    num_image_layers = stated_layers(source, "v_num_hidden_layers", "bert.encoder.v_layer",
                                     REFERENCE_DEFAULTS["v_num_hidden_layers"])
    text_ids, image_ids = ids(source, "t_biattention_id", num_layers), ids(source, "v_biattention_id", num_image_layers)
    if len(text_ids) != len(image_ids):
        raise HFImportError(f"{source.config_path}: t_biattention_id and v_biattention_id differ in length")
    task = "bert.embeddings.task_embeddings.weight"
    size = partial(setting, source, least=1)  # EncoderConfig reads a 0 width or head count as another stream's
    return bert_fields(source, layer_norm_eps=LAYER_NORM_EPS) | dict(
        num_layers=num_layers,
        visual_feat_dim=setting(source, "v_feature_size"),
        image_hidden_size=size("v_hidden_size"),
        image_num_heads=size("v_num_attention_heads"),
        image_intermediate_size=size("v_intermediate_size"),
        num_image_layers=num_image_layers,
        num_cross_layers=len(text_ids),
        coattention_text_layers=text_ids,
        coattention_image_layers=image_ids,
        coattention_hidden_size=size("bi_hidden_size"),
        coattention_num_heads=size("bi_num_attention_heads"),
        task_tokens=source.rows(task) if source.has(task) else 0,
        img_from_regions=True,  # [IMG] = the mean of the regions' features (ImageFeaturesH5Reader), never the detector's
    )


def co_attention_layer(dst: str, src: str) -> KeyMap:
    """Our CoAttentionLayer from a BertConnectionLayer: stream 1 of the reference is the image, stream 2 the text."""
    bi, out = f"{src}.biattention", f"{src}.biOutput"
    return {
        **linear(f"{dst}.text_attention.query", f"{bi}.query2"),
        **fused(f"{dst}.text_attention.kv", [f"{bi}.key1", f"{bi}.value1"]),
        **linear(f"{dst}.text_attention.dense", f"{out}.dense2"),
        **linear(f"{dst}.text_attention.LayerNorm", f"{out}.LayerNorm2"),
        **linear(f"{dst}.image_attention.query", f"{bi}.query1"),
        **fused(f"{dst}.image_attention.kv", [f"{bi}.key2", f"{bi}.value2"]),
        **linear(f"{dst}.image_attention.dense", f"{out}.dense1"),
        **linear(f"{dst}.image_attention.LayerNorm", f"{out}.LayerNorm1"),
        **feed_forward(f"{dst}.text_ffn", f"{src}.t_intermediate", f"{src}.t_output"),
        **feed_forward(f"{dst}.image_ffn", f"{src}.v_intermediate", f"{src}.v_output"),
    }


def encoder_keymap(enc: EncoderConfig) -> KeyMap:
    keymap = bert_embeddings("encoder.embeddings", "bert.embeddings")
    if enc.task_tokens:
        keymap["encoder.task_embeddings.weight"] = ["bert.embeddings.task_embeddings.weight"]
    for name in ("image_embeddings", "image_location_embeddings", "LayerNorm"):
        keymap |= linear(f"encoder.v_embeddings.{name}", f"bert.v_embeddings.{name}")
    for i in range(enc.num_layers):
        keymap |= bert_layer(f"encoder.layer.{i}", f"bert.encoder.layer.{i}")
    for i in range(enc.num_image_layers):
        keymap |= bert_layer(f"encoder.v_layer.{i}", f"bert.encoder.v_layer.{i}")
    for k in range(enc.num_cross_layers):
        keymap |= co_attention_layer(f"encoder.c_layer.{k}", f"bert.encoder.c_layer.{k}")
    for pooler in ("t_pooler", "v_pooler"):
        keymap |= linear(f"encoder.{pooler}.dense", f"bert.{pooler}.dense")
    return keymap


def mlp(dst: str, src: str) -> KeyMap:
    """SimpleClassifier.logit_fc (Linear - GeLU - BertLayerNorm - Linear) -> our "mlp" classifier."""
    return {k: v for i in (0, 2, 3) for k, v in linear(f"{dst}.{i}", f"{src}.logit_fc.{i}").items()}


def pretraining_heads(source: HFSource) -> tuple[dict[str, HeadConfig], KeyMap, dict]:
    """BertPreTrainingHeads: masked LM, ITM (rows swapped), masked region classification."""
    heads = {"mlm": HeadConfig(kind="mlm"), "itm": HeadConfig(kind="itm"),
             "mrc": HeadConfig(kind="mrc", num_labels=source.rows("cls.imagePredictions.decoder.weight"), mrc_loss="kl")}
    keymap = linear("heads.mlm.transform.dense", "cls.predictions.transform.dense")
    keymap |= linear("heads.mlm.transform.LayerNorm", "cls.predictions.transform.LayerNorm")
    keymap["heads.mlm.bias"] = ["cls.predictions.bias"]
    source.tied("cls.predictions.decoder.weight", "bert.embeddings.word_embeddings.weight")
    for part in ("transform.dense", "transform.LayerNorm", "decoder"):
        keymap |= linear(f"heads.mrc.{part}", f"cls.imagePredictions.{part}")
    # the reference's label 0 is "the caption is the image's" (concept_cap_dataset.random_cap), ours is 1
    swapped = {}
    for t, rank in (("weight", 2), ("bias", 1)):
        swapped[f"heads.itm.seq_relationship.{t}"] = source.tensor(f"cls.bi_seq_relationship.{t}", rank).flip(0)
        source.used.add(f"cls.bi_seq_relationship.{t}")
    return heads, keymap, swapped


def chosen_tokens(source: HFSource, enc: EncoderConfig, tokens: dict[str, int] | None) -> dict[str, int]:
    """The task token of each head: TASK_TOKENS, with those `tokens` chooses (head -> another task id of the
    12-in-1 model's table, e.g. refer 10 for RefCOCO+); HFImportError naming a choice that cannot be."""
    chosen = dict(TASK_TOKENS)
    for head, task_id in (tokens or {}).items():
        if not enc.task_tokens:
            raise HFImportError(f"{source.weights_path}: --task-token {head}={task_id}: this model has no task tokens "
                                "(the 12-in-1 model, multi_task_model.bin, has)")
        if head not in chosen:
            raise HFImportError(f"--task-token {head}={task_id}: no head {head!r}; the heads are "
                                f"{', '.join(sorted(chosen))}")
        if not 0 <= task_id < enc.task_tokens:
            raise HFImportError(f"--task-token {head}={task_id}: the model's task ids are 0 to {enc.task_tokens - 1}")
        chosen[head] = task_id
    return chosen


def task_heads(source: HFSource, enc: EncoderConfig,
               tokens: dict[str, int] | None = None) -> tuple[dict[str, HeadConfig], KeyMap, dict]:
    """VILBertForVLTasks' heads with an endpoint, each with its task token when the model has a task table
    (TASK_TOKENS, or the one `tokens` chooses)."""
    chosen = chosen_tokens(source, enc, tokens)
    token = (lambda name: chosen[name]) if enc.task_tokens else (lambda name: -1)
    heads = {
        "vqa": HeadConfig(kind="vqa", num_labels=source.rows("vil_prediction.logit_fc.3.weight"), task_token=token("vqa")),
        "gqa": HeadConfig(kind="vqa", num_labels=source.rows("vil_prediction_gqa.logit_fc.3.weight"),
                          task_token=token("gqa")),
        "nlvr2": HeadConfig(kind="nlvr2", classifier_hidden=source.rows("vil_binary_prediction.logit_fc.0.weight"),
                            task_token=token("nlvr2")),
        "refer": HeadConfig(kind="refer", task_token=token("refer")),
        "rank": HeadConfig(kind="itm", task_token=token("rank")),
    }
    keymap = mlp("heads.vqa.cls", "vil_prediction") | mlp("heads.gqa.cls", "vil_prediction_gqa")
    keymap |= mlp("heads.nlvr2.cls", "vil_binary_prediction") | linear("heads.refer.score", "vision_logit")
    # one retrieval score s -> logits (0, s): "matches" minus "does not" is s
    w, b = source.tensor("vil_logit.weight"), source.tensor("vil_logit.bias", 1)
    rank = {"heads.rank.seq_relationship.weight": torch.cat([torch.zeros_like(w), w]),
            "heads.rank.seq_relationship.bias": torch.cat([torch.zeros_like(b), b])}
    source.used.update(("vil_logit.weight", "vil_logit.bias"))
    return heads, keymap, rank


def convert(source: HFSource, answers: Path | None = None,
            tokens: dict[str, int] | None = None) -> tuple[ModelConfig, dict, dict, str]:
    """Our config, tensors and labels from a vilbert-multi-task state dict, and the reference model it was saved from.
    `tokens`: head -> the task id it runs with, where not TASK_TOKENS' (12-in-1)."""
    check_format(source)
    encoder = build_encoder_config(source, "vilbert", encoder_fields(source))
    task_model = source.has("vil_prediction.logit_fc.0.weight")
    if tokens and not task_model:
        raise HFImportError(f"{source.weights_path}: --task-token: this model has no task heads (the 12-in-1 model, "
                            "multi_task_model.bin, has)")
    if task_model:
        heads, head_keys, built = task_heads(source, encoder, tokens)
        model = "VILBertForVLTasks"
    elif source.has("cls.predictions.bias"):
        heads, head_keys, built = pretraining_heads(source)
        model = "BertForMultiModalPreTraining"
    else:
        heads, head_keys, built, model = {}, {}, {}, "BertModel"
    config = ModelConfig(encoder=encoder, heads=heads)
    keymap = encoder_keymap(encoder) | head_keys
    hint = f" ({source.config_path} and the weights disagree?)"
    with torch.device("meta"):
        own = VLModel(config).state_dict()
    try:
        weights = source.take(keymap) | built
        source.check_shapes(own)
        for key, tensor in built.items():
            if tuple(tensor.shape) != tuple(own[key].shape):
                raise HFImportError(f"{source.weights_path}: {key} built with shape {tuple(tensor.shape)}, "
                                    f"the model needs {tuple(own[key].shape)}")
    except HFImportError as exc:
        raise HFImportError(exc.args[0] + hint) from None
    labels: dict = {"heads": {}}
    name_answers(source, heads, labels, answers)
    unused = unused_keys(source, encoder.num_cross_layers, task_model)
    source.used.update(k for k in unused if k in source.state)
    extra = source.ignored()
    if extra:  # the reference saves nothing else: another model's tensor is an error, not a warning
        raise HFImportError(f"{source.weights_path}: unexpected tensor {extra[0]} ({len(extra)} not part of {model})"
                            + hint)
    source.used -= unused  # listed as ignored in the manifest, by name
    return config, weights, labels, model


def import_vilbert(src: str | Path, out: str | Path, config: str | Path | None = None,
                   answers: Path | None = None, tokens: dict[str, int] | None = None) -> Path:
    """Convert a vilbert-multi-task .bin file into a vlserve checkpoint directory; returns `out`.
    `config`: its config json (default: beside the weights); `answers`: the VQA head's answer table; `tokens`: head
    -> the 12-in-1 task id it runs with, where not the default (TASK_TOKENS)."""
    source = read_vilbert(src, config)
    model_config, weights, labels, model = convert(source, answers, tokens)
    return write_checkpoint(source, out, model_config, weights, labels, FORMAT, model, answers)
