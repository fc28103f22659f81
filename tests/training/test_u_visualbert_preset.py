"""The `u-visualbert` preset builds new models with its authors' embeddings (uclanlp/visualbert's
unsupervised_visualbert: EncoderConfig.embedding_style "published", every sub-word of a region's tag a token of its
own), and every path runs them: fine-tuning with and without region tags, pretraining with tag reconstruction, the
service and an exported repository. Configs saved without the field (VisualBERT's embeddings, vlserve's trained
checkpoints) still build what they were trained as."""
from __future__ import annotations

import base64
import json
import math

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from models import HeadConfig, ModelConfig, VLInputs, VLModel
from models.checkpoint import load_checkpoint
from models.config import EncoderConfig
from models.region_features import region_tag_ids
from models.registry import create_model, encoder_config
from models.tokenizer import VLTokenizer
from service.app import create_app
from service.settings import load_settings
from tests.service.conftest import build_tiny_detector, png_bytes, shapes_image
from training.data.shapes_cache import ShapesConfig
from training.data.shapes_world import WorldConfig
from training.data.vl_tasks import collate
from training.finetune import FinetuneConfig, train
from training.objectives import IGNORE
from training.pretrain import BatchBuilder, PretrainConfig, pretrain
from training.vl_data import prepare_task_data, tagged

SHAPES = ShapesConfig(world=WorldConfig(seed=3, height=64, width=64), splits=(("train", 24), ("val", 12)))


@pytest.fixture(scope="module")
def task_data(tmp_path_factory):
    """The tiny service detector (circle, rectangle = rect ##angle, triangle) and the regions of 24 + 12 scenes."""
    root = tmp_path_factory.mktemp("u_visualbert_preset")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLSERVE_CACHE", str(root / "cache"))
        detector = build_tiny_detector(root / "detector")
        data = prepare_task_data(detector.dir, 24, 12, easy_vqa=False, progress=False, data=SHAPES)
        yield detector, data, root


def finetune_config(out, detector, **kw) -> FinetuneConfig:
    base = dict(out=out, detector_dir=detector, preset="u-visualbert", size="tiny", init_text=False, easy_vqa=False,
                train_scenes=24, eval_scenes=12, tasks={"vqa": 1.0, "refer": 1.0}, steps=3, batch_size=4, warmup=1,
                eval_every=10_000, final_eval_examples=8, threads=1)
    return FinetuneConfig(**{**base, **kw})


def test_new_models_get_the_published_embeddings_and_saved_configs_without_the_field_load_as_trained():
    assert encoder_config("u-visualbert", "tiny").embedding_style == "published"
    assert EncoderConfig(preset="u-visualbert").embedding_style == "vlserve"  # what a config without the field means
    old = create_model("u-visualbert", "tiny", heads={"vqa": HeadConfig(kind="vqa", num_labels=3)},
                       embedding_style="vlserve", box_embedding="normalized").eval()
    saved = old.config.to_dict()
    del saved["encoder"]["embedding_style"]  # as configs written before the field existed
    loaded = VLModel(ModelConfig.from_dict(json.loads(json.dumps(saved)))).eval()
    assert loaded.config.encoder.embedding_style == "vlserve"
    loaded.load_state_dict(old.state_dict())  # strict: the same tensors
    g = torch.Generator().manual_seed(0)
    x = VLInputs(input_ids=torch.randint(1000, 2000, (2, 5), generator=g),
                 attention_mask=torch.ones(2, 5, dtype=torch.long),
                 token_type_ids=torch.zeros(2, 5, dtype=torch.long), region_features=torch.randn(2, 3, 16, generator=g),
                 region_boxes=torch.rand(2, 3, 4, generator=g).sort(-1).values,  # x1 <= y1 <= x2 <= y2
                 region_mask=torch.ones(2, 3, dtype=torch.long),
                 tag_ids=torch.randint(1000, 2000, (2, 3), generator=g))
    with torch.no_grad():
        assert torch.equal(loaded(x, "vqa").logits, old(x, "vqa").logits)
    # the published embeddings take the 4-d box as the reference does: the sin/cos "normalized" one is vlserve's
    with pytest.raises(ValueError, match="box_embedding applies to the vlserve embedding style"):
        encoder_config("u-visualbert", "tiny", box_embedding="normalized")


def test_finetuning_with_and_without_region_tags(task_data):
    detector, data, root = task_data
    tokenizer = VLTokenizer.pretrained_minilm()
    table = tokenizer.tag_subwords(data.objects)
    assert table.shape[1] == 2  # "rectangle" is two sub-words
    for region_tags in (False, True):
        out = root / f"ft_tags{int(region_tags)}"
        result = train(finetune_config(out, detector.dir, region_tags=region_tags), data=data, progress=False)
        assert len(result["losses"]) == 3 and all(map(math.isfinite, result["losses"])), result["losses"]
        model = load_checkpoint(out).model.eval()
        enc = model.config.encoder
        assert (enc.embedding_style, enc.region_tags, enc.box_embedding) == ("published", region_tags, "linear")
        examples = data.train["vqa"][:4]
        table_as_read = tagged(data, model, tokenizer).train_table
        batch, _ = collate("vqa", examples, table_as_read, tokenizer, model.config.heads["vqa"])
        if not region_tags:
            assert batch.tag_ids is None
            continue
        classes = data.train_table.obj_ids[[e.rows[0] for e in examples]]  # (4, N)
        assert batch.tag_ids.tolist() == region_tag_ids(classes, table).tolist()  # (4, N, 2): every sub-word
        with torch.no_grad():
            enc_out = model.forward_features(batch)
        b, n, k = batch.tag_ids.shape
        real = (batch.tag_ids >= 0) & batch.region_mask.bool().unsqueeze(-1)  # (B, N, K)
        assert enc_out.tags.shape[:2] == (b, n * k)  # a token per sub-word slot, after the regions
        assert torch.equal(enc_out.sequence_mask[:, -n * k :].bool(), real.reshape(b, n * k))  # empty slots masked


