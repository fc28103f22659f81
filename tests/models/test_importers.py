"""`vlserve import hf-visualbert|hf-lxmert`: parity with transformers' VisualBert*/Lxmert* classes, and clear errors.

Each transformers model is tiny, has random weights everywhere (LayerNorm included), is saved with
save_pretrained, imported through the CLI and loaded with load_checkpoint; its logits must equal ours within
1e-5 (fp32, eval) on batches with padded text and padded regions.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from models import VLInputs
from models.checkpoint import CheckpointError, load_checkpoint, load_state_strict
from tests.models.reference_checks import import_checkpoint as imported, max_diff, run_import as cli

import transformers  # pinned test dependency

ATOL = 1e-5
SEEDS = (0, 1, 2)  # one padded batch per seed
TINY_BERT = dict(vocab_size=30522, hidden_size=32, num_attention_heads=4, intermediate_size=64, max_position_embeddings=64)
VISUAL_DIM = 16


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models gain nothing from threads, and on a busy 2-core machine spinning threads cost seconds."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@torch.no_grad()
def randomize(model: nn.Module, seed: int = 0) -> nn.Module:
    """Non-trivial random values in every parameter: LayerNorm weights around 1, everything else around 0."""
    g = torch.Generator().manual_seed(seed)
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            noise = 0.2 * torch.randn(p.shape, generator=g)
            p.copy_(1 + noise if isinstance(module, nn.LayerNorm) and name == "weight" else noise)
    return model.eval()


def save_hf(model: nn.Module, path: Path, *, bin_extra: dict[str, torch.Tensor] | None = None) -> Path:
    """save_pretrained (safetensors); with bin_extra, a pytorch_model.bin state dict (old format) instead."""
    model.save_pretrained(path)
    if bin_extra is not None:
        (path / "model.safetensors").unlink()
        torch.save({**model.state_dict(), **bin_extra}, path / "pytorch_model.bin")
    return path


def visualbert_kwargs(x: VLInputs) -> dict[str, torch.Tensor]:
    return dict(input_ids=x.input_ids, attention_mask=x.attention_mask, token_type_ids=x.token_type_ids,
                visual_embeds=x.region_features, visual_attention_mask=x.region_mask)


def joint_regions(x: VLInputs) -> VLInputs:
    """NLVR2 image pairs (B, 2, N, ...) as transformers' VisualBERT takes them: one sequence of 2N regions."""
    b, _, n, d = x.region_features.shape
    return x.replace(region_features=x.region_features.reshape(b, 2 * n, d), region_mask=x.region_mask.reshape(b, 2 * n))


def lxmert_kwargs(x: VLInputs) -> dict[str, torch.Tensor]:
    return dict(input_ids=x.input_ids, attention_mask=x.attention_mask, token_type_ids=x.token_type_ids,
                visual_feats=x.region_features, visual_pos=x.region_boxes, visual_attention_mask=x.region_mask)


def visualbert(cls_name: str, **config):
    cfg = transformers.VisualBertConfig(**TINY_BERT, num_hidden_layers=2, visual_embedding_dim=VISUAL_DIM, **config)
    return randomize(getattr(transformers, cls_name)(cfg))


def lxmert(cls_name: str, **config):
    cfg = transformers.LxmertConfig(**TINY_BERT, l_layers=2, r_layers=1, x_layers=2, visual_feat_dim=VISUAL_DIM, **config)
    return randomize(getattr(transformers, cls_name)(cfg))


def manifest_import(path: Path) -> dict:
    return json.loads((path / "manifest.json").read_text())["import"]


# ---- parity -------------------------------------------------------------------------------------------------


def test_visualbert_vqa_parity(tmp_path, make_batch):
    hf = visualbert("VisualBertForQuestionAnswering", num_labels=7, id2label={i: f"ans{i}" for i in range(7)})
    ckpt = imported("hf-visualbert", save_hf(hf, tmp_path / "hf"), tmp_path / "ours")
    assert ckpt.model.config.heads["vqa"].pool == "answer_slot"
    # trained through a softmax over the answers (transformers' loss: KL divergence of its log-softmax to the soft
    # scores, checked below), so a softmax scores it
    assert ckpt.model.config.heads["vqa"].score == "softmax"
    assert ckpt.labels["heads"]["vqa"] == [f"ans{i}" for i in range(7)]
    assert manifest_import(tmp_path / "ours")["ignored_keys"] == []
    with torch.no_grad():
        for seed in SEEDS:
            x = make_batch(ckpt.model.config.encoder, batch=3, seed=seed)
            assert max_diff(ckpt.model(x, "vqa").logits, hf(**visualbert_kwargs(x)).logits) < ATOL
        soft = torch.rand(3, 7)
        soft /= soft.sum(-1, keepdim=True)
        trained = hf(**visualbert_kwargs(x), labels=soft).loss
        as_softmax = nn.functional.kl_div(ckpt.model(x, "vqa").logits.log_softmax(-1), soft, reduction="batchmean")
        assert abs(trained.item() - as_softmax.item()) < ATOL


