"""The causal-LM loss without float32 logits over the whole vocabulary (codemods/lm_loss.py). The published forward
computes lm_head(hidden) for every token, upcasts it to float32, copies the shifted logits and takes the mean
cross-entropy: at vocabulary 163840 and 8192 tokens that holds about 21 GB more at its peak. Here one autograd Function
walks the tokens in chunks, and per chunk computes the logits (lm_head's GEMM, in its dtype), the float32 logsumexp and
loss, and the gradient (softmax - onehot) / n rounded once to the logits' dtype, as the published backward rounds it;
then the hidden states' and the weight's gradients of that chunk, all in the forward. The backward scales them by the
loss's gradient. Training with labels only; MOE_REWRITE_FUSED_LOSS=0, or config.moe_rewrite_fused_loss = False, runs
the published statements (which return the logits).
"""

import torch

# _moe_rewrite_options marks this module as holding generated caches (tests/conftest.py empties them by that name)
from ..kernels.dispatch import _moe_rewrite_options, _moe_rewrite_setting, _moe_rewrite_triton  # noqa: F401
from ..kernels.triton_cross_entropy import _moe_rewrite_cross_entropy_kernels, _moe_rewrite_cross_entropy_rows

# The logits of one chunk take at most this many bytes: 2048 tokens at vocabulary 163840 in bf16 (0.67 GB)
MOE_REWRITE_LOSS_CHUNK_BYTES = 2048 * 163840 * 2
_moe_rewrite_lm_loss_cache = {}  # "kernels" -> the Triton kernel or None; "out_dtype" -> whether addmm takes out_dtype


def _moe_rewrite_fused_loss_applies(model):
    """Whether the fused loss computes what the published statements would: lm_head a plain nn.Linear without bias or
    hooks whose weight is the whole (vocab, hidden) tensor. FSDP2 (another class, a DTensor weight), PEFT on lm_head
    (a wrapper), DeepSpeed ZeRO-3 (an empty shard, hooks) and any hook fall back to the published statements, as do
    MOE_REWRITE_FUSED_LOSS=0 and config.moe_rewrite_fused_loss = False (for callers that read the logits in training:
    TRL's SFTTrainer computes its entropy and token accuracy from them)."""
    if _moe_rewrite_setting("MOE_REWRITE_FUSED_LOSS", "1") == "0":
        return False
    if not getattr(model.config, "moe_rewrite_fused_loss", True):
        return False
    head = model.lm_head
    if type(head) is not torch.nn.Linear or head.bias is not None:
        return False
    if head._forward_hooks or head._forward_pre_hooks or head._backward_hooks or head._backward_pre_hooks:
        return False
    weight = head.weight
    return (
        type(weight) in (torch.nn.Parameter, torch.Tensor)
        and tuple(weight.shape) == (head.out_features, head.in_features)
        and head.out_features == model.config.vocab_size
    )


