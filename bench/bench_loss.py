"""The causal-LM loss alone, forward + backward (issue #34, item 2): the published statements (lm_head, float32 logits,
shifted copy, CrossEntropyLoss) against the fused loss (moe_rewrite/runtime/model/lm_loss.py) at each chunk size, with
its Triton cross-entropy rows and with the same rows as torch ops. The same hidden states, weight and labels (10% -100)
for every row. Prints one JSON object: per row the median step time, the peak memory above what the inputs hold, the
loss, and the relative difference of the loss and of both gradients against the published path.

    python3 bench/bench_loss.py                      # CUDA, bf16, 8192 tokens, H 2048, vocab 163840 (Moonlight)
    python3 bench/bench_loss.py --device cpu --tokens 64 --hidden 32 --vocab 1000 --dtype float32 --chunk-tokens 16
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from moe_rewrite.runtime.model import lm_loss  # noqa: E402


def published(hidden, weight, labels):
    logits = torch.nn.functional.linear(hidden, weight).float()
    shift_logits = logits[..., :-1, :].contiguous().view(-1, weight.shape[0])
    shift_labels = labels[..., 1:].contiguous().view(-1)
    return torch.nn.CrossEntropyLoss()(shift_logits, shift_labels)


def fused(hidden, weight, labels):
    return lm_loss._moe_rewrite_lm_loss(hidden, weight, labels)[0]


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(fn, hidden, weight, labels, device, warmup, repeats):
    """(median ms of forward + backward, peak GB above the inputs, loss, grad of hidden, grad of weight)."""
    times, peak = [], 0.0
    for i in range(warmup + repeats):
        hidden.grad = weight.grad = None
        sync(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        start = time.perf_counter()
        loss = fn(hidden, weight, labels)
        loss.backward()
        sync(device)
        if i >= warmup:
            times.append((time.perf_counter() - start) * 1e3)
            if device.type == "cuda":
                peak = max(peak, (torch.cuda.max_memory_allocated(device) - base) / 1e9)
    return statistics.median(times), peak, loss.item(), hidden.grad.clone(), weight.grad.clone()


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=163840)
    parser.add_argument("--chunk-tokens", default="1024,2048,4096", help="fused rows' chunk sizes")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    torch.manual_seed(0)
    hidden = (torch.randn(1, args.tokens, args.hidden, device=device) * 0.5).to(dtype).requires_grad_(True)
    weight = (torch.randn(args.vocab, args.hidden, device=device) * 0.02).to(dtype).requires_grad_(True)
    labels = torch.randint(0, args.vocab, (1, args.tokens), device=device)
    labels[torch.rand(labels.shape, device=device) < 0.1] = -100
    kernel = lm_loss._moe_rewrite_cross_entropy_kernel(device, dtype)
    variants = [("published", None, None)]
    for chunk in [int(c) for c in args.chunk_tokens.split(",")]:
        variants.append(("fused", chunk, "triton" if kernel is not None else "torch"))
        if kernel is not None:
            variants.append(("fused", chunk, "torch"))
    rows, want = [], None
    for impl, chunk, rows_by in variants:
        fn = published if impl == "published" else fused
        if chunk is not None:
            lm_loss.MOE_REWRITE_LOSS_CHUNK_BYTES = chunk * args.vocab * hidden.element_size()
        lookup = lm_loss._moe_rewrite_cross_entropy_kernel
        if rows_by == "torch":  # the same arithmetic as torch ops
            lm_loss._moe_rewrite_cross_entropy_kernel = lambda device, dtype: None
        try:
            ms, peak, loss, grad_h, grad_w = run(fn, hidden, weight, labels, device, args.warmup, args.repeats)
        finally:
            lm_loss._moe_rewrite_cross_entropy_kernel = lookup
        if want is None:
            want = (loss, grad_h, grad_w)
        row = {"impl": impl, "chunk_tokens": chunk, "rows": rows_by, "ms": round(ms, 3)}
        row.update(
            peak_extra_gb=round(peak, 3),
            loss=loss,
            loss_rel=abs(loss - want[0]) / abs(want[0]),
            grad_hidden_rel=rel(grad_h, want[1]),
            grad_weight_rel=rel(grad_w, want[2]),
        )
        rows.append(row)
        del grad_h, grad_w
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "dtype": args.dtype,
        "tokens": args.tokens,
        "hidden": args.hidden,
        "vocab": args.vocab,
        "rows": rows,
        "loss_rel_diff": max(row["loss_rel"] for row in rows),
    }
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
