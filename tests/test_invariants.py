"""DESIGN.md invariants 1-5 and the promise that no weight-sized gradient is ever allocated."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import forge_optim
from helpers import (TinyNet, assert_states_unchanged, batches, loss_fn, rel_diff, states_snapshot, step_both, twin,
                     unbatched_and_empty_batches_match_torch)

TOL = 1e-5


def test_weight_updated_when_backward_returns_and_grad_stays_none():
    model, _ = twin()
    opt = forge_optim.AdamW(model, lr=1e-2)
    before = {n: m.weight.detach().clone() for n, m in opt.fused_modules().items()}
    loss_fn(model, batches(1)[0]).backward()
    for name, mod in opt.fused_modules().items():
        assert mod.weight.grad is None, name
        assert not torch.equal(mod.weight, before[name]), f"{name} not updated inside backward"
    assert model.emb.weight.grad is not None  # unfused parameters keep torch's behaviour


def test_dx_uses_the_weight_from_before_the_update():
    lin = nn.Linear(7, 5)
    w_old = lin.weight.detach().clone()
    forge_optim.SGD(lin, lr=0.5)
    x = torch.randn(3, 7, requires_grad=True)
    dy = torch.randn(3, 5)
    lin(x).backward(dy)
    torch.testing.assert_close(x.grad, dy @ w_old, rtol=0, atol=1e-6)
    torch.testing.assert_close(lin.weight.detach(), w_old - 0.5 * dy.t() @ x.detach(), rtol=0, atol=1e-6)


def test_torch_func_transforms_are_refused_by_name():
    """The fused linear calls the C++ autograd apply directly (no Python wrapper: host time). Under
    torch.func transforms it refuses with the module's name and the way out, before touching the weight
    (torch's own message would ask for a setup_context)."""
    lin = nn.Sequential(nn.Linear(7, 5))
    forge_optim.AdamW(lin, lr=1e-2)
    w0 = lin[0].weight.detach().clone()
    x = torch.randn(3, 7)
    with pytest.raises(RuntimeError, match="fused linear '0' cannot run under torch.func"):
        torch.func.grad(lambda t: lin(t).sum())(x)
    assert torch.equal(lin[0].weight.detach(), w0)
    with torch.no_grad():  # inference under vmap runs unfused
        torch.testing.assert_close(torch.func.vmap(lin)(x.unsqueeze(1)).squeeze(1), lin(x))


def test_parametrized_linear_is_unfused_and_late_parametrization_is_refused():
    """A linear parametrized before the optimizer is left to opt.step() (its weight is computed); one
    parametrized after patching no longer has the weight the optimizer updates: a clear error, and the
    weight is not touched."""
    from torch.nn.utils import parametrize

    class Sym(nn.Module):
        def forward(self, w):
            return w.triu() + w.triu(1).t()

    early = nn.Sequential(nn.Linear(6, 6))
    parametrize.register_parametrization(early[0], "weight", Sym())
    opt = forge_optim.AdamW(early, lr=1e-2)
    assert "0" in opt.unfused_linears() and not opt.fused_modules()
    late = nn.Sequential(nn.Linear(6, 6))
    forge_optim.AdamW(late, lr=1e-2)
    w0 = late[0].weight.detach().clone()
    parametrize.register_parametrization(late[0], "weight", Sym())
    with pytest.raises(RuntimeError, match="parametrized .* after the optimizer patched it"):
        late(torch.randn(2, 6))
    assert torch.equal(late[0].parametrizations.weight.original.detach(), w0)


class _AllocRecorder(TorchDispatchMode):
    """Records (element count, dtype, op) of every tensor an op returns: by default only new storages
    (outputs that alias no input); ``views_too=True`` records every output. A sparse result counts
    its values."""

    def __init__(self, views_too: bool = False):
        super().__init__()
        self.views_too = views_too
        self.sizes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
               if isinstance(t, torch.Tensor) and not t.is_sparse}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            if t.is_sparse:
                self.sizes.append((t._values().numel(), t.dtype, str(func)))
            elif self.views_too or t.untyped_storage().data_ptr() not in ins:
                self.sizes.append((t.numel(), t.dtype, str(func)))
        return out


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16", "int8"])
def test_no_weight_sized_gradient_is_allocated(state_dtype):
    dout, din, block = 96, 80, 16
    lin = nn.Linear(din, dout, bias=False)
    opt = forge_optim.AdamW(lin, lr=1e-3, block_rows=block, state_dtype=state_dtype)
    x = torch.randn(4, din)  # activations far smaller than the weight
    loss_fn_ = lambda: lin(x).square().sum()
    loss_fn_().backward()  # first step allocates the states (weight-sized by design)
    rec = _AllocRecorder()
    loss = loss_fn_()
    with rec:
        loss.backward()
    biggest = max(rec.sizes, key=lambda s: s[0])
    padded_din = -(-din // 64) * 64  # int8 scales cover whole 64-element blocks
    assert biggest[0] <= block * padded_din, f"allocated {biggest} during backward; weight is {dout * din}"
    assert opt.state[lin.weight]["step"] == 2


def test_tied_weights_are_stepped_after_both_uses():
    class Tied(TinyNet):
        def __init__(self):
            super().__init__(d=24)
            self.head = nn.Linear(24, 11, bias=False)
            self.head.weight = self.emb.weight

    model, ref_model = twin(factory=Tied)
    opt = forge_optim.AdamW(model, lr=1e-2)
    assert "head" not in opt.fused_modules() and "tied" in opt.unfused_linears()["head"]
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, foreach=False)
    step_both(model, ref_model, opt, ref)
    assert rel_diff(model, ref_model) <= TOL


