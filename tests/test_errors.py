"""Bad input gets a clear error that names the problem and the fix, and changes nothing."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import forge_optim
from helpers import assert_states_unchanged, states_snapshot


def test_model_must_come_first():
    lin = nn.Linear(3, 3)
    with pytest.raises(TypeError, match="takes the model first"):
        forge_optim.AdamW(lin.parameters(), lr=1e-3)


def test_unknown_option_lists_valid_ones():
    with pytest.raises(TypeError, match="unknown option 'betaz'.*betas"):
        forge_optim.AdamW(nn.Linear(3, 3), betaz=(0.9, 0.99))


@pytest.mark.parametrize("kw,match", [
    (dict(lr=-1.0), "invalid lr"),
    (dict(lr="1e-3"), "str, not a number"),
    (dict(betas=(0.9, 1.5)), "beta"),
    (dict(state_dtype="fp8"), "state_dtype"),
    (dict(backend="cuda"), "backend must be one of"),
    (dict(nonfinite="ignore"), "nonfinite"),
    (dict(amsgrad=True), "amsgrad"),
])
def test_bad_hyper_parameters(kw, match):
    lin = nn.Linear(3, 3)
    w = lin.weight.detach().clone()
    with pytest.raises((ValueError, TypeError), match=match):
        forge_optim.AdamW(lin, **kw)
    assert type(lin) is nn.Linear and torch.equal(lin.weight, w)  # nothing patched, nothing changed


def test_fp16_weights_are_refused():
    with pytest.raises(ValueError, match="float16.*bfloat16"):
        forge_optim.AdamW(nn.Linear(3, 3).half())


def test_fp16_autocast_training_is_refused_bf16_and_inference_work():
    """fp16 autocast means a GradScaler'd loss: the in-backward update would take the scaled gradient
    (SGD with a 2**16 loss scale steps 65536x too far). Refused at the forward, by name, before any
    write; inference under fp16 autocast and training under bf16 autocast are unaffected."""
    import gc

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    opt = forge_optim.SGD(model, lr=0.1)
    handles = list(opt._handles.values())
    x = torch.randn(4, 8)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.autocast("cpu", dtype=torch.float16):
        with pytest.raises(RuntimeError, match="float16.*GradScaler.*bfloat16"):
            model(x)
        with torch.no_grad():
            assert model(x).dtype == torch.float16
    gc.collect()  # the refused call's pending use is released with its arguments
    assert all(h.pending_fwd == 0 for h in handles)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(x).float().sum().backward()
    opt.step()
    assert not torch.equal(model[0].weight, before["0.weight"])


def test_model_cast_to_fp16_after_the_optimizer_is_refused_before_writing():
    """model.half() after the optimizer exists would hand the kernel an fp16 weight it would store fp32
    or bf16 words into: refused at the first update, by name, weights and states untouched."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    opt = forge_optim.AdamW(model, lr=0.1)
    x = torch.randn(4, 8)
    model(x).sum().backward()  # one step in fp32: states and the prepared fast path exist
    opt.step()
    model.half()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    states = states_snapshot(opt)
    with pytest.raises(RuntimeError, match=r"'1.weight' is torch.float16 now.*model.to\(torch.bfloat16\)"):
        model(x.half()).float().sum().backward()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert_states_unchanged(opt, states)


