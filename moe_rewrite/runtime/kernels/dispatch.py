"""Kernel choice: which grouped-GEMM kernel and which Triton kernels run for activations on a device in a dtype, from
the environment variables and the rewrite's options, each decided once per process. Always generated (the core,
with route.py, grouped_linear.py, expert_output.py, backends.py, moe_train.py and the triton_*.py kernels).

Every cache of the generated code is a dict named `_moe_rewrite_*_cache`, here: the tests find and clear them by that
name, as a new process would start with them empty. The decisions torch.compile's graphs read are marked
torch.compiler.assume_constant_result: a graph takes the decision made at tracing as a constant and guards on no
cache, so the cache filled by the first call does not make the next one trace again (a compiled layer's
recomputation under gradient checkpointing included).
"""

import torch

from .triton_gather import _moe_rewrite_gather_kernels
from .triton_gemm import _moe_rewrite_gemm_fits, _moe_rewrite_gemm_kernels
from .triton_route import _moe_rewrite_route_kernels
from .triton_sum_rows import _moe_rewrite_sum_rows_kernels
from .triton_swiglu import _moe_rewrite_swiglu_kernels

# moe-rewrite writes the rewrite's own options here (backend, stacking, version; see moe_rewrite/options.py).
_moe_rewrite_options = {"version": "template", "backend": "auto", "stacking": "stack"}
_moe_rewrite_settings_cache = {}  # environment variable -> value
_moe_rewrite_kernel_cache = {}  # (device, dtype) -> the grouped-GEMM kernel's name
_moe_rewrite_triton_cache = {}  # "kernels" -> the Triton kernels ({name: jitted function}) or None
_moe_rewrite_hopper_cache = {}  # device -> whether it is an sm90 GPU
# generated with: fp8-experts
_moe_rewrite_fp8_cache = {}  # device -> its compute capability (FP8 compute: sm89+)
_moe_rewrite_ops_cache = {}  # custom operator name -> whether torch.ops.moe_rewrite.<name> is registered


@torch.compiler.assume_constant_result  # a per-process decision: a constant in compiled graphs
def _moe_rewrite_setting(name, default):
    """The environment variable `name` (MOE_REWRITE_BACKEND, MOE_REWRITE_TRITON, MOE_REWRITE_TRITON_GEMM, ...), read on
    first use and kept for the process, so that no training step reads the environment."""
    if name not in _moe_rewrite_settings_cache:
        import os

        _moe_rewrite_settings_cache[name] = os.environ.get(name) or default
    return _moe_rewrite_settings_cache[name]


