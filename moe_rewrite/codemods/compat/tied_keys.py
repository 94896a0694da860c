"""`_tied_weights_keys` as transformers 5.x reads it: a list of tied weights becomes a {tied: source} dict (marked),
the source read from the class's get_input_embeddings() or, without it, transformers' own default."""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from moe_rewrite.codemods.kit import CompatChanges, class_methods, in_file_lineage, replace, top_classes
from moe_rewrite.errors import RewriteError

TIED_NOTE = "# moe-rewrite: {tied: source} for transformers 5.x"
TIED_LIST = m.SimpleStatementLine(
    body=[
        m.Assign(
            targets=[m.AssignTarget(target=m.Name("_tied_weights_keys"))],
            value=m.List(elements=[m.Element(m.SimpleString())]),
        )
    ]
)
TIED_OURS = m.SimpleStatementLine(
    body=[m.Assign(targets=[m.AssignTarget(target=m.Name("_tied_weights_keys"))], value=m.Dict())],
    trailing_whitespace=m.TrailingWhitespace(comment=m.Comment(TIED_NOTE)),
)


def _embedding_path(cls: cst.ClassDef, module: cst.Module) -> str | None:
    """'model.embed_tokens' from `def get_input_embeddings(self): return self.model.embed_tokens`; without that
    method (files written for transformers >= 4.5x, Kimi's), what transformers' own default returns: the base model
    `self.<base_model_prefix>`'s `embed_tokens`, where this class and that model's class are in the file and say so."""
    for fn in cls.body.body:
        if m.matches(fn, m.FunctionDef(name=m.Name("get_input_embeddings"))):
            returns = m.findall(fn, m.Return(value=m.Attribute()))
            if len(returns) == 1:
                parts = cst.Module(body=[]).code_for_node(cst.ensure_type(returns[0], cst.Return).value).split(".")  # type: ignore[arg-type]
                if parts[0] == "self" and len(parts) > 1 and all(p.isidentifier() for p in parts):
                    return ".".join(parts[1:])
            return None
    classes = top_classes(module)
    prefix = _class_constant(in_file_lineage(cls, module), "base_model_prefix")
    model = _init_assignment(cls, prefix) if prefix else None
    if not m.matches(model, m.Call(func=m.Name())):
        return None
    base = classes.get(cst.ensure_type(cst.ensure_type(model, cst.Call).func, cst.Name).value)
    if base is None:
        return None
    if any(
        "get_input_embeddings" in class_methods(c)
        for c in [*in_file_lineage(cls, module), *in_file_lineage(base, module)]
    ):
        return None  # an in-file base answers otherwise: not transformers' default
    embedding = m.Call(func=m.Attribute(value=m.Name("nn"), attr=m.Name("Embedding")) | m.Name("Embedding"))
    return f"{prefix}.embed_tokens" if m.matches(_init_assignment(base, "embed_tokens"), embedding) else None


def _class_constant(lineage: list[cst.ClassDef], name: str) -> str | None:
    """A string class attribute, `name = "..."`, of the first class in `lineage` that sets it."""
    assign = m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(m.Name(name))])])
    for stmt in (s for cls in lineage for s in cls.body.body if m.matches(s, assign)):
        value = cst.ensure_type(cst.ensure_type(stmt, cst.SimpleStatementLine).body[0], cst.Assign).value
        return value.evaluated_value if isinstance(value, cst.SimpleString) else None  # type: ignore[return-value]
    return None


def _init_assignment(cls: cst.ClassDef, attribute: str) -> cst.BaseExpression | None:
    """The value of the one `self.<attribute> = ...` in `cls.__init__`, else None."""
    init = class_methods(cls).get("__init__")
    target = m.AssignTarget(m.Attribute(value=m.Name("self"), attr=m.Name(attribute)))
    found = m.findall(init, m.Assign(targets=[target])) if init is not None else []
    return cst.ensure_type(found[0], cst.Assign).value if len(found) == 1 else None


def tied_keys_as_dict(module: cst.Module, changes: CompatChanges) -> cst.Module:
    """`_tied_weights_keys = ["lm_head.weight"]` -> a {tied: source} dict, which 4.x iterates as the same keys."""
    for cls in [s for s in module.body if isinstance(s, cst.ClassDef)]:
        for stmt in cls.body.body:
            if not m.matches(stmt, TIED_LIST):
                continue
            source = _embedding_path(cls, module)
            if source is None:
                raise RewriteError(
                    f"compat: {cls.name.value}._tied_weights_keys is a list, which transformers 5.x cannot read, "
                    "and neither its get_input_embeddings() nor its base model's "
                    "`self.embed_tokens = nn.Embedding(...)` says which weight it is tied to; rerun with --no-compat"
                )
            assign = cst.ensure_type(cst.ensure_type(stmt, cst.SimpleStatementLine).body[0], cst.Assign)
            elements = cst.ensure_type(assign.value, cst.List).elements
            entries = ", ".join(f'{cst.Module(body=[]).code_for_node(e.value)}: "{source}.weight"' for e in elements)
            new = cst.parse_statement(
                f"_tied_weights_keys = {{{entries}}}  {TIED_NOTE}\n", config=module.config_for_parsing
            )
            module = replace(module, stmt, new.with_changes(leading_lines=stmt.leading_lines))
            changes.tied_keys.append(cls.name.value)
    return module
