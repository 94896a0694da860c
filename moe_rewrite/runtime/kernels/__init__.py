"""The kernels: dispatch, which grouped-GEMM kernel and which Triton kernels run for activations on a device in a
dtype (with the settings and the rewrite's options every section reads), and the Triton kernels, one family per file
with its launcher (triton_rmsnorm and triton_rope also say where they apply). Imports nothing from the other
packages.

Sections (moe_rewrite/runtime/__init__.py SECTION_LIST, in its order):

    dispatch: the kernel choice: grouped-GEMM kernel and Triton kernels per device and dtype, once per process
    triton_block: the column block of the row-wise Triton kernels
    triton_route: the route in one Triton launch
    triton_gather: the gather of each token's row to its top-k places in Triton
    triton_swiglu: SwiGLU and its backward in Triton
    triton_sum_rows: the weighted un-sort and sum of each token's rows, and its backward, in Triton
    triton_gemm: a Triton grouped GEMM for few rows per expert on sm90
    triton_cross_entropy: the fused loss's cross-entropy rows (logsumexp, loss, gradient in place) in Triton
    triton_rmsnorm: RMSNorm and its backward in Triton where they apply (CUDA); the published norm elsewhere
    triton_rope: RoPE and its backward in Triton where they apply (CUDA); the published RoPE elsewhere
"""
