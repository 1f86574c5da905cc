"""The torch side of ``fused_linear_cross_entropy`` (``TorchBackend``'s fused primitives):
the autograd.Function of ``custom_gradient``, and the in-place and GEMM helpers of the chunk
loop. Eager autograd, torch.compile, torch.func (grad, vjp, vmap) and torch.autocast."""

from __future__ import annotations

import warnings

import torch

from numstab.errors import InvalidArgumentError

#: whether torch.addmm(..., out_dtype=float32) takes 16-bit operands (CUDA, torch >= 2.8);
#: set to False where it fails
FLOAT32_OUT = ["dtype_out" in torch.ops.aten.addmm.overloads()]


def add_float32_product(acc, a, b):
    """``acc + a.T @ b`` (``a.T @ b`` for a None ``acc``) for 16-bit CUDA ``a``, ``b``, in
    float32 by one tensor-core GEMM, added into ``acc`` in place; None (and a warning, once)
    where torch cannot."""
    try:
        if acc is None:
            return torch.mm(a.mT, b, out_dtype=torch.float32)
        return torch.addmm(acc, a.mT, b, out_dtype=torch.float32, out=acc)
    except (RuntimeError, NotImplementedError) as err:
        FLOAT32_OUT[0] = False
        warnings.warn(
            f"numstab fused_linear_cross_entropy: torch could not add a {a.dtype} product into "
            f"float32 ({type(err).__name__}: {err}); it multiplies in float32 instead (the same "
            f"values, slower)",
            RuntimeWarning,
            stacklevel=2,
        )
        return None


class CustomGradient(torch.autograd.Function):
    """Backend.custom_gradient for torch: ``forward``/``backward`` are the algorithm's own.
    In the forward + setup_context form torch.func needs: the residuals are extra outputs,
    not differentiable (an input among them as a view: setup_context cannot save it as-is)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(forward, backward, needs, *args):
        out, residuals = forward(args, needs)  # a flat tuple of tensors or None
        as_is = [r is not None and any(r is a for a in args) for r in residuals]
        return (out, *[r.view_as(r) if i else r for r, i in zip(residuals, as_is, strict=True)])

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.mark_non_differentiable(*[r for r in output[1:] if r is not None])
        # the residual outputs get no gradient: undefined, not zeros (materialised, they were
        # a zero dweight and dhidden, a second weight-sized buffer at the step's peak)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(*output[1:])
        ctx.backward_fn = inputs[1]

    @staticmethod
    def backward(ctx, cotangent, *_):
        if cotangent is None:  # the loss itself got no gradient
            return (None,) * len(ctx.needs_input_grad)
        saved = ctx.saved_tensors
        # grad mode is on under create_graph=True and always under torch.func, where only a
        # second differentiating level counts; a torch.func.vjp function (jacrev) runs after
        # its level ended (its saved tensors are at level -2)
        if torch.is_grad_enabled():
            ended = any(FT.maybe_get_level(t) == -2 for t in saved if t is not None)
            if levels(FT.TransformType.Grad, FT.TransformType.Jvp) + ended != 1:
                raise InvalidArgumentError(NO_HIGHER_ORDER + "Received: create_graph=True")
        grads = autocast_off(cotangent.device.type, ctx.backward_fn, saved, cotangent)
        return (None, None, None, *grads)


NO_HIGHER_ORDER = (
    "fused_linear_cross_entropy has a first-order gradient only (computed without a graph): "
    "autograd.grad(create_graph=True) and second-order torch.func transforms (grad of grad, "
    "hessian, jvp of its gradient) cannot differentiate it. Use cross_entropy(hidden @ "
    "weight.T, labels) where a higher-order gradient is needed (a gradient penalty). "
)
FT = torch._C._functorch
WRAPPED = FT.is_functorch_wrapped_tensor
#: values per temporary block of a fused chunk's work (8 MiB of float32)
BLOCK_VALUES = 1 << 21


def levels(*kinds) -> int:
    """The number of active torch.func levels of ``kinds`` (TransformType)."""
    return sum(level.key() in kinds for level in FT.get_interpreter_stack() or ())


def autocast_off(device: str, fn, *args):
    """``fn(*args)`` with torch.autocast off on ``device`` (autocast_operands cast)."""
    if not torch.is_autocast_enabled(device):
        return fn(*args)
    with torch.autocast(device, enabled=False):
        return fn(*args)


def in_place_ok(*tensors) -> bool:
    """Not compiling (Dynamo cannot trace a mutation of a saved residual or return a mutated
    intermediate) and no torch.func-wrapped tensor (vmap has no out= or mixed in-place ops)."""
    return not torch.compiler.is_compiling() and not any(map(WRAPPED, tensors))


def batched(x: torch.Tensor) -> bool:
    """``x`` is torch.vmap-batched at some torch.func level (vmap(grad(f)) wraps it)."""
    while WRAPPED(x):
        if FT.is_batchedtensor(x):
            return True
        x = FT.get_unwrapped(x)
    return False


def records_grad(*tensors: torch.Tensor) -> bool:
    """Autograd would record an op on ``tensors`` (``out=`` and slice writes refuse that)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def mm_nt_cpu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b.T`` [C, V] on CPU as ``(b @ a.T).T``, a block of ``b``'s rows at a time, each
    block copied into its columns of one contiguous output. MKL computes the logits of a
    fused chunk ~15% faster in this layout (C=128, d=1024, V=65536: fused CE 1.24x -> 1.15x
    unfused); made whole and then contiguous, the product held two chunk-sized buffers."""
    out = a.new_empty((a.shape[0], b.shape[0]), dtype=torch.result_type(a, b))
    rows = max(1, BLOCK_VALUES // max(1, a.shape[0]))
    for start in range(0, b.shape[0], rows):
        out[:, start : start + rows] = torch.mm(b[start : start + rows], a.mT).mT
    return out
