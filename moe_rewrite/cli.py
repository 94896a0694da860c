"""The `moe-rewrite` command: parse options, call the library, map errors to exit codes.

Exit codes: 0 done (or nothing to change), 1 `--in-place` changed a file or `--check`/`--diff` found one to change
(the pre-commit convention), 2 bad input: one line on stderr, nothing written for it (with several files, the others
are still handled, and the run exits 2), 3 a bug in moe-rewrite: one line asking for a report (with -v, the traceback
before it), nothing written for that file, and the run stops there.

Output, as black's: a line per file rewritten (or that would be) on stderr, then one summary line ("2 files rewritten,
1 file left unchanged, 1 file failed"; a single SOURCE that fails gets its error line alone); `-q` prints errors only,
`-v` also names the files left unchanged and the generated code's sections. Diffs go to stdout. On a terminal a
"Rewriting PATH ..." line shows while libcst works and is erased before the next line. Paths in messages escape control
characters (sources.shown), so every message is one line. `moe-rewrite env` (the first word only) is a subcommand.
"""

from __future__ import annotations

import difflib
import os
import shutil
import sys
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import click

from moe_rewrite import __version__, publish, sources
from moe_rewrite.errors import InternalError, NotMoeFileError, RewriteError
from moe_rewrite.options import BACKENDS, STACKINGS, RewriteOptions

if TYPE_CHECKING:
    from moe_rewrite.rewrite import RewriteResult

NOT_MOE = "not a DeepSeek-family MoE file"
# Linked files that are a model's weights: without one, --out says the output has none.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack")


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


class Reporter:
    """Messages on stderr at the user's verbosity (-q: errors only, -v: every file), and the files' outcomes for the
    summary line."""

    def __init__(self, verbosity: int = 0, checkpointing_asked: bool = False):
        self.verbosity = verbosity
        self.checkpointing_asked = checkpointing_asked  # --gradient-checkpointing given on the command line
        self.counts = {"rewritten": 0, "unchanged": 0, "skipped": 0, "failed": 0}

    def info(self, message: str) -> None:
        if self.verbosity >= 0:
            click.echo(message, err=True)

    def detail(self, message: str) -> None:
        if self.verbosity > 0:
            click.echo(message, err=True)

    @contextmanager
    def progress(self, name: str):
        """On a terminal, "Rewriting NAME ..." while libcst works (10-20 s for a real file), erased before anything
        else is printed: what the run prints, and the one error line, stay as they are."""
        shown = self.verbosity >= 0 and sys.stderr.isatty()
        if shown:
            width = shutil.get_terminal_size().columns - 1  # one screen line, so that \r erases all of it
            click.echo(f"Rewriting {name} ..."[:width], err=True, nl=False)
        try:
            yield
        finally:
            if shown:
                click.echo("\r\033[K", err=True, nl=False)

    def sections(self, result: RewriteResult) -> None:
        """-v: the runtime sections the generated code holds, in reading order."""
        from moe_rewrite.render import ordered

        names = ", ".join(ordered(set(result.sections)))
        self.detail(f"  generated code: {names} (moe_rewrite/runtime/__init__.py SECTION_LIST)")

    def attention(self, result: RewriteResult) -> None:
        """Under a file's line: each option chosen for the file, each attention, loss, norm or RoPE left as published
        and why; with -v also the classes and functions that run SDPA, the fused loss, the fused norm and the fused
        RoPE."""
        for line in result.chosen:  # an option the file needs, chosen for it: always said
            self.info(f"  {line}")
        for note in result.notes:
            if note.rewritten:
                self.detail(f"  {note}")
            else:
                self.info(f"  {note}")

    def summary(self, would: bool) -> None:
        """One line: how many files were (or would be) rewritten, left unchanged, skipped and failed."""
        verbs = {
            "rewritten": "would be rewritten" if would else "rewritten",
            "unchanged": "would be left unchanged" if would else "left unchanged",
            "skipped": "skipped",
            "failed": "failed",
        }
        parts = [f"{plural(n, 'file')} {verbs[what]}" for what, n in self.counts.items() if n]
        if parts:
            self.info(", ".join(parts))


