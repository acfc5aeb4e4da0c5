"""Fidelity study of forge_optim (issue 6): exactness, stochastic rounding, convergence, low LR.

    PYTHONPATH=src python3 benchmarks/fidelity.py <part> [--device cuda] [--out-dir DIR] [--time-budget S]

Parts (each writes ``<out-dir>/fidelity-<part>.json`` after every unit of work, so a run cut short
by its time budget or by the device's limit still leaves its finished units; re-running the same
command with the same ``--out-dir`` skips units that are already complete):

  exactness            one fused nn.Linear per Llama-3.1-8B shape, fp32 weights and fp32 state, 10
                       steps on fresh random data: per step, max relative difference of forge's weight
                       to torch.optim.<Rule>(foreach=False) stepped with dY^T X (fp32, no TF32), for
                       every fused rule.
  stochastic-rounding  the bf16 dead-zone microbenchmark (paper Appendix C): bf16 weights at 0.75
                       (ULP 2^-8), SGD lr=1, a true update of a quarter ULP through a fused Linear, 100
                       steps: mean weight change under round-to-nearest, hash SR and the fp32 reference;
                       on CUDA also the kernel time with and without SR (same run, same config).
  convergence          a Llama-style byte-level LM trained from scratch on the Python standard
                       library's own .py files (held-out split by file), one run per (method, seed).
  low-lr               continue the fp32-master checkpoint at lr 1e-5: fp32-master vs forge bf16 with
                       and without SR (and BF16-everywhere torch AdamW).
  report               merge the part files into one results JSON and write docs/fidelity.md's
                       generated blocks and the PNGs.
"""
from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import math
import os
import platform
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
for _p in (ROOT / "src", ROOT / "tests"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import forge_optim  # noqa: E402
from forge_optim.backends import make_backend  # noqa: E402

PARTS = ("exactness", "stochastic-rounding", "convergence", "low-lr")
LLAMA8B_SHAPES = [(1024, 4096), (4096, 4096), (14336, 4096), (4096, 14336), (128256, 4096)]
SMALL_SHAPES = [(96, 384), (256, 512), (1000, 3000)]
DEFAULT_OUT = "runs/fidelity"
# Fixed Triton configs (FORGE_TRITON_CONFIG): no autotuning, so each rule/state variant compiles once.
# exactness: fp32 operands (ieee dot) in a small-footprint tile, pointer loads.
EXACT_CONFIG = "BM=64,BN=128,BK=32,num_warps=4,num_stages=3,group_size=8,progs_per_sm=1,epi_split=1,use_tma=0"
# training: the v1 winner at BT >= 2048 (kernel/launch.py LARGE_BT_CONFIGS[0]).
TRAIN_CONFIG = "BM=128,BN=128,BK=64,num_warps=8,num_stages=4,group_size=8,progs_per_sm=1,epi_split=4"


def set_triton_config(args, default: str) -> str:
    """Export the kernel config choice to FORGE_TRITON_CONFIG (workers inherit it); returns it."""
    cfg = args.triton_config or default
    if cfg == "auto":
        os.environ.pop("FORGE_TRITON_CONFIG", None)
    else:
        os.environ["FORGE_TRITON_CONFIG"] = cfg
    return cfg


# ---------------------------------------------------------------------------------------------
# common

def now_iso() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, timeout=10).stdout.strip() or None
    except Exception:
        return None


def resolve_device(name: str | None) -> torch.device:
    return torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.machine()}, {os.cpu_count()} cores)"


def meta(args, device: torch.device) -> dict:
    try:
        import triton
        tv = triton.__version__
    except Exception:
        tv = None
    return dict(date=now_iso(), device=str(device), device_name=device_name(device), torch=torch.__version__,
                triton=tv, python=platform.python_version(), commit=git_commit(),
                script_sha256=hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16],
                command=" ".join(["benchmarks/fidelity.py"] + list(getattr(args, "argv", []) or sys.argv[1:])),
                time_budget_s=args.time_budget)


def part_path(out_dir, part: str) -> Path:
    return Path(out_dir) / f"fidelity-{part}.json"


def load_json(path) -> dict | None:
    try:
        return json.loads(Path(path).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def write_json(path, obj) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=_json_default))
    os.replace(tmp, path)


def _json_default(o):
    if isinstance(o, (torch.dtype, torch.device, Path)):
        return str(o)
    if isinstance(o, tuple):
        return list(o)
    raise TypeError(type(o))


def finite_or_none(x: float):
    return x if isinstance(x, (int, float)) and math.isfinite(x) else None


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------------------------
# 1. exactness

def rule_cases():
    """rule -> (forge kwargs, reference factory). torch.optim with foreach=False; Lion: ReferenceLion."""
    from reference_optimizers import ReferenceLion

    O = torch.optim
    return {
        "AdamW": (dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1),
                  lambda ps, **kw: O.AdamW(ps, foreach=False, **kw)),
        "Adam": (dict(lr=1e-3, weight_decay=0.1), lambda ps, **kw: O.Adam(ps, foreach=False, **kw)),
        "NAdam": (dict(lr=2e-3, weight_decay=0.1), lambda ps, **kw: O.NAdam(ps, foreach=False, **kw)),
        "RAdam": (dict(lr=1e-3, weight_decay=0.1), lambda ps, **kw: O.RAdam(ps, foreach=False, **kw)),
        "Lion": (dict(lr=1e-4, weight_decay=0.1), lambda ps, **kw: ReferenceLion(ps, **kw)),
        "RMSprop": (dict(lr=1e-3, weight_decay=0.1, momentum=0.9, centered=True),
                    lambda ps, **kw: O.RMSprop(ps, foreach=False, **kw)),
        "Adagrad": (dict(lr=1e-2, weight_decay=0.1, lr_decay=0.01, initial_accumulator_value=0.1),
                    lambda ps, **kw: O.Adagrad(ps, foreach=False, **kw)),
        "SGD": (dict(lr=1e-2, momentum=0.9, weight_decay=0.1),
                lambda ps, **kw: O.SGD(ps, foreach=False, **kw)),
    }


def parse_shapes(spec: str) -> list[tuple[int, int]]:
    if spec == "llama8b":
        return list(LLAMA8B_SHAPES)
    if spec == "small":
        return list(SMALL_SHAPES)
    return [tuple(int(v) for v in s.lower().split("x")) for s in spec.split(",")]