def test_pretraining_reconstructs_every_sub_word_of_the_masked_regions_tags(task_data):
    detector, data, root = task_data
    cfg = PretrainConfig(out=root / "pretrained", detector_dir=detector.dir, preset="u-visualbert", size="tiny",
                         init_text=False, easy_vqa=False, train_scenes=24, eval_scenes=12, steps=3, batch_size=8,
                         warmup=1, eval_examples=8, log_every=1, threads=1, objectives=("mlm", "itm", "mrc", "tag"))
    tokenizer = VLTokenizer.pretrained_minilm()
    table = torch.from_numpy(tokenizer.tag_subwords(data.objects))
    batch = BatchBuilder(cfg, data, tokenizer)(0, np.random.default_rng(0))
    tags, classes = batch.targets["tag"], batch.targets["mrc"]  # (B, N, K), (B, N)
    chosen = classes != IGNORE
    assert tags.dim() == 3 and chosen.any()
    expected = torch.where(table[classes.clamp(min=0)] >= 0, table[classes.clamp(min=0)], IGNORE)
    assert torch.equal(tags[chosen], expected[chosen])  # every sub-word of the class name, nothing in empty slots
    assert (tags[~chosen] == IGNORE).all()
    hidden = tags != IGNORE
    assert (batch.inputs.tag_ids[hidden] == tokenizer.mask_id).all()  # hidden from the model
    assert not (batch.inputs.tag_ids[~hidden] == tokenizer.mask_id).any()
    result = pretrain(cfg, data=data, progress=False)
    assert [set(r) for r in result["records"]] == [{"mlm", "itm", "mrc", "tag", "total"}] * 3, result["records"]
    assert all(math.isfinite(v) for r in result["records"] for v in r.values())
    assert load_checkpoint(root / "pretrained").model.config.encoder.embedding_style == "published"


def test_a_preset_model_fine_tuned_with_tags_is_served_and_exported(task_data):
    from export.repository import export_repository

    detector, data, root = task_data
    model_dir = root / "served"
    train(finetune_config(model_dir, detector.dir, region_tags=True, tasks={"vqa": 1.0}), data=data, progress=False)
    repo = root / "served_repo"
    export_repository(model_dir, repo, examples=8)
    ckpt = load_checkpoint(model_dir)
    model = ckpt.model.eval()
    got = {}
    for name, path, runtime in (("torch", model_dir, "torch"), ("onnx", repo, "onnxruntime")):
        settings = load_settings(model_dir=path, detector_dir=detector.dir, threads=1, max_wait_ms=2.0,
                                 detector_max_wait_ms=2.0,
                                 redis_url=None, precision="fp32", runtime=runtime)
        with TestClient(create_app(settings)) as c:
            r = c.post("/images", json={"image": base64.b64encode(png_bytes(shapes_image(seed=1))).decode()})
            assert r.status_code == 200 and r.json()["num_boxes"] > 0, r.text
            image_id = r.json()["image_id"]
            r = c.post("/vqa", json={"image_id": image_id, "question": "what shape is red?", "top_k": 3})
            assert r.status_code == 200, r.text
            got[name] = r.json()["answers"]
            if runtime != "torch":
                continue
            pipeline = c.app.state.services.pipeline
            assert np.array_equal(pipeline.tag_words, ckpt.tokenizer.tag_subwords(detector.detector.config.classes))
            rf = c.portal.call(pipeline.regions.from_id, image_id)
            enc = ckpt.tokenizer.encode(["what shape is red?"])
            x = VLInputs(**{k: torch.as_tensor(v) for k, v in enc.items()},
                         region_features=torch.as_tensor(rf.features.astype(np.float32))[None],
                         region_boxes=torch.as_tensor(rf.normalized_boxes().astype(np.float32))[None],
                         region_mask=torch.as_tensor(rf.region_mask())[None],
                         tag_ids=torch.as_tensor(region_tag_ids(rf.obj_ids, pipeline.tag_words))[None])
            with torch.no_grad():
                logits = model(x, "vqa").logits[0].double()
            scores = torch.sigmoid(logits) if model.config.heads["vqa"].score == "sigmoid" else torch.softmax(logits, -1)
            best = scores.argsort(descending=True)[:3]
            assert [a["answer"] for a in got["torch"]] == [ckpt.labels["heads"]["vqa"][i] for i in best]
            assert np.allclose([a["score"] for a in got["torch"]], scores[best].numpy(), atol=1e-5)
    assert [a["answer"] for a in got["onnx"]] == [a["answer"] for a in got["torch"]]
    assert np.allclose([a["score"] for a in got["onnx"]], [a["score"] for a in got["torch"]], atol=1e-5)
