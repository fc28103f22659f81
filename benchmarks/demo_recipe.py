"""Demo-recipe experiments on the demo model set's cached regions: how fast does a multi-task encoder learn with
detector tags (class, colour and size words per region, U-VisualBERT style), region attention pooling for VQA,
learning rates and task weights? Prints held-out accuracy every 100 steps and at the end, with VQA accuracy per
question type. Needs the demo detector (`make zoo`); the first run re-runs it once over the images to keep every
attribute probability (cached in --cache).

    python benchmarks/demo_recipe.py [--steps 600] [--tags none|class|all] [--pool pooled|regions] [--lr 2e-4]
                                     [--weights vqa=1,refer=1,itm=1,nlvr2=1] [--filter "what color"] [--regions 8]

Always: u-visualbert small (text side from MiniLM-L6), feature standardisation, frozen word table, foreach AdamW,
bf16 autocast (unless --fp32), batch 32, 3,000 shapes-world train scenes + 2,000 easy-VQA train images.
"""
import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from models import HeadConfig, create_model
from models.detector.io import load_detector
from models.detector import model as detmodel
from models.text_init import init_text_from_minilm
from models.tokenizer import VLTokenizer
from training.vl_data import prepare_task_data
from training.data.vl_tasks import collate
from training.data.shapes_cache import ShapesConfig, load_split
from training.data.easy_vqa import load_easy_vqa, load_image
from training.data.vl_tasks import easy_vqa_images
from training.evaluate import predicted_boxes
from training.metrics import refer_accuracy

DET = Path.home() / ".cache/vlserve/zoo/demo/detector"  # the demo detector (its regions are cached by fingerprint)
ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=600)
ap.add_argument("--batch", type=int, default=32)
ap.add_argument("--regions", type=int, default=8)
ap.add_argument("--tags", default="all")  # none | class | all
ap.add_argument("--preset", default="u-visualbert")
ap.add_argument("--lr", type=float, default=1e-4)
ap.add_argument("--head-lr", type=float, default=1e-3)
ap.add_argument("--weights", default="vqa=1,refer=1,itm=1,nlvr2=1")
ap.add_argument("--pool", default="pooled")
ap.add_argument("--loss", default="ce")
ap.add_argument("--eval", type=int, default=600)
ap.add_argument("--warmup", type=int, default=50)
ap.add_argument("--filter", default="")
ap.add_argument("--vis-scale", type=float, default=1.0)
ap.add_argument("--cache", type=Path, default=None, help="attribute cache (default: per detector fingerprint)")
ap.add_argument("--fp32", action="store_true")
args = ap.parse_args()
torch.manual_seed(0); torch.set_num_threads(2)
rng = np.random.default_rng(0)
t0 = time.time()
data = prepare_task_data(DET, 3000, 500, True, False, easy_vqa_images=2000)
print("data", time.time() - t0, flush=True)
tok = VLTokenizer.pretrained_minilm(max_length=40)

# ---- tags: re-run the detector keeping all attribute probabilities (cached)
cache = args.cache or Path.home() / ".cache/vlserve/runs" / f"demo_recipe_attributes-{data.fingerprint}.npz"
cache.parent.mkdir(parents=True, exist_ok=True)
if args.tags != "none" and not cache.exists():
    det, _ = load_detector(DET)
    stash = []
    orig = detmodel.RegionDetector._regions
    def patched(self, prep, head, boxes, scores):
        c = self.config
        conf, cls = detmodel.region_confidence(boxes, scores, c.region_nms_thresh)
        keep = detmodel.choose_regions(conf, c.num_boxes, c.adaptive, c.min_boxes, c.max_boxes, c.conf_thresh)
        p = torch.zeros(c.max_regions, len(c.attributes)); p[: len(keep)] = torch.sigmoid(head.attr_logits[keep]).float()
        stash.append(p.numpy())
        return orig(self, prep, head, boxes, scores)
    detmodel.RegionDetector._regions = patched
    def run(images):
        stash.clear(); out = []
        for s in range(0, len(images), 32):
            det.extract(images[s:s+32], 16)
        return np.stack(stash)
    tr = load_split("train", ShapesConfig()); va = load_split("val", ShapesConfig())
    ez_tr = load_easy_vqa("train"); ez_te = load_easy_vqa("test")
    ids_tr = easy_vqa_images(ez_tr)[:2000]; ids_te = easy_vqa_images(ez_te)
    t1 = time.time()
    A_train = np.concatenate([run([np.asarray(tr.image(i)) for i in range(3000)]),
                              run([load_image(ez_tr.image_paths[i]) for i in ids_tr])])
    A_eval = np.concatenate([run([np.asarray(va.image(i)) for i in range(500)]),
                             run([load_image(ez_te.image_paths[i]) for i in ids_te])])
    print("attr extraction", time.time() - t1, flush=True)
    np.savez(cache, train=A_train, eval=A_eval)
A = np.load(cache) if args.tags != "none" else None
labels = json.loads((DET / "labels.json").read_text())
obj_w = np.array([tok.word_id(w) for w in labels["objects"]]); attr_w = np.array([tok.word_id(w) for w in labels["attributes"]])
def tag_table(table, probs):
    n = table.mask.shape[1]
    tags = np.full((len(table), n, 3), -1, np.int64)
    real = table.mask == 1
    tags[..., 0] = np.where(real, obj_w[table.obj_ids.clip(0)], -1)
    if args.tags == "all":
        tags[..., 1] = np.where(real, attr_w[probs[:, :n, :8].argmax(-1)], -1)
        tags[..., 2] = np.where(real, attr_w[8 + probs[:, :n, 8:].argmax(-1)], -1)
    return tags
