"""The table of bench/e2e/native.sh's rows: per row set (mode, batch x seq), each implementation's step time,
tokens/s, peak memory, the routed experts' memory, first loss, and its speed and first-loss difference against the
native row; the FP8 rows (native.py --fp8) also their speed and experts' memory against the moe-rewrite row (the
same file on bf16 experts). A row that is missing leaves "-" where it would be compared.

    python bench/e2e/native_report.py bench/out/native_*.json
"""

import json
import sys


def main(paths: list[str]) -> None:
    rows = [json.load(open(p)) for p in paths]
    sets: dict[tuple, list[dict]] = {}
    for row in rows:
        sets.setdefault((row["mode"], row["seq"]), []).append(row)
    for (mode, seq), group in sorted(sets.items()):
        failed = [r for r in group if "error" in r]
        group = [r for r in group if "error" not in r]
        native = next((r for r in group if r["impl"] == "native"), None)
        ours = next((r for r in group if r["impl"] == "moe-rewrite"), None)
        print(f"\n{mode}, {seq} tokens")
        print(
            f"{'impl':30} {'s/step':>7} {'tok/s':>7} {'peak GB':>8} {'exp GB':>7} {'loss[0]':>9} {'vs native':>9} "
            f"{'dloss[0]':>9} {'1st step':>8} {'graphs':>6} {'breaks':>6} {'retraced':>8} {'vs bf16 experts':>15}"
        )
        for r in sorted(group, key=lambda r: r["step_s"]):
            speed = f"{native['step_s'] / r['step_s']:.2f}x" if native else "-"
            dloss = f"{abs(r['losses'][0] - native['losses'][0]):.1e}" if native else "-"
            experts = f"{r['experts_gb']:7.2f}" if r.get("experts_gb") is not None else f"{'-':>7}"
            print(
                f"{r['impl']:30} {r['step_s']:7.3f} {r['tokens_per_s']:7d} {r['peak_gb'] or 0:8.1f} {experts} "
                f"{r['losses'][0]:9.4f} {speed:>9} {dloss:>9} {r.get('first_step_s', 0):8.1f} "
                f"{r.get('graphs', 0):6d} {r.get('graph_breaks', 0):6d} {str(r.get('traced_after_warmup', '-')):>8} "
                f"{against_bf16_experts(r, ours):>15}"
            )
        for r in failed:
            print(f"{r['impl']:30} FAILED: {r['error']}")


def against_bf16_experts(row: dict, ours: dict | None) -> str:
    """An FP8 row's speed and experts' memory over the moe-rewrite row's ("1.05x, 0.50x mem"); "-" elsewhere or
    without that row."""
    if not row.get("fp8") or ours is None:
        return "-"
    speed = f"{ours['step_s'] / row['step_s']:.2f}x"
    if row.get("experts_gb") and ours.get("experts_gb"):
        return f"{speed}, {row['experts_gb'] / ours['experts_gb']:.2f}x mem"
    return speed


if __name__ == "__main__":
    main(sys.argv[1:])
