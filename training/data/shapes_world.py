"""Shapes world: a deterministic, seeded generator of easy-VQA-style scenes with their scene graph."""
from __future__ import annotations

import functools
import itertools
import math
import zlib
from dataclasses import asdict, dataclass
from typing import NamedTuple

import numpy as np
from PIL import Image, ImageDraw

SHAPES = ("circle", "rectangle", "triangle")
# easy-VQA's palette (its gen_data/color.py), so easy-VQA images look in-distribution for our models.
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (255, 0, 0),
    "green": (0, 255, 0),
    "blue": (0, 0, 255),
    "yellow": (255, 255, 0),
    "teal": (0, 128, 128),
    "brown": (165, 42, 42),
    "gray": (128, 128, 128),
    "black": (0, 0, 0),
}
COLOR_NAMES = tuple(COLORS)
SIZES = ("small", "large")
RELATIONS = ("left of", "right of", "above", "below")
OPPOSITE = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}
MAX_OBJECTS = 10  # count answers are a fixed vocabulary, so scenes may not hold more than this
GENERIC_NOUN = "object"  # the noun of a description that does not name the shape

Box = tuple[float, float, float, float]


@dataclass(frozen=True)
class WorldConfig:
    """Everything that decides what scenes look like; its hash names the on-disk cache."""

    seed: int = 0  # with (split, index) fixes every scene
    height: int = 128  # image height in pixels
    width: int = 128  # image width in pixels
    min_objects: int = 1  # objects drawn per scene, uniform in [min, max]
    max_objects: int = 6
    small_side: tuple[float, float] = (0.09, 0.14)  # side range as a fraction of min(h, w); the gap to
    large_side: tuple[float, float] = (0.22, 0.30)  # "large" keeps the size words unambiguous
    max_iou: float = 0.05  # placements overlapping an earlier box more than this are re-drawn
    max_covered: float = 0.2  # nor may a box cover this much of a smaller one: no shape hides behind another
    max_tries: int = 200  # placement attempts before an object is dropped (rare, only in crowded scenes)
    relation_margin: float = 0.05  # centres closer than this fraction of the image: relation unclear, never used

    def __post_init__(self):
        if not 1 <= self.min_objects <= self.max_objects <= MAX_OBJECTS:
            raise ValueError(f"need 1 <= min_objects <= max_objects <= {MAX_OBJECTS}")
        if self.small_side[1] >= self.large_side[0]:
            raise ValueError("small and large side ranges must not overlap")


@dataclass(frozen=True)
class SceneObject:
    """One drawn shape: its class, attributes and pixel box (x1, y1, x2, y2, pixel-edge coordinates)."""

    shape: str
    color: str
    size: str
    box: Box

    @property
    def center(self) -> tuple[float, float]:
        return (self.box[0] + self.box[2]) / 2, (self.box[1] + self.box[3]) / 2


@dataclass(frozen=True)
class Scene:
    """A scene graph; `render_scene` turns it into the image."""

    seed: int
    split: str
    index: int
    height: int
    width: int
    background: tuple[int, int, int]
    objects: tuple[SceneObject, ...]
    relation_margin: float  # WorldConfig.relation_margin, kept so that a scene answers relation questions alone

    @property
    def scene_id(self) -> str:
        return f"{self.split}/{self.index:06d}"

    # Task generation asks the same questions of a scene thousands of times: answer each once.
    # (cached_property writes the instance __dict__, so it works on a frozen dataclass and stays out of eq/hash.)
    @functools.cached_property
    def match_table(self) -> dict[Desc, tuple[int, ...]]:
        """Indices of the objects every description fits."""
        table = dict.fromkeys(ALL_DESCS, ())
        for i, obj in enumerate(self.objects):
            for desc in attribute_descs(obj):
                table[desc] += (i,)
        return table

    @functools.cached_property
    def relation_table(self) -> dict[tuple[str, int, int], bool | None]:
        """relation_value of every ordered pair of distinct objects, with this scene's margin."""
        mx, my = self.relation_margin * self.width, self.relation_margin * self.height
        return {(rel, i, j): relation_value(rel, a, b, mx, my) for rel in RELATIONS
                for i, a in enumerate(self.objects) for j, b in enumerate(self.objects) if i != j}


