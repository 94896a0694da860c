"""Which class the routed experts are: every `self.experts = ...` in the MoE class's `__init__` (or the nearest in-file
base's that assigns it) must be an `nn.ModuleList` of `X(...)` built in one comprehension (`... if lo <= i < hi else
None` allowed in the `ep_size > 1` branch only), X a class of the file."""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from moe_rewrite.codemods.kit import class_methods, one_line
from moe_rewrite.codemods.moe.expert_mlp_proof import NN
from moe_rewrite.errors import RewriteError

NN_MODULE_LIST = m.Attribute(value=NN, attr=m.Name("ModuleList")) | m.Name("ModuleList")
SELF_EXPERTS = m.Attribute(value=m.Name("self"), attr=m.Name("experts"))


def _in_ep_branch(init: cst.FunctionDef, assign: cst.CSTNode) -> bool:
    """Whether `assign` sits in the body (not the else) of an `if ... ep_size > 1:` in `init`."""
    greater = m.Comparison(comparisons=[m.ComparisonTarget(operator=m.GreaterThan(), comparator=m.Integer("1"))])
    for branch in m.findall(init, m.If()):
        branch = cst.ensure_type(branch, cst.If)
        tests = [cst.ensure_type(c, cst.Comparison) for c in m.findall(branch.test, greater)]
        mentions_ep = any("ep_size" in one_line(c.left) for c in tests)
        if mentions_ep and any(node is assign for node in m.findall(branch.body, m.Assign())):
            return True
    return False


def expert_class(moe: str, classes: dict[str, cst.ClassDef]) -> str:
    # the nearest __init__ that assigns self.experts; one that does not must hand over to its base's
    found = None
    for cls in chain_or_any(moe, classes):
        init = class_methods(cls).get("__init__")
        if init is None:
            continue
        if m.findall(init, SELF_EXPERTS):
            found = cls.name.value, init
            break
        super_init = m.Call(func=m.Attribute(value=m.Call(func=m.Name("super")), attr=m.Name("__init__")))
        if not m.findall(init, super_init):
            break
    if found is None:
        raise RewriteError(
            f"{moe}.__init__: no `self.experts = ...` in this file, so moe-rewrite cannot see the experts"
        )
    owner, init = found
    where = f"{owner}.__init__"
    assigns = [
        cst.ensure_type(a, cst.Assign)
        for a in m.findall(init, m.Assign(targets=[m.ZeroOrMore(), m.AssignTarget(SELF_EXPERTS), m.ZeroOrMore()]))
    ]
    if not assigns or len(m.findall(init, SELF_EXPERTS)) != len(assigns):
        raise RewriteError(
            f"{where}: the routed experts should be assigned as `self.experts = nn.ModuleList([...])` and not used "
            "otherwise there"
        )
    names = set()
    for assign in assigns:
        value = assign.value
        if not m.matches(value, m.Call(func=NN_MODULE_LIST)):
            raise RewriteError(
                f"{where}: `self.experts = {one_line(value)}` is not an nn.ModuleList, which moe-rewrite's grouped "
                "experts need"
            )
        call = cst.ensure_type(value, cst.Call)
        comp = call.args[0].value if len(call.args) == 1 and not call.args[0].keyword else None
        if not isinstance(comp, (cst.ListComp, cst.GeneratorExp)):
            raise RewriteError(
                f"{where}: `self.experts = {one_line(value)}` should build its experts in one comprehension "
                "(`nn.ModuleList([X(config, ...) for i in range(...)])`)"
            )
        expert = comp.elt
        if isinstance(expert, cst.IfExp):
            if not m.matches(expert.orelse, m.Name("None")) or not _in_ep_branch(init, assign):
                raise RewriteError(
                    f"{where}: `{one_line(expert)}`: a conditional expert is accepted only as "
                    "`X(...) if ... else None` under `if ... ep_size > 1:`"
                )
            expert = expert.body
        if not m.matches(expert, m.Call(func=m.Name())):
            raise RewriteError(f"{where}: the expert `{one_line(expert)}` is not a call of an expert class")
        name = cst.ensure_type(cst.ensure_type(expert, cst.Call).func, cst.Name).value
        if name not in classes:
            raise RewriteError(f"{where}: the expert class {name} is not defined in this file")
        names.add(name)
    if len(names) != 1:
        raise RewriteError(f"{where}: the experts are built from different classes ({', '.join(sorted(names))})")
    return names.pop()


def chain_or_any(name: str, classes: dict[str, cst.ClassDef]) -> list[cst.ClassDef]:
    """The MoE class and the in-file bases it inherits from (its own base may be anything)."""
    chain = [classes[name]]
    while len(chain[-1].bases) == 1 and isinstance(chain[-1].bases[0].value, cst.Name):
        base = classes.get(cst.ensure_type(chain[-1].bases[0].value, cst.Name).value)
        if base is None or base in chain:
            break
        chain.append(base)
    return chain
