"""overlap_updates=True: fused updates on a side CUDA stream (src/forge_optim/overlap.py).

The side stream changes when an update runs, never what it computes: every test compares bits with the
same training on one stream. On CPU the option is accepted and changes nothing (no streams)."""
import copy

import pytest
import torch
import torch.nn as nn

import forge_optim
from forge_optim import overlap
from helpers import ReusedLinear


def _mlp(width=16, device="cpu", dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width, bias=False),
                         nn.GELU(), nn.Linear(width, 3)).to(device, dtype)


def _states(opt):
    return [t.clone() for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor)]


def _assert_same_training(a, b, opt_a, opt_b):
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), n
    for s, t in zip(_states(opt_a), _states(opt_b)):
        assert torch.equal(s, t)


def test_overlap_on_cpu_trains_as_without():
    a = _mlp()
    b = copy.deepcopy(a)
    oa = forge_optim.AdamW(a, lr=1e-2, overlap_updates=True)
    ob = forge_optim.AdamW(b, lr=1e-2)
    assert oa.overlap_updates and not ob.overlap_updates
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(5, 16, generator=g)
        for m, o in ((a, oa), (b, ob)):
            m(x).square().mean().backward()
            o.step()
            o.zero_grad()
    _assert_same_training(a, b, oa, ob)
    assert not oa._overlap.mains  # nothing was launched on a side stream


def test_overlap_option_is_listed_in_the_unknown_option_error():
    with pytest.raises(TypeError, match="overlap_updates"):
        forge_optim.AdamW(_mlp(), lr=1e-2, overlap_update=True)


# ----- on the GPU (run on the device: pytest -m gpu) ----------------------------------------------

def _gpu_pair(model_fn, **kw):
    a = model_fn()
    b = copy.deepcopy(a)
    oa = forge_optim.AdamW(a, lr=1e-2, weight_decay=0.1, overlap_updates=True, **kw)
    ob = forge_optim.AdamW(b, lr=1e-2, weight_decay=0.1, **kw)
    return a, b, oa, ob


def _wide_mlp():  # wide enough that an update is still running when the host reaches the next line
    return _mlp(width=1024, device="cuda", dtype=torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("held", [None, 1], ids=["default", "host waits after every update"])
def test_gpu_overlap_matches_one_stream_bit_for_bit(held, monkeypatch):
    """Weights and bf16 states equal bit for bit after each backward (read at once, before step()) and
    after each step; with the held-bytes bound at 1 byte the host waits for every update."""
    if held is not None:
        monkeypatch.setattr(overlap, "MAX_HELD_BYTES", held)
    a, b, oa, ob = _gpu_pair(_wide_mlp, state_dtype="bf16")
    g = torch.Generator(device="cuda").manual_seed(1)
    for _ in range(4):
        x = torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16, generator=g)
        for m in (a, b):
            m(x).float().square().mean().backward()
        # no synchronize, no step(): the end-of-backward join alone orders these reads
        for p, q in zip(a.parameters(), b.parameters()):
            assert torch.equal(p, q)
        oa.step()
        ob.step()
    _assert_same_training(a, b, oa, ob)
    assert oa._overlap.side and not ob._overlap.side  # the side stream was used, and only where asked


@pytest.mark.gpu
def test_gpu_overlap_with_accumulation_and_a_reused_weight():
    """accumulate() micro-steps (the buffer is zero-filled on the caller's stream and added to on the side
    stream) and a weight used twice in one forward (buffered, then updated after its last use)."""
    a, b, oa, ob = _gpu_pair(lambda: ReusedLinear(width=256, out=64).cuda())
    g = torch.Generator(device="cuda").manual_seed(2)
    for _ in range(3):
        for micro in range(3):
            x = torch.randn(512, 256, device="cuda", generator=g)
            for m, o in ((a, oa), (b, ob)):
                if micro < 2:
                    with o.accumulate():
                        m(x).square().mean().backward()
                else:
                    m(x).square().mean().backward()
        oa.step()
        ob.step()
        oa.zero_grad()
        ob.zero_grad()
    _assert_same_training(a, b, oa, ob)


@pytest.mark.gpu
def test_gpu_overlap_compiled_matches_one_stream():
    """torch.compile'd model: the update op runs from the compiled backward; same bits as one stream."""
    a, b, oa, ob = _gpu_pair(_wide_mlp, state_dtype="bf16")
    ca, cb = torch.compile(a), torch.compile(b)
    g = torch.Generator(device="cuda").manual_seed(3)
    for _ in range(3):
        x = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16, generator=g)
        for m, o in ((ca, oa), (cb, ob)):
            m(x).float().square().mean().backward()
            o.step()
    _assert_same_training(a, b, oa, ob)


@pytest.mark.gpu
def test_gpu_overlap_state_dict_sees_the_last_update():
    """state_dict() right after backward (no step, no synchronize) holds the updated states."""
    a, b, oa, ob = _gpu_pair(_wide_mlp, state_dtype="bf16")
    x = torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16)
    for m in (a, b):
        m(x).float().square().mean().backward()
    sa, sb = oa.state_dict()["state"], ob.state_dict()["state"]
    for k in sb:
        for key, t in sb[k].items():
            if isinstance(t, torch.Tensor):
                assert torch.equal(sa[k][key], t), (k, key)