def unified_diff(path: Path, old: str, new: str) -> str:
    return "".join(
        difflib.unified_diff(
            old.splitlines(keepends=True),
            new.splitlines(keepends=True),
            f"a/{path.as_posix().lstrip('/')}",
            f"b/{path.as_posix().lstrip('/')}",
        )
    )


def _check_modes(
    specs: tuple[str, ...], out: Path | None, in_place: bool, check: bool, diff: bool, push_to_hub: str | None = None
) -> None:
    publishes = out is not None or push_to_hub is not None
    if out is not None and in_place:
        raise RewriteError("--out and --in-place exclude each other")
    if push_to_hub is not None and in_place:
        raise RewriteError("--push-to-hub and --in-place exclude each other")
    if (check or diff) and (publishes or in_place):
        raise RewriteError("--check and --diff write nothing; drop --out/--in-place/--push-to-hub")
    if not (publishes or in_place or check or diff):
        raise RewriteError("say where the result goes: --out DIR, --push-to-hub REPO_ID, --in-place, --check or --diff")
    if publishes and len(specs) > 1:
        raise RewriteError("--out and --push-to-hub take one SOURCE; rewrite several files with --in-place")


def _check_publishing(out: Path | None, push_to_hub: str | None, include_weights: bool, **push_options) -> None:
    """--include-weights goes with --out; --create-pr, --private, --commit-message and --push-revision with
    --push-to-hub."""
    given = [f"--{name.replace('_', '-')}" for name, value in push_options.items() if value]
    if given and push_to_hub is None:
        raise RewriteError(f"{', '.join(given)}: only with --push-to-hub REPO_ID")
    if push_to_hub is not None and not sources.REPO_ID.match(push_to_hub):
        raise RewriteError(f"--push-to-hub {sources.shown(push_to_hub)}: not a Hub repo id (org/name)")
    if push_options.get("create_pr") and push_options.get("private"):
        raise RewriteError("--private applies when --push-to-hub creates the repo; --create-pr needs an existing one")
    if include_weights and out is None:
        raise RewriteError("--include-weights needs --out DIR (weights are never pushed)")


def _publish(
    src: sources.Source,
    result: RewriteResult,
    options: RewriteOptions,
    out: Path | None,
    push: publish.Push | None,
    force: bool,
    report: Reporter,
) -> None:
    """--out and/or --push-to-hub for the one SOURCE: everything is planned (and checked) first, then pushed, then
    written, so that a failed push leaves nothing written."""
    checkpoint = publish.plan_checkpoint(src, result.text)
    if out is not None:
        publish.check_out_files(out, checkpoint, force)
    uploaded = checkpoint.code_and_config()
    url = publish.push_to_hub(push, uploaded) if push is not None else None
    written, linked = publish.write_checkpoint(out, checkpoint) if out is not None else ([], [])
    target = f" -> {sources.shown(written[0])}" if written else ""
    report.info(f"Rewrote {src.name}{target} ({_describe(result)})")
    report.attention(result)
    report.sections(result)
    if out is not None:
        report.info(f"  {sources.shown(out)}: {_contents(src, len(written) - 1, linked)}")
    if publish.changed_config(src, checkpoint) is not None:
        report.info("  config.json: auto_map now takes the code from the patched files beside it")
    if push is not None:
        done = "opened a pull request on" if push.create_pr else "pushed to"
        report.info(f"  {done} {push.repo_id} ({', '.join(uploaded)}): {url}")


def _contents(src: sources.Source, copied: int, linked: list[Path]) -> str:
    """What --out holds besides the patched file, and whether it has weights."""
    parts = [f"{plural(copied, 'code/config file')} copied"] if copied else []
    if linked:
        parts.append(f"{plural(len(linked), 'file')} linked")
    if not any(path.name.endswith(WEIGHT_SUFFIXES) for path in linked):
        if src.root is None:
            parts.append(f"{sources.shown(src.spec)} is a single file: the output holds the patched file only")
        elif src.kind == "hub" and not src.weights:
            parts.append("no weights: the output holds code and config only (--include-weights links the weights)")
        else:
            parts.append(f"no weights in {sources.shown(src.spec)}: the output holds code and config only")
    return ", ".join(parts)


