"""moe-rewrite: make DeepSeek-family MoE remote code trainable, with grouped-GEMM experts."""

__version__ = "0.7.6"

__all__ = ["RewriteError", "RewriteOptions", "RewriteResult", "rewrite_source", "__version__"]


def __getattr__(name: str):
    """The library API, imported on first use: libcst takes about a second to import, which `moe-rewrite env` and
    `--version` do not need."""
    if name in __all__:
        from moe_rewrite import rewrite

        return getattr(rewrite, name)
    raise AttributeError(f"module 'moe_rewrite' has no attribute {name!r}")
