"""opt.step() steps small unfused parameters (norms, biases) of one group in one batched update.

The batch concatenates same-width rows, updates them once and copies them back: with fp32 weights
(no stochastic rounding) that is the same arithmetic as one update per parameter, bit for bit.
"""
import pytest
import torch

import forge_optim
from helpers import CASES, TinyNet, batches, forge_class, loss_fn, rel_diff, twin


def _train(case, steps=4, batched=True, monkeypatch=None, state_dtype=None, skip_at=None, dtype=torch.float32):
    torch.manual_seed(0)
    model = TinyNet().to(dtype)
    fkw, _ = CASES[case]
    opt = forge_class(case)(model, **fkw, state_dtype=state_dtype)
    if not batched:
        opt.BATCH_MAX_NUMEL = 0  # every parameter on its own
    sizes = []
    orig = opt._apply_batched
    opt._apply_batched = lambda ps, group: (sizes.append(len(ps)), orig(ps, group))
    for i, batch in enumerate(batches(steps)):
        loss_fn(model, batch).backward()
        if skip_at == i:
            model.norm.bias.grad = None  # this step leaves norm.bias (and its step count) alone
        opt.step()
        opt.zero_grad()
    return model, opt, sizes


def _state_tensors(opt):
    return [v for st in opt.state.values() for k, v in sorted(st.items()) if isinstance(v, torch.Tensor)]


@pytest.mark.parametrize("case", ["AdamW", "NAdam", "RAdam-decoupled", "Lion", "RMSprop-centered-momentum",
                                  "Adagrad", "SGD-nesterov"])
def test_batched_step_is_bitwise_the_one_by_one_step(case):
    a, opt_a, sizes = _train(case)
    b, opt_b, none = _train(case, batched=False)
    assert sizes == [3] * 4 and none == []  # up.bias, norm.weight, norm.bias: one batch per step
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    for s, t in zip(_state_tensors(opt_a), _state_tensors(opt_b)):
        assert torch.equal(s, t)


def test_batched_int8_states_are_bitwise_the_one_by_one_states():
    """int8 codes and per-64 scales are per row: concatenating rows changes none of them."""
    a, opt_a, sizes = _train("AdamW", state_dtype="int8")
    b, opt_b, _ = _train("AdamW", state_dtype="int8", batched=False)
    assert sizes
    assert any(v.dtype == torch.int8 for v in _state_tensors(opt_a))
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    for s, t in zip(_state_tensors(opt_a), _state_tensors(opt_b)):
        assert torch.equal(s, t)


def test_batched_step_matches_torch_when_a_parameter_skips_a_step():
    """A parameter without a gradient keeps its step count, so it is batched apart from then on."""
    model, opt, sizes = _train("AdamW", steps=5, skip_at=1)
    assert 2 in sizes  # norm.bias left the batch after skipping a step
    torch.manual_seed(0)
    ref_model = TinyNet()
    ref = CASES["AdamW"][1](ref_model.parameters(), **CASES["AdamW"][0])
    for i, batch in enumerate(batches(5)):
        loss_fn(ref_model, batch).backward()
        if i == 1:
            ref_model.norm.bias.grad = None
        ref.step()
        ref.zero_grad()
    assert rel_diff(model, ref_model) <= 1e-5
    assert opt.state[model.norm.bias]["step"].item() == 4 and opt.state[model.norm.weight]["step"].item() == 5


def test_batched_step_counts_nonfinite_coordinates_per_parameter():
    model, ref = twin()
    opt = forge_optim.AdamW(model, lr=1e-2)
    loss_fn(model, batches(1)[0]).backward()
    model.norm.weight.grad[3] = float("nan")
    model.up.bias.grad[[0, 7]] = float("inf")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.step()
    assert opt.nonfinite_counts() == {"norm.weight": 1, "up.bias": 2}
    assert model.norm.weight[3] == before["norm.weight"][3]
    assert torch.equal(model.up.bias[[0, 7]], before["up.bias"][[0, 7]])
    assert not torch.equal(model.norm.weight, before["norm.weight"])  # the finite coordinates moved
    assert not torch.equal(model.norm.bias, before["norm.bias"])


def test_bf16_batched_step_differs_from_one_by_one_only_by_rounding():
    """bf16 weights and states: the batch draws its own stochastic-rounding bits; both are within one
    bf16 rounding of each other after one step."""
    a, _, sizes = _train("AdamW", steps=1, dtype=torch.bfloat16)
    b, _, _ = _train("AdamW", steps=1, dtype=torch.bfloat16, batched=False)
    assert sizes == [3]
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        ulp = q.float().abs().clamp_min(1e-3) * 2.0 ** -7
        assert ((p.float() - q.float()).abs() <= ulp).all(), n


def test_batch_key_keeps_apart_what_must_not_share_an_update():
    model, _ = twin()
    opt = forge_optim.AdamW(model, lr=1e-2, nonfinite="raise")
    loss_fn(model, batches(1)[0]).backward()
    assert opt._batch_key(model.norm.weight, 0) is None  # 'raise' checks each parameter on its own
    opt.unpatch()
    opt = forge_optim.AdamW(model, lr=1e-2)
    keys = {n: opt._batch_key(p, 0) for n, p in model.named_parameters() if p.grad is not None}
    assert keys["norm.weight"] == keys["norm.bias"] == keys["up.bias"]
    assert keys["head.bias"] != keys["norm.weight"]  # another width
    opt.BATCH_MAX_NUMEL = 10
    assert opt._batch_key(model.norm.weight, 0) is None  # too large for this limit


def test_batched_step_advances_each_step_once():
    """The batch advances every member's step exactly once (bias corrections stay right)."""
    _, opt, _ = _train("AdamW", steps=3)
    assert {int(st["step"].item()) for st in opt.state.values()} == {3}


@pytest.mark.gpu
@pytest.mark.parametrize("state_dtype", ["fp32", "int8"])
def test_gpu_batched_and_row_sparse_steps_through_the_kernel(monkeypatch, state_dtype):
    """CUDA, Triton backend, fp32 weights: the batched norm/bias step and the row-sparse embedding step
    write the bits of the one-by-one, dense-gradient steps."""
    from forge_optim.kernels.launch import GPU_TEST_CONFIG

    monkeypatch.setenv("FORGE_TRITON_CONFIG", GPU_TEST_CONFIG.env())
    results = []
    for batched in (True, False):
        torch.manual_seed(0)
        model = TinyNet(vocab=300, d=64, hidden=128).cuda()
        opt = forge_optim.AdamW(model, lr=1e-2, weight_decay=0.1, backend="triton", state_dtype=state_dtype,
                                sparse_embeddings=batched)
        if not batched:
            opt.BATCH_MAX_NUMEL = 0
        assert opt._backend_for(model.up.weight).name == "triton"
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            idx = torch.randperm(300, generator=g)[:24].view(3, 8).cuda()  # unique ids: same fp32 sums
            tgt = torch.randint(0, 300, (3, 8), generator=g).cuda()
            loss_fn(model, (idx, tgt)).backward()
            assert model.emb.weight.grad.is_sparse == batched
            opt.step()
            opt.zero_grad()
        results.append([p.detach().clone() for p in model.parameters()] + _state_tensors(opt))
    for a, b in zip(*results):
        assert torch.equal(a, b)