def exactness_unit(rule: str, shape: tuple[int, int], steps: int, bt: int, backend: str,
                   device: torch.device, seed: int = 0) -> dict:
    """One fused fp32 Linear [Dout, Din] under forge (fp32 state) vs torch.optim on dY^T X."""
    dout, din = shape
    kwargs, ref_factory = rule_cases()[rule]
    torch.manual_seed(seed)
    lin = nn.Linear(din, dout, bias=False, device=device, dtype=torch.float32)
    model = nn.Sequential(lin)
    ref_w = nn.Parameter(lin.weight.detach().clone())
    w0 = lin.weight.detach().clone()
    opt = getattr(forge_optim, rule)(model, state_dtype="fp32", backend=backend, **kwargs)
    if len(opt.fused_modules()) != 1:
        raise RuntimeError(f"expected one fused module, got {opt.unfused_linears()}")
    ref = ref_factory([ref_w], **kwargs)
    # a second reference fed FORGE's own gradient (the backend's accumulate mode sums the same tiles
    # in the same order as its fused update): what is left is the update arithmetic alone
    own_w = nn.Parameter(lin.weight.detach().clone())
    own = ref_factory([own_w], **kwargs)
    grad_backend = make_backend(backend, device, 256)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    rows = []
    for step in range(1, steps + 1):
        x = torch.randn(bt, din, device=device, generator=gen)
        dy = torch.randn(bt, dout, device=device, generator=gen)
        model(x).backward(dy)
        opt.step()
        opt.zero_grad(set_to_none=True)
        ref_w.grad = dy.t() @ x  # the cuBLAS / torch gradient, fp32 (TF32 is off)
        ref.step()
        ref.zero_grad(set_to_none=True)
        g_own = torch.zeros(dout, din, device=device)
        grad_backend.accumulate(g_own, dy, x)
        own_w.grad = g_own
        own.step()
        own.zero_grad(set_to_none=True)
        with torch.no_grad():
            w, r, o = lin.weight.detach(), ref_w.detach(), own_w.detach()
            diff = (w - r).abs()
            max_abs = diff.max().item()
            scale = r.abs().max().item()
            moved = (r - w0).abs().max().item()
            rows.append(dict(step=step, max_rel=max_abs / max(scale, 1e-30), max_abs=max_abs,
                             rel_to_update=max_abs / max(moved, 1e-30),
                             n_over_1e5=int((diff > 1e-5 * scale).sum().item()),
                             own_grad_max_rel=(w - o).abs().max().item() / max(o.abs().max().item(), 1e-30),
                             finite=bool(torch.isfinite(w).all().item())))
        del x, dy, g_own
    be = opt._backends.get(lin.weight.device)
    out = dict(rule=rule, shape=f"{dout}x{din}", Dout=dout, Din=din, BT=bt, hyper=kwargs, steps=rows,
               max_rel=max(r["max_rel"] for r in rows), step1_max_rel=rows[0]["max_rel"],
               own_grad_max_rel=max(r["own_grad_max_rel"] for r in rows),
               backend=getattr(be, "name", backend), triton_fallbacks=getattr(be, "fallbacks", None))
    del opt, ref, own, model, lin, ref_w, own_w, w0
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def cmd_exactness(args) -> dict:
    device = resolve_device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    path = part_path(args.out_dir, "exactness")
    prev = load_json(path) if args.resume else None
    done = {(u["rule"], u["shape"]): u for u in (prev or {}).get("units", []) if u.get("complete")}
    rules = list(rule_cases()) if args.rules == "all" else args.rules.split(",")
    shapes = parse_shapes(args.shapes)
    backend = args.backend
    triton_cfg = set_triton_config(args, EXACT_CONFIG)
    if backend == "triton" and device.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    res = dict(part="exactness", meta=meta(args, device), rules=rules,
               shapes=[f"{m}x{n}" for m, n in shapes], steps=args.steps, BT=args.bt, backend=args.backend,
               triton_config=triton_cfg,
               criterion="max |W_forge - W_ref| / max |W_ref| <= 1e-5 at every step (fp32 round-off)",
               units=list(done.values()), skipped=[], complete=False)
    t0 = time.time()
    if device.type == "cuda" and backend != "torch":
        res["warmup_s"] = warm_kernel_cache(rules, device)
        print(f"exactness: compiled one kernel variant per rule in parallel, {res['warmup_s']} s", flush=True)
    for shape in shapes:  # small shapes first: a budget cut loses the largest ones
        for rule in rules:
            key = (rule, f"{shape[0]}x{shape[1]}")
            if key in done:
                continue
            if time.time() - t0 > args.time_budget:
                res["skipped"].append(dict(rule=rule, shape=key[1], reason="time budget"))
                continue
            ts = time.time()
            try:
                u = exactness_unit(rule, shape, args.steps, args.bt, backend, device, seed=args.seed)
                u["complete"] = True
            except torch.OutOfMemoryError as e:  # pragma: no cover - GPU only
                torch.cuda.empty_cache()
                u = dict(rule=rule, shape=key[1], complete=False, error=f"OOM: {str(e)[:200]}")
            u["seconds"] = round(time.time() - ts, 2)
            res["units"].append(u)
            msg = (f"max_rel over {args.steps} steps {u['max_rel']:.2e} (step 1 {u['step1_max_rel']:.2e})"
                   if u.get("complete") else u.get("error"))
            print(f"exactness {rule:8s} {key[1]:>12s}: {msg} [{u['seconds']:.1f}s]", flush=True)
            res["elapsed_s"] = round(time.time() - t0, 1)
            write_json(path, res)
    res["complete"] = not res["skipped"] and all(u.get("complete") for u in res["units"])
    res["elapsed_s"] = round(time.time() - t0, 1)
    write_json(path, res)
    return res


def _warm_rule(rule: str) -> str:
    try:
        exactness_unit(rule, (128, 512), 1, 64, "triton", torch.device("cuda"))
        return ""
    except Exception as e:  # noqa: BLE001 - reported, and the real unit will show it again
        return f"{rule}: {type(e).__name__}: {str(e)[:200]}"


def warm_kernel_cache(rules: list[str], device: torch.device) -> float:
    """Run one tiny step of every rule side by side in spawned processes: each compiles its kernel
    variant (the same specialization as the real shapes) into Triton's disk cache, so the serial
    units below do not compile one rule after another."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    t0 = time.time()
    with ProcessPoolExecutor(max_workers=min(len(rules), max(1, (os.cpu_count() or 2) - 1)),
                             mp_context=multiprocessing.get_context("spawn")) as ex:
        for err in ex.map(_warm_rule, rules):
            if err:
                print(f"warm-up failed: {err}", flush=True)
    return round(time.time() - t0, 1)


# ---------------------------------------------------------------------------------------------
# 2. stochastic rounding and the bf16 dead-zone

def bf16_ulp(w: float) -> float:
    return 2.0 ** (math.floor(math.log2(abs(w))) - 7)


def dead_zone_run(method: str, shape, steps: int, w0: float, step_frac: float, backend: str,
                  device: torch.device, seed: int = 0) -> dict:
    """SGD lr=1 with a constant gradient of step_frac ULP(w0) on every element, through a fused
    Linear (forge) or torch.optim.SGD. Returns the mean change per step."""
    dout, din = shape
    g = step_frac * bf16_ulp(w0)  # a power of two for step_frac = 1/4: exact in bf16 and fp32
    dtype = torch.float32 if method == "fp32-reference" else torch.bfloat16
    lin = nn.Linear(din, dout, bias=False, device=device, dtype=dtype)
    with torch.no_grad():
        lin.weight.fill_(w0)
    model = nn.Sequential(lin)
    x = torch.ones(1, din, device=device, dtype=dtype)
    dy = torch.full((1, dout), g, device=device, dtype=dtype)  # dY^T X = g everywhere
    if method in ("forge-sr", "forge-rne"):
        opt = forge_optim.SGD(model, lr=1.0, stochastic_rounding=(method == "forge-sr"), backend=backend, seed=seed)
        assert len(opt.fused_modules()) == 1
    else:  # fp32-reference (fp32 W) or torch-bf16 (torch.optim.SGD on bf16 W: round-to-nearest)
        opt = torch.optim.SGD(model.parameters(), lr=1.0, foreach=False)
    w_init = lin.weight.detach().float().clone()
    curve = []
    for _ in range(steps):
        model(x).backward(dy)
        opt.step()
        opt.zero_grad(set_to_none=True)
        curve.append((lin.weight.detach().float() - w_init).mean().item())
    delta = lin.weight.detach().float() - w_init
    return dict(method=method, mean_change=delta.mean().item(), std_change=delta.std().item(),
                frac_unchanged=(delta == 0).float().mean().item(), curve=curve)


def sr_kernel_cost(device: torch.device, shapes, bts, deadline: float, on_row, rep: int = 50) -> list[dict]:  # pragma: no cover - CUDA
    """Fused AdamW (bf16 W, bf16 m, v) with and without SR: one tuned config, fixed for all modes."""
    from triton.testing import do_bench

    from forge_optim import precision
    from forge_optim.backends.base import StateView, UpdateJob
    from forge_optim.backends.triton_backend import TritonBackend
    from forge_optim.rules import RULES

    rule = RULES["AdamW"]
    coeffs = rule.padded(rule.coefficients(dict(rule.defaults, lr=1e-4, weight_decay=0.1), {}, 10))
    specs = rule.state_specs(dict(rule.defaults))
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    for (M, N) in shapes:
        W = (torch.randn(M, N, device=device, generator=gen) * 0.02).bfloat16()
        views = [StateView(sp, ((torch.randn(M, N, device=device, generator=gen) * 1e-3) ** (2 if sp.nonnegative else 1))
                           .bfloat16()) for sp in specs]
        nf = torch.zeros((), dtype=torch.int64, device=device)
        for BT in bts:
            if time.time() > deadline:
                rows.append(dict(shape=f"{M}x{N}", BT=BT, skipped="time budget"))
                continue
            ins = [(torch.randn(BT, M, device=device, generator=gen).bfloat16(),
                    torch.randn(BT, N, device=device, generator=gen).bfloat16()) for _ in range(2)]
            ctr = [0]

            def make(backend, sr_w, sr_s):
                def fn():
                    ctr[0] += 1
                    d, x = ins[ctr[0] % 2]
                    k = ctr[0]
                    job = UpdateJob(weight=W, rule=rule, coeffs=coeffs, states=views, stochastic_weight=sr_w,
                                    stochastic_state=sr_s, key_weight=precision.stream_key(0, 0, k, 0),
                                    key_states=(precision.stream_key(0, 0, k, 1), precision.stream_key(0, 0, k, 2)),
                                    nonfinite=nf)
                    backend.update(job, d, x)
                return fn

            tuner = TritonBackend()
            make(tuner, True, True)()  # autotune the SR variant
            torch.cuda.synchronize()
            cfg = next((v for k, v in tuner.tuner.cache.items() if k[0] == (M, N)), None)
            fixed = TritonBackend(config=cfg) if cfg is not None else tuner
            row = dict(shape=f"{M}x{N}", BT=BT, config=cfg.short() if cfg is not None else None)
            for name, sw, ss in (("rne", False, False), ("sr_weight", True, False), ("sr_all", True, True)):
                fn = make(fixed, sw, ss)
                fn()
                torch.cuda.synchronize()
                row[name + "_ms"] = do_bench(fn, warmup=10, rep=rep, return_mode="median")
            row["sr_weight_over_rne"] = row["sr_weight_ms"] / row["rne_ms"]
            row["sr_all_over_rne"] = row["sr_all_ms"] / row["rne_ms"]
            rows.append(row)
            on_row(rows)
            print(f"SR cost {M}x{N} BT={BT}: RNE {row['rne_ms']:.3f} ms, SR(W) {row['sr_weight_ms']:.3f}, "
                  f"SR(W,m,v) {row['sr_all_ms']:.3f} ms ({row['sr_all_over_rne']:.3f}x) [{row['config']}]", flush=True)
            del ins
        del W, views
        torch.cuda.empty_cache()
    return rows


def cmd_stochastic_rounding(args) -> dict:
    device = resolve_device(args.device)
    shape = parse_shapes(args.shape)[0]
    if args.backend == "triton" and device.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    triton_cfg = set_triton_config(args, EXACT_CONFIG)  # the dead-zone runs: correctness, not speed
    path = part_path(args.out_dir, "stochastic-rounding")
    ulp = bf16_ulp(args.w0)
    expected = -args.steps * args.step_frac * ulp
    res = dict(part="stochastic-rounding", meta=meta(args, device), shape=f"{shape[0]}x{shape[1]}",
               w0=args.w0, ulp=ulp, step=args.step_frac * ulp, step_in_ulp=args.step_frac, steps=args.steps,
               lr=1.0, backend=args.backend, triton_config=triton_cfg, expected_mean_change=expected, runs={},
               kernel_cost=None,
               criterion="SR mean change within 2% of the fp32 reference; RNE mean change exactly 0",
               complete=False)
    t0 = time.time()
    for method in ("fp32-reference", "forge-sr", "forge-rne", "torch-bf16"):
        r = dead_zone_run(method, shape, args.steps, args.w0, args.step_frac, args.backend, device, args.seed)
        r["ratio_to_expected"] = r["mean_change"] / expected
        res["runs"][method] = r
        print(f"dead-zone {method:15s}: mean change {r['mean_change']:+.6f} (expected {expected:+.6f}, "
              f"ratio {r['ratio_to_expected']:.4f}), unchanged {r['frac_unchanged']:.1%}", flush=True)
        write_json(path, res)
    if device.type == "cuda" and not args.no_kernel_cost:
        os.environ.pop("FORGE_TRITON_CONFIG", None)  # the cost part tunes the SR variant, then fixes that config
        if time.time() - t0 < args.time_budget:
            def on_row(rows):
                res["kernel_cost"] = dict(measured=True, rule="AdamW", weight="bf16", states="bf16", rows=rows)
                write_json(path, res)
            try:
                on_row(sr_kernel_cost(device, parse_shapes(args.cost_shapes), [int(b) for b in args.cost_bts.split(",")],
                                      t0 + args.time_budget, on_row))
            except Exception as e:  # pragma: no cover - CUDA
                res["kernel_cost"] = dict(measured=False, reason=f"error: {e!r}"[:300])
        else:
            res["kernel_cost"] = dict(measured=False, reason="time budget")
    else:
        res["kernel_cost"] = dict(measured=False, reason="no CUDA device: kernel time not measured (CPU run)"
                                  if device.type != "cuda" else "--no-kernel-cost")
    res["elapsed_s"] = round(time.time() - t0, 1)
    res["complete"] = True
    write_json(path, res)
    return res


# ---------------------------------------------------------------------------------------------
# 3. convergence: data

def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def list_stdlib_files(root: str | None = None) -> list[str]:
    """Relative paths of the standard library's .py files (site-packages and caches excluded), sorted."""
    root = root or stdlib_root()
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in ("site-packages", "dist-packages", "__pycache__"))
        for f in sorted(files):
            if f.endswith(".py"):
                out.append(os.path.relpath(os.path.join(d, f), root).replace(os.sep, "/"))
    return sorted(out)


