"""Hugging Face models: parity with torch.optim, tied embeddings, gradient checkpointing, autocast."""
import contextlib
import copy

import pytest
import torch
import torch.utils.checkpoint

import forge_optim
from helpers import ReusedLinear, adam_bound, rel_diff

transformers = pytest.importorskip("transformers")

TOL = 1e-5


def tiny_llama(tie=False, seed=0):
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                   tie_word_embeddings=tie, attn_implementation="eager")
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg)


def hf_batches(n, seed=3, bs=2, seq=12):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 64, (bs, seq), generator=g) for _ in range(n)]


def train(model, opt, data, sched=None, autocast=False):
    model.train()
    losses = []
    for ids in data:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_llama_matches_torch_adamw(tie):
    model = tiny_llama(tie)
    ref_model = copy.deepcopy(model)
    opt = forge_optim.AdamW(model, lr=1e-2, weight_decay=0.01)
    torch_fused_model = copy.deepcopy(ref_model)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.01, foreach=False)
    torch_fused = torch.optim.AdamW(torch_fused_model.parameters(), lr=1e-2, weight_decay=0.01, fused=True)
    fused = set(opt.fused_modules())
    assert "model.layers.0.self_attn.q_proj" in fused and "model.layers.1.mlp.down_proj" in fused
    assert ("lm_head" in fused) == (not tie)
    scheds = [torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=4) for o in (opt, ref, torch_fused)]
    data = hf_batches(4)
    train(model, opt, data, scheds[0])
    train(ref_model, ref, data, scheds[1])
    train(torch_fused_model, torch_fused, data, scheds[2])
    assert rel_diff(model, ref_model) <= adam_bound(rel_diff(torch_fused_model, ref_model))


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_gradient_checkpointing(reentrant):
    model = tiny_llama()
    ref_model = copy.deepcopy(model)
    kwargs = {"use_reentrant": reentrant}
    for m in (model, ref_model):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        if reentrant:
            m.enable_input_require_grads()  # reentrant checkpoints need an input that requires grad
    torch_fused_model = copy.deepcopy(ref_model)
    opt = forge_optim.AdamW(model, lr=1e-2)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, foreach=False)
    torch_fused = torch.optim.AdamW(torch_fused_model.parameters(), lr=1e-2, fused=True)
    data = hf_batches(3)
    train(model, opt, data)
    train(ref_model, ref, data)
    train(torch_fused_model, torch_fused, data)
    assert rel_diff(model, ref_model) <= adam_bound(rel_diff(torch_fused_model, ref_model))
    for h in opt._handles.values():
        assert h.pending_fwd == 0 and h.pending_rec == 0 and h.buffer is None


def _backward_gemms(model, opt, ids):
    from test_invariants import _OpRecorder

    loss = model(input_ids=ids, labels=ids).loss
    rec = _OpRecorder()
    with rec:
        loss.backward()
    opt.step()
    opt.zero_grad()
    return sum(name in ("mm", "addmm") for name, _ in rec.ops)


def test_checkpoint_recompute_skips_each_blocks_last_linear_as_torch_does():
    """A non-reentrant checkpoint's recompute stops once the block's last saved tensor is packed.
    nn.Linear packs its operands before its GEMM, so torch never recomputes a block's last linear
    (down_proj); the fused linear must not either (it did: one extra GEMM per layer)."""
    ids = hf_batches(1)[0]
    counts = {}
    for name in ("forge", "torch", "forge-no-ckpt", "torch-no-ckpt"):
        model = tiny_llama()
        if "no-ckpt" not in name:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        opt = (forge_optim.AdamW(model, lr=1e-2) if name.startswith("forge")
               else torch.optim.AdamW(model.parameters(), lr=1e-2))
        counts[name] = _backward_gemms(model, opt, ids)
    assert counts["forge-no-ckpt"] == counts["torch-no-ckpt"]
    # the recompute: 6 of the 7 linears of each of the 2 layers
    assert counts["torch"] - counts["torch-no-ckpt"] == 2 * 6
    assert counts["forge"] == counts["torch"]


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "autocast-bf16"])
@pytest.mark.parametrize("hooks", ["checkpoint", "save_on_cpu"])
def test_saved_tensor_hooks_give_the_same_weights_as_none(hooks, autocast):
    """Under saved-tensor hooks the fused linear saves its operands through a separate node (before
    its GEMM): the same update, bit for bit, as without hooks, with and without autocast's casts."""
    model, plain = tiny_llama(), tiny_llama()
    if hooks == "checkpoint":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = forge_optim.AdamW(model, lr=1e-2, weight_decay=0.01)
    opt_plain = forge_optim.AdamW(plain, lr=1e-2, weight_decay=0.01)
    data = hf_batches(3)
    ctx = torch.autograd.graph.save_on_cpu() if hooks == "save_on_cpu" else contextlib.nullcontext()
    with ctx:
        losses = train(model, opt, data, autocast=autocast)
    assert losses == train(plain, opt_plain, data, autocast=autocast)
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(p, q), name
    for h in opt._handles.values():
        assert h.pending_fwd == 0 and h.pending_rec == 0 and h.buffer is None


