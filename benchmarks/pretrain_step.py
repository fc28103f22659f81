"""Masked-LM pretraining step time: the vocabulary projection of every text position against that of the masked
positions only (`Head.training_loss`, what `training.pretrain` calls). Same model, batch, masks and optimizer;
contenders take turns; median of several timed steps each.

    python benchmarks/pretrain_step.py [--preset visualbert] [--batch 32] [--text 24] [--runs 5] [--no-write]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from train_step import publish, take_turns, timed_step  # noqa: E402

from models import HeadConfig, VLInputs, create_model  # noqa: E402
from training.objectives import TokenIds, mask_tokens, pretraining_losses  # noqa: E402

HEADING = "## Pretraining step: masked LM decoded at the masked positions only"
REGIONS, FEATURES = 8, 512


def contender(preset: str, batch: int, text: int, masked_only: bool):
    torch.manual_seed(0)
    model = create_model(preset, "small", heads={"mlm": HeadConfig(kind="mlm"), "itm": HeadConfig(kind="itm", num_labels=2)},
                         visual_feat_dim=FEATURES, feature_norm=True, dropout=0.0, attention_dropout=0.0)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, 2000, (batch, text), generator=g)
    ids[:, 0], ids[:, -1] = model.config.encoder.cls_token_id, model.config.encoder.sep_token_id
    inputs = VLInputs(ids, torch.ones(batch, text, dtype=torch.long), torch.zeros(batch, text, dtype=torch.long),
                      torch.randn(batch, REGIONS, FEATURES, generator=g),
                      torch.rand(batch, REGIONS, 4, generator=g).sort(-1).values, torch.ones(batch, REGIONS, dtype=torch.long))
    masked, labels = mask_tokens(inputs.input_ids, inputs.attention_mask, TokenIds.from_config(model.config.encoder), g)
    inputs = inputs.replace(input_ids=masked)
    matched = torch.randint(0, 2, (batch,), generator=g)

    def loss() -> torch.Tensor:
        if masked_only:
            return pretraining_losses(model, inputs, {"mlm": labels, "itm": matched})["total"]
        enc = model.forward_features(inputs)  # the loss as computed before: logits (B, T, V) of every position
        mlm, itm = model.heads["mlm"], model.heads["itm"]
        return mlm.loss(mlm(enc, inputs).float(), labels, inputs) + itm.loss(itm(enc, inputs).float(), matched, inputs)

    return timed_step(loss, opt)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="visualbert")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--text", type=int, default=24, help="text tokens (shapes-world captions are 10-30)")
    p.add_argument("--runs", type=int, default=5, help="timed steps per contender (after 2 warm-up steps)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    names = {"every position decoded (before)": False, "masked positions only": True}
    steps = {name: contender(args.preset, args.batch, args.text, flag) for name, flag in names.items()}
    medians = take_turns(steps, args.runs)
    base = medians[next(iter(names))]
    rows = [f"| {name} | {t * 1000:.0f} | **{base / t:.2f}x** |" for name, t in medians.items()]
    publish(f"python benchmarks/pretrain_step.py --preset {args.preset} --batch {args.batch} --text {args.text} --runs {args.runs}",
            args.threads,
            "One float32 pretraining step (forward, backward, foreach AdamW; word table trained, as pretraining does) of "
            f"`{args.preset}` small with masked LM (15% of {args.text} tokens, decoder tied to the 30,522-word table) and "
            f"ITM, batch {args.batch}, {REGIONS} regions, random inputs; median of {args.runs} steps per contender, taking turns.",
            ["| contender | ms per step | speed-up |", "|---|---|---|", *rows], HEADING, not args.no_write)

if __name__ == "__main__":
    main()
