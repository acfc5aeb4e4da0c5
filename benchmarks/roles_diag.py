"""Why do the role-split kernel's bits differ from the fused kernel's on the GPU (2026-12-06 call 2)?
Deterministic or racy, gradient or update: on 4096x4096, BT=512, fp32 W and states.

    PYTHONPATH=src python benchmarks/roles_diag.py
1. The gradient itself: SGD with lr=1 on a zero fp32 weight writes exactly -G; fused vs role-split, and the
   role-split twice (a race shows as two runs that differ).
2. AdamW fp32: fused vs role-split, role-split vs itself, ring of 1 slot per program.
Writes $OUT/roles_diag.json.
"""
from __future__ import annotations

import copy
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from forge_optim.kernels import launch as L  # noqa: E402
from forge_optim.kernels import roles as R  # noqa: E402
from forge_optim.kernels.launch import KernelConfig  # noqa: E402
from forge_optim.kernels.roles import RolesConfig  # noqa: E402
from forge_optim.rules import RULES  # noqa: E402
from test_roles_kernel import launch_job  # noqa: E402
from test_triton_kernel import make_job  # noqa: E402


def diff(a, b):
    d = (a.float() - b.float()).abs()
    return dict(max=d.max().item(), n=int((a != b).sum()), rows=int((a != b).any(1).sum()),
                first=(a != b).nonzero()[:3].tolist())


def main():
    M, N, BT = 4096, 4096, 512
    gen = torch.Generator(device="cuda").manual_seed(5)
    dy = torch.randn(BT, M, device="cuda", generator=gen).bfloat16()
    x = torch.randn(BT, N, device="cuda", generator=gen).bfloat16()
    rc = RolesConfig()
    fc = KernelConfig(rc.BM, rc.BN, rc.BK, rc.num_warps, rc.num_stages, rc.group_size, 1, rc.epi_split,
                      epi_lookahead=rc.epi_lookahead)
    out = dict(device=torch.cuda.get_device_name(), config=rc.short())
    sgd = RULES["SGD"]
    coeffs = sgd.padded(sgd.coefficients(dict(sgd.defaults, lr=1.0), {}, 1))
    grads = {}
    for name, launcher, cfg in (("fused", L.launch, fc), ("roles", R.launch_roles, rc), ("roles2", R.launch_roles, rc),
                                ("roles_ring1", R.launch_roles, replace(rc, ring_per_producer=1)),
                                ("fused_r128", L.launch, replace(fc, maxnreg=128))):
        w = torch.zeros(M, N, device="cuda")
        launcher(weight=w, dy=dy, x=x, rule_update=sgd.triton_update, coeffs=coeffs, states=(None, None, None),
                 config=cfg)
        torch.cuda.synchronize()
        grads[name] = -w
    ref = torch.mm(dy.t(), x, out_dtype=torch.float32)
    for k in grads:
        out[f"G {k} vs fused"] = diff(grads[k], grads["fused"])
        out[f"G {k} vs cuBLAS max"] = (grads[k] - ref).abs().max().item()
    job = make_job("AdamW", "fp32", M, N, device="cuda", seed=6)
    res = {}
    for name, launcher, cfg in (("fused", L.launch, fc), ("roles", R.launch_roles, rc), ("roles2", R.launch_roles, rc)):
        j = copy.deepcopy(job)
        launch_job(launcher, j, dy, x, cfg)
        torch.cuda.synchronize()
        res[name] = j
    for k in ("roles", "roles2"):
        out[f"AdamW W {k} vs fused"] = diff(res[k].weight, res["fused"].weight)
        out[f"AdamW m {k} vs fused"] = diff(res[k].states[0].data, res["fused"].states[0].data)
    out["AdamW W roles vs roles2"] = diff(res["roles"].weight, res["roles2"].weight)
    print(json.dumps(out, indent=1))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "roles_diag.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
