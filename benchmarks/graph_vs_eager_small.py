"""GPU time (CUDA graph replay) against eager launch rate of the fused update at BT=512 on the smallest
Llama-3.1-8B shape (1024x4096) and 4096x4096, for two tuned configs. At 1024x4096 the kernel (~33 us)
is as short as the Python update path, so eager do_bench timings there measure the host (NOTES.md, eighth
session: an apparent +60% in one A/B run was the host; the graph replays were equal).

    PYTHONPATH=src python3 benchmarks/graph_vs_eager_small.py LABEL
"""
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_kernel, from any working directory
from bench_kernel import fixed_job, make_states, rotating_inputs
from forge_optim.backends.triton_backend import TritonBackend
from forge_optim.kernels import launch as L
from forge_optim.rules import RULES
rule = RULES["AdamW"]; group = dict(rule.defaults, lr=1e-4, weight_decay=0.1)
for M, N in [(1024, 4096), (4096, 4096)]:
    gen = torch.Generator(device="cuda").manual_seed(1)
    nxt = rotating_inputs(512, M, N, gen, 3)
    for cfg in (L.SMALL_BT_CONFIGS[10], L.SMALL_BT_CONFIGS[7]):
        be = TritonBackend(config=cfg)
        W = (torch.randn(M, N, device="cuda", generator=gen) * 0.02).bfloat16()
        job = fixed_job(W, make_states("bf16", M, N, gen, rule, group), rule, group)
        def fn():
            d, x = nxt(); be.update(job, d, x)
        fn(); torch.cuda.synchronize()
        t = do_bench(fn, warmup=10, rep=100, return_mode="median")
        try:
            d, x = nxt()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                be.update(job, d, x)
            tg = do_bench(g.replay, warmup=10, rep=100, return_mode="median")
        except Exception as e:
            tg = float("nan"); print("graph failed", type(e).__name__, flush=True)
        print(sys.argv[1], M, N, cfg.short()[:20], f"eager {t:.4f} graph {tg:.4f}", flush=True)
