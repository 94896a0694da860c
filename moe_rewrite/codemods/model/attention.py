"""Run the attention core through SDPA where the config asks for "sdpa" (on by default; --no-sdpa).

The published eager attention computes its core by hand: an O(S²) score tensor, an fp32 softmax and dropout. Where a
class's forward holds exactly that core (proven statement by statement on the syntax tree, up to names, formatting
and comments), the core goes into the else of a branch that calls torch's scaled_dot_product_attention::

    # Before
    attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) * self.softmax_scale
    if attn_weights.size() != (bsz, self.num_heads, q_len, kv_seq_len):
        raise ValueError(...)
    assert attention_mask is not None
    if attention_mask is not None:
        ...
        attn_weights = attn_weights + attention_mask
    attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query_states.dtype)
    attn_weights = nn.functional.dropout(attn_weights, p=self.attention_dropout, training=self.training)
    attn_output = torch.matmul(attn_weights, value_states)
    ...
    ATTENTION_CLASSES = {"eager": DeepseekV3Attention, "flash_attention_2": DeepseekV3FlashAttention2}
    class DeepseekV3PreTrainedModel(PreTrainedModel):
        _supports_flash_attn_2 = True
    # After
    # moe-rewrite: SDPA where the config asks for it; the published core otherwise
    if self.config._attn_implementation == "sdpa" and not output_attentions and _moe_rewrite_sdpa_enabled():
        attn_weights = None
        attn_output = _moe_rewrite_attention(
            query_states,
            key_states,
            value_states,
            attention_mask,
            self.softmax_scale,
            self.attention_dropout if self.training else 0.0,
        )
    else:
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) * self.softmax_scale
        ...  # the published core, untouched
    ...
    ATTENTION_CLASSES = {"eager": DeepseekV3Attention, "flash_attention_2": DeepseekV3FlashAttention2}
    ATTENTION_CLASSES["sdpa"] = DeepseekV3Attention  # moe-rewrite: ...
    class DeepseekV3PreTrainedModel(PreTrainedModel):
        _supports_flash_attn_2 = True
        _supports_sdpa = True  # moe-rewrite: ...

With `_supports_sdpa`, transformers 4.46 to 5.x load the model with "sdpa" unless the caller names another
implementation: `attn_implementation="eager"` keeps the published core, "flash_attention_2" the file's flash class.
A class whose core differs in any way (an extra score term, another softmax dtype, another order, the mask reassigned
before it) is left as published, and the summary says so; the file is still rewritten. Every run first takes back
what an earlier one added, so --no-sdpa gives the published attention back and a second run changes nothing.
"""

from __future__ import annotations

import ast

import libcst as cst
import libcst.matchers as m

from moe_rewrite.codemods.kit import MARK, Context, Field, Note, code, find, is_marked, replace, single_method
from moe_rewrite.codemods.model.attention_core import Core, find_core
from moe_rewrite.codemods.model.attention_scale import why_not_number
from moe_rewrite.codemods.model.branch import around, unbranched

READS: tuple[Field, ...] = ()
PROVIDES: tuple[Field, ...] = ("notes", "sdpa_classes")
CONCERN = "attention"  # its notes' concern
NOTE = f"{MARK}: SDPA where the config asks for it; the published core otherwise"
ENTRY_NOTE = f"{MARK}: the eager class runs SDPA when the config says sdpa"
SUPPORTS_NOTE = f"{MARK}: loads default to SDPA; attn_implementation='eager' keeps the published core"
BRANCH = (
    'if self.config._attn_implementation == "sdpa" and not output_attentions and _moe_rewrite_sdpa_enabled():\n'
    "    {weights} = None\n"
    "    {output} = _moe_rewrite_attention(\n"
    "        {query},\n"
    "        {key},\n"
    "        {value},\n"
    "        {mask},\n"
    "        {scale},\n"
    "        {dropout} if self.training else 0.0,\n"
    "    )\n"
    "else:\n"
    "    pass\n"
)
OUR_CALL = "_moe_rewrite_attention"
SDPA_DEFAULT = "loads default to sdpa; attn_implementation='eager' keeps the published core"
PRETRAINED_BASE = m.Name("PreTrainedModel") | m.Attribute(attr=m.Name("PreTrainedModel"))
SDPA_ENTRY = m.SimpleStatementLine(
    body=[m.Assign(targets=[m.AssignTarget(m.Subscript(slice=[m.SubscriptElement(m.Index(m.SimpleString()))]))])]
)
SUPPORTS_SDPA = m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(m.Name("_supports_sdpa"))])])


