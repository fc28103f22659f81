"""Fixture for `vlserve import u-visualbert`: the weakly-supervised VisualBERT code (github.com/uclanlp/visualbert,
its unsupervised_visualbert directory: Li et al. 2021, "Unsupervised Vision-and-Language Pre-training Without
Parallel Images and Captions") at a tiny config.

    python scripts/reference_fixtures/u_visualbert.py REFERENCE [--commit SHA] [--out DIR]

REFERENCE is a checkout (or an archive) of uclanlp/visualbert; its unsupervised_visualbert directory is read, never
copied into vlserve. The script builds the reference's own models with the model flags of its published configs
(configs/pretrain/unsupervised.json, configs/vqa.json: a 12-layer VisualBERT-style stack, hybrid embeddings, detector
tags embedded with the word table, each tag sub-word a token with its region's box), with seeded random weights,
saves them as its code saves them, runs them on fixed inputs (padded text, padded regions, boxes, padded tags) and
writes into DIR (default tests/fixtures/u_visualbert):
  vqa.pth                a fine-tuned VQAModel(7 answers).state_dict() as src/tasks/vqa.py saves it after --multiGPU
                         (lxrt_encoder.model.module.bert.module.* and logit_fc.*), the published snap/vqa.pth layout
  pretrained_LXRT.pth    nn.DataParallel(LXRTPretraining).state_dict() (`module.` keys) as src/pretrain/lxmert_pretrain.py
                         builds and saves it (LXMERT.__init__, LXMERT.save), the published CC_Unsupervised_LXRT.pth
                         layout: masked LM, ITM, object/attribute/feature heads, the symbolic tag head
  nlvr2_LXRT.pth         the same model with lxmert_style_nlvr (its NLVR2 setting: two passes per statement, the pooled
                         vectors concatenated into cls.seq_relationship_new)
  bert_config.json       the tiny BertConfig, written by the reference's BertConfig.to_json_string
  vocab.txt              a tiny vocabulary with bert-base-uncased's special ids; "rectangle" and "triangle" are two
                         sub-words each, "circle" one (the tiny test detector's classes)
  label2ans.json         the VQA head's answers: the first 7 of the reference's data/vqa/trainval_label2ans.json
  reference.safetensors  inputs of two padded shapes (`a.*`, `b.*`) and the reference's outputs of every head on them
                         (`{a,b}.{vqa,pretrained,nlvr2}.*`); tags as the reference takes them (flat sub-word lists per
                         example, each with its region's box) and as vlserve takes them (tag_ids (B, N, K), -1 = none)
  reference.json         repository, commit, sha256 of every reference file used, the configs
  manifest_full.json     key -> shape of the three files at full size (bert-base-uncased, 12 layers, 2048-d regions,
                         3129 VQA answers, the 2003-word symbolic tag vocabulary), from the reference's module tree
"""
from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
import types
from pathlib import Path

os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the reference's DataParallel stays on the CPU (and accepts meta modules)

import torch  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: reference_fixtures.common
from reference_fixtures.common import (  # noqa: E402
    CLS, arguments, padded_text_and_boxes, provenance, randomize, save_tensors, shapes, stub_s3, use_bert,
    write_record, write_vocab,
)

REPOSITORY = "uclanlp/visualbert"
SUBDIR = "unsupervised_visualbert"
USED_FILES = (  # the reference files this fixture comes from (hashed into reference.json)
    "src/param.py", "src/lxrt/modeling.py", "src/lxrt/entry.py", "src/tasks/vqa_model.py", "src/tasks/vqa.py",
    "src/pretrain/lxmert_pretrain.py", "src/pretrain/lxmert_data.py", "src/pretrain/tag_data_utilis.py",
    "src/lxrt/symbolic_vocabulary.py", "configs/pretrain/unsupervised.json", "configs/vqa.json",
    "data/vqa/trainval_label2ans.json",
)
# the flags its modules read while building or running the model: both published configs must agree on them
MODEL_FLAGS = (
    "visualbert_style", "hybrid_embedding", "joint_layer_norm", "use_segment_embedding_for_vision_and_tag",
    "use_bert_input_for_tags", "disable_divide_2", "use_tag_symbolic_embedding", "llayers", "xlayers", "rlayers",
)
TINY_BERT = dict(  # BertConfig fields; widths that no two roles share, so a transposed or swapped tensor shows
    vocab_size_or_config_json_file=128, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
    intermediate_size=40, max_position_embeddings=24, type_vocab_size=2,
)
TINY_LAYERS, FULL_LAYERS = 2, 12
VQA_ANSWERS, FULL_VQA_ANSWERS = 7, 3129
FEAT_DIM = 2048  # the feature head regresses 2048 values whatever the features (VisualConfig.visual_loss_config)
TINY_SYMBOLS = 11  # the symbolic tag vocabulary at the tiny size ([CLS], [SEP], [MASK], attributes, objects: 2003 full)
FULL_SYMBOLS = 2003
# two padded shapes: (batch, text length, regions, sub-words per region); per row: text length, regions
SHAPES = {
    "a": dict(batch=3, text=8, regions=5, subwords=2, text_lengths=(8, 6, 4), region_counts=(5, 4, 2)),
    "b": dict(batch=2, text=11, regions=7, subwords=3, text_lengths=(5, 11), region_counts=(7, 3)),
}
CLASS_WORDS = ["circle", "rect", "##angle", "tri", "yes", "no", "red", "blue"]  # after the special tokens
SEED = 0


