"""Which modules are fused, and why the others are not.

A ``nn.Linear`` is fused when its weight is trained by the optimizer and has a single consumer.
Fusing swaps the module's class to :class:`ForgeLinear` (a ``nn.Linear`` subclass: parameters,
state_dict keys, hooks and ``isinstance`` are unchanged); un-fusing swaps it back.
"""
from __future__ import annotations

import fnmatch
import os
import sys
import warnings
from collections import defaultdict

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import dtensor
from .autograd import fused_linear, fused_linear_traceable, register_handle


class ForgeLinear(nn.Linear):
    """An ``nn.Linear`` whose weight is updated inside backward by a forge_optim optimizer."""

    _forge_handle = None

    def forward(self, x):
        h = self._forge_handle
        params = self._parameters  # not self.weight: nn.Module.__getattr__ costs ~0.5 us per access
        try:
            weight, bias = params["weight"], params["bias"]
        except KeyError:
            raise RuntimeError(
                "a forge_optim-fused nn.Linear was parametrized (torch.nn.utils.parametrize) after the "
                "optimizer patched it: its weight is no longer the tensor updated in backward. Register "
                "parametrizations before creating the optimizer (parametrized linears are left unfused "
                "and stepped by opt.step())") from None
        if h is None or not torch.is_grad_enabled() or not weight.requires_grad:
            return F.linear(x, weight, bias)
        if weight is not h.param:
            raise RuntimeError(
                f"forge_optim: the weight of fused linear '{h.name}' was replaced by another Parameter after the "
                "optimizer was created (e.g. tie_weights() tying it to an embedding, or `module.weight = "
                "nn.Parameter(...)`): its in-backward update would go to the old tensor. Create the optimizer "
                "after the model's parameters are final (tied weights are then left to opt.step()), or copy new "
                "values in place (module.weight.data.copy_(...))")
        if torch.compiler.is_compiling():
            return fused_linear_traceable(x, weight, bias, self._forge_weight_alias, h.id)
        return fused_linear(x, weight, bias, h)

    def _apply(self, fn, *args, **kwargs):
        # .to()/.cuda() may give the weight new storage: re-make the alias the compiled form mutates.
        out = super()._apply(fn, *args, **kwargs)
        if "_forge_weight_alias" in self._buffers:
            self._buffers["_forge_weight_alias"] = self.weight.data
        return out

    def extra_repr(self) -> str:
        h = self._forge_handle
        fused = f", fused={h.describe()}" if h is not None else ", fused=None (detached)"
        return super().extra_repr() + fused


def check_not_data_parallel(model: nn.Module) -> None:
    """Refuse data-parallel wrappers: each rank would update with its partial gradient."""
    why = ("forge_optim updates each fused weight inside backward, before data-parallel gradient "
           "reduction, so every rank would apply a different update from its partial gradient "
           "(AdamW is non-linear in the gradient; the result would not be the optimizer's step). "
           "Data parallelism is not supported: train on one GPU, use tensor/sequence parallelism "
           "(the weight is sharded, so each rank's gradient is exact), or use "
           "torch.optim.AdamW(fused=True) for data-parallel training.")
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    if isinstance(model, (DistributedDataParallel, DataParallel)):
        raise ValueError(f"model is wrapped in {type(model).__name__}: {why}")
    fsdp_types = []
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel

        fsdp_types.append(FullyShardedDataParallel)
    except ImportError:  # pragma: no cover
        pass
    try:
        from torch.distributed.fsdp import FSDPModule

        fsdp_types.append(FSDPModule)
    except ImportError:  # pragma: no cover
        pass
    try:  # composable APIs (replicate = DDP, fully_shard = FSDP2) register themselves on the module
        from torch.distributed._composable.contract import _get_registry
    except ImportError:  # pragma: no cover
        _get_registry = None
    for name, mod in model.named_modules():
        if fsdp_types and isinstance(mod, tuple(fsdp_types)):
            raise ValueError(f"module '{name or type(model).__name__}' is sharded by FSDP: {why}")
        registry = _get_registry(mod) if _get_registry is not None else None
        for api in ("replicate", "fully_shard"):
            if registry and api in registry:
                raise ValueError(f"module '{name or type(model).__name__}' uses torch.distributed's {api}(): {why}")


