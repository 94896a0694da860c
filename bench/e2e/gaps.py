"""Where the GPU waits: idle gaps of the compute stream in a Chrome trace from `train.py --profile P --trace T`.

    python3 bench/e2e/gaps.py TRACE.json [top]

A gap is time between compute kernels (NCCL kernels are not compute). A gap during which an NCCL kernel runs is
counted as waiting for communication; any other gap waited for the host, and is charged to the Python frames the host
was in when it launched the kernel that ended the gap (the launch's enclosing python_function events, innermost last).
Caveat, measured: Python stacks in the profiler about double the host time of an FSDP step (0.21 -> 0.43 s), so the
host waits it reports are inflated; read the ranking, not the milliseconds.
"""

from __future__ import annotations

import bisect
import json
import sys
from collections import defaultdict

MIN_GAP_US = 5.0


def main() -> None:
    path, top = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 25
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    gpu = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"])
    nccl = [(e["ts"], e["ts"] + e["dur"]) for e in gpu if "nccl" in e["name"].lower()]
    compute = [e for e in gpu if "nccl" not in e["name"].lower()]
    launches = {
        e["args"]["correlation"]: e
        for e in events
        if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})
    }
    frames = sorted((e for e in events if e.get("cat") == "python_function"), key=lambda e: e["ts"])
    frame_starts = [e["ts"] for e in frames]

    def stack_at(tid, ts: float) -> list[str]:
        # Frames enclosing ts on the launching thread (python_function events nest; a linear scan back is enough).
        out = []
        i = bisect.bisect_right(frame_starts, ts) - 1
        while i >= 0 and len(out) < 400:
            e = frames[i]
            if e["tid"] == tid and e["ts"] <= ts <= e["ts"] + e["dur"]:
                out.append(e["name"])
            i -= 1
        return out[::-1]

    def overlaps_comm(a: float, b: float) -> float:
        return sum(max(0.0, min(b, y) - max(a, x)) for x, y in nccl if x < b and y > a)

    by_frame: dict[str, float] = defaultdict(float)
    by_op: dict[str, float] = defaultdict(float)
    total = comm_wait = host_wait = 0.0
    end = compute[0]["ts"] + compute[0]["dur"]
    for e in compute[1:]:
        gap = e["ts"] - end
        if gap > MIN_GAP_US:
            total += gap
            waiting = overlaps_comm(end, e["ts"])
            comm_wait += waiting
            rest = gap - waiting
            host_wait += rest
            launch = launches.get(e.get("args", {}).get("correlation"))
            if launch is not None and rest > 0:
                stack = [name for name in stack_at(launch["tid"], launch["ts"]) if not name.startswith("<built-in")]
                ours = ("modeling_deepseek", "fully_sharded", "fsdp", "train.py")
                mine = [n for n in stack if any(part in n for part in ours)]
                by_frame[" > ".join(n.split(": ", 1)[-1][:60] for n in (mine or stack)[-3:])] += rest
                by_op[e["name"][:80]] += rest
        end = max(end, e["ts"] + e["dur"])
    span = end - compute[0]["ts"]
    busy = span - total
    print(
        f"window {span / 1e3:.1f} ms: compute busy {busy / 1e3:.1f} ms, compute stream idle {total / 1e3:.1f} ms "
        f"(waiting on NCCL {comm_wait / 1e3:.1f} ms, on the host {host_wait / 1e3:.1f} ms)"
    )
    print("\nhost waits by the launching Python frames (innermost last):")
    for name, us in sorted(by_frame.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {us / 1e3:8.2f} ms  {name}")
    print("\nhost waits by the kernel that ended them:")
    for name, us in sorted(by_op.items(), key=lambda kv: -kv[1])[:12]:
        print(f"  {us / 1e3:8.2f} ms  {name}")


if __name__ == "__main__":
    main()
