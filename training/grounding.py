"""Grounding analysis after Li et al. 2020, "What Does BERT with Vision Look At?": every attention head as a classifier
from a word to the region it attends to most.

Entity grounding: for the last sub-word of each entity (a shapes-world caption's "a large red circle"), a head is right
when its most-attended region has IoU >= 0.5 with the phrase's gold box; the baseline always picks the detector's most
confident region. Syntactic grounding: for a dependency arc between a word and an entity noun, the word's most-attended
region should be the noun's referent (accuracy per relation). A head "attends to the image" when its text tokens put
more than 20% of their attention on regions. Single-stream presets are read at every layer (text rows, region columns
of the self-attention); two-stream presets at their cross-modality layers (text attending to regions).
"""
from __future__ import annotations

import errno
import json
import os
import tempfile
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from models import HeadConfig, VLModel
from models.attention import layer_kind, text_region_attention  # shared with the service's explain=true
from models.checkpoint import load_checkpoint
from models.detector import RegionDetector
from models.detector.io import load_detector
from models.feature_files import FeatureFile
from models.tokenizer import VLTokenizer

from .data.region_table import RegionTable, extract_table
from .data.shapes_cache import ShapesConfig, cache_root, config_hash
from .data.shapes_tasks import TaskConfig, scene_annotations
from .data.shapes_world import WorldConfig, generate_scene, render_scene
from .data.vl_tasks import Example, collate
from .metrics import box_iou, confidence_baseline_hits, grounding_hits, image_attention_fraction

IOU = 0.5  # a predicted region is right with IoU >= this to the gold box
ACTIVE = 0.2  # a head whose text tokens put more than this share of their attention on regions attends to the image
MAX_TEXT = 64  # tokens; the longest shapes-world grounding caption is 42 with [CLS] and [SEP]
ENTITY = "entity"
# Dependency arcs of the templated captions "a large red circle is left of a small blue triangle." (spaCy labels),
# read off the generator instead of parsed. The word that attends is the one without a referent of its own:
#   det, amod:size, amod:color  the article / adjective (dependent) -> the noun it belongs to (head)
#   nsubj                       the copula "is" (head) -> the subject noun (dependent)
#   pobj                        the preposition ("of" of "left of", "above", ...) (head) -> its object noun (dependent)
RELATIONS = ("det", "amod:size", "amod:color", "nsubj", "pobj")

Box = tuple[float, float, float, float]


@dataclass(frozen=True)
class Probe:
    """One word every head classifies: it should attend to the region of `box`."""

    kind: str  # ENTITY or one of RELATIONS
    end: int  # character offset just past the attending word in the caption (its last sub-word is read)
    box: Box  # gold pixel box x1, y1, x2, y2


@dataclass(frozen=True)
class GroundingExample:
    row: int  # scene index = region table row
    caption: str
    probes: tuple[Probe, ...]


def caption_probes(grounding: dict) -> tuple[Probe, ...]:
    """Entity and dependency probes of one shapes-world grounding annotation (caption, phrases, relations)."""
    text = grounding["caption"]
    box_of: dict[int, Box] = {}  # noun end -> its phrase's gold box
    probes = []
    for phrase in grounding["phrases"]:
        start, end = phrase["span"]
        box_of[end] = tuple(phrase["box"])
        probes.append(Probe(ENTITY, end, box_of[end]))  # the phrase ends with its noun
        probes.append(Probe("det", text.index(" ", start), box_of[end]))  # and opens with its article
    for rel in grounding["relations"]:
        (start, end), boxes = rel["word"], [box_of[t[1]] for t in rel["targets"]]
        if rel["label"] in ("size", "color"):
            probes.append(Probe(f"amod:{rel['label']}", end, boxes[0]))
            continue
        copula = len(text[:start].rstrip())  # "<subject> is <relation> <object>"
        if text[:copula].endswith(" is"):
            probes.append(Probe("nsubj", copula, boxes[0]))
        probes.append(Probe("pobj", end, boxes[1]))  # the relation's last word is the preposition
    return tuple(probes)


def split_scenes(split: str) -> int:
    """Scenes of the shapes-world `split` (one grounding caption at most each); ValueError naming the splits there are
    for another."""
    sizes = dict(ShapesConfig().splits)
    if split not in sizes:
        raise ValueError(f"unknown split {split!r}; choose one of {', '.join(sizes)}")
    return sizes[split]


