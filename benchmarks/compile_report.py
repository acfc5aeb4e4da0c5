"""Compile the fused kernel for sm_90 on a machine without a GPU and report registers/spills/smem.

    PYTHONPATH=src python benchmarks/compile_report.py [--sass]

Uses Triton's bundled ptxas; no device needed. Covers every GPU candidate config for bf16 W with
bf16 (SR) and int8 states, AdamW.
"""
from __future__ import annotations

import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from forge_optim.kernels import fused
from forge_optim.kernels.launch import LARGE_BT_CONFIGS, SMALL_BT_CONFIGS
from forge_optim.kernels.ptxas import ptxas_usage
from forge_optim.rules import RULES


def compile_cfg(cfg, s_kind, s1_kind, use_tma=True, rule="AdamW", w_bf16=True, in_dtype="bf16"):
    fn = fused.forge_fused_kernel
    names = fn.arg_names
    ptr = {"dy_ptr": f"*{in_dtype}", "x_ptr": f"*{in_dtype}", "w_ptr": "*bf16" if w_bf16 else "*fp32",
           "buf_ptr": "*fp32", "nf_ptr": "*i64", "sc0_ptr": "*fp32", "sc1_ptr": "*fp32", "sc2_ptr": "*fp32"}
    sdt = {fused.S_BF16: "*bf16", fused.S_FP32: "*fp32", fused.S_INT8: "*i8", fused.S_UINT8: "*u8", 0: "*fp32"}
    ptr["s0_ptr"] = sdt[s_kind]
    ptr["s1_ptr"] = sdt[s1_kind]
    ptr["s2_ptr"] = "*fp32"
    consts = dict(UPDATE=RULES[rule].triton_update, MODE=0, HAS_BUF=False, HAS_NF=True, W_BF16=w_bf16, W_SR=True,
                  S0=s_kind, S1=s1_kind, S2=0, S_SR=True, DOT_PREC="tf32", INTERPRET=False, USE_TMA=use_tma,
                  BM=cfg.BM, BN=cfg.BN, BK=cfg.BK, GROUP_SIZE=cfg.group_size,
                  EPI_SPLIT=cfg.epi_split, FLATTEN=cfg.flatten, PREFETCH=cfg.prefetch)
    sig = {}
    for n in names:
        if n in consts:
            sig[n] = "constexpr"
        elif n in ptr:
            sig[n] = ptr[n]
        elif n in ("BT", "M", "N", "NSB", "NUM_PROGS", "key_w", "key_s0", "key_s1", "key_s2"):
            sig[n] = "i32"
        else:
            sig[n] = "fp32"
    # what the runtime specializes: 16-byte aligned pointers, sizes divisible by 16 (all our shapes)
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if sig[n].startswith("*") or n == "N"}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()}, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                                    **({"maxnreg": cfg.maxnreg} if cfg.maxnreg else {})))
    return k


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
    cfgs = list(dict.fromkeys(SMALL_BT_CONFIGS + LARGE_BT_CONFIGS))
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
