"""The one interface every backend implements.

A backend receives, for one fused weight in one step, the upstream gradient ``dy`` [BT, Dout],
the layer input ``x`` [BT, Din] and an :class:`UpdateJob` describing the weight, its states and the
rule. It must update ``job.weight`` and the states in place without ever materializing the full
[Dout, Din] gradient (the torch backend works in row blocks, the Triton one in register tiles).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .. import precision
from ..rules.base import Rule, StateSpec


@dataclass
class StateView:
    """One element-wise state of a weight, in its storage format.

    ``data`` has the weight's 2-D shape: fp32 or bf16 values, or int8/uint8 codes. For int8 mode
    ``scale`` holds one absmax scale per 64 contiguous elements of a row: [rows, ceil(cols/64)], bf16
    (``precision.SCALE_DTYPE``, rounded up from absmax/qmax).
    """

    spec: StateSpec
    data: torch.Tensor
    scale: torch.Tensor | None = None

    @property
    def quantized(self) -> bool:
        return self.scale is not None

    def rows(self, r0: int, r1: int) -> "StateView":
        """The state of weight rows [r0, r1): views of data and scales, no copy."""
        return StateView(self.spec, self.data[r0:r1], None if self.scale is None else self.scale[r0:r1])


@dataclass
class UpdateJob:
    weight: torch.Tensor  # 2-D [Dout, Din], fp32 or bf16, updated in place
    rule: type[Rule]
    coeffs: tuple  # the rule's coefficients padded to NUM_COEFFS floats
    states: list[StateView] = field(default_factory=list)  # ordered by slot
    grad_sign: float = 1.0  # -1.0 under maximize=True
    grad_buffer: torch.Tensor | None = None  # [Dout, Din] gradient (fp32, or bf16 from update_from_grad) added to this one
    stochastic_weight: bool = False  # stochastic rounding for a bf16 weight store
    stochastic_state: bool = False  # stochastic rounding for bf16 state stores
    key_weight: int = 0  # hash keys (precision.stream_key), one per store site
    key_states: tuple = (0, 0, 0)  # one per entry of ``states``, in that order
    nonfinite: torch.Tensor | None = None  # int64 scalar on the weight's device: skipped coordinates, added to


class Backend:
    """Computes a weight's gradient tile by tile and applies ``job.rule`` to each tile."""

    name = "base"

    def update(self, job: UpdateJob, dy: torch.Tensor, x: torch.Tensor) -> None:
        raise NotImplementedError

    def accumulate(self, buffer: torch.Tensor, dy: torch.Tensor, x: torch.Tensor) -> None:
        """buffer (fp32 [Dout, Din]) += dy^T x, without allocating another weight-sized tensor."""
        raise NotImplementedError

    def update_from_grad(self, job: UpdateJob, grad: torch.Tensor) -> None:
        """Apply ``job.rule`` given an existing gradient (a parameter that is not fused: embeddings,
        norms, tied weights, or an accumulation buffer flushed by ``opt.step()``)."""
        raise NotImplementedError

    def update_from_row_sparse(self, job: UpdateJob, grad: "RowSparseGrad") -> None:
        """The update on a row-sparse gradient without densifying it. Every row is updated once with a
        zero gradient (weight decay and moment decay move untouched rows too): one update over the
        table, no gradient tensor. The touched rows are gathered *before* it, updated from their
        old values and gradient, and written over its result: each row gets exactly one update.
        No host sync: the slots after the touched rows repeat the first one (``grad.valid`` False,
        zero gradient) and are given that row's result before the scatter, so they write its bits."""
        idx = grad.index
        w2d = job.weight
        touched = UpdateJob(
            weight=w2d.index_select(0, idx), rule=job.rule, coeffs=job.coeffs,
            states=[StateView(v.spec, v.data.index_select(0, idx), None if v.scale is None else v.scale.index_select(0, idx))
                    for v in job.states],
            grad_sign=job.grad_sign, stochastic_weight=job.stochastic_weight, stochastic_state=job.stochastic_state,
            # the gathered rows' offsets restart at 0: their own random stream
            key_weight=precision.site_key(job.key_weight, precision.SITE_GATHERED),
            key_states=tuple(precision.site_key(k, precision.SITE_GATHERED) for k in job.key_states),
            nonfinite=job.nonfinite)
        self.update(job, *no_tokens(w2d))
        if idx.numel():
            self.update_from_grad(touched, grad.values)
            keep = grad.valid[:, None]

            def settled(t: torch.Tensor) -> torch.Tensor:
                return torch.where(keep, t, t[:1])  # a repeated slot takes the first touched row's result

            w2d.index_copy_(0, idx, settled(touched.weight))
            for v, t in zip(job.states, touched.states):
                v.data.index_copy_(0, idx, settled(t.data))
                if v.scale is not None:
                    v.scale.index_copy_(0, idx, settled(t.scale))