def test_visualbert_nlvr2_parity(tmp_path, make_batch):
    hf = visualbert("VisualBertForVisualReasoning", num_labels=2)
    ckpt = imported("hf-visualbert", save_hf(hf, tmp_path / "hf"), tmp_path / "ours")
    assert ckpt.model.config.heads["nlvr2"].nlvr2_mode == "joint"
    with torch.no_grad():
        for seed in SEEDS:
            x = make_batch(ckpt.model.config.encoder, batch=3, pairs=True, seed=seed)  # regions (B, 2, N, D)
            assert max_diff(ckpt.model(x, "nlvr2").logits, hf(**visualbert_kwargs(joint_regions(x))).logits) < ATOL


def test_visualbert_multiple_choice_parity(tmp_path, make_batch):
    hf = visualbert("VisualBertForMultipleChoice")
    ckpt = imported("hf-visualbert", save_hf(hf, tmp_path / "hf"), tmp_path / "ours")
    with torch.no_grad():
        for seed in SEEDS:
            x = make_batch(ckpt.model.config.encoder, batch=2, choices=3, seed=seed)  # text (B, C, T)
            per_choice = lambda t: t[:, None].expand(-1, 3, *t.shape[1:]).contiguous()  # noqa: E731
            theirs = hf(**visualbert_kwargs(x.replace(region_features=per_choice(x.region_features),
                                                      region_mask=per_choice(x.region_mask)))).logits
            assert max_diff(ckpt.model(x, "multiple_choice").logits, theirs) < ATOL


def test_visualbert_pretraining_bin_parity(tmp_path, make_batch):
    """pytorch_model.bin (weights_only) with the tied decoder saved and an old position_ids buffer."""
    hf = visualbert("VisualBertForPreTraining")
    stray = {"visual_bert.embeddings.position_ids": torch.arange(64)[None]}
    src = save_hf(hf, tmp_path / "hf", bin_extra=stray)
    ckpt = imported("hf-visualbert", src, tmp_path / "ours")
    record = manifest_import(tmp_path / "ours")
    assert record["weights_file"] == "pytorch_model.bin"
    assert record["ignored_keys"] == ["visual_bert.embeddings.position_ids"]
    assert set(ckpt.model.config.heads) == {"mlm", "itm"}
    with torch.no_grad():
        for seed in SEEDS:
            x = make_batch(ckpt.model.config.encoder, batch=3, seed=seed)
            out = hf(**visualbert_kwargs(x))
            t = x.input_ids.shape[1]
            real = x.attention_mask.bool()  # padded words: ours runs no layer on them (models.layers.Packing)
            assert max_diff(ckpt.model(x, "mlm").logits[real], out.prediction_logits[:, :t][real]) < ATOL
            assert max_diff(ckpt.model(x, "itm").logits, out.seq_relationship_logits) < ATOL


