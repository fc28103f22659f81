"""Readers of the real annotation formats, each on a small file written here in that exact format."""
from __future__ import annotations

import json

import pytest

from training.data.formats import (
    captions_by_image, nlvr2_image_names, nlvr2_image_path, normalize_answer, read_coco_instances,
    read_flickr30k_karpathy, read_flickr30k_tokens, read_nlvr2, read_refcoco, read_vqa, vqa_accuracy,
    vqa_soft_scores, xywh_to_xyxy,
)


def write_json(path, obj):
    path.write_text(json.dumps(obj))
    return path


# --- VQA v2 ---

@pytest.mark.parametrize("raw, expected", [
    ("Yes", "yes"), ("yes!", "yes"), ("Two", "2"), ("the red one.", "red 1"), ("T-Shirt", "t shirt"),
    ("1,000", "1000"), ("3.5", "3.5"), ("dont know", "don't know"), ("A dog, a cat", "dog cat"),
    ("  on the\tleft\n", "on left"), ("none", "0"), ("(grass)", "grass"),
])
def test_normalize_answer(raw, expected):
    assert normalize_answer(raw) == expected


@pytest.mark.parametrize("count, expected", [
    # (count*min(1,(count-1)/3) + (10-count)*min(1,count/3)) / 10, by hand
    (0, 0.0), (1, 0.3), (2, 0.6), (3, 0.9), (4, 1.0), (10, 1.0),
])
def test_vqa_accuracy_of_ten_answers(count, expected):
    answers = ["cat"] * count + ["dog"] * (10 - count)
    assert vqa_accuracy("cat", answers) == pytest.approx(expected)


def test_soft_scores_by_hand():
    answers = ["2"] * 3 + ["3"] * 2 + ["4"] + ["yes"] * 4
    assert vqa_soft_scores(answers) == pytest.approx({"2": 0.9, "3": 0.6, "4": 0.3, "yes": 1.0})
    # fewer than 10 answers: 5 leave-one-out subsets of 4; "a" twice -> (2*(1/3) + 3*(2/3)) / 5
    assert vqa_soft_scores(["a", "a", "b", "c", "d"])["a"] == pytest.approx((2 / 3 + 2) / 5)
    assert vqa_soft_scores([]) == {}


def _vqa_files(tmp_path):
    questions = {"info": {}, "task_type": "Open-Ended", "data_type": "mscoco", "data_subtype": "val2014",
                 "license": {}, "questions": [
                     {"image_id": 42, "question": "What color is the cat?", "question_id": 420},
                     {"image_id": 7, "question": "How many dogs?", "question_id": 70}]}
    answers_420 = ["Black", "black", "black.", "gray", "grey", "black", "dark gray", "black", "gray", "Black"]
    answers_70 = ["two", "2", "2", "3", "2", "2", "two", "2", "2", "three"]
    annotations = {"info": {}, "license": {}, "data_subtype": "val2014", "annotations": [
        {"question_id": 420, "image_id": 42, "question_type": "what color is the", "answer_type": "other",
         "multiple_choice_answer": "black",
         "answers": [{"answer": a, "answer_confidence": "yes", "answer_id": i + 1} for i, a in enumerate(answers_420)]},
        {"question_id": 70, "image_id": 7, "question_type": "how many", "answer_type": "number",
         "multiple_choice_answer": "2",
         "answers": [{"answer": a, "answer_confidence": "maybe", "answer_id": i + 1} for i, a in enumerate(answers_70)]},
    ]}
    return (write_json(tmp_path / "v2_OpenEnded_mscoco_val2014_questions.json", questions),
            write_json(tmp_path / "v2_mscoco_val2014_annotations.json", annotations))


def test_read_vqa(tmp_path):
    questions_path, annotations_path = _vqa_files(tmp_path)
    cat, dogs = read_vqa(questions_path, annotations_path)
    assert (cat.question_id, cat.image_id, cat.question) == (420, 42, "What color is the cat?")
    assert cat.answers.count("black") == 6 and cat.answer_type == "other"
    # black x6 -> 1.0; gray x2 -> 0.6; grey x1, dark gray x1 -> 0.3
    assert cat.scores == pytest.approx({"black": 1.0, "gray": 0.6, "grey": 0.3, "dark gray": 0.3})
    # number words normalize: "2" x9 ("two" counted) -> 1.0; "3" x2 ("three" counted) -> 0.6
    assert dogs.scores == pytest.approx({"2": 1.0, "3": 0.6}) and dogs.multiple_choice_answer == "2"