def no_tokens(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """dY [0, rows] and X [0, cols] for ``weight``: an update with them has a zero gradient (plus the
    job's gradient buffer, if any), i.e. the element-wise update alone."""
    dtype = weight.dtype if weight.dtype in (torch.float32, torch.bfloat16) else torch.float32
    rows, cols = weight.shape
    return weight.new_empty((0, rows), dtype=dtype), weight.new_empty((0, cols), dtype=dtype)


# Rows per chunk when a whole gradient is given: ~16M elements, so temporaries stay ~64 MiB each
# and a 128256 x 4096 embedding takes 32 chunks, not 500 (launch-bound) or 1 (10 GiB of temporaries).
CHUNK_ELEMENTS = 1 << 24


class RowSparseGrad:
    """A [rows, cols] gradient that is zero outside the touched rows, from a sparse COO tensor (what
    ``nn.Embedding(sparse=True)`` gives: one entry per token, duplicates not summed).

    ``index`` [n] (n = the entries given, a host-known size): the touched rows, sorted and unique, in its
    first slots; every slot after them repeats ``index[0]``. ``values`` [n, cols] fp32: each touched row's
    gradient summed in fp32 in entry order (as ``coalesce()`` sums), zero in the repeated slots. ``valid``
    [n]: the slot holds a touched row. Built without asking the device how many rows were touched:
    ``coalesce()`` would (a host sync that waits for the whole backward before the step can queue)."""

    def __init__(self, grad: torch.Tensor):
        if not grad.is_sparse or grad.sparse_dim() != 1 or grad.dim() != 2:
            raise ValueError(f"expected a row-sparse 2-D gradient (an embedding's), got a {grad.layout} "
                             f"{grad.dim()}-D tensor" + (f" with sparse_dim={grad.sparse_dim()}" if grad.is_sparse else ""))
        idx, vals = grad._indices()[0], grad._values().float()
        n = idx.numel()
        if n == 0:
            self.index, self.values = idx, vals.reshape(0, grad.shape[1])
            self.valid = torch.zeros(0, dtype=torch.bool, device=idx.device)
            return
        rows, order = torch.sort(idx, stable=True)
        first = torch.ones_like(rows, dtype=torch.bool)
        first[1:] = rows[1:] != rows[:-1]
        seg = torch.cumsum(first, 0) - 1  # each entry's slot
        lengths = torch.zeros_like(seg).index_add_(0, seg, torch.ones_like(seg))
        self.values = torch.segment_reduce(vals[order], "sum", lengths=lengths, axis=0, unsafe=True)
        self.index = rows[:1].repeat(n).scatter_(0, seg, rows)  # (entries of one slot write the same row)
        self.valid = lengths > 0


def grad_rows(grad: torch.Tensor, r0: int, r1: int) -> torch.Tensor:
    """Rows [r0, r1) of a dense 2-D gradient, as fp32."""
    return grad[r0:r1].float()


def row_chunks(rows: int, cols: int, chunk_elements: int = CHUNK_ELEMENTS):
    step = max(1, chunk_elements // max(cols, 1))
    for r0 in range(0, rows, step):
        yield r0, min(rows, r0 + step)
