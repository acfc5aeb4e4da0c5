"""Tiled PyTorch backend: the reference, and the path for CPUs and any device without Triton.

The gradient is formed ``block_rows`` output rows at a time (one [block_rows, Din] fp32 block is
live at once), the rule is applied to that block and it is dropped. Parameters that are not fused
(embeddings, norms, biases, tied weights) go through :func:`apply_update` with their ``.grad``.
"""
from __future__ import annotations

import torch

from .. import precision
from .base import Backend, UpdateJob, grad_rows, row_chunks


def _offsets(r0: int, r1: int, cols: int, device) -> torch.Tensor:
    return torch.arange(r0 * cols, r1 * cols, device=device, dtype=torch.int64).view(r1 - r0, cols)


def load_state_rows(view, r0: int, r1: int) -> torch.Tensor:
    if view.quantized:
        return precision.dequantize(view.data[r0:r1], view.scale[r0:r1])
    return view.data[r0:r1].float()


def apply_update(job: UpdateJob, g32: torch.Tensor, r0: int = 0, r1: int | None = None) -> None:
    """Apply ``job.rule`` to rows [r0, r1) of the weight given their fp32 gradient ``g32``.

    A coordinate whose gradient is not finite keeps its weight and states (invariant 4).
    """
    w2d = job.weight
    r1 = w2d.shape[0] if r1 is None else r1
    cols = w2d.shape[1]
    if job.grad_buffer is not None:
        g32 = g32 + job.grad_buffer[r0:r1]
    if job.grad_sign != 1.0:
        g32 = g32 * job.grad_sign
    w_block = w2d[r0:r1]
    w32 = w_block.float()
    s32 = [load_state_rows(v, r0, r1) for v in job.states]
    w_new, s_new = job.rule.update(w32, g32, s32, job.coeffs)
    finite = torch.isfinite(g32)
    w_new = torch.where(finite, w_new, w32)
    s_new = [torch.where(finite, new, old) for new, old in zip(s_new, s32)]
    if job.nonfinite is not None:
        job.nonfinite.add_((~finite).sum())
    needs_offsets = (job.stochastic_weight and w2d.dtype == torch.bfloat16) or (
        job.stochastic_state and any(v.data.dtype == torch.bfloat16 for v in job.states))
    offs = _offsets(r0, r1, cols, w2d.device) if needs_offsets else None
    precision.store_float(w_block, w_new, job.stochastic_weight, job.key_weight, offs)
    for view, value, key in zip(job.states, s_new, job.key_states):
        if view.quantized:
            q, scale = precision.quantize(value, view.spec.nonnegative)
            view.data[r0:r1].copy_(q)
            view.scale[r0:r1].copy_(scale)
        elif view.spec.slot in (0, 1):  # the weight's hash: its high half, or its mixed draw (precision)
            draw = precision.DRAW_HIGH if view.spec.slot == 0 else precision.DRAW_MIXED
            precision.store_float(view.data[r0:r1], value, job.stochastic_state, job.key_weight, offs, draw)
        else:
            precision.store_float(view.data[r0:r1], value, job.stochastic_state, key, offs)


class TorchBackend(Backend):
    name = "torch"

    def __init__(self, block_rows: int = 256):
        if block_rows < 1:
            raise ValueError(f"block_rows must be >= 1, got {block_rows}")
        self.block_rows = block_rows

    def _row_blocks(self, rows: int):
        for r0 in range(0, rows, self.block_rows):
            yield r0, min(rows, r0 + self.block_rows)

    @staticmethod
    def _grad_rows(dy32: torch.Tensor, x32: torch.Tensor, r0: int, r1: int) -> torch.Tensor:
        # [r1-r0, Din] fp32: the only gradient memory alive at once
        return dy32[:, r0:r1].t() @ x32

    def update(self, job: UpdateJob, dy: torch.Tensor, x: torch.Tensor) -> None:
        dy32, x32 = dy.float(), x.float()
        for r0, r1 in self._row_blocks(job.weight.shape[0]):
            apply_update(job, self._grad_rows(dy32, x32, r0, r1), r0, r1)

    def accumulate(self, buffer: torch.Tensor, dy: torch.Tensor, x: torch.Tensor) -> None:
        dy32, x32 = dy.float(), x.float()
        for r0, r1 in self._row_blocks(buffer.shape[0]):
            if buffer.dtype == torch.float32:
                buffer[r0:r1].addmm_(dy32[:, r0:r1].t(), x32)
            else:  # a bf16 buffer: the sum in fp32, stored rounded to nearest (as the kernel stores it)
                buffer[r0:r1].copy_(torch.addmm(buffer[r0:r1].float(), dy32[:, r0:r1].t(), x32))

    def update_from_grad(self, job: UpdateJob, grad: torch.Tensor) -> None:
        rows, cols = job.weight.shape
        for r0, r1 in row_chunks(rows, cols):
            apply_update(job, grad_rows(grad, r0, r1), r0, r1)