def test_read_vqa_test_split_has_no_answers(tmp_path):
    questions_path, _ = _vqa_files(tmp_path)
    items = read_vqa(questions_path)
    assert [q.question_id for q in items] == [420, 70] and items[0].answers == [] and items[0].scores == {}


def test_read_vqa_rejects_other_files(tmp_path):
    questions_path, annotations_path = _vqa_files(tmp_path)
    with pytest.raises(ValueError, match="questions"):
        read_vqa(annotations_path)
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        read_vqa(bad)


# --- RefCOCO+ ---

def _refcoco_files(tmp_path):
    instances = {
        "images": [{"id": 1, "file_name": "COCO_train2014_000000000001.jpg", "height": 480, "width": 640},
                   {"id": 2, "file_name": "COCO_train2014_000000000002.jpg", "height": 300, "width": 400}],
        "annotations": [{"id": 10, "image_id": 1, "bbox": [10.0, 20.0, 100.0, 50.5], "category_id": 1},
                        {"id": 11, "image_id": 1, "bbox": [200, 100, 30, 40], "category_id": 18},
                        {"id": 20, "image_id": 2, "bbox": [0, 0, 400, 300], "category_id": 3}],
        "categories": [{"id": 1, "name": "person"}, {"id": 18, "name": "dog"}, {"id": 3, "name": "car"}],
    }
    refs = [
        {"ref_id": 100, "image_id": 1, "ann_id": 10, "split": "train", "category_id": 1,
         "sentences": [{"sent": "man in red shirt", "sent_id": 1000, "tokens": ["man", "in", "red", "shirt"]},
                       {"sent": "guy on left", "sent_id": 1001, "tokens": ["guy", "on", "left"]}]},
        {"ref_id": 101, "image_id": 2, "ann_id": 20, "split": "testA", "category_id": 3,
         "sentences": [{"sent": "blue car", "sent_id": 1002}]},
    ]
    return write_json(tmp_path / "refs(unc).json", refs), write_json(tmp_path / "instances.json", instances)


def test_read_refcoco_converts_boxes(tmp_path):
    refs_path, instances_path = _refcoco_files(tmp_path)
    data = read_refcoco(refs_path, instances_path)
    assert [e.sentence for e in data.expressions] == ["man in red shirt", "guy on left", "blue car"]
    first = data.expressions[0]
    assert (first.ref_id, first.sent_id, first.image_id, first.ann_id, first.split) == (100, 1000, 1, 10, "train")
    assert first.box == (10.0, 20.0, 110.0, 70.5)
    image = data.images[1]
    assert (image.height, image.width, image.file_name) == (480, 640, "COCO_train2014_000000000001.jpg")
    assert image.boxes == {10: (10.0, 20.0, 110.0, 70.5), 11: (200.0, 100.0, 230.0, 140.0)}
    assert [e.ref_id for e in read_refcoco(refs_path, instances_path, split="testA").expressions] == [101]


def test_read_refcoco_accepts_wrapped_refs_and_rejects_dangling_ann(tmp_path):
    refs_path, instances_path = _refcoco_files(tmp_path)
    refs = json.loads(refs_path.read_text())
    wrapped = write_json(tmp_path / "wrapped.json", {"refs": refs})
    assert len(read_refcoco(wrapped, instances_path).expressions) == 3
    refs[0]["ann_id"] = 999
    with pytest.raises(ValueError, match="ann_id 999"):
        read_refcoco(write_json(tmp_path / "bad.json", refs), instances_path)
    with pytest.raises(ValueError, match="instances"):
        read_coco_instances(write_json(tmp_path / "x.json", {"images": []}))


def test_xywh_to_xyxy():
    assert xywh_to_xyxy([1, 2, 3, 4]) == (1.0, 2.0, 4.0, 6.0)


