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
        old values and gradient, and written over its result: each row gets exactly one update."""
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
            w2d.index_copy_(0, idx, touched.weight)
            for v, t in zip(job.states, touched.states):
                v.data.index_copy_(0, idx, t.data)
                if v.scale is not None:
                    v.scale.index_copy_(0, idx, t.scale)


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
    """A [rows, cols] gradient that is zero outside ``index`` (sorted, unique rows), with ``values``
    [len(index), cols] in fp32: what ``nn.Embedding(sparse=True)`` gives, duplicates summed."""

    def __init__(self, grad: torch.Tensor):
        g = grad.float().coalesce()  # duplicate rows (a token seen twice) summed in fp32
        if g.sparse_dim() != 1 or g.dim() != 2:
            raise ValueError(f"expected a row-sparse 2-D gradient (an embedding's), got sparse_dim="
                             f"{g.sparse_dim()} of a {g.dim()}-D tensor")
        self.index = g.indices()[0]
        self.values = g.values()


def grad_rows(grad: torch.Tensor, r0: int, r1: int) -> torch.Tensor:
    """Rows [r0, r1) of a dense 2-D gradient, as fp32."""
    return grad[r0:r1].float()


def row_chunks(rows: int, cols: int, chunk_elements: int = CHUNK_ELEMENTS):
    step = max(1, chunk_elements // max(cols, 1))
    for r0 in range(0, rows, step):
        yield r0, min(rows, r0 + step)
