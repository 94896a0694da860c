"""The rewrites, one module each, grouped by concern, all with one interface (`Codemod`): `transform(module,
context) -> module`, and READS / PROVIDES, the Context fields it reads and the ones it fills (rewrite.py checks the
order of its CODEMODS list against them on import).

Each edits the syntax tree and names, in `context.sections`, the runtime sections its edits call (render.SECTIONS);
the last one, `block`, puts those sections' code into the file. `context.index` answers what a file holds without a
walk of the whole tree per question (kit/index.py). Everything moe-rewrite generates carries the marker MARK (see
`is_marked`), so a later run finds and replaces it.

The packages: `kit/` what they share (Context, the markers, syntax helpers, the Index); `moe/` the MoE layer's
rewrites (its form, experts, router, expert parallelism and layout); `model/` the whole-model rewrites (attention, its
mask, the loss, norms, RoPE, gradient checkpointing, weight init); `compat/` the transformers-compatibility edits;
`block.py`, last, the generated block.
"""
