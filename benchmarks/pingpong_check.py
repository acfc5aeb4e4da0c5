"""Does the Gluon ping-pong kernel compute the Triton kernel's update, and is it faster? (H200)

    PYTHONPATH=src python benchmarks/pingpong_check.py [--quick]

1. Correctness on fresh random data, AdamW:
   - fp32 W and fp32 m/v against an fp64 reference of the same update from G = dY^T X (fp64):
     max |error| relative to max |update|, for the ping-pong and the Triton kernel side by side;
   - bf16 W/m/v with stochastic rounding: fraction of elements whose bits differ from the Triton
     kernel's (the two GEMMs sum in different orders, so a few roundings may differ);
   - a non-finite gradient row: the count and the untouched weights must match the Triton kernel's.
   Shapes include a ragged one (1000 x 3008, BT = 515).
2. Timing (do_bench median, same run): ping-pong configs, the Triton kernel's best known configs,
   cuBLAS wgrad (b), wgrad + torch._fused_adamw_ (c), for the Llama-3.1-8B shapes.
Writes $OUT/pingpong_check.json (else benchmarks/results/pingpong-<date>.json).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from forge_optim.backends.base import StateView  # noqa: E402
from forge_optim.kernels import launch as L  # noqa: E402
from forge_optim.kernels import pingpong as PP  # noqa: E402
from forge_optim.rules import RULES  # noqa: E402
from forge_optim.rules.base import StateSpec  # noqa: E402

from bench_kernel import rotating_inputs, unfused_step  # noqa: E402  (this script's folder is on sys.path)
from results_path import result_path  # noqa: E402  (benchmarks/ is the script directory)

RULE = RULES["AdamW"]
GROUP = dict(RULE.defaults, lr=1e-3, weight_decay=0.1)
COEFFS = RULE.padded(RULE.coefficients(GROUP, {}, 10))
PP_CONFIGS = [PP.PingPongConfig(BN=64, epi_n=2, stages=6),
              PP.PingPongConfig(BN=64, epi_n=4, stages=3, consumer_regs=112, progs_per_sm=2, maxnreg=80),
              PP.PingPongConfig(BN=128, epi_n=4, stages=4)]
# --explore: more schedules, timing only
EXPLORE_CONFIGS = [PP.PingPongConfig(BN=128, epi_n=4, stages=5),
                   PP.PingPongConfig(BN=128, BK=32, epi_n=4, stages=8),
                   PP.PingPongConfig(BN=64, BK=32, epi_n=4, stages=6, consumer_regs=112, progs_per_sm=2, maxnreg=80),
                   PP.PingPongConfig(BN=64, epi_n=4, stages=3, consumer_regs=104, progs_per_sm=2, maxnreg=80,
                                     group_size=16),
                   PP.PingPongConfig(BN=64, epi_n=4, stages=3, consumer_regs=112, progs_per_sm=2, maxnreg=80,
                                     group_size=4)]


def views_of(m, v):
    return (StateView(StateSpec("exp_avg", 0), m), StateView(StateSpec("exp_avg_sq", 1, nonnegative=True), v), None)


def run_triton(W, m, v, dy, x, nf, cfg, sr=True, key=(11, 22, 33)):
    return L.launch(weight=W, dy=dy, x=x, rule_update=RULE.triton_update, coeffs=COEFFS, states=views_of(m, v),
                    nonfinite=nf, stochastic_weight=sr, stochastic_state=sr, key_weight=key[0],
                    key_states=(key[1], key[2], 0), config=cfg)


def run_pp(W, m, v, dy, x, nf, cfg, sr=True, key=(11, 22, 33)):
    PP.launch(weight=W, dy=dy, x=x, rule_update=RULE.triton_update, coeffs=COEFFS, states=views_of(m, v),
              nonfinite=nf, stochastic_weight=sr, stochastic_state=sr, key_weight=key[0],
              key_states=(key[1], key[2], 0), config=cfg)


def reference(W, m, v, dy, x):
    """fp64 AdamW step (torch.optim.AdamW's formula) from the fp64 gradient."""
    G = dy.double().t() @ x.double()
    decay, omb1, beta2, omb2, eps, step_size, bc2_sqrt = COEFFS[:7]
    w = W.double() * decay
    m2 = m.double() + omb1 * (G - m.double())
    v2 = v.double() * beta2 + omb2 * G * G
    w = w - step_size * (m2 / (v2.sqrt() / bc2_sqrt + eps))
    return w, m2, v2


def correctness(M, N, BT, cfg, gen, tcfg):
    out = {}
    dy = torch.randn(BT, M, device="cuda", generator=gen).bfloat16()
    x = torch.randn(BT, N, device="cuda", generator=gen).bfloat16()
    W0 = torch.randn(M, N, device="cuda", generator=gen) * 0.02
    m0 = torch.randn(M, N, device="cuda", generator=gen) * 1e-2
    v0 = (torch.randn(M, N, device="cuda", generator=gen) * 1e-2).square()
    rw, rm, rv = reference(W0, m0, v0, dy, x)
    upd = (rw - W0.double()).abs().max().item()
    for name, fn, c in (("pingpong", run_pp, cfg), ("triton", run_triton, tcfg)):
        W, m, v = W0.clone(), m0.clone(), v0.clone()
        nf = torch.zeros((), dtype=torch.int64, device="cuda")
        fn(W, m, v, dy, x, nf, c, sr=False)
        torch.cuda.synchronize()
        out[f"{name}_fp32_w_err_rel_update"] = ((W.double() - rw).abs().max().item()) / upd
        out[f"{name}_fp32_m_err_rel"] = ((m.double() - rm).abs().max() / rm.abs().max()).item()
        out[f"{name}_fp32_v_err_rel"] = ((v.double() - rv).abs().max() / rv.abs().max()).item()
        out[f"{name}_nonfinite"] = int(nf.item())
    # bf16 W/m/v, stochastic rounding: bit agreement with the Triton kernel
    Wb, mb, vb = W0.bfloat16(), m0.bfloat16(), v0.bfloat16()
    res = {}
    for name, fn, c in (("pingpong", run_pp, cfg), ("triton", run_triton, tcfg)):
        W, m, v = Wb.clone(), mb.clone(), vb.clone()
        fn(W, m, v, dy, x, None, c, sr=True)
        res[name] = (W, m, v)
    torch.cuda.synchronize()
    for i, s in enumerate("wmv"):
        a = res["pingpong"][i].view(torch.int16)
        b = res["triton"][i].view(torch.int16)
        out[f"bf16_sr_{s}_bits_differ_frac"] = (a != b).float().mean().item()
        out[f"bf16_sr_{s}_max_ulp"] = (a.int() - b.int()).abs().max().item()
    # a non-finite gradient row: dY[k, r] = inf makes row r of G non-finite
    r = M // 3
    dyn = dy.clone()
    dyn[BT // 2, r] = float("inf")
    nfs, rows_ok = {}, {}
    for name, fn, c in (("pingpong", run_pp, cfg), ("triton", run_triton, tcfg)):
        W, m, v = Wb.clone(), mb.clone(), vb.clone()
        nf = torch.zeros((), dtype=torch.int64, device="cuda")
        fn(W, m, v, dyn, x, nf, c, sr=True)
        torch.cuda.synchronize()
        nfs[name] = int(nf.item())
        rows_ok[name] = bool(torch.equal(W[r], Wb[r]) and torch.equal(m[r], mb[r]) and torch.equal(v[r], vb[r]))
        assert torch.isfinite(W.float()).all(), f"{name}: non-finite weight written"
    out["nonfinite_count"] = nfs
    out["nonfinite_row_untouched"] = rows_ok
    return out


def timing(M, N, BT, gen, tcfgs):
    row = dict(shape=f"{M}x{N}", BT=BT)
    nxt = rotating_inputs(BT, M, N, gen, 3)

    def bench(fn):
        return do_bench(fn, warmup=10, rep=60, return_mode="median")

    row["wgrad_ms"] = bench(lambda: (lambda d, x: d.t() @ x)(*nxt()))
    W = (torch.randn(M, N, device="cuda", generator=gen) * 0.02).bfloat16()
    m = (torch.randn(M, N, device="cuda", generator=gen) * 1e-3).bfloat16()
    v = (torch.randn(M, N, device="cuda", generator=gen) * 1e-3).square().bfloat16()
    row["unfused_ms"] = bench(unfused_step(W, m, v, nxt))
    nf = torch.zeros((), dtype=torch.int64, device="cuda")
    for c in PP_CONFIGS:
        try:
            fn = lambda: run_pp(W, m, v, *nxt(), nf, c)  # noqa: E731
            fn()
            torch.cuda.synchronize()
            row[c.short()] = bench(fn)
        except Exception as err:  # noqa: BLE001
            row[c.short()] = repr(err)[:300]
    if BT == 512:  # what the non-finite count costs: the first config without it
        fn = lambda: run_pp(W, m, v, *nxt(), None, PP_CONFIGS[0])  # noqa: E731
        fn()
        torch.cuda.synchronize()
        row["nocount " + PP_CONFIGS[0].short()] = bench(fn)
    for c in tcfgs:
        fn = lambda: run_triton(W, m, v, *nxt(), nf, c)  # noqa: E731
        fn()
        torch.cuda.synchronize()
        row["triton " + c.short()] = bench(fn)
    pp = min(v for k, v in row.items() if k.startswith("pingpong") and isinstance(v, float))
    tr = min(v for k, v in row.items() if k.startswith("triton") and isinstance(v, float))
    row["best_pingpong_ms"], row["best_triton_ms"] = pp, tr
    row["pp_over_c"], row["triton_over_c"], row["pp_over_b"] = pp / row["unfused_ms"], tr / row["unfused_ms"], pp / row["wgrad_ms"]
    assert torch.isfinite(W.float()).all()
    del nxt, W, m, v
    torch.cuda.empty_cache()
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--explore", action="store_true", help="timing only, PP_CONFIGS + EXPLORE_CONFIGS")
    a = ap.parse_args()
    if a.explore:
        PP_CONFIGS.extend(EXPLORE_CONFIGS)
    gen = torch.Generator(device="cuda").manual_seed(0)
    results = dict(date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                   device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                   command=" ".join([sys.executable] + sys.argv), correctness=[], timing=[])
    path = result_path("pingpong_check.json", "pingpong")

    def save():
        path.write_text(json.dumps(results, indent=1) + "\n")

    tcfg = L.GPU_TEST_CONFIG
    for (M, N, BT) in [] if a.explore else [(1000, 3008, 515), (4096, 4096, 512), (14336, 4096, 2048)]:
        for cfg in PP_CONFIGS[:1] + ([] if a.quick else PP_CONFIGS[1:2]):
            try:
                r = correctness(M, N, BT, cfg, gen, tcfg)
            except Exception as err:  # noqa: BLE001
                r = dict(error=repr(err)[:500])
            r.update(shape=f"{M}x{N}", BT=BT, config=cfg.short())
            results["correctness"].append(r)
            print(json.dumps(r), flush=True)
            save()
    # the shipped BT=512 winners (the 16-warp la1 tiles, twenty-seventh session's tables) and two
    # multi-program tiles, so the ping-pong is compared with what users run
    by_name = {c.short(): c for c in L.SMALL_BT_CONFIGS}
    small = [by_name[n] for n in ("128x256x64 w16 s3 g8 p1 e8 tma la1", "256x128x64 w16 s3 g8 p1 e8 tma la1")]
    small += [L.SMALL_BT_CONFIGS[-2], L.SMALL_BT_CONFIGS[4]]
    if a.explore:  # the Triton kernel with more resident programs per SM (register caps, small spills)
        small += [L.KernelConfig(64, 64, 64, 4, 3, 8, 5, 4, maxnreg=96, prefetch=True),
                  L.KernelConfig(64, 64, 64, 4, 2, 8, 5, 8, maxnreg=96, prefetch=True),
                  L.KernelConfig(64, 64, 64, 4, 2, 8, 6, 8, maxnreg=80, prefetch=True)]
    large = [L.LARGE_BT_CONFIGS[0], L.LARGE_BT_CONFIGS[4]]
    shapes = [(4096, 4096), (14336, 4096)] if a.explore else [(4096, 4096), (14336, 4096), (1024, 4096)]
    for (M, N) in shapes:
        for BT in ([512] if a.quick else [512, 2048]):
            r = timing(M, N, BT, gen, small if BT <= 1024 else large)
            results["timing"].append(r)
            print(json.dumps(r), flush=True)
            save()
    if not a.quick and not a.explore:
        r = timing(128256, 4096, 512, gen, small)
        results["timing"].append(r)
        print(json.dumps(r), flush=True)
    save()
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
