"""Tensor/sequence parallelism through PyTorch's DTensor.

A weight sharded by ``ColwiseParallel`` (Shard(0): rows of W) or ``RowwiseParallel`` (Shard(1):
columns of W) has, on each rank, a local gradient ``dY_localᵀ X_local`` that is already the exact
gradient of the local shard (paper, Proposition 2), provided dY and X have the layouts the parallel
styles give them: colwise, dY sharded on its feature axis and X replicated; rowwise, dY replicated and
X sharded on its feature axis. The fused update then runs on local tensors with no communication.

Weights replicated across ranks (data-parallel layouts) get partial gradients and are not fused.
"""
from __future__ import annotations

import torch

try:
    from torch.distributed.tensor import DTensor, Replicate, Shard
except ImportError:  # pragma: no cover - torch without distributed
    DTensor = None


def is_dtensor(t) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if is_dtensor(t) else t


def like(ref: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Wrap a local tensor with ``ref``'s mesh and placements (a plain tensor stays plain)."""
    if not is_dtensor(ref):
        return value
    return DTensor.from_local(value, ref.device_mesh, ref.placements, run_check=False)


def unfusable_reason(weight: torch.Tensor) -> str | None:
    """None when a DTensor weight can be updated from its local gradient; else why not."""
    if not is_dtensor(weight):
        return None
    if weight.device_mesh.ndim != 1:
        return (f"DTensor weight on a {weight.device_mesh.ndim}-D mesh {tuple(weight.placements)}: only 1-D "
                "tensor-parallel meshes are fused; stepped by opt.step()")
    (pl,) = weight.placements
    if isinstance(pl, Shard) and pl.dim in (0, 1):
        return None
    return (f"DTensor weight with placement {pl}: replicated weights get partial (data-parallel) gradients "
            "that DTensor reduces; stepped by opt.step()")


def local_operands(weight: torch.Tensor, dy: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Local dY and X whose product is the exact gradient of the local weight shard."""
    if not is_dtensor(weight):
        return local(dy), local(x)
    (pl,) = weight.placements
    if pl.dim == 0:  # colwise: W rows sharded -> dY sharded on features, X replicated
        want_dy, want_x = Shard(dy.dim() - 1), Replicate()
    else:  # rowwise: W columns sharded -> dY replicated, X sharded on features
        want_dy, want_x = Replicate(), Shard(x.dim() - 1)
    if is_dtensor(dy) and tuple(dy.placements) != (want_dy,):
        dy = dy.redistribute(dy.device_mesh, [want_dy])
    if is_dtensor(x) and tuple(x.placements) != (want_x,):
        x = x.redistribute(x.device_mesh, [want_x])
    return local(dy), local(x)
