#!/usr/bin/env bash
# Kernel-time profile of the moe-rewrite candidate's last two steps (FSDP1 and FSDP2), to split the step's time.
# FUSE=1 profiles the file rewritten with --fuse-experts.
set -euo pipefail
source bench/e2e/setup.sh
python3 -m moe_rewrite fixtures/deepseek_v3 --out /tmp/e2e/moe-rewrite --gradient-checkpointing ${FUSE:+--fuse-experts}
for fsdp in fsdp1 fsdp2; do
  torchrun --standalone --nproc-per-node "$NPROC" bench/e2e/train.py --ckpt /tmp/e2e/moe-rewrite --impl moe-rewrite \
    --fsdp $fsdp --steps 6 --profile "$OUT/profile_e2e${FUSE:+_fused}_$fsdp.txt" --out "$OUT/row_profiled${FUSE:+_fused}_$fsdp.json" 2>&1 | grep "step\|Error" || true
done
