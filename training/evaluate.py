"""Task metrics of a multi-task model on held-out examples (VQA / easy-VQA accuracy, refer accuracy, ITM and NLVR2 accuracy)."""
from __future__ import annotations

import numpy as np
import torch

from models import VLModel
from models.tokenizer import VLTokenizer

from .data.vl_tasks import Example, collate
from .metrics import accuracy, refer_accuracy

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


def predicted_boxes(logits: torch.Tensor, examples: list[Example], table) -> torch.Tensor:
    """Pixel box of each example's top-scored region (B, 4)."""
    rows = np.array([e.rows[0] for e in examples])
    return torch.from_numpy(table.pixel_boxes[rows, logits.argmax(-1).numpy()])


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
            gold = torch.tensor(np.array([e.label for e in examples], dtype=np.float32))
            value = refer_accuracy(predicted_boxes(logits, examples, data.eval_table), gold)
        else:  # one gold answer per question here, so soft-score VQA accuracy is plain accuracy
            value = accuracy(logits, torch.tensor([e.label for e in examples]))
        results[f"{name}_acc"] = round(value, 4)
    return results
