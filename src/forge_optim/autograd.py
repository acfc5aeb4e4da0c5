"""The fused linear: forward is F.linear; backward computes dX with the old W, then hands
(dY, X) to the weight's :class:`~forge_optim.optim.FusedWeight`, which updates W in place.

The weight gradient is never returned to autograd, so a fused weight's ``.grad`` stays None.

Two forms of the same thing:
- eager: :class:`FusedLinearFunction` (an autograd.Function); a graph that is never
  backpropagated releases its pending use when it is freed. Under saved-tensor hooks (activation
  checkpointing) :class:`SavedOperands` saves its operands first, before the GEMM.
- under torch.compile: the ``forge_optim::fused_linear`` op (torch.library, defined at the
  dispatcher's level) with an Autograd kernel whose backward computes dX = dY W as ordinary traced
  ops and then calls the opaque, mutating ``forge_optim::fused_linear_update`` op with dX as an
  input: the data dependency keeps every compiler from moving the dX GEMM after the update
  (invariant 1). The weight reaches the op as a non-persistent buffer that aliases the parameter's
  storage: torch 2.11's inductor refuses a mutation of the autograd leaf itself.
  In a compiled forward, ``inductor_pass`` turns each layer's counted-use op into inductor's own GEMM
  and counts the whole graph's uses in one ``forge_optim::count_uses`` call.
"""
from __future__ import annotations

import itertools
import weakref

import torch
import torch.nn.functional as F

from . import dtensor


class Use:
    """One counted forward use of a fused weight; releases its count if its graph is dropped."""

    __slots__ = ("handle", "kind", "done", "__weakref__")

    def __init__(self, handle, kind):
        self.handle, self.kind, self.done = handle, kind, False

    def __del__(self):
        # getattr: torch.compile may build a Use without __init__ while tracing a call it then abandons
        if not getattr(self, "done", True) and self.kind is not None:
            self.handle.release(self.kind)


def autocast_operands(x, weight, bias):
    """Cast as autocast would cast F.linear's operands, so that the cast copies (from which the
    gradient tile is formed, and dX with the old W) are what backward sees."""
    dev = x.device.type
    if not torch.is_autocast_enabled(dev):
        return x, weight, bias
    dt = torch.get_autocast_dtype(dev)
    if dt == torch.float16:
        # fp16 training needs loss scaling (GradScaler): the fused update would consume the *scaled*
        # gradient in backward, before any unscale or inf check (SGD would step scale-times too far)
        raise RuntimeError(
            "forge_optim: a fused linear ran under torch.autocast(dtype=torch.float16) with gradients "
            "enabled. fp16 training needs a loss scale (GradScaler), and a fused update is applied inside "
            "backward to the scaled gradient, before the scaler could unscale it or skip the step. Use "
            "torch.autocast(..., dtype=torch.bfloat16) (no loss scale needed), or exclude the module "
            "(exclude=[...]) to train it with opt.step()")
    return x.to(dt), weight.to(dt), None if bias is None else bias.to(dt)


def input_grad(grad_out: torch.Tensor, w: torch.Tensor, x_dtype: torch.dtype) -> torch.Tensor:
    """dX = dY W in W's dtype, returned in X's; no-op casts skipped (host time on the hot path).
    Invariant 1: ``w`` is the weight as it was before this step's update."""
    g = grad_out if grad_out.dtype == w.dtype else grad_out.to(w.dtype)
    dx = g @ w
    return dx if dx.dtype == x_dtype else dx.to(x_dtype)


