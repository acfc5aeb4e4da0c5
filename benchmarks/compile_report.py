"""Compile the fused kernel for sm_90 on a machine without a GPU and report registers/spills/smem.

    PYTHONPATH=src python benchmarks/compile_report.py [--sass]

Uses Triton's bundled ptxas; no device needed. Covers every GPU candidate config for bf16 W with
bf16 (SR) and int8 states, AdamW.
"""
from __future__ import annotations

import sys

from forge_optim.kernels import fused
from forge_optim.kernels.launch import ALL_TUNED_CONFIGS
from forge_optim.kernels.offline import compile_fused as compile_cfg
from forge_optim.kernels.ptxas import ptxas_usage


def ptxas_report(ptx: str, sass: bool):
    """Registers, spill bytes and stack frame from the bundled ptxas -v; optional SASS summary."""
    u = ptxas_usage(ptx, sass=sass)
    info = ""
    if sass:
        s = u["sass"]
        info = f"HGMMA={s.count('HGMMA')} UTMALDG={s.count('UTMALDG')} LDL={s.count('LDL')} STL={s.count('STL')}"
    show = lambda v: "?" if v is None else str(v)  # noqa: E731
    return (show(u["registers"]), show(u["spill_bytes"]), show(u["stack_bytes"]), info)


def main():
    sass = "--sass" in sys.argv
    rows = []
    cfgs = list(ALL_TUNED_CONFIGS)
    if "--first" in sys.argv:
        cfgs = cfgs[:1]
    for cfg in cfgs:
        for name in ("bf16", "int8"):
            kinds = fused.ADAM_STATE_KINDS[name][:2]
            try:
                k = compile_cfg(cfg, *kinds)
                md = k.metadata
                regs, spill, stack, sass_info = ptxas_report(k.asm["ptx"], sass)
                rows.append((cfg.short(), name, regs, f"{spill}/{stack}", md.shared, sass_info))
            except Exception as err:  # noqa: BLE001
                rows.append((cfg.short(), name, "ERR", repr(err)[:300], "", ""))
    print(f"{'config':36s} {'states':6s} {'regs':>5s} {'spill/stack':>11s} {'smem':>7s}  sass")
    for r in rows:
        print(f"{r[0]:36s} {r[1]:6s} {str(r[2]):>5s} {str(r[3]):>11s} {str(r[4]):>7s}  {r[5]}")


if __name__ == "__main__":
    main()
