"""torch.compile: the fused linear traces as custom ops, with no graph break, and stays exact."""
import copy

import pytest
import torch

import forge_optim
from helpers import ReusedLinear, adam_bound, rel_diff

transformers = pytest.importorskip("transformers")
from test_hf import hf_batches, tiny_llama  # noqa: E402

TOL = 1e-5


def _compiled_pair(model=None, weight_decay=0.01):
    """One model (a tiny Llama by default) twice: FORGE AdamW and torch.optim.AdamW, each model compiled."""
    model = tiny_llama() if model is None else model
    ref_model = copy.deepcopy(model)
    opt = forge_optim.AdamW(model, lr=1e-2, weight_decay=weight_decay)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=weight_decay, foreach=False)
    cmodel, cref = torch.compile(model), torch.compile(ref_model)
    torch._dynamo.reset()
    return model, ref_model, opt, ref, cmodel, cref


def _train_pair(compiled_autograd=False, steps=5):
    model, ref_model, opt, ref, cmodel, cref = _compiled_pair()
    old = torch._dynamo.config.compiled_autograd
    torch._dynamo.config.compiled_autograd = compiled_autograd
    try:
        ids = hf_batches(1, seed=9)[0]
        cmodel(input_ids=ids, labels=ids)  # a grad-enabled forward that is never backpropagated
        for ids in hf_batches(steps):
            for m, o in ((cmodel, opt), (cref, ref)):
                m(input_ids=ids, labels=ids).loss.backward()
                o.step()
                o.zero_grad()
    finally:
        torch._dynamo.config.compiled_autograd = old
    return model, ref_model, opt


@pytest.mark.slow
def test_compiled_forge_matches_compiled_torch_adamw():
    model, ref_model, opt = _train_pair()
    # same compiled numerics on both sides: the only difference left is the optimizer's
    assert rel_diff(model, ref_model) <= TOL
    for h in opt._handles.values():
        assert h.pending_traced == 0 and h.buffer is None
        assert h.param.grad is None


@pytest.mark.slow
def test_compiled_forge_with_activation_checkpointing_matches_torch_adamw():
    """HF's non-reentrant gradient checkpointing inside a compiled FORGE model: the recompute and the
    in-backward update compose (same weights as compiled torch.optim.AdamW, uses all released)."""
    model = tiny_llama()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    model, ref_model, opt, ref, cmodel, cref = _compiled_pair(model)  # the reference: a deep copy
    for ids in hf_batches(3):
        for m, o in ((cmodel, opt), (cref, ref)):
            m(input_ids=ids, labels=ids).loss.backward()
            o.step()
            o.zero_grad()
    assert rel_diff(model, ref_model) <= TOL
    for h in opt._handles.values():
        assert h.pending_traced == 0 and h.pending_fwd == 0 and h.buffer is None
        assert h.param.grad is None


@pytest.mark.slow
def test_compiled_autograd_works():
    model, ref_model, _ = _train_pair(compiled_autograd=True, steps=3)
    assert rel_diff(model, ref_model) <= TOL


def test_no_graph_break_in_a_fused_model():
    model = tiny_llama()
    forge_optim.AdamW(model, lr=1e-2)
    ids = hf_batches(1)[0]
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(input_ids=ids, labels=ids)
    assert explained.graph_break_count == 0, [r.reason for r in explained.break_reasons]
    assert explained.graph_count == 1


