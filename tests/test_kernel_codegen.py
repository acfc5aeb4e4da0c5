"""Properties of the fused kernel's generated code, compiled for sm_90a on this machine (Triton's
bundled toolchain, no GPU): they guard measured performance fixes against silent regressions."""
from __future__ import annotations

import os

import pytest

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    pytest.skip("the interpreter's triton.jit cannot be compiled for a GPU target", allow_module_level=True)

from forge_optim.kernels import fused  # noqa: E402
from forge_optim.kernels.launch import LARGE_BT_CONFIGS, SMALL_BT_CONFIGS  # noqa: E402
from forge_optim.kernels.offline import compile_fused  # noqa: E402


@pytest.mark.parametrize("cfg", [SMALL_BT_CONFIGS[-2], LARGE_BT_CONFIGS[0]], ids=lambda c: c.short())
def test_int8_scale_stores_add_no_layout_conversion(cfg):
    """int8 states store their per-64 scales from the absmax reduction's layout (an inline st.global)
    instead of a tl.store that the coalescing pass re-anchors through shared memory. Measured excess of
    the int8 kernel over the bf16-state kernel (layout conversions / bar.sync): before, 8/16 (64x64,
    4 warps) and 12/28 (128x128, 8 warps); after, 0/0 and 4/12; the int8 epilogue ran 3-5% faster on
    the H200 (benchmarks/NOTES.md, fifth session). The bounds sit between the two."""
    bf16 = compile_fused(cfg, fused.S_BF16, fused.S_BF16)
    int8 = compile_fused(cfg, fused.S_INT8, fused.S_UINT8)
    assert int8.asm["ttgir"].count("convert_layout") - bf16.asm["ttgir"].count("convert_layout") < 8
    assert int8.asm["ptx"].count("bar.sync") - bf16.asm["ptx"].count("bar.sync") < 16
    assert "@p st.global.b16" in int8.asm["ptx"]  # the inline bf16 scale stores


def _global_access_order(ptx: str) -> str:
    """'L' per global load, 'S' per global store, in program order."""
    import re

    return "".join("L" if m.startswith("ld") else "S" for m in re.findall(r"\b(ld\.global|st\.global)", ptx))


@pytest.mark.parametrize("states", ["bf16", "int8"])
def test_epilogue_lookahead_issues_next_slice_loads_before_stores(states):
    """With epi_lookahead=1 each epilogue slice's loads of W and the states come before the previous
    slice's stores; without it they come after (a later load may alias an earlier store, so neither
    the compiler nor the hardware reorders them, and each slice waits out a full load latency). On the
    H200 this took the tuned 64x64 config from 0.115 to 0.110 ms (bf16 states) and 0.139 to 0.125 ms
    (int8) at 4096x4096, BT=512 (benchmarks/NOTES.md, seventh session). The per-tile non-finite count
    must leave no reduction (CTA barrier) between the slices."""
    from dataclasses import replace

    kinds = fused.ADAM_STATE_KINDS[states]
    cfg = replace(SMALL_BT_CONFIGS[-2], epi_lookahead=0)
    loads_per_slice = 3 if states == "bf16" else 5  # W, m, v (+ two scale tensors)
    stores_per_slice = 3 if states == "bf16" else 5
    seq0 = _global_access_order(compile_fused(cfg, kinds[0], kinds[1]).asm["ptx"])
    k1 = compile_fused(replace(cfg, epi_lookahead=1), kinds[0], kinds[1])
    seq1 = _global_access_order(k1.asm["ptx"])
    L, S = "L" * loads_per_slice, "S" * stores_per_slice
    assert seq0.endswith((L + S) * 4)
    assert seq1.endswith(L + L + S + L + S + L + S + S)
    # no barrier inside the epilogue: none between its first load and its last store
    ptx = k1.asm["ptx"]
    loads = [i for i in range(len(ptx)) if ptx.startswith("ld.global", i)]
    first, last = loads[-4 * loads_per_slice], ptx.rindex("st.global")
    assert "bar.sync" not in ptx[first:last]


