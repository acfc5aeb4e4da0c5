"""On CUDA (run on the device: pytest -m gpu): the optimizer with the Triton backend, eager and
compiled, against torch.optim; and the memory promise (no weight-sized gradient)."""
import copy
import gc

import pytest
import torch

import forge_optim
from helpers import ReusedLinear, assert_states_unchanged, rel_diff, states_snapshot

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def fixed_kernel_config(monkeypatch):
    """These tests check numerics and memory, not speed: one kernel config for every launch (the
    autotuner's own correctness is test_triton_kernel.py::test_gpu_tuned_matches_fixed), so the
    device run compiles one variant per state layout instead of one per candidate."""
    from forge_optim.kernels.launch import GPU_TEST_CONFIG

    monkeypatch.setenv("FORGE_TRITON_CONFIG", GPU_TEST_CONFIG.env())


def llama(hidden=256, layers=2, vocab=512, dtype=torch.float32, attn="sdpa"):
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                   num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=128, attn_implementation=attn)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).to("cuda", dtype)


def data(n, vocab=512, bs=2, seq=64):
    g = torch.Generator(device="cuda").manual_seed(1)
    return [torch.randint(0, vocab, (bs, seq), device="cuda", generator=g) for _ in range(n)]


def train(model, opt, batches, graphs=False):
    for ids in batches:
        if graphs:  # mode="reduce-overhead": the last step's graph outputs are dead
            torch.compiler.cudagraph_mark_step_begin()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()


def kernel_gradients(model):
    """Make ``model``'s nn.Linear weight gradients the fused kernel's own (its accumulate mode with
    the same config sums the same tiles in the same order as the update mode), so that a
    torch.optim reference sees exactly the gradient FORGE applied and only the optimizer
    arithmetic is compared. Returns a function that overwrites .grad after backward."""
    from forge_optim.backends.triton_backend import TritonBackend

    be = TritonBackend()
    seen = {}
    for mod in model.modules():
        if isinstance(mod, torch.nn.Linear):
            mod.register_forward_hook(lambda m, i, o: seen.setdefault(m, {}).update(x=i[0].detach()))
            mod.register_full_backward_hook(lambda m, gi, go: seen[m].update(dy=go[0].detach()))

    def overwrite():
        for mod, t in seen.items():
            g = torch.zeros_like(mod.weight, dtype=torch.float32)
            be.accumulate(g, t["dy"].reshape(-1, g.shape[0]), t["x"].reshape(-1, g.shape[1]))
            mod.weight.grad = g.to(mod.weight.dtype)
        seen.clear()

    return overwrite


def test_eager_fp32_equals_torch_adamw_given_the_same_gradient():
    """A Llama with the Triton backend against torch.optim.AdamW (single-tensor) whose linear-layer
    gradients are the kernel's own (eager attention: both models run bit-identical ops at step 1).

    Step 1 (identical weights and gradients, only the update arithmetic differs): equal to fp32
    round-off, <= 1e-6. Steps 2-5: an ulp of difference in W changes the next gradients by round-off,
    and Adam turns round-off in near-zero gradients into visible steps, so the 5-step gap is bounded
    by the gap between torch.optim's own fused and single-tensor AdamW on the same gradients
    (measured in the same run), not by a fixed number."""
    torch.backends.cuda.matmul.allow_tf32 = False
    base = llama(attn="eager")
    model, ref_model, fused_model = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
    opt = forge_optim.AdamW(model, lr=1e-3, weight_decay=0.01)
    assert opt._backend_for(model.lm_head.weight).name == "triton"
    refs = [(ref_model, torch.optim.AdamW(ref_model.parameters(), lr=1e-3, weight_decay=0.01, foreach=False)),
            (fused_model, torch.optim.AdamW(fused_model.parameters(), lr=1e-3, weight_decay=0.01, fused=True))]
    overwrites = [kernel_gradients(m) for m, _ in refs]
    gaps = []
    for ids in data(5):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        for (m, o), overwrite in zip(refs, overwrites):
            m(input_ids=ids, labels=ids).loss.backward()
            overwrite()
            o.step()
            o.zero_grad()
        gaps.append((rel_diff(model, ref_model), rel_diff(fused_model, ref_model)))
    print("forge vs single-tensor AdamW / fused vs single-tensor AdamW, per step: "
          + ", ".join(f"{a:.1e}/{b:.1e}" for a, b in gaps))
    assert gaps[0][0] <= 1e-6, gaps[0]
    assert gaps[-1][0] <= 2 * gaps[-1][1] + 1e-5, gaps[-1]


