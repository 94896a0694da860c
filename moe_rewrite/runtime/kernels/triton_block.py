"""The column block of the row-wise Triton kernels (triton_gather.py, triton_swiglu.py, triton_sum_rows.py): each
program takes one row and one block of its columns. CUDA with triton only, as every triton_*.py section.
"""

MOE_REWRITE_TRITON_BLOCK = 1024  # columns per program (pass): the rows are memory-bound, one block keeps it simple


def _moe_rewrite_blocks(columns):
    """How many column blocks cover `columns` columns."""
    return -(-columns // MOE_REWRITE_TRITON_BLOCK)


def _moe_rewrite_triton_modules():
    """(triton, triton.language), imported by name: transformers' check_imports takes every `import` of a remote-code
    file outside a try block for a requirement, and a rewritten file must load where triton is not installed (the
    kernels are optional: dispatch.py asks for them only where triton imports)."""
    import importlib

    return importlib.import_module("triton"), importlib.import_module("triton.language")
