"""The `moe-rewrite` command: parse options, call the library, map errors to exit codes.

Exit codes: 0 done (or nothing to change), 1 `--in-place` changed a file or `--check`/`--diff` found one to change
(the pre-commit convention), 2 bad input: one line on stderr, nothing written.
"""

from __future__ import annotations

import difflib
import sys
from pathlib import Path

import click

from moe_rewrite import __version__, publish, sources
from moe_rewrite.errors import RewriteError
from moe_rewrite.rewrite import BACKENDS, STACKINGS, RewriteOptions, RewriteResult, rewrite_source


def unified_diff(path: Path, old: str, new: str) -> str:
    return "".join(
        difflib.unified_diff(
            old.splitlines(keepends=True), new.splitlines(keepends=True), f"a/{path.as_posix().lstrip('/')}", f"b/{path.as_posix().lstrip('/')}"
        )
    )


def _check_modes(specs: tuple[str, ...], out: Path | None, in_place: bool, check: bool, diff: bool) -> None:
    if out is not None and in_place:
        raise RewriteError("--out and --in-place exclude each other")
    if (check or diff) and (out is not None or in_place):
        raise RewriteError("--check and --diff write nothing; drop --out/--in-place")
    if not (out is not None or in_place or check or diff):
        raise RewriteError("say where the result goes: --out DIR, --in-place, --check or --diff")
    if out is not None and len(specs) > 1:
        raise RewriteError("--out takes one SOURCE; rewrite several files with --in-place")


def _describe(result: RewriteResult, options: RewriteOptions) -> str:
    gate = f" + {result.gate_class}" if result.form == "v3" else ""
    return f"{result.form.upper()} form, {result.moe_class}{gate}; backend={options.backend}, stacking={options.stacking}"


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("specs", metavar="SOURCE...", nargs=-1, required=True)
@click.option("--out", type=click.Path(path_type=Path), help="Write the patched checkpoint (code, config, links) here.")
@click.option("--in-place", is_flag=True, help="Rewrite the file where it is; exit 1 when it changed.")
@click.option("--check", is_flag=True, help="Write nothing; exit 1 when something would change.")
@click.option("--diff", is_flag=True, help="Print a unified diff; write nothing; exit 1 when something would change.")
@click.option("--revision", help="Hub revision (branch, tag or commit) of a Hub SOURCE.")
@click.option("--token", help="Hub token for private or gated repos (default: the saved login).")
@click.option("--backend", type=click.Choice(BACKENDS), default="auto", show_default=True,
              help="Grouped-GEMM backend written into the file (MOE_REWRITE_BACKEND overrides it at run time).")
@click.option("--stacking", type=click.Choice(STACKINGS), default="stack", show_default=True,
              help="'sequential' stacks each expert weight right before its GEMM: lower peak memory.")
@click.version_option(__version__, prog_name="moe-rewrite")
def command(specs, out, in_place, check, diff, revision, token, backend, stacking) -> int:
    """Make DeepSeek-family MoE remote code trainable with grouped-GEMM experts.

    SOURCE is a Hub repo id (org/name), a checkpoint directory holding modeling_deepseek.py, or a .py file.
    """
    _check_modes(specs, out, in_place, check, diff)
    options = RewriteOptions(backend=backend, stacking=stacking)
    if in_place and (hub := next((s for s in specs if sources.REPO_ID.match(s) and not Path(s).exists()), None)):
        raise RewriteError(f"{hub}: a Hub repo cannot be rewritten in place; use --out DIR")
    # Everything is resolved and rewritten before anything is written: an error leaves every file as it was.
    resolved = [sources.resolve(spec, revision, token) for spec in specs]
    results = []
    for src in resolved:
        try:
            results.append(rewrite_source(src.read(), options))
        except RewriteError as e:
            raise RewriteError(f"{src.modeling_file}: {e}") from None
    if out is not None:
        publish.check_out_dir(out, resolved[0])

    changed = 0
    for src, result in zip(resolved, results):
        path = src.modeling_file
        if out is not None:
            written, linked = publish.write_checkpoint(out, src, result.text)
            click.echo(f"Rewrote {path} -> {written[0]} ({_describe(result, options)})", err=True)
            click.echo(f"  {out}: {len(written) - 1} code/config files copied, {len(linked)} files linked", err=True)
            continue
        if not result.changed:
            continue
        changed = 1
        if diff:
            click.echo(unified_diff(path, src.read(), result.text), nl=False)
        if check:
            click.echo(f"would rewrite {path} ({_describe(result, options)})", err=True)
        if in_place:
            # A vendored file may be a symlink: rewrite the file it points to and keep the link.
            publish.write_atomic(path.resolve(), result.text.encode("utf-8"), mode_from=path)
            click.echo(f"Rewriting {path} ({_describe(result, options)})", err=True)
    return changed


def main(argv: list[str] | None = None) -> int:
    try:
        return command.main(args=argv, prog_name="moe-rewrite", standalone_mode=False) or 0
    except RewriteError as e:
        click.echo(f"moe-rewrite: error: {e}", err=True)
        return 2
    except click.ClickException as e:
        click.echo(f"moe-rewrite: error: {e.format_message()}", err=True)
        return 2
    except click.exceptions.Abort:
        click.echo("moe-rewrite: aborted", err=True)
        return 1


def run() -> None:
    sys.exit(main())