def is_held_out(rel_path: str, val_percent: float) -> bool:
    """Deterministic split by file: the first 32 bits of sha1(relative path), modulo 10000."""
    h = int(hashlib.sha1(rel_path.encode("utf-8")).hexdigest()[:8], 16)
    return (h % 10000) < val_percent * 100


def split_files(paths: list[str], val_percent: float) -> tuple[list[str], list[str]]:
    train = [p for p in paths if not is_held_out(p, val_percent)]
    val = [p for p in paths if is_held_out(p, val_percent)]
    return train, val


def load_corpus(val_percent: float = 5.0, root: str | None = None) -> dict:
    """Byte tokens of the train and held-out files, each file followed by a newline."""
    root = root or stdlib_root()
    paths = list_stdlib_files(root)
    train_files, val_files = split_files(paths, val_percent)

    def cat(files):
        chunks = []
        for rel in files:
            with open(os.path.join(root, rel), "rb") as f:
                chunks.append(f.read())
            chunks.append(b"\n")
        return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8).clone()

    train, val = cat(train_files), cat(val_files)
    fp = hashlib.sha256("\n".join(paths).encode()).hexdigest()[:16]
    return dict(train=train, val=val, root=root, n_files=len(paths), n_train_files=len(train_files),
                n_val_files=len(val_files), train_bytes=train.numel(), val_bytes=val.numel(),
                val_percent=val_percent, file_list_sha256=fp, python=platform.python_version())


# ---------------------------------------------------------------------------------------------
# 3. convergence: model, methods, one run

PRESETS = {
    # CPU smoke/tests: ~0.1M parameters
    "tiny": dict(hidden=64, layers=2, heads=4, ff=176, seq_len=64, batch_size=8, steps=150, warmup=15,
                 lr=3e-3, eval_every=25, eval_batches=4),
    # GPU study: Llama-style, 8 layers, d=768, SwiGLU 2048, byte vocabulary: ~57M parameters
    "small": dict(hidden=768, layers=8, heads=12, ff=2048, seq_len=512, batch_size=16, steps=2000, warmup=100,
                  lr=1e-3, eval_every=100, eval_batches=16),
}

# method -> (weight dtype, autocast bf16 compute, optimizer kind, forge state dtype, stochastic rounding)
METHODS = {
    "fp32-master": ("fp32", True, "torch-fused", None, None),
    "bf16-fused-adamw": ("bf16", False, "torch-fused", None, None),
    "forge-fp32": ("bf16", False, "forge", "fp32", True),
    "forge-bf16-sr": ("bf16", False, "forge", "bf16", True),
    "forge-bf16-rne": ("bf16", False, "forge", "bf16", False),
    "forge-int8": ("bf16", False, "forge", "int8", True),
    "bnb-adamw8bit": ("bf16", False, "bnb", None, None),
    "flashoptim": ("bf16", False, "flashoptim", None, None),
    # extra: the paper's Figure 6 setting (fp32 weights and state, bf16 autocast), exact AdamW in-backward
    "forge-fp32-master": ("fp32", True, "forge", "fp32", None),
}
DEFAULT_METHODS = ["fp32-master", "bf16-fused-adamw", "forge-fp32", "forge-bf16-sr", "forge-bf16-rne", "forge-int8",
                   "bnb-adamw8bit", "flashoptim", "forge-fp32-master"]
MULTI_SEED_METHODS = ("fp32-master", "forge-bf16-sr")


def method_available(method: str, device: torch.device) -> str | None:
    """None if the method can run here, else the reason it is skipped."""
    kind = METHODS[method][2]
    if kind == "bnb":
        try:
            import bitsandbytes  # noqa: F401
        except Exception as e:
            return f"bitsandbytes not importable ({type(e).__name__}: {str(e)[:120]})"
        if device.type != "cuda":
            return "bitsandbytes AdamW8bit needs CUDA here"
    if kind == "flashoptim":
        try:
            import flashoptim  # noqa: F401
        except Exception as e:
            return f"flashoptim not importable ({type(e).__name__}: {str(e)[:120]})"
        if device.type != "cuda":
            return "flashoptim needs CUDA (Triton kernels)"
    return None


def build_model(dims: dict, seed: int, device: torch.device, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=256, hidden_size=dims["hidden"], intermediate_size=dims["ff"],
                      num_hidden_layers=dims["layers"], num_attention_heads=dims["heads"],
                      num_key_value_heads=dims["heads"], max_position_embeddings=max(dims["seq_len"], 64),
                      use_cache=False, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                      pad_token_id=None)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)  # fp32 init from the seed: identical for every method
    return model.to(device=device, dtype=dtype)