@pytest.mark.parametrize("states", ["bf16", "int8"])
def test_evict_first_puts_an_l2_policy_on_every_state_access_and_nothing_else(states):
    """KernelConfig.evict_first: every global load and store of W and the states in the epilogue carries
    an L2 evict-first cache hint; the mainloop's TMA loads of dY and X and the int8 scales do not, and
    without the option no access carries one (twenty-third session: -1 to -5% on the 14336-wide shapes'
    tiles, bf16 state, H100). Same accesses in the same order otherwise."""
    import re
    from dataclasses import replace

    kinds = fused.ADAM_STATE_KINDS[states]
    cfg = SMALL_BT_CONFIGS[-2]
    plain = compile_fused(replace(cfg, evict_first=False), kinds[0], kinds[1]).asm["ptx"]
    evict = compile_fused(replace(cfg, evict_first=True), kinds[0], kinds[1]).asm["ptx"]
    assert "cache_hint" not in plain and "evict_first" not in plain
    hinted = re.findall(r"\b(?:ld|st)\.global\.L1::evict_first\.L2::cache_hint\S*", evict)
    per_slice = 3  # W, m, v: loaded once and stored once per slice
    assert len(hinted) == 2 * per_slice * cfg.epi_split, len(hinted)
    assert "createpolicy.fractional.L2::evict_first" in evict
    assert _global_access_order(plain) == _global_access_order(evict)


def test_adamw_bf16_epilogue_draws_one_hash_and_divides_approximately():
    """Per element of the bf16-weight, bf16-state AdamW epilogue: one SR hash (two multiplies) for three
    bf16 stores (W, m and v take its low half, its high half and the high half of its product with
    precision.DRAW2_MUL: one more multiply), and m / denom as one div.approx.ftz.f32 (its denominator
    clamped to FLT_MIN). Eighth session: three hashes and a div.full.f32 with its range checks became
    two hashes and div.approx (hot epilogue 78 -> 54 SASS instructions per element at 64x64); twenty-first
    session: two hashes became one (hot slice 46.9 -> 40.0 per element at 64x128, static whole kernel
    67.0 -> 59.8; benchmarks/NOTES.md). The div.full.f32 left is the scalar 1 / sqrt(bias_correction2)."""
    from forge_optim import precision

    cfg = SMALL_BT_CONFIGS[-2]
    per_thread = cfg.BM * cfg.BN // (cfg.num_warps * 32)
    ptx = compile_fused(cfg, fused.S_BF16, fused.S_BF16).asm["ptx"]
    assert ptx.count(f", {precision.HASH_MUL};") == 2 * per_thread
    assert ptx.count(f", {precision.DRAW2_MUL};") == per_thread
    assert ptx.count("div.approx.ftz.f32") == per_thread
    assert ptx.count("div.full.f32") <= 4  # scalars only (one per epilogue slice at most)


def test_int8_codes_round_saturate_and_convert_in_one_instruction():
    """int8/uint8 state codes: one saturating cvt.rni per element and state (round half to even,
    convert and clamp to the code's range: F2I.S8 and F2IP.U8), then only the bounds the hardware does
    not give (int8's -127, uint8's floor at 1 for positive values); no separate rint
    (cvt.rni.f32.f32), float clamp or 32-bit convert (eighth session: 117.8 -> 114.8 per element at
    64x64; twenty-second session: the saturating forms and the int8 decode through I2FP, NOTES.md).
    The int8 (m) decode is a 32-bit cvt.rn.f32.s32 of the sign-extended code, not cvt.rn.f32.s8."""
    cfg = SMALL_BT_CONFIGS[-2]
    per_thread = cfg.BM * cfg.BN // (cfg.num_warps * 32)
    ptx = compile_fused(cfg, fused.S_INT8, fused.S_UINT8).asm["ptx"]
    assert ptx.count("cvt.rni.sat.s8.f32") == per_thread  # m
    assert ptx.count("cvt.rni.sat.u8.f32") == per_thread  # v
    assert "cvt.rni.s32.f32" not in ptx and "cvt.rni.f32.f32" not in ptx
    assert ptx.count("cvt.rn.f32.s32") >= per_thread and "cvt.rn.f32.s8" not in ptx


