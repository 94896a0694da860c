"""Collect bench/e2e rows into h200x2-e2e.json (or h200x1-e2e.json) and print the comparison table."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

out, nproc = Path(sys.argv[1]), int(sys.argv[2])
rows = [json.loads(p.read_text()) for p in sorted(out.glob("row_*.json"))]
import torch  # noqa: E402

result = {
    "device": f"{nproc} x {torch.cuda.get_device_name()}",
    "date": time.strftime("%Y-%m-%d"),
    "commit": os.environ.get("BENCH_COMMIT", "unknown"),
    "command": os.environ.get("BENCH_COMMAND", f"NPROC={nproc} bash bench/e2e/run.sh"),
    "torch": torch.__version__,
    "rows": rows,
}
name = "h200x2-e2e.json" if nproc == 2 else f"h200x{nproc}-e2e.json"
(out / name).write_text(json.dumps(result, indent=1) + "\n")
print(
    f"\n{'fsdp':6} {'impl':12} {'fused':5} {'lora':4} {'fwdpf':5} {'ckpt':5} {'step s':>8} {'tok/s/GPU':>10} "
    f"{'peak GB':>8} {'speedup':>8} {'max loss rel diff':>18}"
)
for r in rows:
    base = next(
        (
            b
            for b in rows
            if b["fsdp"] == r["fsdp"]
            and b["impl"] == "naive-loop"
            and b.get("forward_prefetch") == r.get("forward_prefetch")
            and b.get("layers") == r.get("layers")
            and b.get("lora_rank", 0) == r.get("lora_rank", 0)
        ),
        None,
    )
    speed = base["step_s"] / r["step_s"] if base else float("nan")
    diff = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], base["losses"])) if base else float("nan")
    print(
        f"{r['fsdp']:6} {r['impl']:12} {str(r.get('fused_experts', False)):5} {r.get('lora_rank', 0):4} "
        f"{str(r.get('forward_prefetch', False)):5} {str(r['gradient_checkpointing']):5} {r['step_s']:8.3f} "
        f"{r['tokens_per_s_per_gpu']:10.0f} {r['peak_gb']:8.2f} {speed:7.2f}x {diff:18.2e}"
    )
    print(f"       losses: {r['losses']}")