def test_states_left_on_another_device_are_refused_before_writing():
    """model.to("cuda") after the first step moves the weights (in place), not the optimizer's states:
    the kernel would get the old device's pointers. Simulated here by moving one state to the meta
    device; refused by name at the next update, with weights, steps and the other states untouched."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    opt = forge_optim.AdamW(model, lr=0.1)
    x = torch.randn(4, 8)
    model(x).sum().backward()
    opt.step()
    opt.state[model[1].weight]["exp_avg_sq"] = opt.state[model[1].weight]["exp_avg_sq"].to("meta")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    steps = {id(p): int(st["step"]) for p, st in opt.state.items()}
    with pytest.raises(RuntimeError, match=r"state 'exp_avg_sq' of '1.weight' is on meta, the parameter on cpu.*"
                                           r"Create the optimizer after moving the model"):
        model(x).sum().backward()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert {id(p): int(st["step"]) for p, st in opt.state.items()} == steps


def test_weight_replaced_after_patching_is_refused():
    """tie_weights() or `lin.weight = nn.Parameter(...)` after the optimizer exists: the fused update
    would go to the old Parameter while the new one is used. Refused when called, by name."""
    model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 16, bias=False))
    opt = forge_optim.AdamW(model, lr=0.1)
    assert "1" in opt.fused_modules()
    model[1].weight = model[0].weight  # what tie_weights() does for an lm_head
    ids = torch.randint(0, 16, (2, 5))
    with pytest.raises(RuntimeError, match="fused linear '1' was replaced by another Parameter"):
        model(ids)
    with torch.no_grad():  # inference is a plain linear
        assert model(ids).shape == (2, 5, 16)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_triton_backend_without_cuda(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="no CUDA device.*TRITON_INTERPRET=1"):
        forge_optim.AdamW(nn.Linear(3, 3), backend="triton")


def test_double_patching_is_refused():
    """A weight one forge optimizer fuses cannot be in a second one's params (it would be updated by
    both); the error names the module and the two ways out. Nothing of the first is changed."""
    lin = nn.Sequential(nn.Linear(3, 3))
    first = forge_optim.AdamW(lin)
    with pytest.raises(ValueError, match=r"module '0' is already fused by another forge_optim optimizer.*"
                                         r"params=.*unpatch\(\)"):
        forge_optim.SGD(lin)
    assert lin[0]._forge_handle is first._handles["0"]


@pytest.fixture
def process_group(tmp_path):
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_ddp_is_refused_with_the_reason(process_group):
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(4, 4)))
    with pytest.raises(ValueError, match="DistributedDataParallel.*partial gradient.*tensor/sequence parallelism"):
        forge_optim.AdamW(model)


def test_fsdp2_is_refused(process_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    with pytest.raises(ValueError, match="FSDP"):
        forge_optim.AdamW(model)


def test_composable_replicate_is_refused(process_group):
    from torch.distributed._composable import replicate

    model = nn.Sequential(nn.Linear(4, 4))
    replicate(model)
    with pytest.raises(ValueError, match="replicate"):
        forge_optim.AdamW(model)


@pytest.mark.parametrize("group, match", [({"lr": -1.0}, "lr"), ({"lr": "1e-3"}, "lr")])
def test_refused_param_group_is_not_kept(group, match):
    # torch.optim raises before appending a bad group; a group that fails forge_optim's checks after
    # torch filled in its defaults is taken out again, so step() never runs with it.
    model = nn.Sequential(nn.Linear(4, 4))
    extra = nn.Parameter(torch.ones(3))
    opt = forge_optim.AdamW(model, lr=1e-2)
    with pytest.raises((ValueError, TypeError), match=match):
        opt.add_param_group({"params": [extra], **group})
    assert len(opt.param_groups) == 1
    extra.grad = torch.ones(3)
    opt.step()
    assert torch.equal(extra.detach(), torch.ones(3))


def test_add_param_group_refuses_fp16_with_the_reason():
    model = nn.Sequential(nn.Linear(4, 4))
    opt = forge_optim.AdamW(model, lr=1e-2)
    model.register_parameter("scale16", nn.Parameter(torch.ones(3, dtype=torch.float16)))
    with pytest.raises(ValueError, match=r"parameter .scale16. is torch.float16.*loss scaling"):
        opt.add_param_group({"params": [model.scale16]})
    assert len(opt.param_groups) == 1


def test_unfused_reason_follows_add_param_group():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    opt = forge_optim.AdamW(model, lr=1e-2, params=[model[0].weight, model[0].bias])
    assert "not in the optimizer" in opt.unfused_linears()["1"]
    opt.add_param_group({"params": [model[1].weight]})
    assert "add_param_group" in opt.unfused_linears()["1"]
    before = model[1].weight.detach().clone()
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    assert not torch.equal(model[1].weight.detach(), before)  # stepped by opt.step() from its gradient


@pytest.mark.parametrize("how", ["backward", "grad_wrt_input"])
def test_double_backward_is_refused_by_name_before_any_write(how):
    """create_graph=True through a fused layer (the first half of a gradient penalty) raises with the
    module's name and the fix, and leaves weights and states as they were; the same model then trains."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = forge_optim.AdamW(model, lr=1e-2)
    x = torch.randn(5, 6, requires_grad=True)
    model(x).sum().backward()  # one ordinary step first, so that states exist
    opt.step()
    opt.zero_grad()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    saved = states_snapshot(opt)
    out = model(x).sum()
    with pytest.raises(RuntimeError, match=r"create_graph=True reached the fused linear '2'.*exclude="):
        if how == "backward":
            out.backward(create_graph=True)
        else:
            torch.autograd.grad(out, x, create_graph=True)
    for k, v in model.state_dict().items():
        assert torch.equal(v, weights[k]), k
    assert_states_unchanged(opt, saved)
    del out
    model(x).sum().backward()
    opt.step()
    assert not torch.equal(model[0].weight, weights["0.weight"])


def test_gradient_penalty_trains_with_the_critic_excluded():
    """The documented fix: exclude the critic's linears; an R1-style penalty then backpropagates twice."""
    torch.manual_seed(0)
    critic = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = forge_optim.AdamW(critic, lr=1e-2, exclude=["*"])
    x = torch.randn(5, 6, requires_grad=True)
    (g,) = torch.autograd.grad(critic(x).sum(), x, create_graph=True)
    w0 = critic[0].weight.detach().clone()
    (critic(x).mean() + g.square().sum()).backward()
    opt.step()
    assert not torch.equal(critic[0].weight, w0)
