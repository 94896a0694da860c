"""`moe-rewrite env`: what this machine gives the generated code. The installed versions, whether transformers is in
the range the tests run on, and the grouped-GEMM kernel the generated code picks here, and why (on a GPU, also whether
its Triton kernels run). Both come from the generated code's own choice (runtime/kernels/dispatch.py), so they are
what a rewritten file does on this machine. The versions print at once; the kernel lines follow once torch has loaded
(a few seconds on a cold start).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import platform
import sys
from collections.abc import Iterator
from pathlib import Path

from moe_rewrite import __version__

RUNTIME_DIR = Path(__file__).parent / "runtime"  # as render.py's, without importing libcst

# The oldest and newest transformers releases the test suite runs the rewritten files on (README, "transformers
# releases"); versions in between are covered too.
TESTED_TRANSFORMERS = ((4, 46), (5, 24))
PACKAGES = ("torch", "transformers", "peft", "huggingface_hub", "libcst", "triton", "grouped_gemm", "sonic-moe")


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def transformers_support(version: str | None) -> str:
    if version is None:
        return "not installed (the rewritten files need it; the rewriter does not)"
    try:
        minor = tuple(int(part) for part in version.split(".")[:2])
    except ValueError:
        return f"{version} (not a release number moe-rewrite can compare)"
    low, high = TESTED_TRANSFORMERS
    tested = f"{low[0]}.{low[1]} to {high[0]}.{high[1]}"
    if minor < low:
        return f"{version}: older than the tested releases ({tested}); not supported"
    if minor > high:
        return f"{version}: newer than the tested releases ({tested}); expected to work, not tested"
    return f"{version}: in the tested range ({tested})"


def _runtime():
    """runtime/kernels/dispatch.py (the kernel choice) as a module, loaded afresh as a new process would (it reads the
    environment once), of the runtime as a package (it imports its sibling sections): the generated code's kernel
    choice as the rewritten files run it."""
    package = "_moe_rewrite_env_runtime"
    for name in [name for name in sys.modules if name.split(".")[0] == package]:
        del sys.modules[name]
    init = RUNTIME_DIR / "__init__.py"
    spec = importlib.util.spec_from_file_location(package, init, submodule_search_locations=[str(init.parent)])
    sys.modules[package] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sys.modules[package])
    return importlib.import_module(f"{package}.{sys.modules[package].BY_NAME['dispatch'].package}.dispatch")


def _why(kernel: str, device, torch) -> str:
    if kernel == "loop":
        return "MOE_REWRITE_BACKEND=loop (the per-expert loop)"
    if kernel == "torch":
        return "torch._grouped_mm (bf16 on sm90 and later)"
    if kernel == "grouped_gemm":
        return "the grouped_gemm package's CUTLASS kernels"
    if kernel == "sonicmoe":
        return "SonicMoE's fused expert-MLP kernels (sonic-moe installed, sm90), torch._grouped_mm where it cannot"
    by_slice = "rows sorted by expert, one matmul per expert's slice"
    if device.type != "cuda":
        return f"{by_slice} (activations on the CPU)"
    major, minor = torch.cuda.get_device_capability(device)
    if not hasattr(torch, "_grouped_mm"):
        return f"{by_slice} (torch {torch.__version__} has no _grouped_mm; grouped_gemm not installed)"
    return f"{by_slice} (sm{major}{minor}: torch._grouped_mm is fast from sm90; grouped_gemm not installed)"


def report() -> Iterator[str]:
    """The lines `moe-rewrite env` prints, one at a time: the versions need no import, the kernel lines need torch."""
    yield f"moe-rewrite {__version__}, python {platform.python_version()}, runtime in {RUNTIME_DIR}"
    versions = {package: _version(package) for package in PACKAGES}
    for package, version in versions.items():
        shown = transformers_support(version) if package == "transformers" else version or "not installed"
        yield f"{package}: {shown}"
    if versions["torch"] is None:
        yield "kernel: none (the rewritten files need torch >= 2.5)"
        return
    import torch

    runtime = _runtime()
    devices = [torch.device("cpu")] + ([torch.device("cuda", 0)] if torch.cuda.is_available() else [])
    backend = runtime._moe_rewrite_setting("MOE_REWRITE_BACKEND", runtime._moe_rewrite_options["backend"])
    for device in devices:
        dtype = torch.bfloat16
        try:
            kernel = runtime._moe_rewrite_choose_kernel(device, dtype)
        except (RuntimeError, ValueError) as e:  # MOE_REWRITE_BACKEND asks for what this machine lacks
            yield f"kernel on {device} (bf16): error: {e}"
            continue
        name = f"{torch.cuda.get_device_name(device)}, " if device.type == "cuda" else ""
        yield f"kernel on {device} ({name}bf16, backend {backend}): {kernel}: {_why(kernel, device, torch)}"
        if device.type == "cuda":
            yield f"elementwise steps on {device}: {_elementwise(runtime, device, torch)}"


def _elementwise(runtime, device, torch) -> str:
    """Whether the Triton kernels (runtime/kernels/triton_*.py) run the route, SwiGLU, the weighted un-sort and (sm90,
    few rows per expert) the grouped GEMM here."""
    if runtime._moe_rewrite_triton(device, torch.bfloat16) is not None:
        return "Triton kernels (the route, SwiGLU, its backward, the weighted un-sort; sm90: the grouped GEMM)"
    if runtime._moe_rewrite_setting("MOE_REWRITE_TRITON", "1") == "0":
        return "torch ops (MOE_REWRITE_TRITON=0)"
    return "torch ops (triton is not installed)"