def test_parameter_shared_by_two_modules():
    class Shared(TinyNet):
        def __init__(self):
            super().__init__()
            self.down2 = nn.Linear(40, 24, bias=False)
            self.down2.weight = self.down.weight

        def forward(self, idx):
            h = self.emb(idx)
            u = torch.tanh(self.norm(self.up(h)))
            return self.head(h + self.down(u) + self.down2(u * u))

    model, ref_model = twin(factory=Shared)
    opt = forge_optim.AdamW(model, lr=1e-2)
    assert "down" not in opt.fused_modules() and "down2" not in opt.fused_modules()
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, foreach=False)
    step_both(model, ref_model, opt, ref)
    assert rel_diff(model, ref_model) <= TOL


class CalledTwice(TinyNet):
    def __init__(self):
        super().__init__(d=24, hidden=24)

    def forward(self, idx):
        h = self.emb(idx)
        h = h + self.down(torch.tanh(self.up(h)))
        h = h + self.down(torch.tanh(self.up(h)))  # same modules, second call in one forward
        return self.head(h)


def test_module_called_twice_in_one_forward():
    model, ref_model = twin(factory=CalledTwice)
    opt = forge_optim.AdamW(model, lr=1e-2)
    assert {"up", "down"} <= set(opt.fused_modules())
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, foreach=False)
    step_both(model, ref_model, opt, ref)
    assert rel_diff(model, ref_model) <= TOL


def test_dropped_graph_does_not_block_the_next_update():
    model, ref_model = twin()
    opt = forge_optim.AdamW(model, lr=1e-2)
    loss_fn(model, batches(1)[0])  # a forward whose graph is never backpropagated (e.g. a logging pass)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, foreach=False)
    step_both(model, ref_model, opt, ref, n=2)
    assert rel_diff(model, ref_model) <= TOL


def test_frozen_weights_are_skipped():
    model, ref_model = twin()
    for m in (model, ref_model):
        m.up.weight.requires_grad_(False)
    frozen = model.up.weight.detach().clone()
    opt = forge_optim.AdamW(model, lr=1e-2)
    assert "up" not in opt.fused_modules() and "frozen" in opt.unfused_linears()["up"]
    ref = torch.optim.AdamW([p for p in ref_model.parameters() if p.requires_grad], lr=1e-2, foreach=False)
    step_both(model, ref_model, opt, ref)
    assert torch.equal(model.up.weight, frozen)
    assert rel_diff(model, ref_model) <= TOL


def test_weights_unfrozen_later_train_as_with_torch_optim():
    """Progressive unfreezing: a linear and a norm frozen when the optimizer is made (default params) and
    unfrozen after two steps train from then on exactly as under torch.optim.AdamW(model.parameters()),
    the linear stepped by opt.step() from its gradient; and the checkpoint's groups hold the same
    parameters as torch's, so it loads into torch.optim.AdamW(model.parameters())."""
    model, ref_model = twin()
    for m in (model, ref_model):
        m.up.requires_grad_(False)
        m.norm.requires_grad_(False)
    opt = forge_optim.AdamW(model, lr=1e-2, weight_decay=0.1)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    assert opt.unfused_linears()["up"].startswith("frozen") and "unfrozen later" in opt.unfused_linears()["up"]
    frozen = model.up.weight.detach().clone()
    data = batches(5)
    step_both(model, ref_model, opt, ref, data=data[:2])
    for m in (model, ref_model):
        m.up.requires_grad_(True)
        m.norm.requires_grad_(True)
    step_both(model, ref_model, opt, ref, data=data[2:])
    assert not torch.equal(model.up.weight, frozen)
    assert rel_diff(model, ref_model) <= TOL
    torch.optim.AdamW(ref_model.parameters(), lr=1e-2).load_state_dict(opt.state_dict())


