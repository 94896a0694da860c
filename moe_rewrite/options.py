"""What a rewrite is asked to generate. Written into the patched file (_moe_rewrite_options) and its banner."""

from __future__ import annotations

import math
from dataclasses import dataclass

from moe_rewrite.errors import RewriteError

BACKENDS = ("auto", "torch", "sonicmoe", "grouped_gemm", "loop")
STACKINGS = ("stack", "sequential")


@dataclass(frozen=True)
class RewriteOptions:
    backend: str = "auto"
    stacking: str = "stack"
    aux_loss: bool = False  # V3 form: the complementary sequence-wise balance loss, weighted by aux_loss_alpha
    bias_update: float | None = None  # V3 form: aux-loss-free balancing, bias += RATE * sign(mean load - load)
    gradient_checkpointing: bool = True  # V3 form: make gradient_checkpointing_enable() checkpoint decoder layers
    # from_pretrained / from_config fuse the routed experts (moe_rewrite_fuse_experts); None, the default: fused,
    # unless the file needs per-expert layers, which the rewrite then chooses and says (Context.need_per_expert_layers)
    fuse_experts: bool | None = None
    compat: bool = True  # run on transformers 4.46 through 5.x (codemods/compat/)
    sdpa: bool = True  # the attention core through SDPA where the config asks for "sdpa" (codemods/model/attention.py)
    fused_loss: bool = True  # the causal-LM loss without float32 logits in training (codemods/model/lm_loss.py)
    fused_norm: bool = True  # RMSNorm through the fused Triton kernels where they apply (codemods/model/rmsnorm.py)
    fused_rope: bool = True  # apply_rotary_pos_emb through the fused Triton kernel where it applies (model/rope.py)
    # FP8 block-quantized experts (runtime/experts/fp8_experts.py): generated where asked; None, the default: where the
    # checkpoint's config.json asks for FP8 (quantization_config), else where an earlier rewrite's banner records
    # them, else not (rewrite.fp8_choice, said in the summary)
    fp8_experts: bool | None = None
    # FP8 experts' grouped GEMMs in FP8 compute (W8A8: rows quantized per 1 x 128 tile, FP8 tensor cores), the default
    # of the generated code's MOE_REWRITE_FP8_COMPUTE; asks for FP8 experts (rewrite.fp8_choice), refused without them;
    # None: where an earlier rewrite's banner records it, else not (rewrite.fp8_compute_choice)
    fp8_compute: bool | None = None
    # expert parallelism (runtime/moe/expert_parallel.py, runtime/parallel/): generated where asked, with fused experts
    # only; None, the default: where an earlier rewrite's banner records it, else not (rewrite.expert_parallel_choice)
    expert_parallel: bool | None = None
    # not an option: what the file's experts chose (codemods/moe/expert_mlp.py): their forward casts x to their weights'
    # dtype and back (DeepSeek's ESFT fork), so moe_train checks the experts' dtypes (render.features, "expert-casts")
    expert_casts: bool = False

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise RewriteError(f"unknown backend {self.backend!r}; choose from {', '.join(BACKENDS)}")
        if self.stacking not in STACKINGS:
            raise RewriteError(f"unknown stacking {self.stacking!r}; choose from {', '.join(STACKINGS)}")
        if self.bias_update is not None and not (math.isfinite(self.bias_update) and self.bias_update > 0):
            raise RewriteError(f"--bias-update RATE must be a positive number, got {self.bias_update}")
        if self.fp8_compute and self.fp8_experts is False:
            raise RewriteError("--fp8-compute runs FP8 experts' GEMMs in FP8: it cannot go with --no-fp8-experts")

        if self.expert_parallel and self.fuse_experts is False:
            raise RewriteError("--expert-parallel needs fused experts: drop --no-fuse-experts")

    def describe(self) -> str:
        """backend=auto, stacking=stack[, aux-loss][, bias-update=0.001][, no-gradient-checkpointing][, no-fuse-experts]
        [, no-compat][, no-sdpa][, no-fused-loss][, no-fused-norm][, no-fused-rope][, fp8-experts][, fp8-compute]
        [, expert-parallel]: the defaults are not named."""
        parts = [f"backend={self.backend}", f"stacking={self.stacking}"]
        if self.aux_loss:
            parts.append("aux-loss")
        if self.bias_update is not None:
            parts.append(f"bias-update={self.bias_update:g}")
        if not self.gradient_checkpointing:
            parts.append("no-gradient-checkpointing")
        if self.fuse_experts is False:
            parts.append("no-fuse-experts")
        if not self.compat:
            parts.append("no-compat")
        if not self.sdpa:
            parts.append("no-sdpa")
        if not self.fused_loss:
            parts.append("no-fused-loss")
        if not self.fused_norm:
            parts.append("no-fused-norm")
        if not self.fused_rope:
            parts.append("no-fused-rope")
        if self.fp8_experts:
            parts.append("fp8-experts")
        if self.fp8_compute:
            parts.append("fp8-compute")
        if self.expert_parallel:
            parts.append("expert-parallel")
        return ", ".join(parts)

    def as_dict(self, version: str) -> dict:
        """What the generated code reads at run time (opt-in keys only when enabled)."""
        values: dict = {"version": version, "backend": self.backend, "stacking": self.stacking}
        if self.bias_update is not None:
            values["bias_update"] = self.bias_update
        if self.fp8_compute:
            values["fp8_compute"] = 1  # JSON-rendered (render.options_literal): 1, not true
        return values