def compiled_gap(steps: int, mode: str | None = None):
    """FORGE compiled with ``mode`` and torch.optim.AdamW compiled in the default mode, both trained
    ``steps`` steps from one fp32 Llama, and eager torch.optim.AdamW beside them. Returns (gap, noise,
    forge's optimizer): gap = FORGE vs compiled torch.optim; noise = what compiling alone moves
    torch.optim (eager vs compiled), the yardstick of "fp32 round-off" here."""
    torch.backends.cuda.matmul.allow_tf32 = False
    base = llama()
    models = {k: copy.deepcopy(base) for k in ("forge", "ref_c", "ref_e")}
    opts = {"forge": forge_optim.AdamW(models["forge"], lr=1e-3, weight_decay=0.01)}
    for k in ("ref_c", "ref_e"):
        opts[k] = torch.optim.AdamW(models[k].parameters(), lr=1e-3, weight_decay=0.01, foreach=False)
    batches = data(steps)
    train(torch.compile(models["forge"], mode=mode), opts["forge"], batches, graphs=mode == "reduce-overhead")
    train(torch.compile(models["ref_c"]), opts["ref_c"], batches)
    train(models["ref_e"], opts["ref_e"], batches)
    assert all(torch.isfinite(p).all() for p in models["forge"].parameters())
    return rel_diff(models["forge"], models["ref_c"]), rel_diff(models["ref_e"], models["ref_c"]), opts["forge"]


def test_compiled_fp32_within_compile_noise_of_torch_adamw():
    """torch.compile'd FORGE (custom ops, Triton backend) against compiled torch.optim.AdamW on
    cuBLAS gradients, 5 steps, fp32. Their gradients differ in summation order (Triton tile vs
    cuBLAS), and Adam turns near-zero gradients' round-off into visible steps, so "fp32 round-off"
    is calibrated in the same run: the FORGE-vs-torch gap must not exceed twice the gap that
    compiling alone opens between eager and compiled torch.optim (plus 1e-5)."""
    gap, noise, _ = compiled_gap(5)
    print(f"compiled forge vs compiled torch.optim: {gap:.2e}; eager vs compiled torch.optim: {noise:.2e}")
    assert gap <= 2 * noise + 1e-5, (gap, noise)


def test_reduce_overhead_compile_is_exact():
    """torch.compile(mode="reduce-overhead") replays CUDA graphs. FORGE's ops run host code every step
    (the step's bias corrections, learning rate and rounding keys), so they must stay outside the
    graphs: had a graph captured one, every replay would repeat step 1's update (bias-corrected step
    10x lr in fp32 AdamW), far outside the tolerance below, which is test_compiled_fp32's."""
    gap, noise, opt = compiled_gap(6, mode="reduce-overhead")
    print(f"reduce-overhead forge vs compiled torch.optim: {gap:.2e}; eager vs compiled torch.optim: {noise:.2e}")
    assert gap <= 2 * noise + 1e-5, (gap, noise)
    for h in opt._handles.values():
        assert int(opt.state[h.param]["step"]) == 6, h.name


def _raised_in_chain(exc: BaseException, text: str) -> bool:
    """Whether ``text`` is in ``exc`` or an exception it was raised while handling (the capture's end
    may raise on its own after the error that stopped it)."""
    while exc is not None:
        if text in str(exc):
            return True
        exc = exc.__context__
    return False


def test_cuda_graph_capture_of_a_fused_update_is_refused_before_writing():
    """A hand-made CUDA graph of the whole step (torch's recipe: warm-up on a side stream, then forward
    and backward captured) would bake this step's scalars into every replay: the capture is refused by
    name at the first fused update, before its step counter moves; opt.step() under capture likewise."""
    model = llama()
    opt = forge_optim.AdamW(model, lr=1e-3)
    ids = data(1)[0]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        train(model, opt, [ids, ids])  # warm-up: states exist, steps are 2
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    steps = {id(p): int(st["step"]) for p, st in opt.state.items()}
    for text, body in (("is being updated inside a CUDA graph capture",
                        lambda: model(input_ids=ids, labels=ids).loss.backward()),
                       ("step() is running inside a CUDA graph capture", opt.step)):
        graph = torch.cuda.CUDAGraph()
        with pytest.raises(Exception) as info:
            with torch.cuda.graph(graph):
                body()
        assert _raised_in_chain(info.value, text), info.value
        del info  # its traceback holds the refused backward's graph, whose uses are pending
        gc.collect()
        torch.cuda.synchronize()
        assert {id(p): int(st["step"]) for p, st in opt.state.items()} == steps, text
    train(model, opt, [ids])  # the optimizer still works after a refused capture
    assert all(int(st["step"]) == 3 for st in opt.state.values())


def test_model_cast_to_fp16_after_the_optimizer_is_refused_on_gpu():
    """On the GPU a late model.half() would have sent an fp16 weight to the Triton kernel, which stores
    fp32 or bf16 words: refused by name before the launch, weights and states untouched."""
    model = llama()
    opt = forge_optim.AdamW(model, lr=1e-3)
    ids = data(1)[0]
    train(model, opt, [ids])
    model.half()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    states = states_snapshot(opt)
    with pytest.raises(RuntimeError, match="is torch.float16 now"):
        model(input_ids=ids, labels=ids).loss.backward()
    torch.cuda.synchronize()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert_states_unchanged(opt, states)