def test_checkpoint_without_the_frozen_parameters_gets_an_error_naming_the_fix():
    """A checkpoint from an optimizer over the trainable parameters only (forge's default before
    2026-12-05, or torch.optim over a filtered list) does not fit one made with the default params on a
    model with frozen parameters: the error says so and how to load it; nothing is changed."""
    model, _ = twin()
    model.up.requires_grad_(False)
    old = forge_optim.AdamW(model, params=[p for p in model.parameters() if p.requires_grad], lr=1e-2)
    loss_fn(model, batches(1)[0]).backward()
    old.step()
    saved = old.state_dict()
    old.unpatch()
    opt = forge_optim.AdamW(model, lr=1e-2)
    with pytest.raises(ValueError, match=r"2 frozen parameters.*params=\[p for p in model.parameters\(\) if "
                                         r"p.requires_grad\]"):
        opt.load_state_dict(saved)
    assert not opt.state
    opt.unpatch()
    forge_optim.AdamW(model, params=[p for p in model.parameters() if p.requires_grad], lr=1e-2).load_state_dict(saved)


def test_frozen_weights_of_other_dtypes_stay_out_of_the_default_params():
    """A frozen fp16 (or quantized) base weight is not put into the default params: it could not be
    stepped, and the fp32/bf16-only check must not refuse the model for it."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model[0].half().requires_grad_(False)
    opt = forge_optim.AdamW(model, lr=1e-2)
    assert {id(p) for g in opt.param_groups for p in g["params"]} == {id(p) for p in model[1].parameters()}


def _nonfinite_setup(**kw):
    lin = nn.Linear(6, 4, bias=False)
    opt = forge_optim.AdamW(lin, lr=1e-2, **kw)
    lin(torch.randn(3, 6)).sum().backward()  # one clean step so states are non-trivial
    x = torch.randn(3, 6)
    x[1, 2] = float("inf")  # gradient column 2 becomes non-finite for every row
    return lin, opt, x


def test_nonfinite_gradient_coordinates_keep_weight_and_state():
    lin, opt, x = _nonfinite_setup()
    w0 = lin.weight.detach().clone()
    st = {k: v.clone() for k, v in opt.state[lin.weight].items() if k in ("exp_avg", "exp_avg_sq")}
    lin(x).sum().backward()
    w1 = lin.weight.detach()
    assert torch.equal(w1[:, 2], w0[:, 2])
    for k, v in st.items():
        assert torch.equal(opt.state[lin.weight][k][:, 2], v[:, 2]), k
    keep = [0, 1, 3, 4, 5]
    assert (w1[:, keep] != w0[:, keep]).all()
    assert torch.isfinite(w1).all()
    assert opt.nonfinite_counts() == {".weight": 4} or list(opt.nonfinite_counts().values()) == [4]


def test_nonfinite_raise_names_the_module():
    model = nn.Sequential(nn.Linear(6, 4, bias=False))
    opt = forge_optim.AdamW(model, lr=1e-2, nonfinite="raise")
    x = torch.randn(3, 6)
    x[0, 1] = float("nan")
    with pytest.raises(FloatingPointError, match="'0.weight'"):
        model(x).sum().backward()
    assert opt.nonfinite_counts() == {"0.weight": 4}


def test_fused_weight_used_outside_its_module_is_refused():
    class Leaky(TinyNet):
        def forward(self, idx):
            out = super().forward(idx)
            return out + F.linear(self.emb(idx), self.up.weight).mean()

    model, _ = twin(factory=Leaky)
    opt = forge_optim.AdamW(model, lr=1e-2, exclude=[])
    with pytest.raises(RuntimeError, match="exclude=\\['up'\\]"):
        loss_fn(model, batches(1)[0]).backward()
        opt.step()


def test_exclude_pattern_that_matches_no_linear_warns():
    """A typo in exclude= (e.g. 'heads') would fuse the module meant to be left out: warned, naming it."""
    model, _ = twin()
    with pytest.warns(UserWarning, match="exclude pattern 'heads' matches no nn.Linear") as record:
        opt = forge_optim.AdamW(model, lr=1e-2, exclude=["heads", "he*"])
    assert record[0].filename == __file__  # the line that made the optimizer
    assert set(opt.fused_modules()) == {"up", "down"}  # the pattern that matched still excluded 'head'


def test_exclude_patterns_and_unpatch_restore_plain_linear():
    model, _ = twin()
    opt = forge_optim.AdamW(model, lr=1e-2, exclude=["he*"])
    assert set(opt.fused_modules()) == {"up", "down"}
    assert "fused=AdamW(state=fp32" in repr(model.up)
    assert opt.unfused_linears()["head"].startswith("excluded")
    opt.unpatch()
    assert type(model.up) is nn.Linear and "fused" not in repr(model)
    assert opt.fused_modules() == {}
    loss_fn(model, batches(1)[0]).backward()  # now plain: the gradient lands in .grad
    assert model.up.weight.grad is not None
    opt.step()


@pytest.mark.parametrize("form", ["opt.unpatch()", "forge_optim.unpatch(model)"])
def test_training_goes_on_after_unpatch_with_the_same_optimizer(form):
    """Unpatched after two fused steps (either form), the layers are plain nn.Linear and the same
    optimizer steps their weights from .grad with the states the fused updates left: the whole run
    equals torch.optim.AdamW's (the module-level form used to leave the optimizer treating them as
    fused, and step() raised that the weight had a gradient from outside its module)."""
    model, ref_model = twin()
    opt = forge_optim.AdamW(model, lr=1e-2, weight_decay=0.1)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    data = batches(5)
    step_both(model, ref_model, opt, ref, data=data[:2])
    opt.unpatch() if form == "opt.unpatch()" else forge_optim.unpatch(model)
    assert opt.fused_modules() == {} and type(model.up) is nn.Linear
    step_both(model, ref_model, opt, ref, data=data[2:])
    assert opt.unfused_linears()["up"].startswith("unpatched")
    assert rel_diff(model, ref_model) < 1e-5


def test_unbatched_input_and_empty_batch_match_torch():
    """An unbatched 1-D input and an empty batch through a fused linear with a bias step as torch.optim
    does (the bias gradient of an unbatched input was summed to a scalar, and autograd refused it)."""
    unbatched_and_empty_batches_match_torch("torch")


def test_deepcopy_of_a_patched_model_is_unfused():
    model, _ = twin()
    forge_optim.AdamW(model, lr=1e-2)
    clone = copy.deepcopy(model)
    loss_fn(clone, batches(1)[0]).backward()
    assert clone.up.weight.grad is not None


def test_in_place_misuse_raises_torchs_error():
    lin = nn.Linear(5, 5)
    forge_optim.SGD(lin, lr=0.1)
    x = torch.randn(2, 5, requires_grad=True)
    h = x @ lin.weight.t()  # an upstream consumer that saved the weight; its backward runs after lin's
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        lin(h).sum().backward()


@pytest.mark.parametrize("value", [0.0, 0.1, -0.3, 1e-30])
@pytest.mark.parametrize("nonnegative", [False, True])
def test_quantized_full_equals_quantizing_a_full_tensor(value, nonnegative):
    from forge_optim import precision

    if nonnegative and value < 0:
        pytest.skip("non-negative states are never initialized below zero")
    for rows, cols in ((3, 64), (5, 100), (1, 1)):
        q_ref, s_ref = precision.quantize(torch.full((rows, cols), value), nonnegative)
        q, s = precision.quantized_full(rows, cols, value, nonnegative)
        assert q.dtype == q_ref.dtype and torch.equal(q, q_ref) and torch.equal(s, s_ref)


@pytest.mark.parametrize("state_dtype", ["bf16", "int8"])
def test_state_init_allocates_no_fp32_copy_of_the_weight(state_dtype):
    """States are born in their storage format: on the 8B model's 128256x4096 embedding an fp32
    detour cost a 7 GiB first-step peak (measured on the H200: 41.8 GiB vs 34.8 GiB steady)."""
    model = nn.ModuleDict(dict(lin=nn.Linear(80, 96, bias=False), emb=nn.Embedding(50, 80)))
    opt = forge_optim.Adagrad(model, lr=1e-2, initial_accumulator_value=0.1, state_dtype=state_dtype)
    group = opt.param_groups[0]
    for p in (model["lin"].weight, model["emb"].weight):
        rec = _AllocRecorder()
        with rec:
            state = opt._init_state(p, group)
        fp32_big = [s for s in rec.sizes if s[1] == torch.float32 and s[0] >= p.numel()]
        assert not fp32_big, fp32_big
        stored = state["sum"] if state_dtype == "bf16" else precision_dequantize(state)
        assert torch.allclose(stored.float().reshape(p.shape), torch.full(p.shape, 0.1), rtol=4e-3)


def precision_dequantize(state):
    from forge_optim import precision

    return precision.dequantize(state["sum"].view(-1, state["sum"].shape[-1]), state["sum_scale"])


def _embedding_model(tie=False):
    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(50, 24)
            self.head = nn.Linear(24, 50, bias=False)
            if tie:
                self.head.weight = self.emb.weight

        def forward(self, ids):
            return self.head(torch.tanh(self.emb(ids)))

    torch.manual_seed(0)
    return LM()


def test_embedding_gradient_is_row_sparse_and_the_step_is_torch_adamws():
    """The untied embedding's gradient holds only the touched rows (no [vocab, dim] tensor in
    backward); opt.step() still moves every row, as torch.optim.AdamW does on the dense gradient."""
    emb = nn.Embedding(50, 24)
    ref = copy.deepcopy(emb)
    opt = forge_optim.AdamW(emb, lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    c = torch.randn(2, 6, 24)
    for step in range(4):
        ids = torch.randint(0, 50, (2, 6), generator=torch.Generator().manual_seed(step))
        rec = _AllocRecorder(views_too=True)
        with rec:
            (emb(ids) * c).sum().backward()
        assert emb.weight.grad.is_sparse and max(n for n, _, _ in rec.sizes) < 50 * 24, rec.sizes
        (ref(ids) * c).sum().backward()
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    # the loss is linear in the table: no round-off amplification, the two must agree to round-off
    assert ((emb.weight - ref.weight).abs().max() / ref.weight.abs().max()).item() <= 1e-6


def test_sparse_embeddings_opt_out_tied_and_unpatch():
    from forge_optim.patch import ForgeEmbedding

    model = _embedding_model()
    opt = forge_optim.AdamW(model, lr=1e-2, sparse_embeddings=False)
    model(torch.tensor([[1, 2]])).sum().backward()
    assert type(model.emb) is nn.Embedding and not model.emb.weight.grad.is_sparse

    tied = _embedding_model(tie=True)
    forge_optim.AdamW(tied, lr=1e-2)
    tied(torch.tensor([[1, 2]])).sum().backward()
    assert type(tied.emb) is nn.Embedding and not tied.emb.weight.grad.is_sparse

    model = _embedding_model()
    opt = forge_optim.AdamW(model, lr=1e-2)
    assert type(model.emb) is ForgeEmbedding
    opt.unpatch()
    assert type(model.emb) is nn.Embedding and not model.emb.sparse

    model = _embedding_model()
    forge_optim.AdamW(model, lr=1e-2)
    forge_optim.unpatch(model)  # the module-level form too: torch.optim afterwards needs dense gradients
    model(torch.tensor([[1, 2]])).sum().backward()
    assert type(model.emb) is nn.Embedding and not model.emb.weight.grad.is_sparse


def test_bf16_embedding_with_sparse_gradient_steps_like_dense():
    """bf16 table: the sparse path (duplicates summed in fp32) and sparse_embeddings=False agree
    to one bf16 rounding of the weight."""
    torch.manual_seed(0)
    a = nn.Embedding(40, 16).to(torch.bfloat16)
    b = copy.deepcopy(a)
    opt_a = forge_optim.AdamW(a, lr=1e-2, state_dtype="bf16", stochastic_rounding=False)
    opt_b = forge_optim.AdamW(b, lr=1e-2, state_dtype="bf16", stochastic_rounding=False, sparse_embeddings=False)
    ids = torch.tensor([[1, 2, 2, 7], [7, 7, 3, 1]])
    c = torch.randn(2, 4, 16).to(torch.bfloat16)
    for m, o in ((a, opt_a), (b, opt_b)):
        (m(ids).float() * c.float()).sum().backward()
        assert m.weight.grad.is_sparse == (m is a)
        o.step()
    ulp = a.weight.float().abs().max() * 2.0 ** -7
    assert (a.weight.float() - b.weight.float()).abs().max() <= ulp


@pytest.mark.parametrize("state_dtype", ["fp32", "int8"])
def test_sparse_embedding_step_is_bitwise_the_dense_step(state_dtype):
    """fp32 table (no stochastic rounding): the row-sparse step (one zero-gradient update of every row,
    the touched rows updated from their gathered old values) writes the bits of the dense step."""
    torch.manual_seed(0)
    a = nn.Embedding(60, 80)
    b = copy.deepcopy(a)
    opt_a = forge_optim.AdamW(a, lr=1e-2, weight_decay=0.1, state_dtype=state_dtype)
    opt_b = forge_optim.AdamW(b, lr=1e-2, weight_decay=0.1, state_dtype=state_dtype, sparse_embeddings=False)
    for step in range(3):
        ids = torch.randperm(60, generator=torch.Generator().manual_seed(step))[:7]  # unique: same fp32 sums
        c = torch.randn(7, 80, generator=torch.Generator().manual_seed(10 + step))
        for m, o in ((a, opt_a), (b, opt_b)):
            (m(ids) * c).sum().backward()
            assert m.weight.grad.is_sparse == (m is a)
            o.step()
            o.zero_grad()
    assert torch.equal(a.weight, b.weight)
    sa, sb = opt_a.state[a.weight], opt_b.state[b.weight]
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


def test_sparse_embedding_step_skips_nonfinite_coordinates():
    emb = nn.Embedding(30, 16)
    opt = forge_optim.AdamW(emb, lr=1e-2, weight_decay=0.1)
    ids = torch.tensor([3, 9])
    (emb(ids) * torch.randn(2, 16)).sum().backward()
    g = emb.weight.grad.coalesce()
    vals = g.values().clone()
    vals[1, 5] = float("nan")
    emb.weight.grad = torch.sparse_coo_tensor(g.indices(), vals, g.shape, check_invariants=True)
    before = emb.weight.detach().clone()
    opt.step()
    assert opt.nonfinite_counts() == {"weight": 1}
    assert emb.weight[9, 5] == before[9, 5]
    assert (emb.weight[9, :5] != before[9, :5]).all() and (emb.weight[0] != before[0]).all()  # decay moves rows


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16", "int8"])
def test_sparse_embedding_step_allocates_nothing_table_sized(state_dtype):
    """opt.step() on a row-sparse embedding gradient never builds a [vocab, dim] tensor: the zero-gradient
    update runs over the table in place (in block_rows blocks on the torch backend, in the kernel's
    registers on the GPU) and only the touched rows are gathered."""
    vocab, dim, block = 1000, 64, 64  # (int8 blocks pad a row to a multiple of 64)
    emb = nn.Embedding(vocab, dim)
    opt = forge_optim.AdamW(emb, lr=1e-2, state_dtype=state_dtype, block_rows=block)
    for step in range(3):
        ids = torch.randint(0, vocab, (3, 5), generator=torch.Generator().manual_seed(step))
        (emb(ids) * torch.randn(3, 5, dim)).sum().backward()
        rec = _AllocRecorder()
        with rec:
            opt.step()
        opt.zero_grad()
        if step > 0:  # (the first step creates the table-sized states themselves)
            biggest = max(n for n, _, _ in rec.sizes)
            assert biggest <= block * dim, sorted(rec.sizes, key=lambda r: r[0])[-5:]


# ----- what a backward asks of a fused weight ---------------------------------------------------------

@pytest.mark.parametrize("how", ["autograd.grad", "backward(inputs=[x])"])
def test_a_backward_that_asks_only_for_input_gradients_updates_no_weight(how):
    """torch.autograd.grad(loss, x) (an input gradient: saliency, an adversarial perturbation, a
    gradient penalty's first pass) or backward(inputs=[x]) does not ask for the weights' gradients:
    torch.optim would step nothing, so no fused update may run. The input gradient is torch's, and
    the next training step matches torch.optim (no use is left pending)."""
    model, ref_model = twin()
    opt = forge_optim.AdamW(model, lr=1e-2, state_dtype="fp32")
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, foreach=False)
    step_both(model, ref_model, opt, ref, n=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    saved = states_snapshot(opt)
    idx, tgt = batches(1, seed=5)[0]
    grads = []
    for m in (model, ref_model):
        e = m.emb(idx).detach().requires_grad_(True)  # the input whose gradient is wanted
        h = e + m.down(torch.tanh(m.norm(m.up(e))))  # TinyNet.forward from the embedding on
        loss = F.cross_entropy(m.head(h).reshape(-1, m.head.out_features), tgt.reshape(-1))
        if how == "autograd.grad":
            grads.append(torch.autograd.grad(loss, e)[0])
        else:
            loss.backward(inputs=[e])
            grads.append(e.grad)
    assert torch.allclose(grads[0], grads[1], rtol=1e-5, atol=1e-7)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert_states_unchanged(opt, saved)
    assert all(h.buffer is None and h.pending_fwd == 0 for h in opt._handles.values())
    step_both(model, ref_model, opt, ref, n=2)
    assert rel_diff(model, ref_model) <= TOL


def test_autograd_grad_of_a_fused_weight_is_refused_before_writing():
    """A fused layer never forms its weight's gradient, so autograd.grad cannot return it: refused by
    name (torch would otherwise hand back None after the weight had been stepped)."""
    lin = nn.Linear(6, 4)
    opt = forge_optim.SGD(lin, lr=0.1)
    x = torch.randn(3, 6, requires_grad=True)
    w = lin.weight.detach().clone()
    out = lin(x)
    with pytest.raises(RuntimeError, match=r"autograd.grad asked for the gradient of the fused weight.*exclude"):
        torch.autograd.grad(out.pow(2).sum(), [x, lin.weight])
    assert torch.equal(lin.weight, w) and not opt.state.get(lin.weight)
    h = opt._handles[""]
    assert h.pending_fwd == 0  # the refused pass released its use: the next backward updates
    lin(x).pow(2).sum().backward()
    assert not torch.equal(lin.weight, w)


def test_retained_graph_backpropagated_twice_is_one_step_with_the_summed_gradient():
    """retain_graph=True: the graph may be backpropagated again, and each pass needs the old weight.
    Two losses backpropagated through one graph are one optimizer step with their summed gradient
    (torch.optim's result); a retained graph backpropagated once is stepped by opt.step()."""
    model, ref_model = twin()
    opt = forge_optim.AdamW(model, lr=1e-2, state_dtype="fp32")
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, foreach=False)
    for batch in batches(3, seed=7):
        for m, o in ((model, opt), (ref_model, ref)):
            loss = loss_fn(m, batch)
            loss.backward(retain_graph=True)
            (0.5 * loss).backward()
            o.step()
            o.zero_grad()
    assert rel_diff(model, ref_model) <= TOL
    for i, batch in enumerate(batches(2, seed=8)):
        for m, o in ((model, opt), (ref_model, ref)):
            loss_fn(m, batch).backward(retain_graph=True)
            if o is opt and i == 0:  # the buffer's cost is named once
                with pytest.warns(UserWarning, match=r"retain_graph=True \(or create_graph=True\) and not backpropagated.*fp32 buffer"):
                    o.step()
            else:
                o.step()
            o.zero_grad()
    assert rel_diff(model, ref_model) <= TOL
    assert all(h.buffer is None and not h.retained for h in opt._handles.values())


def test_weight_frozen_after_the_optimizer_is_not_stepped():
    """requires_grad_(False) on a fused weight after the optimizer exists: torch.optim would not step
    it (no gradient), so neither does FORGE (the layer runs as a plain linear; a weight frozen between
    forward and backward is skipped in backward); the rest trains as before."""
    model, ref_model = twin()
    opt = forge_optim.AdamW(model, lr=1e-2, state_dtype="fp32")
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, foreach=False)
    step_both(model, ref_model, opt, ref, n=1)
    for m in (model, ref_model):
        m.up.weight.requires_grad_(False)
    frozen = model.up.weight.detach().clone()
    step_both(model, ref_model, opt, ref, n=2)
    assert torch.equal(model.up.weight, frozen)
    assert rel_diff(model, ref_model) <= TOL