def grounding_examples(count: int, split: str = "val", world: WorldConfig = WorldConfig(),
                       tasks: TaskConfig = TaskConfig()) -> list[GroundingExample]:
    """The grounding captions of shapes-world scenes 0, 1, ... of `split` (at most one per scene), `count` of them,
    fewer where the split's scenes run out first.

    Scenes are regenerated, not read from the split cache: they depend only on (world, split, index), so these are
    the cached dataset's scenes and annotations without building all of it. A `count` over the split's scenes is a
    ValueError before any is generated: no count of them could be met.
    """
    scenes = split_scenes(split)
    if count > scenes:
        raise ValueError(f"{count} grounding examples asked of the {split} split, which has {scenes} scenes "
                         f"(one caption at most each)")
    out: list[GroundingExample] = []
    for index in range(scenes):
        if len(out) >= count:
            break
        for g in scene_annotations(generate_scene(world, split, index), tasks)["grounding"][: count - len(out)]:
            out.append(GroundingExample(index, g["caption"], caption_probes(g)))
    if not out:
        raise ValueError(f"no grounding captions among the {split} split's scenes")
    return out


def scene_regions(detector: RegionDetector, fingerprint: str, scenes: int, split: str = "val",
                  world: WorldConfig = WorldConfig(), progress: bool = True) -> tuple[RegionTable, list[np.ndarray]]:
    """Regions of scenes 0..scenes-1 and each one's detector confidences (real regions only).

    They are cached in the file where fine-tuning caches the same scenes' regions (`prepare_task_data`), so an
    encoder's evaluation regions are extracted once for both.
    """
    path = cache_root() / "features" / fingerprint / f"shapes-{config_hash(ShapesConfig(world=world))}-{split}.vlfeat"
    table = extract_table(detector, fingerprint, lambda i: np.asarray(render_scene(generate_scene(world, split, i))),
                          scenes, path, progress=progress)
    with FeatureFile(path) as f:
        regions = [f[str(i)] for i in range(scenes)]
    return table, [r.obj_scores[: r.num_boxes] for r in regions]


@dataclass
class GroundingTally:
    """Hits of every (layer, head) and of the baseline per probe kind, and attention mass on regions, summed."""

    layers: int
    heads: int
    hits: dict[str, torch.Tensor] = field(default_factory=dict)  # kind -> (L, heads) probes grounded right
    baseline: Counter = field(default_factory=Counter)  # kind -> probes the most confident region grounds right
    counts: Counter = field(default_factory=Counter)  # kind -> probes
    reachable: Counter = field(default_factory=Counter)  # kind -> probes some region grounds right (the upper bound)
    region_mass: torch.Tensor | None = None  # (L, heads) share of attention on regions, summed over text tokens
    text_tokens: int = 0

    def add(self, attention: torch.Tensor, text_mask: torch.Tensor, region_mask: torch.Tensor, region_boxes: torch.Tensor,
            region_scores: torch.Tensor, kinds: list[str], tokens: torch.Tensor, gold: torch.Tensor, thresh: float = IOU) -> None:
        """One example: attention (L, heads, T, N), masks (T,) / (N,) with real regions first, region_boxes (N, 4)
        and region_scores (n_real,) in the gold boxes' pixels; probe kinds, their token index (P,) and gold boxes (P, 4)."""
        tokens_here = int(text_mask.sum())
        mass = image_attention_fraction(attention, text_mask, region_mask) * tokens_here  # (L, heads)
        self.region_mass = mass if self.region_mass is None else self.region_mass + mass
        self.text_tokens += tokens_here
        real = int(region_mask.sum())
        if real:  # without a region nothing is grounded: the probes only count as misses
            hits = grounding_hits(attention[:, :, tokens, :real], gold, region_boxes[:real], thresh)  # (L, heads, P)
            base = confidence_baseline_hits(region_scores[:real], gold, region_boxes[:real], thresh)  # (P,)
            reach = (box_iou(region_boxes[:real, None], gold[None]) >= thresh).any(0)  # (P,)
        for kind in dict.fromkeys(kinds):
            sel = torch.tensor([k == kind for k in kinds])
            self.counts[kind] += int(sel.sum())
            self.hits.setdefault(kind, torch.zeros(self.layers, self.heads, dtype=torch.long))
            if real:
                self.hits[kind] += hits[..., sel].sum(-1)
                self.baseline[kind] += int(base[sel].sum())
                self.reachable[kind] += int(reach[sel].sum())

    def accuracy(self, kind: str) -> torch.Tensor:
        """(L, heads) grounding accuracy of every head on the probes of `kind` (0 where there were none)."""
        hits = self.hits.get(kind, torch.zeros(self.layers, self.heads, dtype=torch.long))
        return hits.double() / max(self.counts[kind], 1)

    def baseline_accuracy(self, kind: str) -> float:
        return self.baseline[kind] / max(self.counts[kind], 1)

    def upper_bound(self, kind: str) -> float:
        """Share of the probes for which some region has IoU >= thresh: what the best possible head scores."""
        return self.reachable[kind] / max(self.counts[kind], 1)

    def image_attention(self) -> torch.Tensor:
        """(L, heads) mean share of their attention that text tokens put on regions."""
        return self.region_mass.double() / max(self.text_tokens, 1)