def test_bf16_model_bf16_and_int8_state_train():
    for state in ("bf16", "int8"):
        model = llama(dtype=torch.bfloat16)
        opt = forge_optim.AdamW(model, lr=3e-3, state_dtype=state)
        ids = data(1)[0]
        losses = []
        for _ in range(15):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward(); opt.step(); opt.zero_grad()
            losses.append(loss.item())
        assert losses[-1] < losses[0] - 1.0, (state, losses)
        assert all(torch.isfinite(p).all() for p in model.parameters())


def test_no_weight_sized_gradient_on_gpu():
    """Peak memory of a backward through one big fused linear stays far below one gradient's size."""
    lin = torch.nn.Linear(4096, 8192, bias=False, device="cuda", dtype=torch.bfloat16)
    opt = forge_optim.AdamW(lin, lr=1e-4)
    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)  # activations << weight
    lin(x).float().square().mean().backward()  # states allocated here
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    lin(x).float().square().mean().backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    grad_bytes = lin.weight.numel() * 2  # a bf16 gradient would be 64 MiB
    assert extra < grad_bytes / 2, (extra, grad_bytes)
    assert lin.weight.grad is None and int(opt.state[lin.weight]["step"]) == 2


def test_input_gradient_and_retained_graph_on_gpu():
    """The Triton path of FusedWeight.asked(): an input gradient (torch.autograd.grad w.r.t. the input
    embeddings) steps no weight and no state, eager and compiled; a retained graph backpropagated twice
    is one step with the summed gradient (the kernel's accumulate mode into the fp32 buffer, then the
    buffered update): SGD, linear in the gradient, against torch.optim.SGD on the kernel's gradient of
    the equivalent single pass (1.5x the loss), to fp32 round-off."""
    torch.backends.cuda.matmul.allow_tf32 = False
    base = llama(attn="eager")
    model = copy.deepcopy(base)
    opt = forge_optim.AdamW(model, lr=1e-3, weight_decay=0.01)
    ids = data(1)[0]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for m in (model, torch.compile(model)):
        e = model.get_input_embeddings()(ids).detach().requires_grad_(True)
        g = torch.autograd.grad(m(inputs_embeds=e, labels=ids).loss, e)[0]
        assert torch.isfinite(g).all() and g.abs().sum() > 0
    torch.cuda.synchronize()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert not any(opt.state.get(h.param) for h in opt._handles.values())

    model, ref_model = copy.deepcopy(base), copy.deepcopy(base)
    opt = forge_optim.SGD(model, lr=1e-2)
    ref = torch.optim.SGD(ref_model.parameters(), lr=1e-2)
    overwrite = kernel_gradients(ref_model)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward(retain_graph=True)
    (0.5 * loss).backward()
    opt.step()
    (1.5 * ref_model(input_ids=ids, labels=ids).loss).backward()
    overwrite()
    ref.step()
    assert all(h.buffer is None for h in opt._handles.values())
    gap = rel_diff(model, ref_model)
    print(f"retained graph, two passes, vs torch.optim.SGD on the summed gradient: {gap:.2e}")
    assert gap <= 1e-6, gap


@pytest.mark.parametrize("dx_in_graph", [True, False], ids=["current form", "dX inside the op (older form)"])
def test_compiled_reused_weight_takes_one_step_on_gpu(dx_in_graph, monkeypatch):
    """CUDA inductor and the Triton backend: one fused linear used twice per forward, and two forwards
    before one backward, compiled, take one AdamW step with the summed gradient (fp32 state), as
    torch.optim.AdamW on the same compiled model does. The older backward form made inductor copy the
    weight and copy that copy back after the update (erasing it: 1x lr off) until the ops learned to write
    the update back into the tensor they are handed."""
    import torch._inductor.config as inductor_config

    from forge_optim import autograd as fautograd

    monkeypatch.setattr(fautograd, "_TRACE_DX_IN_GRAPH", dx_in_graph)
    monkeypatch.setattr(inductor_config, "force_disable_caches", True)

    torch.manual_seed(0)
    model = ReusedLinear(64, 32).cuda()
    ref_model = copy.deepcopy(model)
    opt = forge_optim.AdamW(model, lr=1e-2, weight_decay=0.01, backend="triton", state_dtype="fp32")
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.01, foreach=False)
    torch._dynamo.reset()
    cmodel, cref = torch.compile(model), torch.compile(ref_model)
    g = torch.Generator(device="cuda").manual_seed(2)
    for _ in range(4):
        xs = [torch.randn(4, 16, 64, device="cuda", generator=g) for _ in range(2)]
        for m, o in ((cmodel, opt), (cref, ref)):
            sum(m(x).square().mean() for x in xs).backward()
            o.step()
            o.zero_grad()
    gap = rel_diff(model, ref_model)
    print(f"reused weight, compiled, dx_in_graph={dx_in_graph}: forge vs torch.optim {gap:.2e}")
    assert gap <= 1e-4, gap
    assert all(int(opt.state[h.param]["step"]) == 4 for h in opt._handles.values())
