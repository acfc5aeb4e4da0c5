"""Offline compilation of the fused Triton kernel for sm_90a (no GPU: Triton's bundled toolchain),
for reports (benchmarks/compile_report.py) and for tests of properties of the
generated code. Needs a Triton whose ``triton.jit`` is not the interpreter's (TRITON_INTERPRET unset)."""
from __future__ import annotations

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from ..rules import RULES
from . import fused


def _compile(fn, cfg, s_kind, s1_kind, consts: dict, rule: str, w_bf16: bool, in_dtype: str, ints: tuple):
    """``fn`` in update mode (stochastic rounding, non-finite count) with state kinds ``s_kind``/``s1_kind``
    (fused.S_*) and the config's launch options, specialized as the runtime would for our shapes."""
    names = fn.arg_names
    w_ptr = "*bf16" if w_bf16 else "*fp32"
    # as the launchers pass them: int8 states' scales are bf16 (precision.SCALE_DTYPE); an unused
    # pointer is the weight
    ptr = {"dy_ptr": f"*{in_dtype}", "x_ptr": f"*{in_dtype}", "w_ptr": w_ptr, "buf_ptr": "*fp32", "nf_ptr": "*i64"}
    sdt = {fused.S_BF16: "*bf16", fused.S_FP32: "*fp32", fused.S_INT8: "*i8", fused.S_UINT8: "*u8", 0: w_ptr}
    for slot, kind in enumerate((s_kind, s1_kind, 0)):
        ptr[f"s{slot}_ptr"] = sdt[kind]
        ptr[f"sc{slot}_ptr"] = "*bf16" if kind in (fused.S_INT8, fused.S_UINT8) else w_ptr
    consts = dict(UPDATE=RULES[rule].triton_update, HAS_BUF=False, HAS_NF=True, W_BF16=w_bf16, W_SR=True,
                  S0=s_kind, S1=s1_kind, S2=0, S_SR=True, DOT_PREC="tf32", INTERPRET=False,
                  BM=cfg.BM, BN=cfg.BN, BK=cfg.BK, GROUP_SIZE=cfg.group_size, EPI_SPLIT=cfg.epi_split,
                  EPI_LOOKAHEAD=cfg.epi_lookahead, **consts)
    sig = {}
    for n in names:
        if n in consts:
            sig[n] = "constexpr"
        elif n in ptr:
            sig[n] = ptr[n]
        elif n in ints:
            sig[n] = "i32"
        else:
            sig[n] = "fp32"
    # what the runtime specializes: 16-byte aligned pointers, sizes divisible by 16 (all our shapes)
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if sig[n].startswith("*") or n == "N"}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                                       **({"maxnreg": cfg.maxnreg} if cfg.maxnreg else {})))


_KEYS = ("key_w", "key_s0", "key_s1", "key_s2")


def compile_fused(cfg, s_kind, s1_kind, use_tma=True, rule="AdamW", w_bf16=True, in_dtype="bf16"):
    """The fused kernel for KernelConfig ``cfg`` (see ``_compile``)."""
    return _compile(fused.forge_fused_kernel, cfg, s_kind, s1_kind,
                    dict(MODE=0, USE_TMA=use_tma, FLATTEN=cfg.flatten, PREFETCH=cfg.prefetch),
                    rule, w_bf16, in_dtype, ("BT", "M", "N", "NSB", "NUM_PROGS") + _KEYS)

