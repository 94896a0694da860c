"""The one exception type the library raises for input it cannot rewrite."""


class RewriteError(Exception):
    """A user-facing, one-line reason why a file or source cannot be rewritten."""
