"""The codemod on source snippets: what changes, what stays byte for byte, idempotence, refusals."""

from __future__ import annotations

import ast
import difflib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from goldens import not_from_sections, section_hashes, what_changed

from moe_rewrite import RewriteError, RewriteOptions, rewrite_source
from moe_rewrite.codemods.moe.moe_forward import EVAL_NOTE

PAIRS = Path(__file__).parent / "pairs"
FIXTURES = Path(__file__).parent.parent / "fixtures"
INPUTS = sorted(PAIRS.glob("*.in.py"))


def _read(path: Path) -> str:
    return path.read_bytes().decode()


def _golden(path: Path, text: str) -> None:
    """`text` equals the file at `path`, byte for byte. `make update-pairs` writes a golden that differs, and the test
    skips instead of passing: what it compared with is what it just wrote."""
    if os.environ.get("MOE_REWRITE_UPDATE_PAIRS") and not (path.exists() and _read(path) == text):
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(text.encode())
        pytest.skip(f"updated {path.relative_to(PAIRS.parent.parent)}, review with git diff")
    assert text == _read(path), f"{path.name} differs (run `make update-pairs` after an intended change and review it)"


def _undefined_names(text: str) -> str:
    """ruff's F821 (undefined name) findings in a rewritten file: a name the generated code uses and nothing binds."""
    lint = [sys.executable, "-m", "ruff", "check", "--isolated", "--no-cache", "--select", "F821"]
    proc = subprocess.run(
        [*lint, "--output-format", "concise", "--stdin-filename", "modeling_deepseek.py", "-"],
        input=text,
        capture_output=True,
        text=True,
    )
    # ruff exits 1 for findings (listed on stdout); 1 with nothing listed is ruff itself missing or failing
    assert proc.returncode == 0 or (proc.returncode == 1 and proc.stdout), f"ruff did not run: {proc.stderr.strip()}"
    return proc.stdout if proc.returncode else ""


def test_the_undefined_name_check_finds_one():
    """The check above can fail: a name nothing binds is reported, one that is bound is not."""
    assert "F821" in _undefined_names("import torch\n\nx = torch.ones(1) + missing_name\n")
    assert _undefined_names("import torch\n\nx = torch.ones(1)\n") == ""


@pytest.mark.parametrize("source", INPUTS, ids=lambda p: p.name.removesuffix(".in.py"))
def test_fixture_pair(source: Path):
    """The snippet's diff: what the codemod changes, with the generated block and methods as placeholders."""
    result = rewrite_source(_read(source))
    assert result.changed
    ast.parse(result.text)
    _golden(
        source.with_name(source.name.replace(".in.py", ".diff")), what_changed(_read(source), result.text, source.name)
    )


# The stand-in fixtures (a whole modeling file each, with its PreTrainedModel subclass) under every option.
OPTION_CASES = {
    "defaults": (),
    "no-fuse-experts": ("--no-fuse-experts",),
    "fp8-experts": ("--fp8-experts",),
    "fp8-compute": ("--fp8-compute",),
    "expert-parallel": ("--expert-parallel",),
    "aux-loss": ("--aux-loss",),
    "bias-update": ("--bias-update", "0.001"),
    "no-gradient-checkpointing": ("--no-gradient-checkpointing",),
    "no-compat": ("--no-compat",),
    "no-sdpa": ("--no-sdpa",),
    "no-fused-loss": ("--no-fused-loss",),
    "no-fused-norm": ("--no-fused-norm",),
    "no-fused-rope": ("--no-fused-rope",),
    "backend-loop-sequential": ("--backend", "loop", "--stacking", "sequential"),
}
FIXTURE_CASES = [("deepseek_v3", name) for name in OPTION_CASES] + [
    ("deepseek_v2", "defaults"),
    ("deepseek_v2", "expert-parallel"),
    ("deepseek_v2", "no-fuse-experts"),
    ("deepseek_v2_esft", "no-fuse-experts"),
]


def _options(args: tuple[str, ...]) -> RewriteOptions:
    values: dict = {}
    flags = {
        "--no-fuse-experts": "fuse_experts",
        "--no-gradient-checkpointing": "gradient_checkpointing",
        "--no-compat": "compat",
        "--no-sdpa": "sdpa",
        "--no-fused-loss": "fused_loss",
        "--no-fused-norm": "fused_norm",
        "--no-fused-rope": "fused_rope",
    }
    rest = list(args)
    while rest:
        flag = rest.pop(0)
        if flag in flags:
            values[flags[flag]] = False
        elif flag == "--aux-loss":
            values["aux_loss"] = True
        elif flag == "--fp8-experts":
            values["fp8_experts"] = True
        elif flag == "--fp8-compute":
            values["fp8_compute"] = True
        elif flag == "--expert-parallel":
            values["expert_parallel"] = True
        elif flag == "--bias-update":
            values["bias_update"] = float(rest.pop(0))
        else:
            values[flag.removeprefix("--")] = rest.pop(0)
    return RewriteOptions(**values)