class SavedOperands(torch.autograd.Function):
    """Saves a fused linear's GEMM operands before the GEMM runs and hands them on (autocast's casts
    made here); its backward passes dX through. Used only while saved-tensor hooks are active.

    Why: a non-reentrant activation checkpoint's recompute stops at the pack of the block's last saved
    tensor. nn.Linear's autograd packs its operands before its GEMM, so the block's last linear is never
    recomputed; an autograd.Function packs what it saved when its forward returns, after the GEMM, so
    FusedLinearFunction alone recomputed that GEMM (Llama-3.1-8B's down_proj: 32 extra 8192x14336x4096
    GEMMs, 4% of a BS=16 step on an H100; NOTES.md thirty-fifth session)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.set_materialize_grads(False)  # the weight's gradient is never formed: no W-sized zeros
        ctx.x_dtype = x.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        x, w, bias = autocast_operands(x, weight, bias)
        ctx.save_for_backward(x, w)
        return x, w, bias

    @staticmethod
    def backward(ctx, dx, dw, db):
        if dx is not None and dx.dtype != ctx.x_dtype:
            dx = dx.to(ctx.x_dtype)
        if db is not None and db.dtype != ctx.bias_dtype:
            db = db.to(ctx.bias_dtype)
        return dx, None, db


class FusedLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, handle, use, operands):
        # operands: SavedOperands' node, which saved (X, W) already and cast them; else this saves them
        ctx.x_dtype = x.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        x, w, bias = (x, weight, bias) if operands is not None else autocast_operands(x, weight, bias)
        if torch.is_autocast_enabled(x.device.type):
            with torch.autocast(x.device.type, enabled=False):
                out = F.linear(x, w, bias)
        else:  # no autocast context to enter and leave: ~10 us less per layer on the host
            out = F.linear(x, w, bias)
        if operands is None:
            ctx.save_for_backward(x, w)
        ctx.handle, ctx.use, ctx.operands = handle, use, operands
        return out

    @staticmethod
    def backward(ctx, grad_out):
        # A plain backward runs this with grad mode off; on only under create_graph=True, whose graph would
        # be differentiated again (a gradient penalty): refused before anything is written.
        if torch.is_grad_enabled():
            raise RuntimeError(
                f"forge_optim: backward with create_graph=True reached the fused linear '{ctx.handle.name}'. "
                "Double backward (a gradient penalty: WGAN-GP, R1, input-gradient regularizers) cannot go "
                "through a fused layer: its backward updates the weight in place and never forms the gradient "
                "a second backward would differentiate. Exclude the module from fusion (exclude=['...'] when "
                "creating the optimizer); nothing was updated")
        ops = ctx.operands
        x, w = ctx.saved_tensors if ops is None else ops.saved_tensors
        dx = db = None
        if ctx.needs_input_grad[0] and (ops is None or ops.needs_input_grad[0]):
            dx = input_grad(grad_out, w, ctx.x_dtype)
        if ctx.needs_input_grad[2] and (ops is None or ops.needs_input_grad[2]):
            if grad_out.dim() == 1:  # an unbatched input: sum(()) would sum over every dimension
                db = grad_out.to(ctx.bias_dtype, copy=True)
            else:
                db = grad_out.sum(tuple(range(grad_out.dim() - 1)), dtype=torch.float32).to(ctx.bias_dtype)
        ctx.handle.consume(grad_out, x, ctx.use)
        return dx, None, db, None, None, None


# autograd.Function.apply is a Python wrapper around the C++ apply that only matters under functorch
# transforms (vmap, grad), which the fused linear refuses anyway, or with a setup_context (this Function
# has none). It costs ~7 us per call on a 2-core CPU, ~25% of a small layer's forward on the host.
_C_APPLY = super(torch.autograd.Function, FusedLinearFunction).apply
_C_APPLY_OPERANDS = super(torch.autograd.Function, SavedOperands).apply


def fused_linear(x, weight, bias, handle):
    """Apply the fused linear; counts this call as a pending use of ``weight`` (invariant 2)."""
    if torch._C._are_functorch_transforms_active():
        raise RuntimeError(
            f"forge_optim: the fused linear '{handle.name}' cannot run under torch.func transforms (vmap, "
            "grad, jacrev, ...) with gradients enabled: its backward updates the weight in place instead of "
            "returning a gradient. Run the transform under torch.no_grad(), or exclude the module "
            "(exclude=[...]) or unpatch the model first")
    use = handle.new_use()
    if torch._C._autograd._top_saved_tensors_default_hooks(False) is not None and torch.is_grad_enabled():
        # saved-tensor hooks (an activation checkpoint, save_on_cpu): pack X and W before the GEMM
        x, weight, bias = _C_APPLY_OPERANDS(x, weight, bias)
        return _C_APPLY(x, weight, bias, handle, use, x.grad_fn)
    return _C_APPLY(x, weight, bias, handle, use, None)


# ----- torch.compile form -------------------------------------------------------------------------
_HANDLES: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
_NEXT_ID = itertools.count(1)


def register_handle(handle) -> int:
    """An integer id for ``handle``: custom ops take ints, not Python objects."""
    hid = next(_NEXT_ID)
    _HANDLES[hid] = handle
    return hid


def _handle(hid: int):
    h = _HANDLES.get(hid)
    if h is None:
        raise RuntimeError(f"forge_optim: fused layer #{hid} has no optimizer any more (was it unpatched?)")
    return h


# The backward op needs no autograd formula, so it is defined at the dispatcher's level rather than
# with custom_op: a call then runs this one Python function, not custom_op's four Python wrappers
# (autograd, inplace-or-view, backend, default filling: ~25 us per fused linear per step).
_LIB = torch.library.Library("forge_optim", "FRAGMENT")
# Both ops run host code every call (use counts; the step's learning rate, bias corrections and random
# keys, passed to the kernel as scalars), which a CUDA graph replay would skip or repeat unchanged.
# cudagraph_unsafe makes inductor's mode="reduce-overhead" keep them out of its CUDA graphs (it graphs
# the code between them, or, where it cannot partition a graph, skips graphing that graph).
_GRAPH_UNSAFE = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()
_LIB.define("fused_linear_backward(Tensor grad_out, Tensor x, Tensor weight, Tensor(a!) weight_alias, "
            "int handle_id, bool needs_dx) -> Tensor", tags=_GRAPH_UNSAFE)


def fused_linear_backward_op(grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                             weight_alias: torch.Tensor, handle_id: int, needs_dx: bool) -> torch.Tensor:
    """dX = dY W with the old W, then the fused update of ``weight_alias`` (the parameter's storage)."""
    dx = input_grad(grad_out, weight, x.dtype) if needs_dx else x.new_empty(0)
    fused_linear_update_op(grad_out, x, dx, weight_alias, handle_id)
    return dx


def _write_back(weight_alias: torch.Tensor, param: torch.Tensor) -> None:
    """The update is written to the parameter's storage, whatever tensor the op was handed. A compiled
    graph that does not reinplace the op's declared mutation hands it a copy of the weight and copies that
    copy back over the weight after the op: without this, the stale copy would erase the update (seen in
    torch 2.13's inductor when the graph reads the weight after a first mutation: a weight used twice)."""
    a, p = dtensor.local(weight_alias), dtensor.local(param)
    if a.data_ptr() != p.data_ptr():
        with torch.no_grad():
            a.copy_(p)


_LIB.impl("fused_linear_backward", fused_linear_backward_op, "CompositeExplicitAutograd")


@torch.library.register_fake("forge_optim::fused_linear_backward")
def _fused_linear_backward_fake(grad_out, x, weight, weight_alias, handle_id, needs_dx):
    return x.new_empty(x.shape) if needs_dx else x.new_empty(0)


# What the traced backward calls since 2026-12-04 (``fused_linear_backward`` stays for graphs compiled and
# cached before): dX is no longer formed inside the op, where it cost a Python matmul per layer, but by the
# traced graph (inductor's GEMM call) and handed in. The op never reads ``dx``: it is there so that the
# GEMM that reads the old W is ordered before the op that writes W (invariant 1), by data dependency.
_LIB.define("fused_linear_update(Tensor grad_out, Tensor x, Tensor? dx, Tensor(a!) weight_alias, int handle_id) -> ()",
            tags=_GRAPH_UNSAFE)


def fused_linear_update_op(grad_out: torch.Tensor, x: torch.Tensor, dx: torch.Tensor | None,
                           weight_alias: torch.Tensor, handle_id: int) -> None:
    """The fused update of ``weight_alias`` (the parameter's storage), after ``dx`` was formed."""
    h = _handle(handle_id)
    h.release_one()
    h.consume(grad_out, x, None)
    _write_back(weight_alias, h.param)


_LIB.impl("fused_linear_update", fused_linear_update_op, "CompositeExplicitAutograd")


@torch.library.register_fake("forge_optim::fused_linear_update")
def _fused_linear_update_fake(grad_out, x, dx, weight_alias, handle_id):
    return None


# One call per compiled forward graph counts the uses of every fused linear the graph computes with
# inductor's GEMM (inductor_pass.py puts it there). ``anchor`` (the first such weight) is read only: it
# gives the call a device. Registered as side-effecting, so no dead-code elimination drops it.
_LIB.define("count_uses(Tensor anchor, int[] handle_ids) -> ()", tags=_GRAPH_UNSAFE)


def count_uses_op(anchor: torch.Tensor, handle_ids: list[int]) -> None:
    for hid in handle_ids:
        _handle(hid).count_use()


_LIB.impl("count_uses", count_uses_op, "CompositeExplicitAutograd")


@torch.library.register_fake("forge_optim::count_uses")
def _count_uses_fake(anchor, handle_ids):
    return None


torch.fx.node.has_side_effect(torch.ops.forge_optim.count_uses.default)


# The forward, in two ops. ``fused_linear`` is what a traced model calls: its Autograd kernel (the
# autograd.Function below) records the backward op. What the compiled forward graph then calls at every
# step is ``linear_counted``, the op that Function runs below autograd: it has no Autograd kernel, so a
# call crosses into Python once (count the use, F.linear), where calling ``fused_linear`` itself went
# through its Python Autograd kernel first (~5 us more per fused linear per step on the host; the
# compiled forward is host-bound at BS=1).
_LIB.define("fused_linear(Tensor x, Tensor weight, Tensor? bias, Tensor weight_alias, int handle_id) -> Tensor",
            tags=_GRAPH_UNSAFE)
_LIB.define("linear_counted(Tensor x, Tensor weight, Tensor? bias, int handle_id) -> Tensor", tags=_GRAPH_UNSAFE)


def linear_counted_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, handle_id: int) -> torch.Tensor:
    _handle(handle_id).count_use()
    return F.linear(x, weight, bias)