def _keeps_config(cls: cst.ClassDef, classes: dict[str, cst.ClassDef]) -> bool:
    """Whether the class (or a base in the file) sets `self.config`: the branch reads self.config."""
    keeps = m.Assign(targets=[m.AssignTarget(m.Attribute(value=m.Name("self"), attr=m.Name("config")))])
    if find(cls, keeps, cst.Assign):
        return True
    bases = [b.value.value for b in cls.bases if isinstance(b.value, cst.Name)]
    return any(base in classes and _keeps_config(classes[base], classes) for base in bases)


def _branch(forward: cst.FunctionDef, core: Core, module: cst.Module) -> cst.FunctionDef:
    body = list(cst.ensure_type(forward.body, cst.IndentedBlock).body)
    statements = body[core.start : core.end]
    b = core.bound
    text = BRANCH.format(
        weights=b["S"],
        output=b["O"],
        query=b["Q"],
        key=b["K"],
        value=b["V"],
        mask=b["M"],
        scale=ast.unparse(b["SCALE"]),  # type: ignore[arg-type]
        dropout=ast.unparse(b["P"]),  # type: ignore[arg-type]
    )
    branch = around(statements, text, NOTE, module)
    body[core.start : core.end] = [branch]
    return forward.with_changes(body=forward.body.with_changes(body=body))


def undo(module: cst.Module) -> cst.Module:
    """The module without what an earlier run added: the branches, the "sdpa" entries, `_supports_sdpa`."""
    body: list[cst.BaseStatement] = []
    for stmt in module.body:
        if m.matches(stmt, SDPA_ENTRY) and is_marked(stmt):
            continue
        if isinstance(stmt, cst.ClassDef) and isinstance(stmt.body, cst.IndentedBlock):
            members = [
                unbranched(s, NOTE, OUR_CALL) if isinstance(s, cst.FunctionDef) and s.name.value == "forward" else s
                for s in stmt.body.body
                if not (m.matches(s, SUPPORTS_SDPA) and is_marked(s))
            ]
            if len(members) != len(stmt.body.body) or any(a is not b for a, b in zip(members, stmt.body.body)):
                stmt = stmt.with_changes(body=stmt.body.with_changes(body=members))  # new nodes only where changed
        body.append(stmt)
    return module.with_changes(body=body)


def _marked_line(text: str, note: str, module: cst.Module) -> cst.SimpleStatementLine:
    """`text` with the marker comment `note` on the line above it: a formatter that wraps a long line moves a trailing
    comment into the parentheses, where a later run would not find it (then the rewrite and the formatter never
    settle)."""
    line = cst.ensure_type(cst.parse_statement(f"{text}\n", config=module.config_for_parsing), cst.SimpleStatementLine)
    return line.with_changes(leading_lines=[cst.EmptyLine(comment=cst.Comment(note))])


def _attention_dicts(module: cst.Module, classes: list[str]) -> list[tuple[int, str, str]]:
    """(index in the module, dict name, eager class) for each top-level `NAME = {"eager": Class, ...}` whose eager
    class was rewritten and which has no "sdpa" key."""
    found = []
    for i, stmt in enumerate(module.body):
        if not m.matches(
            stmt, m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(m.Name())], value=m.Dict())])
        ):
            continue
        assign = cst.ensure_type(cst.ensure_type(stmt, cst.SimpleStatementLine).body[0], cst.Assign)
        keys = {}
        for element in cst.ensure_type(assign.value, cst.Dict).elements:
            if isinstance(element, cst.DictElement) and isinstance(element.key, cst.SimpleString):
                keys[element.key.evaluated_value] = element.value
        eager = keys.get("eager")
        if isinstance(eager, cst.Name) and eager.value in classes and "sdpa" not in keys:
            found.append((i, cst.ensure_type(assign.targets[0].target, cst.Name).value, eager.value))
    return found


