"""The table of bench/e2e/native.sh's rows: per row set (mode, batch x seq), each implementation's step time,
tokens/s, peak memory, first loss, and its speed and first-loss difference against the native row.

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
        print(f"\n{mode}, {seq} tokens")
        print(
            f"{'impl':30} {'s/step':>7} {'tok/s':>7} {'peak GB':>8} {'loss[0]':>9} {'vs native':>9} {'dloss[0]':>9} "
            f"{'1st step':>8} {'graphs':>6} {'breaks':>6} {'retraced':>8}"
        )
        for r in sorted(group, key=lambda r: r["step_s"]):
            speed = f"{native['step_s'] / r['step_s']:.2f}x" if native else "-"
            dloss = f"{abs(r['losses'][0] - native['losses'][0]):.1e}" if native else "-"
            print(
                f"{r['impl']:30} {r['step_s']:7.3f} {r['tokens_per_s']:7d} {r['peak_gb'] or 0:8.1f} "
                f"{r['losses'][0]:9.4f} {speed:>9} {dloss:>9} {r.get('first_step_s', 0):8.1f} "
                f"{r.get('graphs', 0):6d} {r.get('graph_breaks', 0):6d} {str(r.get('traced_after_warmup', '-')):>8}"
            )
        for r in failed:
            print(f"{r['impl']:30} FAILED: {r['error']}")


if __name__ == "__main__":
    main(sys.argv[1:])