_LIB.impl("linear_counted", linear_counted_op, "CompositeExplicitAutograd")


def fused_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, weight_alias: torch.Tensor,
                    handle_id: int) -> torch.Tensor:
    return torch.ops.forge_optim.linear_counted(x, weight, bias, handle_id)


_LIB.impl("fused_linear", fused_linear_op, "CompositeExplicitAutograd")


def _linear_fake(x, weight, bias, *rest):
    # Runs only while torch.compile traces a FORGE model, before inductor compiles the graph: the moment
    # to put the forward's rewrite into inductor's post-grad passes (install() does nothing if it is there).
    from . import inductor_pass

    inductor_pass.install()
    return x.new_empty(*x.shape[:-1], weight.shape[0])


torch.library.register_fake("forge_optim::fused_linear")(_linear_fake)
torch.library.register_fake("forge_optim::linear_counted")(_linear_fake)


# Read when a backward is traced, not when it runs: graphs compiled with either value stay as they were.
_TRACE_DX_IN_GRAPH = True


class _TracedLinearGrad(torch.autograd.Function):
    """The autograd formula of ``forge_optim::fused_linear``: backward is the mutating backward op."""

    @staticmethod
    def forward(ctx, x, weight, bias, weight_alias, handle_id):
        out = torch.ops.forge_optim.linear_counted(x, weight, bias, handle_id)
        ctx.save_for_backward(x, weight, weight_alias)
        ctx.handle_id = handle_id
        ctx.has_bias = bias is not None
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, weight_alias = ctx.saved_tensors
        if not _TRACE_DX_IN_GRAPH:  # the form before 2026-12-04 night (benchmarks/compiled_ab.py compares them)
            needs_dx = ctx.needs_input_grad[0]
            dx = torch.ops.forge_optim.fused_linear_backward(grad_out, x, weight, weight_alias, ctx.handle_id, needs_dx)
            dx = dx if needs_dx else None
        else:
            # dX with the old W, traced (inductor's GEMM), handed to the update op: invariant 1 by data dependency
            dx = input_grad(grad_out, weight, x.dtype) if ctx.needs_input_grad[0] else None
            dy2, x2 = grad_out, x
            if not dtensor.is_dtensor(x):  # 2-D views made in the graph (a reinterpret call each), not two
                dy2 = grad_out.reshape(-1, grad_out.shape[-1])  # reshapes in the op's Python (~0.8 us each)
                x2 = x.reshape(-1, x.shape[-1])
            torch.ops.forge_optim.fused_linear_update(dy2, x2, dx, weight_alias, ctx.handle_id)
        db = None
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = grad_out.reshape(-1, weight.shape[0]).sum(0)
        return dx, None, db, None, None


