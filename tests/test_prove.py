"""The prover of published code (moe_rewrite/codemods/kit/prove.py): what it accepts (names bound by the rule,
formatting, comments, parentheses, docstrings) and, one mutation each, every rule it refuses by."""

from __future__ import annotations

import ast

import libcst as cst
import pytest

from moe_rewrite.codemods.kit import code
from moe_rewrite.codemods.kit.prove import Differs, Proof, Template, closest, prove, prove_function, same

# A published region in capitals: S the scores, Q K V, M the mask, O the output; SCALE any expression.
CORE = Template(
    """\
    S = torch.matmul(Q, K.transpose(2, 3)) * SCALE
    if M is not None:
        S = S + M
    S = nn.functional.softmax(S, dim=-1, dtype=torch.float32).to(Q.dtype)
    O = torch.matmul(S, V)
    """,
    placeholders={"S", "Q", "K", "V", "M", "O", "self"},
    wildcards={"SCALE"},
)
FILE = """\
def forward(self, q, k, v, mask):
    scores = torch.matmul(q, k.transpose(2, 3)) * self.scale
    if mask is not None:
        scores = scores + mask
    scores = nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(scores, v)
    return out
"""


def _forward(text: str) -> cst.FunctionDef:
    return cst.ensure_type(cst.parse_module(text).body[0], cst.FunctionDef)


def _prove(text: str, template: Template = CORE) -> Proof | Differs:
    """The template against the function's statements from the scores' on, but its last (the return)."""
    forward = _forward(text)
    statements = list(cst.ensure_type(forward.body, cst.IndentedBlock).body)
    start = next(i for i, s in enumerate(statements) if "torch.matmul" in code(s))
    return prove(template, statements[start:-1], within=forward)


def _edited(old: str, new: str) -> str:
    assert FILE.count(old) == 1, old
    return FILE.replace(old, new)


def test_the_published_region_binds_each_placeholder_and_wildcard():
    proof = _prove(FILE)
    assert isinstance(proof, Proof)
    assert proof.names == {"S": "scores", "Q": "q", "K": "k", "M": "mask", "V": "v", "O": "out"}
    assert ast.unparse(proof.expressions["SCALE"]) == "self.scale"


ACCEPTED = {
    "other names": [("scores", "w"), ("mask", "bias"), ("out", "o")],
    "formatting, comments, parentheses": [
        (
            "    scores = torch.matmul(q, k.transpose(2, 3)) * self.scale\n",
            "    # the scores\n    scores = (\n        torch.matmul(q, (k.transpose(2, 3)))  # scores\n"
            "        * (self.scale)\n    )\n",
        ),
        ("dim=-1, dtype=torch.float32", "dim=-1,\n        dtype=torch.float32,  # fp32\n    "),
    ],
}


@pytest.mark.parametrize("case", ACCEPTED, ids=list(ACCEPTED))
def test_names_formatting_comments_and_parentheses_do_not_matter(case):
    text = FILE
    for old, new in ACCEPTED[case]:
        assert old in text
        text = text.replace(old, new)
    assert text != FILE
    assert isinstance(_prove(text), Proof)