def probe_tokens(tokenizer: VLTokenizer, example: GroundingExample, text_len: int) -> list[tuple[str, int, Box]]:
    """(kind, index of the attending word's last sub-word in `[CLS] caption [SEP]`, gold box); truncated words dropped."""
    out = []
    for p in example.probes:
        index = len(tokenizer.token_ids(example.caption[: p.end]))  # words end where sub-words do; [CLS] is at 0
        if index < text_len - 1:  # the last real token is [SEP]
            out.append((p.kind, index, p.box))
    return out


@torch.inference_mode()
def tally_grounding(model: VLModel, tokenizer: VLTokenizer, examples: list[GroundingExample], table: RegionTable,
                    region_scores: list[np.ndarray], batch_size: int = 16, thresh: float = IOU,
                    progress: Callable[[Iterable], Iterable] = iter) -> GroundingTally:
    """Run the encoder on every caption with its scene's regions and count what each head grounds."""
    model.eval()
    tally: GroundingTally | None = None
    itm = HeadConfig(kind="itm")  # the plain `[CLS] text [SEP]` layout
    for s in progress(range(0, len(examples), batch_size)):
        batch = examples[s : s + batch_size]
        inputs, _ = collate("itm", [Example((e.row,), e.caption, 1) for e in batch], table, tokenizer, itm, MAX_TEXT)
        attention = text_region_attention(model, inputs).float()  # (L, B, heads, T, N)
        if tally is None:
            tally = GroundingTally(attention.shape[0], attention.shape[2])
        for b, example in enumerate(batch):
            text_mask = inputs.attention_mask[b]
            probes = probe_tokens(tokenizer, example, int(text_mask.sum()))
            kinds, tokens, gold = zip(*probes) if probes else ((), (), ())
            slots = inputs.region_mask.shape[-1]  # the batch's region slots (collate drops padding every image has)
            tally.add(attention[:, b], text_mask, inputs.region_mask[b], torch.from_numpy(table.pixel_boxes[example.row, :slots]),
                      torch.from_numpy(region_scores[example.row][:slots]), list(kinds), torch.tensor(tokens, dtype=torch.long),
                      torch.tensor(gold, dtype=torch.float32).reshape(-1, 4), thresh)
    if tally is None:
        raise ValueError("no grounding examples to analyse")
    return tally


def _head(layer: int, head: int, value: float) -> dict:
    return {"layer": layer + 1, "head": head + 1, "accuracy": round(value, 4)}