def _moe_rewrite_compute_dtype(x):
    """The dtype the expert GEMMs run in: torch.autocast's when it is on for x's device (as nn.Linear would), else
    x's."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


@torch.compiler.assume_constant_result  # a per-process decision: a constant in compiled graphs
def _moe_rewrite_kernel(device, dtype):
    """The grouped-GEMM kernel for activations on `device` computed in `dtype`: "torch", "sonicmoe" (the whole expert
    MLP where SonicMoE runs it, else "torch"), "grouped_gemm", "sorted" or "loop". Decided on first use per
    (device, dtype) and kept for the process."""
    key = (device, dtype)
    if key not in _moe_rewrite_kernel_cache:
        _moe_rewrite_kernel_cache[key] = _moe_rewrite_choose_kernel(device, dtype)
    return _moe_rewrite_kernel_cache[key]


def _moe_rewrite_choose_kernel(device, dtype):
    """MOE_REWRITE_BACKEND, else the backend chosen at rewrite time, resolved for this device and dtype."""
    backend = _moe_rewrite_setting("MOE_REWRITE_BACKEND", _moe_rewrite_options["backend"])
    cuda_bf16 = device.type == "cuda" and dtype == torch.bfloat16
    if backend == "loop":
        return "loop"
    if backend == "grouped_gemm":
        if not cuda_bf16 or _moe_rewrite_grouped_gemm() is None:
            raise RuntimeError(
                "moe-rewrite: backend 'grouped_gemm' needs the grouped_gemm package, CUDA and bfloat16 activations"
            )
        return "grouped_gemm"
    if backend == "sonicmoe":  # SonicMoE's kernels are written for Hopper (sm90) and bf16
        if not (cuda_bf16 and _moe_rewrite_hopper(device)) or _moe_rewrite_sonicmoe() is None:
            raise RuntimeError(
                "moe-rewrite: backend 'sonicmoe' needs the sonic-moe package, an sm90 GPU (H100, H200) and bfloat16 "
                "activations"
            )
        return "sonicmoe"
    # torch's grouped matmul (torch._grouped_mm, torch's only grouped GEMM, private but the one transformers uses too)
    # has fast kernels for bf16 on sm90+ only; anywhere else the sorted kernel is faster.
    torch_fast = cuda_bf16 and hasattr(torch, "_grouped_mm") and torch.cuda.get_device_capability(device)[0] >= 9
    if backend == "torch":
        return "torch" if torch_fast else "sorted"
    if backend == "auto":  # never SonicMoE: its first call per token count autotunes for minutes (bench/NOTES.md)
        if torch_fast:
            return "torch"
        if cuda_bf16 and _moe_rewrite_grouped_gemm() is not None:
            return "grouped_gemm"
        return "sorted"
    raise ValueError(f"moe-rewrite: unknown backend {backend!r}; use auto, torch, sonicmoe, grouped_gemm or loop")


def _moe_rewrite_grouped_gemm():
    """The grouped_gemm package's backend module, or None when it is not installed."""
    try:
        from grouped_gemm import backend
    except ImportError:
        return None
    return backend


def _moe_rewrite_sonicmoe():
    """The sonic-moe package (SonicMoE: the whole expert MLP in fused CuTe-DSL kernels for Hopper), or None when it is
    not installed."""
    try:
        import sonicmoe
    except ImportError:
        return None
    return sonicmoe


@torch.compiler.assume_constant_result  # a per-process decision: a constant in compiled graphs
def _moe_rewrite_hopper(device):
    """Whether `device` is an sm90 GPU (H100, H200): SonicMoE's kernels, and torch._grouped_mm's tile choice
    (_moe_rewrite_padding). Asked once per device and kept for the process (it is asked every step)."""
    if device not in _moe_rewrite_hopper_cache:
        hopper = device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)
        _moe_rewrite_hopper_cache[device] = hopper
    return _moe_rewrite_hopper_cache[device]


def _moe_rewrite_triton(device, dtype):
    """The Triton kernels of the memory-bound steps (the triton_*.py sections) for rows on `device` in `dtype`, or
    None, and the same arithmetic runs as torch ops: off CUDA, in float64 (the kernels compute in float32), without
    triton, with MOE_REWRITE_TRITON=0, or under torch.compile (which fuses those steps itself). Built on first use and
    kept for the process."""
    if device.type != "cuda" or dtype == torch.float64 or torch.compiler.is_compiling():
        return None
    if "kernels" not in _moe_rewrite_triton_cache:
        wanted = _moe_rewrite_setting("MOE_REWRITE_TRITON", "1") != "0"
        _moe_rewrite_triton_cache["kernels"] = _moe_rewrite_build_triton() if wanted else None
    return _moe_rewrite_triton_cache["kernels"]