def test_int8_scale_block_indices_take_no_shuffles():
    """The scale store's row and block index are constant along each 64-column block: they are
    "reduced" with a combine that keeps one operand, so the shuffles such a reduction emits are dead
    and ptxas drops them, and the store predicate comes from them rather than from a reduction of the
    element mask. The int8 kernel's SASS then has, beyond the bf16-state kernel's shuffles (the
    non-finite count), only the two absmax reductions': log2(8 lanes per block) = 3 rounds per state and
    epilogue slice (twenty-second session, 64x64: 49 -> 24 extra SHFL; 128x256: 101 -> 50)."""
    import re

    from forge_optim.kernels import ptxas

    cfg = SMALL_BT_CONFIGS[-2]  # 64x64, 4 warps, 4 slices of 16x64: 8 lanes share a block

    def shfl(kinds):
        sass = ptxas.ptxas_usage(compile_fused(cfg, *kinds).asm["ptx"], sass=True)["sass"]
        return len(re.findall(r"\bSHFL\.", sass))

    extra = shfl((fused.S_INT8, fused.S_UINT8)) - shfl((fused.S_BF16, fused.S_BF16))
    assert extra <= 2 * 3 * cfg.epi_split + 2, extra


@pytest.mark.parametrize("config", ["64x128x64 w4 s3 g8 p3 e8 tma r168", "128x256x64 w16 s3 g8 p1 e8 tma la1",
                                    "256x128x64 w16 s3 g8 p1 e8 tma la1",
                                    "64x128x64 w4 s3 g8 p3 e8 tma r168 pf la1 fc1",
                                    "128x256x64 w16 s3 g8 p1 e8 tma la1 ev"])
def test_int8_epilogue_slice_loads_leave_together(config):
    """Each epilogue slice's W and state loads are issued together, before the slice's absmax
    reductions (fused._load_fence). Without the fence ptxas sinks loads to their first uses: on the
    16-warp winner 128x256 la1 (main before the fence) a slice's W and code loads were split across its
    shuffles, and the fence took it 5-6% faster with int8 states on the H100 (twenty-fifth session,
    benchmarks/results/fence-ab-2026-12-07.json); on 64x128 p3 r168 the division-free int8 block scale
    of f3b7a4e without the fence gave three serial DRAM round trips per slice, +24-29%. The fenced twin of
    64x128 pf la1 (exploratory: that tile is split without the fence) is grouped, and so is the
    evict-first twin of 128x256 la1 (its loads are LDG.E.EF.*, counted the same). In SASS: every
    run of loads that no SHFL separates holds W (LDG.E.128) and the codes of m and v (two LDG.E.64 per
    W load). With lookahead the next slice's loads may join this slice's run (still whole slices)."""
    from forge_optim.kernels import ptxas
    from forge_optim.kernels.launch import ALL_TUNED_CONFIGS, EXPLORE_SMALL_BT_CONFIGS
    from forge_optim.kernels.offline import epilogue_load_runs, slice_loads_grouped

    cfg = {c.short(): c for c in ALL_TUNED_CONFIGS + EXPLORE_SMALL_BT_CONFIGS}[config]
    sass = ptxas.ptxas_usage(compile_fused(cfg, fused.S_INT8, fused.S_UINT8).asm["ptx"], sass=True)["sass"]
    runs = epilogue_load_runs(sass)
    assert runs, "no epilogue loads found"
    assert slice_loads_grouped(runs) is True, runs