@pytest.mark.slow  # a whole stand-in file, rewritten, rewritten again and linted: ~10 s each
@pytest.mark.parametrize(("fixture", "case"), FIXTURE_CASES, ids=[f"{f}-{c}" for f, c in FIXTURE_CASES])
def test_fixture_under_options(fixture: str, case: str):
    """What each option changes in a whole file: its diff with the generated code as placeholders, the generated code
    made of the sections the placeholders name (their code: test_section_hashes), every name it uses defined."""
    source = FIXTURES / fixture / "modeling_deepseek.py"
    text = _read(source)
    options = _options(OPTION_CASES[case])
    result = rewrite_source(text, options)
    assert rewrite_source(result.text, options).text == result.text
    assert not_from_sections(result.text, result.options) == []
    assert _undefined_names(result.text) == ""
    _golden(
        PAIRS / "fixtures" / f"{fixture}-{case}.diff",
        what_changed(text, result.text, f"{fixture}/modeling_deepseek.py"),
    )


def test_no_two_sections_define_one_name():
    """The sections share one namespace in the rewritten file: a name two of them define would silently be the later
    one's (the placeholder classes MoE and Model are not copied)."""
    from moe_rewrite.render import PLACEHOLDERS, SECTIONS, section_file

    owners: dict[str, list[str]] = {}
    for section in SECTIONS:
        for stmt in ast.parse(section_file(section).read_text()).body:
            names = [stmt.name] if isinstance(stmt, (ast.FunctionDef, ast.ClassDef)) else []
            if isinstance(stmt, ast.Assign):
                names = [t.id for t in stmt.targets if isinstance(t, ast.Name)]
            for name in names:
                owners.setdefault(name, []).append(section)
    assert {n: s for n, s in owners.items() if len(s) > 1 and n not in PLACEHOLDERS} == {}


def test_section_hashes():
    """The code of each runtime section as the rewritten files hold it (one line each: a change to a section shows as
    its line changing; the diffs above show where each goes)."""
    _golden(PAIRS / "sections.sha256", section_hashes())


def test_a_section_importing_what_the_file_lacks_is_refused(tmp_path, monkeypatch):
    """A module-level import is not copied into the rewritten file: only `import torch` (which every file it rewrites
    has) and the other sections may be imported there (relative imports naming a section, in its package or another);
    anything else would be a NameError in the rewritten file."""
    import libcst as cst

    from moe_rewrite import render

    monkeypatch.setattr(render, "RUNTIME_DIR", tmp_path / "runtime")
    probes = {
        "probe_sibling": ("one", '"""A section."""\n\nimport torch\n\nMOE_REWRITE_ONE = torch.ones(1)\n'),
        "probe_uses": ("one", "from .probe_sibling import MOE_REWRITE_ONE\n\nMOE_REWRITE_TWO = 2\n"),
        "probe_across": ("two", "from ..one.probe_sibling import MOE_REWRITE_ONE\n\nMOE_REWRITE_THREE = 3\n"),
        "probe_math": ("two", "import math\n\nMOE_REWRITE_PI = math.pi\n"),
        "probe_not_there": ("two", "from .probe_sibling import MOE_REWRITE_ONE\n\nMOE_REWRITE_FOUR = 4\n"),
        "probe_outside": ("two", "from ...options import RewriteOptions\n\nMOE_REWRITE_FIVE = 5\n"),
    }
    for name, (package, text) in probes.items():
        monkeypatch.setitem(render.PACKAGE_OF, name, package)
        (tmp_path / "runtime" / package).mkdir(parents=True, exist_ok=True)
        (tmp_path / "runtime" / package / f"{name}.py").write_text(text)
    empty = cst.parse_module("")
    for name in ["probe_sibling", "probe_uses", "probe_across"]:
        assert len(render.render_section(name, empty).statements) == 1
    for name, code in [
        ("probe_math", "import math"),
        ("probe_not_there", "from .probe_sibling import MOE_REWRITE_ONE"),  # probe_sibling is in package one
        ("probe_outside", "from ...options import RewriteOptions"),
    ]:
        with pytest.raises(ValueError, match=rf"runtime/two/{name}\.py: `{re.escape(code)}` would not be in the rewr"):
            render.render_section(name, empty)