if A is not None:
    assert A["train"].shape[0] == len(data.train_table), (A["train"].shape, len(data.train_table))
    T_train = tag_table(data.train_table, A["train"]); T_eval = tag_table(data.eval_table, A["eval"])
else:
    T_train = T_eval = np.full((1, 1, 1), -1)  # unused: --tags none
R = args.regions
for t in (data.train_table, data.eval_table):
    t.features, t.boxes, t.pixel_boxes, t.mask, t.obj_ids = (t.features[:, :R], t.boxes[:, :R], t.pixel_boxes[:, :R], t.mask[:, :R], t.obj_ids[:, :R])
T_train, T_eval = T_train[:, :R], T_eval[:, :R]  # no-op for the unused placeholder
if args.filter:
    data.train["vqa"] = [e for e in data.train["vqa"] if e.text.lower().startswith(args.filter)]
    print("filtered", len(data.train["vqa"]))

heads = {"vqa": HeadConfig(kind="vqa", num_labels=len(data.answers), vqa_loss=args.loss, pool=args.pool),
         "refer": HeadConfig(kind="refer"), "itm": HeadConfig(kind="itm"), "nlvr2": HeadConfig(kind="nlvr2", nlvr2_mode="pair")}
weights = dict(kv.split("=") for kv in args.weights.split(","))
tasks = [t for t in weights]; w = np.array([float(weights[t]) for t in tasks]); w /= w.sum()
model = create_model(args.preset, "small", heads={t: heads[t] for t in tasks}, visual_feat_dim=data.feature_dim, feature_norm=True)
init_text_from_minilm(model)
with torch.no_grad(): model.encoder.embeddings.visual_projection.weight.mul_(args.vis_scale)
model.encoder.feature_norm.fit(data.train_table.features, data.train_table.mask)
model.encoder.embeddings.word_embeddings.weight.requires_grad_(False)
groups = [{"params": [p for n, p in model.named_parameters() if p.requires_grad and not n.startswith("heads.")], "peak": args.lr},
          {"params": [p for n, p in model.named_parameters() if p.requires_grad and n.startswith("heads.")], "peak": args.head_lr}]
opt = torch.optim.AdamW(groups, lr=args.lr, weight_decay=0.01, foreach=True)

def with_tags(kind, exs, table, tags):
    inputs, y = collate(kind, exs, table, tok, model.config.heads[kind], 40)
    if args.tags != "none":
        rows = np.array([e.rows if kind == "nlvr2" else e.rows[0] for e in exs])
        inputs.tag_ids = torch.from_numpy(tags[rows][..., :inputs.region_mask.shape[-1]])  # the batch's region slots
    return inputs, y

def qtype(q):
    q = q.lower()
    for k in ("what color", "what shape", "what size", "how many", "is there", "are there"):
        if q.startswith(k): return k
    return "relation" if (" left " in q or " right " in q or "above" in q or "below" in q) else "other"

@torch.inference_mode()
def evaluate(n):
    model.eval(); res = {}
    for name, exs in data.eval.items():
        kind = {"vqa": "vqa", "easy_vqa": "vqa", "refer": "refer", "itm": "itm", "nlvr2": "nlvr2"}.get(name)
        if kind not in model.heads: continue
        exs = exs[:n]; logits = []
        for s in range(0, len(exs), 64):
            inp, _ = with_tags(kind, exs[s:s+64], data.eval_table, T_eval)
            logits.append(model(inp, kind).logits.float())
        logits = torch.cat(logits)
        if kind == "vqa":
            ok = (logits.argmax(-1).numpy() == np.array([e.label for e in exs]))
            res[name] = round(float(ok.mean()), 3)
            if name in ("vqa", "easy_vqa"):
                by = {}
                for e, o in zip(exs, ok): by.setdefault(qtype(e.text), []).append(o)
                res[name + "_types"] = {k: round(float(np.mean(v)), 2) for k, v in by.items()}
        elif kind == "refer":
            res[name] = round(float(refer_accuracy(predicted_boxes(logits, exs, data.eval_table), torch.tensor([e.label for e in exs], dtype=torch.float32))), 3)
        else:
            res[name] = round(float((logits.argmax(-1).numpy() == np.array([e.label for e in exs])).mean()), 3)
    model.train(); return res

L = []
start = time.time()
for step in range(args.steps):
    scale = (step + 1) / args.warmup if step < args.warmup else max(0.0, (args.steps - step) / (args.steps - args.warmup))
    for g in opt.param_groups: g["lr"] = g["peak"] * scale
    task = tasks[int(rng.choice(len(tasks), p=w))]
    pool = data.train[task]
    exs = [pool[int(i)] for i in rng.integers(0, len(pool), args.batch)]
    inp, y = with_tags(task, exs, data.train_table, T_train)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not args.fp32):
        loss = model(inp, task, y).loss
    opt.zero_grad(set_to_none=True); loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0); opt.step()
    L.append(loss.item())
    if (step + 1) % 20 == 0: print("loss", step + 1, round(float(np.mean(L[-20:])), 3), flush=True)
    if (step + 1) % 100 == 0:
        print(f"step {step+1} {time.time()-start:.0f}s", json.dumps(evaluate(200)), flush=True)
print("train s", round(time.time() - start), "FINAL", json.dumps(evaluate(args.eval)), flush=True)
