"""Launch each case of the fused kernel once inside a profiler range, for Nsight Compute (ncu).

    bash benchmarks/ncu_h200.sh OUTDIR      (runs this under ncu and writes the reports)

Cases (bf16 W; AdamW; one forced config each, no tuning; ``python3 benchmarks/ncu_fused.py a,b`` runs
only the named ones): the H200's old BT=512 winner (64x64, 4 programs/SM) on 4096x4096 with bf16 and
int8 states and on 14336x4096; the 64x128 3-programs config on 4096x4096 (wider tiles were 1.2-2x slower
per element: why?); the BT=8192 config; the fp32 accumulate mode (mainloop + an 8 B/element
read-modify-write, no rule); torch's wgrad GEMM and ``_fused_adamw_`` on the 4096x4096 operands, the
baseline (c); the H100's BT=512 winner (128x256, 16 warps) at BT=64 (the update alone) and 512 with bf16
and int8 states; and the 64x128 tile with int8 states at BT=64 and 512 (the division-free block scale's
slowdown, profiled on both trees); the evict-first twin of the 128x256 tile (the H100's int8 BT=512 winner
since 2026-12-07) on 4096x4096 and 14336x4096. Every launch is preceded by a warm-up outside the profiled range
(compilation, TMA allocator). The order of the profiled launches is printed, so that the report's kernel
IDs can be mapped to cases.
"""
from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from bench_kernel import fixed_job, make_states, unfused_step  # noqa: E402
from forge_optim.backends.triton_backend import TritonBackend  # noqa: E402
from forge_optim.kernels import launch as L  # noqa: E402
from forge_optim.kernels import pingpong as PP  # noqa: E402
from forge_optim.rules import RULES  # noqa: E402

# NCU_LOOKAHEAD=n: profile the configs with KernelConfig.epi_lookahead = n
_LA = int(os.environ.get("NCU_LOOKAHEAD", "0"))
_la = (lambda c: dataclasses.replace(c, epi_lookahead=_LA)) if _LA else (lambda c: c)
_KNOWN = {c.short(): c for c in L.ALL_TUNED_CONFIGS}
SMALL = _la(_KNOWN["64x64x64 w4 s3 g8 p4 e4 tma r128 pf la1"])  # 64x64, 4 programs/SM
WIDE = _la(_KNOWN["64x128x64 w4 s3 g8 p3 e8 tma r168"])  # 64x128, 3 programs/SM
BIG = _KNOWN["128x256x64 w16 s3 g8 p1 e8 tma la1"]  # the H100's BT=512 winner at 4096x4096 (2026-12-06)
BIG_EV = _KNOWN["128x256x64 w16 s3 g8 p1 e8 tma la1 ev"]  # its evict-first twin, the H100's int8 winner (2026-12-07)
LARGE = _la(_KNOWN["128x256x64 w16 s4 g8 p1 e8 tma la1"])  # the BT=8192 winner

CASES = [  # name, M, N, BT, state mode, config ("accumulate" mode uses no states)
    ("small-bf16-4096", 4096, 4096, 512, "bf16", SMALL),
    ("small-int8-4096", 4096, 4096, 512, "int8", SMALL),
    ("small-bf16-14336", 14336, 4096, 512, "bf16", SMALL),
    ("wide-bf16-4096", 4096, 4096, 512, "bf16", WIDE),
    ("large-bf16-4096-bt8192", 4096, 4096, 8192, "bf16", LARGE),
    ("small-accumulate-4096", 4096, 4096, 512, "accumulate", SMALL),
    # the update alone (BT=64: the GEMM is ~4% of it) and BT=512, bf16 against int8 states, on the
    # H100's BT=512 winners (twenty-second session: why int8 moves 2/3 of the bytes in the same time)
    ("big-bf16-4096-bt64", 4096, 4096, 64, "bf16", BIG),
    ("big-int8-4096-bt64", 4096, 4096, 64, "int8", BIG),
    ("big-bf16-4096", 4096, 4096, 512, "bf16", BIG),
    ("big-int8-4096", 4096, 4096, 512, "int8", BIG),
    ("bigev-int8-4096", 4096, 4096, 512, "int8", BIG_EV),
    ("bigev-int8-14336", 14336, 4096, 512, "int8", BIG_EV),
    ("small-bf16-4096-bt64", 4096, 4096, 64, "bf16", SMALL),
    ("small-int8-4096-bt64", 4096, 4096, 64, "int8", SMALL),
    # int8 on the 4-warp 64x128 tile, which the division-free block scale (f3b7a4e) made 24-29% slower
    # although its static count fell 12% (twenty-third session): profile it on both trees
    ("wide-int8-4096", 4096, 4096, 512, "int8", WIDE),
    ("wide-int8-4096-bt64", 4096, 4096, 64, "int8", WIDE),
    # the Gluon ping-pong kernel (bf16 states only): its 64x128 tiles ran 2-2.5x slower per element than
    # its 64x64 ones (fifth session, cause never profiled); the 2-programs-per-SM 64x64 schedule was its best
    ("pp64-bf16-4096", 4096, 4096, 512, "pp-bf16", PP.PingPongConfig(BN=64, epi_n=2, stages=6)),
    ("pp64x2-bf16-4096", 4096, 4096, 512, "pp-bf16",
     PP.PingPongConfig(BN=64, epi_n=4, stages=3, consumer_regs=112, progs_per_sm=2, maxnreg=80)),
    ("pp128-bf16-4096", 4096, 4096, 512, "pp-bf16", PP.PingPongConfig(BN=128, epi_n=4, stages=4)),
    # the schedule the H100 table names for 4096x14336, 128256x4096 (2026-12-07), on the MLP's up/gate shape
    ("pp128s5-bf16-14336", 14336, 4096, 512, "pp-bf16", PP.PingPongConfig(BN=128, epi_n=4, stages=5, group_size=16)),
]


