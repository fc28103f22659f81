"""Shapes world: determinism, and every gold label re-derived from the scene graph by checks written here."""
from __future__ import annotations

import dataclasses
import json
import re
from collections import Counter

import numpy as np
import pytest

from training.data.shapes_cache import ShapesConfig, build_shapes, dataset_dir, load_split
from training.data.shapes_tasks import (
    ANSWERS, ONE_SIDE, RELATED_PER_OBJECT, TaskConfig, false_listings, nlvr2_examples, position_questions,
    related_attribute_questions, related_expressions, scene_annotations,
)
from training.data.shapes_world import COLORS, SHAPES, SIZES, Scene, WorldConfig, generate_scene, render_scene

WORLD = WorldConfig(seed=3)
N_SCENES = 200
RELATION_WORDS = ("left of", "right of", "above", "below")


@pytest.fixture(scope="module")
def scenes() -> list[Scene]:
    return [generate_scene(WORLD, "test", i) for i in range(N_SCENES)]


@pytest.fixture(scope="module")
def annotations(scenes) -> list[dict]:
    # Through JSON, as consumers read them from the cache.
    return [json.loads(json.dumps(scene_annotations(s))) for s in scenes]


# ---- an independent reading of the generated language -------------------------------------------------------

def parse_np(text: str) -> dict[str, str]:
    """'large red circles' -> {'size': 'large', 'color': 'red', 'shape': 'circle'}; 'object(s)' names no shape."""
    *modifiers, noun = text.split()
    attrs = {}
    for word in modifiers:
        key = "size" if word in SIZES else "color"
        assert word in SIZES or word in COLORS, text
        attrs[key] = word
    noun = noun[:-1] if noun.endswith("s") else noun
    assert noun in SHAPES or noun == "object", text
    if noun != "object":
        attrs["shape"] = noun
    return attrs


def fits(attrs: dict[str, str], obj: dict) -> bool:
    return all(obj[k] == v for k, v in attrs.items())


def holds(rel: str, a: dict, b: dict, scene: dict) -> bool | None:
    """Is a rel b by box centres; None inside the margin, where a reader could not tell."""
    axis = 0 if rel in ("left of", "right of") else 1
    extent = scene["width"] if axis == 0 else scene["height"]
    centre_a = (a["box"][axis] + a["box"][axis + 2]) / 2
    centre_b = (b["box"][axis] + b["box"][axis + 2]) / 2
    gap = centre_b - centre_a if rel in ("left of", "above") else centre_a - centre_b
    return None if abs(gap) <= scene["relation_margin"] * extent else gap > 0


def referents(expression: str, scene: dict) -> list[int]:
    """Objects a reader could take 'the X [rel the Y]' to mean (a relation inside the margin counts as maybe)."""
    m = re.fullmatch(r"the (.+?)(?: (left of|right of|above|below) the (.+))?", expression)
    target = parse_np(m.group(1))
    objs = scene["objects"]
    candidates = [i for i, o in enumerate(objs) if fits(target, o)]
    if m.group(2) is None:
        return candidates
    anchors = referents(f"the {m.group(3)}", scene)
    assert len(anchors) == 1, f"ambiguous anchor in {expression!r}"
    anchor = objs[anchors[0]]
    return [i for i in candidates if i != anchors[0] and holds(m.group(2), objs[i], anchor, scene) is not False]


def unique_referent(expression: str, scene: dict) -> int:
    found = referents(expression, scene)
    assert len(found) == 1, f"{expression!r} fits objects {found}"
    m = re.fullmatch(r"the .+? (left of|right of|above|below) the (.+)", expression)
    if m:  # the referent itself must clearly stand in the relation, not only maybe
        anchor = scene["objects"][referents(f"the {m.group(2)}", scene)[0]]
        assert holds(m.group(1), scene["objects"][found[0]], anchor, scene) is True
    return found[0]


def count(np_text: str, scene: dict) -> int:
    return sum(fits(parse_np(np_text), o) for o in scene["objects"])


