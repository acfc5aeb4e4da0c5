"""On CUDA (run on the device: pytest -m gpu): the optimizer with the Triton backend, eager and
compiled, against torch.optim; and the memory promise (no weight-sized gradient)."""
import copy

import pytest
import torch

import forge_optim
from helpers import rel_diff

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip("transformers")


def llama(hidden=256, layers=2, vocab=512, dtype=torch.float32):
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                   num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=128, attn_implementation="sdpa")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).to("cuda", dtype)


def data(n, vocab=512, bs=2, seq=64):
    g = torch.Generator(device="cuda").manual_seed(1)
    return [torch.randint(0, vocab, (bs, seq), device="cuda", generator=g) for _ in range(n)]


def train(model, opt, batches):
    for ids in batches:
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_triton_backend_fp32_matches_torch_adamw(compiled):
    torch.backends.cuda.matmul.allow_tf32 = False
    model = llama()
    ref_model = copy.deepcopy(model)
    opt = forge_optim.AdamW(model, lr=1e-3, weight_decay=0.01)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-3, weight_decay=0.01, foreach=False)
    assert opt._backend_for(model.lm_head.weight).name == "triton"
    m, r = (torch.compile(model), torch.compile(ref_model)) if compiled else (model, ref_model)
    batches = data(5)
    train(m, opt, batches)
    train(r, ref, batches)
    assert rel_diff(model, ref_model) <= 1e-5


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
