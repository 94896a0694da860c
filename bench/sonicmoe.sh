#!/bin/bash
# The peers side by side at one size with SonicMoE tuned, resumable across device calls.
#
# SonicMoE's first call per token count runs quack's autotune over its six GEMMs: each compiles 9 or 22 candidate
# configs in worker processes (~70-120 s per GEMM on an H200 with 16 workers) and times them in under a second, and
# quack keeps the timings in $QUACK_CACHE_DIR. This script restores earlier timings from
# bench/results/sonicmoe-autotune-CONFIG.tgz, runs bench_moe.py under a time limit, and writes the timings it has,
# finished or not, to $OUT/sonicmoe-autotune-CONFIG.tgz. Copy that file into bench/results/ and run again until the
# sonicmoe row prints (moonlight: one 560 s call tuned five GEMMs, the next finished in 131 s). With all six timings
# saved (moonlight, seed and v3 have them) a fresh machine compiles only the chosen configs: ~30 s.
#
# SONICMOE_CACHE=DIR keeps the whole cache there instead of a fresh temporary directory: the compiled kernels too,
# which quack keys on dtypes, layouts and tile shapes but not on the sizes, so a second size (or a second call on a
# machine still warm) compiles nothing and only times the candidates.
#
#   OUT=/root/out bash bench/sonicmoe.sh moonlight [SECONDS] [ROWS]
#
# Needs sonic-moe and its wheels importable (the install line in docs/backends.md) and the libcst wheel for the rewrite.
set -uo pipefail
config=${1:?usage: bench/sonicmoe.sh seed|moonlight|v3 [seconds] [rows]}
limit=${2:-540}
rows=${3:-moe-rewrite[fused],liger-fused_moe,sonicmoe}
out=${OUT:-bench/out}
cache=${SONICMOE_CACHE:-$(mktemp -d)}
mkdir -p "$cache"
saved=bench/results/sonicmoe-autotune-$config.tgz
mkdir -p "$out"
[ -f "$saved" ] && tar -xzf "$saved" -C "$cache"
export QUACK_CACHE_DIR=$cache/qc TRITON_CACHE_DIR=$cache/tc TRITON_CACHE_AUTOTUNING=1
export QUACK_COMPILE_WORKERS=${QUACK_COMPILE_WORKERS:-16} QUACK_PRINT_AUTOTUNING=1 PYTHONUNBUFFERED=1
timeout "$limit" python3 bench/bench_moe.py --configs "$config" --reps 30 --only "$rows" \
  --label "peers-$config" --out "$out" >"$out/log-peers-$config.txt" 2>&1
status=$?
grep '^{' "$out/log-peers-$config.txt"
grep 'autotuning for function\|Pre-compil' "$out/log-peers-$config.txt" | cut -c1-160
(cd "$cache" && find qc tc -name '*.autotune.json' 2>/dev/null | tar -czf "$out/sonicmoe-autotune-$config.tgz" -T -)
echo "bench_moe.py exit status $status (124: stopped at ${limit} s); timings kept: $(tar -tzf "$out/sonicmoe-autotune-$config.tgz" | wc -l)"