def indefinite(text: str) -> str:
    m = re.fullmatch(r"an? (.+)", text)
    assert m, text
    return m.group(1)


def caption_truth(caption: str, scene: dict) -> bool | None:
    """Truth of a retrieval caption; None when it hangs on a relation inside the margin."""
    objs = scene["objects"]
    if m := re.fullmatch(r"there (?:is|are) (no|\d+) (.+)\.", caption):
        return count(m.group(2), scene) == (0 if m.group(1) == "no" else int(m.group(1)))
    if m := re.fullmatch(r"there is (an? .+)\.", caption):
        return count(indefinite(m.group(1)), scene) > 0
    if m := re.fullmatch(r"(an? .+) is (left of|right of|above|below) (an? .+)\.", caption):
        a, b = parse_np(indefinite(m.group(1))), parse_np(indefinite(m.group(3)))
        values = {holds(m.group(2), x, y, scene) for i, x in enumerate(objs) for j, y in enumerate(objs)
                  if i != j and fits(a, x) and fits(b, y)}
        return True if True in values else (None if None in values else False)
    items = re.split(r", | and ", caption.rstrip("."))  # a listing of every object
    listed = Counter(tuple(sorted(parse_np(indefinite(item)).items())) for item in items)
    return listed == Counter(tuple(sorted((k, o[k]) for k in ("shape", "color", "size"))) for o in objs)


# ---- scenes ---------------------------------------------------------------------------------------------

def test_same_seed_same_scenes_in_any_order(scenes, annotations):
    again = {i: generate_scene(WORLD, "test", i) for i in reversed(range(30))}
    for i in range(30):
        assert again[i] == scenes[i]
        assert np.array_equal(np.asarray(render_scene(again[i])), np.asarray(render_scene(scenes[i])))
        assert json.loads(json.dumps(scene_annotations(again[i]))) == annotations[i]


def test_other_seed_or_split_differs(scenes):
    other_seed = [generate_scene(WorldConfig(seed=4), "test", i) for i in range(20)]
    other_split = [generate_scene(WORLD, "val", i) for i in range(20)]
    for other in (other_seed, other_split):
        differing = sum(not np.array_equal(np.asarray(render_scene(a)), np.asarray(render_scene(b)))
                        for a, b in zip(scenes, other))
        assert differing == 20


def test_objects_counts_sizes_overlap_and_pixels(scenes):
    assert {len(s.objects) for s in scenes} == set(range(1, 7))
    for s in scenes:
        for k, obj in enumerate(s.objects):
            x1, y1, x2, y2 = obj.box
            assert 0 <= x1 < x2 <= s.width and 0 <= y1 < y2 <= s.height
            side = max(x2 - x1, y2 - y1) if obj.size == "small" else min(x2 - x1, y2 - y1)
            limit = max(WORLD.small_side) * 128 + 1
            assert (side <= limit) if obj.size == "small" else (side > limit)
            for other in s.objects[:k]:
                ox1, oy1, ox2, oy2 = other.box
                inter = max(min(x2, ox2) - max(x1, ox1), 0) * max(min(y2, oy2) - max(y1, oy1), 0)
                union = (x2 - x1) * (y2 - y1) + (ox2 - ox1) * (oy2 - oy1) - inter
                assert inter / union <= WORLD.max_iou
            # Drawn alone, the object's pixels span exactly its box, in its colour.
            alone = np.asarray(render_scene(dataclasses.replace(s, objects=(obj,))))
            ys, xs = np.nonzero(np.any(alone != np.array(s.background), axis=-1))
            assert (xs.min(), ys.min(), xs.max() + 1, ys.max() + 1) == obj.box
            assert tuple(alone[ys[0], xs[0]]) == COLORS[obj.color]


# ---- task labels ----------------------------------------------------------------------------------------

