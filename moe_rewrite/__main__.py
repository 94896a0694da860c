"""python -m moe_rewrite: the same as the moe-rewrite command."""

from moe_rewrite.cli import run

run()