def _describe(result: RewriteResult) -> str:
    """The form, its classes, the options the file was rewritten with (those chosen for it too) and compat's edits."""
    gate = f" + {result.gate_class}" if result.form == "v3" else ""
    changed = f"; {result.compat}" if result.compat else ""
    return f"{result.form.upper()} form, {result.moe_class}{gate}; {result.options.describe()}{changed}"


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("specs", metavar="SOURCE...", nargs=-1, required=True)
@click.option("--out", type=click.Path(), help="Write the patched checkpoint (code, config, links) here.")
@click.option("--in-place", is_flag=True, help="Rewrite the file where it is; exit 1 when it changed.")
@click.option("--check", is_flag=True, help="Write nothing; exit 1 when something would change.")
@click.option("--diff", is_flag=True, help="Print a unified diff; write nothing; exit 1 when something would change.")
@click.option("--revision", help="Hub revision (branch, tag or commit) of a Hub SOURCE.")
@click.option("--token", help="Hub token for private or gated repos, and for pushes (default: the saved login).")
@click.option(
    "--include-weights",
    is_flag=True,
    help="Hub SOURCE: download every file into the Hub cache and link weights and tokenizer into --out.",
)
@click.option("--push-to-hub", metavar="REPO_ID", help="Upload the patched code and config files to this Hub repo.")
@click.option("--create-pr", is_flag=True, help="With --push-to-hub: open a pull request instead of committing.")
@click.option("--commit-message", help="With --push-to-hub: the commit message (default: version and options).")
@click.option("--private", is_flag=True, help="With --push-to-hub: create the repo private when it does not exist.")
@click.option(
    "--push-revision",
    metavar="BRANCH",
    help="With --push-to-hub: the branch to commit to, or the pull request's base (default: main).",
)
@click.option(
    "--backend",
    type=click.Choice(BACKENDS),
    default="auto",
    show_default=True,
    help="Grouped-GEMM backend written into the file (MOE_REWRITE_BACKEND, read once per process, overrides it).",
)
@click.option(
    "--stacking",
    type=click.Choice(STACKINGS),
    default="stack",
    show_default=True,
    help="'stack' keeps stacked expert weights for backward (fastest, single process); 'sequential' stacks "
    "each right before its GEMM: lower peak memory.",
)
@click.option(
    "--aux-loss",
    is_flag=True,
    help="V3 form: train the router with the complementary sequence-wise balance loss (aux_loss_alpha).",
)
@click.option(
    "--bias-update",
    type=float,
    metavar="RATE",
    help="V3 form: aux-loss-free balancing; the bias moves by RATE per optimizer step (see README).",
)
@click.option(
    "--gradient-checkpointing/--no-gradient-checkpointing",
    default=True,
    show_default=True,
    help="V3 form: make gradient_checkpointing_enable() checkpoint each decoder layer.",
)
@click.option(
    "--compat/--no-compat",
    default=True,
    show_default=True,
    help="Guard the file's uses of transformers APIs that later releases removed, so it runs on 4.46 to 5.x.",
)
@click.option(
    "--sdpa/--no-sdpa",
    default=True,
    show_default=True,
    help="Run the attention core through torch's scaled_dot_product_attention where the config asks for 'sdpa' "
    "(the default load), with no 4-D mask where it would only be causal; --no-sdpa keeps the published attention "
    "and mask.",
)
@click.option(
    "--fused-loss/--no-fused-loss",
    default=True,
    show_default=True,
    help="In training with labels, compute the causal-LM loss in chunks without float32 logits over the vocabulary "
    "(no outputs.logits there: reading them raises an error naming the opt-outs); --no-fused-loss keeps the "
    "published loss.",
)
@click.option(
    "--fused-norm/--no-fused-norm",
    default=True,
    show_default=True,
    help="Run RMSNorm through one fused Triton kernel each way on CUDA (the published norm elsewhere); "
    "--no-fused-norm keeps the published norm everywhere.",
)
@click.option(
    "--fused-rope/--no-fused-rope",
    default=True,
    show_default=True,
    help="Run apply_rotary_pos_emb through one fused Triton kernel each way on CUDA (the published RoPE elsewhere); "
    "--no-fused-rope keeps the published RoPE everywhere.",
)
@click.option(
    "--fuse-experts/--no-fuse-experts",
    default=None,
    help="Models load with each layer's routed experts fused into two parameters: fastest training, most of "
    "all under FSDP; save_pretrained keeps the checkpoint's per-expert keys; PEFT's LoRA adapts them (target_modules "
    "or target_parameters). --no-fuse-experts keeps the experts' nn.Linear modules, as published, for code that "
    "needs them as modules (LoRA does not). [default: fused, unless the file needs per-expert layers (the ESFT form "
    "trains selected experts): then --no-fuse-experts is chosen and said; an explicit --fuse-experts refuses such a "
    "file]",
)
@click.option(
    "--fp8-experts/--no-fp8-experts",
    default=None,
    help="Generate the code that loads and trains FP8 block-quantized experts (DeepSeek-V3, R1, Kimi-K2 as shipped: "
    "codes kept FP8, LoRA on them). [default: where the checkpoint's config.json asks for FP8, or where an earlier "
    "rewrite of the file has them; said in the summary]",
)
@click.option(
    "--fp8-compute/--no-fp8-compute",
    default=None,
    help="Run FP8 experts' frozen base forward GEMMs on FP8 tensor cores (W8A8: activations quantized per 1 x 128 "
    "tile, as DeepSeek-V3 trains; faster than W8A16 on sm89+ GPUs, within a few percent of its numbers; "
    "docs/training.md). "
    "Implies --fp8-experts; MOE_REWRITE_FP8_COMPUTE=0/1 overrides it at run time. [default: where an earlier rewrite "
    "of the file has it, else bf16 compute (W8A16)]",
)
@click.option(
    "--expert-parallel/--no-expert-parallel",
    default=None,
    help="Generate expert parallelism (ep_size > 1: each rank holds some of every layer's experts, rows exchanged "
    "all-to-all; model.moe_rewrite_fully_shard, moe_rewrite_expert_parallel, moe_rewrite_all_reduce_gradients), for "
    "training on several GPUs; needs fused experts. [default: where an earlier rewrite of the file has it; said in "
    "the summary]",
)
@click.option("--force", is_flag=True, help="With --out: replace files there that moe-rewrite did not write.")
@click.option(
    "--skip-unrecognised",
    is_flag=True,
    help="Report and skip a file that is not a DeepSeek-family MoE file at all (pre-commit hooks).",
)
@click.option("-q", "--quiet", is_flag=True, help="Print errors only.")
@click.option(
    "-v", "--verbose", is_flag=True, help="Also name the files left unchanged and the runtime sections each file gets."
)
@click.version_option(__version__, prog_name="moe-rewrite")
def command(
    specs,
    out,
    in_place,
    check,
    diff,
    revision,
    token,
    backend,
    stacking,
    aux_loss,
    bias_update,
    gradient_checkpointing,
    compat,
    sdpa,
    fused_loss,
    fused_norm,
    fused_rope,
    fuse_experts,
    fp8_experts,
    fp8_compute,
    expert_parallel,
    force,
    skip_unrecognised,
    include_weights,
    push_to_hub,
    create_pr,
    commit_message,
    private,
    push_revision,
    quiet,
    verbose,
) -> int:
    """Make DeepSeek-family MoE remote code trainable with grouped-GEMM experts.

    SOURCE is a Hub repo id (org/name), a checkpoint directory holding modeling_deepseek.py, or a .py file.
    `moe-rewrite env` prints the installed versions and the kernel the generated code picks on this machine.
    """
    if out == "":  # an unset $OUTDIR: Path("") is the current directory
        raise RewriteError("--out: empty path (an unset variable?); name the output directory")
    out = None if out is None else Path(out)
    _check_modes(specs, out, in_place, check, diff, push_to_hub)
    if quiet and verbose:
        raise RewriteError("-q/--quiet and -v/--verbose exclude each other")
    asked = click.get_current_context().get_parameter_source("gradient_checkpointing")
    report = Reporter(-1 if quiet else 1 if verbose else 0, asked == click.core.ParameterSource.COMMANDLINE)
    if force and out is None:
        raise RewriteError("--force applies to --out DIR")
    if token is not None and (not token.isprintable() or any(c.isspace() for c in token)):
        raise RewriteError("--token: contains a space, line break or control character; pass the token alone")
    _check_publishing(
        out,
        push_to_hub,
        include_weights,
        create_pr=create_pr,
        private=private,
        commit_message=commit_message,
        push_revision=push_revision,
    )
    options = RewriteOptions(
        backend=backend,
        stacking=stacking,
        aux_loss=aux_loss,
        bias_update=bias_update,
        gradient_checkpointing=gradient_checkpointing,
        fuse_experts=fuse_experts,
        compat=compat,
        sdpa=sdpa,
        fused_loss=fused_loss,
        fused_norm=fused_norm,
        fused_rope=fused_rope,
        fp8_experts=fp8_experts,
        fp8_compute=fp8_compute,
        expert_parallel=expert_parallel,
    )
    if in_place and (hub := next((s for s in specs if sources.hub_repo(s) is not None), None)):
        raise RewriteError(f"{sources.shown(hub)}: a Hub repo cannot be rewritten in place; use --out DIR")
    if out is not None or push_to_hub is not None:  # one SOURCE (_check_modes)
        src = sources.resolve(specs[0], revision, token, include_weights)
        result = _rewrite(src, options, skip_unrecognised, report)
        if result is None:
            return 0
        if out is not None:
            publish.check_out_dir(out, src)
        push = (
            None
            if push_to_hub is None
            else publish.Push(
                push_to_hub,
                commit_message or publish.default_commit_message(result.options.describe()),
                create_pr=create_pr,
                private=private,
                revision=push_revision,
                token=token,
            )
        )
        _publish(src, result, options, out, push, force, report)
        return 0
    # Each file is checked and written on its own (atomically), so one bad file does not stop the others.
    for spec in specs:
        try:
            outcome = _rewrite_file(spec, options, revision, token, skip_unrecognised, in_place, check, diff, report)
        except (RewriteError, OSError) as e:
            if len(specs) == 1:
                raise  # one line, no summary
            message = (
                str(e) if isinstance(e, RewriteError) else f"{sources.shown(e.filename or spec)}: {e.strerror or e}"
            )
            _error(message, [token] if token else [])
            outcome = "failed"
        report.counts[outcome] += 1
    report.summary(would=not in_place)
    counts = report.counts
    return 2 if counts["failed"] else 1 if counts["rewritten"] else 0


