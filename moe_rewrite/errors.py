"""The exceptions the library raises: RewriteError for input it cannot rewrite, InternalError for its own bugs."""


class RewriteError(Exception):
    """A user-facing, one-line reason why a file or source cannot be rewritten."""


class Refusals(RewriteError):
    """Every reason the codemods gave for refusing one file, the MoE-form ones first (rewrite.py), on one line:
    the reason itself when there is one, else "2 reasons: (1) ...; (2) ..."."""

    def __init__(self, reasons: list[str]) -> None:
        self.reasons = tuple(reasons)
        if len(reasons) == 1:
            super().__init__(reasons[0])
        else:
            numbered = "; ".join(f"({i}) {reason}" for i, reason in enumerate(reasons, 1))
            super().__init__(f"{len(reasons)} reasons: {numbered}")


class NotMoeFileError(RewriteError):
    """The file has no DeepSeek-family MoE class at all (as opposed to one whose structure is not recognised)."""


class InternalError(Exception):
    """A bug in moe-rewrite (a codemod failed on its own assumptions), not a problem with the file: the CLI says so,
    asks for a report and exits 3. `file` is the file being rewritten, once the CLI knows it."""

    def __init__(self, reason: str, file: str = "") -> None:
        super().__init__(reason)
        self.reason = reason
        self.file = file
