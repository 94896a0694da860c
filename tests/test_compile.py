"""The rewritten model under torch.compile, as a user compiles a training step: each decoder layer (`layer.compile()`)
under non-reentrant gradient checkpointing, the whole model, PEFT LoRA on the experts (target_parameters on fused
experts, target_modules on per-expert ones), train and eval: the same loss and gradients as the eager rewritten model
in float32, no tracing again from step to step at fixed shapes, and no tracing per sequence length. The CPU runs use
the aot_eager backend (the graphs torch.compile captures, run by torch's own kernels: what would break or recompile
shows there, in seconds); one test runs inductor; the CUDA test runs at the end where a GPU is present.
"""

from __future__ import annotations

import copy
import re

import pytest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

from conftest import build_model, patched_checkpoint  # noqa: E402
from helpers import rel_err  # noqa: E402

pytestmark = pytest.mark.slow  # torch.compile takes seconds per graph on a CI CPU: 10-30 s a test
REL = 1e-5
ONE_MOE_LAYER = {"num_hidden_layers": 1, "first_k_dense_replace": 0}  # half the graphs to trace
PARAMETERS = ["experts.gate_up_proj", "experts.down_proj"]
ROUTED = r".*\.experts\.\d+\.(gate_proj|up_proj|down_proj)"


@pytest.fixture(scope="module")
def fused(tmp_path_factory):
    return patched_checkpoint(tmp_path_factory, "v3")


@pytest.fixture(scope="module")
def per_expert(tmp_path_factory):
    return patched_checkpoint(tmp_path_factory, "v3", "--no-fuse-experts")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def graphs() -> int:
    """How many graphs torch.compile has traced in this process since the last reset."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def tokens(length, seed=0, batch=2):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (batch, length), generator=generator)


def taken_grads(model):
    """The gradients of the trainable parameters, then cleared."""
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def batch_step(model, run, batch):
    """One training step's loss on `batch` (keyword arguments of the forward) and its gradients (then cleared)."""
    loss = run(**batch).loss
    loss.backward()
    return loss.detach(), taken_grads(model)


def step(model, run, ids):
    """One training step on `ids` as inputs and labels: its loss and gradients (then cleared)."""
    return batch_step(model, run, dict(input_ids=ids, labels=ids))


def assert_same_step(eager, compiled):
    (loss, grads), (ref_loss, ref_grads) = compiled, eager
    assert rel_err(loss, ref_loss) < REL
    assert grads.keys() == ref_grads.keys() and len(grads) > 0
    for name, grad in grads.items():
        assert rel_err(grad, ref_grads[name]) < REL, name


def compile_layers(model, backend="aot_eager"):
    for layer in model.model.layers:
        layer.compile(backend=backend)


def test_compiled_layers_train_under_checkpointing_as_eager_and_trace_once(fused):
    """The issue's failure (CheckpointError at the first backward) came from the published RoPE module rebuilding its
    tables on first use inside the compiled layer: the recomputation traced another graph."""
    eager = build_model(fused).train()
    model = copy.deepcopy(eager)
    for m in (eager, model):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    compile_layers(model)
    ids = tokens(12)
    assert_same_step(step(eager, eager, ids), step(model, model, ids))
    traced = graphs()
    assert traced > 0
    assert_same_step(step(eager, eager, ids), step(model, model, ids))
    assert graphs() == traced  # the second step, its recomputation included, traces nothing


def test_compiled_model_trains_as_eager_without_a_graph_per_length(fused):
    """torch.compile(model) under non-reentrant checkpointing, lengths 12, 20 and 28: the second length makes
    dimensions dynamic, the third traces nothing (neither does its routing: the grouped GEMMs are one operator)."""
    eager = build_model(fused, **ONE_MOE_LAYER).train()
    model = copy.deepcopy(eager)
    for m in (eager, model):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    run = torch.compile(model, backend="aot_eager")
    traced = []
    for length in (12, 20, 28):
        before = graphs()
        ids = tokens(length, seed=length)
        assert_same_step(step(eager, eager, ids), step(model, run, ids))
        traced.append(graphs() - before)
    assert traced[0] > 0 and traced[2] == 0, traced


def test_compiled_model_evaluates_as_eager(fused):
    eager = build_model(fused, **ONE_MOE_LAYER).eval()
    run = torch.compile(copy.deepcopy(eager), backend="aot_eager")
    ids = tokens(12)
    with torch.no_grad():
        for _ in range(2):
            assert rel_err(run(input_ids=ids).logits, eager(input_ids=ids).logits) < REL