def test_sharded_checkpoint_imports_like_a_single_file(tmp_path, make_batch):
    hf = visualbert("VisualBertForVisualReasoning", num_labels=2)
    hf.save_pretrained(tmp_path / "hf", max_shard_size="1MB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    ckpt = imported("hf-visualbert", tmp_path / "hf", tmp_path / "ours")
    assert manifest_import(tmp_path / "ours")["weights_file"] == "model.safetensors.index.json"
    x = make_batch(ckpt.model.config.encoder, batch=2, pairs=True)
    with torch.no_grad():
        assert max_diff(ckpt.model(x, "nlvr2").logits, hf(**visualbert_kwargs(joint_regions(x))).logits) < ATOL


def test_visualbert_region_to_phrase_parity(tmp_path, make_batch):
    hf = visualbert("VisualBertForRegionToPhraseAlignment")
    ckpt = imported("hf-visualbert", save_hf(hf, tmp_path / "hf"), tmp_path / "ours")
    assert set(ckpt.model.config.heads) == {"mlm", "itm", "grounding"}
    assert manifest_import(tmp_path / "ours")["ignored_keys"] == ["attention.value.bias", "attention.value.weight"]
    with torch.no_grad():
        for seed in SEEDS:
            x = make_batch(ckpt.model.config.encoder, batch=3, seed=seed)
            theirs = hf(**visualbert_kwargs(x), region_to_phrase_position=x.phrase_index).logits  # (B, P, N)
            ours = ckpt.model(x, "grounding").logits
            real = x.region_mask[:, None, :].expand_as(ours).bool()  # padded regions: both far below any real score
            assert max_diff(ours[real], theirs[real]) < ATOL


def test_lxmert_vqa_parity(tmp_path, make_batch):
    hf = lxmert("LxmertForQuestionAnswering", num_qa_labels=6)
    ckpt = imported("hf-lxmert", save_hf(hf, tmp_path / "hf"), tmp_path / "ours")
    assert ckpt.labels["heads"]["vqa"] == [str(i) for i in range(6)]  # no id2label for the 6 answers: numbered
    assert manifest_import(tmp_path / "ours")["ignored_keys"] == []
    with torch.no_grad():
        for seed in SEEDS:
            x = make_batch(ckpt.model.config.encoder, batch=3, seed=seed)
            assert max_diff(ckpt.model(x, "vqa").logits, hf(**lxmert_kwargs(x)).question_answering_score) < ATOL


def test_lxmert_pretraining_parity(tmp_path, make_batch):
    hf = lxmert("LxmertForPreTraining", num_qa_labels=5, num_object_labels=7, num_attr_labels=3)
    ckpt = imported("hf-lxmert", save_hf(hf, tmp_path / "hf"), tmp_path / "ours")
    assert set(ckpt.model.config.heads) == {"mlm", "itm", "image_qa", "mrc", "mrfr"}
    ignored = manifest_import(tmp_path / "ours")["ignored_keys"]
    assert ignored == ["obj_predict_head.decoder_dict.attr.bias", "obj_predict_head.decoder_dict.attr.weight"]
    with torch.no_grad():
        for seed in SEEDS:
            x = make_batch(ckpt.model.config.encoder, batch=3, seed=seed)
            out = hf(**lxmert_kwargs(x), output_hidden_states=True)
            objects = hf.obj_predict_head(out.vision_hidden_states[-1])
            assert max_diff(ckpt.model(x, "mlm").logits, out.prediction_logits) < ATOL
            assert max_diff(ckpt.model(x, "itm").logits, out.cross_relationship_score) < ATOL
            assert max_diff(ckpt.model(x, "image_qa").logits, out.question_answering_score) < ATOL
            assert max_diff(ckpt.model(x, "mrc").logits, objects["obj"]) < ATOL
            assert max_diff(ckpt.model(x, "mrfr").logits, objects["feat"]) < ATOL


# ---- errors: exit code 2, one line naming the file, no traceback --------------------------------------------


@pytest.fixture(scope="module")
def good_src(tmp_path_factory) -> Path:
    return save_hf(visualbert("VisualBertForQuestionAnswering", num_labels=3), tmp_path_factory.mktemp("good") / "hf")


@pytest.fixture(scope="module")
def good_lxmert(tmp_path_factory) -> Path:
    return save_hf(lxmert("LxmertForQuestionAnswering", num_qa_labels=3), tmp_path_factory.mktemp("good") / "hf")


def copy_src(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def bad(src: Path, tmp_path: Path) -> Path:
    return copy_src(src, tmp_path / "bad")


def corrupt_config(edit):
    def make(src, tmp_path):
        path = bad(src, tmp_path)
        cfg = json.loads((path / "config.json").read_text())
        edit(cfg)
        (path / "config.json").write_text(json.dumps(cfg))
        return path
    return make


def drop_tensor(src, tmp_path):
    from safetensors.torch import load_file, save_file

    path = bad(src, tmp_path)
    state = load_file(path / "model.safetensors")
    del state["visual_bert.encoder.layer.1.attention.self.key.weight"]
    save_file(state, path / "model.safetensors")
    return path


def pickled_object(src, tmp_path):
    path = bad(src, tmp_path)
    (path / "model.safetensors").unlink()
    torch.save({"weights": Path("not a tensor")}, path / "pytorch_model.bin")  # weights_only refuses to unpickle it
    return path


class _RunsACommand:
    """Unpickled, it would call os.system; weights_only refuses its module outright."""

    def __reduce__(self):
        return os.system, ("true",)


def pickled_call(src, tmp_path):
    path = bad(src, tmp_path)
    (path / "model.safetensors").unlink()
    torch.save({"weights": torch.zeros(2), "payload": _RunsACommand()}, path / "pytorch_model.bin")
    return path


def write_text(name: str, text: str | bytes):
    def make(src, tmp_path):
        path = bad(src, tmp_path)
        (path / name).write_bytes(text.encode() if isinstance(text, str) else text)
        return path
    return make


def shard_index(text: str | bytes):
    """The weights as a sharded checkpoint whose model.safetensors.index.json holds `text`."""
    def make(src, tmp_path):
        path = write_text("model.safetensors.index.json", text)(src, tmp_path)
        (path / "model.safetensors").unlink()
        return path
    return make


def edit_weights(edit, bin_file: bool = False):
    """The weights after `edit` of their state dict, as model.safetensors (or pytorch_model.bin: complex tensors)."""
    def make(src, tmp_path):
        from safetensors.torch import load_file, save_file

        path = bad(src, tmp_path)
        state = load_file(path / "model.safetensors")
        edit(state)
        if bin_file:
            (path / "model.safetensors").unlink()
            torch.save(state, path / "pytorch_model.bin")
        else:
            save_file(state, path / "model.safetensors")
        return path
    return make


def set_tensor(key: str, value, bin_file: bool = False):
    """The weights with tensor `key` replaced by value(the tensor)."""
    return edit_weights(lambda state: state.update({key: value(state[key])}), bin_file)


def two_shards(edit):
    """The weights as two safetensors shards (keys alternating) and their index, after edit(shard 1, shard 2,
    weight_map)."""
    def make(src, tmp_path):
        from safetensors.torch import load_file, save_file

        path = bad(src, tmp_path)
        state = load_file(path / "model.safetensors")
        (path / "model.safetensors").unlink()
        keys = sorted(state)
        first, second = {k: state[k] for k in keys[::2]}, {k: state[k] for k in keys[1::2]}
        weight_map = {k: SHARDS[0] for k in first} | {k: SHARDS[1] for k in second}
        edit(first, second, weight_map)
        save_file(first, path / SHARDS[0])
        save_file(second, path / SHARDS[1])
        (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
        return path
    return make


SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
LFS_POINTER = "version https://git-lfs.github.com/spec/v1\noid sha256:4d7a\nsize 913000000\n"
HTML_PAGE = "<!DOCTYPE html><html><body>Access denied</body></html>\n"
DEEP_JSON = "[" * 100_000 + "]" * 100_000  # deeper than Python's json parser recurses
QUERY, KEY = "visual_bert.encoder.layer.0.attention.self.query", "visual_bert.encoder.layer.0.attention.self.key"


def with_tokenizer_config(text: str):
    """A vocab.txt (bert-base-uncased's) beside the weights, and a tokenizer_config.json holding `text`."""
    def make(src, tmp_path):
        from models.tokenizer import VLTokenizer

        path = write_text("tokenizer_config.json", text)(src, tmp_path)
        (path / "vocab.txt").write_bytes(Path(VLTokenizer.pretrained_minilm().vocab_file).read_bytes())
        return path
    return make


def shard_index_free(name: str, text: str):
    """The weights replaced by `name` holding `text` (the safetensors file removed)."""
    def make(src, tmp_path):
        path = write_text(name, text)(src, tmp_path)
        (path / "model.safetensors").unlink()
        return path
    return make


def drop_layer(stack: str):
    """The weights without any tensor of layer `stack` (`...encoder.layer.0`), the layers above it kept."""
    def make(src, tmp_path):
        from safetensors.torch import load_file, save_file

        path = bad(src, tmp_path)
        state = load_file(path / "model.safetensors")
        save_file({k: v for k, v in state.items() if not k.startswith(f"{stack}.")}, path / "model.safetensors")
        return path
    return make


def remove(name: str):
    def make(src, tmp_path):
        path = bad(src, tmp_path)
        (path / name).unlink()
        return path
    return make


ERRORS = {
    "not a directory": (lambda src, tmp: tmp / "nowhere", "not a directory"),
    "no weights file": (remove("model.safetensors"), "no weights file"),
    "no config": (remove("config.json"), "missing file config.json"),
    "malformed config": (write_text("config.json", "{not json"), "config.json: invalid JSON"),
    "config field type": (corrupt_config(lambda c: c.update(hidden_size="big")), "config.json: field 'hidden_size'"),
    "unsupported architecture": (corrupt_config(lambda c: c.update(architectures=["VisualBertForSomething"])),
                                 "config.json: unsupported architecture 'VisualBertForSomething'"),
    "other model type": (corrupt_config(lambda c: c.update(model_type="bert")), "config.json: model_type is 'bert'"),
    "ambiguous classifier": (corrupt_config(lambda c: c.pop("architectures")), "config.json: field 'architectures' is missing"),
    "missing tensor": (drop_tensor, "model.safetensors: source checkpoint lacks visual_bert.encoder.layer.1.attention.self.key.weight"),
    "corrupt weights": (write_text("model.safetensors", "garbage"), "model.safetensors: unreadable weights"),
    "unsafe pickle": (pickled_object, "pytorch_model.bin: unreadable weights: the pickle holds pathlib.PosixPath"),
    "pickle calling a command": (pickled_call, "pytorch_model.bin: unreadable weights: the pickle holds posix.system, "
                                               "not only tensors"),
    "negative width": (corrupt_config(lambda c: c.update(hidden_size=-32)), "config.json: hidden_size=-32 must be at least 1"),
    "no attention heads": (corrupt_config(lambda c: c.update(num_attention_heads=0)), "config.json: num_heads=0 must be at least 1"),
    "dropout above 1": (corrupt_config(lambda c: c.update(hidden_dropout_prob=5)),
                        "config.json: dropout=5.0 is not a probability in [0, 1]"),
    "negative attention dropout": (corrupt_config(lambda c: c.update(attention_probs_dropout_prob=-1)),
                                   "config.json: attention_dropout=-1.0 is not a probability in [0, 1]"),
    "fewer layers than the weights": (corrupt_config(lambda c: c.update(num_hidden_layers=1)),
                                      "config.json: num_hidden_layers is 1, but the weights have 2 (visual_bert.encoder.layer.*)"),
    "more layers than the weights": (corrupt_config(lambda c: c.update(num_hidden_layers=3)),
                                     "config.json: num_hidden_layers is 3, but the weights have 2 (visual_bert.encoder.layer.*)"),
    "a billion layers": (corrupt_config(lambda c: c.update(num_hidden_layers=10**9)),  # refused before any layer is built
                         "config.json: num_hidden_layers is 1000000000, but the weights have 2 (visual_bert.encoder.layer.*)"),
    "weights without a lower layer": (drop_layer("visual_bert.encoder.layer.0"),
                                      "model.safetensors: tensors of visual_bert.encoder.layer.1 but none of visual_bert.encoder.layer.0"),
    "shard index naming a number": (shard_index(json.dumps({"weight_map": {"visual_bert.pooler.dense.weight": 3}})),
                                    "model.safetensors.index.json: not a valid shard index (weight_map gives 3, not a file name"),
    "shard index naming a file elsewhere": (
        shard_index(json.dumps({"weight_map": {"visual_bert.pooler.dense.weight": "../model.safetensors"}})),
        "model.safetensors.index.json: not a valid shard index (weight_map gives '../model.safetensors', not a file "
        "name beside it)"),
    "shard index not UTF-8": (shard_index(b"\xff\xfe{}"), "model.safetensors.index.json: not a valid shard index ('utf-8' codec "
                                                           "can't decode byte 0xff in position 0: invalid start byte)"),
    "shard index nested too deeply": (shard_index(DEEP_JSON),
                                      "model.safetensors.index.json: not a valid shard index (nested too deeply)"),
    "a tensor in two shards": (two_shards(lambda a, b, wm: b.update({"cls.bias": a["cls.bias"] + 7})),
                               f"model.safetensors.index.json: tensor cls.bias is in both {SHARDS[0]} and {SHARDS[1]}; "
                               f"the index names {SHARDS[0]}"),
    "a tensor in a shard the index does not name": (two_shards(lambda a, b, wm: b.update({"cls.bias": a.pop("cls.bias")})),
                                                    f"model.safetensors.index.json: tensor cls.bias is in {SHARDS[1]}, "
                                                    f"but the index names {SHARDS[0]}"),
    "config nested too deeply": (write_text("config.json", DEEP_JSON), "config.json: invalid JSON (nested too deeply)"),
    "tokenizer config nested too deeply": (with_tokenizer_config(DEEP_JSON),
                                           "tokenizer_config.json: invalid JSON (nested too deeply)"),
    "a 0-d weight": (set_tensor("cls.weight", lambda t: torch.tensor(0.5)),
                     "model.safetensors: tensor cls.weight has shape (), expected a 2-d tensor"),
    "a 0-d bias of a fused projection": (set_tensor(f"{QUERY}.bias", lambda t: torch.tensor(0.5)),
                                         f"model.safetensors: tensor {QUERY}.bias has shape (), expected a 1-d or 2-d "
                                         "tensor"),
    "a 1-d weight of a fused projection": (set_tensor(f"{KEY}.weight", lambda t: t.flatten()),
                                           f"model.safetensors: tensor {KEY}.weight has shape (1024,), which cannot be "
                                           f"fused with {QUERY}.weight (32, 32)"),
    "integer weights": (set_tensor(f"{QUERY}.weight", lambda t: t.to(torch.int64)),
                        f"model.safetensors: tensor {QUERY}.weight is int64, not floating point"),
    "bool weights": (set_tensor(f"{QUERY}.weight", lambda t: t > 0), f"tensor {QUERY}.weight is bool, not floating point"),
    "complex weights": (set_tensor(f"{QUERY}.weight", lambda t: t.to(torch.complex64), bin_file=True),
                        f"pytorch_model.bin: tensor {QUERY}.weight is complex64, not floating point"),
    "NaN weights": (set_tensor("visual_bert.pooler.dense.bias", lambda t: torch.full_like(t, float("nan"))),
                    "model.safetensors: tensor visual_bert.pooler.dense.bias holds 32 NaN or infinite values"),
    "an infinite weight": (set_tensor(f"{QUERY}.weight", lambda t: t.index_fill(0, torch.tensor([3]), float("inf"))),
                           f"model.safetensors: tensor {QUERY}.weight holds 32 NaN or infinite values"),
    "config size the weights lack": (corrupt_config(lambda c: c.update(max_position_embeddings=128)),
                                     "model.safetensors: tensor visual_bert.embeddings.position_embeddings.weight has "
                                     "shape (64, 32), the model needs (128, 32)"),
    "Git LFS pointer as model.safetensors": (write_text("model.safetensors", LFS_POINTER),
                                             "model.safetensors: not a safetensors file but a Git LFS pointer to one: "
                                             "fetch the weights with `git lfs pull`"),
    "Git LFS pointer as pytorch_model.bin": (shard_index_free("pytorch_model.bin", LFS_POINTER),
                                             "pytorch_model.bin: not a PyTorch weights file but a Git LFS pointer"),
    "HTML page as pytorch_model.bin": (shard_index_free("pytorch_model.bin", HTML_PAGE),
                                       "pytorch_model.bin: not a PyTorch weights file: it looks like an HTML page (a "
                                       "failed download"),
    "HTML page as model.safetensors": (write_text("model.safetensors", HTML_PAGE),
                                       "model.safetensors: not a safetensors file: it looks like an HTML page"),
    "LayerNorm eps NaN": (corrupt_config(lambda c: c.update(layer_norm_eps=float("nan"))),
                          "config.json: field 'layer_norm_eps' is nan, expected a finite number"),
    "LayerNorm eps infinite": (corrupt_config(lambda c: c.update(layer_norm_eps=float("inf"))),
                               "config.json: field 'layer_norm_eps' is inf, expected a finite number"),
    "negative LayerNorm eps": (corrupt_config(lambda c: c.update(layer_norm_eps=-1e-12)),
                               "config.json: field 'layer_norm_eps' is -1e-12, expected a number above 0"),
    "LayerNorm eps 0": (corrupt_config(lambda c: c.update(layer_norm_eps=0)),
                        "config.json: field 'layer_norm_eps' is 0.0, expected a number above 0"),
}
LXMERT_ERRORS = {  # hf-lxmert: each of its layer counts is checked against the weights
    "fewer language layers": (corrupt_config(lambda c: c.update(l_layers=1)),
                              "config.json: l_layers is 1, but the weights have 2 (lxmert.encoder.layer.*)"),
    "fewer cross-modality layers": (corrupt_config(lambda c: c.update(x_layers=1)),
                                    "config.json: x_layers is 1, but the weights have 2 (lxmert.encoder.x_layers.*)"),
    "more object-relationship layers": (corrupt_config(lambda c: c.update(r_layers=2)),
                                        "config.json: r_layers is 2, but the weights have 1 (lxmert.encoder.r_layers.*)"),
}
SOURCES = {"hf-visualbert": ("good_src", ERRORS), "hf-lxmert": ("good_lxmert", LXMERT_ERRORS)}  # format -> fixture, cases


@pytest.mark.parametrize("fmt, case", [(fmt, case) for fmt, (_, cases) in SOURCES.items() for case in cases])
def test_bad_source_exits_2_with_one_clear_message(fmt, case, request, tmp_path):
    fixture, cases = SOURCES[fmt]
    make, message = cases[case]
    result = cli(fmt, make(request.getfixturevalue(fixture), tmp_path), tmp_path / "out")
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit)  # no traceback
    assert message in result.stderr
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_lxmert_importer_rejects_a_visualbert_checkpoint(good_src, tmp_path):
    result = cli("hf-lxmert", good_src, tmp_path / "out")
    assert result.exit_code == 2
    assert "config.json: model_type is 'visual_bert', this importer reads 'lxmert'" in result.stderr


def test_existing_output_needs_force(good_src, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("user data")
    result = cli("hf-visualbert", good_src, out)
    assert result.exit_code == 2 and "--force" in result.stderr
    assert cli("hf-visualbert", good_src, out, "--force").exit_code == 0
    assert load_checkpoint(out).model.config.heads["vqa"].num_labels == 3


# ---- answer vocabularies: --answers ------------------------------------------------------------------------


def served_kinds(ckpt) -> set[str]:
    from service.pipeline import task_specs

    return set(task_specs({t: h.kind for t, h in ckpt.model.config.heads.items()}, {}, ckpt.labels))


def test_answers_name_the_vqa_head(tmp_path):
    """VQA's trainval_label2ans.json form (a list) and its trainval_ans2label.json form (answer -> index)."""
    hf = lxmert("LxmertForQuestionAnswering", num_qa_labels=4)
    src = save_hf(hf, tmp_path / "hf")
    names = ["", "woods", "trash can", "2"]
    (tmp_path / "label2ans.json").write_text(json.dumps(names))
    (tmp_path / "ans2label.json").write_text(json.dumps({a: i for i, a in enumerate(names)}))
    for table in ("label2ans.json", "ans2label.json"):
        ckpt = imported("hf-lxmert", src, tmp_path / table.replace(".json", ""), "--answers", tmp_path / table)
        assert ckpt.labels["heads"]["vqa"] == names
        assert manifest_import(tmp_path / table.replace(".json", ""))["answers"] == str((tmp_path / table).resolve())


def test_answers_from_a_text_file(tmp_path):
    """Pythia's answers_vqa.txt form: one answer a line (CRLF too), read as it stands; a blank line is an answer."""
    src = save_hf(lxmert("LxmertForQuestionAnswering", num_qa_labels=4), tmp_path / "hf")
    (tmp_path / "answers_vqa.txt").write_bytes(b"yes\r\n\r\n  trash can \r\n2\r\n")
    ckpt = imported("hf-lxmert", src, tmp_path / "ours", "--answers", tmp_path / "answers_vqa.txt")
    assert ckpt.labels["heads"]["vqa"] == ["yes", "", "trash can", "2"]


def test_repeated_answers_warn(good_src, tmp_path):
    """An answer table naming two outputs alike imports (the names are the user's) with a warning that says which."""
    (tmp_path / "answers.json").write_text(json.dumps(["yes", "no", "yes"]))
    result = cli("hf-visualbert", good_src, tmp_path / "out", "--answers", tmp_path / "answers.json")
    assert result.exit_code == 0, result.output
    assert "warning: 1 answer names more than one output of the vqa head ('yes' at 0, 2)" in result.stderr
    clean = cli("hf-visualbert", good_src, tmp_path / "clean", "--answers", _table(tmp_path, ["yes", "no", "red"]))
    assert clean.exit_code == 0 and "warning" not in clean.stderr


def test_id2label_with_nulls_is_numbered(tmp_path):
    """config.json's id2label with a null label is not a naming (it was served as the answer "None")."""
    src = save_hf(lxmert("LxmertForQuestionAnswering", num_qa_labels=3), tmp_path / "hf")
    cfg = json.loads((src / "config.json").read_text())
    cfg["id2label"] = {"0": "yes", "1": None, "2": "no"}
    (src / "config.json").write_text(json.dumps(cfg))
    ckpt = imported("hf-lxmert", src, tmp_path / "ours")
    assert ckpt.labels["heads"]["vqa"] == ["0", "1", "2"]


def test_a_checkpoint_no_endpoint_serves_imports_with_a_warning(tmp_path):
    """VisualBERT's VCR format (multiple choice) imports, for fine-tuning or export, and says `serve` refuses it."""
    result = cli("hf-visualbert", save_hf(visualbert("VisualBertForMultipleChoice"), tmp_path / "hf"), tmp_path / "mc")
    assert result.exit_code == 0 and "warning: no head of this checkpoint answers an endpoint (/vqa, /refer, " \
                                     "/retrieve, /nlvr2), so `vlserve serve` refuses it" in result.stderr
    served = cli("hf-visualbert", save_hf(visualbert("VisualBertForQuestionAnswering", num_labels=3), tmp_path / "q"),
                 tmp_path / "vqa")
    assert served.exit_code == 0 and "answers an endpoint" not in served.stderr


def test_an_import_that_fills_its_disk_names_out_not_its_staging(good_src, small_disk):
    """A disk that holds the weights but not the vocabulary after them: the error named the file in the checkpoint
    writer's staging directory (DISK/.out.XXXX/.new.saving-YYYY/vocab.txt)."""
    disk = small_disk(f"{(good_src / 'model.safetensors').stat().st_size // 1024 + 100}k")
    result = cli("hf-visualbert", good_src, disk / "out")
    assert result.exit_code == 2 and result.stderr.count("\n") == 1, result.output
    assert "No space left on device" in result.stderr and f"{disk / 'out' / 'vocab.txt'}" in result.stderr
    assert ".saving-" not in result.stderr and not any(disk.iterdir())


def test_placeholder_id2label_is_numbered_and_warns(tmp_path):
    """transformers writes id2label {"0": "LABEL_0", ...} for a head it was given no names for, as the hub's
    VisualBERT VQA config holds: served, /vqa answered "LABEL_1733" and the import said nothing."""
    src = save_hf(visualbert("VisualBertForQuestionAnswering", num_labels=5), tmp_path / "hf")
    assert json.loads((src / "config.json").read_text())["id2label"]["3"] == "LABEL_3"
    result = cli("hf-visualbert", src, tmp_path / "ours")
    assert result.exit_code == 0 and "warning: the 5 VQA answers are numbered" in result.stderr
    assert load_checkpoint(tmp_path / "ours").labels["heads"]["vqa"] == ["0", "1", "2", "3", "4"]


def _table(tmp_path: Path, names: list[str]) -> Path:
    (tmp_path / "table.json").write_text(json.dumps(names))
    return tmp_path / "table.json"


def test_lxmert_base_uncased_answer_head_is_pretraining(tmp_path):
    """lxmert-base-uncased: LxmertForPreTraining weights under a config.json that names no architecture, with the
    9500-way answer head of LXMERT's pretraining (answers: its all_ans.json): imported as the image_qa pretraining
    head, which /vqa does not serve."""
    src = save_hf(lxmert("LxmertForPreTraining", num_qa_labels=9500, num_object_labels=7, num_attr_labels=3), tmp_path / "hf")
    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("architectures", None)
    (src / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "all_ans.json").write_text(json.dumps([{"ans": f"answer {i}", "dsets": ["vqa"]} for i in range(9500)]))
    ckpt = imported("hf-lxmert", src, tmp_path / "ours", "--answers", tmp_path / "all_ans.json")
    heads = ckpt.model.config.heads
    assert set(heads) == {"mlm", "itm", "mrc", "mrfr", "image_qa"} and heads["image_qa"].num_labels == 9500
    assert ckpt.labels["heads"]["image_qa"][17] == "answer 17"
    assert served_kinds(ckpt) == {"itm"}


ANSWER_ERRORS = {
    "size": (["yes", "no"], "answers.json: 2 answers, but the checkpoint's vqa head has 3 outputs"),
    "format": ({"yes": "no"}, "answers.json: not an answer table"),
    "json": ("{not json", "answers.json: unreadable answer table"),
    "text": ("yes\nno\n", "answers.txt: 2 answers, but the checkpoint's vqa head has 3 outputs"),
    "empty text": ("", "answers.txt: no answers (one answer a line expected)"),
    "json nested too deeply": (DEEP_JSON, "answers.json: unreadable answer table (JSON nested too deeply)"),
    "csv": ("yes,0\nno,1\nred,2\n", "answers.csv: unreadable answer table (Expecting value: line 1 column 1 (char 0)); "
                                    "a table is JSON (a list of answers, or an answer -> index object) or a .txt file"),
    "pickle": ("\x80\x04...", "answers.pkl: a pickled answer table, which vlserve does not unpickle"),
}


@pytest.mark.parametrize("case", list(ANSWER_ERRORS))
def test_bad_answers_exit_2(case, good_src, tmp_path):
    table, message = ANSWER_ERRORS[case]
    suffix = {"csv": ".csv", "pickle": ".pkl"}.get(case, ".txt" if case.endswith("text") else ".json")
    path = tmp_path / f"answers{suffix}"
    path.write_text(table if isinstance(table, str) else json.dumps(table))
    result = cli("hf-visualbert", good_src, tmp_path / "out", "--answers", path)
    assert result.exit_code == 2, result.output
    assert message in result.stderr and result.stderr.startswith("error: ") and result.stderr.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_answers_with_a_byte_order_mark(good_src, tmp_path):
    """An answer table saved with a UTF-8 byte-order mark (as Windows editors write) reads as one without."""
    (tmp_path / "answers.json").write_bytes(b"\xef\xbb\xbf" + json.dumps(["yes", "no", "red"]).encode())
    ckpt = imported("hf-visualbert", good_src, tmp_path / "out", "--answers", tmp_path / "answers.json")
    assert ckpt.labels["heads"]["vqa"] == ["yes", "no", "red"]


def test_a_vlserve_directory_as_the_source_says_it_needs_no_import(good_src, tmp_path):
    imported("hf-visualbert", good_src, tmp_path / "ours")
    result = cli("hf-visualbert", tmp_path / "ours", tmp_path / "again")
    assert result.exit_code == 2 and f"{tmp_path / 'ours'} is a vlserve checkpoint directory already: it needs no " \
                                     "import" in result.stderr


def test_answers_without_an_answer_head_exit_2(tmp_path):
    (tmp_path / "answers.json").write_text(json.dumps(["yes", "no"]))
    src = save_hf(visualbert("VisualBertForVisualReasoning", num_labels=2), tmp_path / "hf")
    result = cli("hf-visualbert", src, tmp_path / "out", "--answers", tmp_path / "answers.json")
    assert result.exit_code == 2 and "answers.json: the checkpoint has no answer head" in result.stderr


# ---- what the weights and config.json may hold --------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64], ids=str)
def test_weights_of_other_float_types_import_as_fp32(dtype, good_src, tmp_path):
    from safetensors.torch import load_file

    src = edit_weights(lambda state: state.update({k: v.to(dtype) for k, v in state.items()}))(good_src, tmp_path)
    ckpt = imported("hf-visualbert", src, tmp_path / "out")
    ours = ckpt.model.state_dict()["encoder.pooler.dense.weight"]
    assert ours.dtype == torch.float32
    assert torch.equal(ours, load_file(src / "model.safetensors")["visual_bert.pooler.dense.weight"].float())


def test_load_state_strict_refuses_a_tensor_that_is_not_floating_point():
    """load_state_dict would cast it into the float parameter without a word."""
    state = {"weight": torch.ones(2, 2, dtype=torch.int64), "bias": torch.zeros(2)}
    with pytest.raises(CheckpointError, match="w.safetensors: tensor weight is int64, not floating point"):
        load_state_strict(nn.Linear(2, 2), state, "w.safetensors")


def test_config_with_a_byte_order_mark_imports(good_src, tmp_path):
    """A config.json saved with a UTF-8 byte-order mark (as Windows editors write) reads as one without."""
    src = bad(good_src, tmp_path)
    (src / "config.json").write_bytes(b"\xef\xbb\xbf" + (src / "config.json").read_bytes())
    assert imported("hf-visualbert", src, tmp_path / "out").model.config.heads["vqa"].num_labels == 3


@pytest.mark.parametrize("vocab", [b"", b"[PAD]\n[UNK]\ncaf\xe9\n"], ids=["no special tokens", "not UTF-8"])
def test_a_bad_vocabulary_is_named_once(vocab, good_src, tmp_path):
    src = write_text("vocab.txt", vocab)(good_src, tmp_path)
    result = cli("hf-visualbert", src, tmp_path / "out")
    assert result.exit_code == 2 and result.stderr.startswith(f"error: {src / 'vocab.txt'}: "), result.output
    assert result.stderr.count("vocab.txt") == 1 and result.stderr.count("\n") == 1
