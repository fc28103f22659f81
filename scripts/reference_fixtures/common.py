"""What the reference-fixture generators of this folder share: their command line, the provenance they record,
seeded weights, padded inputs, the tiny vocabulary and the files every fixture ends with.

The generators import it as `reference_fixtures.common` (scripts/ on the path), never as `common`: VL-BERT's
reference has a `common` package of its own.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import types
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

FIXTURES = Path(__file__).resolve().parents[2] / "tests/fixtures"
PAD, UNUSED, CLS, SEP = 0, 99, 101, 102  # bert-base-uncased's special ids ([unused0..98] between [PAD] and [UNK])


def arguments(doc: str, reference_help: str, fixture: str) -> argparse.ArgumentParser:
    """`REFERENCE [--commit SHA] [--out DIR]`, DIR by default tests/fixtures/`fixture`."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("reference", type=Path, help=reference_help)
    parser.add_argument("--commit", help="the reference's commit (read with git when REFERENCE is a checkout)")
    parser.add_argument("--out", type=Path, default=FIXTURES / fixture)
    return parser


def provenance(reference: Path, commit: str | None, repository: str, used_files: Iterable[str],
               subdir: str = "") -> dict:
    """Repository, commit (`commit`, else the checkout's HEAD) and the sha256 of each used file (under `subdir`)."""
    if commit is None:
        try:
            commit = subprocess.run(["git", "-C", str(reference), "rev-parse", "HEAD"], check=True,
                                    capture_output=True, text=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            sys.exit(f"{reference}: not a git checkout; pass --commit with the commit it was taken from")
    prefix = f"{subdir}/" if subdir else ""
    hashes = {prefix + name: hashlib.sha256((reference / subdir / name).read_bytes()).hexdigest()
              for name in used_files}
    return {"repository": repository, "commit": commit, "sha256": hashes}


def stub_s3(*more: str) -> None:
    """Empty stand-ins for the S3 downloader's imports (boto3, botocore) and `more`, never called."""
    for name in ("boto3", "botocore", "botocore.exceptions", *more):
        sys.modules.setdefault(name, types.ModuleType(name))
    sys.modules["botocore.exceptions"].ClientError = type("ClientError", (Exception,), {})


def is_layer_norm(module: nn.Module) -> bool:
    return isinstance(module, nn.LayerNorm)


@torch.no_grad()
def randomize(model: nn.Module, seed: int, is_norm: Callable[[nn.Module], bool] = is_layer_norm) -> nn.Module:
    """Seeded values in every parameter (0.2 * N(0, 1); the weights of modules `is_norm` picks around 1): no output
    depends on an initializer. Tied parameters stay tied (one Parameter, set once per module that holds it)."""
    g = torch.Generator().manual_seed(seed)
    for module in model.modules():
        norm = is_norm(module)
        for name, p in module.named_parameters(recurse=False):
            noise = 0.2 * torch.randn(p.shape, generator=g)
            p.copy_(1 + noise if norm and name == "weight" else noise)
    model.eval()  # some task modules' train() override returns None
    return model


def padded_text_and_boxes(g: torch.Generator, vocab_size: int, batch: int, length: int, regions: int,
                          text_lengths, region_counts):
    """Random ids between [CLS] and [SEP] padded with [PAD], the text and region masks, and normalized x1 y1 x2 y2
    boxes (drawn from `g` in this order: ids, box corners, box sizes)."""
    text_mask = (torch.arange(length) < torch.tensor(text_lengths)[:, None]).long()
    region_mask = (torch.arange(regions) < torch.tensor(region_counts)[:, None]).long()
    ids = torch.randint(CLS + 3, vocab_size, (batch, length), generator=g)
    ids[:, 0] = CLS
    ids[torch.arange(batch), torch.tensor(text_lengths) - 1] = SEP
    lo = torch.rand(batch, regions, 2, generator=g) * 0.5
    boxes = torch.cat([lo, lo + 0.1 + torch.rand(batch, regions, 2, generator=g) * 0.4], -1)  # normalized x1 y1 x2 y2
    return ids * text_mask + PAD * (1 - text_mask), text_mask, region_mask, boxes


def shapes(model: nn.Module) -> dict[str, list[int]]:
    return {key: list(t.shape) for key, t in model.state_dict().items()}


def write_vocab(path: Path, size: int, words: Iterable[str] = ()) -> None:
    """bert-base-uncased's special tokens at their ids, then `words`, then made-up words up to `size`."""
    special = ["[PAD]", *(f"[unused{i}]" for i in range(UNUSED)), "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    words = list(words)
    words += [f"w{i}" for i in range(size - len(special) - len(words))]
    path.write_text("\n".join(special + words) + "\n")


def use_bert(modeling, **fields) -> None:
    """airsplay/lxmert's code (and code derived from it): from_pretrained builds this BertConfig instead of
    downloading bert-base-uncased (every weight is replaced by seeded values)."""
    config = modeling.BertConfig(**fields)
    modeling.BertPreTrainedModel.from_pretrained = classmethod(lambda cls, name, *a, **k: cls(config, *a, **k))


def save_tensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    save_file({k: v.contiguous() for k, v in tensors.items()}, path)


def write_record(out: Path, record: dict) -> None:
    """reference.json, then the size of every file written."""
    (out / "reference.json").write_text(json.dumps(record, indent=2) + "\n")
    for f in sorted(out.iterdir()):
        print(f"{f.stat().st_size:>9}  {f}")