def read_commented_json(path: Path) -> dict:
    """The reference's configs are JSON with // comments (it reads them with commentjson)."""
    text = re.sub(r"//[^\n]*", "", path.read_text())
    return json.loads(text)


def reference_args(reference: Path) -> dict:
    """The pretraining config's arguments, checked to build the same model as the VQA config's."""
    pretrain = read_commented_json(reference / SUBDIR / "configs/pretrain/unsupervised.json")
    vqa = read_commented_json(reference / SUBDIR / "configs/vqa.json")
    differ = [f for f in MODEL_FLAGS if pretrain.get(f, False) != vqa.get(f, False)]  # the code reads False if absent
    if differ:
        sys.exit(f"the reference's pretraining and VQA configs build different models ({', '.join(differ)})")
    return pretrain | {"llayers": TINY_LAYERS}


def import_reference(reference: Path, args: dict, workdir: Path):
    """The reference's modules, importable offline. Its argument parser (src/param.py) reads a config file, as its
    commands pass one (--config); commentjson and attrdict, which it imports for that, are replaced by equivalents
    (JSON with comments; a dict with attribute access); its S3 downloader's imports are stubbed (never called);
    from_pretrained builds the chosen BertConfig instead of downloading bert-base-uncased (every weight is replaced
    by seeded values); and LXRTEncoder.dim, which the reference fixes at BERT-base's 768, is that config's width."""
    stub_s3("requests")
    commentjson = types.ModuleType("commentjson")
    commentjson.load = lambda f: json.loads(re.sub(r"//[^\n]*", "", f.read()))
    sys.modules["commentjson"] = commentjson

    class AttrDict(dict):
        def __getattr__(self, name):
            try:
                return self[name]
            except KeyError:
                raise AttributeError(name) from None

        def __setattr__(self, name, value):
            self[name] = value

    attrdict = types.ModuleType("attrdict")
    attrdict.AttrDict = AttrDict
    sys.modules["attrdict"] = attrdict
    config = workdir / "config.json"
    config.write_text(json.dumps(args))
    sys.path.insert(0, str(reference / SUBDIR / "src"))
    sys.argv = [sys.argv[0], "--config", str(config), "--output", str(workdir / "snap")]
    stdout = sys.stdout
    try:
        import param  # parses the arguments, logs into --output and tees stdout there
    finally:
        sys.stdout = stdout
    from lxrt import entry, modeling
    from tasks import vqa_model

    entry.BertTokenizer.from_pretrained = classmethod(lambda cls, *a, **k: None)  # ids are given, never tokenized
    entry.LXRTEncoder.dim = property(lambda self: self.model.config.hidden_size)
    return param.args, modeling, vqa_model


def build_vqa(modeling, vqa_model, answers: int) -> nn.Module:
    """VQA.__init__ of src/tasks/vqa.py with --multiGPU (the README's command): both DataParallel wrappings."""
    modeling.VISUAL_CONFIG.set_visual_dims(FEAT_DIM, 4)
    model = vqa_model.VQAModel(answers)
    model.lxrt_encoder.multi_gpu()
    model.multi_gpu()
    return model


def build_pretraining(modeling, args, symbols: list[list[int]] | None, nlvr2: bool) -> nn.Module:
    """LXMERT.__init__ of src/pretrain/lxmert_pretrain.py (its config's tasks), then its --multiGPU wrapping.
    `symbols`: the sub-word ids of each symbolic tag word (SymbolicVocab.get_symbolic_list), None to keep the
    symbolic embedding's built size (the meta-device manifest: 2003 = that vocabulary's full size)."""
    modeling.VISUAL_CONFIG.set_visual_dims(FEAT_DIM, 4)
    args["lxmert_style_nlvr"] = nlvr2
    model = modeling.LXRTPretraining.from_pretrained(
        "bert-base-uncased", args=args, task_mask_lm=args.task_mask_lm, task_obj_predict=args.task_obj_predict,
        task_matched=args.task_matched, task_qa=args.task_qa, visual_losses=args.visual_losses,
        num_answers=int(args.num_answers),
    )
    if args.get("use_tag_symbolic_embedding", False):
        if symbols is not None:
            model.bert.embeddings.initialize_symbolic_embeddings(symbols)
        model.special_initialize_pretraining_head()
    if args.get("hybrid_embedding", False):
        model.bert.embeddings.initialize_visual_position_type_embeddings()
    return nn.DataParallel(model)


