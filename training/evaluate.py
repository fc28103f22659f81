"""Task metrics of a model on held-out examples: VQA / easy-VQA soft-score accuracy, refer accuracy (IoU >= 0.5),
ITM, NLVR2 and multiple-choice accuracy."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from models import VLModel
from models.heads import NEG
from models.tokenizer import VLTokenizer

from .data.vl_tasks import Example, collate
from .device import model_device
from .metrics import accuracy, answer_type, refer_accuracy, vqa_accuracy_by_type, vqa_soft_accuracy

# eval set -> the kind of head it measures
HEAD_OF = {"vqa": "vqa", "easy_vqa": "vqa", "positions": "vqa", "refer": "refer", "itm": "itm", "nlvr2": "nlvr2", "mc": "multiple_choice"}


def head_for(model: VLModel, kind: str) -> str | None:
    """Name of the model's head of this kind: the head named after the kind, else the first of that kind."""
    heads = model.config.heads
    if kind in model.heads and heads[kind].kind == kind:
        return kind
    return next((name for name, h in heads.items() if h.kind == kind and name in model.heads), None)


@torch.inference_mode()
def predictions(model: VLModel, task: str, examples: list[Example], table, tokenizer: VLTokenizer, batch_size: int = 64) -> torch.Tensor:
    """Logits of the task's head for every example, in order. A batch keeps only the region slots its images need
    (collate), so per-region logits (refer) come back padded to the table's slots with the heads' padding logit. The
    model may be on a GPU: batches go there, logits come back to the CPU in float32."""
    model.eval()
    device = model_device(model)
    head = model.config.heads[task]
    slots = table.mask.shape[1]
    out = []
    for s in range(0, len(examples), batch_size):
        inputs, _ = collate(head.kind, examples[s : s + batch_size], table, tokenizer, head, tokenizer.max_length,
                            with_labels=False)
        logits = model(inputs.to(device), task).logits.to("cpu", torch.float32)
        if head.kind == "refer":
            logits = F.pad(logits, (0, slots - logits.shape[-1]), value=NEG)
        out.append(logits)
    return torch.cat(out)


def predicted_boxes(logits: torch.Tensor, examples: list[Example], table) -> torch.Tensor:
    """Pixel box of each example's top-scored region (B, 4)."""
    rows = np.array([e.rows[0] for e in examples])
    return torch.from_numpy(table.pixel_boxes[rows, logits.argmax(-1).numpy()])


def vqa_scores(examples: list[Example], answers: list[str], head_answers: list[str]) -> torch.Tensor:
    """(B, A) soft scores over the head's answer list: 1 for the gold answer (shapes-world and easy-VQA questions
    have one unambiguous answer), 0 elsewhere; a gold answer the head does not know scores 0 everywhere."""
    column = {a: i for i, a in enumerate(head_answers)}
    scores = torch.zeros(len(examples), len(head_answers))
    for b, e in enumerate(examples):
        if answers[e.label] in column:
            scores[b, column[answers[e.label]]] = 1.0
    return scores


def evaluate_tasks(model: VLModel, data, tokenizer: VLTokenizer, limit: int | None = None,
                   head_answers: dict[str, list[str]] | None = None) -> dict[str, float]:
    """`<eval set>_acc` for every eval set the model has a head of the right kind for (the first `limit` examples
    of each), and for VQA sets also per answer type (`vqa_acc_yes_no`, `vqa_acc_number`, `vqa_acc_other`).
    head_answers: a VQA head's answer list when it is not data.answers (a checkpoint's labels.json)."""
    results = {}
    for name, examples in data.eval.items():
        task = head_for(model, HEAD_OF[name]) if name in HEAD_OF else None
        if task is None or not examples:
            continue
        examples = examples[:limit] if limit else examples
        by_type = {}
        logits = predictions(model, task, examples, data.eval_table, tokenizer)
        kind = model.config.heads[task].kind
        if kind == "refer":
            gold = torch.tensor(np.array([e.label for e in examples], dtype=np.float32))
            value = refer_accuracy(predicted_boxes(logits, examples, data.eval_table), gold)
        elif kind == "vqa":
            scores = vqa_scores(examples, data.answers, (head_answers or {}).get(task, data.answers))
            value = vqa_soft_accuracy(logits.argmax(-1), scores)
            types = [answer_type(data.answers[e.label]) for e in examples]
            by_type = vqa_accuracy_by_type(logits.argmax(-1), scores, types)
        else:
            value = accuracy(logits, torch.tensor([e.label for e in examples]))
        results[f"{name}_acc"] = round(value, 4)
        results.update({f"{name}_acc_{t.replace('/', '_')}": round(v, 4) for t, v in by_type.items()})  # e.g. vqa_acc_yes_no
    return results
