#!/bin/bash
# The GPU checks on a lent machine without network (the device tool), after `python scripts/gpu_carry.py
# [--reference DIR]` here: carry [".whl", ".ref"], command `bash scripts/gpu_device.sh`. Installs the carried wheels
# beside the image's own torch, runs the tests marked gpu that import there (schemathesis, tritonclient and easy_vqa
# do not travel), the torch runtime and detector benchmark (benchmarks/gpu.py) and, where .ref holds the frcnn-vg
# reference, the real-size detector against it (benchmarks/butd.py --device cuda). Logs and docs/BENCHMARKS.md, with
# the sections the benchmarks wrote, land in $OUT. About 8 minutes on an H200; each step has its own time limit so
# that the call ends inside the tool's 10.
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/.whl/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi -L
step() {  # name, seconds, command...
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    timeout "$limit" "$@" 2>&1 | grep -v -i "warning\|meshgrid" | tee "$OUT/$name.log" | tail -25
    echo "== $name: exit ${PIPESTATUS[0]}, $((SECONDS - start)) s"
}
step tests 200 python3 -m pytest -q -ra -p no:cacheprovider -m gpu tests/models/test_frcnn_vg.py \
    tests/service/test_cuda.py tests/service/test_onnx_runtime.py tests/export/test_fp16.py \
    tests/export/test_tensorrt.py tests/training/test_cuda_training.py
step gpu-bench 100 python3 benchmarks/gpu.py --runs 10
if [ -f .ref/modeling_frcnn.py ]; then
    step butd 220 python3 benchmarks/butd.py --device cuda --reference .ref --runs 10 --batch-runs 3 --threads 8
else
    echo "== butd: skipped, .ref holds no frcnn-vg reference (python scripts/gpu_carry.py --reference DIR)"
fi
cp docs/BENCHMARKS.md "$OUT/BENCHMARKS.md"