def _fused_linear_autograd(x, weight, bias, weight_alias, handle_id):
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                    or (bias is not None and bias.requires_grad)):
        return _TracedLinearGrad.apply(x, weight, bias, weight_alias, handle_id)
    return torch.ops.forge_optim.linear_counted(x, weight, bias, handle_id)


_LIB.impl("fused_linear", _fused_linear_autograd, "Autograd")


def fused_linear_traceable(x, weight, bias, weight_alias, handle_id: int):
    """The form torch.compile traces: autocast casts happen here, outside the op, so the op saves
    the operands its gradient is made of."""
    x, weight, bias = autocast_operands(x, weight, bias)
    return torch.ops.forge_optim.fused_linear(x, weight, bias, weight_alias, handle_id)


# ----- the embedding's row-sparse gradient under torch.compile ------------------------------------
# Eager FORGE hands opt.step() an embedding's touched rows (nn.Embedding(sparse=True)); inductor cannot
# hold sparse tensors, so a compiled graph used to form the dense [vocab, dim] gradient instead: on
# Llama-3.1-8B a 2 GiB fp32 zero-fill, its bf16 cast and a gradient read in the dense update (~2-3 ms
# of a BS=1 step). Here the compiled backward calls an opaque op that builds eager's sparse gradient
# from (dY, indices) and accumulates it into ``weight.grad`` as autograd's AccumulateGrad would; the
# traced formula returns no gradient for the weight. (Eager embeddings with a padding row take the same
# formula: torch's own sparse backward syncs the host there.)
_LIB.define("embedding_sparse_grad(Tensor grad_out, Tensor indices, int padding_idx, int handle_id) -> ()",
            tags=_GRAPH_UNSAFE)


