"""Exact gradient accumulation and state_dict round trips (forge <-> forge, forge <-> torch.optim)."""
import copy
import io

import pytest
import torch

import forge_optim
from forge_optim.optim import _as_2d
from helpers import (assert_states_unchanged, batches, bf16_accumulation_matches_reference, loss_fn, rel_diff,
                     states_snapshot, twin)

TOL = 1e-5


@pytest.mark.parametrize("final_outside", [True, False], ids=["last-backward-outside", "all-inside-then-step"])
def test_accumulate_equals_optimizer_on_summed_gradient(final_outside):
    model, ref_model = twin()
    opt = forge_optim.AdamW(model, lr=1e-2)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, foreach=False)
    data = batches(9)
    for step in range(3):
        micro = data[3 * step: 3 * step + 3]
        for i, b in enumerate(micro):
            if final_outside and i == len(micro) - 1:
                loss_fn(model, b).backward()  # applies the update with buffer + this gradient
            else:
                with opt.accumulate():
                    loss_fn(model, b).backward()
        opt.step()
        opt.zero_grad()
        for b in micro:
            loss_fn(ref_model, b).backward()
        ref.step()
        ref.zero_grad()
        assert all(h.buffer is None for h in opt._handles.values())  # buffer lives only in the window
    assert rel_diff(model, ref_model) <= TOL


def test_bf16_accumulation_buffer():
    """accumulate_dtype="bf16" halves the buffer (2 B/param, as torch's bf16 .grad): see the helper."""
    bf16_accumulation_matches_reference("torch")


def test_accumulate_dtype_is_checked():
    with pytest.raises(ValueError, match="accumulate_dtype must be 'fp32' or 'bf16'"):
        forge_optim.AdamW(twin()[0], accumulate_dtype="fp16")


def test_accumulation_without_accumulate_warns_once(recwarn):
    """The usual accumulation loop (backward per micro-batch, one opt.step()) takes one optimizer step
    per backward on a fused layer: warned once, naming opt.accumulate(); one backward per opt.step()
    and accumulate() stay silent."""
    model, _ = twin()
    opt = forge_optim.AdamW(model, lr=1e-2)
    data = batches(8)
    _train(model, opt, data[:2])  # one backward per step
    with opt.accumulate():
        loss_fn(model, data[2]).backward()
    loss_fn(model, data[3]).backward()
    opt.step()
    assert not [w for w in recwarn if "forge_optim" in str(w.message)]
    for _ in range(2):  # twice: the warning is shown once
        for b in data[4:6]:
            loss_fn(model, b).backward()
        opt.step()
    ours = [w for w in recwarn if "forge_optim" in str(w.message)]
    msgs = [str(w.message) for w in ours]
    assert len(msgs) == 1 and "2 backward passes" in msgs[0] and "opt.accumulate()" in msgs[0], msgs
    assert ours[0].filename == __file__  # it points at the caller's opt.step(), not into torch
    h = next(iter(opt._handles.values()))
    assert int(opt.state[h.param]["step"]) == 1 + 1 + 1 + 4  # the warning does not change what ran


def _train(model, opt, data):
    for b in data:
        loss_fn(model, b).backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("name", ["AdamW", "NAdam", "SGD"])
def test_resume_is_identical_to_uninterrupted(name, state_dtype):
    kw = dict(lr=1e-2, momentum=0.9) if name == "SGD" else dict(lr=1e-2)
    cls = getattr(forge_optim, name)
    data = batches(6)
    model, resumed = twin()
    opt = cls(model, state_dtype=state_dtype, **kw)
    _train(model, opt, data[:3])
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    _train(model, opt, data[3:])

    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    resumed.load_state_dict(ckpt["model"])
    opt2 = cls(resumed, state_dtype=state_dtype, **kw)
    opt2.load_state_dict(ckpt["opt"])
    _train(resumed, opt2, data[3:])
    assert rel_diff(model, resumed) == 0.0


def test_int8_state_dict_exports_dequantized_and_keeps_quantized():
    model, _ = twin()
    opt = forge_optim.AdamW(model, lr=1e-2, state_dtype="int8")
    _train(model, opt, batches(2))
    sd = opt.state_dict()
    st = sd["state"][0]
    assert st["exp_avg"].dtype == torch.float32 and st["exp_avg_q"].dtype == torch.int8
    assert st["exp_avg_sq_q"].dtype == torch.uint8 and "exp_avg_sq_scale" in st
    assert st["exp_avg"].shape == next(model.parameters()).shape