def test_position_questions_rederived(scenes):
    """'is the red circle on the left?': yes when the centre is in the asked side's outer 40% of the image, no when in
    the opposite side's; objects near the middle are not asked. Asked both ways, so the word alone tells nothing."""
    asked, answers, by_word = 0, Counter(), Counter()
    for scene in scenes:
        d = json.loads(json.dumps(scene_annotations(scene)))
        questions = position_questions(scene)
        for q in questions:
            m = re.fullmatch(r"is (the .+) (on the left|on the right|at the top|at the bottom)\?", q["question"])
            obj = d["objects"][unique_referent(m.group(1), d)]
            axis, far = {"on the left": (0, False), "on the right": (0, True), "at the top": (1, False),
                         "at the bottom": (1, True)}[m.group(2)]
            extent = d["width"] if axis == 0 else d["height"]
            centre = (obj["box"][axis] + obj["box"][axis + 2]) / 2 / extent
            near_asked = centre > 0.6 if far else centre < 0.4
            near_opposite = centre < 0.4 if far else centre > 0.6
            assert near_asked or near_opposite, q
            assert q["answer"] == ("yes" if near_asked else "no") and q["type"] == "position"
            answers[q["answer"]] += 1
            by_word[m.group(2), q["answer"]] += 1
        asked += len(questions)
        one_side = position_questions(scene, ONE_SIDE)
        assert one_side == [q for q in questions if q["question"].endswith(("on the left?", "at the top?"))]
    assert asked > 2 * N_SCENES and answers["yes"] == answers["no"]
    for word, opposite in (("on the left", "on the right"), ("at the top", "at the bottom")):  # each object both ways
        assert by_word[word, "yes"] == by_word[opposite, "no"] and by_word[word, "no"] == by_word[opposite, "yes"]


def test_vqa_answers_rederived(annotations):
    types = Counter()
    for scene in annotations:
        for q in scene["vqa"]:
            question, answer = q["question"], q["answer"]
            assert answer in ANSWERS
            types[q["type"]] += 1
            if m := re.fullmatch(r"what (color|shape|size) is (the .+)\?", question):
                assert scene["objects"][unique_referent(m.group(2), scene)][m.group(1)] == answer
            elif m := re.fullmatch(r"how many (.+) are there\?", question):
                assert str(count(m.group(1), scene)) == answer
            elif m := re.fullmatch(r"is there (an? .+)\?", question):
                assert ("yes" if count(indefinite(m.group(1)), scene) else "no") == answer
            else:
                m = re.fullmatch(r"is (the .+?) (left of|right of|above|below) (the .+)\?", question)
                a, b = (scene["objects"][unique_referent(m.group(k), scene)] for k in (1, 3))
                value = holds(m.group(2), a, b, scene)
                assert value is not None and ("yes" if value else "no") == answer
    assert set(types) == {"color", "shape", "size", "count", "exists", "relation"}


def test_refer_expressions_unique_and_shortest(annotations):
    for scene in annotations:
        for ref in scene["refer"]:
            i = unique_referent(ref["expression"], scene)
            assert i == ref["object"] and ref["box"] == scene["objects"][i]["box"]
            obj = scene["objects"][i]
            # No attribute-only description with fewer words fits this object alone.
            n_words = len(ref["expression"].split())
            for keys in ((), ("shape",), ("color",), ("size",), ("shape", "color"), ("shape", "size"),
                         ("color", "size"), ("shape", "color", "size")):
                words = 2 + len([k for k in keys if k != "shape"])
                if words < n_words:
                    attrs = {k: obj[k] for k in keys}
                    assert sum(fits(attrs, o) for o in scene["objects"]) > 1, (ref, attrs)


def relation_decides(expression: str, scene: dict) -> bool:
    """Does 'the X rel the Y' need its relation: does X alone fit other objects than the anchor Y too?"""
    m = re.fullmatch(r"(the .+?) (?:left of|right of|above|below) (the .+)", expression)
    return m is not None and len(set(referents(m.group(1), scene)) - {unique_referent(m.group(2), scene)}) > 1


