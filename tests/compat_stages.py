"""Run one checkpoint directory through the stages a user goes through, on whatever transformers is installed.

    python tests/compat_stages.py OUT.pt DIR [DIR ...]

Stages, each in order and each only if the one before it passed: import (AutoConfig and the dynamic module), load
(`from_pretrained(trust_remote_code=True)`, float32; its buffers other than the router's correction bias, which
the checkpoint holds, must equal those of a model built from the config), eval (a forward with the config's defaults,
`use_cache=True`), generate (cached greedy `generate()`, which must equal a no-cache greedy decode), train (one
training step with the
config's defaults, `use_cache` included), save (save_pretrained into a new directory, which reloads with the same
eval logits). A directory without `auto_map` in its config.json loads transformers' own
class for its model_type (the native cross-check). OUT.pt gets, per directory, the stage results ("ok" or a one-line
error) and the numbers the tests compare: eval logits, generated tokens, training loss and gradients.

Run as a subprocess of the test suite, once per transformers release (tests/test_compat.py); it imports nothing from
moe-rewrite, so it measures the rewritten files as users run them.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import torch

PROMPT = [[3, 17, 42, 9, 100, 5, 77]]
NEW_TOKENS = 4
STAGES = ("import", "load", "eval", "generate", "train", "save")


def _one_line(exc: BaseException) -> str:
    frame = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
    where = f" ({Path(frame.filename).name}:{frame.lineno})" if frame else ""
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}{where}"


def _greedy_without_cache(model, ids: torch.Tensor, steps: int) -> torch.Tensor:
    for _ in range(steps):
        logits = model(input_ids=ids, use_cache=False).logits
        ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=-1)
    return ids


def _check_buffers(model, built) -> None:
    """Buffers no checkpoint holds (the RoPE tables) must be what __init__ computes, as in a model built from the
    config; transformers 5.x leaves them uninitialised when it loads remote code that does not restore them."""
    fresh = dict(built.named_buffers())
    for name, buffer in model.named_buffers():
        if name in fresh and not torch.equal(buffer, fresh[name].to(buffer.dtype)) and "correction_bias" not in name:
            raise AssertionError(f"buffer {name} after loading differs from a model built from the config")


def run(directory: Path) -> dict:
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    result: dict = {"stages": {}}
    remote = "auto_map" in json.loads((directory / "config.json").read_text())
    model = None
    for stage in STAGES:
        try:
            if stage == "import":
                config = AutoConfig.from_pretrained(directory, trust_remote_code=remote)
                if remote:
                    from transformers.dynamic_module_utils import get_class_from_dynamic_module

                    get_class_from_dynamic_module(config.auto_map["AutoModelForCausalLM"], directory)
            elif stage == "load":
                model = AutoModelForCausalLM.from_pretrained(
                    directory, trust_remote_code=remote, torch_dtype=torch.float32
                )
                result["class"] = f"{type(model).__module__}.{type(model).__name__}"
                _check_buffers(model, AutoModelForCausalLM.from_config(config, trust_remote_code=remote))
            elif stage == "eval":
                model.eval()
                with torch.no_grad():
                    result["logits"] = model(input_ids=torch.tensor(PROMPT)).logits.float()
            elif stage == "generate":
                prompt = torch.tensor(PROMPT)
                with torch.no_grad():
                    cached = model.generate(
                        prompt,
                        attention_mask=torch.ones_like(prompt),
                        max_new_tokens=NEW_TOKENS,
                        do_sample=False,
                        min_new_tokens=NEW_TOKENS,
                        pad_token_id=0,
                    )
                    reference = _greedy_without_cache(model, prompt, NEW_TOKENS)
                result["generated"] = cached
                if not torch.equal(cached, reference):
                    raise AssertionError(f"cached generate {cached.tolist()} != no-cache greedy {reference.tolist()}")
            elif stage == "train":
                model.train()
                ids = torch.tensor(PROMPT)
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                result["loss"] = loss.detach()
                result["grads"] = {
                    name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None
                }
            elif stage == "save":
                import tempfile

                saved = Path(tempfile.mkdtemp(prefix=f"{directory.name}_saved_", dir=directory.parent))
                model.save_pretrained(saved)
                reloaded = AutoModelForCausalLM.from_pretrained(
                    saved, trust_remote_code=remote, torch_dtype=torch.float32
                )
                with torch.no_grad():
                    logits = reloaded.eval()(input_ids=torch.tensor(PROMPT)).logits.float()
                worst = (logits - result["logits"]).abs().max().item()
                if worst > 1e-6:
                    raise AssertionError(f"the saved directory reloads with other eval logits (max diff {worst:.3g})")
        except Exception as exc:  # a stage that fails is the measurement, not a crash of the harness
            result["stages"][stage] = _one_line(exc)
            break
        result["stages"][stage] = "ok"
    result["transformers"] = transformers.__version__
    return result


def main(argv: list[str]) -> int:
    out, *dirs = argv
    torch.manual_seed(0)
    results = {d: run(Path(d)) for d in dirs}
    torch.save(results, out)
    for d, r in results.items():
        print(Path(d).name, json.dumps(r["stages"]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
