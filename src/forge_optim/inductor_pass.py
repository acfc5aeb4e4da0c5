"""Inductor's view of the fused linear's forward: its own GEMM per layer, one use-count call per graph.

A compiled FORGE forward calls ``forge_optim::linear_counted`` once per fused linear: a crossing into
Python (count the use, then F.linear). This post-grad pass rewrites each such call in a forward graph as
the GEMM F.linear is (``mm``/``addmm`` on a 2-D view) and counts all of them in one
``forge_optim::count_uses`` call before the first: one Python crossing per graph instead of per layer.
Measured in one process on the H200 (benchmarks/compiled_ab.py, NOTES.md fourteenth session), the per-layer
ops cost only 5-10 us each, so this is tidiness, not a speed lever; it keeps inductor's own GEMM in view.

What it leaves alone, so the op path (always correct) runs instead:
- graphs that also hold a fused backward op (activation-checkpoint recompute inside a compiled
  backward): there a use is counted only if none is pending at that moment, so counts must stay in order
  with the updates;
- calls with symbolic shapes, a non-contiguous input, or operands of different dtypes.

``install()`` chains the pass in front of any ``post_grad_custom_pre_pass`` already set, and gives
inductor's caches a key (``uuid``). Set ``FORGE_OPTIM_INDUCTOR_PASS=0`` to leave inductor's config alone.
"""
from __future__ import annotations

import hashlib
import math
import os

import torch
from torch._inductor import config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass

aten = torch.ops.aten


def _static_shape(t) -> bool:
    return all(isinstance(s, int) for s in t.shape)


def _rewritable(node: torch.fx.Node) -> bool:
    x, w, b = node.args[0], node.args[1], node.args[2]
    vals = [getattr(a, "meta", {}).get("val") for a in (x, w) + ((b,) if b is not None else ())]
    if any(not isinstance(v, torch.Tensor) for v in vals):
        return False
    xv, wv = vals[0], vals[1]
    return (all(_static_shape(v) for v in vals) and xv.dim() >= 1 and wv.dim() == 2 and xv.is_contiguous()
            and xv.dtype == wv.dtype and all(v.device == xv.device for v in vals)
            and (b is None or (vals[2].dtype == xv.dtype and vals[2].dim() == 1)))


def _call(graph: torch.fx.Graph, op, args, fake_mode):
    node = graph.call_function(op, args)
    with fake_mode:
        node.meta["val"] = op(*[a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in args])
    return node


def _replace_with_gemm(graph: torch.fx.Graph, node: torch.fx.Node) -> None:
    """out = F.linear(x, w, b) as ATen computes it for a contiguous input: x viewed 2-D, mm (addmm with a
    bias), viewed back."""
    x, w, b = node.args[0], node.args[1], node.args[2]
    xv, wv = x.meta["val"], w.meta["val"]
    fake_mode = torch._guards.detect_fake_mode([xv, wv])
    dout, din = wv.shape
    lead = list(xv.shape[:-1])
    with graph.inserting_before(node):
        wt = _call(graph, aten.permute.default, (w, [1, 0]), fake_mode)
        x2 = x if xv.dim() == 2 else _call(graph, aten.view.default, (x, [math.prod(lead), din]), fake_mode)
        mm = (_call(graph, aten.addmm.default, (b, x2, wt), fake_mode) if b is not None
              else _call(graph, aten.mm.default, (x2, wt), fake_mode))
        out = mm if xv.dim() == 2 else _call(graph, aten.view.default, (mm, lead + [dout]), fake_mode)
    node.replace_all_uses_with(out)
    graph.erase_node(node)


def rewrite_forward_linears(graph: torch.fx.Graph) -> int:
    """The pass itself; returns how many fused linears now run as inductor's GEMM."""
    ops = torch.ops.forge_optim
    counted = ops.linear_counted.default
    backward_ops = (ops.fused_linear_update.default, ops.fused_linear_backward.default)
    nodes, in_backward = [], False
    for n in graph.nodes:
        if n.op == "call_function":
            if n.target is counted:
                nodes.append(n)
            elif n.target in backward_ops:
                in_backward = True
    if in_backward:
        return 0
    nodes = [n for n in nodes if _rewritable(n)]
    if not nodes:
        return 0
    with graph.inserting_before(nodes[0]):
        graph.call_function(ops.count_uses.default, (nodes[0].args[1], [int(n.args[3]) for n in nodes]))
    for n in nodes:
        _replace_with_gemm(graph, n)
    return len(nodes)


def _source_hash() -> str:
    with open(__file__, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


class FusedLinearPass(CustomGraphPass):
    """``rewrite_forward_linears``, then whatever pass was configured before (``inner``)."""

    def __init__(self, inner=None):
        self.inner = inner

    def _inner_passes(self) -> list:
        inner = self.inner
        return [] if inner is None else list(inner) if isinstance(inner, (list, tuple)) else [inner]

    def __call__(self, graph: torch.fx.Graph) -> None:
        rewrite_forward_linears(graph)
        for p in self._inner_passes():
            p(graph)

    def uuid(self):
        inner = []
        for p in self._inner_passes():
            u = p.uuid() if hasattr(p, "uuid") else None
            if u is None:
                return None  # a pass inductor cannot key: no caching, as inductor does for it alone
            inner.append(u)
        return ("forge_optim.inductor_pass", _source_hash(), tuple(inner))


def install() -> bool:
    """Put the pass into inductor's ``post_grad_custom_pre_pass`` (once; chained with a pass already set)."""
    if os.environ.get("FORGE_OPTIM_INDUCTOR_PASS", "1") == "0":
        return False
    current = inductor_config.post_grad_custom_pre_pass
    if isinstance(current, FusedLinearPass):
        return True
    inductor_config.post_grad_custom_pre_pass = FusedLinearPass(current)
    return True