def _rewrite(
    src: sources.Source, options: RewriteOptions, skip_unrecognised: bool, report: Reporter
) -> RewriteResult | None:
    """The rewrite of one source; None for a file that is not a MoE file at all, with --skip-unrecognised."""
    from moe_rewrite.rewrite import rewrite_source  # libcst: a second to import, which `env` and --help skip

    text = src.read()  # its errors name the file already
    if src.via is not None:
        report.info(
            f"{sources.shown(src.via)} (config.json's auto_map) imports the MoE classes from "
            f"{sources.shown(src.modeling_file.name)}: that file is the one rewritten"
        )
    try:
        with report.progress(src.name):
            result = rewrite_source(text, options, sources.read_config(src.root))
        if report.checkpointing_asked and options.gradient_checkpointing and "checkpoint_layer" not in result.sections:
            report.info(
                f"note: --gradient-checkpointing changes nothing in {src.name}: its decoder loop checkpoints "
                "already (V2 form), or it has none"
            )
        return result
    except RewriteError as e:
        if skip_unrecognised and isinstance(e, NotMoeFileError):
            report.info(f"{src.name}: skipped ({NOT_MOE})")
            return None
        raise RewriteError(f"{src.name}: {e}") from None
    except InternalError as e:
        cause = e.__cause__ or e
        if report.verbosity > 0:  # what a bug report needs
            click.echo(
                "".join(traceback.format_exception(type(cause), cause, cause.__traceback__)).rstrip("\n"), err=True
            )
        raise InternalError(e.reason, src.name) from cause


