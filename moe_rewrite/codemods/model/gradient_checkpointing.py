"""Make `gradient_checkpointing_enable()` work in the V3 form (on by default; --no-gradient-checkpointing).

The V3-form model class advertises `supports_gradient_checkpointing = True`, but its decoder loop never checkpoints::

    # Before
    use_cache = use_cache if use_cache is not None else self.config.use_cache
    ...
    for decoder_layer in self.layers:
        layer_outputs = decoder_layer(hidden_states, attention_mask=attention_mask, use_cache=use_cache)
    # After
    use_cache = use_cache if use_cache is not None else self.config.use_cache
    # moe-rewrite: no KV cache under gradient checkpointing (a recomputed layer would add to it twice).
    if self.gradient_checkpointing and self.training:
        use_cache = False
    ...
    for decoder_layer in self.layers:
        if self.gradient_checkpointing and self.training:
            layer_outputs = _moe_rewrite_checkpoint_layer(
                self._gradient_checkpointing_func, decoder_layer, hidden_states, attention_mask=attention_mask, ...
            )
        else:
            layer_outputs = decoder_layer(hidden_states, attention_mask=attention_mask, use_cache=use_cache)

A loop that already checkpoints (the V2 form) is left alone. Running without the option removes what it added.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from moe_rewrite.codemods.kit import Context, Field, find, replace
from moe_rewrite.errors import RewriteError

CHECKPOINTING_ON = m.BooleanOperation(
    left=m.Attribute(value=m.Name("self"), attr=m.Name("gradient_checkpointing")),
    operator=m.And(),
    right=m.Attribute(value=m.Name("self"), attr=m.Name("training")),
)
MENTIONS_CHECKPOINTING = m.If(test=m.MatchIfTrue(lambda test: bool(m.findall(test, m.Name("gradient_checkpointing")))))
CHECKPOINT_LAYER = "_moe_rewrite_checkpoint_layer"
OUR_CALL = m.Call(func=m.Name(CHECKPOINT_LAYER))
USE_CACHE_ASSIGN = m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(target=m.Name("use_cache"))])])
NOTE = "# moe-rewrite: no KV cache under gradient checkpointing (a recomputed layer would add to it twice)."
READS: tuple[Field, ...] = ()
PROVIDES: tuple[Field, ...] = ()


def _is_our_use_cache_guard(stmt: cst.CSTNode) -> bool:
    return (
        isinstance(stmt, cst.If)
        and m.matches(stmt.test, CHECKPOINTING_ON)
        and any(line.comment is not None and line.comment.value == NOTE for line in stmt.leading_lines)
    )


def _layer_loops(forward: cst.FunctionDef) -> list[cst.For]:
    return [
        cst.ensure_type(loop, cst.For)
        for loop in find(
            forward, m.For(target=m.Name(), iter=m.Attribute(value=m.Name("self"), attr=m.Name("layers"))), cst.For
        )
    ]


def _layer_call_index(loop: cst.For) -> int | None:
    layer = cst.ensure_type(loop.target, cst.Name).value
    call = m.SimpleStatementLine(body=[m.Assign(value=m.Call(func=m.Name(layer)))])
    found = [i for i, s in enumerate(loop.body.body) if m.matches(s, call)]
    return found[0] if len(found) == 1 else None


def _checkpointed(loop: cst.For, index: int, config: cst.PartialParserConfig) -> cst.If:
    stmt = cst.ensure_type(loop.body.body[index], cst.SimpleStatementLine)
    assign = cst.ensure_type(stmt.body[0], cst.Assign)
    call = cst.ensure_type(assign.value, cst.Call)
    code = cst.Module(body=[]).code_for_node
    # One argument a line, as black writes a call that does not fit on one.
    args = ["self._gradient_checkpointing_func", code(call.func)]
    args += [
        code(a.with_changes(comma=cst.MaybeSentinel.DEFAULT, whitespace_after_arg=cst.SimpleWhitespace("")))
        for a in call.args
    ]
    targets = "".join(code(t) for t in assign.targets)
    text = targets + "_moe_rewrite_checkpoint_layer(\n" + "".join(f"    {a},\n" for a in args) + ")\n"
    checkpointed = cst.parse_statement(text, config=config)
    return cst.If(
        test=cst.parse_expression("self.gradient_checkpointing and self.training"),
        body=cst.IndentedBlock(body=[checkpointed]),
        orelse=cst.Else(body=cst.IndentedBlock(body=[stmt.with_changes(leading_lines=[])])),
        leading_lines=stmt.leading_lines,
    )


class _Checkpointing(cst.CSTTransformer):
    """Adds (enabled) or removes (not enabled) the checkpointing branch and the use_cache guard in one forward."""

    def __init__(self, enabled: bool, config: cst.PartialParserConfig) -> None:
        self.enabled, self.config = enabled, config

    def leave_For(self, original_node: cst.For, updated_node: cst.For) -> cst.For:
        if not m.matches(original_node.iter, m.Attribute(value=m.Name("self"), attr=m.Name("layers"))):
            return updated_node
        body = list(updated_node.body.body)
        for i, stmt in enumerate(body):
            if m.matches(stmt, MENTIONS_CHECKPOINTING) and m.findall(stmt, OUR_CALL) and not self.enabled:
                restored = cst.ensure_type(cst.ensure_type(stmt, cst.If).orelse, cst.Else).body.body[0]
                body[i] = restored.with_changes(leading_lines=stmt.leading_lines)
        if self.enabled and not any(m.matches(s, MENTIONS_CHECKPOINTING) for s in body):
            index = _layer_call_index(updated_node)
            if index is None:
                raise RewriteError(
                    "the decoder loop has no single `layer_outputs = decoder_layer(...)` call to checkpoint"
                )
            body[index] = _checkpointed(updated_node, index, self.config)
        return updated_node.with_changes(body=updated_node.body.with_changes(body=body))


def _use_cache_guard() -> cst.If:
    guard = cst.ensure_type(
        cst.parse_statement("if self.gradient_checkpointing and self.training:\n    use_cache = False\n"), cst.If
    )
    return guard.with_changes(leading_lines=[cst.EmptyLine(comment=cst.Comment(NOTE))])


def _natively_checkpointed(forward: cst.FunctionDef) -> bool:
    return any(
        m.matches(s, MENTIONS_CHECKPOINTING) and not m.findall(s, OUR_CALL)
        for loop in _layer_loops(forward)
        for s in loop.body.body
    )


def _rewrite_forward(forward: cst.FunctionDef, enabled: bool, config: cst.PartialParserConfig) -> cst.FunctionDef:
    forward = cst.ensure_type(forward.visit(_Checkpointing(enabled, config)), cst.FunctionDef)
    body = [s for s in forward.body.body if not _is_our_use_cache_guard(s)]
    takes_use_cache = any(p.name.value == "use_cache" for p in forward.params.params + forward.params.kwonly_params)
    if enabled and takes_use_cache:
        # Right after `use_cache` is resolved (before any cache is built), else right before the decoder loop.
        resolved = [i for i, s in enumerate(body) if m.matches(s, USE_CACHE_ASSIGN)]
        loop = next(i for i, s in enumerate(body) if _layer_loops_in(s))
        body.insert(resolved[0] + 1 if resolved and resolved[0] < loop else loop, _use_cache_guard())
    return forward.with_changes(body=forward.body.with_changes(body=body))


def _layer_loops_in(node: cst.CSTNode) -> bool:
    return bool(find(node, m.For(iter=m.Attribute(value=m.Name("self"), attr=m.Name("layers"))), cst.For))


def transform(module: cst.Module, context: Context) -> cst.Module:
    """The module with the checkpointing branch added (--gradient-checkpointing, the default) or removed."""
    enabled = context.options.gradient_checkpointing
    forwards = [
        fn
        for cls in module.body
        if isinstance(cls, cst.ClassDef)
        for fn in cls.body.body
        if isinstance(fn, cst.FunctionDef)
        and fn.name.value == "forward"
        and context.index.mentions(fn, "layers")
        and _layer_loops(fn)
    ]
    # A file without a decoder loop (a bare MoE module) has nothing to checkpoint: on by default, so not an error.
    for forward in forwards:
        if not _natively_checkpointed(forward):  # the V2 form checkpoints already
            module = replace(module, forward, _rewrite_forward(forward, enabled, module.config_for_parsing))
    if any(CHECKPOINT_LAYER in facts.called for facts in context.index.module_facts(module)):
        context.sections.add("checkpoint_layer")
    return module
