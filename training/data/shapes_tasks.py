"""Task annotations derived from a shapes-world scene graph; every gold label is unambiguous by construction."""
from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass

import numpy as np

from .shapes_world import (
    ALL_DESCS, COLOR_NAMES, MAX_OBJECTS, OPPOSITE, RELATIONS, SHAPES, SIZES, Desc, Scene, article,
    attribute_descs, full_desc, scene_relation, scene_rng, scene_to_dict,
)

# One answer vocabulary for every VQA question (and the VQA head's label list).
ANSWERS = ["yes", "no", *COLOR_NAMES, *SHAPES, *SIZES, *(str(n) for n in range(MAX_OBJECTS + 1))]
ATTRIBUTE_VALUES = {"shape": SHAPES, "color": COLOR_NAMES, "size": SIZES}
FULL_DESCS = tuple(Desc(s, c, z) for s in SHAPES for c in COLOR_NAMES for z in SIZES)  # every object that can be drawn
# rng streams of scene_rng, apart from the scene's own draws (stream 0): tasks, pairs, the related_* training sets
TASK_STREAM, PAIR_STREAM, RELATED_QA_STREAM, RELATED_REFER_STREAM = 1, 2, 3, 4


@dataclass(frozen=True)
class TaskConfig:
    """How many annotations of each task one scene (or scene pair) gets."""

    vqa_per_type: int = 2  # per question type (color, shape, size, count, exists, relation) and scene
    captions_per_image: int = 5  # true retrieval captions per image
    negatives_per_caption: int = 1  # hard negatives (one attribute or count changed, false) per caption
    nlvr2_per_pair: int = 4  # statements per image pair, half true and half false
    mc_per_scene: int = 2  # multiple-choice questions per scene
    mc_choices: int = 4  # candidates per multiple-choice question, exactly one correct

    def __post_init__(self):
        if self.nlvr2_per_pair % 2:
            raise ValueError("nlvr2_per_pair must be even: every pair gets as many true as false statements")


@dataclass(frozen=True)
class Ref:
    """A referring expression: a description, optionally related to a uniquely described anchor."""

    target: Desc
    relation: str | None = None
    anchor: Desc | None = None

    def words(self) -> list[str]:
        words = ["the", *self.target.words()]
        if self.relation is not None:
            words += [*self.relation.split(), "the", *self.anchor.words()]
        return words

    def text(self) -> str:
        return " ".join(self.words())

    def length(self) -> int:
        """len(self.words()) without building them: ranking candidates is the slow part of `describe`."""
        tail = len(self.relation.split()) + 1 + self.anchor.n_words() if self.relation is not None else 0
        return 1 + self.target.n_words() + tail


def pick(rng: np.random.Generator, items: list, k: int) -> list:
    """Up to k items without replacement, kept in their original order."""
    if k <= 0 or not items:
        return []
    return [items[i] for i in sorted(rng.permutation(len(items))[:k])]


def matching(scene: Scene, desc: Desc) -> tuple[int, ...]:
    return scene.match_table[desc]


def is_unique_ref(scene: Scene, ref: Ref, i: int) -> bool:
    """Does ref pick out object i and no other one?"""
    if ref.relation is None:
        return matching(scene, ref.target) == (i,)
    anchors = matching(scene, ref.anchor)
    if len(anchors) != 1 or anchors[0] == i:
        return False
    j = anchors[0]
    values = {k: scene_relation(scene, ref.relation, k, j) for k in matching(scene, ref.target) if k != j}
    # The referent must clearly hold and every other candidate clearly fail: an unclear one could be meant too.
    return values.get(i) is True and all(v is False for k, v in values.items() if k != i)


def simple_ref(scene: Scene, i: int, exclude: frozenset[str] = frozenset()) -> Ref | None:
    """The shortest attribute-only description of object i that fits no other object."""
    return next((Ref(d) for d in attribute_descs(scene.objects[i], exclude) if matching(scene, d) == (i,)), None)


