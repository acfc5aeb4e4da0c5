"""``forge-optim tune``: time the fused kernel's configs on a model's whole weights, on this GPU, and
write a table that every later run on this GPU reads (kernels/tuned.py; kernels/tune.py does the work).

    forge-optim tune --model Qwen3-8B --bts 512,8192            # -> ~/.cache/forge_optim/tuned/<gpu>.json

Without a table the tuner times configs on a <= 4096-row slice of each weight at its first step,
which can pick a config that is slower on the whole weight (up to 1.24x on the H200's lm_head).
"""
from __future__ import annotations

import argparse
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..bench_models import model_names

    p.add_argument("--model", default="Llama-3.1-8B", help=f"one of {', '.join(model_names())}")
    p.add_argument("--config", default=None, help="a Hugging Face config.json to take the shapes from instead")
    p.add_argument("--bts", default="512,2048,8192",
                   help="tokens per step (batch size x sequence length) to tune for, comma-separated; a run "
                   "uses the entry of its power-of-two bucket (BT=3000 -> 4096)")
    p.add_argument("--states", default="bf16,int8", help="state dtypes to tune for: bf16, int8")
    p.add_argument("--rep", type=int, default=60, help="milliseconds of timing per config and pass")
    p.add_argument("--out", default=None, help="table file (default: this GPU's file in $FORGE_TUNED_DIR, "
                   "else ~/.cache/forge_optim/tuned/); entries for other keys already there are kept")


def _ints(text: str, flag: str) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"forge-optim tune: {flag} takes comma-separated positive integers, got {text!r}") from None
    if not vals or any(v <= 0 for v in vals):
        raise SystemExit(f"forge-optim tune: {flag} takes comma-separated positive integers, got {text!r}")
    return vals


def run_parsed(ns: argparse.Namespace) -> int:
    states = [s.strip() for s in ns.states.split(",") if s.strip()]
    bad = [s for s in states if s not in ("bf16", "int8")]
    if bad or not states:
        raise SystemExit(f"forge-optim tune: --states takes bf16 and/or int8, got {ns.states!r}")
    bts = _ints(ns.bts, "--bts")
    if ns.rep <= 0:
        raise SystemExit(f"forge-optim tune: --rep must be positive, got {ns.rep}")
    import torch

    from ..bench_models import config_dict
    from ..kernels import tune, tuned

    try:
        cfg = config_dict(None if ns.config else ns.model, ns.config)
    except (ValueError, OSError) as err:
        raise SystemExit(f"forge-optim tune: {err}") from None
    if not torch.cuda.is_available():
        raise SystemExit("forge-optim tune: needs a CUDA GPU (it times the fused Triton kernel); without "
                         "one the torch backend runs, which has no configs to tune")
    shapes = tune.linear_shapes(cfg)
    device = torch.cuda.get_device_name()
    out = ns.out or tuned.user_table_path(device)
    print(f"forge-optim tune: {len(shapes)} shapes x BT {bts} x states {states} on {device}", flush=True)
    entries = tune.tune_entries(shapes, bts, states, rep=ns.rep, log=lambda s: print(s, flush=True))
    path = tune.write_table(entries, out)
    print(f"wrote {len(entries)} entries to {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="forge-optim tune", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run_parsed(p.parse_args(sys.argv[1:] if argv is None else argv))
