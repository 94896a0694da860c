"""The published RoPE modules build their cos/sin tables on first use (and again for a longer sequence): kept out of
torch.compile's graphs, so that a compiled decoder layer traces the same graph on every call."""

import torch


def _moe_rewrite_rope_tables_eager(*classes):
    """Run the `forward` of these classes (the file's RoPE modules, whose forward rebuilds the tables when
    `max_seq_len_cached` is None or shorter than the sequence) outside torch.compile's graphs.

    A compiled graph that traced the rebuild holds the rebuild and guards on the table's length; the next call finds
    the tables built, fails that guard and traces another graph. Under non-reentrant gradient checkpointing of a
    compiled layer (`layer.compile()`), the recomputation then runs a graph that saves other tensors than the forward
    did, and torch.utils.checkpoint raises CheckpointError at the first backward; without checkpointing, each longer
    sequence compiles the layer again. Outside the graph, the tables come in as inputs of the same shape, and the
    graph is the same on every call. The numbers are the published ones: the forward itself is unchanged.
    """
    for cls in classes:
        cls.forward = torch.compiler.disable(cls.forward)