def test_compiled_layers_evaluate_as_eager_without_a_graph_per_expert(fused):
    """Eval mode's published moe_infer loops over the experts in Python and calls each one's module: compiled, that
    was a graph per expert (each view guards on its index) until dynamo's recompile limit (8), then eager. Compiled,
    the experts run as one grouped product instead: the eager model's numbers, a few graphs, none per new batch."""
    eager = build_model(fused, **ONE_MOE_LAYER, n_routed_experts=16).eval()
    model = copy.deepcopy(eager)
    compile_layers(model)
    traced = []
    with torch.no_grad():
        for seed in range(3):
            before = graphs()
            ids = tokens(12, seed=seed)
            assert rel_err(model(input_ids=ids).logits, eager(input_ids=ids).logits) < REL
            traced.append(graphs() - before)
    assert 0 < traced[0] < 8 and traced[1:] == [0, 0], traced


@pytest.mark.parametrize("targets", ["target_parameters", "target_modules"])
def test_compiled_layers_train_lora_under_checkpointing_as_eager(fused, per_expert, targets):
    """PEFT LoRA r4 on every routed expert: on the fused parameters (target_parameters) and on per-expert nn.Linear
    layers (target_modules), the layers compiled and checkpointed."""
    where = {"target_parameters": PARAMETERS} if targets == "target_parameters" else {"target_modules": ROUTED}
    base = build_model(fused if targets == "target_parameters" else per_expert, **ONE_MOE_LAYER)
    torch.manual_seed(1)
    config = peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, **where)
    eager = peft.get_peft_model(base, config, autocast_adapter_dtype=False).train()
    model = copy.deepcopy(eager)
    for m in (eager, model):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    compile_layers(model.base_model.model)
    ids = tokens(12)
    for _ in range(2):
        assert_same_step(step(eager, eager, ids), step(model, model, ids))


def test_inductor_compiled_layers_train_as_eager(fused):
    """The default backend (inductor, C++ on the CPU): its fused kernels round differently, within 1e-4."""
    eager = build_model(fused, **ONE_MOE_LAYER).train()
    model = copy.deepcopy(eager)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    compile_layers(model, backend="inductor")
    ids = tokens(12)
    loss, grads = step(model, model, ids)
    ref_loss, ref_grads = step(eager, eager, ids)
    assert rel_err(loss, ref_loss) < 1e-4
    for name, grad in grads.items():
        assert rel_err(grad, ref_grads[name]) < 1e-4, name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("where", ["layers", "model"])
def test_cuda_compiled_model_trains_as_eager_in_bf16(fused, where):
    """On the GPU in bf16 with inductor: the Triton kernels and grouped GEMMs of the eager path against what the
    compiled one runs, under checkpointing, within bf16's rounding; the second step traces nothing."""
    eager = build_model(fused).cuda().bfloat16().train()
    model = copy.deepcopy(eager)
    for m in (eager, model):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if where == "layers":
        compile_layers(model, backend="inductor")
        run = model
    else:
        run = torch.compile(model)
    ids = tokens(64).cuda()
    for index in range(2):
        before = graphs()
        loss, grads = step(model, run, ids)
        ref_loss, ref_grads = step(eager, eager, ids)
        assert rel_err(loss, ref_loss) < 2e-2
        for name, grad in grads.items():
            assert rel_err(grad, ref_grads[name]) < 5e-2, name
        if index == 1:
            assert graphs() == before


def test_the_rope_line_names_the_classes_whose_forward_rebuilds_the_tables_and_a_second_run_keeps_it():
    from moe_rewrite.codemods.kit import Context
    from moe_rewrite.codemods.model import rope_tables
    from moe_rewrite.options import RewriteOptions

    source = (
        "class Rotary(nn.Module):\n"
        "    def forward(self, x, seq_len=None):\n"
        "        if self.max_seq_len_cached is None or seq_len > self.max_seq_len_cached:\n"
        "            self._set_cos_sin_cache(seq_len=seq_len, device=x.device, dtype=x.dtype)\n"
        "        return self.cos_cached[:seq_len], self.sin_cached[:seq_len]\n\n\n"
        "class Scaled(Rotary):\n"
        "    def _set_cos_sin_cache(self, seq_len, device, dtype):\n"
        "        self.max_seq_len_cached = seq_len\n\n\n"
        "class Plain(nn.Module):\n"
        "    def forward(self, x):\n"
        "        return x\n"
    )
    import libcst as cst

    context = Context(RewriteOptions())
    once = rope_tables.transform(cst.parse_module(source), context).code
    line = "\n\n\n_moe_rewrite_rope_tables_eager(\n    Rotary,\n)  # moe-rewrite: their forward rebuilds the tables"
    assert line in once and once.endswith("torch.compile\n")
    assert once.count("_moe_rewrite_rope_tables_eager") == 1 and "rope_tables" in context.sections
    assert rope_tables.transform(cst.parse_module(once), Context(RewriteOptions())).code == once
    plain = source[source.index("class Plain") :]
    assert rope_tables.transform(cst.parse_module(plain), Context(RewriteOptions())).code == plain