def test_int8_checkpoint_with_fp32_scales_is_quantized_afresh():
    """A checkpoint written before scales became bf16 (fp32 ``_scale``, ``_q`` codes against it) loads:
    its exported fp32 values are quantized again with bf16 scales (codes against the old scales would
    be wrong by up to 2**-7 of a scale), so every state reads back within half a new step."""
    model, _ = twin()
    opt = forge_optim.AdamW(model, lr=1e-2, state_dtype="int8")
    _train(model, opt, batches(2))
    sd = copy.deepcopy(opt.state_dict())
    for st in sd["state"].values():  # rewrite as the old format: fp32 scales, codes against them
        for key in ("exp_avg", "exp_avg_sq"):
            x = _as_2d(st[key])
            nonneg = key == "exp_avg_sq"
            xb, _ = forge_optim.precision._blocked(x)
            qmax = 255.0 if nonneg else 127.0
            scale32 = xb.abs().amax(-1) / qmax
            st[key + "_scale"] = scale32
            st[key] = forge_optim.precision.dequantize(_as_2d(st[key + "_q"]), scale32).reshape(st[key].shape)
    opt2 = forge_optim.AdamW(copy.deepcopy(model), lr=1e-2, state_dtype="int8")
    opt2.load_state_dict(sd)
    for idx, st in opt2.state_dict()["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert st[key + "_scale"].dtype == torch.bfloat16
            live = opt2.state[opt2.param_groups[0]["params"][idx]][key + "_scale"]
            assert live.dtype == torch.bfloat16
            saved = _as_2d(sd["state"][idx][key])
            step = st[key + "_scale"].float().repeat_interleave(64, dim=-1)[:, :saved.shape[-1]]
            err = (_as_2d(st[key]) - saved).abs()
            assert (err <= step * (1.0 if key == "exp_avg_sq" else 0.5) * (1 + 1e-6) + 1e-30).all()


def test_checkpoint_moves_from_forge_to_torch_and_back():
    data = batches(6)
    model, ref_model = twin()
    opt = forge_optim.AdamW(model, lr=1e-2)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, foreach=False)
    _train(model, opt, data[:2])
    _train(ref_model, ref, data[:2])

    # forge -> torch: continue the forge run with torch.optim
    torch_model = copy.deepcopy(ref_model)
    torch_model.load_state_dict(model.state_dict())
    torch_opt = torch.optim.AdamW(torch_model.parameters(), lr=1e-2, foreach=False)
    torch_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # as if saved to disk
    # torch -> forge: continue the torch run with forge
    forge_model = copy.deepcopy(ref_model)
    forge_opt = forge_optim.AdamW(forge_model, lr=1e-2)
    forge_opt.load_state_dict(copy.deepcopy(ref.state_dict()))

    for m, o in ((model, opt), (ref_model, ref), (torch_model, torch_opt), (forge_model, forge_opt)):
        _train(m, o, data[2:])
    assert rel_diff(torch_model, ref_model) <= TOL
    assert rel_diff(forge_model, ref_model) <= TOL
    assert rel_diff(model, ref_model) <= TOL


def test_load_rejects_mismatched_groups():
    model, other = twin()
    opt = forge_optim.AdamW(model, lr=1e-2)
    two = forge_optim.AdamW(other, params=[{"params": [other.up.weight]}, {"params": [other.head.weight]}])
    with pytest.raises(ValueError, match="parameter groups"):
        opt.load_state_dict(two.state_dict())


