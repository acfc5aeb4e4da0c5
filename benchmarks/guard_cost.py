"""What torch.compile's guard evaluation costs per step, by method (CPU, no GPU needed).

    python3 benchmarks/guard_cost.py [--layers 32] [--steps 7] [--out FILE]

A synchronized compiled step starts with dynamo's guard check on the host while the GPU idles (the
lead of benchmarks/gpu_idle_map.py). A FORGE-patched model adds guards per fused linear: a second tensor
input (``_forge_weight_alias``) and the ``weight is h.param`` check of ``ForgeLinear.forward``, which
dynamo keeps as a Python lambda guard. This times torch.profiler's ``TorchDynamo Cache Lookup`` per step
(median over ``--steps`` steps) on a compiled tiny Llama with ``--layers`` layers (32: as many fused
linears as Llama-3.1-8B, 225) for ``none``, torch fused AdamW, forge-bf16, and forge-bf16 with that
identity check taken out of the traced forward (an experiment: the check is what refuses a replaced
Parameter). Writes benchmarks/results/guard-cost-<date>.json (date, CPU, versions, command).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from forge_optim import patch  # noqa: E402
from forge_optim.autograd import fused_linear_traceable  # noqa: E402
from forge_optim.bench_models import build_model, config_dict  # noqa: E402
from forge_optim.cli.bench import _make_method  # noqa: E402
from results_path import result_path  # noqa: E402


def _forward_without_identity_check(self, x):
    """ForgeLinear.forward's compiled branch without ``weight is h.param`` (the experiment's variant)."""
    h = self._forge_handle
    weight, bias = self._parameters["weight"], self._parameters["bias"]
    if h is None or not torch.is_grad_enabled() or not weight.requires_grad:
        return F.linear(x, weight, bias)
    return fused_linear_traceable(x, weight, bias, self._forge_weight_alias, h.id)


def lookup_us(method: str, layers: int, steps: int) -> list[float]:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = build_model(config_dict("tiny", None, layers), "cpu", torch.bfloat16)
    _opt, after, _ = _make_method(method, model, 1e-5, 0.1, "cpu")
    run = torch.compile(model)
    ids = torch.randint(0, model.config.vocab_size, (1, 64))
    for _ in range(4):
        run(input_ids=ids, labels=ids).loss.backward()
        after()
    out = []
    for _ in range(steps):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            run(input_ids=ids, labels=ids).loss.backward()
            after()
        ka = {e.key: e for e in prof.key_averages()}
        out.append(round(ka["TorchDynamo Cache Lookup"].cpu_time_total, 1))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    res = {}
    for name, method in [("none", "none"), ("torch-fused-adamw", "torch-fused-adamw"), ("forge-bf16", "forge-bf16"),
                         ("forge-bf16 without the identity check", "forge-bf16")]:
        original = patch.ForgeLinear.forward
        if "without" in name:
            patch.ForgeLinear.forward = _forward_without_identity_check
        try:
            us = lookup_us(method, a.layers, a.steps)
        finally:
            patch.ForgeLinear.forward = original
        res[name] = {"median_us": statistics.median(us), "all_us": us}
        print(f"{name:40s} cache lookup {res[name]['median_us']:8.1f} us  {us}", flush=True)
    import triton
    out = dict(date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), device="cpu",
               cpu=platform.processor() or platform.machine(), torch=torch.__version__, triton=triton.__version__,
               python=platform.python_version(), command=" ".join([sys.executable] + sys.argv),
               model=f"tiny Llama, {a.layers} layers, BS=1, SEQ=64, compiled (default mode)",
               units="us of 'TorchDynamo Cache Lookup' per step (torch.profiler)", results=res)
    path = Path(a.out) if a.out else result_path("guard_cost.json", "guard-cost")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