def test_related_questions_and_expressions_need_their_relation(scenes):
    """The related_* training sets name an object through a relation, never where its description alone (without
    the anchor) would do; the answers and boxes are the referent's; at most RELATED_PER_OBJECT expressions per
    object (and asked attribute); seeded by the scene."""
    questions, expressions, kinds = 0, 0, Counter()
    for scene in scenes:
        d = json.loads(json.dumps(scene_annotations(scene)))
        asked = related_attribute_questions(scene)
        assert asked == related_attribute_questions(scene)  # the scene's own stream, not a shared generator
        per_object = Counter()
        for q in asked:
            m = re.fullmatch(r"what (color|shape|size) is (the .+)\?", q["question"])
            i = unique_referent(m.group(2), d)
            assert relation_decides(m.group(2), d), q
            assert d["objects"][i][m.group(1)] == q["answer"] and q["type"] == m.group(1)
            target = re.match(r"the (.+?) (?:left of|right of|above|below) ", m.group(2)).group(1)
            assert m.group(1) not in parse_np(target), q  # the asked attribute is not said
            per_object[i, m.group(1)] += 1
            kinds[m.group(1)] += 1
        assert max(per_object.values(), default=0) <= RELATED_PER_OBJECT
        named = related_expressions(scene)
        for r in named:
            assert unique_referent(r["expression"], d) == r["object"] and relation_decides(r["expression"], d), r
            assert r["box"] == d["objects"][r["object"]]["box"]
        assert max(Counter(r["object"] for r in named).values(), default=0) <= RELATED_PER_OBJECT
        questions, expressions = questions + len(asked), expressions + len(named)
    assert questions > 5 * N_SCENES and expressions > 2 * N_SCENES and set(kinds) == {"color", "shape", "size"}


def test_retrieval_captions_true_and_negatives_false(annotations):
    for scene in annotations:
        captions = scene["captions"]
        assert len(captions) == 5 and len(set(captions)) == 5
        for caption in captions:
            assert caption_truth(caption, scene) is True, caption
        for neg in scene["negatives"]:
            assert caption_truth(neg["caption"], scene) is False, neg
            positive = captions[neg["positive"]].split()
            words = neg["caption"].split()
            if neg["changed"] == "count":
                assert words[-1].rstrip(".s") == positive[-1].rstrip(".s")
            else:  # exactly one word (an attribute or the relation) differs
                assert len(words) == len(positive) and sum(a != b for a, b in zip(words, positive)) == 1


def test_false_listings_are_false_near_misses_of_the_listing(scenes, annotations):
    """Each is false of its scene (checked by the independent parser above) and one step from the true listing:
    the same number of objects with exactly one word changed, or one object more or fewer."""
    steps = Counter()
    for scene, ann in zip(scenes, annotations):
        listing = ann["captions"][0]
        false = false_listings(scene, np.random.default_rng(0), 7)
        assert len(false) == len(set(false)) == 7 and listing not in false
        n = len(re.split(r", | and ", listing))
        for caption in false:
            assert caption_truth(caption, ann) is False, caption
            items = re.split(r", | and ", caption.rstrip("."))
            assert abs(len(items) - n) <= 1
            if len(items) == n:
                words, true_words = caption.split(), listing.split()
                changed = [(a, b) for a, b in zip(words, true_words) if a != b]
                # an attribute swapped in place (one word; 'a' -> 'an' may follow it)
                assert 1 <= len(changed) <= 2 and len(words) == len(true_words), (caption, listing)
                steps["attribute"] += 1
            else:
                steps["fewer" if len(items) < n else "more"] += 1
    assert steps["attribute"] and steps["fewer"] and steps["more"], steps
    assert false_listings(scenes[0], np.random.default_rng(0), 7) == false_listings(scenes[0], np.random.default_rng(0), 7)