class _CheckpointedReuse(torch.nn.Module):
    """A weight used twice inside one checkpointed block, then a head outside it."""

    def __init__(self):
        super().__init__()
        self.block, self.head = ReusedLinear(8, 8), torch.nn.Linear(8, 3)

    def forward(self, x, ckpt):
        h = torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False) if ckpt else self.block(x)
        return self.head(h)


@pytest.mark.parametrize("case", ["plain", "frozen", "accumulate"])
def test_checkpointed_reused_weight_steps_as_without_checkpoint(case):
    """Pending uses of a weight used twice in a checkpointed block (recompute included) end in the
    same single update as without the checkpoint; also with a frozen weight and under accumulate()."""
    models = []
    for ckpt in (True, False):
        torch.manual_seed(0)
        model = _CheckpointedReuse()
        if case == "frozen":
            model.block.b.weight.requires_grad_(False)
        opt = forge_optim.AdamW(model, lr=1e-2)
        g = torch.Generator().manual_seed(1)
        for step in range(3):
            xs = [torch.randn(4, 8, generator=g, requires_grad=step % 2 == 0) for _ in range(2)]
            if case == "accumulate":
                with opt.accumulate():
                    model(xs[0], ckpt).square().mean().backward()
            model(xs[1], ckpt).square().mean().backward()
            opt.step()
            opt.zero_grad()
        for h in opt._handles.values():
            assert h.pending_fwd == 0 and h.pending_rec == 0 and h.buffer is None
        models.append(model)
    for (name, p), q in zip(models[0].named_parameters(), models[1].parameters()):
        assert torch.equal(p, q), name


def test_autocast_bf16_trains_and_tracks_torch():
    model = tiny_llama()
    ref_model = copy.deepcopy(model)
    opt = forge_optim.AdamW(model, lr=1e-3)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-3, foreach=False)
    data = hf_batches(3)
    train(model, opt, data, autocast=True)
    train(ref_model, ref, data, autocast=True)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    # torch's weight gradient is rounded to bf16 by the autocast GEMM, forge's stays fp32: close, not equal
    assert rel_diff(model, ref_model) < 5e-3
    assert rel_diff(model, ref_model) > 0


def test_bf16_model_trains_with_bf16_state():
    model = tiny_llama().to(torch.bfloat16)
    opt = forge_optim.AdamW(model, lr=3e-3)
    assert opt.state_dtype_of(model.lm_head.weight) == "bf16"
    data = hf_batches(1) * 12
    losses = train(model, opt, data)
    assert losses[-1] < losses[0] - 0.5
    assert opt.state[model.lm_head.weight]["exp_avg"].dtype == torch.bfloat16


def test_three_d_and_non_contiguous_inputs():
    lin = torch.nn.Linear(6, 5)
    ref = copy.deepcopy(lin)
    opt = forge_optim.AdamW(lin, lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    for _ in range(3):
        x = torch.randn(4, 6, 3).transpose(1, 2)  # [4, 3, 6], non-contiguous
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        lin(xa).square().sum().backward()
        ref(xb).square().sum().backward()
        opt.step(); opt.zero_grad(); ref_opt.step(); ref_opt.zero_grad()
        torch.testing.assert_close(xa.grad, xb.grad)
    assert rel_diff(lin, ref) <= TOL


def _trainer_run(model, optimizers, out_dir, steps=3, accumulation=1):
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": torch.randint(0, 64, (12,), generator=g)} for _ in range(8)]
    for d in data:
        d["labels"] = d["input_ids"].clone()
    args = transformers.TrainingArguments(
        output_dir=str(out_dir), max_steps=steps, per_device_train_batch_size=2, max_grad_norm=0,
        gradient_accumulation_steps=accumulation, report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True,
        seed=0)
    transformers.Trainer(model=model, args=args, train_dataset=data, optimizers=optimizers).train()


def test_hf_trainer_with_the_readme_recipe(tmp_path):
    """README's Trainer recipe (optimizers=(opt, scheduler), max_grad_norm=0, no Trainer accumulation,
    sparse_embeddings=False because the Trainer takes the norm of every gradient for its log) trains
    to what the same Trainer does with torch.optim.AdamW, to fp32 round-off."""
    model = tiny_llama()
    ref_model = copy.deepcopy(model)
    opt = forge_optim.AdamW(model, lr=1e-2, weight_decay=0.01, sparse_embeddings=False)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.01, foreach=False)
    for m, o, d in ((model, opt, "forge"), (ref_model, ref, "torch")):
        _trainer_run(m, (o, torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 - s / 10)), tmp_path / d)
    h = opt._handles["model.layers.0.mlp.up_proj"]
    assert int(opt.state[h.param]["step"]) == 3
    assert rel_diff(model, ref_model) <= 1e-5


