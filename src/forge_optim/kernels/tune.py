"""Tune the fused kernel on whole weights and write a table that the tuner reads (kernels/tuned.py).

The run-time tuner times candidates on a sub-problem of at most TUNE_ROWS rows, which does not always
rank them as the whole weight does. ``tune_entries`` times every candidate config of each (shape, BT,
state mode) on clones of the whole weight and its states, in two passes (the second in reverse order,
so that a clock drift does not favour one end of the list), keeps each candidate's faster pass and
returns the winners keyed exactly as TritonBackend keys its tuning. ``forge-optim tune`` and
``benchmarks/tune_shapes.py`` (the shipped tables) call it; it needs a CUDA GPU.
"""
from __future__ import annotations

import datetime as dt
import json
import sys
from pathlib import Path

import torch

from . import tuned


def linear_shapes(cfg: dict) -> list[tuple[int, int]]:
    """(Dout, Din) of a Llama/Qwen-style decoder's fused linears, from its Hugging Face config dict:
    q, k/v, o, gate/up, down, and the lm_head unless it is tied to the embedding (a tied weight is
    not fused: patch.py)."""
    d, h = cfg["hidden_size"], cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or h
    hd = cfg.get("head_dim") or d // h
    inter = cfg["intermediate_size"]
    shapes = [(h * hd, d), (kv * hd, d), (d, h * hd), (inter, d), (d, inter)]
    if not cfg.get("tie_word_embeddings", False):
        shapes.append((cfg["vocab_size"], d))
    return list(dict.fromkeys(shapes))


def _states(mode: str, M: int, N: int, gen, rule):
    """Random AdamW states, the same draws as benchmarks/bench_kernel.make_states (which keeps its own
    copy: it also runs against older source trees in old/new A/B runs)."""
    from .. import precision
    from ..backends.base import StateView

    views = []
    for sp in rule.state_specs(dict(rule.defaults)):
        v = torch.randn(M, N, device="cuda", generator=gen) * 1e-3
        if sp.nonnegative:
            v = v.square()
        if mode == "int8":
            q, s = precision.quantize(v, sp.nonnegative)
            views.append(StateView(sp, q.contiguous(), s.contiguous()))
        else:
            views.append(StateView(sp, v.bfloat16()))
        del v
    return views


# The Gluon ping-pong kernel (kernels/pingpong.py) joins the candidates where it can run: bf16 states (its int8
# path ran 1.24-1.27x slower than the Triton kernel's on the H100), 0 < BT <= 2048 (it lost at larger BT on the
# H100: its mainloop is one 64-row warpgroup at a time), Hopper. FORGE_TUNE_PINGPONG=0 leaves it out.
PINGPONG_MAX_BT = 2048


def pingpong_candidates(bt: int, mode: str, device=None) -> list:
    import os

    if os.environ.get("FORGE_TUNE_PINGPONG", "1") == "0" or mode != "bf16" or not 0 < bt <= PINGPONG_MAX_BT:
        return []
    if torch.cuda.get_device_capability(device)[0] != 9:
        return []
    try:
        from . import pingpong
    except ImportError:  # a Triton without Gluon
        return []
    return list(pingpong.CANDIDATES)


