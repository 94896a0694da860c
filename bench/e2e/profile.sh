#!/usr/bin/env bash
# Kernel-time profile of the moe-rewrite candidate's last two steps (FSDP1 and FSDP2), to split the step's time.
# FUSE=1 profiles the file rewritten with --fuse-experts.
set -euo pipefail
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/libcst-*.whl .whl/tf4/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_MODULES_CACHE=/tmp/e2e/modules
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
NPROC=${NPROC:-$(python3 -c "import torch; print(torch.cuda.device_count())")}
rm -rf /tmp/e2e && mkdir -p /tmp/e2e
python3 -m moe_rewrite fixtures/deepseek_v3 --out /tmp/e2e/moe-rewrite --gradient-checkpointing ${FUSE:+--fuse-experts}
for fsdp in fsdp1 fsdp2; do
  torchrun --standalone --nproc-per-node "$NPROC" bench/e2e/train.py --ckpt /tmp/e2e/moe-rewrite --impl moe-rewrite \
    --fsdp $fsdp --steps 6 --profile "$OUT/profile_e2e${FUSE:+_fused}_$fsdp.txt" --out "$OUT/row_profiled${FUSE:+_fused}_$fsdp.json" 2>&1 | grep "step\|Error" || true
done