def _rewrite_file(
    spec: str,
    options: RewriteOptions,
    revision,
    token,
    skip_unrecognised: bool,
    in_place: bool,
    check: bool,
    diff: bool,
    report: Reporter,
) -> str:
    """--in-place, --check or --diff for one SOURCE: "rewritten" when it changed (or would), "unchanged" or
    "skipped"."""
    src = sources.resolve(spec, revision, token)
    if in_place and src.kind == "dir" and not src.modeling_file.resolve().is_relative_to(src.root.resolve()):
        raise RewriteError(
            f"{src.name}: a link to {sources.shown(src.modeling_file.resolve())}, outside the checkpoint; --in-place "
            "rewrites files inside it only (rewrite that file itself, or use --out DIR)"
        )
    result = _rewrite(src, options, skip_unrecognised, report)
    if result is None:
        return "skipped"
    if not result.changed:
        report.detail(f"{src.name}: already rewritten")
        return "unchanged"
    path = src.modeling_file
    if diff:
        click.echo(unified_diff(Path(src.name), src.read(), result.text), nl=False)
        # and the auto_map edit --out would make, if any
        planned = publish.changed_config(src, publish.plan_checkpoint(src, result.text))
        if planned is not None:
            before = sources.read_text(src.root / "config.json")  # a one-line error if not UTF-8
            click.echo(unified_diff(Path(src.name).parent / "config.json", before, planned.decode()), nl=False)
    if check:
        report.info(f"would rewrite {src.name} ({_describe(result)})")
        report.attention(result)
    report.sections(result)
    if in_place:
        # A vendored file may be a symlink: rewrite the file it points to and keep the link.
        target = path.resolve()
        if not os.access(target, os.W_OK) or not os.access(target.parent, os.W_OK | os.X_OK):
            raise RewriteError(f"{src.name}: cannot be rewritten in place (not writable)")
        publish.write_atomic(target, result.text.encode("utf-8"), mode_from=path)
        report.info(f"Rewriting {src.name} ({_describe(result)})")
        report.attention(result)
    return "rewritten"