def param_owners(model: nn.Module) -> dict[int, set[int]]:
    """{id(parameter): ids of the modules that hold it}: more than one means a tied weight."""
    owners: dict[int, set[int]] = defaultdict(set)
    for mod in model.modules():
        for p in mod._parameters.values():
            if p is not None:
                owners[id(p)].add(id(mod))
    return owners


_LIBRARY_DIRS = (os.path.dirname(os.path.abspath(__file__)) + os.sep,  # this package
                 os.path.dirname(os.path.abspath(torch.__file__)) + os.sep)


def user_stacklevel() -> int:
    """warnings.warn's stacklevel that names the first caller outside forge_optim and torch (torch wraps
    Optimizer.step in two decorators, so a fixed level would point into torch)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_LIBRARY_DIRS):
        frame, level = frame.f_back, level + 1
    return level


def plan_fusion(model: nn.Module, trained: set[int], exclude) -> tuple[dict, dict]:
    """Returns ({name: linear to fuse}, {name: reason it is not fused}) for every nn.Linear."""
    owners = param_owners(model)
    patterns = [exclude] if isinstance(exclude, str) else list(exclude or ())
    fuse, skip = {}, {}
    matched, example = set(), "lm_head"  # patterns that name at least one nn.Linear; a name, for the warning
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.Linear):
            continue
        hits = [pat for pat in patterns if fnmatch.fnmatchcase(name, pat)]
        matched.update(hits)
        example = name
        if type(mod) not in (nn.Linear, ForgeLinear):
            skip[name] = f"{type(mod).__name__} is a subclass of nn.Linear with its own forward"
        elif isinstance(mod, ForgeLinear) and mod._forge_handle is not None:
            if id(mod.weight) in trained:
                raise ValueError(
                    f"the weight of module '{name}' is already fused by another forge_optim optimizer and is also "
                    "in this one's params: each fused weight is updated inside backward by one optimizer. Leave it "
                    "out of this optimizer's params= (two optimizers over disjoint parameters of one model work), "
                    "or call the other optimizer's unpatch() first")
            # another optimizer's (disjoint params): it stays fused there
            skip[name] = "fused by another forge_optim optimizer"
        elif hits:
            skip[name] = "excluded by the exclude= patterns"
        elif not mod.weight.requires_grad:
            skip[name] = ("frozen (weight.requires_grad is False) when the optimizer was made; if unfrozen later, "
                          "it is stepped by opt.step() from its gradient")
        elif id(mod.weight) not in trained:
            skip[name] = "weight is not in the optimizer's params"
        elif len(owners[id(mod.weight)]) > 1:
            skip[name] = (f"weight is shared by {len(owners[id(mod.weight)])} modules (tied); "
                          "it is stepped by opt.step() after its gradient is complete")
        elif mod.weight.dim() != 2 or mod.weight.is_sparse:
            skip[name] = "weight is not a dense 2-D tensor"
        elif (why := dtensor.unfusable_reason(mod.weight)) is not None:
            skip[name] = why
        else:
            fuse[name] = mod
    for pat in patterns:
        if pat not in matched:
            # most likely a typo, and then the module meant to be excluded is fused
            warnings.warn(f"forge_optim: exclude pattern {pat!r} matches no nn.Linear of the model (patterns are "
                          f"fnmatch patterns on full module names, e.g. {example!r} "
                          "or '*.mlp.*'); nothing was excluded by it", UserWarning, stacklevel=user_stacklevel())
    return fuse, skip


class LiveOnly:
    """A marker that a copy of the model does not carry: deepcopy and pickle give None, so a copied
    (or saved and reloaded) module behaves as the plain torch module it was patched from."""

    def __deepcopy__(self, memo):
        return None

    def __reduce__(self):
        return (type(None), ())


class EmbeddingLink(LiveOnly):
    """What ties a ForgeEmbedding to its optimizer: the id by which its compiled backward op finds the
    weight whose ``.grad`` receives the touched rows (LiveOnly: a copy of the model carries none)."""

    def __init__(self, param: torch.Tensor):
        self.param = param
        self.id = register_handle(self)


class ForgeEmbedding(nn.Embedding):
    """nn.Embedding whose gradient is row-sparse: eager, ``F.embedding(sparse=True)``; compiled, or eager
    with a padding row, the ``forge_optim::embedding`` op, whose backward builds the same sparse gradient
    outside inductor's graph and without torch's host sync for padding tokens. A copy of it
    (copy.deepcopy of the model, e.g. for a torch.optim baseline) gives dense gradients again."""

    _forge_live = None

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        link = self._forge_live
        # the optimizer's own gradient formula (max_norm renormalizes W in forward: left to F.embedding)
        own = link is not None and not self.sparse and self.max_norm is None and link.param is self.weight
        compiling = torch.compiler.is_compiling()
        if own and (compiling or self.padding_idx is not None):
            # compiled: inductor cannot hold the sparse gradient, the op builds it outside the graph; eager
            # with a padding row: torch's sparse backward would drop the padding tokens with a host sync
            # (autograd.sparse_rows_grad)
            pad = -1 if self.padding_idx is None else self.padding_idx
            return torch.ops.forge_optim.embedding(input, self.weight, pad, link.id)
        sparse = self.sparse or (link is not None and not compiling)
        return F.embedding(input, self.weight, self.padding_idx, self.max_norm, self.norm_type,
                           self.scale_grad_by_freq, sparse)


def plan_sparse_embeddings(model: nn.Module, trained: set[int]) -> dict:
    """{name: nn.Embedding} whose gradient can be row-sparse: a dense gradient of a 128256x4096
    vocabulary is 1 GiB of mostly zero rows (a batch touches at most BT of them), the largest
    gradient left in a FORGE step. ``nn.Embedding.sparse = True`` makes autograd hand ``opt.step()``
    only the touched rows; the update still runs over every row (weight decay and moment decay move
    the untouched ones too), so the result is torch.optim's on the dense gradient.

    Left dense: weights shared with another module (a tied lm_head adds a dense gradient anyway),
    frozen or untrained weights, DTensor shards (vocabulary parallelism), already sparse modules,
    ``scale_grad_by_freq=True`` (torch's sparse embedding backward refuses it),
    and subclasses of nn.Embedding (their own forward may not pass ``sparse``). Under torch.compile the
    gradient is built outside inductor's graph (which cannot hold sparse tensors): see :class:`ForgeEmbedding`."""
    owners = param_owners(model)
    out = {}
    for name, mod in model.named_modules():
        if (type(mod) is nn.Embedding and not mod.sparse and not mod.scale_grad_by_freq and mod.weight.requires_grad
                and id(mod.weight) in trained and len(owners[id(mod.weight)]) == 1
                and not dtensor.is_dtensor(mod.weight)):
            out[name] = mod
    return out


def attach(mod: nn.Linear, handle) -> None:
    mod.__class__ = ForgeLinear
    mod._forge_handle = handle
    # Non-persistent: not in state_dict; shares the weight's storage (see autograd.py for why).
    mod.register_buffer("_forge_weight_alias", mod.weight.data, persistent=False)


def detach(mod: nn.Module) -> None:
    if isinstance(mod, ForgeLinear):
        mod.__dict__.pop("_forge_handle", None)
        mod._buffers.pop("_forge_weight_alias", None)
        mod.__class__ = nn.Linear


def unpatch(model: nn.Module) -> int:
    """Turn every ForgeLinear of ``model`` back into a plain nn.Linear (and every ForgeEmbedding into
    an nn.Embedding with a dense gradient, as torch.optim needs); returns how many linears."""
    n = 0
    for mod in model.modules():
        if isinstance(mod, ForgeLinear):
            h = mod._forge_handle
            if h is not None:
                h.detach()
            detach(mod)
            n += 1
        elif type(mod) is ForgeEmbedding:
            mod.__class__ = nn.Embedding
            mod.__dict__.pop("_forge_live", None)
    return n
