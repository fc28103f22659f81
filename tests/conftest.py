"""Shared test fixtures: random tiny batches (with real padding) and correct labels for every head kind; a small disk."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from models import EncoderConfig, HeadConfig, VLInputs, VLModel, create_model
from models.spatial import pairwise_iou

TEXT_LEN, REGIONS, CHOICES, PHRASES = 7, 5, 3, 2  # tiny batch dimensions; every row but the first is padded
HEAD_ARGS = {"vqa": dict(num_labels=7), "image_qa": dict(num_labels=5), "mrc": dict(num_labels=6)}  # kinds that need them


def build_model(preset: str, *kinds: str, seed: int = 0, options: dict | None = None, **overrides) -> VLModel:
    """A tiny `preset` with one head per kind (task name = kind), built under `seed`; `options` go to every head."""
    torch.manual_seed(seed)
    heads = {k: HeadConfig(kind=k, **{**HEAD_ARGS.get(k, {}), **(options or {})}) for k in kinds}
    if preset == "vl-bert":  # wiring tests need the image to reach every output of the untrained model
        overrides.setdefault("visual_scale_init", 1.0)
    return create_model(preset, "tiny", heads=heads, **overrides)


def random_boxes(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """Normalized x1, y1, x2, y2 boxes (..., 4) with x1 < x2 and y1 < y2 inside [0, 1]."""
    lo = torch.rand(*shape, 2, generator=g) * 0.5
    size = 0.1 + torch.rand(*shape, 2, generator=g) * 0.4
    return torch.cat([lo, lo + size], dim=-1)


def lengths_mask(lengths: torch.Tensor, width: int) -> torch.Tensor:
    """(...,) real lengths -> (..., width) long mask, 1 = real (right padding)."""
    return (torch.arange(width) < lengths.unsqueeze(-1)).long()


def build_batch(
    enc: EncoderConfig,
    *,
    head: str = "",  # lay the batch out as this head kind reads it (NLVR2 pairs, multiple-choice candidates)
    batch: int = 2,
    text_len: int = TEXT_LEN,
    regions: int = REGIONS,
    pairs: bool = False,  # NLVR2: region tensors (B, 2, N, ...)
    choices: int = 0,  # multiple choice: text tensors (B, C, T)
    phrases: int = PHRASES,  # grounding: phrase_index (B, P)
    image_feature: bool = False,  # pass a whole-image feature instead of letting the encoder average regions
    seed: int = 0,
) -> VLInputs:
    """A random right-padded batch: row i has i fewer real tokens and regions than row 0 (never fewer than 3 / 2)."""
    pairs = pairs or head == "nlvr2"
    choices = choices or (CHOICES if head == "multiple_choice" else 0)
    g = torch.Generator().manual_seed(seed)
    text_shape = (batch, choices) if choices else (batch,)
    region_shape = (batch, 2) if pairs else (batch,)
    row = torch.arange(batch).view(batch, *([1] * (len(text_shape) - 1)))
    text_mask = lengths_mask((text_len - row).clamp(min=3).expand(text_shape), text_len)  # (*text, T)
    row = torch.arange(batch).view(batch, *([1] * (len(region_shape) - 1)))
    region_mask = lengths_mask((regions - row).clamp(min=2).expand(region_shape), regions)  # (*region, N)

    ids = torch.randint(1000, 2000, (*text_shape, text_len), generator=g)
    ids[..., 0] = enc.cls_token_id
    last = text_mask.sum(-1, keepdim=True) - 1  # the final [SEP] of each row
    ids.scatter_(-1, last, enc.sep_token_id)
    ids = ids * text_mask + enc.pad_token_id * (1 - text_mask)
    segments = torch.randint(0, 2, ids.shape, generator=g) * text_mask

    tags = torch.randint(1000, 2000, (*region_shape, regions), generator=g)
    tags[..., 0] = -1  # the first region has no detector tag
    phrase_index = None
    if phrases and not choices:
        # the last sub-word of each phrase: any real token between [CLS] and [SEP]; the last phrase of row 1 is absent
        real = text_mask.sum(-1, keepdim=True) - 2  # (B, 1)
        phrase_index = 1 + (torch.rand(batch, phrases, generator=g) * real).long()  # (B, P)
        if batch > 1:
            phrase_index[1, -1] = -1
    return VLInputs(
        input_ids=ids,
        attention_mask=text_mask,
        token_type_ids=segments,
        region_features=torch.randn(*region_shape, regions, enc.visual_feat_dim, generator=g),
        region_boxes=random_boxes((*region_shape, regions), g),
        region_mask=region_mask,
        image_feature=torch.randn(*region_shape, enc.visual_feat_dim, generator=g) if image_feature else None,
        tag_ids=tags,
        phrase_index=phrase_index,
    )


def build_labels(head: HeadConfig, enc: EncoderConfig, inputs: VLInputs, seed: int = 1):
    """Correct targets for `head` on `inputs`, in the format each head's docstring states."""
    g = torch.Generator().manual_seed(seed)
    b = inputs.input_ids.shape[0]
    region_mask = inputs.region_mask
    kind = head.kind
    if kind in ("vqa", "image_qa"):  # soft scores in {0, .3, .6, .9, 1} over the answers
        levels = torch.tensor([0.0, 0.0, 0.3, 0.6, 0.9, 1.0])
        return levels[torch.randint(0, len(levels), (b, head.num_labels), generator=g)]
    if kind in ("nlvr2", "itm"):
        return (torch.arange(b) + 1) % 2  # true / match, false / no match, ...
    if kind == "multiple_choice":
        return torch.randint(0, inputs.input_ids.shape[1], (b,), generator=g)
    if kind == "refer":  # regions with IoU >= 0.5 to a gold box; the gold box is one of the real regions
        gold = torch.stack([inputs.region_boxes[i, int(region_mask[i].sum()) - 1] for i in range(b)])  # (B, 4)
        return torch.stack([(pairwise_iou(inputs.region_boxes[i], gold[i : i + 1])[:, 0] >= 0.5) for i in range(b)]).float()
    if kind == "grounding":  # (B, P, N) 1 = region matches the phrase; one real region per phrase
        n = region_mask.shape[-1]
        target = torch.zeros(b, inputs.phrase_index.shape[1], n)
        for i in range(b):
            real = int(region_mask[i].sum())
            target[i, :, :] = torch.nn.functional.one_hot(torch.randint(0, real, (target.shape[1],), generator=g), n).float()
        return target
    if kind == "mlm":  # token ids at masked real positions, -100 elsewhere
        labels = torch.full_like(inputs.input_ids, -100)
        labels[:, 1:3] = torch.randint(1000, 2000, (b, 2), generator=g)
        return labels
    if kind == "tag":  # the detector tag of the first real regions, -100 elsewhere
        labels = torch.full_like(inputs.tag_ids, -100)
        labels[:, 1:2] = inputs.tag_ids[:, 1:2]
        return labels
    if kind == "mrfr":
        mask = torch.zeros_like(region_mask)
        mask[:, 0] = 1
        return {"features": torch.randn(inputs.region_features.shape, generator=g), "mask": mask}
    if kind == "mrc":
        n = region_mask.shape[-1]
        ids = torch.full((b, n), -100, dtype=torch.long)
        ids[:, :2] = torch.randint(0, head.num_labels, (b, 2), generator=g)
        if head.mrc_loss == "ce":
            return ids
        dist = torch.zeros(b, n, head.num_labels)
        dist[:, :2] = torch.rand(b, 2, head.num_labels, generator=g).softmax(-1)
        return dist
    raise KeyError(f"no label builder for head kind {kind!r}: add one to tests/conftest.py")


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """Tiny tensors gain nothing from intra-op threads; on a busy 2-core machine their spinning made tests 15x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def make_model() -> Callable[..., VLModel]:
    return build_model


@pytest.fixture
def make_batch() -> Callable[..., VLInputs]:
    return build_batch


@pytest.fixture
def make_labels() -> Callable[..., object]:
    return build_labels


@pytest.fixture
def small_disk(tmp_path):
    """small_disk(size) -> a directory on a tmpfs of that size (as mount's size=, e.g. "1m"): a disk that fills.
    Unmounted after the test."""
    import subprocess

    mounted = []

    def mount(size: str) -> Path:
        where = tmp_path / f"disk{len(mounted)}"
        where.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True)
        # the project's machines run the suite as root (make test installs its system packages)
        assert done.returncode == 0, f"mounting a small tmpfs needs root (CAP_SYS_ADMIN): {done.stderr.decode().strip()}"
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], check=True)