def sparse_rows_grad(grad_out: torch.Tensor, indices: torch.Tensor, num_weights: int, padding_idx: int) -> torch.Tensor:
    """The embedding's gradient as ``F.embedding(sparse=True)`` gives it (one entry per token, duplicates not
    summed), but without a host sync: a padding token's entry carries a zero gradient, where torch's
    sparse backward drops it with a boolean mask whose size the host must read back from the GPU. The
    update is the same (the padding row's gradient is zero either way)."""
    idx = indices.reshape(-1).long()
    vals = grad_out.reshape(idx.numel(), grad_out.shape[-1])
    if padding_idx >= 0:
        vals = torch.where((idx != padding_idx).unsqueeze(1), vals, vals.new_zeros(()))
    return torch.sparse_coo_tensor(idx.unsqueeze(0), vals, (num_weights, vals.shape[1]), check_invariants=False)


def embedding_sparse_grad_op(grad_out: torch.Tensor, indices: torch.Tensor, padding_idx: int, handle_id: int) -> None:
    p = _handle(handle_id).param
    g = sparse_rows_grad(grad_out, indices, p.shape[0], padding_idx)
    with torch.no_grad():
        p.grad = g if p.grad is None else p.grad + g


_LIB.impl("embedding_sparse_grad", embedding_sparse_grad_op, "CompositeExplicitAutograd")


@torch.library.register_fake("forge_optim::embedding_sparse_grad")
def _embedding_sparse_grad_fake(grad_out, indices, padding_idx, handle_id):
    return None


torch.fx.node.has_side_effect(torch.ops.forge_optim.embedding_sparse_grad.default)

_LIB.define("embedding(Tensor indices, Tensor weight, int padding_idx, int handle_id) -> Tensor", tags=_GRAPH_UNSAFE)


def embedding_op(indices: torch.Tensor, weight: torch.Tensor, padding_idx: int, handle_id: int) -> torch.Tensor:
    return F.embedding(indices, weight)


_LIB.impl("embedding", embedding_op, "CompositeExplicitAutograd")


@torch.library.register_fake("forge_optim::embedding")
def _embedding_fake(indices, weight, padding_idx, handle_id):
    return weight.new_empty(*indices.shape, weight.shape[1])


class EmbeddingRowsGrad(torch.autograd.Function):
    """The autograd formula of ``forge_optim::embedding`` (compiled, and eager for an embedding with a
    padding row, see ``sparse_rows_grad``): the weight's gradient goes to ``weight.grad`` as a sparse tensor through
    the side-effecting op; autograd gets none."""

    @staticmethod
    def forward(ctx, indices, weight, padding_idx, handle_id):
        ctx.save_for_backward(indices)
        ctx.padding_idx, ctx.handle_id = padding_idx, handle_id
        return F.embedding(indices, weight)  # traced as aten.embedding: inductor fuses the gather

    @staticmethod
    def backward(ctx, grad_out):
        (indices,) = ctx.saved_tensors
        torch.ops.forge_optim.embedding_sparse_grad(grad_out, indices, ctx.padding_idx, ctx.handle_id)
        return None, None, None, None


def _embedding_autograd(indices, weight, padding_idx, handle_id):
    if torch.is_grad_enabled() and weight.requires_grad:
        return EmbeddingRowsGrad.apply(indices, weight, padding_idx, handle_id)
    return F.embedding(indices, weight)


_LIB.impl("embedding", _embedding_autograd, "Autograd")
