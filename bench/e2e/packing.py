"""Packed against padded supervised fine-tuning on one GPU (issue #48 parts 4 and 5): the same documents, lengths
log-normal (median 500, tail 8192), fed either padded (rows padded to the longest document of their batch, as a
Trainer without group_by_length feeds them) or packed (DataCollatorWithFlattening's form: one row, position ids
restarting per document, labels -100 at each document's first token, no attention mask). One process per row:

    python bench/e2e/packing.py --impl native --layout padded --mode full --out row.json
    python bench/e2e/packing.py --impl moe-rewrite --ckpt REWRITTEN_DIR --layout packed --mode lora --out row.json

Batches: documents in a fixed random order, each batch as many as fit --budget tokens (padded: rows x longest,
packed: their sum), a document longer than the budget cut to it. Useful tokens/s counts the documents' tokens only
(no padding) over the timed steps. Native packed runs transformers' own packed-sequence detection (position ids with
no attention mask: a block-diagonal mask through SDPA's masked kernel; flash-attn, whose varlen kernel transformers
uses for packing otherwise, is not installed on the device). --check-documents N: the first N documents' losses run
packed against each alone (eval, bf16), written to the row. --compile: `layer.compile()` on each decoder layer, as
a user adds it (PEFT's base model's layers under LoRA; inductor, or --backend); the row then records the graphs
traced per step (packed: two steps trace, the second with the lengths dynamic, later ones nothing), and with
--check-compiled N the first N documents' check again through the compiled layers after the timed steps (eval
compiles graphs of its own). The rows share weights (seeded) and batches, so a compiled row's losses are comparable
with the eager row's. bench/e2e/packing.sh runs every row.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from native import (  # noqa: E402
    LORA_MODULES,
    LORA_PARAMETERS,
    MOONLIGHT,
    TINY,
    file_model,
    graph_counts,
    native_model,
)


def lognormal_lengths(count: int, median: float, tail: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [
        max(8, min(tail, int(math.exp(math.log(median) + torch.randn((), generator=g).item())))) for _ in range(count)
    ]


def batches(lengths: list[int], budget: int, layout: str) -> list[list[int]]:
    """Document indices per batch: as many, in order, as fit the budget (padded: count x longest)."""
    out, current = [], []
    for i, n in enumerate(lengths):
        n = min(n, budget)
        trial = current + [i]
        cost = (
            sum(min(lengths[j], budget) for j in trial)
            if layout == "packed"
            else len(trial) * max(min(lengths[j], budget) for j in trial)
        )
        if current and cost > budget:
            out.append(current)
            trial = [i]
        current = trial
    if current:
        out.append(current)
    return out


def make_batch(docs: list[torch.Tensor], layout: str, device: str) -> dict:
    if layout == "packed":
        ids = torch.cat(docs)[None]
        positions = torch.cat([torch.arange(len(d)) for d in docs])[None]
        labels = ids.clone()
        starts = torch.tensor([0] + [len(d) for d in docs[:-1]]).cumsum(0)
        labels[0, starts] = -100
        return dict(input_ids=ids.to(device), position_ids=positions.to(device), labels=labels.to(device))
    longest = max(len(d) for d in docs)
    ids = torch.zeros(len(docs), longest, dtype=torch.long)
    mask = torch.zeros(len(docs), longest, dtype=torch.long)
    for row, d in enumerate(docs):
        ids[row, : len(d)], mask[row, : len(d)] = d, 1
    labels = ids.masked_fill(mask == 0, -100)
    return dict(input_ids=ids.to(device), attention_mask=mask.to(device), labels=labels.to(device))


def document_losses(model, docs: list[torch.Tensor], device: str) -> dict:
    """Per-document mean losses (eval, no grad): packed in one row against each document alone."""
    import torch.nn.functional as F

    def losses(logits, ids):
        return F.cross_entropy(logits[:-1].float(), ids[1:]).item()

    model.eval()
    with torch.no_grad():
        batch = make_batch(docs, "packed", device)
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits[0]
        alone, together, start = [], [], 0
        for d in docs:
            d = d.to(device)
            alone.append(losses(model(input_ids=d[None], use_cache=False).logits[0], d))
            together.append(losses(packed[start : start + len(d)], d))
            start += len(d)
    model.train()
    diff = max(abs(a - b) for a, b in zip(alone, together))
    return dict(alone=[round(x, 4) for x in alone], packed=[round(x, 4) for x in together], max_abs_diff=round(diff, 5))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", required=True, help="native, or a label for the file in --ckpt")
    parser.add_argument("--ckpt")
    parser.add_argument("--layout", choices=["padded", "packed"], required=True)
    parser.add_argument("--mode", choices=["full", "lora"], default="full")
    parser.add_argument("--budget", type=int, default=16384, help="tokens per batch (padded: rows x longest)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3, help="steps left out (flex compiles in the first two)")
    parser.add_argument("--check-documents", type=int, default=8)
    parser.add_argument("--profile", help="write kernel- and host-time tables of the last batch, run once more, here")
    parser.add_argument("--compile", action="store_true", help="layer.compile() on each decoder layer")
    parser.add_argument("--backend", default="inductor", help="torch.compile's backend (aot_eager: a quick smoke test)")
    parser.add_argument("--check-compiled", type=int, default=0, help="--check-documents through the compiled layers")
    parser.add_argument("--tiny", action="store_true", help="tiny sizes on the CPU: a smoke test of this script")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    from transformers.utils import logging

    logging.set_verbosity_error()
    sizes = TINY if args.tiny else dict(MOONLIGHT, num_hidden_layers=args.layers)
    device = "cpu" if args.tiny else "cuda"
    budget = 256 if args.tiny else args.budget
    tail = 128 if args.tiny else 8192
    if args.impl.startswith("native"):
        model, attn = native_model(sizes, liger=False, device=device), "sdpa"
    else:
        model, attn = file_model(args.ckpt, sizes, device)
    cuda = device == "cuda"
    lengths = lognormal_lengths(4000, 40 if args.tiny else 500, tail, seed=0)
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(0, sizes["vocab_size"], (min(n, budget),), generator=g) for n in lengths]
    row = dict(impl=args.impl, layout=args.layout, mode=args.mode, layers=sizes["num_hidden_layers"], attention=attn)
    row["compile"] = f"layers ({args.backend})" if args.compile else "none"
    if cuda:
        row["device"] = torch.cuda.get_device_name()
    if args.check_documents:
        try:
            row["document_losses"] = document_losses(model, docs[: args.check_documents], device)
        except Exception as e:  # noqa: BLE001
            row["document_losses"] = f"error: {type(e).__name__}: {e}"[:400]
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if args.mode == "lora":
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=16, lora_alpha=32, target_modules=LORA_MODULES, target_parameters=LORA_PARAMETERS)
        model = get_peft_model(model, lora).to(torch.bfloat16)
    model.train()
    if args.compile:
        base = model.get_base_model() if args.mode == "lora" else model
        for layer in base.model.layers:
            layer.compile(backend=args.backend)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-5, weight_decay=0.0, fused=cuda)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    plan = batches([len(d) for d in docs], budget, args.layout)[: args.steps]
    times, useful, padded_tokens, losses, traced = [], [], [], [], []
    for index in plan:
        before = graph_counts()[0]
        batch = make_batch([docs[i] for i in index], args.layout, device)
        sync()
        start = time.perf_counter()
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync()
        times.append(time.perf_counter() - start)
        useful.append(sum(len(docs[i]) for i in index))
        padded_tokens.append(batch["input_ids"].numel())
        losses.append(round(loss.item(), 5))
        traced.append(graph_counts()[0] - before)
    if args.profile:  # the last batch once more, profiled, left out of the timing
        kinds = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        batch = make_batch([docs[i] for i in plan[-1]], args.layout, device)
        with torch.profiler.profile(activities=kinds) as profiler:
            model(**batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            sync()
        with open(args.profile, "w") as f:
            f.write(f"{args.impl} {args.layout} {args.mode}: the last batch, after the timed steps\n")
            for order in (["self_cuda_time_total"] if cuda else []) + ["self_cpu_time_total"]:
                table = profiler.key_averages().table(sort_by=order, row_limit=25, max_name_column_width=90)
                f.write(f"by {order}\n{table}\n")
    timed = slice(args.warmup, None)
    row.update(
        useful_tokens_per_s=round(sum(useful[timed]) / sum(times[timed])),
        padding_share=round(1 - sum(useful[timed]) / sum(padded_tokens[timed]), 3),
        median_step_s=round(statistics.median(times[timed]), 4),
        peak_gb=round(torch.cuda.max_memory_allocated() / 1e9, 2) if cuda else None,
        batches=[
            dict(documents=len(i), useful=u, shape=list(map(int, p)))
            for i, u, p in zip(
                plan,
                useful,
                [[1, t] if args.layout == "packed" else [len(i), t // len(i)] for i, t in zip(plan, padded_tokens)],
            )
        ],
        losses=losses,
        step_times=[round(t, 4) for t in times],
        graphs_per_step=traced if args.compile else None,
        packed_kernels=packed_kernels(model),
        trainable=sum(p.numel() for p in trainable),
    )
    print(json.dumps(row))
    with open(args.out, "w") as f:
        json.dump(row, f)
    if args.compile and args.check_compiled:  # after the row is written: its compilation is not timed
        try:
            row["document_losses_compiled"] = document_losses(model, docs[: args.check_compiled], device)
        except Exception as e:  # noqa: BLE001
            row["document_losses_compiled"] = f"error: {type(e).__name__}: {e}"[:400]
        print(json.dumps(dict(document_losses_compiled=row["document_losses_compiled"])))
        with open(args.out, "w") as f:
            json.dump(row, f)


def packed_kernels(model) -> dict | None:
    """The rewritten file's packed-attention choices (its _moe_rewrite_packing_cache: eager keys, and ("compiled",
    ...) for compiled layers, "varlen" or "mask"), None for native rows."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    cache = getattr(sys.modules[type(base).__module__], "_moe_rewrite_packing_cache", None)
    return None if cache is None else {str(k): str(v) for k, v in cache.items()}


if __name__ == "__main__":
    main()
