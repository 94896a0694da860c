"""Calls of the Cache methods later releases removed (`get_usable_length`, `from_legacy_cache`, ..., `.seen_tokens`)
through the generated helpers of runtime/compat/compat_cache.py, and reads of `config.rope_scaling` through the
reader of runtime/compat/compat_rope_scaling.py."""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from moe_rewrite.codemods.kit import Index

# method name -> the generated helper that answers it; the receiver becomes the helper's first argument.
CACHE_METHODS = {
    "get_usable_length": "_moe_rewrite_cache_usable_length",
    "get_max_length": "_moe_rewrite_cache_max_length",
    "from_legacy_cache": "_moe_rewrite_cache_from_legacy",
    "to_legacy_cache": "_moe_rewrite_cache_to_legacy",
}
SEEN_TOKENS_HELPER = "_moe_rewrite_cache_seen_tokens"
ROPE_SCALING_HELPER = "_moe_rewrite_rope_scaling"  # `config.rope_scaling` -> `_moe_rewrite_rope_scaling(config)`
HELPERS = {helper: method for method, helper in CACHE_METHODS.items()}
CACHE_NAMES = {*CACHE_METHODS, "seen_tokens", "rope_scaling"}
SELF_OR_SUPER = m.Name("self") | m.Call(func=m.Name("super"))


class CacheCalls(cst.CSTTransformer):
    """Cache method calls (and `.seen_tokens`) -> the generated helpers, on any receiver but self / super(); every
    read of `X.rope_scaling` but `self.rope_scaling` -> the rope_scaling reader."""

    def __init__(self) -> None:
        self.count = 0
        self.rope_reads = 0
        self._targets: set[int] = set()

    def visit_AssignTarget(self, node: cst.AssignTarget) -> None:
        self._targets.add(id(node.target))

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.BaseExpression:
        func = updated_node.func
        if (
            not isinstance(func, cst.Attribute)
            or func.attr.value not in CACHE_METHODS
            or m.matches(func.value, SELF_OR_SUPER)
        ):
            return updated_node
        self.count += 1
        args = [cst.Arg(func.value), *updated_node.args]
        args = [a.with_changes(comma=cst.MaybeSentinel.DEFAULT) for a in args]
        return cst.Call(func=cst.Name(CACHE_METHODS[func.attr.value]), args=args)

    def leave_Attribute(self, original_node: cst.Attribute, updated_node: cst.Attribute) -> cst.BaseExpression:
        attr = updated_node.attr.value
        if attr not in ("seen_tokens", "rope_scaling") or id(original_node) in self._targets:
            return updated_node
        if m.matches(updated_node.value, SELF_OR_SUPER):
            return updated_node
        if attr == "rope_scaling":
            self.rope_reads += 1
            return cst.Call(func=cst.Name(ROPE_SCALING_HELPER), args=[cst.Arg(updated_node.value)])
        self.count += 1
        return cst.Call(func=cst.Name(SEEN_TOKENS_HELPER), args=[cst.Arg(updated_node.value)])


def defines_cache_methods(module: cst.Module, index: Index) -> list[str]:
    names = set(CACHE_METHODS) | {"seen_tokens"}
    return sorted({name for facts in index.module_facts(module) for name in facts.functions if name in names})
