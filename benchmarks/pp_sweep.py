"""Ping-pong (Gluon) schedules against the shipped Triton tile, bf16 W and bf16 (or, with --modes int8, int8)
m/v, AdamW, at BT=512 on the Llama-3.1-8B shapes (do_bench median, same run, rotating operands); for bf16
states this device's tabled Triton tile for the key is timed too, where it is not one of the two named.
With --check-bits, each ping-pong schedule first runs once beside the Triton kernel (the tests' reference tile) on
clones of the same W, states and inputs, and the row records whether every byte of W, the states and the
non-finite count agreed (`bits_equal`): a schedule that no test names can be read off a sweep only where that
holds. do_bench times each call with the host launch path in the way, which can only make the ping-pong look
slower at small shapes (pp_b2b.py, NOTES twenty-ninth session).

    PYTHONPATH=src python3 benchmarks/pp_sweep.py [--shapes 4096x4096,...] [--bts 512] [--modes bf16,int8]
        [--set tabled|slots] [--configs 'BN=128,BK=32,stages=10;...' (PingPongConfig fields; replaces --set)]
        [--check-bits] [--wgrad]
With --wgrad, cuBLAS's wgrad GEMM alone (``dY.t() @ X`` into a preallocated bf16 G, the same rotating inputs) is
timed in the same row (``ms["wgrad cublas"]``, ``pp_over_wgrad``): issue 3's (b).
Writes $OUT/pp_sweep.json (else benchmarks/results/pp-sweep-<date>.json).
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from bench_kernel import make_states, rotating_inputs  # noqa: E402
from forge_optim.backends.triton_backend import _clone_view  # noqa: E402
from forge_optim.kernels import launch as L  # noqa: E402
from forge_optim.kernels import pingpong as PP  # noqa: E402
from forge_optim.rules import RULES  # noqa: E402
from results_path import result_path  # noqa: E402  (benchmarks/ is the script directory)
from pp_table import bf16_key  # noqa: E402
from forge_optim.kernels import tuned  # noqa: E402

TRITON = ["128x256x64 w16 s3 g8 p1 e8 tma la1", "64x128x64 w4 s3 g8 p3 e8 tma r168 ev"]
TRITON_INT8 = ["128x256x64 w16 s3 g8 p1 e8 tma la1 ev", "256x128x64 w16 s3 g8 p1 e8 tma la1"]
WGRAD = "wgrad cublas"
RULE = RULES["AdamW"]
GROUP = dict(RULE.defaults, lr=1e-3, weight_decay=0.1)
COEFFS = RULE.padded(RULE.coefficients(GROUP, {}, 10))


def run(kernel, W, views, dy, x, nf, cfg):
    kw = dict(weight=W, dy=dy, x=x, rule_update=RULE.triton_update, coeffs=COEFFS, states=tuple(views) + (None,),
              nonfinite=nf, stochastic_weight=True, stochastic_state=True, key_weight=11, key_states=(22, 33, 0))
    return PP.launch(config=cfg, **kw) if kernel == "pingpong" else L.launch(config=cfg, **kw)


def parse_configs(text: str) -> list:
    """'BN=128,BK=32,stages=10;BN=64' -> [PingPongConfig(BN=128, BK=32, stages=10), PingPongConfig(BN=64)]."""
    out = []
    for c in text.split(";"):
        if not c.strip():
            continue
        fields = {}
        for f in c.split(","):
            k, _, v = f.partition("=")
            if k.strip() not in PP.PingPongConfig.__dataclass_fields__ or not v.strip().isdigit():
                raise SystemExit(f"--configs: {f!r} is not FIELD=INT for a PingPongConfig field "
                                 f"({', '.join(PP.PingPongConfig.__dataclass_fields__)})")
            fields[k.strip()] = int(v)
        out.append(PP.PingPongConfig(**fields))
    return out


def same_bits(cfg, W, views, dy, x) -> bool:
    """Does ``cfg`` write the Triton reference tile's bytes (W, every state and scale, the non-finite count) from
    the same inputs? Both run on clones: the tensors being timed are not touched."""
    outs = []
    for kernel, c in (("pingpong", cfg), ("triton", L.GPU_TEST_CONFIG)):
        W2 = W.clone()
        v2 = [_clone_view(v) for v in views]
        nf = torch.zeros((), dtype=torch.int64, device=W.device)
        run(kernel, W2, v2, dy, x, nf, c)
        outs.append([W2, nf] + [t for v in v2 for t in (v.data, v.scale) if t is not None])
    torch.cuda.synchronize()
    return all(torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)) for a, b in zip(*outs))


def pp_configs():
    """The tuner's two-slot ping-pong candidates (slot_configs() times the others against them)."""
    return [c for c in PP.CANDIDATES if c.state_slots == 2]