def test_load_of_another_models_states_is_refused_and_changes_nothing():
    """A checkpoint whose states have other shapes (another model, or the parameters listed in another
    order) is refused by name, even where the sizes match and a reshape would go through silently;
    the failed load leaves the optimizer's groups and states as they were."""
    def build(dims):
        torch.manual_seed(0)
        m = torch.nn.Sequential(*[torch.nn.Linear(a, b) for a, b in zip(dims, dims[1:])])
        o = forge_optim.AdamW(m, lr=1e-2)
        m(torch.randn(2, dims[0])).sum().backward()
        o.step()
        return m, o

    _, src = build([8, 4, 8])  # weights [4, 8] and [8, 4]
    model, opt = build([4, 8, 4])  # weights [8, 4] and [4, 8]: the same sizes, transposed
    groups = copy.deepcopy([{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups])
    saved = states_snapshot(opt)
    sd = src.state_dict()
    sd["param_groups"][0]["lr"] = 0.5  # would be loaded first if groups were replaced before states
    # (the fused weights' states were made in backward order: the last layer's is checked first)
    with pytest.raises(ValueError, match=r"state 'exp_avg' of parameter '1.weight' has shape \(8, 4\), "
                                         r"the parameter has \(4, 8\).*nothing was loaded"):
        opt.load_state_dict(sd)
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == groups
    assert_states_unchanged(opt, saved)


def test_int8_checkpoint_through_torch_optim_of_a_bf16_model_keeps_exact_codes():
    # torch.optim's load_state_dict casts every state tensor to the parameter's dtype: the int8 codes
    # come back as bf16 numbers. They must be recognised as the same codes (a resumed run equals an
    # uninterrupted one bit for bit), not stored as bf16 "codes" (garbage moments).
    data = batches(5)
    model, _ = twin()
    model.to(torch.bfloat16)
    resumed_model = copy.deepcopy(model)
    opt = forge_optim.AdamW(model, lr=1e-2, state_dtype="int8")
    _train(model, opt, data[:3])
    via_torch = torch.optim.AdamW(copy.deepcopy(resumed_model).parameters(), lr=1e-2)
    via_torch.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert via_torch.state_dict()["state"][0]["exp_avg_q"].dtype == torch.bfloat16  # what torch does
    resumed_model.load_state_dict(model.state_dict())
    resumed = forge_optim.AdamW(resumed_model, lr=1e-2, state_dtype="int8")
    resumed.load_state_dict(copy.deepcopy(via_torch.state_dict()))
    for p, q in zip(model.parameters(), resumed_model.parameters()):
        for key, v in opt.state[p].items():
            assert resumed.state[q][key].dtype == v.dtype and torch.equal(resumed.state[q][key], v), key
    _train(model, opt, data[3:])
    _train(resumed_model, resumed, data[3:])
    for p, q in zip(model.parameters(), resumed_model.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_codes_left_stale_by_torch_optim_training_are_not_used(dtype):
    # torch.optim keeps the "_q"/"_scale" keys it does not know through its own steps: by the time the
    # checkpoint comes back they no longer describe the moments, which are quantized afresh from the value.
    data = batches(6)
    model, torch_model = twin()
    model.to(dtype), torch_model.to(dtype)
    back_model = copy.deepcopy(torch_model)
    opt = forge_optim.AdamW(model, lr=1e-2, state_dtype="int8")
    _train(model, opt, data[:2])
    torch_model.load_state_dict(model.state_dict())
    torch_opt = torch.optim.AdamW(torch_model.parameters(), lr=1e-2)
    torch_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    _train(torch_model, torch_opt, data[2:])
    saved = copy.deepcopy(torch_opt.state_dict())
    back_model.load_state_dict(torch_model.state_dict())
    back = forge_optim.AdamW(back_model, lr=1e-2, state_dtype="int8")
    back.load_state_dict(saved)
    for i, q in enumerate(back_model.parameters()):
        if q.dim() < 2:
            continue
        for key in ("exp_avg", "exp_avg_sq"):
            st = back.state[q]
            now = saved["state"][i][key].float()  # torch's current moment
            deq = forge_optim.precision.dequantize(_as_2d(st[key]), st[key + "_scale"]).reshape(now.shape)
            step = st[key + "_scale"].float().repeat_interleave(64, dim=-1)[:, :now.shape[-1]]
            assert ((deq - now).abs() <= step * (1.0 if key == "exp_avg_sq" else 0.5) * (1 + 1e-6) + 1e-30).all()


def test_deepcopy_of_a_patched_model_trains_with_torch_optim():
    # copy.deepcopy(model) after forge_optim patched it (a torch.optim baseline, an EMA copy): the copy
    # must be a plain model, with dense embedding gradients torch.optim.AdamW accepts.
    data = batches(3)
    model, ref_model = twin()
    opt = forge_optim.AdamW(model, lr=1e-2)
    assert opt.fused_modules()
    copied = copy.deepcopy(model)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, foreach=False)
    copied_opt = torch.optim.AdamW(copied.parameters(), lr=1e-2, foreach=False)
    _train(copied, copied_opt, data)
    _train(ref_model, ref, data)
    assert rel_diff(copied, ref_model) <= TOL
    assert all(p.grad is None for p in model.parameters())  # the copy's backward touched no original


def test_zero_grad_discards_the_fused_buffers_as_torch_discards_grad():
    # a micro-batch accumulated and then dropped with opt.zero_grad() (a bad batch, a loss spike) must not
    # reach the fused weights, as torch.optim's zero_grad drops it from .grad
    model, ref_model = twin()
    opt = forge_optim.AdamW(model, lr=1e-2)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, foreach=False)
    data = batches(3)
    with opt.accumulate():
        loss_fn(model, data[0]).backward()
    loss_fn(ref_model, data[0]).backward()
    opt.zero_grad()
    ref.zero_grad()
    assert all(h.buffer is None for h in opt._handles.values())
    for b in data[1:]:
        for m, o in ((model, opt), (ref_model, ref)):
            loss_fn(m, b).backward()
            o.step()
            o.zero_grad()
    assert rel_diff(model, ref_model) <= TOL


def test_step_inside_accumulate_applies_the_buffer_like_torch():
    # torch.optim's step() applies what .grad holds wherever it is called; inside accumulate() too
    model, ref_model = twin()
    opt = forge_optim.AdamW(model, lr=1e-2)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, foreach=False)
    data = batches(4)
    for step in range(2):
        with opt.accumulate():
            for b in data[2 * step: 2 * step + 2]:
                loss_fn(model, b).backward()
            opt.step()
            opt.zero_grad()
        for b in data[2 * step: 2 * step + 2]:
            loss_fn(ref_model, b).backward()
        ref.step()
        ref.zero_grad()
        assert all(h.buffer is None for h in opt._handles.values())
    assert rel_diff(model, ref_model) <= TOL
