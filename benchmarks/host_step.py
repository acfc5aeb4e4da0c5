"""Host time of a training step, phase by phase, on a tiny Llama with many layers (CPU, no GPU needed).

    python3 benchmarks/host_step.py [--layers 32] [--steps 20] [--state-dtype bf16] [--threads N] [--out FILE]
                                    [--compile] [--methods none,forge]      (FORGE_SRC=other/src: A/B)

The model is too small for compute to matter (hidden 64, vocabulary 4096), so what is timed is the
host's work: forward, backward and ``opt.step()`` of forge_optim.AdamW (backend="triton" under
TRITON_INTERPRET=1, with the kernel launch replaced by a no-op: FORGE's own Python path, not
Triton's launcher), of torch.optim.AdamW (foreach and fused) and of no optimizer. Each method gets a
fresh model; the figure is the median over ``--steps`` steps after 5 warm-up steps. ``--compile`` runs
each model through torch.compile (inductor's CPU code; its compile is in the warm-up). Writes
benchmarks/results/host-step-<date>.json (date, CPU, versions, command).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"
# FORGE_SRC: another checkout's src/ (an A/B of two versions with this script)
sys.path.insert(0, os.environ.get("FORGE_SRC", str(Path(__file__).resolve().parents[1] / "src")))

import torch  # noqa: E402

import forge_optim  # noqa: E402
from forge_optim.kernels import launch as launch_mod  # noqa: E402


class _NoLaunch:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def tiny_llama(layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=4096, max_position_embeddings=64)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(torch.bfloat16)


def phases(model, opt, ids, steps: int, compile: bool = False) -> dict:
    """Median ms of forward, backward and step (+zero_grad) over ``steps`` steps after 5 warm-up ones."""
    rec = {"forward": [], "backward": [], "step": []}
    if compile:
        torch._dynamo.reset()
        model = torch.compile(model)
    for i in range(steps + 5):
        t0 = time.perf_counter()
        loss = model(ids, labels=ids).loss
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)
        else:
            model.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        if i >= 5:
            rec["forward"].append(t1 - t0)
            rec["backward"].append(t2 - t1)
            rec["step"].append(t3 - t2)
    return {k: round(statistics.median(v) * 1e3, 3) for k, v in rec.items()}


def _commit() -> str:
    import subprocess

    src = Path(os.environ.get("FORGE_SRC", str(Path(__file__).resolve().parents[1] / "src")))
    try:
        return subprocess.run(["git", "-C", str(src), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except Exception:
        return "unknown"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--state-dtype", default="bf16", choices=("fp32", "bf16", "int8"))
    ap.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads (default: torch's). On a many-core host with a noisy neighbour "
                    "the default's thread pool made runs of identical code differ by up to 40% (NOTES.md, "
                    "twelfth session); --threads 1 times the Python path alone")
    ap.add_argument("--out", default=None)
    ap.add_argument("--compile", action="store_true", help="torch.compile each model (default mode)")
    ap.add_argument("--methods", default="none,torch_adamw_foreach,torch_adamw_fused,forge")
    a = ap.parse_args()
    methods = a.methods.split(",")
    if a.threads:
        torch.set_num_threads(a.threads)
    launch_mod.fused.forge_fused_kernel = _NoLaunch()
    ids = torch.randint(0, 4096, (1, 64), generator=torch.Generator().manual_seed(0))
    res = {}
    if "none" in methods:
        res["none"] = phases(tiny_llama(a.layers), None, ids, a.steps, a.compile)
    for name, make in (("torch_adamw_foreach", lambda p: torch.optim.AdamW(p, lr=1e-3, foreach=True)),
                       ("torch_adamw_fused", lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True))):
        if name in methods:
            m = tiny_llama(a.layers)
            res[name] = phases(m, make(m.parameters()), ids, a.steps, a.compile)
    if "forge" in methods:
        m = tiny_llama(a.layers)
        opt = forge_optim.AdamW(m, lr=1e-3, backend="triton", state_dtype=a.state_dtype)
        res[f"forge_{a.state_dtype}"] = phases(m, opt, ids, a.steps, a.compile)
        res["forge_fused_linears"] = len(opt.fused_modules())
        res["forge_unfused_params"] = sum(1 for g in opt.param_groups for p in g["params"]
                                          if id(p) not in opt._fused_ids)
    for k, v in res.items():
        print(f"{k:24s} {v}")
    out = dict(date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
               device=f"cpu ({platform.machine()}, {os.cpu_count()} cores)", torch=torch.__version__,
               command=" ".join([sys.executable] + sys.argv), layers=a.layers, steps=a.steps,
               threads=torch.get_num_threads(), compile=a.compile,
               forge_src=os.environ.get("FORGE_SRC", "src"), forge_commit=_commit(),
               units="ms per step, median", **res)
    path = Path(a.out) if a.out else (Path(__file__).resolve().parent / "results"
                                      / f"host-step-{dt.date.today().isoformat()}.json")
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
