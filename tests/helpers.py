"""Shared test models and the (forge optimizer, torch.optim reference) pairs."""
from __future__ import annotations

import copy
import importlib.util
import sys
from pathlib import Path

import torch
import torch.nn as nn

import forge_optim

from reference_optimizers import ReferenceLion

# (forge class name, kwargs, reference factory); kwargs include every knob the test varies.
CASES = {
    "AdamW": (dict(lr=1e-2, weight_decay=0.1), lambda ps, **kw: torch.optim.AdamW(ps, foreach=False, **kw)),
    "Adam": (dict(lr=1e-2, weight_decay=0.1), lambda ps, **kw: torch.optim.Adam(ps, foreach=False, **kw)),
    "NAdam": (dict(lr=1e-2, weight_decay=0.1), lambda ps, **kw: torch.optim.NAdam(ps, foreach=False, **kw)),
    "NAdam-decoupled": (dict(lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True),
                        lambda ps, **kw: torch.optim.NAdam(ps, foreach=False, **kw)),
    "RAdam": (dict(lr=1e-2, weight_decay=0.1), lambda ps, **kw: torch.optim.RAdam(ps, foreach=False, **kw)),
    "RAdam-decoupled": (dict(lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True),
                        lambda ps, **kw: torch.optim.RAdam(ps, foreach=False, **kw)),
    "Lion": (dict(lr=1e-3, weight_decay=0.1), lambda ps, **kw: ReferenceLion(ps, **kw)),
    "RMSprop": (dict(lr=1e-3, weight_decay=0.1), lambda ps, **kw: torch.optim.RMSprop(ps, foreach=False, **kw)),
    "RMSprop-centered-momentum": (dict(lr=1e-3, weight_decay=0.1, momentum=0.9, centered=True),
                                  lambda ps, **kw: torch.optim.RMSprop(ps, foreach=False, **kw)),
    "Adagrad": (dict(lr=1e-2, weight_decay=0.1, lr_decay=0.01, initial_accumulator_value=0.1),
                lambda ps, **kw: torch.optim.Adagrad(ps, foreach=False, **kw)),
    "SGD": (dict(lr=1e-2, weight_decay=0.1), lambda ps, **kw: torch.optim.SGD(ps, foreach=False, **kw)),
    "SGD-momentum": (dict(lr=1e-2, weight_decay=0.1, momentum=0.9, dampening=0.1),
                     lambda ps, **kw: torch.optim.SGD(ps, foreach=False, **kw)),
    "SGD-nesterov": (dict(lr=1e-2, weight_decay=0.1, momentum=0.9, nesterov=True),
                     lambda ps, **kw: torch.optim.SGD(ps, foreach=False, **kw)),
}


def forge_class(case: str):
    return getattr(forge_optim, case.split("-")[0])


class TinyNet(nn.Module):
    """Embedding -> Linear -> norm -> Linear(no bias) -> head: fused and unfused parameters."""

    def __init__(self, vocab=11, d=24, hidden=40):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.up = nn.Linear(d, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.down = nn.Linear(hidden, d, bias=False)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx):
        h = self.emb(idx)
        h = h + self.down(torch.tanh(self.norm(self.up(h))))
        return self.head(h)


class ReusedLinear(nn.Module):
    """One linear called twice per forward (the same weight used twice), then a second one."""

    def __init__(self, width: int = 8, out: int = 4):
        super().__init__()
        self.a, self.b = nn.Linear(width, width), nn.Linear(width, out, bias=False)

    def forward(self, x):
        return self.b(torch.tanh(self.a(torch.tanh(self.a(x)))))


def batches(n, seed=1, vocab=11, bs=3, seq=5):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, vocab, (bs, seq), generator=g), torch.randint(0, vocab, (bs, seq), generator=g))
            for _ in range(n)]


def loss_fn(model, batch):
    idx, tgt = batch
    logits = model(idx)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1))


def step_both(model, ref_model, opt, ref, n=4, loss=loss_fn, data=None):
    """Train ``model`` with ``opt`` and ``ref_model`` with ``ref`` on the same batches (``data``, or
    ``batches(n)``); ``opt`` or ``ref`` may be a list of optimizers over disjoint parts of one model."""
    for batch in batches(n) if data is None else data:
        for m, opts in ((model, opt), (ref_model, ref)):
            loss(m, batch).backward()
            for o in opts if isinstance(opts, (list, tuple)) else (opts,):
                o.step()
                o.zero_grad()


def twin(seed=0, factory=TinyNet, **kw):
    torch.manual_seed(seed)
    a = factory(**kw)
    return a, copy.deepcopy(a)


def rel_diff(a: nn.Module, b: nn.Module) -> float:
    worst = 0.0
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        worst = max(worst, ((p.float() - q.float()).abs().max() / q.float().abs().max().clamp_min(1e-30)).item())
    return worst