class _PaddedLM(torch.nn.Module):
    """An embedding with a padding row, then a fused linear."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(40, 16, padding_idx=3)
        self.head = torch.nn.Linear(16, 40, bias=False)

    def forward(self, ids):
        return torch.tanh(self.head(self.emb(ids))).square().mean()


def test_compiled_embedding_gradient_is_row_sparse_and_steps_like_torch_adamw():
    """Under torch.compile the untied embedding's gradient is eager's row-sparse one (the touched rows, a zero
    gradient for the padding row; two backward passes before a step add up), built by the opaque backward
    op outside inductor's graph: no [vocab, dim] gradient. Its weights then follow torch.optim.AdamW on
    the compiled dense-gradient twin to fp32 round-off, as the eager sparse step does."""
    model, ref_model, opt, ref, cmodel, cref = _compiled_pair(_PaddedLM(), weight_decay=0.1)
    g = torch.Generator().manual_seed(1)
    for step in range(4):
        batches = [torch.randint(0, 40, (2, 7), generator=g) for _ in range(1 + step % 2)]
        batches[0][0, 0] = 3  # the padding row is used, and gets no gradient
        for m, o in ((cmodel, opt), (cref, ref)):
            for i, ids in enumerate(batches):
                if m is cmodel and i < len(batches) - 1:
                    with opt.accumulate():  # micro-batches of one step
                        m(ids).backward()
                else:
                    m(ids).backward()
            if m is cmodel:
                grad = model.emb.weight.grad.coalesce()
                assert grad.is_sparse, grad.layout
                rows = grad.indices()[0].tolist()
                assert set(rows) == {int(i) for b in batches for i in b.flatten()}
                assert not grad.values()[rows.index(3)].any()  # the padding row's gradient is zero
            o.step()
            o.zero_grad()
    assert rel_diff(model, ref_model) <= TOL
    assert int(opt.state[model.emb.weight]["step"]) == 4


def test_compiled_embedding_op_is_in_the_graph_without_a_break():
    model = _PaddedLM()
    forge_optim.AdamW(model, lr=1e-2)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(torch.tensor([[1, 2, 3]]))
    assert explained.graph_break_count == 0, [r.reason for r in explained.break_reasons]
    code = "\n".join(gm.code for gm in explained.graphs)
    assert "forge_optim.embedding" in code, code


def test_alias_follows_the_weight_storage():
    lin = torch.nn.Linear(4, 4)
    forge_optim.AdamW(lin)
    lin.to(torch.float64).to(torch.float32)  # new storage
    assert lin._forge_weight_alias.data_ptr() == lin.weight.data_ptr()
    assert "_forge_weight_alias" not in lin.state_dict()


def test_fused_ops_are_kept_out_of_cuda_graphs():
    """Both ops run host code each call (use counts; the step's scalars): tagged so that
    mode="reduce-overhead" never records them into a CUDA graph (tests/test_gpu_end_to_end.py runs it)."""
    ops = torch.ops.forge_optim
    for op in (ops.fused_linear.default, ops.linear_counted.default, ops.fused_linear_backward.default,
               ops.fused_linear_update.default, ops.count_uses.default, ops.embedding.default,
               ops.embedding_sparse_grad.default):
        assert torch.Tag.cudagraph_unsafe in op.tags, op


def test_step_inside_a_cuda_graph_capture_is_refused(monkeypatch):
    """opt.step() of unfused parameters under capture would bake this step's scalars into the graph:
    refused by name before any write (the capture query is faked here: CPU-only torch has no CUDA)."""
    model = tiny_llama()
    opt = forge_optim.AdamW(model, lr=1e-2)
    ids = hf_batches(1)[0]
    model(input_ids=ids, labels=ids).loss.backward()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match=r"AdamW.step\(\) is running inside a CUDA graph capture"):
        opt.step()
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    # the fused weights were updated in backward; the unfused ones (embeddings, norms) never got a state
    assert not any("exp_avg" in st for p, st in opt.state.items() if id(p) not in opt._fused_ids)



@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
def test_compiled_fp16_autocast_training_is_refused_and_releases_its_uses():
    """The fp16-autocast refusal (tests/test_errors.py) under torch.compile: dynamo abandons the traced
    call and the eager fallback raises; no use stays pending and no half-built object is left to
    fail in its finalizer, so the next compiled step trains normally."""
    import gc

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    opt = forge_optim.AdamW(model, lr=1e-2)
    compiled = torch.compile(model)
    torch._dynamo.reset()
    x = torch.randn(4, 8)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.autocast("cpu", dtype=torch.float16):
        with pytest.raises(RuntimeError, match="float16.*GradScaler"):
            compiled(x)
    gc.collect()
    assert all(h.pending_fwd == 0 and h.pending_traced == 0 for h in opt._handles.values())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    compiled(x).sum().backward()
    opt.step()
    assert all(int(opt.state[h.param]["step"]) == 1 for h in opt._handles.values())


def test_compiled_input_gradient_updates_no_weight():
    """torch.autograd.grad of the loss with respect to the input embeddings through a compiled model: the
    compiled backward runs FORGE's backward op, which must not step any weight (torch.optim would not);
    the input gradient equals the eager unfused model's."""
    model = tiny_llama()
    ref_model = copy.deepcopy(model)
    opt = forge_optim.AdamW(model, lr=1e-2)
    cmodel = torch.compile(model)
    torch._dynamo.reset()
    ids = hf_batches(1, seed=3)[0]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    grads = []
    for m in (cmodel, ref_model):
        e = m.get_input_embeddings()(ids).detach().requires_grad_(True)
        grads.append(torch.autograd.grad(m(inputs_embeds=e, labels=ids).loss, e)[0])
    assert torch.allclose(grads[0], grads[1], rtol=1e-4, atol=1e-6)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert not any(opt.state.get(h.param) for h in opt._handles.values())


@pytest.mark.slow
def test_compiled_autograd_updates_inside_backward():
    """Under compiled autograd the fused update still runs inside backward (not buffered for opt.step()):
    every fused weight has moved when backward returns, with no gradient buffer."""
    model = tiny_llama()
    opt = forge_optim.AdamW(model, lr=1e-2)
    cmodel = torch.compile(model)
    torch._dynamo.reset()
    old = torch._dynamo.config.compiled_autograd
    torch._dynamo.config.compiled_autograd = True
    try:
        for ids in hf_batches(2):
            before = {n: m.weight.detach().clone() for n, m in opt.fused_modules().items()}
            cmodel(input_ids=ids, labels=ids).loss.backward()
            for n, m in opt.fused_modules().items():
                assert not torch.equal(m.weight, before[n]), n
                assert opt._handles[n].buffer is None, n
            opt.step()
            opt.zero_grad()
    finally:
        torch._dynamo.config.compiled_autograd = old


def test_compiled_retained_graph_backpropagated_twice_is_one_step(monkeypatch):
    """retain_graph=True through a compiled model: the backward op buffers the first pass's gradient,
    the second pass applies the sum; the same as torch.optim.AdamW on the compiled reference. Two torch
    switches, for any optimizer: torch refuses retain_graph on a compiled backward with donated buffers
    (its error names donated_buffer), and its compile caches do not key on that switch, so a backward
    cached with donated buffers by an earlier compile (another test, another process) hands the second
    pass corrupted saved tensors silently (seen with torch 2.13: compiled FORGE and compiled torch.optim
    agreed, both 0.5 off eager torch.optim); hence no caches here. The bound is the fp32 one, or Adam's
    amplified round-off measured as torch's fused AdamW against its single-tensor one on the same run
    (``adam_bound``; with transformers 5.25 the second step's gap is 1.1e-5 of max|W|)."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    monkeypatch.setattr(functorch_config, "donated_buffer", False)
    monkeypatch.setattr(inductor_config, "force_disable_caches", True)
    model, ref_model, opt, ref, cmodel, cref = _compiled_pair()
    noise_model = copy.deepcopy(ref_model)
    noise_opt = torch.optim.AdamW(noise_model.parameters(), lr=1e-2, weight_decay=0.01, fused=True)
    cnoise = torch.compile(noise_model)
    for ids in hf_batches(2):
        for m, o in ((cmodel, opt), (cref, ref), (cnoise, noise_opt)):
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward(retain_graph=True)
            (0.5 * loss).backward()
            o.step()
            o.zero_grad()
    assert rel_diff(model, ref_model) <= adam_bound(rel_diff(noise_model, ref_model), TOL)
    assert all(h.buffer is None and h.pending_traced == 0 for h in opt._handles.values())


def _generated_code(fn):
    """inductor's generated code (forward graph first) for one call of ``fn``, compiled afresh."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    return run_and_get_code(fn)[1]


def test_compiled_forward_runs_inductors_gemm_and_counts_uses_once(monkeypatch):
    """inductor_pass: the compiled forward calls inductor's own GEMM for every fused linear and counts all
    their uses in one call (one crossing into Python per graph, not per layer); the compiled backward
    forms dX with inductor's GEMM and hands it to the update op, with dY and X as 2-D views made in the graph
    (no reshape in the op's Python). The old per-layer ops appear nowhere."""
    import torch._inductor.config as inductor_config

    from forge_optim import optim as foptim

    monkeypatch.setattr(inductor_config, "force_disable_caches", True)
    dims = []
    consume = foptim.FusedWeight.consume
    monkeypatch.setattr(foptim.FusedWeight, "consume",
                        lambda self, dy, x, use: dims.append((dy.dim(), x.dim())) or consume(self, dy, x, use))
    model = tiny_llama()
    opt = forge_optim.AdamW(model, lr=1e-2)
    n_fused = len(opt.fused_modules())
    cmodel = torch.compile(model)
    ids = hf_batches(1)[0]
    fwd, bwd = _generated_code(lambda: cmodel(input_ids=ids, labels=ids).loss.backward())
    assert "forge_optim.linear_counted" not in fwd and "forge_optim.fused_linear." not in fwd
    assert fwd.count("forge_optim.count_uses.default(") == 1
    assert fwd.count("extern_kernels.mm(") >= n_fused
    assert bwd.count("forge_optim.fused_linear_update.default(") == n_fused
    assert "fused_linear_backward" not in bwd
    assert dims == [(2, 2)] * n_fused
    # every use was counted in forward and released by its backward: all fused weights stepped once
    assert all(h.pending_traced == 0 and h.buffer is None for h in opt._handles.values())
    assert all(int(opt.state[h.param]["step"]) == 1 for h in opt._handles.values())


@pytest.mark.parametrize("layout", ["weight used twice", "two forwards, one backward", "dynamic shapes",
                                    "dX inside the backward op"])
def test_compiled_counted_uses_give_one_step_with_the_summed_gradient(layout, monkeypatch):
    """The use count now lives in one call per compiled forward graph (and, for symbolic shapes, in the
    per-layer op that pass leaves alone): a weight used twice in a forward, or by two forwards before one
    backward, still takes one AdamW step with the summed gradient, as torch.optim.AdamW does. The backward
    form traced before 2026-12-04 night (dX formed inside the op; kept for cached graphs and the A/B of
    benchmarks/compiled_ab.py) gives the same."""
    from forge_optim import autograd as fautograd

    monkeypatch.setattr(fautograd, "_TRACE_DX_IN_GRAPH", layout != "dX inside the backward op")
    torch.manual_seed(0)
    model = ReusedLinear()
    ref_model = copy.deepcopy(model)
    opt = forge_optim.AdamW(model, lr=1e-2, weight_decay=0.01)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.01, foreach=False)
    torch._dynamo.reset()
    cmodel = torch.compile(model, dynamic=layout == "dynamic shapes")
    for step in range(3):
        xs = [torch.randn(3 + step if layout == "dynamic shapes" else 3, 5, 8) for _ in range(2)]
        if layout != "two forwards, one backward":
            xs = xs[:1]
        for m, o in ((cmodel, opt), (ref_model, ref)):
            sum(m(x).square().mean() for x in xs).backward()
            o.step()
            o.zero_grad()
    assert rel_diff(model, ref_model) <= TOL
    assert all(h.pending_traced == 0 and h.buffer is None for h in opt._handles.values())
    assert all(int(opt.state[h.param]["step"]) == 3 for h in opt._handles.values())