# --- Flickr30K ---

def test_read_flickr30k_token_file(tmp_path):
    path = tmp_path / "results_20130124.token"
    path.write_text(
        "1000092795.jpg#0\tTwo young guys with shaggy hair look at their hands .\n"
        "1000092795.jpg#1\tTwo young , White males are outside near many bushes .\r\n"
        "\n"
        "10002456.jpg#0\tSeveral men in hard hats are operating a giant pulley system .\n")
    captions = read_flickr30k_tokens(path)
    assert [(c.image_file, c.index) for c in captions] == [("1000092795.jpg", 0), ("1000092795.jpg", 1), ("10002456.jpg", 0)]
    assert captions[1].caption == "Two young , White males are outside near many bushes ."
    assert captions_by_image(captions)["1000092795.jpg"][0].startswith("Two young guys")
    path.write_text("1000092795.jpg Two young guys\n")
    with pytest.raises(ValueError, match="line 1"):
        read_flickr30k_tokens(path)


def test_read_flickr30k_karpathy(tmp_path):
    data = {"dataset": "flickr30k", "images": [
        {"filename": "1000092795.jpg", "imgid": 0, "split": "train", "sentids": [0, 1], "sentences": [
            {"raw": "Two young guys with shaggy hair look at their hands.", "tokens": ["two", "young"], "imgid": 0, "sentid": 0},
            {"raw": "Two young, White males are outside near many bushes.", "tokens": ["two"], "imgid": 0, "sentid": 1}]},
        {"filename": "1007129816.jpg", "imgid": 1, "split": "test", "sentids": [5], "sentences": [
            {"raw": "The man with pierced ears is wearing glasses.", "tokens": ["the"], "imgid": 1, "sentid": 5}]},
    ]}
    path = write_json(tmp_path / "dataset_flickr30k.json", data)
    captions = read_flickr30k_karpathy(path)
    assert [(c.image_file, c.index, c.split) for c in captions] == [
        ("1000092795.jpg", 0, "train"), ("1000092795.jpg", 1, "train"), ("1007129816.jpg", 5, "test")]
    assert [c.caption for c in read_flickr30k_karpathy(path, split="test")] == ["The man with pierced ears is wearing glasses."]


# --- NLVR2 ---

def test_read_nlvr2_jsonl(tmp_path):
    rows = [
        {"validation": {}, "sentence": "One image shows exactly two brown acorns in back-to-back caps on green foliage.",
         "left_url": "https://example.invalid/l.jpg", "writer": "103", "label": "False", "right_url": "https://example.invalid/r.jpg",
         "synset": "n12267677", "query": "green acorns1", "identifier": "dev-850-0-0", "extra_validations": {}},
        {"sentence": "There are two dogs.", "label": "True", "identifier": "train-10171-0-1", "directory": 91},
    ]
    path = tmp_path / "dev.json"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    first, second = read_nlvr2(path)
    assert (first.label, first.left_image, first.right_image) == (False, "dev-850-0-img0.png", "dev-850-0-img1.png")
    assert first.left_url == "https://example.invalid/l.jpg" and first.directory is None
    assert second.label is True and second.directory == 91
    assert nlvr2_image_path("/data", second, 1).as_posix() == "/data/train/91/train-10171-0-img1.png"
    assert nlvr2_image_path("/data", first, 0).as_posix() == "/data/dev/dev-850-0-img0.png"


@pytest.mark.parametrize("row", [
    {"sentence": "x", "label": "maybe", "identifier": "dev-1-0-0"},
    {"sentence": "x", "label": "True", "identifier": "dev-1-0"},
    {"label": "True", "identifier": "dev-1-0-0"},
])
def test_read_nlvr2_rejects_bad_rows(tmp_path, row):
    path = tmp_path / "dev.json"
    path.write_text(json.dumps({"sentence": "ok", "label": "True", "identifier": "dev-1-0-0"}) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(ValueError, match="line 2"):
        read_nlvr2(path)


def test_nlvr2_image_names():
    assert nlvr2_image_names("test1-0-1-3") == ("test1-0-1-img0.png", "test1-0-1-img1.png")