def summarize(tally: GroundingTally, layer_name: str = "layer", active: float = ACTIVE, **meta) -> dict:
    """The report (grounding.json): every head, the best one per probe kind against the baseline, the active heads.

    Layers and heads are numbered from 1, as in the paper.
    """
    entity = tally.accuracy(ENTITY)
    image = tally.image_attention()
    relations = [r for r in RELATIONS if tally.counts[r]]
    heads = [{"layer": l + 1, "head": h + 1, "entity": round(entity[l, h].item(), 4),
              "image_attention": round(image[l, h].item(), 4), "active": bool(image[l, h] > active),
              "syntactic": {r: round(tally.accuracy(r)[l, h].item(), 4) for r in relations}}
             for l in range(tally.layers) for h in range(tally.heads)]

    def best(kind: str) -> dict:
        acc = tally.accuracy(kind)
        l, h = divmod(int(acc.argmax()), tally.heads)
        return {**_head(l, h, acc[l, h].item()), "baseline": round(tally.baseline_accuracy(kind), 4),
                "margin_points": round(100 * (acc[l, h].item() - tally.baseline_accuracy(kind)), 2)}

    return {
        **meta,
        "layer_kind": layer_name, "layers": tally.layers, "heads_per_layer": tally.heads,
        "iou_threshold": IOU, "active_threshold": active,
        "entity_words": tally.counts[ENTITY],
        "baseline": round(tally.baseline_accuracy(ENTITY), 4),
        "upper_bound": round(tally.upper_bound(ENTITY), 4),
        "best_entity_head": best(ENTITY),
        "active_heads": sum(h["active"] for h in heads),
        "syntactic": {r: {"arcs": tally.counts[r], **best(r)} for r in relations},
        "heads": heads,
    }


def _pct(x: float) -> str:
    return f"{100 * x:.1f}"


def markdown_report(report: dict) -> str:
    """grounding.md: the summary, syntactic grounding per relation, and every head."""
    best, relations = report["best_entity_head"], list(report["syntactic"])
    lines = [
        f"# Grounding analysis: `{report.get('model', 'model')}`",
        "",
        f"{report.get('examples', '?')} shapes-world {report.get('split', '')} captions, {report['entity_words']} entity words; "
        f"{report.get('preset', '')} read at every {report['layer_kind']} ({report['layers']} x {report['heads_per_layer']} heads); "
        f"a region is right with IoU >= {report['iou_threshold']}.",
        "",
        f"**Entity grounding**: best head {report['layer_kind']} {best['layer']} head {best['head']}: {_pct(best['accuracy'])}% "
        f"vs {_pct(report['baseline'])}% for the detector-confidence baseline ({best['margin_points']:+.1f} points).",
        "",
        f"Some region matches {_pct(report['upper_bound'])}% of the entities (the most any head can score).",
        "",
        f"**Heads attending to the image** (> {_pct(report['active_threshold'])}% of their attention on regions): "
        f"{report['active_heads']} of {len(report['heads'])}.",
        "",
        "## Syntactic grounding",
        "",
        "| relation | arcs | best head (layer-head) | accuracy % | baseline % |",
        "|---|---:|---|---:|---:|",
        *(f"| {r} | {s['arcs']} | {s['layer']}-{s['head']} | {_pct(s['accuracy'])} | {_pct(s['baseline'])} |"
          for r, s in report["syntactic"].items()),
        "",
        "## Every head (accuracy %)",
        "",
        "| layer | head | entity | attention on regions % | active | " + " | ".join(relations) + " |",
        "|---:|---:|---:|---:|---|" + "---:|" * len(relations),
        *(f"| {h['layer']} | {h['head']} | {_pct(h['entity'])} | {_pct(h['image_attention'])} | {'yes' if h['active'] else 'no'} | "
          + " | ".join(_pct(h["syntactic"][r]) for r in relations) + " |" for h in report["heads"]),
    ]
    return "\n".join(lines) + "\n"


