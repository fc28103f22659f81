"""Device: shapes data, the demo detector on the GPU, every region the variants read (train/val/test), cached.

Run by benchmarks/gpu_variants.sh on the lent GPU machine (VLSERVE_CACHE=/tmp/vlc)."""
import sys, time
from pathlib import Path
from training.data.shapes_cache import ShapesConfig, load_split
from training.detector_train import DetectorTrainConfig, train_detector
from training.vl_data import prepare_eval_data
from training.finetune import run_data
from training.zoo import DEMO, finetune_config, retrieval_config, detector_selection
def main():
    p, det = DEMO, Path("/tmp/vlc/det")
    t = time.perf_counter()
    for split in ("train", "val", "test"):
        load_split(split, ShapesConfig())
    print(f"generation s: {time.perf_counter() - t:.1f}", flush=True)
    t = time.perf_counter()
    m = train_detector(DetectorTrainConfig(out=det, steps=p.detector_steps, eval_every=p.detector_steps,
                       final_eval_images=p.detector_eval_images, threads=16, device="cuda", data=ShapesConfig(),
                       attribute_weight=p.detector_attribute_weight, detector=detector_selection(p)), progress=False)
    print(f"detector s: {time.perf_counter() - t:.1f} val {m['val']}", flush=True)
    t = time.perf_counter()
    cfg = finetune_config(p, det, Path("/tmp/unused"), 16)
    import dataclasses
    cfg = dataclasses.replace(cfg, device="cuda")
    run_data(cfg, False, retrieval_config(p, cfg, Path("/tmp/unused2")))
    prepare_eval_data(det, "test", 1000, 1000, 1000, progress=False, device="cuda")
    print(f"regions s: {time.perf_counter() - t:.1f}", flush=True)


if __name__ == "__main__":
    main()