def _secrets(argv: list[str]) -> list[str]:
    """Tokens given on the command line, which no message may show."""
    found = []
    for i, arg in enumerate(argv):
        if arg == "--token" and i + 1 < len(argv):
            found.append(argv[i + 1])
        elif arg.startswith("--token="):
            found.append(arg[len("--token=") :])
    return found


def _error(message: str, tokens: list[str]) -> int:
    """Print the one error line, with `tokens` and those in the environment masked; returns exit code 2."""
    click.echo(f"moe-rewrite: error: {_one_line(message, tokens)}", err=True)
    return 2


def _internal_error(error: InternalError, tokens: list[str]) -> int:
    """Print the one line saying moe-rewrite failed, not the file; returns exit code 3."""
    where = f" while rewriting {error.file}" if error.file else ""
    line = f"internal error ({error.reason}){where}; this is a bug in moe-rewrite, please report it"
    click.echo(f"moe-rewrite {__version__}: {_one_line(line, tokens)}", err=True)
    return 3


def _one_line(message: str, tokens: list[str]) -> str:
    """`message` on one line, whatever a library put in it, with `tokens` and those in the environment masked."""
    for secret in [*tokens, *(os.environ.get(name, "") for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"))]:
        if secret:
            message = message.replace(secret, "***")
    return " ".join(message.split())


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        if args[:1] == ["env"]:  # the subcommand, as git's: a path named env is written ./env
            return _env(args[1:])
        return command.main(args=args, prog_name="moe-rewrite", standalone_mode=False) or 0
    except RewriteError as e:
        return _error(str(e), _secrets(args))
    except InternalError as e:
        return _internal_error(e, _secrets(args))
    except click.ClickException as e:
        return _error(e.format_message(), _secrets(args))
    except OSError as e:  # a write that failed after every check passed (disk full, permissions changed)
        return _error(f"{sources.shown(e.filename or '')}: {e.strerror or e}; nothing was written", _secrets(args))
    except click.exceptions.Abort:
        click.echo("moe-rewrite: aborted", err=True)
        return 1


def _env(args: list[str]) -> int:
    """`moe-rewrite env`: its lines as they come (the versions at once, the kernel once torch has loaded)."""
    if args in (["-h"], ["--help"]):
        click.echo(
            "Usage: moe-rewrite env\n\n  Print the installed versions and the kernel the generated code picks here."
        )
        return 0
    if args:
        raise RewriteError(
            f"env takes no arguments (a SOURCE named env is written ./env): {sources.shown(' '.join(args))}"
        )
    from moe_rewrite.env import report

    for line in report():
        click.echo(line)
    return 0


def run() -> None:
    sys.exit(main())