def test_hf_trainer_gradient_accumulation_is_exact(tmp_path):
    """The Trainer's own gradient accumulation (gradient_accumulation_steps=2): accelerate marks the
    non-final micro-steps, where the fused layers add their gradient to a buffer; the last micro-step's
    backward applies one update with the summed gradient. Same result as the Trainer with
    torch.optim.AdamW, one optimizer step per two micro-batches, and no "several updates" warning."""
    import warnings

    model = tiny_llama()
    ref_model = copy.deepcopy(model)
    opt = forge_optim.AdamW(model, lr=1e-2, weight_decay=0.01, sparse_embeddings=False)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.01, foreach=False)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*backward passes since the last")
        for m, o, d in ((model, opt, "forge"), (ref_model, ref, "torch")):
            _trainer_run(m, (o, torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 - s / 10)), tmp_path / d,
                         accumulation=2)
    h = opt._handles["model.layers.0.mlp.up_proj"]
    assert int(opt.state[h.param]["step"]) == 3 and h.buffer is None
    assert rel_diff(model, ref_model) <= 1e-5



def test_accelerate_accumulate_loop_is_exact():
    """A plain accelerate loop with ``accelerator.accumulate(model)`` (gradient_accumulation_steps=3): the
    non-final micro-steps buffer the fused gradients, the last applies them. Two optimizer steps give
    bit for bit what ``opt.accumulate()`` gives in a loop of one's own (tested against torch.optim in
    test_accumulate_and_checkpoints.py); the first equals the same accelerate loop with torch.optim.AdamW
    to fp32 round-off (from the second on, Adam amplifies round-off for every implementation alike:
    helpers.adam_bound)."""
    import accelerate
    from accelerate.state import AcceleratorState, GradientState

    model = tiny_llama()
    ref_model, own_model = copy.deepcopy(model), copy.deepcopy(model)
    batches = hf_batches(6)
    after_first = {}

    def accelerate_loop(m, opt, name):
        AcceleratorState._reset_state()
        GradientState._reset_state()
        acc = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=3)
        pm, popt = acc.prepare(m, opt)
        for i, ids in enumerate(batches):
            with acc.accumulate(pm):
                acc.backward(pm(input_ids=ids, labels=ids).loss)
                popt.step()
                popt.zero_grad()
            if i == 2:
                after_first[name] = copy.deepcopy(m)
        GradientState._reset_state()

    opt = forge_optim.AdamW(model, lr=1e-2, weight_decay=0.01)
    accelerate_loop(model, opt, "forge")
    accelerate_loop(ref_model, torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.01, foreach=False),
                    "torch")
    own = forge_optim.AdamW(own_model, lr=1e-2, weight_decay=0.01)
    for i, ids in enumerate(batches):
        with own.accumulate() if i % 3 != 2 else contextlib.nullcontext():
            (own_model(input_ids=ids, labels=ids).loss / 3).backward()
        if i % 3 == 2:
            own.step()
            own.zero_grad()
    h = opt._handles["model.layers.0.mlp.up_proj"]
    assert int(opt.state[h.param]["step"]) == 2 and h.buffer is None
    assert rel_diff(model, own_model) == 0.0
    assert rel_diff(after_first["forge"], after_first["torch"]) <= 1e-6


def test_a_training_step_runs_no_op_that_would_sync_the_host():
    """A FORGE step of a Llama (forward, backward with the fused updates, opt.step() for the embedding's rows
    and the norms) runs no op whose output size depends on tensor values, and reads no tensor value on the
    host but the step counters (CPU tensors on any device): on a GPU it never waits for the device."""
    from test_invariants import _DATA_DEPENDENT, _OpRecorder

    model = tiny_llama()
    opt = forge_optim.AdamW(model, lr=1e-2, weight_decay=0.01)
    for i, ids in enumerate(hf_batches(3)):
        rec = _OpRecorder()
        with rec:
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
        if i:  # (the first step makes the states from host constants)
            ran = rec.names([st["step"] for st in opt.state.values() if "step" in st])
            assert not _DATA_DEPENDENT & ran, sorted(_DATA_DEPENDENT & ran)
    assert type(model.model.embed_tokens).__name__ == "ForgeEmbedding"