@pytest.mark.parametrize("source", INPUTS, ids=lambda p: p.name.removesuffix(".in.py"))
def test_second_run_changes_nothing(source: Path):
    once = rewrite_source(_read(source)).text
    again = rewrite_source(once)
    assert not again.changed
    assert again.text == once


@pytest.mark.parametrize("source", INPUTS, ids=lambda p: p.name.removesuffix(".in.py"))
def test_other_options_regenerate(source: Path):
    default = rewrite_source(_read(source)).text
    other = rewrite_source(default, RewriteOptions(backend="loop", stacking="sequential"))
    assert other.changed
    assert '"backend": "loop"' in other.text and '"stacking": "sequential"' in other.text
    assert '"backend": "auto"' not in other.text
    assert other.text.count("def moe_train(") == 1
    assert other.text.count("class _MoeRewriteGroupedLinear") == 1
    # and back: the same bytes as a first run with the defaults
    assert rewrite_source(other.text).text == default


def _removed_lines(old: str, new: str) -> list[str]:
    a, b = old.splitlines(keepends=True), new.splitlines(keepends=True)
    removed = []
    for tag, i1, i2, _, _ in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if tag in ("delete", "replace"):
            removed += a[i1:i2]
    return [line.strip() for line in removed]


EVAL_V3 = "y = self.moe_infer(hidden_states, topk_idx, topk_weight).view(*orig_shape)"


def test_v3_only_the_assert_is_removed_and_eval_goes_through_moe_rewrite_infer():
    text = _read(PAIRS / "v3_basic.in.py")
    result = rewrite_source(text)
    assert result.form == "v3" and result.moe_class == "DeepseekV3MoE" and result.gate_class == "MoEGate"
    assert _removed_lines(text, result.text) == ["assert not self.training", EVAL_V3]
    training = (
        "else:\n            y = self.moe_train(hidden_states, topk_idx, topk_weight, out_dtype=hidden_states.dtype)"
    )
    assert training in result.text  # moe_infer returns the tokens' dtype, and so does training


def test_v3_reformatted_keeps_comments_and_names():
    text = _read(PAIRS / "v3_reformatted.in.py")
    result = rewrite_source(text)
    assert result.gate_class == "Router"
    assert _removed_lines(text, result.text)[0] == "assert (not self.training)"
    assert len(_removed_lines(text, result.text)) == 2  # and the eval call, now through moe_rewrite_infer
    assert "# Inference only in the original release." in result.text
    assert "self.moe_train(x, ids, weights, out_dtype=x.dtype)" in result.text
    assert "# sorted experts" in result.text


@pytest.mark.parametrize(
    "call, expected",
    [
        (  # one line
            "self.moe_infer(hidden_states, topk_idx, topk_weight)",
            "self.moe_train(hidden_states, topk_idx, topk_weight, out_dtype=hidden_states.dtype)",
        ),
        (  # one argument a line, a trailing comma and a comment after it
            "self.moe_infer(\n                hidden_states,\n                topk_idx,\n"
            "                topk_weight,  # weights\n            )",
            "self.moe_train(\n                hidden_states,\n                topk_idx,\n                topk_weight,\n"
            "                out_dtype=hidden_states.dtype,  # weights\n            )",
        ),
        (  # aligned continuation lines, no trailing comma
            "self.moe_infer(hidden_states,\n                           topk_idx,\n                           topk_weight)",
            "self.moe_train(hidden_states,\n                           topk_idx,\n                           topk_weight,\n"
            "                           out_dtype=hidden_states.dtype)",
        ),
    ],
    ids=["one-line", "trailing-comma", "aligned"],
)
def test_v3_training_call_keeps_the_eval_calls_layout(call, expected):
    """The training branch's call is the eval branch's, renamed, with out_dtype as its last argument in the same
    layout (comments kept): it must compile and read as the file's own code."""
    text = _read(PAIRS / "v3_basic.in.py")
    eval_call = "self.moe_infer(hidden_states, topk_idx, topk_weight)"
    assert text.count(eval_call) == 1
    result = rewrite_source(text.replace(eval_call, call))
    ast.parse(result.text)
    assert f"else:\n            y = {expected}.view(*orig_shape)\n" in result.text