def describe(scene: Scene, i: int, exclude: frozenset[str] = frozenset()) -> Ref | None:
    """Shortest unambiguous expression for object i (attributes first, then relative to an anchor)."""
    ref = simple_ref(scene, i, exclude)
    if ref is not None:
        return ref
    anchors = [(j, simple_ref(scene, j)) for j in range(len(scene.objects)) if j != i]
    candidates = [Ref(desc, rel, anchor.target) for j, anchor in anchors if anchor is not None
                  for desc in attribute_descs(scene.objects[i], exclude) for rel in RELATIONS]
    candidates.sort(key=Ref.length)  # stable: equal lengths keep the enumeration order
    return next((r for r in candidates if is_unique_ref(scene, r, i)), None)


def related_refs(scene: Scene, i: int, exclude: frozenset[str] = frozenset()) -> list[Ref]:
    """Every expression that picks out object i only through its relation to a uniquely described anchor ("the
    shape left of the red circle"): its own description fits other objects than the anchor too, so the relation
    decides."""
    anchors = [(j, simple_ref(scene, j)) for j in range(len(scene.objects)) if j != i]
    return [ref for j, anchor in anchors if anchor is not None
            for desc in attribute_descs(scene.objects[i], exclude) if len(set(matching(scene, desc)) - {j}) > 1
            for rel in RELATIONS if is_unique_ref(scene, ref := Ref(desc, rel, anchor.target), i)]


def count_phrase(n: int, desc: Desc) -> str:
    """'no red circles', '1 red circle', '3 red circles'."""
    return f"no {desc.text(plural=True)}" if n == 0 else f"{n} {desc.text(plural=n != 1)}"


def indefinite(desc: Desc) -> str:
    text = desc.text()
    return f"{article(text)} {text}"


# ---- VQA -------------------------------------------------------------------------------------------------

def attribute_questions(scene: Scene, attribute: str) -> list[dict]:
    """'what color is the circle?' for every object describable without naming the asked attribute."""
    out = []
    for i, obj in enumerate(scene.objects):
        ref = describe(scene, i, exclude=frozenset({attribute}))
        if ref is not None:
            out.append(qa(f"what {attribute} is {ref.text()}?", getattr(obj, attribute), attribute))
    return out


def qa(question: str, answer: str, qtype: str) -> dict:
    assert answer in ANSWERS, answer
    return {"question": question, "answer": answer, "type": qtype}


def count_questions(scene: Scene, rng: np.random.Generator, k: int) -> list[dict]:
    """'how many red circles are there?': the answer is drawn first, else almost every answer would be '1'."""
    by_count: dict[int, list[Desc]] = {}
    for d in ALL_DESCS:
        by_count.setdefault(len(matching(scene, d)), []).append(d)
    out = []
    for n in pick(rng, sorted(by_count), k):
        d = by_count[n][int(rng.integers(len(by_count[n])))]
        out.append(qa(f"how many {d.text(plural=True)} are there?", str(n), "count"))
    return out


