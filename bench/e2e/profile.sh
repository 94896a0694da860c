#!/usr/bin/env bash
# Kernel-time profile of the moe-rewrite candidate's last two steps (FSDP1 and FSDP2), to split the step's time.
# PER_EXPERT=1 profiles the file rewritten with --no-fuse-experts; TRACE=1 also writes a Chrome trace with Python stacks
# and prints where the compute stream waits (bench/e2e/gaps.py).
set -euo pipefail
source bench/e2e/setup.sh
python3 -m moe_rewrite fixtures/deepseek_v3 --out /tmp/e2e/moe-rewrite --gradient-checkpointing ${PER_EXPERT:+--no-fuse-experts}
tag=${PER_EXPERT:+_per_expert}
for fsdp in ${FSDP:-fsdp1 fsdp2}; do
  torchrun --standalone --nproc-per-node "$NPROC" bench/e2e/train.py --ckpt /tmp/e2e/moe-rewrite --impl moe-rewrite \
    --fsdp $fsdp --steps 6 --profile "$OUT/profile_e2e${tag}_$fsdp.txt" ${TRACE:+--trace /tmp/e2e/trace_$fsdp.json} \
    --out "$OUT/profiled${tag}_$fsdp.json" 2>&1 | grep "step\|Error" || true
  if [ -n "${TRACE:-}" ]; then python3 bench/e2e/gaps.py /tmp/e2e/trace_$fsdp.json | tee "$OUT/gaps_e2e${tag}_$fsdp.txt"; fi
done