def main():
    only = set(sys.argv[1].split(",")) if len(sys.argv) > 1 else None
    gen = torch.Generator(device="cuda").manual_seed(0)
    rule = RULES["AdamW"]
    group = dict(rule.defaults, lr=1e-4, weight_decay=0.1)
    prepared = []
    for name, M, N, BT, mode, cfg in CASES:
        if only and name not in only:
            continue
        dy = torch.randn(BT, M, device="cuda", generator=gen).bfloat16()
        x = torch.randn(BT, N, device="cuda", generator=gen).bfloat16()
        if mode == "pp-bf16":
            W = (torch.randn(M, N, device="cuda", generator=gen) * 0.02).bfloat16()
            views = make_states("bf16", M, N, gen, rule, group)
            coeffs = rule.padded(rule.coefficients(group, {}, 10))
            nf = torch.zeros((), dtype=torch.int64, device="cuda")

            def fn(W=W, views=views, dy=dy, x=x, cfg=cfg, coeffs=coeffs, nf=nf):
                PP.launch(weight=W, dy=dy, x=x, rule_update=rule.triton_update, coeffs=coeffs,
                          states=tuple(views) + (None,) * (3 - len(views)), nonfinite=nf, stochastic_weight=True,
                          stochastic_state=True, key_weight=11, key_states=(22, 33, 0), config=cfg)
            fn()
            torch.cuda.synchronize()
            prepared.append((f"{name} [{cfg.short()}]", fn))
            continue
        os.environ["FORGE_TRITON_CONFIG"] = cfg.env()
        backend = TritonBackend()
        if mode == "accumulate":
            buf = torch.zeros(M, N, device="cuda")

            def fn(backend=backend, buf=buf, dy=dy, x=x):
                backend.accumulate(buf, dy, x)
        else:
            W = (torch.randn(M, N, device="cuda", generator=gen) * 0.02).bfloat16()
            views = make_states(mode, M, N, gen, rule, group)
            job = fixed_job(W, views, rule, group, nonfinite=torch.zeros((), dtype=torch.int64, device="cuda"))

            def fn(backend=backend, job=job, dy=dy, x=x):
                backend.update(job, dy, x)
        fn()  # compile + warm
        torch.cuda.synchronize()
        prepared.append((f"{name} [{cfg.short()}]", fn))
        if name in ("small-bf16-4096", "big-bf16-4096-bt64"):  # the unfused baseline (c), same operands
            Wb = (torch.randn(M, N, device="cuda", generator=gen) * 0.02).bfloat16()
            unfused = unfused_step(Wb, torch.zeros_like(Wb), torch.zeros_like(Wb), lambda dy=dy, x=x: (dy, x))
            unfused()
            prepared.append((f"torch wgrad GEMM, then _fused_adamw_, {M}x{N} BT={BT} bf16", unfused))
        torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for i, (name, fn) in enumerate(prepared):
        print(f"PROFILED {i}: {name}", flush=True)
        fn()
        torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