def exists_questions(scene: Scene, rng: np.random.Generator, k: int) -> list[dict]:
    """Balanced yes/no: 'is there a small green triangle?'."""
    said = [d for d in ALL_DESCS if d != Desc()]  # "is there an object?" is always yes
    yes = pick(rng, [d for d in said if matching(scene, d)], (k + 1) // 2)
    no = pick(rng, [d for d in said if not matching(scene, d)], k // 2)
    return [qa(f"is there {indefinite(d)}?", "yes" if d in yes else "no", "exists") for d in yes + no]


def relation_questions(scene: Scene) -> list[dict]:
    """'is the red circle left of the blue triangle?' for uniquely described pairs in a clear relation."""
    refs = [simple_ref(scene, i) for i in range(len(scene.objects))]
    out = []
    for i, a in enumerate(refs):
        for j, b in enumerate(refs):
            for rel in RELATIONS:
                value = scene_relation(scene, rel, i, j) if a is not None and b is not None and i != j else None
                if value is not None:
                    out.append(qa(f"is {a.text()} {rel} {b.text()}?", "yes" if value else "no", "relation"))
    return out


# side -> (axis, far): "on the left" asks whether the centre is near x = 0, "on the right" near x = width
SIDES = {"on the left": (0, False), "on the right": (0, True), "at the top": (1, False), "at the bottom": (1, True)}
ONE_SIDE = ("on the left", "at the top")  # one side per axis: the answer follows the position alone


def position_questions(scene: Scene, sides: tuple[str, ...] = tuple(SIDES)) -> list[dict]:
    """'is the red circle on the left?' for every object with an attribute-only description whose centre lies in the
    outer 40% of the image along that axis: "yes" on the asked side, "no" on the opposite one (objects near the
    middle are not asked about). With all four sides every object is asked both ways, so the answer is the
    exclusive-or of position and word; with ONE_SIDE it follows the position alone (a curriculum's first step,
    training.finetune.FinetuneConfig.curriculum). Training material only: not part of a split's VQA questions."""
    out = []
    for i, obj in enumerate(scene.objects):
        ref = simple_ref(scene, i)
        if ref is None:
            continue
        centre = (obj.center[0] / scene.width, obj.center[1] / scene.height)
        for side in sides:
            axis, far = SIDES[side]
            where = 1 - centre[axis] if far else centre[axis]  # 0 = at that side's edge
            if where < 0.4 or where > 0.6:
                out.append(qa(f"is {ref.text()} {side}?", "yes" if where < 0.4 else "no", "position"))
    return out


def all_attribute_questions(scene: Scene) -> list[dict]:
    """Every colour, shape and size question a scene has (vqa_questions samples per_type of each)."""
    return [q for a in ATTRIBUTE_VALUES for q in attribute_questions(scene, a)]


RELATED_PER_OBJECT = 2  # related_* training sets: expressions drawn per object (and asked attribute)


def related_attribute_questions(scene: Scene, per_object: int = RELATED_PER_OBJECT) -> list[dict]:
    """'what color is the shape left of the red circle?': colour, shape and size questions about objects named
    through a relation that decides (related_refs), per_object expressions drawn for each object and attribute.
    A split's questions name an object through a relation only where nothing shorter fits it alone (describe), so
    they are few; these are training material that makes the relation matter. Seeded by the scene."""
    rng = scene_rng(scene.seed, scene.split, scene.index, RELATED_QA_STREAM)
    return [qa(f"what {attribute} is {ref.text()}?", getattr(obj, attribute), attribute)
            for attribute in ATTRIBUTE_VALUES for i, obj in enumerate(scene.objects)
            for ref in pick(rng, related_refs(scene, i, frozenset({attribute})), per_object)]


def vqa_questions(scene: Scene, rng: np.random.Generator, per_type: int) -> list[dict]:
    pools = [attribute_questions(scene, a) for a in ("color", "shape", "size")] + [relation_questions(scene)]
    picked = [q for pool in pools for q in pick(rng, pool, per_type)]
    return picked + count_questions(scene, rng, per_type) + exists_questions(scene, rng, per_type)


# ---- refer -----------------------------------------------------------------------------------------------

def refer_expressions(scene: Scene) -> list[dict]:
    """The shortest unambiguous expression of every object that has one."""
    out = []
    for i, obj in enumerate(scene.objects):
        ref = describe(scene, i)
        if ref is not None:
            out.append({"expression": ref.text(), "object": i, "box": list(obj.box)})
    return out


def related_expressions(scene: Scene, per_object: int = RELATED_PER_OBJECT) -> list[dict]:
    """Referring expressions that name each object through a relation that decides (related_refs), per_object drawn
    for each object; training material, as related_attribute_questions. Seeded by the scene."""
    rng = scene_rng(scene.seed, scene.split, scene.index, RELATED_REFER_STREAM)
    return [{"expression": ref.text(), "object": i, "box": list(obj.box)} for i, obj in enumerate(scene.objects)
            for ref in pick(rng, related_refs(scene, i), per_object)]


# ---- retrieval: statements are tuples ("listing", descs) | ("exists", d) | ("count", d, n) | ("related", a, rel, b)

def statement_text(st: tuple) -> str:
    kind = st[0]
    if kind == "listing":
        items = [indefinite(d) for d in st[1]]
        return (", ".join(items[:-1]) + " and " + items[-1] if len(items) > 1 else items[0]) + "."
    if kind == "exists":
        return f"there is {indefinite(st[1])}."
    if kind == "count":
        return f"there {'is' if st[2] == 1 else 'are'} {count_phrase(st[2], st[1])}."
    return f"{indefinite(st[1])} is {st[2]} {indefinite(st[3])}."


def statement_truth(scene: Scene, st: tuple) -> bool | None:
    """True or False for the scene; None when it hangs on an unclear relation."""
    kind = st[0]
    if kind == "listing":
        return Counter(st[1]) == Counter(full_desc(o) for o in scene.objects)
    if kind == "exists":
        return bool(matching(scene, st[1]))
    if kind == "count":
        return len(matching(scene, st[1])) == st[2]
    values = {scene_relation(scene, st[2], i, j)
              for i in matching(scene, st[1]) for j in matching(scene, st[3]) if i != j}
    return True if True in values else (None if None in values else False)


def desc_mutations(desc: Desc) -> list[tuple[Desc, str]]:
    """Every description that differs from desc in exactly one stated attribute."""
    return [(desc.replace(**{k: other}), k) for k, v in desc.attributes().items() if v is not None
            for other in ATTRIBUTE_VALUES[k] if other != v]


def statement_mutations(st: tuple) -> list[tuple[tuple, str]]:
    """Statements one attribute, count or relation away from st, with the name of what changed."""
    kind = st[0]
    if kind == "listing":
        descs = st[1]
        return [(("listing", descs[:k] + (m,) + descs[k + 1:]), what)
                for k, d in enumerate(descs) for m, what in desc_mutations(d)]
    if kind == "exists":
        return [(("exists", m), what) for m, what in desc_mutations(st[1])]
    if kind == "count":
        return [(("count", st[1], n), "count") for n in (st[2] - 1, st[2] + 1) if 0 <= n <= MAX_OBJECTS]
    _, a, rel, b = st
    return ([(("related", m, rel, b), what) for m, what in desc_mutations(a)]
            + [(("related", a, rel, m), what) for m, what in desc_mutations(b)]
            + [(("related", a, OPPOSITE[rel], b), "relation")])


def caption_pools(scene: Scene) -> dict[str, list[tuple]]:
    """True statements of each kind that a caption can be."""
    objs = scene.objects
    by_x = sorted(objs, key=lambda o: o.center)  # listed left to right, the way one reads the image
    present = [d for d in ALL_DESCS if matching(scene, d)]
    related = [("related", Desc(a.shape, a.color), rel, Desc(b.shape, b.color))
               for i, a in enumerate(objs) for j, b in enumerate(objs) for rel in RELATIONS
               if i != j and scene_relation(scene, rel, i, j)]
    return {
        "listing": [("listing", tuple(full_desc(o) for o in by_x))],
        "related": [st for st in dict.fromkeys(related) if statement_truth(scene, st)],
        "count": [("count", d, len(matching(scene, d))) for d in present],
        "exists": [("exists", d) for d in present if d != Desc()],
    }


def retrieval_captions(scene: Scene, rng: np.random.Generator, config: TaskConfig) -> tuple[list[str], list[dict]]:
    """True captions (the listing first, then other kinds in turn) and their false hard negatives."""
    pools = caption_pools(scene)
    chosen = pools.pop("listing")
    queues = [pick(rng, pool, config.captions_per_image) for pool in pools.values()]
    while len(chosen) < config.captions_per_image and any(queues):
        chosen += [q.pop(0) for q in queues if q][:config.captions_per_image - len(chosen)]
    negatives = []
    for k, st in enumerate(chosen):
        mutations = statement_mutations(st)
        # Try mutations in random order and keep the first false ones: checking them all is the slow part.
        tries = (mutations[m] for m in rng.permutation(len(mutations)))
        false = list(itertools.islice(((m, what) for m, what in tries if statement_truth(scene, m) is False),
                                      config.negatives_per_caption))
        negatives += [{"caption": statement_text(m), "positive": k, "changed": what} for m, what in false]
    return [statement_text(st) for st in chosen], negatives


def false_listings(scene: Scene, rng: np.random.Generator, k: int) -> list[str]:
    """Up to k listing captions false of the scene, each one step from its true listing: one attribute of one
    object changed, one object left out, or one more object put in (the near misses a ranking must tell apart)."""
    listing = caption_pools(scene)["listing"][0]
    descs = listing[1]
    near = [m for m, _ in statement_mutations(listing)]
    if len(descs) > 1:
        near += [("listing", descs[:j] + descs[j + 1:]) for j in range(len(descs))]
    if len(descs) < MAX_OBJECTS:
        near += [("listing", descs[:j] + (FULL_DESCS[int(rng.integers(len(FULL_DESCS)))],) + descs[j:])
                 for j in range(len(descs) + 1)]
    texts = dict.fromkeys(statement_text(near[m]) for m in rng.permutation(len(near))
                          if statement_truth(scene, near[m]) is False)
    return list(texts)[:k]


# ---- grounding: phrase -> box links and word -> word relations, as character spans -----------------------

def _append(parts: list[str], text: str) -> list[int]:
    """Append text to the caption being built; return its character span."""
    start = sum(map(len, parts))
    parts.append(text)
    return [start, start + len(text)]


def _phrase(parts: list[str], scene: Scene, i: int, links: dict) -> list[int]:
    """Write 'a large red circle', record its box link and attribute -> noun relations; return the noun span."""
    obj = scene.objects[i]
    start = _append(parts, f"{article(obj.size)} ")[0]
    size = _append(parts, obj.size)
    _append(parts, " ")
    color = _append(parts, obj.color)
    _append(parts, " ")
    noun = _append(parts, obj.shape)
    links["phrases"].append({"span": [start, noun[1]], "object": i, "box": list(obj.box)})
    links["relations"] += [{"label": "size", "word": size, "targets": [noun]},
                           {"label": "color", "word": color, "targets": [noun]}]
    return noun


def grounding_caption(scene: Scene, rng: np.random.Generator) -> dict | None:
    """A caption over objects whose full description is unique, pairing them in clear relations where possible."""
    unique = [i for i, o in enumerate(scene.objects) if matching(scene, full_desc(o)) == (i,)]
    if not unique:
        return None
    order = [unique[k] for k in rng.permutation(len(unique))]
    parts: list[str] = []
    links: dict = {"phrases": [], "relations": []}
    for pair in (order[n:n + 2] for n in range(0, len(order), 2)):
        _append(parts, " " if parts else "")
        rels = [r for r in RELATIONS if len(pair) == 2 and scene_relation(scene, r, pair[0], pair[1])]
        if rels:
            noun_a = _phrase(parts, scene, pair[0], links)
            _append(parts, " is ")
            rel = _append(parts, rels[int(rng.integers(len(rels)))])
            _append(parts, " ")
            noun_b = _phrase(parts, scene, pair[1], links)
            links["relations"].append({"label": "relation", "word": rel, "targets": [noun_a, noun_b]})
        else:
            _append(parts, "there is ")
            _phrase(parts, scene, pair[0], links)
            if len(pair) == 2:
                _append(parts, " and ")
                _phrase(parts, scene, pair[1], links)
        _append(parts, ".")
    return {"caption": "".join(parts), **links}


# ---- multiple choice -------------------------------------------------------------------------------------

def mc_questions(scene: Scene, rng: np.random.Generator, vqa: list[dict], config: TaskConfig) -> list[dict]:
    """Colour, count and 'which of these is in the image?' questions with exactly one correct candidate."""
    def wrong_answers(q: dict) -> list[str]:
        if q["type"] == "color":
            return [c for c in COLOR_NAMES if c != q["answer"]]
        n = int(q["answer"])  # near counts only: "9" against a scene of at most 6 shapes would give it away
        return [str(m) for m in range(max(n - 3, 0), n + 4) if m != n and m <= MAX_OBJECTS]

    pool = [(q["question"], q["answer"], wrong_answers(q)) for q in vqa if q["type"] in ("color", "count")]
    absent = [indefinite(d) for d in ALL_DESCS if d.shape and d.color and d.size and not matching(scene, d)]
    pool += [("which of these is in the image?", indefinite(full_desc(o)), absent) for o in scene.objects]
    out = []
    for question, answer, wrong in pick(rng, pool, config.mc_per_scene):
        choices = [answer] + pick(rng, wrong, config.mc_choices - 1)
        choices = [choices[k] for k in rng.permutation(len(choices))]
        out.append({"question": question, "choices": choices, "answer": choices.index(answer)})
    return out


# ---- NLVR2 -----------------------------------------------------------------------------------------------

def nlvr2_pools(left: Scene, right: Scene) -> dict[str, tuple[list[str], list[str]]]:
    """Every templated statement about the pair, by template, as (false statements, true statements)."""
    pools: dict[str, tuple[list[str], list[str]]] = {t: ([], []) for t in ("more", "exactly", "both", "one", "neither")}
    for d in ALL_DESCS:
        cl, cr = len(matching(left, d)), len(matching(right, d))
        plural = d.text(plural=True)
        pools["more"][cl > cr].append(f"the left image has more {plural} than the right image.")
        pools["more"][cr > cl].append(f"the right image has more {plural} than the left image.")
        for side, n in (("left", cl), ("right", cr)):
            for m in (n - 1, n, n + 1):
                if m > 0:
                    pools["exactly"][m == n].append(f"the {side} image contains exactly {count_phrase(m, d)}.")
        if d != Desc():  # "an object" is in every image
            some = indefinite(d)
            pools["both"][cl > 0 and cr > 0].append(f"both images contain {some}.")
            pools["one"][(cl > 0) != (cr > 0)].append(f"exactly one image contains {some}.")
            pools["neither"][cl == 0 and cr == 0].append(f"neither image contains {some}.")
    return pools


def nlvr2_examples(left: Scene, right: Scene, config: TaskConfig = TaskConfig()) -> list[dict]:
    """Statements about (left, right), exactly half true; the template is drawn first so no template leaks the label."""
    rng = scene_rng(left.seed, left.split, left.index, PAIR_STREAM)
    pools = nlvr2_pools(left, right)
    out = []
    for label in [True, False] * (config.nlvr2_per_pair // 2):
        templates = [t for t, p in pools.items() if p[label]]
        template = templates[int(rng.integers(len(templates)))]
        statement = pools[template][label].pop(int(rng.integers(len(pools[template][label]))))
        out.append({"left": left.scene_id, "right": right.scene_id, "statement": statement, "label": label,
                    "template": template})
    return out


def scene_annotations(scene: Scene, config: TaskConfig = TaskConfig()) -> dict:
    """The scene graph plus every single-image task annotation, as JSON-ready data."""
    rng = scene_rng(scene.seed, scene.split, scene.index, TASK_STREAM)
    vqa = vqa_questions(scene, rng, config.vqa_per_type)
    captions, negatives = retrieval_captions(scene, rng, config)
    grounding = grounding_caption(scene, rng)
    return {
        **scene_to_dict(scene),
        "vqa": vqa,
        "refer": refer_expressions(scene),
        "captions": captions,
        "negatives": negatives,
        "grounding": [grounding] if grounding else [],
        "mc": mc_questions(scene, rng, vqa, config),
    }


__all__ = [
    "ANSWERS", "Ref", "TaskConfig", "describe", "false_listings", "grounding_caption", "is_unique_ref", "mc_questions",
    "nlvr2_examples", "refer_expressions", "retrieval_captions", "scene_annotations", "vqa_questions",
]