def inputs(shape: dict, vocab_size: int, seed: int) -> dict[str, torch.Tensor]:
    """Padded text, regions and tags. Tags: each real region's class name as 1..K sub-words (ours: tag_ids
    (B, N, K), -1 = none) and as the reference takes them: per example the sub-words region by region, each with
    its region's box, padded with id 0 and mask 0 (lxrt.entry.convert_tags_to_tensorts)."""
    g = torch.Generator().manual_seed(seed)
    b, t, n, k = shape["batch"], shape["text"], shape["regions"], shape["subwords"]
    ids, text_mask, region_mask, boxes = padded_text_and_boxes(g, vocab_size, b, t, n, shape["text_lengths"],
                                                                shape["region_counts"])
    lengths = torch.randint(1, k + 1, (b, n), generator=g) * region_mask  # sub-words of each region's tag
    words = torch.randint(CLS + 3, vocab_size, (b, n, k), generator=g)
    tag_ids = torch.where(torch.arange(k) < lengths[..., None], words, torch.full_like(words, -1))
    flat = [tag_ids[i][tag_ids[i] >= 0] for i in range(b)]  # region by region, sub-word by sub-word
    owner = [torch.arange(n).repeat_interleave(lengths[i]) for i in range(b)]
    width = max(len(f) for f in flat)
    ref_tags = torch.zeros(b, width, dtype=torch.long)
    ref_tags_mask = torch.zeros(b, width, dtype=torch.long)
    ref_tags_box = torch.zeros(b, width, 4)
    for i in range(b):
        ref_tags[i, : len(flat[i])] = flat[i]
        ref_tags_mask[i, : len(flat[i])] = 1
        ref_tags_box[i, : len(flat[i])] = boxes[i, owner[i]]
    return {
        "input_ids": ids,
        "attention_mask": text_mask,
        "token_type_ids": torch.randint(0, 2, (b, t), generator=g) * text_mask,  # the reference ignores segments
        "region_features": torch.randn(b, n, FEAT_DIM, generator=g),
        "region_boxes": boxes,
        "region_mask": region_mask,
        "tag_ids": tag_ids,
        "ref_tags": ref_tags,
        "ref_tags_mask": ref_tags_mask,
        "ref_tags_box": ref_tags_box,
    }


def run_bert(bert: nn.Module, x: dict[str, torch.Tensor]):
    """LXRTModel.forward as VQAModel.forward and LXMERT.forward call it, with the padded regions' mask given (the
    reference builds an all-ones one when none is passed, attending to padding)."""
    return bert(x["input_ids"], x["token_type_ids"], x["attention_mask"],
                visual_feats=(x["region_features"], x["region_boxes"]), visual_attention_mask=x["region_mask"],
                visual_tags=x["ref_tags"], visual_tags_mask=x["ref_tags_mask"], visual_tags_box=x["ref_tags_box"])


