"""A small Llama-style model laid out like torchtitan's, and its tensor/sequence-parallel plans."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class Attention(nn.Module):
    def __init__(self, dim, n_heads):
        super().__init__()
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (w(x).view(b, s, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim, n_heads, hidden):
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim)
        self.attention = Attention(dim, n_heads)
        self.ffn_norm = nn.RMSNorm(dim)
        self.feed_forward = FeedForward(dim, hidden)

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class TinyLlama(nn.Module):
    def __init__(self, vocab=64, dim=32, n_heads=4, hidden=64, n_layers=2):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, n_heads, hidden) for _ in range(n_layers))
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx):
        h = self.tok_embeddings(idx)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def parallelize(model: TinyLlama, mesh, sequence_parallel: bool) -> TinyLlama:
    """torchtitan's Llama plan: q/k/v/w1/w3 column-wise, wo/w2 row-wise, output column-wise."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                                   parallelize_module)

    seq = Shard(1) if sequence_parallel else Replicate()
    top = {"output": ColwiseParallel(input_layouts=seq, output_layouts=Replicate())}
    if sequence_parallel:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
        top["norm"] = SequenceParallel()
    parallelize_module(model, mesh, top)
    for block in model.layers:
        plan = {
            "attention.wq": ColwiseParallel(input_layouts=seq),
            "attention.wk": ColwiseParallel(input_layouts=seq),
            "attention.wv": ColwiseParallel(input_layouts=seq),
            "attention.wo": RowwiseParallel(output_layouts=seq),
            "feed_forward.w1": ColwiseParallel(input_layouts=seq),
            "feed_forward.w3": ColwiseParallel(input_layouts=seq),
            "feed_forward.w2": RowwiseParallel(output_layouts=seq),
        }
        if sequence_parallel:
            plan["attention_norm"] = SequenceParallel()
            plan["ffn_norm"] = SequenceParallel()
        parallelize_module(block, mesh, plan)
    return model


def main():
    """torchrun --nproc-per-node 2 examples/tp_llama.py  (gloo on CPU, NCCL on GPUs)."""
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import forge_optim

    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = "cuda" if use_cuda else "cpu"
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    mesh = init_device_mesh(device, (world,))
    torch.manual_seed(0)  # same init on every rank; parallelize() shards it
    with torch.device(device):
        model = parallelize(TinyLlama(), mesh, sequence_parallel=True)
    opt = forge_optim.AdamW(model, lr=3e-3, weight_decay=0.1)
    if rank == 0:
        print(f"fused on each rank's shard: {len(opt.fused_modules())} linears")
    g = torch.Generator(device=device).manual_seed(0)  # identical batches on every TP rank
    for step in range(20):
        start = torch.randint(0, 64, (4, 1), generator=g, device=device)
        stride = torch.randint(1, 4, (4, 1), generator=g, device=device)
        idx = (start + stride * torch.arange(16, device=device)) % 64  # learnable sequences
        logits = model(idx)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, 64), idx[:, 1:].reshape(-1))
        loss.backward()  # each rank updates its local shard of every fused weight here
        opt.step()
        opt.zero_grad()
        if rank == 0 and step % 5 == 0:
            print(f"step {step} loss {loss.item():.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