# Packed documents (runtime/model/packing.py) under torch.compile: the Model finds them outside the graphs, the
# compiled layers read only their tensors and longest length.
PACKED_STEPS = ((5, 9, 3, 7), (11, 2, 6), (4, 4, 8, 3, 5), (7, 12, 1, 2))  # new lengths, counts and token totals


def packed_batch(lengths, vocab, seed, flash_kwargs=False):
    """DataCollatorWithFlattening's form: one row, position ids restarting, labels -100 at each document's start."""
    generator = torch.Generator().manual_seed(seed)
    docs = [torch.randint(2, vocab, (n,), generator=generator) for n in lengths]
    ids = torch.cat(docs)[None]
    labels = ids.clone()
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    labels[0, cu[:-1].long()] = -100
    batch = dict(input_ids=ids, position_ids=torch.cat([torch.arange(n) for n in lengths])[None], labels=labels)
    if flash_kwargs:
        batch.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lengths), max_length_k=max(lengths))
    return docs, batch


def alone_step(model, docs):
    """Each document run alone: the token losses summed over all documents, over their count, and its gradients
    (what the packed batch's mean loss over its labels is); a document of one token has no label."""
    total = sum(model(input_ids=d[None], labels=d[None]).loss * (len(d) - 1) for d in docs if len(d) > 1)
    count = sum(len(d) - 1 for d in docs)
    (total / count).backward()
    return total.detach() / count, taken_grads(model)


def recording(functions):
    """aot_eager, adding to `functions` the names of the functions each graph traced (its nodes' stack traces)."""
    aot_eager = torch._dynamo.lookup_backend("aot_eager")

    def backend(gm, inputs):
        traces = "".join(str(node.meta.get("stack_trace", "")) for node in gm.graph.nodes)
        functions.update(re.findall(r"line \d+, in (\w+)", traces))
        return aot_eager(gm, inputs)

    return backend


@pytest.mark.parametrize(
    "where, flash_kwargs", [("layers", False), ("model", False), ("model", True)], ids=["layers", "model", "model-cu"]
)
def test_compiled_packed_batches_are_each_document_alone_and_trace_twice(fused, where, flash_kwargs):
    """Four packed steps with new document lengths, counts and token totals, the documents read from restarting
    position ids or from the collator's cu_seq_lens_q/k (model-cu): the compiled model's loss and gradients equal the
    eager packed model's and each document run alone (float32), the attention of the compiled graphs runs the
    document-causal mask, the first step traces, the second traces again with the lengths dynamic, the third and
    fourth trace nothing. Each layer compiled under non-reentrant checkpointing; the whole model compiled without
    (with it, the decoder layers run eagerly: docs/compile.md)."""
    import warnings

    eager = build_model(fused, aux_loss_alpha=0.0, **ONE_MOE_LAYER).train()  # the aux loss spans the batch
    model = copy.deepcopy(eager)
    functions = set()
    if where == "layers":
        for m in (eager, model):
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        compile_layers(model, backend=recording(functions))
        run = model
    else:
        run = torch.compile(model, backend=recording(functions))
    traced = []
    for index, lengths in enumerate(PACKED_STEPS):
        docs, batch = packed_batch(lengths, eager.config.vocab_size, seed=index, flash_kwargs=flash_kwargs)
        before = graphs()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the packed-batch warning
            got = batch_step(model, run, batch)
            want = batch_step(eager, eager, batch)
        traced.append(graphs() - before)
        alone = alone_step(eager, docs)
        assert_same_step(want, got)
        assert_same_step(alone, got)
    assert "_moe_rewrite_document_causal_mask" in functions
    assert traced[0] > 0 and traced[1] > 0 and traced[2:] == [0, 0], traced