@torch.no_grad()
def vqa_outputs(model: nn.Module, x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """VQAModel.forward after its tokenizing and padding: lxrt_encoder.model.module.bert(...) then logit_fc."""
    _, pooled = run_bert(model.lxrt_encoder.model.module.bert, x)
    return {"vqa": model.logit_fc(pooled)}


@torch.no_grad()
def pretraining_outputs(wrapped: nn.Module, args, x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What LXRTPretraining.forward computes before its losses: every head's scores. Tags are decoded by `cls` (the
    masked-LM head), as its tag objective does with use_bert_input_for_tags."""
    model = wrapped.module
    args["lxmert_style_nlvr"] = False
    (lang, tags, visn), pooled = run_bert(model.bert, x)
    mlm, itm = model.cls(lang, pooled)
    tag_scores, _ = model.cls(tags, tags[:, 0], calculate_seq_score=False)
    objects = model.obj_predict_head(visn)
    return {"mlm": mlm, "itm": itm, "tag": tag_scores, "mrc": objects["obj"], "attr": objects["attr"],
            "mrfr": objects["feat"]}


@torch.no_grad()
def nlvr2_outputs(wrapped: nn.Module, args, x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """lxmert_style_nlvr: every statement twice, once per image (lxmert_data's custom_collact_fn interleaves them),
    the two pooled vectors concatenated (LXRTPretraining.forward) into cls.seq_relationship_new. The fixture's rows
    pair up as the images: row 2i with row 2i+1's regions, the text of row 2i for both."""
    model = wrapped.module
    args["lxmert_style_nlvr"] = True
    pair = dict(x)
    for key in ("input_ids", "token_type_ids", "attention_mask"):
        pair[key] = x[key][0::2].repeat_interleave(2, dim=0)
    rows = 2 * (x["input_ids"].shape[0] // 2)
    pair = {k: v[:rows] for k, v in pair.items()}
    (lang, _, _), pooled = run_bert(model.bert, pair)
    pooled = pooled.view(pooled.size(0) // 2, 2 * pooled.size(-1))
    _, nlvr2 = model.cls(lang, pooled)
    args["lxmert_style_nlvr"] = False
    return {"nlvr2": nlvr2}


def main() -> None:
    opts = arguments(__doc__, "uclanlp/visualbert checkout or archive", "u_visualbert").parse_args()
    reference = opts.reference.resolve()
    record = provenance(reference, opts.commit, REPOSITORY, USED_FILES, SUBDIR)
    workdir = Path(tempfile.mkdtemp(prefix="u_visualbert_reference_"))  # the reference's --output (its run log)
    try:
        args, modeling, vqa_model = import_reference(reference, reference_args(reference), workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    out = opts.out
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)

    # tiny models: weights in the reference's file format, and its outputs
    vocab = TINY_BERT["vocab_size_or_config_json_file"]
    use_bert(modeling, **TINY_BERT)
    g = torch.Generator().manual_seed(SEED)
    symbols = [torch.randint(CLS + 3, vocab, (int(torch.randint(1, 3, (1,), generator=g)),), generator=g).tolist()
               for _ in range(TINY_SYMBOLS)]
    vqa = randomize(build_vqa(modeling, vqa_model, VQA_ANSWERS), SEED)
    pretrained = randomize(build_pretraining(modeling, args, symbols, nlvr2=False), SEED + 1)
    nlvr2 = randomize(build_pretraining(modeling, args, symbols, nlvr2=True), SEED + 2)
    torch.save(vqa.state_dict(), out / "vqa.pth")
    torch.save(pretrained.state_dict(), out / "pretrained_LXRT.pth")
    torch.save(nlvr2.state_dict(), out / "nlvr2_LXRT.pth")
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in SHAPES.items():
        x = inputs(shape, vocab, SEED + 10 + ord(name))
        outputs = {f"vqa.{k}": v for k, v in vqa_outputs(vqa, x).items()}
        outputs |= {f"pretrained.{k}": v for k, v in pretraining_outputs(pretrained, args, x).items()}
        outputs |= {f"nlvr2.{k}": v for k, v in nlvr2_outputs(nlvr2, args, x).items()}
        tensors |= {f"{name}.{k}": v for k, v in {**x, **outputs}.items()}
    save_tensors(tensors, out / "reference.safetensors")
    (out / "bert_config.json").write_text(vqa.lxrt_encoder.model.module.config.to_json_string())
    write_vocab(out / "vocab.txt", vocab, CLASS_WORDS)
    label2ans = json.loads((reference / SUBDIR / "data/vqa/trainval_label2ans.json").read_text())[:VQA_ANSWERS]
    (out / "label2ans.json").write_text(json.dumps(label2ans))

    # full size: the key and shape of every tensor, from modules built without memory
    use_bert(modeling, vocab_size_or_config_json_file=30522)  # bert-base-uncased's bert_config.json
    args["llayers"] = modeling.VISUAL_CONFIG.l_layers = FULL_LAYERS
    with torch.device("meta"):
        full = {"vqa.pth": shapes(build_vqa(modeling, vqa_model, FULL_VQA_ANSWERS)),
                "pretrained_LXRT.pth": shapes(build_pretraining(modeling, args, None, nlvr2=False)),
                "nlvr2_LXRT.pth": shapes(build_pretraining(modeling, args, None, nlvr2=True))}
    symbolic = full["pretrained_LXRT.pth"]["module.bert.embeddings.symbolic_embedding.weight"][0]
    assert symbolic == FULL_SYMBOLS, symbolic
    (out / "manifest_full.json").write_text(json.dumps(full, indent=0) + "\n")

    record |= {"tiny": {"bert": TINY_BERT, "layers": TINY_LAYERS, "vqa_answers": VQA_ANSWERS,
                        "symbolic_words": TINY_SYMBOLS, "shapes": SHAPES},
               "full": {"layers": FULL_LAYERS, "vqa_answers": FULL_VQA_ANSWERS, "symbolic_words": FULL_SYMBOLS},
               "model_flags": {f: args.get(f) for f in MODEL_FLAGS},
               "torch": torch.__version__, "generator": "scripts/reference_fixtures/u_visualbert.py"}
    write_record(out, record)


if __name__ == "__main__":
    main()