def param_groups(model, wd: float) -> list[dict]:
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(method: str, model, lr: float, betas, wd: float, device, backend: str, seed: int):
    _, _, kind, state, sr = METHODS[method]
    groups = param_groups(model, wd)
    info = {}
    if kind == "torch-fused":
        try:
            opt = torch.optim.AdamW(groups, lr=lr, betas=betas, fused=True)
            info["impl"] = "torch.optim.AdamW(fused=True)"
        except Exception as e:  # pragma: no cover - a device without a fused kernel
            opt = torch.optim.AdamW(param_groups(model, wd), lr=lr, betas=betas, foreach=True)
            info["impl"] = f"torch.optim.AdamW(foreach=True) (fused failed: {e!r})"[:200]
    elif kind == "forge":
        opt = forge_optim.AdamW(model, params=groups, lr=lr, betas=betas, state_dtype=state,
                                stochastic_rounding=sr, backend=backend, seed=seed)
        info.update(impl=f"forge_optim.AdamW(state_dtype={state}, stochastic_rounding={opt.stochastic_rounding}, "
                         f"backend={backend})", fused_modules=len(opt.fused_modules()),
                    unfused_linears=sorted(opt.unfused_linears()))
    elif kind == "bnb":  # pragma: no cover - CUDA
        import bitsandbytes as bnb
        opt = bnb.optim.AdamW8bit(groups, lr=lr, betas=betas)
        info["impl"] = f"bitsandbytes {bnb.__version__} AdamW8bit"
    elif kind == "flashoptim":  # pragma: no cover - CUDA
        import flashoptim
        opt = flashoptim.FlashAdamW(groups, lr=lr, betas=betas)
        info["impl"] = f"flashoptim {getattr(flashoptim, '__version__', '?')} FlashAdamW"
    else:
        raise ValueError(method)
    return opt, info


def lr_multiplier(schedule: str, warmup: int, total: int, min_ratio: float = 0.1):
    """Warm-up + cosine, the same schedule as `forge-optim train`; or constant."""
    if schedule == "constant":
        return lambda s: 1.0
    from forge_optim.cli.train import lr_lambda

    return lr_lambda(warmup, total, min_ratio)


def get_batch(data: torch.Tensor, bs: int, seq: int, gen: torch.Generator, device):
    ix = torch.randint(data.numel() - seq - 1, (bs,), generator=gen)
    chunk = data[ix[:, None] + torch.arange(seq + 1)].long()
    return chunk[:, :-1].to(device), chunk[:, 1:].to(device)


def eval_batches(corpus: dict, dims: dict, device) -> list:
    gen = torch.Generator().manual_seed(20261202)  # the same held-out windows for every method and seed
    return [get_batch(corpus["val"], dims["batch_size"], dims["seq_len"], gen, device)
            for _ in range(dims["eval_batches"])]


@torch.no_grad()
def evaluate(model, batches, autocast: bool, device) -> float:
    model.eval()
    tot = 0.0
    for x, y in batches:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            logits = model(input_ids=x).logits
        tot += F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1)).item()
    model.train()
    return tot / len(batches)


