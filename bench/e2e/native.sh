#!/usr/bin/env bash
# Issue #34's end-to-end rows on one GPU (bench/e2e/native.py), from the repository root on the GPU machine:
#   MODELING=path/to/modeling_deepseek.py bash bench/e2e/native.sh
# MODELING is the published DeepSeek-V3/R1 file (not in this repository; without it our stand-in fixture is used).
# ROWS picks rows ("impl:mode:batch:seq[:compile[:checkpointing]] ...", compile none, layers or model: native.py
# --compile; checkpointing layers, the default, selective or none: native.py --checkpointing); OPTOUTS
# are the options of the "published-attention" file (every whole-model rewrite off, the MoE rewrite kept); PROFILE=1
# writes kernel tables. fp8-w8a16 and fp8-compute rows: the file rewritten with --fp8-experts (--fp8-compute) on an
# FP8 checkpoint of the same weights (native.py --fp8, issue #49). libcst, peft and Liger come from the wheels in .whl/
# (installed into /tmp/site); the device's own torch and transformers run everything.
set -euo pipefail
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --target /tmp/site $(ls .whl/{libcst,liger_kernel,peft}-*.whl 2>/dev/null)
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_MODULES_CACHE=/tmp/e2e-native/modules
src=/tmp/e2e-native/src
rm -rf /tmp/e2e-native && mkdir -p "$src"
cp fixtures/deepseek_v3/config.json fixtures/deepseek_v3/configuration_deepseek.py "$src/"
cp "${MODELING:-fixtures/deepseek_v3/modeling_deepseek.py}" "$src/modeling_deepseek.py"
ROWS=${ROWS:-"native:full:2:4096 native-liger:full:2:4096 moe-rewrite:full:2:4096 published-attention:full:2:4096
naive-loop:full:2:4096 native:lora:2:4096 native-liger:lora:2:4096 moe-rewrite:lora:2:4096
published-attention:lora:2:4096 native:full:1:8192 native-liger:full:1:8192 moe-rewrite:full:1:8192
published-attention:full:1:8192 fp8-w8a16:lora:2:4096 fp8-compute:lora:2:4096"}
python3 -m moe_rewrite "$src" --out /tmp/e2e-native/moe-rewrite
if [[ $ROWS == *published-attention* ]]; then
  python3 -m moe_rewrite "$src" --out /tmp/e2e-native/published-attention ${OPTOUTS:---no-sdpa}
fi
if [[ $ROWS == *fp8-w8a16* ]]; then
  python3 -m moe_rewrite "$src" --out /tmp/e2e-native/fp8-w8a16 --fp8-experts
fi
if [[ $ROWS == *fp8-compute* ]]; then
  python3 -m moe_rewrite "$src" --out /tmp/e2e-native/fp8-compute --fp8-compute
fi
if [[ $ROWS == *naive-loop* ]]; then
  python3 -m moe_rewrite "$src" --out /tmp/e2e-native/naive-loop --backend loop --no-fuse-experts ${OPTOUTS:---no-sdpa}
fi
for row in $ROWS; do
  IFS=: read -r impl mode batch seq compile checkpointing <<<"$row"
  compile=${compile:-none}
  checkpointing=${checkpointing:-layers}
  name="native_${impl}_${mode}_${batch}x${seq}$([ "$compile" = none ] || echo "_compiled-$compile")"
  ckpt_label=$(case $checkpointing in none) echo " no-ckpt" ;; selective) echo " selective-ckpt" ;; esac)
  name+=${ckpt_label// /_}
  extra=()
  if [ -n "${PROFILE:-}" ]; then extra+=(--profile "$OUT/$name.profile.txt"); fi
  if [[ $impl != native* ]]; then extra+=(--ckpt "/tmp/e2e-native/$impl"); fi
  if [[ $impl == fp8-* ]]; then extra+=(--fp8 "${impl#fp8-}"); fi
  timeout "${ROW_TIMEOUT:-600}" python3 bench/e2e/native.py --impl "$impl" --mode "$mode" --batch "$batch" \
    --seq "$seq" --steps "${STEPS:-8}" --compile "$compile" --checkpointing "$checkpointing" \
    --out "$OUT/$name.json" "${extra[@]}" 2>&1 |
    grep -v "Warning\|warn(" || echo "row $row failed"
  if [ ! -f "$OUT/$name.json" ]; then  # killed (ROW_TIMEOUT, out of memory): the row still says so
    label=$impl$([ "$compile" = none ] || echo " compiled-$compile")$ckpt_label
    printf '{"impl": "%s", "mode": "%s", "seq": "%sx%s", "compile": "%s", "error": "no result (timeout %ss or killed)"}\n' \
      "$label" "$mode" "$batch" "$seq" "$compile" "${ROW_TIMEOUT:-600}" >"$OUT/$name.json"
  fi
done
python3 bench/e2e/native_report.py "$OUT"/native_*.json