REFUSED = {
    # (old, new, the statement named, why)
    "two placeholders bound to one name": ("torch.matmul(scores, v)", "torch.matmul(scores, q)", "out = ", "two"),
    "a placeholder bound inconsistently": ("scores = scores + mask", "scores = w + mask", "if mask", "one published"),
    "a placeholder bound to a literal": ("out = torch.matmul", "torch = torch.matmul", "torch = ", "reads `torch`"),
    "a placeholder given an expression": ("(q, k.transpose", "(q[0], k.transpose", "scores = torch", ""),
    "another global": ("out = torch.matmul", "out = th.matmul", "out = th.", ""),
    "another function of the global": ("nn.functional.softmax", "nn.functional.log_softmax", "scores = nn.", ""),
    "another attribute": ("to(q.dtype)", "to(q.device)", "scores = nn.", ""),
    "another constant": ("transpose(2, 3)", "transpose(1, 3)", "scores = torch", ""),
    "a constant of another type": ("transpose(2, 3)", "transpose(2.0, 3)", "scores = torch", ""),
    "True for 1": ("transpose(2, 3)", "transpose(2, True)", "scores = torch", ""),
    "another operator": ("scores = scores + mask", "scores = scores - mask", "if mask", ""),
    "keyword arguments in another order": (
        "dim=-1, dtype=torch.float32",
        "dtype=torch.float32, dim=-1",
        "scores = nn.",
        "",
    ),
    "the wildcard bound inconsistently": ("", "", "", "in the places of one published expression"),
    "a statement inserted": ("    out = torch", "    scores = scores * 2\n    out = torch", "scores = scores * 2", ""),
    "a statement removed": ("    if mask is not None:\n        scores = scores + mask\n", "", "scores = nn.", ""),
    "two statements on one line": ("(q.dtype)\n", "(q.dtype); scores = scores * 2\n", "scores = nn.", "on one line"),
    "a literal bound in the function": ("mask):\n", "mask):\n    nn = other\n", "scores = nn.", "`nn` is bound in"),
    "a literal as a parameter": ("mask):\n", "mask, torch):\n", "", "`torch` is bound in the function"),
    "a literal imported": ("mask):\n", "mask):\n    import numpy as torch\n", "", "`torch` is bound in"),
}


@pytest.mark.parametrize("case", REFUSED, ids=list(REFUSED))
def test_each_rule_refuses_and_the_first_statement_that_differs_is_named(case):
    old, new, named, why = REFUSED[case]
    if case == "the wildcard bound inconsistently":
        template = Template("S = Q * SCALE\nO = S + SCALE", {"S", "Q", "O"}, {"SCALE"})
        statements = [cst.parse_statement("w = x * self.scale\n"), cst.parse_statement("o = w + self.scale2\n")]
        found = prove(template, statements)
        assert isinstance(found, Differs) and found.at == 1 and why in found.why, found
        assert isinstance(prove(template, [statements[0], cst.parse_statement("o = w + (self.scale)\n")]), Proof)
        return
    found = _prove(_edited(old, new))
    assert isinstance(found, Differs), found
    assert named in (found.found or ""), found
    assert why in found.why, found
    line = found.describe("core")
    assert line.startswith(f"`{found.found}` where the published core has `") and "\n" not in line


def test_the_lines_name_where_the_statements_end_and_where_the_template_ends():
    forward = _forward(FILE)
    statements = list(cst.ensure_type(forward.body, cst.IndentedBlock).body)
    short = prove(CORE, statements[:2])
    assert isinstance(short, Differs) and short.at == 2 and short.found is None
    assert short.describe("core", "the end of forward") == (
        "the end of forward where the published core has "
        "`S = nn.functional.softmax(S, dim=-1, dtype=torch.float32).to(Q.dtype)`"
    )
    longer = prove(CORE, statements)
    assert (
        isinstance(longer, Differs)
        and longer.describe("core") == "`return out` where the published core has nothing more"
    )
    compound = prove(CORE, [statements[0], statements[2]])
    assert isinstance(compound, Differs)
    assert compound.describe() == (
        "`scores = nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)` where the published code "
        "has `if M is not None: ...`"
    )


def test_bound_names_carry_over_and_are_held_to_the_rule():
    forward = _forward(FILE)
    statements = list(cst.ensure_type(forward.body, cst.IndentedBlock).body)
    tail = Template("O = torch.matmul(S, V)", {"O", "S", "V"})
    assert isinstance(prove(tail, statements[3:4], {"S": "scores"}), Proof)
    other = prove(tail, statements[3:4], {"S": "w"})
    assert isinstance(other, Differs) and "`w` and `scores` in the places of one published name" in other.why
    literal = prove(tail, statements[3:4], {"V": "torch"})
    assert isinstance(literal, Differs) and "reads `torch` itself" in literal.why
    with pytest.raises(ValueError, match="the template uses literally"):
        prove(tail, statements[3:4], {"torch": "torch"})
    score = Template(CORE.lines[0], {"S", "Q", "K"}, {"SCALE"})
    first = prove(score, statements[:1])  # a proof carried into the next template: its names and expressions
    assert isinstance(first, Proof)
    scaled = Template("O = torch.matmul(S, V) * SCALE", {"O", "S", "V"}, {"SCALE"})
    again = prove(scaled, [cst.parse_statement("out = torch.matmul(scores, v) * (self.scale)\n")], first)
    assert isinstance(again, Proof) and again.names["O"] == "out" and again.names["Q"] == "q"
    for line, why in [
        ("out = torch.matmul(scores, v) * self.other\n", "in the places of one published expression"),
        ("q = torch.matmul(scores, v) * self.scale\n", "`q` in the places of two published names"),
    ]:
        found = prove(scaled, [cst.parse_statement(line)], first)
        assert isinstance(found, Differs) and why in found.why, found
    with pytest.raises(ValueError, match="both a placeholder and a wildcard"):
        Template("x = y", {"x"}, {"x"})


