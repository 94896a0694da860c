"""Imports of what later transformers releases removed: each `from M import ...` line naming one is guarded, `try:`
the import, `except ImportError:` (marked) the runtime section that defines it as 4.x had it (FALLBACKS), or refused
where the file uses a name that has no stand-in."""

from __future__ import annotations

from functools import lru_cache

import libcst as cst
import libcst.matchers as m

from moe_rewrite.codemods.kit import MARK, CompatChanges, Index
from moe_rewrite.errors import RewriteError
from moe_rewrite.render import render_statements

# (module, name) -> the runtime section defining the name where the import fails.
FALLBACKS = {
    ("transformers.utils.import_utils", "is_torch_fx_available"): "compat_fx_available",
    ("transformers.modeling_attn_mask_utils", "_prepare_4d_causal_attention_mask"): "compat_causal_mask",
    # the 4.3x-era imports of DeepSeekMoE 16B (V1) and of training forks of the V2/V3 files
    ("transformers.modeling_attn_mask_utils", "AttentionMaskConverter"): "compat_attn_mask_converter",
    ("transformers.modeling_attn_mask_utils", "_prepare_4d_attention_mask"): "compat_attention_mask",
    ("transformers.modeling_attn_mask_utils", "_prepare_4d_causal_attention_mask_for_sdpa"): "compat_sdpa_causal_mask",
}
GONE_MODULES = {"transformers.modeling_attn_mask_utils": "5.x"}  # the whole module
GONE_NAMES = {("transformers.utils.import_utils", "is_torch_fx_available"): "5.0"}

# Llama's attention classes as 4.46/4.47 had them (DeepSeek-VL2 and DeepSeek-OCR's language models, `use_mla: false`).
# 4.48 removed LlamaFlashAttention2 and LlamaSdpaAttention, so their import fails there; the LlamaAttention imported
# beside them is then 4.48's, which takes RoPE from the caller and returns two values: the stand-in replaces it too.
LLAMA = "transformers.models.llama.modeling_llama"
FALLBACKS |= {(LLAMA, name): "compat_llama_attention" for name in ("LlamaAttention", "LlamaFlashAttention2")}
GONE_NAMES |= {(LLAMA, "LlamaFlashAttention2"): "4.48", (LLAMA, "LlamaSdpaAttention"): "4.48"}
IMPORT_FROM_LINE = m.SimpleStatementLine(body=[m.ImportFrom()])


@lru_cache(maxsize=64)
def _stand_in(section: str, config: cst.PartialParserConfig) -> tuple[cst.BaseStatement, ...]:
    """A fallback section's statements for files with this newline, indentation and encoding, parsed once per
    process (as Context.section does for the block's sections): their nodes, immutable, can be shared."""
    layout = cst.Module(
        body=[], encoding=config.encoding, default_indent=config.default_indent, default_newline=config.default_newline
    )
    return tuple(render_statements(section, layout))


def module_name(node: cst.ImportFrom) -> str:
    return "." * len(node.relative) + (cst.Module(body=[]).code_for_node(node.module) if node.module else "")


def is_our_guard(stmt: cst.CSTNode) -> bool:
    if not (isinstance(stmt, cst.Try) and len(stmt.handlers) == 1):
        return False
    handler = stmt.handlers[0].body
    if not isinstance(handler, cst.IndentedBlock):  # `except ImportError: x = None`, the file's own
        return False
    return handler.header.comment is not None and handler.header.comment.value.startswith(MARK)


def _bound_names(node: cst.ImportFrom) -> list[tuple[str, str]]:
    """(imported name, name it is bound to) for each alias of a `from M import ...`."""
    if isinstance(node.names, cst.ImportStar):
        return []
    return [
        (cst.ensure_type(a.name, cst.Name).value, a.evaluated_alias or cst.ensure_type(a.name, cst.Name).value)
        for a in node.names
    ]


def _gone_since(source: str, imported: str) -> str | None:
    """The transformers release that removed `from source import imported`, or None if it is still there."""
    return GONE_MODULES.get(source) or GONE_NAMES.get((source, imported))


def guard(
    stmt: cst.SimpleStatementLine, node: cst.ImportFrom, module: cst.Module, changes: CompatChanges, index: Index
) -> cst.Try:
    source = module_name(node)
    fallback: list[cst.BaseStatement] = []
    rendered: set[str] = set()
    for imported, bound in _bound_names(node):
        section = FALLBACKS.get((source, imported))
        since = _gone_since(source, imported)
        if section is not None:
            changes.imports.append(bound)
            if section in rendered:  # a section that stands in for several names (Llama's attention classes)
                continue
            rendered.add(section)
            defs = list(_stand_in(section, module.config_for_parsing))
            classes = [d for d in defs if isinstance(d, cst.ClassDef)]
            if not classes:  # the function under the file's name for it; its helpers keep theirs
                fallback += [d.with_changes(name=cst.Name(bound)) if is_named(d, imported) else d for d in defs]
                continue
            # Classes keep their names (one is the other's base): the file must bind them by those names only.
            for cls in classes:
                name = cls.name.value
                aliases = [b for i, b in _bound_names(node) if i == name]
                if aliases not in ([], [name]) or (not aliases and index.count(module, name)):
                    raise RewriteError(
                        f"compat: the stand-in for `{imported}` from {source} defines {name}, which the file binds "
                        "otherwise; rerun with --no-compat to keep the import as it is"
                    )
            fallback += defs
        elif since is None:  # still there: imported on its own, beside the stand-ins
            alias = f" as {bound}" if bound != imported else ""
            fallback.append(
                cst.parse_statement(f"from {source} import {imported}{alias}\n", config=module.config_for_parsing)
            )
        elif index.count(module, bound) > 1:  # more than the import itself
            raise RewriteError(
                f"compat: `{imported}` from {source} is gone in transformers {since} and the file uses it; "
                "moe-rewrite has no stand-in for it (rerun with --no-compat to keep the import as it is)"
            )
    if not fallback:  # nothing the file uses: keep the import importable by binding nothing else
        fallback = [cst.SimpleStatementLine(body=[cst.Pass()])]
    since = next(filter(None, (_gone_since(source, imported) for imported, _ in _bound_names(node))))
    comment = f"{MARK}: gone in transformers {since}; defined here as 4.x had it"
    handler = cst.ExceptHandler(
        type=cst.Name("ImportError"),
        body=cst.IndentedBlock(
            body=fallback,
            header=cst.TrailingWhitespace(whitespace=cst.SimpleWhitespace("  "), comment=cst.Comment(comment)),
        ),
    )
    return cst.Try(
        body=cst.IndentedBlock(body=[stmt.with_changes(leading_lines=[])]),
        handlers=[handler],
        leading_lines=stmt.leading_lines,
    )


def is_named(stmt: cst.BaseStatement, name: str) -> bool:
    """The stand-in's own definition (its helpers keep their names)."""
    return isinstance(stmt, (cst.FunctionDef, cst.ClassDef)) and stmt.name.value == name


def removed(node: cst.ImportFrom) -> bool:
    source = module_name(node)
    return any(_gone_since(source, imported) for imported, _ in _bound_names(node))
