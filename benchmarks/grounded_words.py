"""Masked class and attribute words of held-out captions filled in with each caption's own image and with another
scene's (`training.pretrain.grounded_word_accuracy`, what pretraining reports at its end), for saved checkpoints.

    python benchmarks/grounded_words.py CKPT [CKPT ...] [--detector-dir DIR] [--captions 2000]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a checkout without installing
from models.checkpoint import load_checkpoint  # noqa: E402
from training.pretrain import grounded_word_accuracy  # noqa: E402
from training.vl_data import prepare_task_data  # noqa: E402
from training.zoo import zoo_dir  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoints", nargs="+", type=Path)
    ap.add_argument("--detector-dir", type=Path, default=zoo_dir("demo") / "detector")
    ap.add_argument("--eval-scenes", type=int, default=500, help="shapes-world val scenes whose captions are scored")
    ap.add_argument("--captions", type=int, default=2000, help="captions scored (PretrainConfig.eval_examples)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    data = prepare_task_data(args.detector_dir, 1, args.eval_scenes, False, False)
    for path in args.checkpoints:
        ckpt = load_checkpoint(path)
        print(json.dumps({"checkpoint": str(path), **grounded_word_accuracy(ckpt.model, data, ckpt.tokenizer, args.captions)}),
              flush=True)


if __name__ == "__main__":
    main()