def tune_entries(shapes, bts, modes=("bf16", "int8"), *, rep: int = 60, log=print) -> list[dict]:
    """Whole-weight winners for AdamW with bf16 weights, stochastic rounding and the non-finite count
    (the optimizer's defaults), one entry per (shape, BT, state mode) in tuned.py's table format. The
    candidates are the Triton kernel's for the BT, and the ping-pong kernel's where it can run
    (``pingpong_candidates``); a candidate that cannot launch is never the winner."""
    from triton.testing import do_bench

    from .. import precision
    from ..backends.base import UpdateJob
    from ..backends.triton_backend import launch_kwargs, tuning_key, tuning_launch
    from ..rules import RULES
    from . import fused
    from .launch import candidate_configs, precompile

    if not torch.cuda.is_available():
        raise RuntimeError("tuning the fused kernel needs a CUDA GPU")
    for m in modes:
        if m not in ("bf16", "int8"):
            raise ValueError(f"state mode {m!r}: tables hold 'bf16' and 'int8' states")
    specs = {repr((c, m)): dict(config=c, kinds=fused.ADAM_STATE_KINDS[m]) for m in modes for bt in bts
             for c in candidate_configs(bt)}
    precompile(list(specs.values()))
    rule = RULES["AdamW"]
    group = dict(rule.defaults, lr=1e-4, weight_decay=0.1)
    coeffs = rule.padded(rule.coefficients(group, {}, 10))
    gen = torch.Generator(device="cuda").manual_seed(0)
    entries = []
    for (M, N) in shapes:
        for BT in bts:
            dy = torch.randn(BT, M, device="cuda", generator=gen).bfloat16()
            x = torch.randn(BT, N, device="cuda", generator=gen).bfloat16()
            W = (torch.randn(M, N, device="cuda", generator=gen) * 0.02).bfloat16()
            for mode in modes:
                job = UpdateJob(weight=W, rule=rule, coeffs=coeffs, states=_states(mode, M, N, gen, rule),
                                stochastic_weight=True, stochastic_state=True,
                                key_weight=precision.stream_key(0, 0, 1, 0),
                                key_states=(precision.stream_key(0, 0, 1, 1), precision.stream_key(0, 0, 1, 2), 0),
                                nonfinite=torch.zeros((), dtype=torch.int64, device="cuda"))
                kwargs = launch_kwargs(job, dy, x)
                key = tuning_key(job, dy, kwargs)
                cands = list(candidate_configs(BT)) + pingpong_candidates(BT, mode)
                times = {c.short(): float("inf") for c in cands}
                for order in (cands, cands[::-1]):
                    for cfg in order:
                        fn = tuning_launch(kwargs, cfg, max_rows=M)  # clones of the whole weight
                        try:
                            fn()
                            torch.cuda.synchronize()
                            t = do_bench(fn, warmup=5, rep=rep, return_mode="median")
                        except Exception as err:  # noqa: BLE001 - does not fit: never the winner
                            log(f"    {cfg.short()}: {err!r}"[:200])
                            t = float("inf")
                        times[cfg.short()] = min(times[cfg.short()], t)
                        del fn
                    torch.cuda.empty_cache()
                ranked = sorted(cands, key=lambda c: times[c.short()])
                best = ranked[0]
                if times[best.short()] == float("inf"):
                    raise RuntimeError(f"no config ran for {M}x{N} BT={BT} {mode}")
                entries.append(dict(key=tuned.key_text(key), shape=f"{M}x{N}", BT=BT, states=mode,
                                    config=tuned.config_dict(best), ms=times[best.short()],
                                    timings_ms={c.short(): (times[c.short()] if times[c.short()] < float("inf")
                                                            else None) for c in ranked}))
                nxt = f"   (next {ranked[1].short()} {times[ranked[1].short()]:.4f})" if len(ranked) > 1 else ""
                log(f"{M:>6}x{N:<6} BT={BT:<5} {mode:4s} {best.short():<42} {times[best.short()]:.4f} ms{nxt}")
                del job, kwargs
                torch.cuda.empty_cache()
            del dy, x, W
            torch.cuda.empty_cache()
    return entries


def write_table(entries: list[dict], path: Path, *, merge: bool = True) -> Path:
    """Write ``entries`` as this device's table at ``path`` (entries already there for other keys are
    kept when ``merge``), with the date, versions and the code's source digest."""
    import triton

    from ..cli.bench import source_digest

    device = torch.cuda.get_device_name()
    path = Path(path)
    old = []
    if merge and path.exists():
        data = json.loads(path.read_text())
        if data.get("device") == device:
            new_keys = {e["key"] for e in entries}
            old = [e for e in data.get("entries", []) if e["key"] not in new_keys]
    out = dict(device=device, date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
               torch=torch.__version__, triton=triton.__version__, source_digest=source_digest(),
               command=" ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
               note="each candidate timed on the whole weight (forge_optim.kernels.tune)",
               entries=old + list(entries))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    tuned.load_table.cache_clear()
    return path