# A function proven whole: its locals renamed, its globals and attributes literal
NORM = Template(
    """\
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    return self.weight * hidden_states.to(input_dtype)
    """,
    params=("self", "hidden_states"),
)
NORM_FILE = '''\
def forward(self, x):
    """Normalise."""
    dtype = x.dtype  # kept
    x = x.to(torch.float32)
    return self.weight * x.to(dtype)
'''


def test_a_function_is_proven_up_to_the_names_of_its_locals():
    assert NORM.placeholders == {"self", "hidden_states", "input_dtype"} and NORM.literals == {"torch"}
    proof = prove_function(NORM, _forward(NORM_FILE))
    assert isinstance(proof, Proof) and proof.names == {"self": "self", "hidden_states": "x", "input_dtype": "dtype"}
    tree = ast.parse(NORM_FILE).body[0]
    assert isinstance(tree, ast.FunctionDef) and prove_function(NORM, tree) == proof  # the same on an ast function
    documented = Template('"""The published docstring."""\n' + "\n".join(NORM.lines), params=NORM.params)
    assert documented.lines == NORM.lines  # docstrings are skipped: the template's, the file's (another one)
    assert prove_function(documented, _forward(NORM_FILE)) == proof
    assert prove_function(documented, _forward(NORM_FILE.replace('    """Normalise."""\n', ""))) == proof


@pytest.mark.parametrize(
    "old, new, why",
    [
        ("self.weight", "self.bias", ""),  # an attribute of self
        ("torch.float32", "torch.float16", ""),  # an attribute of a global
        ("    x = x.to(torch.float32)\n", "    torch = x\n    x = x.to(torch.float32)\n", ""),  # a statement more
        ("dtype = x.dtype", "torch = x.dtype", "reads `torch` itself"),  # a local named as a global
        ("dtype = x.dtype", "x = x.dtype", "two published names"),  # the input in the place of the dtype
        ("def forward(self, x):", "def forward(self, x, y):", ""),  # a parameter more
    ],
    ids=["attribute", "global-attribute", "statement", "local-as-global", "two-names", "parameter"],
)
def test_a_function_that_differs_is_refused(old, new, why):
    assert NORM_FILE.count(old) == 1
    found = prove_function(NORM, _forward(NORM_FILE.replace(old, new)))
    assert isinstance(found, Differs) and why in found.why, found


def test_the_differences_that_got_furthest_are_named():
    first, second = Differs(1, "a", "b"), Differs(2, "c", "d")
    assert closest([first, second]) is second and closest([second, Differs(2, "e", "f")]) is second


def test_same_compares_a_node_with_sources_up_to_formatting():
    assert same(cst.parse_expression("(a +\n b)"), "a + b", "a - b")
    assert same(cst.parse_statement("x = f(a, b=1)  # c\n"), "x = f(a, b=1)")
    assert not same(cst.parse_statement("x = f(b=1, a=2)\n"), "x = f(a=2, b=1)")  # the keywords' order is proven
    assert not same(cst.parse_expression("a.b"), "a.c") and same(ast.parse("x = 1").body[0], "x = (1)")
    assert not same(cst.parse_statement("x = 1; y = 2\n"), "x = 1")  # a line's every statement