def test_v2_replaces_the_loop_and_keeps_cast_and_aux_loss():
    text = _read(PAIRS / "v2_basic.in.py")
    result = rewrite_source(text)
    assert result.form == "v2"
    removed = _removed_lines(text, result.text)
    assert removed[0] == "hidden_states = hidden_states.repeat_interleave("
    assert "for i, expert in enumerate(self.experts):" in removed
    assert all("AddAuxiliaryLoss" not in line and ".to(hidden_states.dtype)" not in line for line in removed)
    body = result.text[result.text.index("        if self.training:") :]
    assert body.startswith(
        "        if self.training:\n"
        "            # moe-rewrite: the experts as grouped GEMMs instead of a loop over experts\n"
        "            y = self.moe_train(hidden_states, topk_idx, topk_weight)\n"
        "            y = y.to(hidden_states.dtype).view(*orig_shape)\n"
        "            y = AddAuxiliaryLoss.apply(y, aux_loss)\n"
        "        else:\n"
    )


def test_v2_early_revision_keeps_its_missing_cast():
    result = rewrite_source(_read(PAIRS / "v2_early.in.py"))
    assert "self.moe_train(hidden_states, topk_idx, topk_weight)\n            y = y.view(*orig_shape)\n" in result.text
    # the comment described the replaced loop: it goes with it
    assert "# one copy of each token per selected expert" not in result.text
    assert "# tokens routed to expert i" not in result.text


@pytest.mark.parametrize("source", INPUTS, ids=lambda p: p.name.removesuffix(".in.py"))
def test_crlf_in_crlf_out(source: Path):
    text = _read(source).replace("\n", "\r\n")
    result = rewrite_source(text)
    assert "\n" not in result.text.replace("\r\n", "")
    assert result.text == rewrite_source(_read(source)).text.replace("\n", "\r\n")


def test_moe_infer_untouched_and_eval_calls_it_through_moe_rewrite_infer():
    """Eval calls moe_infer through moe_rewrite_infer (the same arguments and post-processing, marked), which runs
    moe_infer unless PEFT wrapped the experts so that moe_infer cannot index them."""
    text = _read(PAIRS / "v3_basic.in.py")
    new = rewrite_source(text).text
    start = text.index("    @torch.no_grad()\n    def moe_infer(self, x, topk_ids, topk_weight):\n")
    infer = text[start : text.index("        return combined.to(unsorted.dtype)\n", start)]
    assert infer in new
    assert f"        if not self.training:\n            {EVAL_V3}\n" in text
    through = EVAL_V3.replace("self.moe_infer(", "self.moe_rewrite_infer(")
    assert f"        if not self.training:\n            {through}  {EVAL_NOTE}\n" in new
    assert "            return self.moe_infer(x, topk_ids, topk_weight)\n" in new  # in moe_rewrite_infer
    assert rewrite_source(new).text == new


_STAND_IN = (PAIRS.parent.parent / "fixtures" / "deepseek_v3" / "modeling_deepseek.py").read_text()
_START = _STAND_IN.index("    @torch.no_grad()\n    def moe_infer(")
STAND_IN_MOE_INFER = _STAND_IN[_START : _STAND_IN.index("\n\n\nclass ", _START)] + "\n"  # a known moe_infer body
V3_MOE = """
class E(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.h, config.i, bias=False)
        self.up_proj = nn.Linear(config.h, config.i, bias=False)
        self.down_proj = nn.Linear(config.i, config.h, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class M:
    def __init__(self, config):
        self.experts = nn.ModuleList([E(config) for _ in range(config.n_routed_experts)])
        self.gate = G(config)

    def forward(self, h):
        ids, w = self.gate(h)
{branch}
        return y

    def moe_infer(self, x, ids, w):
        return x
"""


