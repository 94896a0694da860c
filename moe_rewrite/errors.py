"""The one exception type the library raises for input it cannot rewrite."""


class RewriteError(Exception):
    """A user-facing, one-line reason why a file or source cannot be rewritten."""


class NotMoeFileError(RewriteError):
    """The file has no DeepSeek-family MoE class at all (as opposed to one whose structure is not recognised)."""