def _moe_rewrite_lm_loss(hidden, weight, labels):
    """(loss, no logits): the published mean cross-entropy of lm_head(hidden) (float32 logits) at position t against
    labels at t + 1, -100 ignored (NaN when every label is; a label out of the vocabulary's bounds raises as
    published), without the logits: in their place _MoeRewriteNoLogits, whose every use raises an error naming the
    opt-outs (None while torch.compile traces). Under torch.autocast the GEMMs run in its dtype, as lm_head would."""
    if labels.shape != hidden.shape[:-1]:
        raise ValueError(f"moe-rewrite: labels of shape {tuple(labels.shape)} for hidden states {tuple(hidden.shape)}")
    if torch.is_autocast_enabled(hidden.device.type):
        dtype = torch.get_autocast_dtype(hidden.device.type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
    # the logits at t score the label at t + 1: each sequence's labels moved one to the left, -100 after its last
    ignored = labels.new_full((*labels.shape[:-1], 1), -100)
    target = torch.cat([labels[..., 1:], ignored], dim=-1).reshape(-1).to(hidden.device)
    _moe_rewrite_check_targets(target, weight.shape[0])
    with torch.autocast(hidden.device.type, enabled=False):
        if torch.compiler.is_compiling() and _moe_rewrite_loss_op():  # one operator, opaque to the compiler
            wanted = (hidden.requires_grad, weight.requires_grad)
            loss = torch.ops.moe_rewrite.linear_cross_entropy(hidden, weight, target, *wanted)[0]
        else:
            loss = _MoeRewriteLinearCrossEntropy.apply(hidden, weight, target)
    return loss, (None if torch.compiler.is_compiling() else _MoeRewriteNoLogits())


def _moe_rewrite_check_targets(target, vocab):
    """The published loss's bounds check: every target in [0, vocab) or -100 (CrossEntropyLoss's ignore_index); the
    kernels would read another row's logits. On CUDA as published, a device-side assert (torch._assert_async: no host
    sync; the step's later kernels never run, the error surfaces at the next synchronisation as "CUDA error:
    device-side assert triggered"); elsewhere the published IndexError, "Target N is out of bounds.", N the first."""
    bad = (target >= vocab) | ((target < 0) & (target != -100))
    if target.device.type == "cuda":
        torch._assert_async(~bad.any())
    elif bad.any():
        raise IndexError(f"Target {target[bad][0].item()} is out of bounds.")


class _MoeRewriteLinearCrossEntropy(torch.autograd.Function):
    """mean over target != -100 of logsumexp(x·Wᵀ) - (x·Wᵀ)[target], float32, with x the hidden states (..., H) as
    rows and W (V, H); the gradients are computed in the forward, chunk by chunk, and kept for the backward."""

    @staticmethod
    def forward(ctx, hidden, weight, target):
        loss, grad_x, grad_w = _moe_rewrite_loss_and_grads(hidden, weight, target, *ctx.needs_input_grad[:2])
        ctx.save_for_backward(grad_x, grad_w)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_x, grad_w = ctx.saved_tensors
        return (
            grad_x * grad_loss if grad_x is not None else None,
            grad_w * grad_loss if grad_w is not None else None,
            None,
        )


def _moe_rewrite_loss_and_grads(hidden, weight, target, grad_x_wanted, grad_w_wanted):
    """(loss, the hidden states' gradient or None, the weight's or None) of _MoeRewriteLinearCrossEntropy."""
    x = hidden.reshape(-1, hidden.shape[-1])
    rows, vocab = x.shape[0], weight.shape[0]
    n = (target != -100).sum().to(torch.float32)  # kept on the device: no synchronisation
    scale = (1.0 / n).reshape(1)
    chunk = max(1, MOE_REWRITE_LOSS_CHUNK_BYTES // (vocab * x.element_size()))
    kernels = _moe_rewrite_cross_entropy_kernel(x.device, x.dtype)
    total = torch.zeros((), device=x.device, dtype=torch.float32)
    grad_x = torch.empty_like(x) if grad_x_wanted else None
    grad_w = None
    for start in range(0, rows, chunk):
        rows_x = x[start : start + chunk]
        logits = rows_x @ weight.t()
        if kernels is not None:
            row_loss = _moe_rewrite_cross_entropy_rows(kernels, logits, target[start : start + chunk], scale)
        else:
            row_loss = _moe_rewrite_cross_entropy_torch(logits, target[start : start + chunk], scale)
        total += row_loss.sum()
        grad = logits  # overwritten with the gradient of the chunk's logits
        if grad_x is not None:
            torch.mm(grad, weight, out=grad_x[start : start + chunk])
        if grad_w_wanted:  # a frozen lm_head (LoRA) needs no weight gradient
            grad_w = _moe_rewrite_loss_accumulate(grad_w, grad.t(), rows_x, single=chunk >= rows)
    grad_x = grad_x.view(hidden.shape) if grad_x is not None else None
    return total / n, grad_x, grad_w.to(weight.dtype) if grad_w is not None else None


class _MoeRewriteNoLogits:
    """The `logits` the forward returns in training with labels where the fused loss ran (it computes none): one
    shared instance, in the published output's logits slot (to_tuple() and outputs[i] as published), whose every
    use (an attribute, indexing, arithmetic, len, bool) raises an error naming the two opt-outs, not a bare
    "'NoneType' object ...". Inert to what walks a model's outputs: hasattr() probes find nothing (AttributeError),
    iterating it yields nothing and calling the class with anything gives the instance back (DataParallel's gather,
    accelerate's fp32 conversion, FSDP, DDP, pickling and copying keep it); == and hash by identity."""

    __slots__ = ()
    _moe_rewrite_instance = None
    MESSAGE = (
        "moe-rewrite: no logits in training with labels: the rewritten forward computes the loss in chunks without "
        "them. To get them, set `model.config.moe_rewrite_fused_loss = False` (or MOE_REWRITE_FUSED_LOSS=0), or "
        "rewrite the file with `--no-fused-loss`"
    )

    def __new__(cls, *args, **kwargs):
        if cls._moe_rewrite_instance is None:
            cls._moe_rewrite_instance = super().__new__(cls)
        return cls._moe_rewrite_instance

    def __getattr__(self, name):
        raise AttributeError(f"{_MoeRewriteNoLogits.MESSAGE} (reading `logits.{name}`)")

    def __iter__(self):
        return iter(())

    def __repr__(self):
        return "<no logits: moe-rewrite's fused loss; model.config.moe_rewrite_fused_loss = False keeps them>"

    def _moe_rewrite_refuse(self, *args, **kwargs):
        raise TypeError(_MoeRewriteNoLogits.MESSAGE)

    __getitem__ = __setitem__ = __len__ = __bool__ = __contains__ = _moe_rewrite_refuse
    __float__ = __int__ = __index__ = __neg__ = __pos__ = __abs__ = __invert__ = _moe_rewrite_refuse
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __matmul__ = __rmatmul__ = _moe_rewrite_refuse
    __truediv__ = __rtruediv__ = __floordiv__ = __pow__ = __mod__ = _moe_rewrite_refuse
    __lt__ = __le__ = __gt__ = __ge__ = _moe_rewrite_refuse


def _moe_rewrite_cross_entropy_torch(logits, target, scale):
    """_moe_rewrite_cross_entropy_rows' arithmetic as torch ops (off CUDA, without triton)."""
    z = logits.float()
    lse = torch.logsumexp(z, dim=-1)
    valid = target != -100
    index = torch.where(valid, target, 0).unsqueeze(1)
    row_loss = torch.where(valid, lse - z.gather(1, index).squeeze(1), 0.0)
    grad = torch.exp(z - lse.unsqueeze(1))
    grad.scatter_add_(1, index, torch.full_like(index, -1, dtype=grad.dtype))
    grad *= torch.where(valid, scale, 0.0).unsqueeze(1)
    logits.copy_(grad)
    return row_loss


def _moe_rewrite_loss_accumulate(total, a, b, single):
    """total + a @ b, accumulated in float32 over the chunks (None: the first). One chunk: a @ b in a's dtype, as the
    published backward's single GEMM computes it. The sum is added in place: an out-of-place addmm first copies
    `total` into its result (a 1.3 GB copy per chunk at vocabulary 163840, hidden 2048)."""
    if single:
        return a @ b
    if a.dtype == torch.float32:
        return a @ b if total is None else total.addmm_(a, b)
    if _moe_rewrite_lm_loss_cache.get("out_dtype", True):
        try:  # torch >= 2.8 on CUDA: bf16 GEMMs accumulating into float32, no bf16 product in between
            if total is None:
                return torch.mm(a, b, out_dtype=torch.float32)
            return torch.addmm(total, a, b, out_dtype=torch.float32, out=total)
        except (TypeError, RuntimeError, NotImplementedError):
            _moe_rewrite_lm_loss_cache["out_dtype"] = False
    if total is None:
        total = torch.zeros(a.shape[0], b.shape[1], device=a.device, dtype=torch.float32)
    return total.add_(a @ b)


@torch.compiler.assume_constant_result  # run at tracing, not traced: the graph holds only the operator's call
def _moe_rewrite_loss_op():
    """Whether torch.ops.moe_rewrite.linear_cross_entropy (loss, grad_x, grad_w) is registered: the loss as a custom
    operator for torch.compile (torch >= 2.4; eager runs the autograd Function). Traced as the Function, the loop over
    the chunks would fix the number of tokens in the graph, and every sequence length would compile again. Registered
    once per process: the first rewritten file loaded registers it, later ones use it."""
    if "op" not in _moe_rewrite_lm_loss_cache:
        _moe_rewrite_lm_loss_cache["op"] = _moe_rewrite_register_loss_op()
    return _moe_rewrite_lm_loss_cache["op"]


def _moe_rewrite_register_loss_op():
    try:
        torch.ops.moe_rewrite.linear_cross_entropy  # noqa: B018 (registered by another copy of this code)
        return True
    except (AttributeError, RuntimeError):
        pass
    if not hasattr(torch.library, "custom_op"):
        return False
    schema = "(Tensor hidden, Tensor weight, Tensor target, bool grad_x, bool grad_w) -> (Tensor, Tensor, Tensor)"

    def parts(hidden, weight, target, grad_x, grad_w):  # a gradient not asked for: an empty tensor
        loss, dx, dw = _moe_rewrite_loss_and_grads(hidden, weight, target, grad_x, grad_w)
        return loss, hidden.new_empty(0) if dx is None else dx, weight.new_empty(0) if dw is None else dw

    def fake(hidden, weight, target, grad_x, grad_w):
        dx = torch.empty_like(hidden) if grad_x else hidden.new_empty(0)
        dw = torch.empty_like(weight) if grad_w else weight.new_empty(0)
        return hidden.new_empty((), dtype=torch.float32), dx, dw

    def setup_context(ctx, inputs, output):
        ctx.wanted = inputs[3:5]
        ctx.save_for_backward(output[1], output[2])

    def backward(ctx, grad_loss, _grad_x, _grad_w):
        (dx, dw), (want_x, want_w) = ctx.saved_tensors, ctx.wanted
        return dx * grad_loss if want_x else None, dw * grad_loss if want_w else None, None, None, None

    op = torch.library.custom_op("moe_rewrite::linear_cross_entropy", parts, mutates_args=(), schema=schema)
    op.register_fake(fake)
    op.register_autograd(backward, setup_context=setup_context)
    return True


def _moe_rewrite_cross_entropy_kernel(device, dtype):
    """The Triton cross-entropy kernel where the other Triton kernels run (dispatch.py: CUDA, triton, not
    MOE_REWRITE_TRITON=0, not under torch.compile), else None. Built once per process."""
    if _moe_rewrite_triton(device, dtype) is None:
        return None
    if "kernels" not in _moe_rewrite_lm_loss_cache:
        _moe_rewrite_lm_loss_cache["kernels"] = _moe_rewrite_cross_entropy_kernels()
    return _moe_rewrite_lm_loss_cache["kernels"]
