"""What the codemods share: `Context` (context.py), the marker every generated statement carries and the tests for
generated code (markers.py), syntax helpers (syntax.py), the `Index` of what a file holds (index.py), the one
prover of published code (prove.py: imported from there, as it is the codemods' and not the Context's), and the
normalised trees moe_infer's fingerprints are taken of (normalise.py, imported from there too)."""

from moe_rewrite.codemods.kit.context import (
    ACCESSORS,
    SHARED,
    Codemod,
    CompatChanges,
    Context,
    Field,
    Form,
    MoeClassInfo,
    Note,
)
from moe_rewrite.codemods.kit.index import Facts, Index, find, walk
from moe_rewrite.codemods.kit.markers import (
    GENERATED_PREFIXES,
    LEGACY_CALLS,
    MARK,
    METHOD_MARK,
    is_generated_method,
    is_marked,
    marked,
)
from moe_rewrite.codemods.kit.syntax import (
    body_lines,
    class_methods,
    code,
    first_line,
    in_file_lineage,
    one_line,
    reads,
    replace,
    single_method,
    top_classes,
)

__all__ = [
    "ACCESSORS",
    "SHARED",
    "GENERATED_PREFIXES",
    "LEGACY_CALLS",
    "MARK",
    "METHOD_MARK",
    "Codemod",
    "CompatChanges",
    "Context",
    "Facts",
    "Field",
    "Form",
    "Index",
    "MoeClassInfo",
    "Note",
    "body_lines",
    "class_methods",
    "code",
    "find",
    "first_line",
    "in_file_lineage",
    "is_generated_method",
    "is_marked",
    "marked",
    "one_line",
    "reads",
    "replace",
    "single_method",
    "top_classes",
    "walk",
]
