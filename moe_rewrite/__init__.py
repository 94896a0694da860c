"""moe-rewrite: make DeepSeek-family MoE remote code trainable, with grouped-GEMM experts."""

__version__ = "0.3.0"

from moe_rewrite.rewrite import RewriteError, RewriteOptions, RewriteResult, rewrite_source  # noqa: E402

__all__ = ["RewriteError", "RewriteOptions", "RewriteResult", "rewrite_source", "__version__"]