class Desc(NamedTuple):
    """A noun phrase over attributes; None means 'not said' ("the red object" has only a colour)."""

    # A NamedTuple, not a dataclass: descriptions are hashed and compared ~10^3 times per scene, at C speed.
    shape: str | None = None
    color: str | None = None
    size: str | None = None

    def matches(self, obj: SceneObject) -> bool:
        return ((self.shape is None or self.shape == obj.shape) and (self.color is None or self.color == obj.color)
                and (self.size is None or self.size == obj.size))

    def attributes(self) -> dict[str, str | None]:
        return self._asdict()

    def words(self, plural: bool = False) -> list[str]:
        noun = self.shape or GENERIC_NOUN
        return [w for w in (self.size, self.color) if w] + [noun + "s" if plural else noun]

    def text(self, plural: bool = False) -> str:
        return _desc_text(self, plural)

    def n_words(self) -> int:
        return 1 + (self.size is not None) + (self.color is not None)

    def replace(self, **changes: str | None) -> Desc:
        return self._replace(**changes)


@functools.lru_cache(maxsize=None)  # 108 descriptions x 2: each wording is built once
def _desc_text(desc: Desc, plural: bool) -> str:
    return " ".join(desc.words(plural))


# Attribute subsets shortest first, and shape-naming before generic at equal length: the order in
# which descriptions are tried, so "the shortest description" has one deterministic tie-break.
_SUBSETS = sorted(
    (s for n in range(4) for s in itertools.combinations(("shape", "color", "size"), n)),
    key=lambda s: (len(s), "shape" not in s),
)


def attribute_descs(obj: SceneObject, exclude: frozenset[str] = frozenset()) -> tuple[Desc, ...]:
    """Every description of obj built from its own attributes (not using `exclude`), shortest first."""
    return _attribute_descs(obj.shape, obj.color, obj.size, exclude)


@functools.lru_cache(maxsize=None)  # 48 attribute combinations x a few excludes
def _attribute_descs(shape: str, color: str, size: str, exclude: frozenset[str]) -> tuple[Desc, ...]:
    values = {"shape": shape, "color": color, "size": size}
    return tuple(Desc(**{k: values[k] for k in s}) for s in _SUBSETS if not exclude.intersection(s))


def full_desc(obj: SceneObject) -> Desc:
    return Desc(obj.shape, obj.color, obj.size)


# Every describable attribute combination, including the empty one ("objects").
ALL_DESCS = tuple(Desc(s, c, z) for s in (None, *SHAPES) for c in (None, *COLOR_NAMES) for z in (None, *SIZES))


def article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def relation_value(rel: str, a: SceneObject, b: SceneObject, margin_x: float, margin_y: float) -> bool | None:
    """Is a `rel` b, judged on box centres? None when the centres are within the margin (unclear)."""
    dx = b.center[0] - a.center[0]  # > 0: a is left of b
    dy = b.center[1] - a.center[1]  # > 0: a is above b (image y grows downward)
    signed = {"left of": dx, "right of": -dx, "above": dy, "below": -dy}[rel]
    margin = margin_x if rel in ("left of", "right of") else margin_y
    return None if abs(signed) <= margin else signed > 0


def scene_relation(scene: Scene, rel: str, i: int, j: int) -> bool | None:
    """relation_value for distinct objects i and j of a scene, with the scene's margin."""
    return scene.relation_table[rel, i, j]


def box_iou(a: Box, b: Box) -> float:
    inter = _intersection(a, b)
    union = _area(a) + _area(b) - inter
    return inter / union if union > 0 else 0.0


def covered_fraction(a: Box, b: Box) -> float:
    """The largest fraction of either box that the other covers."""
    return _intersection(a, b) / max(min(_area(a), _area(b)), 1e-9)


def _area(a: Box) -> float:
    return max(a[2] - a[0], 0.0) * max(a[3] - a[1], 0.0)


def _intersection(a: Box, b: Box) -> float:
    w = min(a[2], b[2]) - max(a[0], b[0])
    h = min(a[3], b[3]) - max(a[1], b[1])
    return max(w, 0.0) * max(h, 0.0)


def split_key(split: str) -> int:
    # str hash() is salted per process; crc32 is stable across runs and machines.
    return zlib.crc32(split.encode())


def scene_rng(seed: int, split: str, index: int, stream: int = 0) -> np.random.Generator:
    """The generator of one scene; other streams (tasks, pairs) never shift the scene's own draws."""
    return np.random.default_rng([seed, split_key(split), index, stream])