def test_scale_grad_by_freq_embedding_stays_dense_and_steps_like_torch():
    # torch's sparse embedding backward refuses scale_grad_by_freq: such a table keeps its dense gradient
    emb = nn.Embedding(20, 8, scale_grad_by_freq=True)
    ref = copy.deepcopy(emb)
    opt = forge_optim.AdamW(emb, lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    ids = torch.tensor([[1, 1, 3, 7]])
    for m, o in ((emb, opt), (ref, ref_opt)):
        m(ids).sum().backward()
        o.step()
    assert not emb.weight.grad.is_sparse
    assert torch.allclose(emb.weight, ref.weight, rtol=0, atol=1e-7)


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16", "int8"])
def test_centered_rmsprop_never_writes_nan_when_rounding_makes_the_variance_negative(state_dtype):
    # the same gradient every step: square_avg - grad_avg^2 -> 0, and bf16/int8 rounding takes it below 0;
    # the sqrt is clamped at 0 (torch's fp32 form gives NaN there too, later, from round-off)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64, bias=False))
    x = torch.randn(8, 64)
    opt = forge_optim.RMSprop(model, lr=1e-3, alpha=0.9, centered=True, state_dtype=state_dtype)
    for _ in range(60):
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
    assert torch.isfinite(model[0].weight).all()


def test_row_sparse_grad_sums_duplicates_as_coalesce_does_without_calling_it(monkeypatch):
    """RowSparseGrad asks the device nothing (coalesce() would sync the host with the whole backward): the
    touched rows sorted and unique in the first slots, the later slots repeating the first row with a zero
    gradient, the sums those of coalesce() in fp32."""
    from forge_optim.backends.base import RowSparseGrad

    idx = torch.tensor([5, 2, 9, 5, 2, 5])
    vals = torch.randn(6, 8, generator=torch.Generator().manual_seed(0)).bfloat16()
    grad = torch.sparse_coo_tensor(idx[None], vals, (12, 8))
    want = grad.float().coalesce()
    monkeypatch.setattr(torch.Tensor, "coalesce", lambda self: pytest.fail("coalesce() was called"))
    g = RowSparseGrad(grad)
    assert g.index.tolist() == [2, 5, 9, 2, 2, 2] and g.valid.tolist() == [True] * 3 + [False] * 3
    assert torch.equal(g.values[:3], want.values()) and not g.values[3:].any()
    with pytest.raises(ValueError, match="row-sparse 2-D gradient"):
        RowSparseGrad(torch.zeros(12, 8))


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16", "int8"])
def test_repeated_tokens_step_like_their_coalesced_gradient(state_dtype):
    """A batch that repeats tokens gives more gradient entries than touched rows: the extra slots repeat the
    first touched row and must write its bits, not a second update of it. Same bits (fp32, bf16 with
    stochastic rounding, int8) as the step on the gradient coalesced beforehand (one slot per row)."""
    torch.manual_seed(0)
    a = nn.Embedding(50, 64).to(torch.bfloat16 if state_dtype == "bf16" else torch.float32)
    b = copy.deepcopy(a)
    opt_a = forge_optim.AdamW(a, lr=1e-2, weight_decay=0.1, state_dtype=state_dtype)
    opt_b = forge_optim.AdamW(b, lr=1e-2, weight_decay=0.1, state_dtype=state_dtype)
    for step in range(3):
        ids = torch.tensor([[3, 7, 3, 3, 11], [7, 40, 3, 0, 0]]) + step
        # small integers: the duplicates' sums are exact in bf16 too (b's coalesce() sums in the weight's dtype)
        c = torch.randint(-4, 5, (2, 5, 64), generator=torch.Generator().manual_seed(step)).to(a.weight.dtype)
        for m, o in ((a, opt_a), (b, opt_b)):
            (m(ids) * c).float().sum().backward()
            if m is b:
                b.weight.grad = b.weight.grad.coalesce()
            o.step()
            o.zero_grad()
    assert torch.equal(a.weight, b.weight)
    for key in opt_a.state[a.weight]:
        assert torch.equal(opt_a.state[a.weight][key], opt_b.state[b.weight][key]), key


class _OpRecorder(torch.utils._python_dispatch.TorchDispatchMode):
    """The aten ops run inside it: (name, id of the first argument)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append((str(func.overloadpacket.__name__), id(args[0]) if args else None))
        return func(*args, **(kwargs or {}))

    def names(self, host_tensors=()) -> set:
        """The op names, less .item() of ``host_tensors`` (kept on the host on purpose: the step counters)."""
        host = {id(t) for t in host_tensors}
        return {n for n, a in self.ops if not (n == "_local_scalar_dense" and a in host)}


# ops whose output size depends on tensor values: on CUDA each reads a count back to the host (a sync)
_DATA_DEPENDENT = {"nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_consecutive", "coalesce",
                   "_coalesce", "item", "_local_scalar_dense", "embedding_sparse_backward"}


@pytest.mark.parametrize("padding_idx", [None, 2])
def test_row_sparse_embedding_backward_and_step_run_no_op_with_a_data_dependent_size(padding_idx):
    """Neither the embedding's backward (with a padding row too: torch's own sparse backward masks padding
    tokens out, a host sync on CUDA) nor opt.step()'s row-sparse update runs an op whose output size the
    host would have to read back; the padding row's entries carry a zero gradient, and the step still
    equals torch.optim.AdamW's on the dense gradient."""
    emb = nn.Embedding(30, 16, padding_idx=padding_idx)
    ref = copy.deepcopy(emb)
    opt = forge_optim.AdamW(emb, lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    ids = torch.tensor([[2, 5, 2, 9], [5, 5, 0, 2]])
    c = torch.randn(2, 4, 16)
    for step in range(3):
        rec = _OpRecorder()
        with rec:
            (emb(ids) * c).sum().backward()
        assert emb.weight.grad.is_sparse
        if padding_idx is not None:
            g = emb.weight.grad.coalesce()
            assert not g.values()[g.indices()[0].tolist().index(padding_idx)].any()
        assert not _DATA_DEPENDENT & rec.names(), sorted(_DATA_DEPENDENT & rec.names())  # backward
        rec = _OpRecorder()
        with rec:
            opt.step()
        if step:  # (the first step makes its states from host constants)
            ran = rec.names([opt.state[emb.weight]["step"]])  # (a CPU tensor whatever the device: no sync)
            assert not _DATA_DEPENDENT & ran, sorted(_DATA_DEPENDENT & ran)
        (ref(ids) * c).sum().backward()
        ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    assert ((emb.weight - ref.weight).abs().max() / ref.weight.abs().max()).item() <= 1e-6
