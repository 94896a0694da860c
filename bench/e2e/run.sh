#!/usr/bin/env bash
# End-to-end FSDP comparison on one host (issue: training at scale). Run from the repository root on the GPU machine:
#   bash bench/e2e/run.sh            # NPROC defaults to the number of GPUs
# PER_EXPERT=1 adds rows for files rewritten with --no-fuse-experts; FORWARD_PREFETCH=1 adds FSDP1 rows (baseline and
# defaults) with forward_prefetch=True; NO_CKPT_ROW=1 adds a row without gradient checkpointing (too large for 26 MoE
# layers); FSDP="fsdp1" runs one flavour; LORA_RANK=16 trains LoRA adapters of rank 16 on attention and every routed
# expert (train.py's LORA_TARGETS) in every row instead of every parameter.
# Environment (transformers 4.5x and libcst from .whl/): bench/e2e/setup.sh.
set -euo pipefail
source bench/e2e/setup.sh
# The model is Moonlight's depth by default, 1 dense + 26 MoE layers (15.5B parameters, 77-78 GB of the 141 GB per GPU):
# the issue asks for enough layers to fill the GPUs. MOE_LAYERS=4 gives the smaller model of earlier runs.
MOE_LAYERS=${MOE_LAYERS:-26}
STEPS=${STEPS:-10}
# Gradients are reduced after the last of the --accum micro-batches only (as accelerate does; --sync-each-micro-batch
# reduces after every one). Baseline: the naive per-expert loop over the experts' own nn.Linear layers; candidate: the
# defaults (models load with each layer's experts fused into two parameters). All with --gradient-checkpointing, so
# that gradient_checkpointing_enable() works in the V3 form.
python3 -m moe_rewrite fixtures/deepseek_v3 --out /tmp/e2e/naive-loop --backend loop --no-fuse-experts --gradient-checkpointing
python3 -m moe_rewrite fixtures/deepseek_v3 --out /tmp/e2e/moe-rewrite --gradient-checkpointing
python3 -m moe_rewrite fixtures/deepseek_v3 --out /tmp/e2e/per-expert --no-fuse-experts --gradient-checkpointing
run() {  # impl checkpoint-dir fsdp [extra args...]
  local impl=$1 dir=$2 fsdp=$3; shift 3
  local tag; tag=$(echo "$*" | tr -d ' -')
  if [ -n "${LORA_RANK:-}" ]; then set -- "$@" --lora-rank "$LORA_RANK"; tag=${tag}lora$LORA_RANK; fi
  torchrun --standalone --nproc-per-node "$NPROC" bench/e2e/train.py --ckpt "/tmp/e2e/$dir" --impl "$impl" \
    --fsdp "$fsdp" --steps "$STEPS" --moe-layers "$MOE_LAYERS" --out "$OUT/row_${fsdp}_${dir}${tag:+_$tag}.json" "$@" 2>&1 | grep -v "^W1\|Warning\|warn(" || true
}
for fsdp in ${FSDP:-fsdp2 fsdp1}; do
  run naive-loop naive-loop $fsdp
  run moe-rewrite moe-rewrite $fsdp
  if [ -n "${PER_EXPERT:-}" ]; then run moe-rewrite per-expert $fsdp; fi
done
if [ -n "${FORWARD_PREFETCH:-}" ]; then
  run naive-loop naive-loop fsdp1 --forward-prefetch
  run moe-rewrite moe-rewrite fsdp1 --forward-prefetch
fi
if [ -n "${NO_CKPT_ROW:-}" ]; then run moe-rewrite moe-rewrite fsdp2 --no-grad-ckpt; fi
python3 bench/e2e/report.py "$OUT" "$NPROC"
