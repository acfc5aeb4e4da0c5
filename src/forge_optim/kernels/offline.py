"""Offline compilation of the fused Triton kernel for sm_90a (no GPU: Triton's bundled toolchain),
for reports (benchmarks/compile_report.py) and for tests of properties of the generated code."""
from __future__ import annotations

import re

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from ..rules import RULES
from . import fused


def compile_fused(cfg, s_kind, s1_kind, use_tma=True, rule="AdamW", w_bf16=True, in_dtype="bf16"):
    """The fused kernel (MODE_UPDATE, stochastic rounding, non-finite count) for KernelConfig ``cfg`` with
    state kinds ``s_kind``/``s1_kind`` (fused.S_*), specialized as the runtime would for our shapes.
    Needs a Triton whose ``triton.jit`` is not the interpreter's (TRITON_INTERPRET unset)."""
    fn = fused.forge_fused_kernel
    names = fn.arg_names
    w_ptr = "*bf16" if w_bf16 else "*fp32"
    # as launch.launch passes them: int8 states' scales are bf16 (precision.SCALE_DTYPE); an unused
    # pointer is the weight
    ptr = {"dy_ptr": f"*{in_dtype}", "x_ptr": f"*{in_dtype}", "w_ptr": w_ptr, "buf_ptr": "*fp32", "nf_ptr": "*i64"}
    sdt = {fused.S_BF16: "*bf16", fused.S_FP32: "*fp32", fused.S_INT8: "*i8", fused.S_UINT8: "*u8", 0: w_ptr}
    for slot, kind in enumerate((s_kind, s1_kind, 0)):
        ptr[f"s{slot}_ptr"] = sdt[kind]
        ptr[f"sc{slot}_ptr"] = "*bf16" if kind in (fused.S_INT8, fused.S_UINT8) else w_ptr
    consts = dict(UPDATE=RULES[rule].triton_update, MODE=0, HAS_BUF=False, HAS_NF=True, W_BF16=w_bf16, W_SR=True,
                  S0=s_kind, S1=s1_kind, S2=0, S_SR=True, DOT_PREC="tf32", INTERPRET=False, USE_TMA=use_tma,
                  BM=cfg.BM, BN=cfg.BN, BK=cfg.BK, GROUP_SIZE=cfg.group_size,
                  EPI_SPLIT=cfg.epi_split, FLATTEN=cfg.flatten, PREFETCH=cfg.prefetch,
                  EPI_LOOKAHEAD=cfg.epi_lookahead, EPI_EVICT=cfg.eviction_policy,
                  EPI_FENCE=cfg.fence)
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
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items() if k in names}, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                                    **({"maxnreg": cfg.maxnreg} if cfg.maxnreg else {})))
    return k


def epilogue_load_runs(sass: str) -> list[tuple[int, int]]:
    """The epilogue's global loads of an sm_90a SASS listing as runs that no SHFL separates, each run as
    (W loads, state-code loads) = (LDG.E.128, LDG.E.64) counts (int8 states: one W load and the m and v codes
    per slice). The slice's absmax reductions are shuffles, so a slice whose loads ptxas sank to their first
    uses shows as runs with W or codes missing (fused._load_fence, NOTES.md, twenty-fifth session). Loads
    with an L2 evict-first policy (KernelConfig.evict_first) are LDG.E.EF.128 / LDG.E.EF.64 and count the same."""
    ops = re.findall(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?(?:LDG\.E(?:\.EF)?\.(128|64)|(SHFL))\b",
                     sass, re.M)
    runs, run = [], []
    for width, shfl in ops + [("", "SHFL")]:
        if not shfl:
            run.append(width)
        elif run:
            runs.append((run.count("128"), run.count("64")))
            run = []
    return runs


def slice_loads_grouped(runs: list[tuple[int, int]]) -> bool | None:
    """Whether every run of ``epilogue_load_runs`` holds whole int8 slices: W and both codes of each. None
    where no code load is 64-bit: with 4 slices per tile (e4) a thread's codes are as wide as its W row
    (all LDG.E.128), so this count cannot tell them apart."""
    if not any(codes for _, codes in runs):
        return None
    return all(w >= 1 and codes == 2 * w for w, codes in runs)