def test_nlvr2_labels_and_balance(scenes, annotations):
    examples = [ex for k in range(0, N_SCENES, 2) for ex in nlvr2_examples(scenes[k], scenes[k + 1])]
    assert sum(ex["label"] for ex in examples) * 2 == len(examples) == N_SCENES // 2 * TaskConfig().nlvr2_per_pair
    by_id = {a["id"]: a for a in annotations}
    for ex in examples:
        left, right = by_id[ex["left"]], by_id[ex["right"]]
        s = ex["statement"]
        if m := re.fullmatch(r"the (left|right) image has more (.+) than the (?:left|right) image\.", s):
            first, second = (left, right) if m.group(1) == "left" else (right, left)
            truth = count(m.group(2), first) > count(m.group(2), second)
        elif m := re.fullmatch(r"the (left|right) image contains exactly (\d+) (.+)\.", s):
            truth = count(m.group(3), left if m.group(1) == "left" else right) == int(m.group(2))
        else:
            m = re.fullmatch(r"(both images|exactly one image|neither image) contains? (an? .+)\.", s)
            present = [count(indefinite(m.group(2)), side) > 0 for side in (left, right)]
            truth = {"both images": all(present), "exactly one image": sum(present) == 1,
                     "neither image": not any(present)}[m.group(1)]
        assert truth == ex["label"], ex


def test_grounding_phrases_and_word_relations(annotations):
    for scene in annotations:
        for g in scene["grounding"]:
            text = g["caption"]
            nouns = {}
            for phrase in g["phrases"]:
                s, e = phrase["span"]
                i = unique_referent("the " + indefinite(text[s:e]), scene)
                assert i == phrase["object"] and phrase["box"] == scene["objects"][i]["box"]
                nouns[(e - len(scene["objects"][i]["shape"]), e)] = i
            for rel in g["relations"]:
                word = text[slice(*rel["word"])]
                targets = [nouns[tuple(t)] for t in rel["targets"]]  # every target is a phrase's noun
                if rel["label"] in ("size", "color"):
                    assert scene["objects"][targets[0]][rel["label"]] == word
                else:
                    assert rel["label"] == "relation" and word in RELATION_WORDS
                    a, b = (scene["objects"][t] for t in targets)
                    assert holds(word, a, b, scene) is True


def test_multiple_choice_has_exactly_one_correct(annotations):
    for scene in annotations:
        for q in scene["mc"]:
            choices = q["choices"]
            assert len(choices) == 4 and len(set(choices)) == 4
            if q["question"] == "which of these is in the image?":
                correct = [count(indefinite(c), scene) > 0 for c in choices]
            elif m := re.fullmatch(r"how many (.+) are there\?", q["question"]):
                correct = [c == str(count(m.group(1), scene)) for c in choices]
            else:
                m = re.fullmatch(r"what color is (the .+)\?", q["question"])
                correct = [c == scene["objects"][unique_referent(m.group(1), scene)]["color"] for c in choices]
            assert correct.count(True) == 1 and correct.index(True) == q["answer"]


# ---- cache ----------------------------------------------------------------------------------------------

SMALL = ShapesConfig(world=WorldConfig(seed=5, height=96, width=112), splits=(("train", 6), ("val", 4)))


def test_cache_builds_identically_serial_and_parallel(tmp_path):
    serial = build_shapes(SMALL, tmp_path / "a", workers=1, progress=False)
    parallel = build_shapes(SMALL, tmp_path / "b", workers=2, progress=False)
    files = sorted(p.relative_to(serial) for p in serial.rglob("*") if p.is_file())
    assert len(files) == 1 + 2 * 2 + 6 + 4  # config, (annotations, nlvr2) per split, one PNG per scene
    for rel in files:
        assert (serial / rel).read_bytes() == (parallel / rel).read_bytes(), rel
    split = load_split("train", SMALL, tmp_path / "a")
    assert len(split) == 6 and len(split.nlvr2) == 3 * SMALL.tasks.nlvr2_per_pair
    assert split.image(2).size == (112, 96)
    assert np.array_equal(np.asarray(split.image(2)), np.asarray(render_scene(split.scene(2))))
    assert split.scene(2) == generate_scene(SMALL.world, "train", 2)


def test_cache_root_from_env(tmp_path, monkeypatch):
    monkeypatch.setenv("VLSERVE_CACHE", str(tmp_path))
    assert dataset_dir(SMALL).parent == tmp_path / "shapes"
    assert dataset_dir(SMALL) != dataset_dir(ShapesConfig(world=WorldConfig(seed=6), splits=SMALL.splits))
