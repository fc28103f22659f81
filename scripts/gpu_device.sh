#!/bin/bash
# The checks a lent GPU machine without network (the device tool) is for, after `python scripts/gpu_carry.py
# [--reference DIR]` here: carry [".whl", ".ref"], command `bash scripts/gpu_device.sh [cpu|gpu|butd|all]`.
# Installs the carried wheels beside the image's own torch, then
#   cpu  the machine's host CPU (an Intel Xeon with AMX) on 2 physical cores pinned with taskset, as the 2-core
#        machines here: the real-size first /vqa (benchmarks/butd.py --first-vqa, where .ref holds the frcnn-vg
#        reference) and the demo's training step (benchmarks/train_step.py at the demo's shape; the demo build's
#        time on AMX) with oneDNN's own choice of ISA on one and two threads, capped below AMX, and on the two
#        hyperthreads of one core where the host has them (a 2-vCPU cloud machine often is one such core). About
#        5 minutes.
#   gpu  the tests marked gpu that import there (schemathesis, tritonclient and easy_vqa do not travel), the torch
#        runtime and detector benchmark (benchmarks/gpu.py) and the real-size detector against the reference
#        (benchmarks/butd.py --device cuda). About 8 minutes on an H200.
#   butd only the real-size detector against the reference on the GPU (about 4 minutes).
#   all  cpu and gpu (default), longer than one device call allows: give the tool one mode a call. A session's 15
#        minutes of device time hold the machine's start, cpu and butd; cpu first (the AMX CPU's targets).
# Logs and docs/BENCHMARKS.md, with the sections the benchmarks wrote, land in $OUT. Each step has its own time limit
# so that a call ends inside the tool's 10 minutes.
set -o pipefail
MODE=${1:-all}
case $MODE in cpu|gpu|butd|all) ;; *) echo "usage: bash scripts/gpu_device.sh [cpu|gpu|butd|all]" >&2; exit 2 ;; esac
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/.whl/site:$PWD PYTHONUNBUFFERED=1
step() {  # name, seconds, command...
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    timeout "$limit" "$@" 2>&1 | grep -v -i "warning\|meshgrid" | tee "$OUT/$name.log" | tail -25
    echo "== $name: exit ${PIPESTATUS[0]}, $((SECONDS - start)) s"
}
pinned() {  # the first CPU of each of the first two physical cores (not two hyperthreads of one core)
    cat "${SYSFS:-/sys}"/devices/system/cpu/cpu[0-9]*/topology/thread_siblings_list | sed 's/[,-].*//' | sort -un |
        head -2 | paste -sd,
}
one_core() {  # the first two hyperthreads of the first core ("0,16" or "0-1"); nothing where a core runs one thread
    local list
    list=$(head -1 "${SYSFS:-/sys}"/devices/system/cpu/cpu0/topology/thread_siblings_list)
    case $list in
        *,*) echo "$list" | cut -d, -f1,2 ;;
        *-*) echo "${list%%-*},$((${list%%-*} + 1))" ;;
    esac
}
if [ "$MODE" = cpu ] || [ "$MODE" = all ]; then
    CORES=$(pinned)
    echo "== cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2) on CPUs $CORES of $(nproc)"
    if [ -f .ref/modeling_frcnn.py ]; then
        step first-vqa 300 taskset -c "$CORES" python3 benchmarks/butd.py --reference .ref --first-vqa --runs 2
    else
        echo "== first-vqa: skipped, .ref holds no frcnn-vg reference (python scripts/gpu_carry.py --reference DIR)"
    fi
    DEMO_STEP="benchmarks/train_step.py --no-write --runs 3 --num-layers 4 --text 24"  # docs/BENCHMARKS.md's shape
    step train-step 90 taskset -c "$CORES" python3 $DEMO_STEP --threads 1 2
    step train-step-avx512-bf16 60 env ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 taskset -c "$CORES" python3 $DEMO_STEP
    SIBLINGS=$(one_core)
    if [ -n "$SIBLINGS" ]; then
        step train-step-one-core 60 taskset -c "$SIBLINGS" python3 $DEMO_STEP
    else
        echo "== train-step-one-core: skipped, the host runs one thread a core"
    fi
fi
if [ "$MODE" = gpu ] || [ "$MODE" = all ]; then
    nvidia-smi -L
    step tests 200 python3 -m pytest -q -ra -p no:cacheprovider -m gpu tests/models/test_frcnn_vg.py \
        tests/service/test_cuda.py tests/service/test_onnx_runtime.py tests/export/test_fp16.py \
        tests/export/test_tensorrt.py tests/training/test_cuda_training.py
    step gpu-bench 100 python3 benchmarks/gpu.py --runs 10
fi
if [ "$MODE" = gpu ] || [ "$MODE" = butd ] || [ "$MODE" = all ]; then
    if [ -f .ref/modeling_frcnn.py ]; then
        step butd 220 python3 benchmarks/butd.py --device cuda --reference .ref --runs 10 --batch-runs 3 --threads 8
    else
        echo "== butd: skipped, .ref holds no frcnn-vg reference (python scripts/gpu_carry.py --reference DIR)"
    fi
fi
cp docs/BENCHMARKS.md "$OUT/BENCHMARKS.md"
