"""Task metrics of a multi-task model on held-out examples (VQA / easy-VQA accuracy, refer accuracy, ITM and NLVR2 accuracy)."""
from __future__ import annotations

import numpy as np
import torch

from models import VLModel
from models.spatial import pairwise_iou
from models.tokenizer import VLTokenizer

from .data.vl_tasks import Example, collate

HEAD_OF = {"vqa": "vqa", "easy_vqa": "vqa", "refer": "refer", "itm": "itm", "nlvr2": "nlvr2"}  # eval set -> head


@torch.inference_mode()
def predictions(model: VLModel, task: str, examples: list[Example], table, tokenizer: VLTokenizer, batch_size: int = 64) -> torch.Tensor:
    """Logits of the task's head for every example, in order."""
    model.eval()
    head = model.config.heads[task]
    out = []
    for s in range(0, len(examples), batch_size):
        inputs, _ = collate(head.kind, examples[s : s + batch_size], table, tokenizer, head)
        out.append(model(inputs, task).logits)
    return torch.cat(out)


def refer_hits(logits: torch.Tensor, examples: list[Example], table, thresh: float = 0.5) -> np.ndarray:
    """1 where the top-scored region's box overlaps the gold box with IoU >= thresh."""
    best = logits.argmax(-1).numpy()
    hits = []
    for e, region in zip(examples, best):
        box = torch.from_numpy(table.pixel_boxes[e.rows[0], region][None])
        hits.append(float(pairwise_iou(box, torch.tensor([e.label], dtype=torch.float32))[0, 0] >= thresh))
    return np.array(hits)


def evaluate_tasks(model: VLModel, data, tokenizer: VLTokenizer, limit: int | None = None) -> dict[str, float]:
    """Accuracy per eval set the model has a head for (the first `limit` examples of each)."""
    results = {}
    for name, examples in data.eval.items():
        task = HEAD_OF.get(name)
        if task not in model.heads or not examples:
            continue
        examples = examples[:limit] if limit else examples
        logits = predictions(model, task, examples, data.eval_table, tokenizer)
        if task == "refer":
            correct = refer_hits(logits, examples, data.eval_table)
        else:
            correct = (logits.argmax(-1).numpy() == np.array([e.label for e in examples])).astype(float)
        results[f"{name}_acc"] = round(float(correct.mean()), 4)
    return results
