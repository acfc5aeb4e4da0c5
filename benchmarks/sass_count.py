"""Static SASS instruction counts of the fused kernel, compiled offline for sm_90a (no GPU: Triton's
bundled ptxas and cuobjdump), per element of a tile per thread, with registers and spill bytes, for the
tuned configs the eighth session's instruction diet was measured on (NOTES.md).

    PYTHONPATH=src python3 benchmarks/sass_count.py --label now --out FILE
    PYTHONPATH=OLD/src python3 benchmarks/sass_count.py --label old --out FILE   (a tree from git archive)

The count is the whole kernel (prologue, mainloop, epilogue and cold paths) divided by the elements
each thread holds; the hot-epilogue figures of NOTES.md (78 -> 54 at 64x64 bf16) were read from the
same SASS between the mainloop's back-edge and the tile loop's, without the cold non-finite count.
"""
from __future__ import annotations

import argparse
import collections
import datetime as dt
import json
import re
import sys

import triton

from forge_optim.kernels import fused, launch, offline, ptxas


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--configs", default="", help="'|'-separated KernelConfig.short() names of "
                    "launch.ALL_TUNED_CONFIGS instead of the eighth session's four")
    ap.add_argument("--states", default="bf16,int8")
    a = ap.parse_args()
    rows = []
    if a.configs:
        known = {c.short(): c for c in launch.ALL_TUNED_CONFIGS}
        plan = [(s, known[s]) for s in a.configs.split("|")]
    else:
        plan = [("S10", launch.SMALL_BT_CONFIGS[10]), ("S7", launch.SMALL_BT_CONFIGS[7]),
                ("L0", launch.LARGE_BT_CONFIGS[0]), ("L4", launch.LARGE_BT_CONFIGS[4])]
    for name, cfg in plan:
        for kind in a.states.split(","):
            s0, s1 = fused.ADAM_STATE_KINDS[kind][:2]
            u = ptxas.ptxas_usage(offline.compile_fused(cfg, s0, s1).asm["ptx"], sass=True)
            ops = collections.Counter(op.split(".")[0] for op in opcodes(u["sass"]))
            n = sum(ops.values())
            per_thread = cfg.BM * cfg.BN / (cfg.num_warps * 32)
            rows.append(dict(config=name, short=cfg.short(), states=kind, registers=u["registers"],
                             spill_bytes=u["spill_bytes"], static_instructions=n,
                             per_element=round(n / per_thread, 1), opcodes=dict(sorted(ops.items()))))
            print(f"[{a.label}] {name} {kind}: {rows[-1]['per_element']} per element, "
                  f"{u['registers']} registers, {u['spill_bytes']} bytes spill", flush=True)
    write_offline(a.out, a.label, rows)


def opcodes(sass: str) -> list[str]:
    """The opcode of each instruction of a cuobjdump SASS listing, with its modifiers (``LDG.E.128``),
    without its predicate."""
    return re.findall(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+(?:\.[A-Z0-9_.]+)?)", sass, re.M)


def write_offline(path: str, label: str, rows: list) -> None:
    """An offline (no GPU) result file: date, target, Triton version, the command, label and rows."""
    out = dict(date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), device="offline sm_90a",
               triton=triton.__version__, command=" ".join([sys.executable] + sys.argv), label=label, rows=rows)
    with open(path, "w") as f:
        f.write(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