@pytest.mark.parametrize(
    "text, message",
    [
        ("import torch\nx = 1\n", "no class defines both forward() and moe_infer()"),
        ("def f(:\n", "syntax error at line 1"),
        (V3_MOE.format(branch="        y = self.moe_infer(h, ids, w)"), "expected one `if self.training:`"),
        (
            V3_MOE.format(
                branch="        if not self.training:\n            y = self.moe_infer(h, ids, w)\n        else:\n            y = h"
            ),
            "already has an else branch",
        ),
        (
            V3_MOE.format(
                branch="        if self.training:\n            y = h\n        else:\n            y = self.moe_infer(h, ids, w)"
            ),
            "unrecognised structure (self.gate returns 2 values",
        ),
        (
            V3_MOE.replace("ids, w = self.gate(h)", "ids, w, aux = self.gate(h)").format(
                branch="        if self.training:\n            y = h\n        else:\n            y = self.moe_infer(h, ids, w)"
            ),
            "no `for ... in enumerate(self.experts)` loop",
        ),
        (
            V3_MOE.format(branch="        if not self.training:\n            y = self.moe_infer(h, ids, w)").replace(
                "    def moe_infer(self, x, ids, w):\n        return x\n", STAND_IN_MOE_INFER
            ),
            "gate class G is not defined once",
        ),
        (
            V3_MOE.format(branch="        if not self.training:\n            y = self.moe_infer(h, ids, w)"),
            "M.moe_infer: `return x` is not in any published moe_infer moe-rewrite knows",
        ),
        (
            V3_MOE.format(branch="        if not self.training:\n            self.moe_infer(h, ids, w)"),
            "does not assign the result of self.moe_infer",
        ),
    ],
    ids=[
        "no-moe",
        "syntax",
        "no-branch",
        "foreign-else",
        "arity-mismatch",
        "v2-no-loop",
        "no-gate-class",
        "unknown-moe-infer",
        "no-assign",
    ],
)
def test_unrecognised_structure_is_refused(text, message):
    with pytest.raises(RewriteError) as info:
        rewrite_source(text)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_unknown_options_are_refused():
    with pytest.raises(RewriteError, match="unknown backend 'cutlass'"):
        RewriteOptions(backend="cutlass")
    with pytest.raises(RewriteError, match="unknown stacking"):
        RewriteOptions(stacking="lazy")


def test_every_generated_statement_is_recognised_as_generated():
    """A later run finds the block by its names: each module-level statement of every section must carry the prefix."""
    import libcst as cst

    from moe_rewrite.codemods.block import _is_generated
    from moe_rewrite.render import SECTIONS, render_section

    for name in SECTIONS:
        for stmt in render_section(name, cst.parse_module("")).statements:
            assert _is_generated(stmt), f"runtime/{name}.py: {cst.parse_module('').code_for_node(stmt)[:60]}"


V3_SOURCE = (FIXTURES / "deepseek_v3" / "modeling_deepseek.py").read_text()


@pytest.mark.parametrize(
    "old, new, message",
    [
        (
            "    def _init_weights(self, module):\n",
            "    def _init_weights(self, module): pass\n\n    def _published_init_weights(self, module):\n",
            "DeepseekV3PreTrainedModel._init_weights: its body is on the `def` line",
        ),
        (
            "class MoEGate(nn.Module):\n",
            "class Generating(nn.Module):\n"
            "    def prepare_inputs_for_generation(self, **kwargs): return kwargs.get('position_ids', None)\n\n\n"
            "class MoEGate(nn.Module):\n",
            "compat: Generating.prepare_inputs_for_generation: its body is on the `def` line",
        ),
    ],
    ids=["init_weights", "prepare_inputs_for_generation"],
)
def test_a_one_line_body_the_codemods_edit_is_refused_by_name(old, new, message):
    assert V3_SOURCE.count(old) == 1
    with pytest.raises(RewriteError) as info:
        rewrite_source(V3_SOURCE.replace(old, new))
    assert message in str(info.value)


def test_a_one_line_except_of_the_files_own_is_kept():
    """`except ImportError: x = None` is not moe-rewrite's guard (those have an indented body): kept as written."""
    own = "try:\n    import foo\nexcept ImportError: foo = None\n"
    text = V3_SOURCE.replace("import torch\n", "import torch\n" + own, 1)
    assert own in rewrite_source(text).text


def test_each_codemod_reads_only_what_an_earlier_one_provides():
    """rewrite.py checks CODEMODS on import; a codemod moved before the one that fills what it reads is a bug."""
    import types

    from moe_rewrite.errors import InternalError
    from moe_rewrite.rewrite import CODEMODS, RESULT_READS, check_order

    check_order(CODEMODS, RESULT_READS)
    names = [codemod.__name__.rsplit(".", 1)[-1] for codemod in CODEMODS]
    gate, moe_forward = CODEMODS[names.index("gate")], CODEMODS[names.index("moe_forward")]
    with pytest.raises(InternalError, match=r"\.gate reads moe, which no codemod before it provides"):
        check_order([gate, moe_forward], RESULT_READS)
    unprovided = ", ".join(sorted(set(RESULT_READS) - set(moe_forward.PROVIDES)))
    assert "notes" in unprovided and "compat" in unprovided
    with pytest.raises(InternalError, match=f"the result reads {unprovided}, which no codemod provides"):
        check_order([moe_forward], RESULT_READS)
    reads_nothing = types.SimpleNamespace(__name__="late", READS=("moe",), PROVIDES=())
    with pytest.raises(InternalError, match="late reads moe"):
        check_order([reads_nothing, moe_forward], ())