def _with_supports_sdpa(cls: cst.ClassDef, module: cst.Module) -> cst.ClassDef:
    """`_supports_sdpa = True` after the class's other `_supports_*` flags (or its docstring), unless it sets one."""
    members = list(cls.body.body)
    if any(m.matches(s, SUPPORTS_SDPA) for s in members):
        return cls
    flags = [
        i
        for i, s in enumerate(members)
        if m.matches(s, m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(m.Name())])]))
        and cst.ensure_type(cst.ensure_type(s, cst.SimpleStatementLine).body[0], cst.Assign)
        .targets[0]
        .target.value.startswith("_supports_")  # type: ignore[attr-defined]
    ]
    docstring = bool(members) and m.matches(members[0], m.SimpleStatementLine(body=[m.Expr(m.SimpleString())]))
    at = flags[-1] + 1 if flags else int(docstring)
    members.insert(at, _marked_line("_supports_sdpa = True", SUPPORTS_NOTE, module))
    return cls.with_changes(body=cls.body.with_changes(body=members))


def _other_choice(module: cst.Module, context: Context, dicts: set[str]) -> str | None:
    """The first read of `_attn_implementation` that "sdpa" would change: anything but a lookup in one of `dicts`
    (which get an "sdpa" entry) or a test for "flash_attention_2" (VL2 builds "mla_" + the name; a test for "eager"
    would take another path under sdpa)."""
    for stmt in module.body:
        if "_attn_implementation" not in context.index.facts(stmt).attributes:
            continue
        tree = ast.parse(code(stmt))
        fine = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id in dicts:
                fine.add(id(node.slice))
            elif isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], (ast.Eq, ast.NotEq)):
                if isinstance(node.comparators[0], ast.Constant) and node.comparators[0].value == "flash_attention_2":
                    fine.add(id(node.left))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == "_attn_implementation" and id(node) not in fine:
                line = next(x for x in ast.unparse(tree).splitlines() if "_attn_implementation" in x)
                return line.strip()
    return None


def transform(module: cst.Module, context: Context) -> cst.Module:
    """The module with each proven core in its SDPA branch (with --sdpa, the default); what was left, and why, in
    context.notes; the classes "sdpa" selects, rewritten, in context.sdpa_classes."""
    module = undo(module)
    context.sdpa_classes = ()
    notes, start = context.notes, len(context.notes)
    if not context.options.sdpa:
        return module
    classes = {s.name.value: s for s in module.body if isinstance(s, cst.ClassDef)}
    proven = []
    for name, cls in classes.items():
        forward = single_method(cls, "forward")
        if forward is None or not {"matmul", "softmax"} <= context.index.facts(forward).attributes:
            continue
        core = find_core(forward)
        if isinstance(core, str):
            notes.append(Note(CONCERN, name, False, core))
            continue
        if not _keeps_config(cls, classes):
            notes.append(Note(CONCERN, name, False, "it does not keep `self.config`"))
            continue
        scale = why_not_number(core.bound["SCALE"], forward, cls, module)  # type: ignore[arg-type]
        if scale is not None:
            notes.append(Note(CONCERN, name, False, scale))
            continue
        proven.append((name, forward, core))
    entries = _attention_dicts(module, [name for name, _, _ in proven])
    other = _other_choice(module, context, {dict_name for _, dict_name, _ in entries}) if proven else None
    if other is not None:  # a load would default to sdpa, and that line would then do something else
        notes += [Note(CONCERN, name, False, f"the file reads `{other}`") for name, _, _ in proven]
        return module
    rewritten = [name for name, _, _ in proven]
    for _, forward, core in proven:
        module = replace(module, forward, _branch(forward, core, module))
    if not rewritten:
        return module
    body = list(module.body)
    for i, dict_name, eager in reversed(entries):
        body.insert(i + 1, _marked_line(f'{dict_name}["sdpa"] = {eager}', ENTRY_NOTE, module))
    body = [
        _with_supports_sdpa(s, module)
        if isinstance(s, cst.ClassDef) and any(m.matches(b.value, PRETRAINED_BASE) for b in s.bases)
        else s
        for s in body
    ]
    module = module.with_changes(body=body)
    context.sdpa_classes = tuple(sorted({eager for _, _, eager in entries}))
    context.sections.add("attention")
    names = ", ".join(rewritten)
    notes.insert(start, Note(CONCERN, names, True, f"SDPA in {names} ({SDPA_DEFAULT})"))
    return module