def _moe_rewrite_build_triton():
    """Every Triton kernel, {name: jitted function}, or None where triton is not installed. Called once per process."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return None
    return {
        **_moe_rewrite_route_kernels(),
        **_moe_rewrite_gather_kernels(),
        **_moe_rewrite_swiglu_kernels(),
        **_moe_rewrite_sum_rows_kernels(),
        **_moe_rewrite_gemm_kernels(),
    }


def _moe_rewrite_gemm_by_triton(device, rows, experts, n, k):
    """Whether the Triton grouped GEMM (triton_gemm.py) runs a forward or input-gradient product of `rows` rows
    over `experts` experts, n wide and k deep, instead of torch._grouped_mm, where the kernel is "torch" (bf16) and
    the Triton kernels run: on sm90 at no more than 160 rows per expert on average, where torch's CUTLASS tiles read
    an expert's weights once per row tile (bench/NOTES.md, change 26: 1.07-1.36x at V3's widths and 64-160 rows per
    expert, 0.87-1.01x at 256 and 768), for products at least one tile wide and a depth of whole tiles (not the
    adapters' rank-r ones).
    MOE_REWRITE_TRITON_GEMM=0 keeps torch's."""
    if rows > 160 * experts or not _moe_rewrite_gemm_fits(n, k) or not _moe_rewrite_hopper(device):
        return False
    return _moe_rewrite_setting("MOE_REWRITE_TRITON_GEMM", "1") != "0"


# generated with: fp8-experts
def _moe_rewrite_fp8_compute(device, kernels):
    """Whether FP8 experts' grouped GEMMs run in FP8 compute (W8A8: rows quantized per 1 x 128 tile, FP8 tensor-core
    products; grouped_linear.py's _moe_rewrite_fp8_gmm): MOE_REWRITE_FP8_COMPUTE (1 or 0), else the rewrite's
    --fp8-compute. Off CUDA its arithmetic runs as torch ops (for tests); on CUDA it needs FP8 tensor cores (sm89+)
    and the Triton kernels, and where asked without them it raises rather than run another arithmetic."""
    asked = _moe_rewrite_setting("MOE_REWRITE_FP8_COMPUTE", "1" if _moe_rewrite_options.get("fp8_compute") else "0")
    if asked not in ("0", "1"):
        raise ValueError(f"moe-rewrite: MOE_REWRITE_FP8_COMPUTE={asked!r}; use 1 (FP8 compute) or 0 (bf16 compute)")
    if asked == "0" or device.type != "cuda":
        return asked == "1"
    if device not in _moe_rewrite_fp8_cache:
        _moe_rewrite_fp8_cache[device] = torch.cuda.get_device_capability(device)
    capability = _moe_rewrite_fp8_cache[device]
    if capability < (8, 9):
        raise RuntimeError(
            f"moe-rewrite: FP8 compute needs a GPU with FP8 tensor cores (sm89+: L4, L40S, H100, H200, B200), not "
            f"sm{capability[0]}{capability[1]}; set MOE_REWRITE_FP8_COMPUTE=0 (or rewrite without --fp8-compute)"
        )
    if kernels is None:
        raise RuntimeError(
            "moe-rewrite: FP8 compute needs the Triton kernels (triton installed, MOE_REWRITE_TRITON unset or 1, not "
            "under torch.compile, bf16, fp16 or float32 activations); set MOE_REWRITE_FP8_COMPUTE=0 (or rewrite "
            "without --fp8-compute)"
        )
    return True


def _moe_rewrite_custom_op(name, schema, impl, fake, backward=None, setup_context=None):
    """Whether torch.ops.moe_rewrite.<name> is registered, registering it on the first call: `impl` as a custom
    operator (torch.library.custom_op, torch >= 2.4) with the fake implementation `fake` (the output's shape and
    dtype from the inputs', for torch.compile's tracing) and, where given, its autograd formula. torch.compile's
    graphs call the operator as one opaque node: no graph break and no shape that depends on the routing inside; eager
    code calls `impl`'s own code directly. An operator registered by another copy of this code (a second rewritten
    file in the process) is used as it is. False on torch < 2.4: compiled graphs break there instead."""
    if name not in _moe_rewrite_ops_cache:
        try:
            getattr(torch.ops.moe_rewrite, name)
            registered = True
        except (AttributeError, RuntimeError):
            registered = hasattr(torch.library, "custom_op")
            if registered:
                op = torch.library.custom_op(f"moe_rewrite::{name}", impl, mutates_args=(), schema=schema)
                op.register_fake(fake)
                if backward is not None:
                    op.register_autograd(backward, setup_context=setup_context)
        _moe_rewrite_ops_cache[name] = registered
    return _moe_rewrite_ops_cache[name]