def adam_bound(noise: float, tol: float = 1e-5, factor: float = 4.0) -> float:
    """The allowed FORGE-vs-torch.optim gap after several Adam steps of a whole model.

    Step 1 differs by round-off only (~1e-7 of max|W|). From step 2 on, that ulp of difference in W
    changes the next gradients by round-off, and Adam's normalization turns round-off in a
    near-zero gradient coordinate into a step of up to lr: the gap jumps to ~1e-5 of max|W| for
    torch.optim's own fused vs single-tensor AdamW as well. So the bound is the larger of ``tol``
    and ``factor`` times that torch-vs-torch gap (``noise``), measured on the same model and data.
    """
    return max(tol, factor * noise)


def states_snapshot(opt) -> dict:
    """A copy of every optimizer state, to check later that a refused call changed none of them."""
    return {id(p): {k: v.clone() if torch.is_tensor(v) else v for k, v in st.items()} for p, st in opt.state.items()}


def assert_states_unchanged(opt, saved: dict) -> None:
    """The same parameters have states as in ``saved`` (``states_snapshot``), each equal to the copy."""
    assert {id(p) for p in opt.state} == set(saved)
    for p, st in opt.state.items():
        for k, v in st.items():
            assert torch.equal(v, saved[id(p)][k]) if torch.is_tensor(v) else v == saved[id(p)][k], k


def unbatched_and_empty_batches_match_torch(backend: str) -> None:
    """Shared by the torch-backend test here and the Triton one (interpreter): an unbatched 1-D input
    and an empty batch, through a linear with a bias, step as torch.optim.AdamW does (an empty batch is
    a zero gradient: decay and moment decay only)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    ref_model = copy.deepcopy(model)
    opt = forge_optim.AdamW(model, lr=1e-2, weight_decay=0.1, backend=backend)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    step_both(model, ref_model, opt, ref, loss=lambda m, x: m(x).square().sum(),
              data=(torch.randn(2, 4), torch.randn(4), torch.randn(0, 4), torch.randn(1, 0, 4), torch.randn(3, 4)))
    assert opt.fused_modules() == {"": model}
    assert rel_diff(model, ref_model) < 1e-6


def bf16_accumulation_matches_reference(backend: str, device: str = "cpu") -> None:
    """accumulate_dtype="bf16": after two micro-steps inside ``opt.accumulate()`` each fused layer's buffer is
    bf16 and holds the micro-step gradients summed as torch's bf16 ``.grad`` sums them (fp32 sum of the
    buffer and the new gradient, rounded to nearest: within one bf16 step of that reference, which
    differs only by the GEMM's summation order); the final backward applies AdamW to the buffer plus the
    last gradient, which equals torch.optim.AdamW given that gradient, to fp32 round-off."""
    model, ref_model = (m.to(device) for m in twin())
    opt = forge_optim.AdamW(model, lr=1e-2, weight_decay=0.1, backend=backend, accumulate_dtype="bf16")
    data = [tuple(t.to(device) for t in b) for b in batches(3)]
    fused = {n: m.weight for n, m in opt.fused_modules().items()}
    for b in data[:2]:
        with opt.accumulate():
            loss_fn(model, b).backward()
    bufs = {n: opt._handles[n].buffer.clone() for n in fused}
    assert all(b.dtype == torch.bfloat16 for b in bufs.values())
    grads = []  # each micro-batch's exact gradients, from the reference model (weights unchanged so far)
    for b in data:
        ref_model.zero_grad()
        loss_fn(ref_model, b).backward()
        grads.append({n: p.grad.clone() for n, p in ref_model.named_parameters()})
    for n in fused:
        expected = grads[0][n + ".weight"].to(torch.bfloat16)
        expected = (expected.float() + grads[1][n + ".weight"]).to(torch.bfloat16).float()
        assert ((bufs[n].float() - expected).abs() <= 2.0 ** -7 * expected.abs() + 1e-30).all(), n
        # rounded to nearest, not truncated: a summation-order difference flips only the odd near-tie
        assert (bufs[n].float() == expected).float().mean() > 0.9, (n, (bufs[n].float() == expected).float().mean())
    loss_fn(model, data[2]).backward()  # the final micro-step: one update with the buffer + this gradient
    opt.step()
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    for n, p in ref_model.named_parameters():
        module = n.rsplit(".", 1)[0]
        if module in fused and n.endswith("weight"):
            p.grad = bufs[module].float() + grads[2][n]
        else:
            p.grad = (grads[0][n] + grads[1][n]) + grads[2][n]
    ref.step()
    assert all(opt._handles[n].buffer is None for n in fused)
    assert rel_diff(model, ref_model) <= 1e-5


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str):
    """benchmarks/<name>.py as a module (the scripts are not a package). Their folder goes on sys.path first, as
    when they run: some import their neighbours (bench_kernel, pp_table, results_path)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses and pickling look the module up by name
    spec.loader.exec_module(mod)
    return mod