def slot_configs():
    """Ping-pong schedules with 3-6 tiles' W/states in shared memory (state_slots, NOTES thirtieth session)
    beside the tabled 2-slot ones, the dY/X ring made shorter to make room."""
    C = PP.PingPongConfig
    return [C(BN=128, epi_n=4, stages=5, group_size=16), C(BN=128, epi_n=4, stages=5), C(BN=64, epi_n=2, stages=6),
            C(BN=128, epi_n=4, stages=3, state_slots=3), C(BN=128, epi_n=4, stages=3, group_size=16, state_slots=3),
            C(BN=128, epi_n=8, stages=3, state_slots=3), C(BN=128, epi_n=4, stages=2, state_slots=3),
            C(BN=64, epi_n=2, stages=6, state_slots=4), C(BN=64, epi_n=2, stages=5, state_slots=5),
            C(BN=64, epi_n=2, stages=6, state_slots=5), C(BN=64, epi_n=2, stages=4, state_slots=6),
            C(BN=64, epi_n=2, stages=3, state_slots=6)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="4096x4096,14336x4096,4096x14336,1024x4096,128256x4096")
    ap.add_argument("--bts", default="512")
    ap.add_argument("--modes", default="bf16", help="state modes: bf16 (pp_configs()), int8 (pingpong.INT8_CONFIGS)")
    ap.add_argument("--set", default="tabled", choices=["tabled", "slots"],
                    help="bf16 ping-pong schedules: tabled (pp_configs()) or slots (slot_configs())")
    ap.add_argument("--configs", default="",
                    help="explicit ping-pong schedules instead of --set: ';'-separated PingPongConfig fields, e.g. "
                         "'BN=128,BK=32,epi_n=4,stages=10,group_size=16;BN=64,stages=6'")
    ap.add_argument("--check-bits", action="store_true",
                    help="run each ping-pong schedule once beside the Triton reference tile first: row['bits_equal']")
    ap.add_argument("--wgrad", action="store_true", help="also time cuBLAS's dY.t() @ X alone (issue 3's (b))")
    a = ap.parse_args()
    explicit = parse_configs(a.configs)
    gen = torch.Generator(device="cuda").manual_seed(0)
    known = {c.short(): c for c in L.ALL_TUNED_CONFIGS}
    res = dict(date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
               device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               command=" ".join([sys.executable] + sys.argv), rows=[])
    path = result_path("pp_sweep.json", "pp-sweep")
    for shape, BT, mode in [(sh, bt, md) for sh in a.shapes.split(",") for bt in map(int, a.bts.split(","))
                            for md in a.modes.split(",")]:
        M, N = map(int, shape.split("x"))
        nxt = rotating_inputs(BT, M, N, gen, 3)
        W = (torch.randn(M, N, device="cuda", generator=gen) * 0.02).bfloat16()
        views = make_states(mode, M, N, gen, RULE, GROUP)
        nf = torch.zeros((), dtype=torch.int64, device="cuda")
        row = dict(shape=shape, BT=BT, states=mode, ms={})
        bf16_set = explicit or (slot_configs() if a.set == "slots" else pp_configs())
        tnames, pps = (TRITON_INT8, PP.INT8_CONFIGS) if mode == "int8" else (TRITON, bf16_set)
        cands = [("triton " + n, lambda c=known[n]: run("triton", W, views, *nxt(), nf, c)) for n in tnames]
        tab = tuned.load_table(res["device"]).get(bf16_key(M, N, BT)) if mode == "bf16" else None
        tab = L.KernelConfig(**tab) if tab is not None and tab.get("kernel") != "pingpong" else None
        if tab is not None and tab.short() not in tnames:
            # this device's tabled Triton tile for the key (the named two are the H100's best): the baseline
            # pp_table.py compares with must be the best Triton tile this device has
            cands.insert(0, ("triton tabled " + tab.short(), lambda c=tab: run("triton", W, views, *nxt(), nf, c)))
        cands += [(c.short(), lambda c=c: run("pingpong", W, views, *nxt(), nf, c)) for c in pps]
        if a.wgrad:
            G = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)

            def wgrad(G=G):
                d, xx = nxt()
                torch.mm(d.t(), xx, out=G)
            cands.insert(0, (WGRAD, wgrad))
        row["configs"] = {c.short(): PP.table_dict(c) for c in pps}  # pp_table.py builds a winner from these
        if a.check_bits:
            dy0, x0 = nxt()
            row["bits_equal"] = {}
            for c in pps:
                try:
                    row["bits_equal"][c.short()] = same_bits(c, W, views, dy0, x0)
                except Exception as err:  # noqa: BLE001
                    row["bits_equal"][c.short()] = repr(err)[:200]
            print(f"{shape:>12} BT={BT:<5} {mode} bits equal to the Triton tile: {row['bits_equal']}", flush=True)
        for name, fn in cands:
            try:
                fn()
                torch.cuda.synchronize()
                row["ms"][name] = do_bench(fn, warmup=10, rep=50, return_mode="median")
            except Exception as err:  # noqa: BLE001
                row["ms"][name] = repr(err)[:200]
        t = {k: v for k, v in row["ms"].items() if isinstance(v, float)}
        bt = min(v for k, v in t.items() if k.startswith("triton"))
        pp_t = {k: v for k, v in t.items() if not k.startswith("triton") and k != WGRAD}
        if pp_t:
            bp_name = min(pp_t, key=pp_t.get)
            row.update(best_triton_ms=bt, best_pp=bp_name, best_pp_ms=t[bp_name], pp_over_triton=t[bp_name] / bt)
            if WGRAD in t:
                row.update(pp_over_wgrad=t[bp_name] / t[WGRAD], triton_over_wgrad=bt / t[WGRAD])
            top = sorted((v, k) for k, v in t.items())[:5]
            vs_wgrad = (f"vs wgrad {row['pp_over_wgrad']:.3f} (triton {row['triton_over_wgrad']:.3f})  "
                        if WGRAD in t else "")
            print(f"{shape:>12} BT={BT:<5} {mode} triton {bt:.4f}  best pp {t[bp_name]:.4f} ({bp_name})  "
                  f"ratio {row['pp_over_triton']:.3f}  {vs_wgrad}top5 {[(k, round(v, 4)) for v, k in top]}",
                  flush=True)
        else:
            print(f"{shape:>12} BT={BT:<5} {mode} triton {bt:.4f}  no ping-pong schedule ran: {row['ms']}", flush=True)
        res["rows"].append(row)
        path.write_text(json.dumps(res, indent=1) + "\n")
        del nxt, W, views
        torch.cuda.empty_cache()
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
