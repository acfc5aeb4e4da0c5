"""Where the fused kernel's epilogue issues its global loads and stores, from its sm_90a SASS (offline: Triton's
bundled ptxas, no GPU): the instruction index of every LDG, STG, SHFL, MUFU.SQRT and CALL, with registers and
spills, for the named configs. Loads that leave together show as one run of LDGs; loads that ptxas sank to
their first uses show as LDGs between the previous one's SHFL/SQRT (NOTES.md, twenty-fourth session: the
division-free int8 block scale serialized a slice's three loads).

    PYTHONPATH=<tree>/src python3 benchmarks/sass_load_order.py --label L --out FILE [--configs "A|B"|all] [--states int8]

Each row also says whether every run of loads holds whole int8 slices (``offline.slice_loads_grouped``, the
criterion of tests/test_kernel_codegen.py; null where it does not apply: e4 tiles load codes as wide as W);
``--configs all`` takes every TMA candidate of launch.ALL_TUNED_CONFIGS.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from forge_optim.kernels import fused, launch, offline, ptxas

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sass_count import opcodes, write_offline  # noqa: E402

SHORT = {"LDG.E.": "L", "STG.E.": "S", "MUFU.SQRT": "SQ", "CALL.REL.NOINC": "C", "SHFL.BFLY": "SH"}


def memory_order(sass: str) -> str:
    """'index:op[xN]' for each run of the same memory, shuffle, sqrt or call instruction."""
    runs = []
    for i, op in enumerate(opcodes(sass)):
        for long, short in SHORT.items():
            if op.startswith(long):
                op = short + op[len(long):]
                break
        else:
            continue
        if runs and runs[-1][1] == op:
            runs[-1][2] += 1
        else:
            runs.append([i, op, 1])
    return " ".join(f"{i}:{op}" + (f"x{n}" if n > 1 else "") for i, op, n in runs)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--configs", default="128x256x64 w16 s3 g8 p1 e8 tma la1|64x64x64 w4 s3 g8 p4 e4 tma r128 pf la1|"
                    "64x128x64 w4 s3 g8 p3 e8 tma r168|64x128x64 w4 s3 g8 p3 e8 tma r168 pf la1")
    ap.add_argument("--states", default="int8")
    a = ap.parse_args()
    known = {c.short(): c for c in launch.ALL_TUNED_CONFIGS}
    names = [n for n, c in known.items() if c.use_tma] if a.configs == "all" else a.configs.split("|")
    rows = []
    for name in names:
        for kind in a.states.split(","):
            s0, s1 = fused.ADAM_STATE_KINDS[kind][:2]
            u = ptxas.ptxas_usage(offline.compile_fused(known[name], s0, s1).asm["ptx"], sass=True)
            runs = offline.epilogue_load_runs(u["sass"])
            grouped = offline.slice_loads_grouped(runs) if kind == "int8" else None
            rows.append(dict(config=name, states=kind, registers=u["registers"], spill_bytes=u["spill_bytes"],
                             order=memory_order(u["sass"]), load_runs=runs, slice_loads_grouped=grouped))
            print(f"[{a.label}] {name} {kind}: {u['registers']} registers, {u['spill_bytes']} B spill, "
                  f"slice loads grouped: {grouped}\n  {rows[-1]['order'][:600]}", flush=True)
    write_offline(a.out, a.label, rows)


if __name__ == "__main__":
    main()