def run_one(spec: dict, corpus: dict | None = None) -> dict:
    """Train one (method, seed); writes spec['out_file'] after every eval. Returns the run record."""
    device = torch.device(spec["device"])
    method, seed, dims = spec["method"], spec["seed"], spec["dims"]
    wdtype, autocast, _, _, _ = METHODS[method]
    rec = dict(method=method, seed=seed, dims=dims, steps_planned=spec["steps"], lr=spec["lr"],
               schedule=spec["schedule"], warmup=spec["warmup"], betas=spec["betas"], weight_decay=spec["wd"],
               weights=wdtype, autocast_bf16=autocast, init=spec.get("init_checkpoint"), complete=False,
               train=[], eval=[], started=now_iso())
    why = method_available(method, device)
    if why:
        rec.update(skipped=why)
        write_json(spec["out_file"], rec)
        return rec
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    corpus = corpus or load_corpus(spec["val_percent"])
    dtype = torch.float32 if wdtype == "fp32" else torch.bfloat16
    model = build_model(dims, seed, device, torch.float32)
    if spec.get("init_checkpoint"):
        model.load_state_dict(torch.load(spec["init_checkpoint"], map_location=device))
    model = model.to(dtype)
    model.train()
    rec["params"] = sum(p.numel() for p in model.parameters())
    opt, info = build_optimizer(method, model, spec["lr"], tuple(spec["betas"]), spec["wd"], device,
                                spec["backend"], seed)
    rec["optimizer"] = info
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_multiplier(spec["schedule"], spec["warmup"], spec["steps"]))
    ev = eval_batches(corpus, dims, device)
    gen = torch.Generator().manual_seed(spec.get("data_seed", seed))
    rec["eval"].append([0, evaluate(model, ev, autocast, device)])
    write_json(spec["out_file"], rec)
    step_times = []
    t0 = time.time()
    for step in range(1, spec["steps"] + 1):
        if time.time() > spec["deadline"]:
            rec["stopped"] = f"time budget at step {step - 1}"
            break
        ts = time.time()
        x, y = get_batch(corpus["train"], dims["batch_size"], dims["seq_len"], gen, device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            logits = model(input_ids=x).logits
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        lv = loss.item()  # synchronizes
        step_times.append(time.time() - ts)
        rec["train"].append([step, lv])
        if not math.isfinite(lv):
            rec["stopped"] = f"non-finite loss at step {step}"
            break
        if step % spec["eval_every"] == 0 or step == spec["steps"]:
            rec["eval"].append([step, evaluate(model, ev, autocast, device)])
            warm = step_times[5:] or step_times
            rec["tokens_per_s"] = dims["batch_size"] * dims["seq_len"] * len(warm) / sum(warm)
            rec["train_seconds"] = time.time() - t0
            write_json(spec["out_file"], rec)
    rec["steps_done"] = len(step_times)
    rec["complete"] = len(step_times) == spec["steps"] and "stopped" not in rec
    warm = step_times[5:] or step_times
    if warm:
        rec["tokens_per_s"] = dims["batch_size"] * dims["seq_len"] * len(warm) / sum(warm)
        rec["ms_per_step_median"] = 1e3 * sorted(warm)[len(warm) // 2]
    rec["train_seconds"] = time.time() - t0
    rec["final_eval"] = rec["eval"][-1][1] if rec["eval"] else None
    if hasattr(opt, "nonfinite_counts"):
        rec["nonfinite_skipped"] = opt.nonfinite_counts()
    if device.type == "cuda":
        rec["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    if spec.get("save_checkpoint") and rec["complete"]:
        torch.save({k: v.float() for k, v in model.state_dict().items()}, spec["save_checkpoint"])
        write_json(spec["save_checkpoint"] + ".json", dict(dims=dims, method=method, seed=seed,
                                                          steps=spec["steps"], final_eval=rec["final_eval"]))
        rec["checkpoint"] = spec["save_checkpoint"]
    write_json(spec["out_file"], rec)
    return rec


def run_one_safe(spec: dict, corpus: dict | None = None) -> dict:
    """run_one, but an exception (an optimizer that will not build, a kernel that will not compile)
    is recorded in the run's file instead of ending the part."""
    try:
        return run_one(spec, corpus)
    except Exception as e:
        import traceback
        rec = load_json(spec["out_file"]) or dict(method=spec["method"], seed=spec["seed"], train=[], eval=[])
        rec.update(complete=False, error=f"{type(e).__name__}: {e}"[:500],
                   traceback=traceback.format_exc()[-2000:])
        rec["final_eval"] = None
        write_json(spec["out_file"], rec)
        print(f"  {spec['method']} seed {spec['seed']}: FAILED {rec['error']}", flush=True)
        return rec


def run_specs(specs: list[dict], parallel: int, corpus: dict | None, on_done) -> None:
    """Run specs in order, ``parallel`` at a time (subprocesses) or in this process (parallel=1)."""
    if parallel <= 1:
        for s in specs:
            on_done(run_one_safe(s, corpus))
        return
    pending = list(specs)
    live: list[tuple[subprocess.Popen, dict]] = []
    while pending or live:
        while pending and len(live) < parallel:
            s = pending.pop(0)
            spec_file = Path(s["out_file"]).with_suffix(".spec.json")
            write_json(spec_file, s)
            proc = subprocess.Popen([sys.executable, __file__, "worker", str(spec_file)])
            live.append((proc, s))
        time.sleep(2)
        still = []
        for proc, s in live:
            if proc.poll() is None:
                if time.time() > s["deadline"] + 30:  # a worker past its deadline (stuck in a compile or a step)
                    proc.kill()
                    proc.wait()
                else:
                    still.append((proc, s))
                    continue
            r = load_json(s["out_file"]) or dict(method=s["method"], seed=s["seed"], complete=False)
            if proc.returncode and not r.get("complete"):
                r["error"] = f"worker exited with {proc.returncode}"
            on_done(r)
        live = still


def summarize_runs(runs: list[dict]) -> dict:
    by: dict[str, list] = {}
    for r in runs:
        if r.get("final_eval") is not None and r.get("complete"):
            by.setdefault(r["method"], []).append(r["final_eval"])
    out = {}
    for m, v in by.items():
        mean = sum(v) / len(v)
        std = (sum((a - mean) ** 2 for a in v) / (len(v) - 1)) ** 0.5 if len(v) > 1 else None
        out[m] = dict(n=len(v), mean=mean, std=std, values=v)
    return out


def make_specs(args, device, dims, methods, seeds_for, out_dir, deadline, tag, schedule, lr, steps, warmup,
               init_checkpoint=None, save_ckpt_for=None, data_seed_offset=0):
    specs = []
    order = []
    max_seeds = max(len(seeds_for(m)) for m in methods)
    for i in range(max_seeds):  # every method's first seed before any extra seed
        for m in methods:
            s = seeds_for(m)
            if i < len(s):
                order.append((m, s[i]))
    for m, seed in order:
        spec = dict(method=m, seed=seed, dims=dims, steps=steps, lr=lr, schedule=schedule, warmup=warmup,
                    betas=[0.9, 0.95], wd=0.1, backend=args.backend, device=str(device), deadline=deadline,
                    eval_every=dims["eval_every"], val_percent=args.val_percent, init_checkpoint=init_checkpoint,
                    data_seed=seed + data_seed_offset, threads=args.threads,
                    out_file=str(Path(out_dir) / f"{tag}-runs" / f"{m}-s{seed}.json"))
        if save_ckpt_for == (m, seed):
            spec["save_checkpoint"] = str(Path(out_dir) / f"ckpt-{m}-s{seed}.pt")
        specs.append(spec)
    return specs


def resolve_dims(args) -> dict:
    dims = dict(PRESETS[args.preset])
    for k in ("steps", "batch_size", "seq_len", "lr", "eval_every", "warmup", "eval_batches"):
        v = getattr(args, k, None)
        if v is not None:
            dims[k] = v
    return dims


def corpus_info(corpus: dict) -> dict:
    return {k: v for k, v in corpus.items() if k not in ("train", "val")}


def cmd_convergence(args) -> dict:
    device = resolve_device(args.device)
    t0 = time.time()
    deadline = t0 + args.time_budget
    dims = resolve_dims(args)
    corpus = load_corpus(args.val_percent)
    path = part_path(args.out_dir, "convergence")
    prev = (load_json(path) or {}) if args.resume else {}
    done = {(r["method"], r["seed"]): r for r in prev.get("runs", []) if r.get("complete") or r.get("skipped")}
    methods = DEFAULT_METHODS if args.methods == "all" else args.methods.split(",")
    for m in methods:
        if m not in METHODS:
            raise SystemExit(f"unknown method {m!r}; choose from {', '.join(METHODS)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    extra = [int(s) for s in args.extra_seeds.split(",")] if args.extra_seeds else []

    def seeds_for(m):
        return seeds + (extra if m in MULTI_SEED_METHODS else [])

    triton_cfg = set_triton_config(args, TRAIN_CONFIG)
    res = dict(part="convergence", meta=meta(args, device), preset=args.preset, dims=dims, triton_config=triton_cfg,
               smoke=args.preset == "tiny" or device.type == "cpu", corpus=corpus_info(corpus), methods=methods,
               seeds=seeds, extra_seeds=extra, hyper=dict(optimizer="AdamW", betas=[0.9, 0.95], weight_decay=0.1,
                                                         lr=dims["lr"], warmup=dims["warmup"], schedule="cosine",
                                                         min_lr_ratio=0.1, grad_clip=None),
               runs=list(done.values()), complete=False)
    specs = [s for s in make_specs(args, device, dims, methods, seeds_for, args.out_dir, deadline, "convergence",
                                   "cosine", dims["lr"], dims["steps"], dims["warmup"],
                                   save_ckpt_for=("fp32-master", seeds[0]) if not args.no_checkpoint else None)
             if (s["method"], s["seed"]) not in done]
    print(f"convergence: {len(specs)} runs, preset {args.preset} ({dims}), corpus {corpus['n_files']} files "
          f"({corpus['n_val_files']} held out), {corpus['train_bytes']:,} / {corpus['val_bytes']:,} bytes", flush=True)

    def on_done(r):
        res["runs"] = [x for x in res["runs"] if (x["method"], x["seed"]) != (r["method"], r["seed"])] + [r]
        res["summary"] = summarize_runs(res["runs"])
        res["elapsed_s"] = round(time.time() - t0, 1)
        write_json(path, res)
        if r.get("skipped"):
            print(f"  {r['method']} seed {r['seed']}: skipped: {r['skipped']}", flush=True)
        else:
            tps = r.get("tokens_per_s")
            print(f"  {r['method']} seed {r['seed']}: held-out {r.get('final_eval')} after {r.get('steps_done')} steps"
                  f" ({tps or 0:,.0f} tok/s){'' if r.get('complete') else ' INCOMPLETE ' + str(r.get('stopped') or r.get('error'))}",
                  flush=True)

    parallel = args.parallel if args.parallel else (1 if device.type == "cpu" else min(8, len(specs)))
    res["parallel"] = parallel
    for s in specs:
        s["threads"] = s["threads"] or (max(1, (os.cpu_count() or 1) // parallel) if parallel > 1 else None)
    run_specs(specs, parallel, corpus if parallel <= 1 else None, on_done)
    res["summary"] = summarize_runs(res["runs"])
    res["complete"] = all(r.get("complete") or r.get("skipped") for r in res["runs"]) and len(res["runs"]) >= len(
        [1 for m in methods for _ in seeds_for(m)])
    res["elapsed_s"] = round(time.time() - t0, 1)
    write_json(path, res)
    return res


def cmd_worker(args) -> None:
    spec = json.loads(Path(args.spec).read_text())
    run_one_safe(spec)


# ---------------------------------------------------------------------------------------------
# 4. low learning rate

def cmd_low_lr(args) -> dict:
    device = resolve_device(args.device)
    t0 = time.time()
    deadline = t0 + args.time_budget
    dims = resolve_dims(args)
    corpus = load_corpus(args.val_percent)
    path = part_path(args.out_dir, "low-lr")
    seed = int(args.seed)
    ckpt = args.checkpoint or str(Path(args.out_dir) / f"ckpt-fp32-master-s{seed}.pt")
    triton_cfg = set_triton_config(args, TRAIN_CONFIG)
    res = dict(part="low-lr", meta=meta(args, device), preset=args.preset, dims=dims, corpus=corpus_info(corpus),
               triton_config=triton_cfg,
               lr=args.lr_low, steps=args.steps_low, schedule="constant", seed=seed, checkpoint=ckpt,
               smoke=args.preset == "tiny" or device.type == "cpu", runs=[], pretrain=None, complete=False)
    if not os.path.exists(ckpt):
        if not args.pretrain_steps:
            raise SystemExit(f"no checkpoint at {ckpt}: run convergence first (same --out-dir) or pass --pretrain-steps N")
        print(f"low-lr: no checkpoint at {ckpt}: pre-training fp32-master for {args.pretrain_steps} steps", flush=True)
        pargs = dict(dims)
        spec = make_specs(args, device, pargs, ["fp32-master"], lambda m: [seed], args.out_dir, deadline, "low-lr-pretrain",
                          "cosine", dims["lr"], args.pretrain_steps, min(dims["warmup"], args.pretrain_steps // 5),
                          save_ckpt_for=("fp32-master", seed))[0]
        spec["save_checkpoint"] = ckpt
        r = run_one_safe(spec, corpus)
        res["pretrain"] = {k: r.get(k) for k in ("method", "seed", "steps_done", "final_eval", "complete", "tokens_per_s")}
        write_json(path, res)
        if not r.get("complete"):
            res["error"] = "pre-training did not complete"
            write_json(path, res)
            return res
    side = load_json(ckpt + ".json")
    if side and side.get("dims"):
        for k in ("hidden", "layers", "heads", "ff"):
            dims[k] = side["dims"][k]
        res["checkpoint_info"] = side
    res["dims"] = dims
    methods = args.methods.split(",")
    specs = make_specs(args, device, dims, methods, lambda m: [seed], args.out_dir, deadline, "low-lr", "constant",
                       args.lr_low, args.steps_low, 0, init_checkpoint=ckpt, data_seed_offset=1000)
    for s in specs:
        s["eval_every"] = args.eval_every_low

    def on_done(r):
        res["runs"] = [x for x in res["runs"] if x["method"] != r["method"]] + [r]
        res["elapsed_s"] = round(time.time() - t0, 1)
        write_json(path, res)
        print(f"  low-lr {r['method']}: held-out {r['eval'][0][1] if r.get('eval') else None} -> {r.get('final_eval')}"
              f"{'' if r.get('complete') else ' (incomplete/skipped: ' + str(r.get('stopped') or r.get('skipped') or r.get('error')) + ')'}",
              flush=True)

    parallel = args.parallel if args.parallel else (1 if device.type == "cpu" else len(specs))
    res["parallel"] = parallel
    for s in specs:
        s["threads"] = s["threads"] or (max(1, (os.cpu_count() or 1) // parallel) if parallel > 1 else None)
    run_specs(specs, parallel, corpus if parallel <= 1 else None, on_done)
    res["summary"] = low_lr_summary(res["runs"])
    res["complete"] = all(r.get("complete") or r.get("skipped") for r in res["runs"])
    res["elapsed_s"] = round(time.time() - t0, 1)
    write_json(path, res)
    return res


def low_lr_summary(runs: list[dict]) -> dict:
    ref = next((r for r in runs if r["method"] == "fp32-master" and r.get("final_eval") is not None), None)
    out = {}
    for r in runs:
        if r.get("final_eval") is None or not r.get("eval"):
            continue
        d = dict(start=r["eval"][0][1], final=r["final_eval"], steps=r.get("steps_done"), complete=r.get("complete"))
        if ref is not None:
            gain_ref = ref["eval"][0][1] - ref["final_eval"]
            d["gap_to_fp32_master"] = r["final_eval"] - ref["final_eval"]
            d["gap_pct_of_final"] = 100 * d["gap_to_fp32_master"] / ref["final_eval"]
            # how much of fp32-master's improvement (from its own start) this method achieved
            d["improvement"] = r["eval"][0][1] - r["final_eval"]
            d["improvement_pct_of_fp32_master"] = 100 * d["improvement"] / gain_ref if gain_ref > 0 else None
        out[r["method"]] = d
    return out


# ---------------------------------------------------------------------------------------------
# 5. report

def _fmt(x, spec=".3g"):
    return "-" if x is None else format(x, spec)


def merge_part(a: dict, b: dict) -> dict:
    """The same part from two out-dirs (e.g. two device calls): b's units/runs win on the same key."""
    out = dict(b)
    if "units" in a:
        key = lambda u: (u.get("rule"), u.get("shape"))  # noqa: E731
        bu = {key(u) for u in b.get("units", [])}
        out["units"] = [u for u in a["units"] if key(u) not in bu] + b.get("units", [])
        finished = {key(u) for u in out["units"] if u.get("complete")}
        out["skipped"] = list({(s["rule"], s["shape"]): s for s in a.get("skipped", []) + b.get("skipped", [])
                               if (s["rule"], s["shape"]) not in finished}.values())
        out["complete"] = not out["skipped"] and all(u.get("complete") for u in out["units"])
    if "runs" in a and isinstance(a["runs"], list):
        key = lambda r: (r.get("method"), r.get("seed"))  # noqa: E731
        br = {key(r) for r in b.get("runs", [])}
        out["runs"] = [r for r in a["runs"] if key(r) not in br] + b.get("runs", [])
        out["methods"] = list(dict.fromkeys(a.get("methods", []) + b.get("methods", [])))
        out["merged_from"] = [a.get("meta", {}).get("command"), b.get("meta", {}).get("command")]
    return out


def collect_parts(in_dirs: list[str]) -> dict:
    parts = {}
    for d in in_dirs:
        for part in PARTS:
            j = load_json(part_path(d, part))
            if j is not None:
                parts[part] = merge_part(parts[part], j) if part in parts else j
    return parts


def source_label(src: dict) -> str:
    metas = [p.get("meta", {}) for p in src["parts"].values()]
    names = sorted({m.get("device_name", "?") for m in metas})
    return f"{src.get('tag', '?')} ({', '.join(names)})"


def _rule_shape_table(rules, shapes, units, key, cell) -> list[str]:
    """Markdown rows of a rule x shape table of ``u[key]`` (cell text: ``cell(u)``), with the verdict
    of the 1e-5 criterion per rule."""
    lines = ["| rule | " + " | ".join(shapes) + " | held (≤ 1e-5) |", "|---|" + "---|" * (len(shapes) + 1)]
    for rule in rules:
        cells, vals = [], []
        for s in shapes:
            u = next((u for u in units if u["rule"] == rule and u["shape"] == s and key in u), None)
            if u is None:
                cells.append("not run")
                continue
            vals.append(u[key])
            cells.append(cell(u))
        if vals and max(vals) > 1e-5:
            verdict = "**no**"
        elif len(vals) < len(shapes):
            verdict = "incomplete" + (" (so far yes)" if vals else "")
        else:
            verdict = "yes"
        lines.append(f"| {rule} | " + " | ".join(cells) + f" | {verdict} |")
    return lines


def md_exactness(src: dict) -> str:
    p = src["parts"].get("exactness")
    if not p:
        return ""
    units = [u for u in p["units"] if u.get("complete")]
    shapes = p["shapes"]
    lines = [f"**{source_label(src)}**, backend `{p['backend']}`, BT={p['BT']}, {p['steps']} steps, fp32 W and fp32 "
             f"state; cell: max over steps of max|W_forge − W_ref| / max|W_ref| (step 1 in brackets).", ""]
    lines += _rule_shape_table(p["rules"], shapes, units, "max_rel",
                               lambda u: f"{u['max_rel']:.1e} ({u['step1_max_rel']:.1e})")
    if any("own_grad_max_rel" in u for u in units):
        lines += ["", "The same runs against torch.optim fed FORGE's own gradient (the backend's accumulate "
                  "mode: same tiles, same summation order), i.e. the update arithmetic alone; cell: max over "
                  "steps.", ""]
        lines += _rule_shape_table(p["rules"], shapes, units, "own_grad_max_rel",
                                   lambda u: f"{u['own_grad_max_rel']:.1e}")
    if p.get("skipped"):
        lines += ["", f"Not run (time budget): {len(p['skipped'])} units."]
    return "\n".join(lines)


def md_sr(src: dict, fig_dir: Path, doc_dir: Path) -> str:
    p = src["parts"].get("stochastic-rounding")
    if not p:
        return ""
    exp = p["expected_mean_change"]
    lines = [f"**{source_label(src)}**, W = {p['shape']} bf16 at {p['w0']} (ULP {p['ulp']:.6g}), SGD lr=1, true update "
             f"{p['step']:.6g} = {p['step_in_ulp']} ULP per step, {p['steps']} steps (expected change {exp:+.6f}).", "",
             "| store | mean weight change | / expected | std | elements unchanged |", "|---|---|---|---|---|"]
    labels = {"fp32-reference": "fp32 weights (torch.optim.SGD)", "forge-sr": "forge bf16, hash SR",
              "forge-rne": "forge bf16, round-to-nearest", "torch-bf16": "torch.optim.SGD on bf16 (RNE)"}
    for m, r in p["runs"].items():
        lines.append(f"| {labels.get(m, m)} | {r['mean_change']:+.6f} | {r['ratio_to_expected']:.4f} | "
                     f"{r['std_change']:.2e} | {r['frac_unchanged']:.1%} |")
    sr, rne = p["runs"].get("forge-sr"), p["runs"].get("forge-rne")
    if sr and rne:
        held = abs(sr["ratio_to_expected"] - 1) <= 0.02 and rne["mean_change"] == 0
        lines += ["", f"Held: {'yes' if held else '**no**'} (SR within {abs(sr['ratio_to_expected'] - 1):.2%} of the fp32 "
                      f"reference; RNE change {rne['mean_change']:+.6f})."]
    kc = p.get("kernel_cost") or {}
    if kc.get("measured"):
        lines += ["", "Kernel cost of SR (fused AdamW, bf16 W and m, v; one tuned config for all three rows; "
                      "do_bench median, ms):", "",
                  "| shape | BT | RNE | SR on W | SR on W, m, v | SR(all)/RNE |", "|---|---|---|---|---|---|"]
        for r in kc["rows"]:
            if r.get("skipped"):
                lines.append(f"| {r['shape']} | {r['BT']} | not run ({r['skipped']}) | | | |")
                continue
            lines.append(f"| {r['shape']} | {r['BT']} | {r['rne_ms']:.3f} | {r['sr_weight_ms']:.3f} | "
                         f"{r['sr_all_ms']:.3f} | {r['sr_all_over_rne']:.3f} |")
    else:
        lines += ["", f"Kernel cost of SR: not measured ({kc.get('reason', '?')})."]
    fig = plot_sr(p, fig_dir / f"fidelity-{src['tag']}-sr.png")
    if fig:
        lines += ["", f"![dead-zone]({os.path.relpath(fig, doc_dir)})"]
    return "\n".join(lines)


def plot_sr(p: dict, path: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for m, r in p["runs"].items():
        ax.plot(range(1, len(r["curve"]) + 1), r["curve"], label=m, lw=1.5 if m.startswith("forge") else 1,
                ls="--" if m == "fp32-reference" else "-")
    ax.set_xlabel("step")
    ax.set_ylabel("mean weight change")
    ax.set_title(f"bf16 dead-zone: update {p['step_in_ulp']} ULP/step at w={p['w0']}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _mean_curves(runs, key):
    """{step: mean over runs} for runs of one method (steps present in all)."""
    curves = [dict((s, v) for s, v in r[key]) for r in runs if r.get(key)]
    if not curves:
        return [], []
    steps = sorted(set.intersection(*(set(c) for c in curves)))
    return steps, [sum(c[s] for c in curves) / len(curves) for s in steps]


def _smooth(v, k):
    out, acc = [], []
    for x in v:
        acc.append(x)
        if len(acc) > k:
            acc.pop(0)
        out.append(sum(acc) / len(acc))
    return out


def plot_convergence(p: dict, path: Path, title: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    methods = [m for m in p["methods"] if any(r["method"] == m and r.get("train") for r in p["runs"])]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    first = p.get("seeds", [0])[0] if p.get("seeds") else 0
    for i, m in enumerate(methods):
        runs = [r for r in p["runs"] if r["method"] == m and r.get("train")]
        c = colors[i % len(colors)]
        main = next((r for r in runs if r["seed"] == first), runs[0])
        k = max(1, len(main["train"]) // 50)
        a1.plot([t[0] for t in main["train"]], _smooth([t[1] for t in main["train"]], k), color=c, lw=1,
                label=f"{m} (seed {main['seed']})")
        a2.plot([e[0] for e in main["eval"]], [e[1] for e in main["eval"]], "o-", color=c, ms=3, lw=1.2,
                label=f"{m} (seed {main['seed']}" + (f"; thin: {len(runs) - 1} more seeds)" if len(runs) > 1 else ")"))
        for r in runs:
            if r is not main:
                a2.plot([e[0] for e in r["eval"]], [e[1] for e in r["eval"]], color=c, lw=0.6, alpha=0.5)
    a1.set_title("train loss (running mean)", fontsize=9)
    a2.set_title("held-out loss (held-out files)", fontsize=9)
    for a in (a1, a2):
        a.set_xlabel("step")
        a.set_ylabel("cross-entropy (nats/byte)")
        a.grid(alpha=0.3)
    a2.legend(fontsize=7)
    # zoom the held-out panel on the last half of the run
    evals = [e[1] for r in p["runs"] if r.get("eval") for e in r["eval"][len(r["eval"]) // 2:]]
    if evals:
        lo, hi = min(evals), max(evals)
        a2.set_ylim(lo - 0.05 * (hi - lo + 1e-3), hi + 0.05 * (hi - lo + 1e-3))
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def md_convergence(src: dict, fig_dir: Path, doc_dir: Path) -> str:
    p = src["parts"].get("convergence")
    if not p:
        return ""
    d, c = p["dims"], p["corpus"]
    params = next((r.get("params") for r in p["runs"] if r.get("params")), None)
    smoke = " — **CPU smoke run of the pipeline, not the study**" if p.get("smoke") else ""
    lines = [f"**{source_label(src)}**{smoke}: preset `{p['preset']}` (Llama {d['layers']}L d{d['hidden']} "
             f"h{d['heads']} ff{d['ff']}, {params / 1e6 if params else 0:.2f}M params, byte vocabulary), "
             f"{d['steps']} steps of {d['batch_size']}x{d['seq_len']} tokens, AdamW lr {d['lr']:g} "
             f"warm-up {d['warmup']} + cosine to 0.1x, betas (0.9, 0.95), wd 0.1 (matrices). Corpus: Python "
             f"{c['python']} stdlib, {c['n_files']} .py files ({c['n_val_files']} held out by path hash, "
             f"{c['val_bytes']:,} bytes), file list sha256 {c['file_list_sha256']}. Held-out loss: "
             f"{d['eval_batches']} fixed windows of the held-out files."
             + (f" tokens/s: each run's own rate while {p['parallel']} runs shared the device."
                if (p.get("parallel") or 1) > 1 else ""), "",
             "| method | final held-out, seed 0 | − fp32-master (seed 0) | mean ± std over seeds (n) | "
             "tokens/s | status |", "|---|---|---|---|---|---|"]
    summ = summarize_runs(p["runs"])
    first = p.get("seeds", [0])[0]

    def seed0(m):
        r = next((r for r in p["runs"] if r["method"] == m and r["seed"] == first and r.get("complete")), None)
        return None if r is None else r.get("final_eval")

    ref0 = seed0("fp32-master")
    for m in p["methods"]:
        runs = [r for r in p["runs"] if r["method"] == m]
        if not runs:
            lines.append(f"| {m} | - | - | - | - | not run |")
            continue
        if all(r.get("skipped") for r in runs):
            lines.append(f"| {m} | - | - | - | - | skipped: {runs[0]['skipped']} |")
            continue
        s, v0 = summ.get(m), seed0(m)
        tps = [r["tokens_per_s"] for r in runs if r.get("tokens_per_s")]
        status = "complete" if all(r.get("complete") for r in runs) else "incomplete: " + "; ".join(
            str(r.get("stopped") or r.get("error") or "?") for r in runs if not r.get("complete"))
        ms = "-" if s is None else (f"{s['mean']:.4f}" + (f" ± {s['std']:.4f}" if s["std"] is not None else "")
                                    + f" ({s['n']})")
        lines.append(f"| {m} | {_fmt(v0, '.4f')} | {_fmt(None if v0 is None or ref0 is None else v0 - ref0, '+.4f')} | "
                     f"{ms} | {_fmt(sum(tps) / len(tps) if tps else None, ',.0f')} | {status} |")
    # the issue's targets: multi-seed methods by their means (and the worst paired seed), others paired on seed 0
    ref = summ.get("fp32-master", {}).get("mean")
    t = []
    if ref is not None and summ.get("forge-bf16-sr"):
        a = summ["forge-bf16-sr"]
        pairs = [(r["final_eval"], q["final_eval"]) for r in p["runs"] for q in p["runs"]
                 if r["method"] == "forge-bf16-sr" and q["method"] == "fp32-master" and r["seed"] == q["seed"]
                 and r.get("complete") and q.get("complete")]
        worst = max((abs(x - y) for x, y in pairs), default=None)
        d = a["mean"] - ref
        t.append(f"forge-bf16-sr within 0.01 nats of fp32-master: mean over seeds {d:+.4f} (n={a['n']} vs "
                 f"{summ['fp32-master']['n']}; worst same-seed gap {_fmt(worst, '.4f')}) → "
                 f"{'held' if abs(d) <= 0.01 else '**not held**'}")
    b0, s0 = seed0("bf16-fused-adamw"), seed0("forge-bf16-sr")
    if b0 is not None and s0 is not None:
        t.append(f"forge-bf16-sr no worse than bf16-fused-adamw (seed 0): {s0:.4f} vs {b0:.4f} → "
                 f"{'held' if s0 <= b0 else '**not held**'}")
    i0, n0 = seed0("forge-int8"), seed0("bnb-adamw8bit")
    if i0 is not None and ref0 is not None:
        if n0 is not None:
            a, b = abs(i0 - ref0), abs(n0 - ref0)
            t.append(f"forge-int8 closer to fp32-master than bnb-adamw8bit (seed 0): |Δ| {a:.4f} vs {b:.4f} → "
                     f"{'held' if a < b else '**not held**'}")
        else:
            t.append("forge-int8 vs bnb-adamw8bit: bnb did not run here")
    if t and p.get("smoke"):
        t.append("(smoke run: these lines only exercise the pipeline; the verdicts of the study come from the GPU run)")
    if t:
        lines += [""] + [f"- {x}" for x in t]
    fig = plot_convergence(p, fig_dir / f"fidelity-{src['tag']}-convergence.png",
                           f"{source_label(src)} — preset {p['preset']}{' (smoke)' if p.get('smoke') else ''}")
    lines += ["", f"![convergence]({os.path.relpath(fig, doc_dir)})"]
    return "\n".join(lines)


def md_low_lr(src: dict, fig_dir: Path, doc_dir: Path) -> str:
    p = src["parts"].get("low-lr")
    if not p:
        return ""
    smoke = " — **CPU smoke run of the pipeline, not the study**" if p.get("smoke") else ""
    pre = p.get("pretrain")
    pre_s = (f" (checkpoint pre-trained here: fp32-master, {pre['steps_done']} steps, held-out {pre['final_eval']:.4f})"
             if pre else "")
    lines = [f"**{source_label(src)}**{smoke}: from the fp32-master checkpoint{pre_s}, constant lr {p['lr']:g}, "
             f"{p['steps']} steps, fresh AdamW states, same batches for every method.", "",
             "| method | held-out at start | final | gap to fp32-master | gap, % of final loss | "
             "improvement, % of fp32-master's |", "|---|---|---|---|---|---|"]
    summ = low_lr_summary(p["runs"])
    for r in p["runs"]:
        s = summ.get(r["method"])
        if r.get("skipped") or s is None:
            lines.append(f"| {r['method']} | - | - | - | - | {r.get('skipped') or r.get('error') or 'no result'} |")
            continue
        lines.append(f"| {r['method']} | {s['start']:.4f} | {s['final']:.4f} | {_fmt(s.get('gap_to_fp32_master'), '+.4f')} | "
                     f"{_fmt(s.get('gap_pct_of_final'), '+.3f')} | {_fmt(s.get('improvement_pct_of_fp32_master'), '.1f')} |")
    conv = dict(p, methods=[r["method"] for r in p["runs"]])
    fig = plot_convergence(conv, fig_dir / f"fidelity-{src['tag']}-low-lr.png",
                           f"{source_label(src)} — low lr {p['lr']:g}{' (smoke)' if p.get('smoke') else ''}")
    lines += ["", f"![low-lr]({os.path.relpath(fig, doc_dir)})"]
    return "\n".join(lines)


AUTO_BLOCKS = ("exactness", "stochastic-rounding", "convergence", "low-lr", "sources")


def replace_block(text: str, name: str, body: str) -> str:
    begin, end = f"<!-- BEGIN AUTO {name} -->", f"<!-- END AUTO {name} -->"
    block = f"{begin}\n{body.strip()}\n{end}"
    if begin in text and end in text:
        a, b = text.index(begin), text.index(end) + len(end)
        return text[:a] + block + text[b:]
    return text.rstrip() + f"\n\n## {name}\n\n{block}\n"


def cmd_report(args) -> dict:
    sources = []
    if args.in_dir:
        parts = collect_parts(args.in_dir)
        if not parts:
            raise SystemExit(f"no fidelity-*.json part files in {args.in_dir}")
        combined = dict(tag=args.tag, written=now_iso(), parts=parts)
        if args.json:
            write_json(args.json, combined)
            print(f"wrote {args.json}")
    results = sorted(Path(p) for p in (args.results or []))
    if args.json and Path(args.json) not in results:
        results.append(Path(args.json))
    for r in results:
        j = load_json(r)
        if j and "parts" in j:
            j["file"] = str(r)
            sources.append(j)
    if not sources:
        raise SystemExit("nothing to report")
    doc = Path(args.doc)
    fig_dir = Path(args.fig_dir)
    text = doc.read_text() if doc.exists() else "# Fidelity study\n"
    blocks = {n: [] for n in AUTO_BLOCKS}
    for src in sources:
        blocks["exactness"].append(md_exactness(src))
        blocks["stochastic-rounding"].append(md_sr(src, fig_dir, doc.parent))
        blocks["convergence"].append(md_convergence(src, fig_dir, doc.parent))
        blocks["low-lr"].append(md_low_lr(src, fig_dir, doc.parent))
        rel = os.path.relpath(src["file"], doc.parent)
        metas = {k: v.get("meta", {}) for k, v in src["parts"].items()}
        blocks["sources"].append(f"- `{rel}` (tag {src['tag']}): " + "; ".join(
            f"{k}: {m.get('device_name')}, torch {m.get('torch')}, commit {m.get('commit')}, {m.get('date')}"
            for k, m in metas.items()))
    for name, bodies in blocks.items():
        body = "\n\n".join(b for b in bodies if b) or "_No results yet._"
        text = replace_block(text, name, body)
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text)
    print(f"wrote {doc} ({len(sources)} result files)")
    return dict(doc=str(doc), sources=[s["file"] for s in sources])


# ---------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="fidelity.py", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = ap.add_subparsers(dest="part", required=True)

    def common(name, budget=540.0):
        p = sub.add_parser(name)
        p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
        p.add_argument("--out-dir", default=DEFAULT_OUT, help="where fidelity-<part>.json is written")
        p.add_argument("--time-budget", type=float, default=budget, help="seconds; finished units are kept")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--backend", choices=["auto", "torch", "triton"], default="auto")
        p.add_argument("--no-resume", dest="resume", action="store_false",
                       help="redo units already complete in --out-dir")
        p.add_argument("--triton-config", default=None,
                       help="'auto' (forge's autotuner) or a fixed kernel config for every launch, e.g. "
                            f"'{EXACT_CONFIG}' (sets FORGE_TRITON_CONFIG; default: per part)")
        return p

    p = common("exactness")
    p.add_argument("--shapes", default="llama8b", help="'llama8b', 'small', or e.g. 4096x4096,1024x4096 (Dout x Din)")
    p.add_argument("--rules", default="all", help="comma list of AdamW,Adam,NAdam,RAdam,Lion,RMSprop,Adagrad,SGD")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--bt", type=int, default=512, help="tokens per step (rows of X and dY)")

    p = common("stochastic-rounding")
    p.add_argument("--shape", default="256x512", help="Dout x Din of the bf16 weight")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--w0", type=float, default=0.75)
    p.add_argument("--step-frac", type=float, default=0.25, help="true update per step, in ULPs of w0")
    p.add_argument("--cost-shapes", default="4096x4096,14336x4096")
    p.add_argument("--cost-bts", default="512,4096")
    p.add_argument("--no-kernel-cost", action="store_true")

    def train_args(p):
        p.add_argument("--preset", choices=list(PRESETS), default=None,
                       help="tiny (CPU tests) or small (~57M, GPU); default: small on CUDA, tiny on CPU")
        p.add_argument("--batch-size", type=int, default=None)
        p.add_argument("--seq-len", type=int, default=None)
        p.add_argument("--eval-batches", type=int, default=None)
        p.add_argument("--val-percent", type=float, default=5.0, help="held-out share of files (by path hash)")
        p.add_argument("--parallel", type=int, default=0,
                       help="runs at once as subprocesses (default: 1 on CPU; on CUDA all runs at once, at most 8: "
                            "the small model's step is dispatch-bound, so runs share one GPU well)")
        p.add_argument("--threads", type=int, default=None, help="torch CPU threads per run")

    p = common("convergence")
    train_args(p)
    p.add_argument("--methods", default="all", help=f"comma list of {', '.join(METHODS)}")
    p.add_argument("--seeds", default="0", help="seeds for every method")
    p.add_argument("--extra-seeds", default="1,2", help=f"more seeds for {', '.join(MULTI_SEED_METHODS)}")
    p.add_argument("--steps", type=int, default=None, help="default: the preset's (2000 small, 150 tiny)")
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--eval-every", type=int, default=None)
    p.add_argument("--no-checkpoint", action="store_true", help="do not save the fp32-master checkpoint")

    p = common("low-lr")
    train_args(p)
    p.add_argument("--checkpoint", default=None, help="default: <out-dir>/ckpt-fp32-master-s<seed>.pt")
    p.add_argument("--pretrain-steps", type=int, default=0,
                   help="if the checkpoint is missing, pre-train fp32-master this many steps first")
    p.add_argument("--methods", default="fp32-master,forge-bf16-sr,forge-bf16-rne,bf16-fused-adamw")
    p.add_argument("--lr-low", type=float, default=1e-5)
    p.add_argument("--steps-low", type=int, default=1000)
    p.add_argument("--eval-every-low", type=int, default=100)
    p.add_argument("--lr", type=float, default=None, help="peak lr of the pre-training")

    p = sub.add_parser("report")
    p.add_argument("--in-dir", nargs="*", default=None, help="out-dirs whose part files are merged into --json")
    p.add_argument("--tag", default="cpu", help="label of the merged results (cpu, h200, ...)")
    p.add_argument("--json", default=None, help="merged results file, e.g. benchmarks/results/fidelity-cpu-<date>.json")
    p.add_argument("--results", nargs="*", default=None, help="more merged results files to show in the doc")
    p.add_argument("--doc", default=str(ROOT / "docs" / "fidelity.md"))
    p.add_argument("--fig-dir", default=str(ROOT / "docs"))
    p.add_argument("--time-budget", type=float, default=60.0)

    p = sub.add_parser("worker", help=argparse.SUPPRESS)
    p.add_argument("spec")
    return ap


def main(argv: list[str] | None = None):
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    if getattr(args, "preset", "x") is None:
        args.preset = "small" if resolve_device(args.device).type == "cuda" else "tiny"
    fn = {"exactness": cmd_exactness, "stochastic-rounding": cmd_stochastic_rounding, "convergence": cmd_convergence,
          "low-lr": cmd_low_lr, "report": cmd_report, "worker": cmd_worker}[args.part]
    return fn(args)


if __name__ == "__main__":
    main()