def object_extent(rng: np.random.Generator, config: WorldConfig, shape: str, size: str) -> tuple[int, int]:
    """Width and height in whole pixels of a new object."""
    lo, hi = config.small_side if size == "small" else config.large_side
    unit = min(config.height, config.width)
    side = max(int(round(rng.uniform(lo, hi) * unit)), 2)
    if shape == "rectangle":
        return side, max(int(round(rng.uniform(lo, hi) * unit)), 2)
    if shape == "triangle":  # equilateral, base down: height = side * sqrt(3) / 2
        return side, max(int(round(side * math.sqrt(3) / 2)), 2)
    return side, side


def place_box(rng: np.random.Generator, config: WorldConfig, w: int, h: int, taken: list[Box]) -> Box | None:
    """Rejection-sample a position whose overlap with every taken box stays under the caps."""
    for _ in range(config.max_tries):
        x0 = int(rng.integers(0, config.width - w + 1))
        y0 = int(rng.integers(0, config.height - h + 1))
        box = (float(x0), float(y0), float(x0 + w), float(y0 + h))
        if all(box_iou(box, t) <= config.max_iou and covered_fraction(box, t) <= config.max_covered for t in taken):
            return box
    return None


def generate_scene(config: WorldConfig, split: str, index: int) -> Scene:
    """Scene `index` of `split`: depends only on (config, split, index), so any scene regenerates alone."""
    rng = scene_rng(config.seed, split, index)
    # easy-VQA's background: every channel uniform in [230, 255].
    background = tuple(int(v) for v in rng.integers(230, 256, size=3))
    objects: list[SceneObject] = []
    for _ in range(int(rng.integers(config.min_objects, config.max_objects + 1))):
        shape = SHAPES[rng.integers(len(SHAPES))]
        color = COLOR_NAMES[rng.integers(len(COLOR_NAMES))]
        size = SIZES[rng.integers(len(SIZES))]
        w, h = object_extent(rng, config, shape, size)
        box = place_box(rng, config, w, h, [o.box for o in objects])
        if box is not None:
            objects.append(SceneObject(shape, color, size, box))
    return Scene(config.seed, split, index, config.height, config.width, background, tuple(objects),
                 config.relation_margin)


def draw_object(draw: ImageDraw.ImageDraw, obj: SceneObject) -> None:
    # PIL's corner coordinates are inclusive pixel indices, the box is pixel edges: hence the -1.
    x0, y0, x1, y1 = obj.box[0], obj.box[1], obj.box[2] - 1, obj.box[3] - 1
    fill = COLORS[obj.color]
    if obj.shape == "circle":
        draw.ellipse([x0, y0, x1, y1], fill=fill)
    elif obj.shape == "rectangle":
        draw.rectangle([x0, y0, x1, y1], fill=fill)
    else:
        draw.polygon([(x0, y1), (x1, y1), ((x0 + x1) / 2, y0)], fill=fill)


def render_scene(scene: Scene) -> Image.Image:
    """The RGB image of a scene, objects drawn in order (later ones on top)."""
    image = Image.new("RGB", (scene.width, scene.height), scene.background)
    draw = ImageDraw.Draw(image)
    for obj in scene.objects:
        draw_object(draw, obj)
    return image


def scene_to_dict(scene: Scene) -> dict:
    """JSON-ready scene graph (the annotation file's core)."""
    d = asdict(scene)
    d["id"] = scene.scene_id
    return d


def scene_from_dict(d: dict) -> Scene:
    objects = tuple(SceneObject(o["shape"], o["color"], o["size"], tuple(o["box"])) for o in d["objects"])
    return Scene(d["seed"], d["split"], d["index"], d["height"], d["width"], tuple(d["background"]), objects,
                 d["relation_margin"])


__all__ = [
    "ALL_DESCS", "COLORS", "COLOR_NAMES", "MAX_OBJECTS", "OPPOSITE", "RELATIONS", "SHAPES", "SIZES", "Desc", "Scene",
    "SceneObject", "WorldConfig", "article", "attribute_descs", "box_iou", "full_desc", "generate_scene",
    "relation_value", "render_scene", "scene_from_dict", "scene_relation", "scene_rng", "scene_to_dict",
]
