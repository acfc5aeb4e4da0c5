"""fp32 state on fp32 weights: every forge optimizer equals torch.optim (or the Lion reference)."""
import pytest
import torch

import forge_optim
from helpers import CASES, batches, forge_class, loss_fn, rel_diff, step_both, twin

TOL = 1e-5


def run_pair(case, kwargs, steps=6, groups=False, scheduler=False):
    model, ref_model = twin()
    fkw, ref_factory = CASES[case]
    fkw = dict(fkw, **kwargs)
    if groups:  # no weight decay on norms and biases: the fused layers use their own group's values
        def split(m):
            decay = [p for n, p in m.named_parameters() if p.dim() >= 2]
            rest = [p for n, p in m.named_parameters() if p.dim() < 2]
            return [{"params": decay}, {"params": rest, "weight_decay": 0.0, "lr": fkw["lr"] * 0.5}]
        opt = forge_class(case)(model, params=split(model), **fkw)
        ref = ref_factory(split(ref_model), **fkw)
    else:
        opt = forge_class(case)(model, **fkw)
        ref = ref_factory(ref_model.parameters(), **fkw)
    assert set(opt.fused_modules()) == {"up", "down", "head"}
    scheds = []
    if scheduler:
        scheds = [torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=steps) for o in (opt, ref)]
    for batch in batches(steps):
        for m, o in ((model, opt), (ref_model, ref)):
            loss_fn(m, batch).backward()
            o.step()
            o.zero_grad()
        for s in scheds:
            s.step()
    return model, ref_model, opt


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("wd", [True, False], ids=["wd", "no-wd"])
def test_matches_reference(case, wd):
    model, ref_model, _ = run_pair(case, {} if wd else {"weight_decay": 0.0})
    assert rel_diff(model, ref_model) <= TOL


@pytest.mark.parametrize("case", ["AdamW", "NAdam", "RAdam", "Lion", "RMSprop-centered-momentum", "Adagrad",
                                  "SGD-nesterov", "Adam"])
def test_matches_reference_with_scheduler_and_two_groups(case):
    model, ref_model, opt = run_pair(case, {}, steps=5, groups=True, scheduler=True)
    assert rel_diff(model, ref_model) <= TOL
    assert opt.param_groups[1]["weight_decay"] == 0.0


def test_maximize_matches_torch():
    model, ref_model = twin()
    opt = forge_optim.AdamW(model, lr=1e-2, maximize=True)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, maximize=True, foreach=False)
    for batch in batches(3):
        for m, o in ((model, opt), (ref_model, ref)):
            loss_fn(m, batch).backward(); o.step(); o.zero_grad()
    assert rel_diff(model, ref_model) <= TOL


def test_adam_decoupled_is_adamw():
    model, ref_model = twin()
    opt = forge_optim.Adam(model, lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    for batch in batches(3):
        for m, o in ((model, opt), (ref_model, ref)):
            loss_fn(m, batch).backward(); o.step(); o.zero_grad()
    assert rel_diff(model, ref_model) <= TOL


def test_small_block_rows_is_still_exact():
    model, ref_model = twin()
    opt = forge_optim.AdamW(model, lr=1e-2, block_rows=3)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, foreach=False)
    for batch in batches(3):
        for m, o in ((model, opt), (ref_model, ref)):
            loss_fn(m, batch).backward(); o.step(); o.zero_grad()
    assert rel_diff(model, ref_model) <= TOL


def test_two_optimizers_over_disjoint_parameters_of_one_model():
    """forge AdamW on the first half and forge Lion on the rest of one model (each with its own
    params=) fuse their own linears and leave the other's alone; together they equal torch.optim.AdamW
    plus the reference Lion on the same split. Unpatching one leaves the other's layers fused."""
    model, ref_model = twin()

    def split(m):
        first = [p for n, p in m.named_parameters() if n.startswith(("emb", "up", "norm"))]
        return first, [p for n, p in m.named_parameters() if not n.startswith(("emb", "up", "norm"))]

    (adamw_kw, adamw_ref), (lion_kw, lion_ref) = CASES["AdamW"], CASES["Lion"]
    a, b = split(model)
    opts = [forge_optim.AdamW(model, params=a, **adamw_kw), forge_optim.Lion(model, params=b, **lion_kw)]
    ra, rb = split(ref_model)
    refs = [adamw_ref(ra, **adamw_kw), lion_ref(rb, **lion_kw)]
    assert set(opts[0].fused_modules()) == {"up"} and set(opts[1].fused_modules()) == {"down", "head"}
    assert opts[1].unfused_linears()["up"] == "fused by another forge_optim optimizer"
    step_both(model, ref_model, opts, refs, n=5)
    assert rel_diff(model, ref_model) < TOL
    opts[0].unpatch()  # "up" is then stepped by opts[0].step() from its .grad, the same update
    assert set(opts[1].fused_modules()) == {"down", "head"} and not opts[0].fused_modules()
    assert type(model.up) is torch.nn.Linear and model.down._forge_handle is opts[1]._handles["down"]
    step_both(model, ref_model, opts, refs, data=batches(2, seed=7))
    assert rel_diff(model, ref_model) < TOL