def test_inductor_pass_is_chained_with_a_users_pass(monkeypatch):
    """A post-grad pass the user configured still runs (after FORGE's), and inductor's cache key names both;
    one FORGE does not know how to key makes inductor skip caching, as it would for that pass alone."""
    import torch._inductor.config as inductor_config
    from torch._inductor.custom_graph_pass import CustomGraphPass

    from forge_optim import inductor_pass

    seen = []

    class UserPass(CustomGraphPass):
        def __call__(self, graph):
            seen.append(sum(n.target is torch.ops.forge_optim.count_uses.default for n in graph.nodes))

        def uuid(self):
            return "user-pass-v1"

    monkeypatch.setattr(inductor_config, "post_grad_custom_pre_pass", UserPass())
    monkeypatch.setattr(inductor_config, "force_disable_caches", True)
    model = ReusedLinear()
    forge_optim.AdamW(model, lr=1e-2)
    cmodel = torch.compile(model)
    torch._dynamo.reset()
    cmodel(torch.randn(3, 8)).sum().backward()
    installed = inductor_config.post_grad_custom_pre_pass
    assert isinstance(installed, inductor_pass.FusedLinearPass) and isinstance(installed.inner, UserPass)
    assert seen[0] == 1  # the user's pass ran on the forward graph FORGE's pass had rewritten
    assert installed.uuid()[-1] == ("user-pass-v1",)
    installed.inner = lambda graph: None
    assert installed.uuid() is None


def test_inductor_pass_can_be_turned_off(monkeypatch):
    """FORGE_OPTIM_INDUCTOR_PASS=0: inductor's config is left alone and the per-layer ops run (exactly)."""
    import torch._inductor.config as inductor_config

    monkeypatch.setenv("FORGE_OPTIM_INDUCTOR_PASS", "0")
    monkeypatch.setattr(inductor_config, "post_grad_custom_pre_pass", None)
    monkeypatch.setattr(inductor_config, "force_disable_caches", True)
    torch.manual_seed(0)
    model = ReusedLinear()
    ref_model = copy.deepcopy(model)
    opt = forge_optim.AdamW(model, lr=1e-2)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, foreach=False)
    cmodel = torch.compile(model)
    x = torch.randn(3, 8)
    fwd, _ = _generated_code(lambda: cmodel(x).sum().backward())
    assert inductor_config.post_grad_custom_pre_pass is None
    assert fwd.count("forge_optim.linear_counted.default(") == 3 and "count_uses" not in fwd
    ref_model(x).sum().backward()
    ref.step()
    opt.step()
    assert rel_diff(model, ref_model) <= TOL
