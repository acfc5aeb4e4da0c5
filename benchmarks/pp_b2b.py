"""Back-to-back launches (no L2 flush, no host gaps: 50 launches queued between two events) of the ping-pong
schedule and the Triton tile at 4096x4096 and 14336x4096, BT=512, bf16 W/m/v: the kernels' own time, against
do_bench's per-call median, which was bimodal for the ping-pong at 4096x4096 (pp_variance.py).

    PYTHONPATH=src python3 benchmarks/pp_b2b.py      (prints JSON lines; $OUT/pp_b2b.json)
"""
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from forge_optim.kernels import launch as L  # noqa: E402
from forge_optim.kernels import pingpong as PP  # noqa: E402
from pingpong_check import run_pp, run_triton  # noqa: E402

gen = torch.Generator(device="cuda").manual_seed(0)
pp = PP.PingPongConfig(BN=128, epi_n=4, stages=5, group_size=16)
tr = {c.short(): c for c in L.ALL_TUNED_CONFIGS}["128x256x64 w16 s3 g8 p1 e8 tma la1"]
rows = []
for M, N in [(4096, 4096), (14336, 4096)]:
    dy = torch.randn(512, M, device="cuda", generator=gen).bfloat16()
    x = torch.randn(512, N, device="cuda", generator=gen).bfloat16()
    W = (torch.randn(M, N, device="cuda", generator=gen) * 0.02).bfloat16()
    m = (torch.randn(M, N, device="cuda", generator=gen) * 1e-3).bfloat16()
    v = (torch.randn(M, N, device="cuda", generator=gen) * 1e-3).square().bfloat16()
    nf = torch.zeros((), dtype=torch.int64, device="cuda")
    for name, fn in (("pingpong", lambda: run_pp(W, m, v, dy, x, nf, pp)), ("triton", lambda: run_triton(W, m, v, dy, x, nf, tr))):
        fn()
        torch.cuda.synchronize()
        per = []
        for _ in range(5):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(50_000_000)  # let the host queue all launches before the first runs
            a.record()
            for _ in range(50):
                fn()
            b.record()
            torch.cuda.synchronize()
            per.append(a.elapsed_time(b) / 50)
        row = dict(shape=f"{M}x{N}", kernel=name, ms_per_launch=per)
        print(json.dumps(row), flush=True)
        rows.append(row)
if os.environ.get("OUT"):
    Path(os.environ["OUT"], "pp_b2b.json").write_text(json.dumps(dict(device=torch.cuda.get_device_name(),
        torch=torch.__version__, command="python3 benchmarks/pp_b2b.py", rows=rows), indent=1))