def plot_report(report: dict, path: Path) -> None:
    """grounding.png: entity accuracy of every head by layer against the baseline (the paper's Figure 3), and the
    best head per dependency relation against the baseline."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.2), layout="constrained")
    FigureCanvasAgg(fig)  # Agg: no display, no pyplot state
    left, right = fig.subplots(1, 2, width_ratios=(3, 2))
    heads = report["heads"]
    for active, style in ((True, dict(color="tab:blue", label="attends to the image")),
                          (False, dict(facecolors="none", edgecolors="gray", label="other heads"))):
        xs = [h["layer"] for h in heads if h["active"] == active]
        ys = [100 * h["entity"] for h in heads if h["active"] == active]
        if xs:
            left.scatter(xs, ys, s=22, **style)
    left.axhline(100 * report["baseline"], color="tab:red", linestyle="--", label="detector-confidence baseline")
    left.axhline(100 * report["upper_bound"], color="gray", linestyle=":", label="upper bound (some region matches)")
    left.set(xlabel=report["layer_kind"], ylabel="entity grounding accuracy (%)", ylim=(0, 105),
             xticks=range(1, report["layers"] + 1), title="Entity grounding per head")
    left.legend(loc="upper left", fontsize=8)
    relations = list(report["syntactic"])
    x = np.arange(len(relations))
    right.bar(x - 0.2, [100 * report["syntactic"][r]["accuracy"] for r in relations], 0.4, label="best head")
    right.bar(x + 0.2, [100 * report["syntactic"][r]["baseline"] for r in relations], 0.4, color="tab:red", alpha=0.6,
              label="baseline")
    right.set(ylim=(0, 105), ylabel="accuracy (%)", title="Syntactic grounding (best head per relation)")
    right.set_xticks(x, [f"{r}\n{report['syntactic'][r]['arcs']} arcs" for r in relations], fontsize=8)
    right.legend(loc="upper right", fontsize=8)
    fig.savefig(path, dpi=100)


REPORT_FILES = {"json": "grounding.json", "md": "grounding.md", "png": "grounding.png"}


def report_paths(out: Path) -> dict[str, Path]:
    """Where write_report puts each report file under `out`."""
    return {kind: Path(out) / name for kind, name in REPORT_FILES.items()}


def write_report(report: dict, out: Path) -> dict[str, Path]:
    """grounding.json, grounding.md and grounding.png under out, each written whole: all three go to temporaries
    beside them, renamed over them only once every one is written. A failure (OSError: a target that is a directory,
    a full disk) removes the temporaries and leaves the report files as they were; a failure in the renames leaves
    each one whole, old or new."""
    from models.file_modes import apply_umask

    out.mkdir(parents=True, exist_ok=True)
    paths = report_paths(out)
    temporaries: dict[str, Path] = {}
    try:
        for kind, path in paths.items():
            fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=path.suffix, dir=out)  # savefig reads the suffix
            os.close(fd)
            temporaries[kind] = Path(name)
            apply_umask(name)  # mkstemp's 0600 -> the mode a new file gets
        temporaries["json"].write_text(json.dumps(report, indent=2))
        temporaries["md"].write_text(markdown_report(report))
        plot_report(report, temporaries["png"])
        for path in paths.values():
            if os.path.isdir(path):  # a file cannot be renamed over it: refused before any rename
                raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
        for kind, path in paths.items():
            os.replace(temporaries.pop(kind), path)
    finally:
        for name in temporaries.values():
            name.unlink(missing_ok=True)
    return paths


def analyze_grounding(model_dir: Path, detector_dir: Path, examples: int = 500, split: str = "val",
                      batch_size: int = 16, progress: bool = True) -> dict:
    """The grounding report of an encoder checkpoint on `examples` captions of shapes-world `split` scenes.

    Raises ValueError (CheckpointError included) before any work when the inputs do not fit together.
    """
    splits = [name for name, _ in ShapesConfig().splits]
    if split not in splits:
        raise ValueError(f"unknown split {split!r}; choose one of {', '.join(splits)}")
    if examples < 1:
        raise ValueError("examples must be at least 1")
    ckpt = load_checkpoint(model_dir)
    detector, fingerprint = load_detector(detector_dir)
    expected = (ckpt.manifest.get("detector") or {}).get("fingerprint")
    if expected and expected != fingerprint:
        raise ValueError(f"{model_dir} was trained on regions of detector {expected}, {detector_dir} is {fingerprint}")
    encoder = ckpt.model.config.encoder
    if detector.config.feature_dim != encoder.visual_feat_dim:
        raise ValueError(f"detector features have {detector.config.feature_dim} dims, the encoder reads {encoder.visual_feat_dim}")
    data = grounding_examples(examples, split)
    table, scores = scene_regions(detector, fingerprint, data[-1].row + 1, split, progress=progress)
    if encoder.region_tags:  # the encoder reads each region's detector class word beside its feature
        table = table.with_tags(ckpt.tokenizer.tag_table(detector.config.classes, encoder.embedding_style))
    tally = tally_grounding(ckpt.model, ckpt.tokenizer, data, table, scores, batch_size,
                            progress=lambda it: tqdm(it, desc="grounding", unit="batch", disable=not progress))
    return summarize(tally, layer_kind(ckpt.model), model=str(model_dir), preset=encoder.preset, detector=fingerprint,
                     split=split, examples=len(data))
