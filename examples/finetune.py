"""Fine-tune a checkpoint rewritten by moe-rewrite: LoRA or full fine-tuning, with transformers' Trainer or a plain
PyTorch loop, then save and reload. Copy it and change what you need.

    moe-rewrite deepseek-ai/DeepSeek-V2-Lite --include-weights --out ./v2-lite      # once
    python examples/finetune.py ./v2-lite --out ./v2-lite-lora --lora --text train.txt
    python examples/finetune.py ./v2-lite --out ./v2-lite-full --loop --gradient-checkpointing --text train.txt

Without --text it trains on random tokens (a smoke test: `make test` runs it on the bundled stand-in). With a file
rewritten with --bias-update it updates the router's balancing biases once per optimizer step (BiasUpdateCallback in
the Trainer, register_bias_update in the loop). On a GPU it trains in bfloat16.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments

from moe_rewrite import training


def token_blocks(checkpoint: str, text: str | None, vocab_size: int, seq_len: int, count: int) -> list[dict]:
    """`count` training examples of `seq_len` tokens: the text file tokenized with the checkpoint's tokenizer and cut
    into blocks, or random tokens without one."""
    if text is None:
        ids = torch.randint(0, vocab_size, (count, seq_len), generator=torch.Generator().manual_seed(0))
    else:
        tokenizer = AutoTokenizer.from_pretrained(checkpoint, trust_remote_code=True)
        stream = tokenizer(Path(text).read_text(), return_tensors="pt").input_ids[0]
        blocks = len(stream) // seq_len
        if blocks == 0:
            raise SystemExit(f"{text}: fewer than --seq-len={seq_len} tokens")
        ids = stream[: blocks * seq_len].view(blocks, seq_len)
    return [{"input_ids": row, "labels": row} for row in ids]


def load(checkpoint: str, dtype: torch.dtype, args: argparse.Namespace):
    model = AutoModelForCausalLM.from_pretrained(checkpoint, trust_remote_code=True, torch_dtype=dtype)
    if args.gradient_checkpointing:  # each decoder layer recomputed in backward (the rewrite makes this work for V3)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if args.lora:
        from peft import LoraConfig, get_peft_model

        # Every linear layer but the head, the routed experts included: they train as grouped GEMMs.
        config = LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank, target_modules="all-linear")
        model = get_peft_model(model, config)
        model.print_trainable_parameters()
    return model


def train_with_trainer(model, data: list[dict], args: argparse.Namespace, bias_update: bool) -> None:
    cuda = torch.cuda.is_available()
    arguments = TrainingArguments(
        output_dir=str(Path(args.out) / "trainer"),
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        learning_rate=args.lr,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        bf16=cuda,
        use_cpu=not cuda,
        dataloader_num_workers=0,
    )
    callbacks = [training.BiasUpdateCallback()] if bias_update else []
    Trainer(model=model, args=arguments, train_dataset=data, callbacks=callbacks).train()


def train_with_a_loop(model, data: list[dict], args: argparse.Namespace, bias_update: bool) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model.to(device).train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    if bias_update:
        training.register_bias_update(model, optimizer)  # after every optimizer.step()
    for step in range(args.steps):
        batch = data[(step * args.batch_size) % len(data) :][: args.batch_size]
        ids = torch.stack([example["input_ids"] for example in batch]).to(device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        print(f"step {step}: loss {loss.item():.4f}", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a checkpoint directory (or Hub repo) rewritten by moe-rewrite")
    parser.add_argument("--out", required=True, help="where the fine-tuned model (or LoRA adapter) is saved")
    parser.add_argument("--lora", action="store_true", help="train LoRA adapters instead of every weight")
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--loop", action="store_true", help="a plain PyTorch loop instead of transformers' Trainer")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--text", help="a UTF-8 text file to train on (default: random tokens)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-4)
    args = parser.parse_args(argv)

    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    model = load(args.checkpoint, dtype, args)
    bias_update = any(hasattr(m, "moe_rewrite_update_bias") for m in model.modules())
    data = token_blocks(args.checkpoint, args.text, model.config.vocab_size, args.seq_len, 8 * args.batch_size)
    (train_with_a_loop if args.loop else train_with_trainer)(model, data, args, bias_update)

    # Save, reload, and check that the reloaded model computes what the trained one does.
    model.save_pretrained(args.out)  # full: the checkpoint's own per-expert keys and the patched code; LoRA: adapter
    probe = data[0]["input_ids"][None].to(model.device)
    model.eval()
    with torch.no_grad():
        expected = model(input_ids=probe).logits.float()
    if args.lora:
        from peft import PeftModel

        base = AutoModelForCausalLM.from_pretrained(args.checkpoint, trust_remote_code=True, torch_dtype=dtype)
        reloaded = PeftModel.from_pretrained(base, args.out)
    else:
        reloaded = AutoModelForCausalLM.from_pretrained(args.out, trust_remote_code=True, torch_dtype=dtype)
    reloaded.to(model.device).eval()
    with torch.no_grad():
        got = reloaded(input_ids=probe).logits.float()
    print(f"saved to {args.out}; reloaded: max |logits - trained model's| = {(got - expected).abs().max().item():.2e}")


if __name__ == "__main__":
    main()
