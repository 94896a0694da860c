#!/usr/bin/env bash
# Issue #48's packing rows on one GPU (bench/e2e/packing.py), from the repository root on the GPU machine:
#   MODELING=path/to/modeling_deepseek.py bash bench/e2e/packing.sh
# MODELING is the published DeepSeek-V3/R1 file (not in this repository; without it our stand-in fixture is used).
# ROWS picks rows ("impl:layout:mode:layers:budget[:layers] ..."; a last field `layers` compiles each decoder layer,
# packing.py --compile, and CHECK_COMPILED=N checks N documents through them); the default is Moonlight's sizes at
# 8 layers, full and LoRA r16, native and ours, padded and packed. LAYERS27=1 runs the 27-layer LoRA rows instead
# (part 5). PROFILE=1 writes each row's kernel and host tables of one more step beside its JSON.
set -euo pipefail
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --target /tmp/site $(ls .whl/{libcst,peft}-*.whl 2>/dev/null)
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_MODULES_CACHE=/tmp/e2e-packing/modules
src=/tmp/e2e-packing/src
rm -rf /tmp/e2e-packing && mkdir -p "$src"
cp fixtures/deepseek_v3/config.json fixtures/deepseek_v3/configuration_deepseek.py "$src/"
cp "${MODELING:-fixtures/deepseek_v3/modeling_deepseek.py}" "$src/modeling_deepseek.py"
python3 -m moe_rewrite "$src" --out /tmp/e2e-packing/moe-rewrite -v | grep -i "packing\|attention" || true
DEFAULT="native:padded:full:8:16384 native:packed:full:8:16384 moe-rewrite:padded:full:8:16384
moe-rewrite:packed:full:8:16384 native:padded:lora:8:16384 native:packed:lora:8:16384 moe-rewrite:padded:lora:8:16384
moe-rewrite:packed:lora:8:16384"
if [ -n "${LAYERS27:-}" ]; then
  DEFAULT="native:padded:lora:27:8192 native:packed:lora:27:8192 moe-rewrite:padded:lora:27:8192
moe-rewrite:packed:lora:27:8192"
fi
for row in ${ROWS:-$DEFAULT}; do
  IFS=: read -r impl layout mode layers budget compiled <<<"$row"
  name="packing_${impl}_${layout}_${mode}_${layers}l_${budget}$([ -z "$compiled" ] || echo "_compiled-$compiled")"
  extra=()
  if [[ $impl != native* ]]; then extra+=(--ckpt "/tmp/e2e-packing/$impl"); fi
  if [ -n "${PROFILE:-}" ]; then extra+=(--profile "$OUT/$name.profile.txt"); fi
  case "$compiled" in
    "") ;;
    layers) extra+=(--compile --check-compiled "${CHECK_COMPILED:-0}") ;;
    *) echo "row $row: unknown last field '$compiled' (layers compiles each decoder layer)"; continue ;;
  esac
  start=$(date +%s)
  timeout "${ROW_TIMEOUT:-150}" python3 bench/e2e/packing.py --impl "$impl" --layout "$layout" --mode "$mode" \
    --layers "$layers" --budget "$budget" --steps "${STEPS:-7}" --warmup "${WARMUP:-3}" --out "$OUT/$name.json" \
    "${extra[@]}" 2>&1 | grep -v "Warning\|warn(" | cut -c1-1500 || echo "row $row failed"
  echo "row $row: $(( $(date +%s) - start )) s"
done