def test_slice_loads_grouped_reads_runs_of_w_and_code_loads():
    """The criterion on runs of (W loads, code loads): whole slices pass, a slice cut by a shuffle fails,
    and a kernel whose codes are not 64-bit loads (e4 tiles) is not judged; the parser reads plain and
    evict-first loads."""
    from forge_optim.kernels.offline import epilogue_load_runs, slice_loads_grouped

    assert slice_loads_grouped([(1, 2), (2, 4)]) is True
    assert slice_loads_grouped([(1, 2), (0, 1), (1, 1)]) is False
    assert slice_loads_grouped([(4, 0), (4, 0)]) is None
    sass = "\n".join(f"        /*{i:04x}*/                   {op} R{i}, desc[UR4][R2.64] ;"
                      for i, op in enumerate(["LDG.E.128", "LDG.E.64", "LDG.E.64", "SHFL.BFLY PT, R1, R2, 0x1, 0x1f",
                                              "@P0 LDG.E.64", "SHFL.BFLY PT, R1, R2, 0x2, 0x1f", "LDG.E.128"]))
    assert epilogue_load_runs(sass) == [(1, 2), (0, 1), (1, 0)]
    evict = "\n".join(f"        /*{i:04x}*/                   {op} R{i}, desc[UR4][R2.64] ;"
                       for i, op in enumerate(["LDG.E.EF.128", "LDG.E.EF.64", "LDG.E.EF.64",
                                               "SHFL.BFLY PT, R1, R2, 0x1, 0x1f"]))
    assert epilogue_load_runs(evict) == [(1, 2)]  # evict-first loads (KernelConfig.evict_first) count the same


@pytest.mark.parametrize("config,load_fence,fenced", [("128x256x64 w16 s3 g8 p1 e8 tma la1", -1, True),
                                                      ("256x128x64 w16 s3 g8 p1 e8 tma la1", -1, True),
                                                      ("64x128x64 w4 s3 g8 p3 e8 tma r168 pf la1", -1, False),
                                                      ("64x64x64 w4 s3 g8 p4 e4 tma r128 pf la1", -1, False),
                                                      ("64x128x64 w4 s3 g8 p3 e8 tma r168 pf la1", 1, True),
                                                      ("128x256x64 w16 s3 g8 p1 e8 tma la1", 0, False)])
def test_load_fence_only_on_large_tiles(config, load_fence, fenced):
    """By default fused._load_fence is compiled into tiles of at least 128x256 (where it was measured
    faster) and not into the small 4-warp tiles (measured 1-3% slower with it): their code stays what it
    was. KernelConfig.load_fence forces it on or off."""
    from dataclasses import replace

    from forge_optim.kernels.launch import ALL_TUNED_CONFIGS

    cfg = replace({c.short(): c for c in ALL_TUNED_CONFIGS}[config], load_fence=load_fence)
    assert cfg.fence == fenced
    for kinds in ((fused.S_INT8, fused.S_UINT8), (fused.S_BF16, fused.S_BF16)):
        ptx = compile_fused(cfg, *kinds).asm["ptx"]
        # the fence's inline asm; Triton's own TMA descriptor code has bar.warp.sync with a tab
        assert ("bar.warp.sync -1;" in ptx) == fenced, (config, kinds)


@pytest.mark.parametrize("states", ["bf16", "int8"])
def test_static_launch_layout_matches_the_kernel_entry(states):
    """The static launch (kernels/launch.py) hands torch's C++ launcher one 8-byte slot per kernel
    parameter, typed by static_layout(): it must list exactly the compiled entry's parameters, in order
    (pointers as 64-bit, sizes and keys as 32-bit ints, coefficients as fp32), ending with the two
    scratch pointers Triton appends; a mismatch would shift every argument after it."""
    import re

    from forge_optim.kernels.launch import static_layout

    kinds = fused.ADAM_STATE_KINDS[states]
    k = compile_fused(SMALL_BT_CONFIGS[-2], kinds[0], kinds[1])
    keep, tys = static_layout(k)
    assert keep == tuple(range(29))
    entry = re.search(r"\.entry\s+\w+\((.*?)\)", k.asm["ptx"], re.S).group(1)
    params = re.findall(r"\.param\s+\.(\w+)", entry)
    as_ptx = {"O": "u64", "i": "u32", "f": "f32"}
    assert [as_ptx[c] for c in tys] == params
    assert k.metadata.global_scratch_size > 0  # the device-side TMA descriptors live there
