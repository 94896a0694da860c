#!/usr/bin/env bash
# End-to-end FSDP comparison on one host (issue: training at scale). Run from the repository root on the GPU machine:
#   bash bench/e2e/run.sh            # NPROC defaults to the number of GPUs
# Environment (transformers 4.5x and libcst from .whl/): bench/e2e/setup.sh.
set -euo pipefail
source bench/e2e/setup.sh
STEPS=${STEPS:-14}
# Gradients are reduced after the last of the --accum micro-batches only (as accelerate does; --sync-each-micro-batch
# reduces after every one). Baseline: the naive per-expert loop; candidates: the defaults, and the defaults plus
# --fuse-experts (models load with each layer's experts in two parameters). All with --gradient-checkpointing, so that
# gradient_checkpointing_enable() works in the V3 form.
python3 -m moe_rewrite fixtures/deepseek_v3 --out /tmp/e2e/naive-loop --backend loop --gradient-checkpointing
python3 -m moe_rewrite fixtures/deepseek_v3 --out /tmp/e2e/moe-rewrite --gradient-checkpointing
python3 -m moe_rewrite fixtures/deepseek_v3 --out /tmp/e2e/moe-rewrite-fused --gradient-checkpointing --fuse-experts
run() {  # impl checkpoint-dir fsdp [extra args...]
  local impl=$1 dir=$2 fsdp=$3; shift 3
  torchrun --standalone --nproc-per-node "$NPROC" bench/e2e/train.py --ckpt "/tmp/e2e/$dir" --impl "$impl" \
    --fsdp "$fsdp" --steps "$STEPS" --out "$OUT/row_${fsdp}_${dir}${1:+_nockpt}.json" "$@" 2>&1 | grep -v "^W1\|Warning\|warn(" || true
}
for fsdp in fsdp2 fsdp1; do
  run naive-loop naive-loop $fsdp
  run moe-rewrite moe-rewrite $fsdp
  run moe-rewrite moe-rewrite-fused $fsdp
done
run moe-rewrite moe-rewrite-fused fsdp2 --no-grad-ckpt
STEPS=$STEPS python3 bench/e2e/report.py "$OUT" "$NPROC"
