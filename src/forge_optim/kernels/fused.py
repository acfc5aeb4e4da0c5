"""The fused FORGE kernel: weight-gradient GEMM tile in registers, optimizer update in the epilogue.

For a linear layer with upstream gradient ``dY`` [BT, Dout] and input ``X`` [BT, Din], one program
of a persistent grid walks output tiles (GROUP_SIZE swizzle) of the [Dout, Din] weight. For each
tile it accumulates ``G = dY[:, rows]^T X[:, cols]`` in fp32 registers over the token axis, then:

- MODE_UPDATE: adds the fp32 gradient buffer if one is given (final micro-step of gradient
  accumulation), multiplies by ``grad_sign`` (maximize), loads W and the rule's states (fp32, bf16,
  or int8/uint8 codes with one bf16 scale per 64 columns), applies the rule's ``triton_update``
  (a constexpr JIT function), keeps old values where G is not finite (counting those coordinates
  into ``nonfinite``), and stores W and states back (bf16 by stochastic rounding or RNE, int8 by
  per-64-block absmax quantization). The gradient never exists in memory.
- MODE_ACCUMULATE: ``buffer += G`` (an fp32 buffer, or a bf16 one rounded to nearest).

With ``PREFETCH`` (GPU only) each tile's W, states and buffer are requested into L2 before its
mainloop (``_prefetch_l2``), so the epilogue's loads hit L2 (kernel v4 in benchmarks/NOTES.md).
The epilogue runs on row slices (``_epilogue_tile``): ``_epi_load`` issues a slice's loads,
``_epi_apply`` updates and stores it, and with ``EPI_LOOKAHEAD`` the next slice's loads are issued
before this slice's stores. With ``EPI_EVICT = "evict_first"`` the W and state loads and stores
carry an L2 evict-first policy (the state streams through L2 once per step while the mainloop re-reads
dY and X tiles from it), a hint that changes no bit (NOTES.md, twenty-third session). Where the
gradient is the accumulator itself, the non-finite count is one test of the tile's sum, and an exact
count only when that sum is not finite (``_count_nonfinite_tile``; NOTES.md, seventh and eighth
sessions).

The numerics follow ``backends.torch_backend.apply_update`` op for op, except that the rules divide
with ``_triton.fast_div`` (div.approx, <= 2 ulp); the stochastic-rounding bits come from the same
uint32 hash as ``precision.hash32`` (W and the slot-0 and slot-1 states: three draws of one hash).

Under ``TRITON_INTERPRET=1`` (constexpr ``INTERPRET``) every operand is upcast to fp32 before the
dot and bf16 rounding is done by explicit bit arithmetic, because the interpreter's bf16 math is
wrong and its fp32->bf16 cast truncates.
"""
from __future__ import annotations

from .._triton import jit, tl

MODE_UPDATE = 0
MODE_ACCUMULATE = 1

# state kinds (constexpr)
S_NONE = 0
S_FP32 = 1
S_BF16 = 2
S_INT8 = 3  # signed codes, scale = absmax / 127
S_UINT8 = 4  # non-negative codes, scale = absmax / 255, positive values floored to code 1
# the three state slots of a two-moment rule (Adam family: m signed, v non-negative) per state_dtype
ADAM_STATE_KINDS = {"fp32": (S_FP32, S_FP32, S_NONE), "bf16": (S_BF16, S_BF16, S_NONE),
                    "int8": (S_INT8, S_UINT8, S_NONE)}

QBLOCK = 64  # columns per int8 scale (precision.INT8_BLOCK)


@jit
def _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_SIZE: tl.constexpr):
    """Grouped ordering: GROUP_SIZE row-tiles sweep all column-tiles together (L2 reuse of X)."""
    num_pid_in_group = GROUP_SIZE * num_pid_n
    group_id = tile_id // num_pid_in_group
    first_pid_m = group_id * GROUP_SIZE
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_SIZE)
    pid_m = first_pid_m + (tile_id % group_size_m)
    pid_n = (tile_id % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@jit
def _hash32(off_u32, key):
    """precision.hash32((offset + key) mod 2**32)."""
    h = off_u32 + key.to(tl.uint32)
    h = ((h >> 16) ^ h) * 0x045D9F3B
    h = ((h >> 16) ^ h) * 0x045D9F3B
    return (h >> 16) ^ h


@jit
def _random16(off_u32, key, DRAW: tl.constexpr):
    """16 random bits per element (precision.random16): DRAW 0 the hash's low half, 1 its high half, 2
    the high half of the hash times precision.DRAW2_MUL. The weight's store takes draw 0 and the states
    in slots 0 and 1 draws 1 and 2 of one hash (the compiler computes it once): three bf16 stores cost
    one hash and a multiply, not two hashes (NOTES.md, twenty-first session)."""
    h = _hash32(off_u32, key)
    if DRAW == 1:
        return h >> 16
    elif DRAW == 2:
        return (h * 0x5BD1E995) >> 16
    else:
        return h & 0xFFFF


@jit
def _to_bf16(x, hoff, key, SR: tl.constexpr, INTERPRET: tl.constexpr, DRAW: tl.constexpr):
    """fp32 -> bf16, stochastic (add 16 hashed bits, truncate) or round-to-nearest-even."""
    if SR:
        bits = x.to(tl.uint32, bitcast=True) + _random16(hoff, key, DRAW)
        if INTERPRET:
            return (bits & 0xFFFF0000).to(tl.float32, bitcast=True).to(tl.bfloat16)
        else:  # the high half is the bf16 (PRMT packs two of them: no mask, no convert)
            return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        if INTERPRET:  # the interpreter's cast truncates: round the bit pattern first
            bits = x.to(tl.uint32, bitcast=True)
            lsb = (bits >> 16) & 1
            bits = (bits + 0x7FFF + lsb) & 0xFFFF0000
            r = tl.where(x != x, x, bits.to(tl.float32, bitcast=True))
            return r.to(tl.bfloat16)
        else:
            return x.to(tl.bfloat16)


@jit
def _round_to_code(y, x, KIND: tl.constexpr, INTERPRET: tl.constexpr):
    """int8 (KIND 3) or uint8 (KIND 4) codes of y = x / scale as int32, as precision.quantize computes
    them: round half to even, clamp to [-127, 127] or [0, 255], and a positive x floored to code 1.
    On the GPU one saturating cvt.rni to the code's type (F2I.S8, F2IP.U8: round, convert and clamp;
    an infinite y saturates to the bound the clamp gives, NaN converts to 0), then only the bounds it
    does not give (NOTES.md, eighth and twenty-second sessions). The interpreter has no inline
    assembly: it rounds with the 1.5 * 2**23 trick (|y| < 2**22) and clamps."""
    if INTERPRET:
        qi = ((y + 12582912.0) - 12582912.0).to(tl.int32)
        if KIND == 4:
            return tl.where(x > 0, tl.minimum(tl.maximum(qi, 1), 255), 0)
        else:
            return tl.minimum(tl.maximum(qi, -127), 127)
    elif KIND == 4:
        qi = tl.inline_asm_elementwise("cvt.rni.sat.u8.f32 $0, $1;", "=r,f", [y], dtype=tl.int32,
                                       is_pure=True, pack=1)
        return tl.where(x > 0, tl.maximum(qi, 1), qi)
    else:
        qi = tl.inline_asm_elementwise("cvt.rni.sat.s8.f32 $0, $1;", "=r,f", [y], dtype=tl.int32,
                                       is_pure=True, pack=1)
        return tl.maximum(qi, -127)


@jit
def _load_raw(s_ptr, sc_ptr, lin, mask, offs_m, sb_idx, M, NSB,
              KIND: tl.constexpr, EVICT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """One state of a [BM, BN] block as stored: values (fp32/bf16) or codes plus their [BM, BN/64]
    scales, not yet converted, so that a slice's loads can be issued early (``_epilogue_tile``) at
    the cost of its packed registers only."""
    if KIND == 0:
        return tl.zeros((BM, BN), dtype=tl.float32), tl.zeros((BM, BN // 64), dtype=tl.float32)
    elif KIND == 1 or KIND == 2:
        return (tl.load(s_ptr + lin, mask=mask, other=0.0, eviction_policy=EVICT),
                tl.zeros((BM, BN // 64), dtype=tl.float32))
    else:
        q = tl.load(s_ptr + lin, mask=mask, other=0, eviction_policy=EVICT)
        smask = (offs_m[:, None] < M) & (sb_idx[None, :] < NSB)
        sc = tl.load(sc_ptr + offs_m[:, None].to(tl.int64) * NSB + sb_idx[None, :], mask=smask, other=0.0)
        return q, sc


@jit
def _raw_value(q, sc, KIND: tl.constexpr, INTERPRET: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """fp32 value of a state loaded by ``_load_raw``."""
    if KIND == 0:
        return q
    elif KIND == 1 or KIND == 2:
        return q.to(tl.float32)
    else:
        NB: tl.constexpr = BN // 64
        v = tl.reshape(_code_to_f32(q, KIND, INTERPRET), (BM, NB, 64)) * sc.to(tl.float32)[:, :, None]
        return tl.reshape(v, (BM, BN))


@jit
def _code_to_f32(q, KIND: tl.constexpr, INTERPRET: tl.constexpr):
    """fp32 value of int8 (KIND 3) or uint8 (KIND 4) codes, before the block scale (the ping-pong kernel
    calls it too)."""
    if KIND == 3 and not INTERPRET:
        # int8 -> fp32 from the sign-extended int32 (I2FP, on the FP32 pipe): the compiler's
        # conversion of an int8 is I2F.S8/S16, on the quarter-rate conversion pipe
        return tl.inline_asm_elementwise("cvt.rn.f32.s32 $0, $1;", "=f,r", [q.to(tl.int32)],
                                         dtype=tl.float32, is_pure=True, pack=1)
    else:
        return q.to(tl.float32)


@jit
def _block_scale(absmax, qmax, one):
    """precision._block_scale: a block's scale, absmax / qmax rounded up to bf16 (kept in fp32), and its
    inverse (0 for an all-zero block), against which the codes are rounded. ``qmax`` and ``one`` are
    tensors shaped like ``absmax`` holding 127 or 255 and 1.0 (so that Gluon callers give them a layout)."""
    scale = tl.div_rn(absmax, qmax)
    scale = ((scale.to(tl.uint32, bitcast=True) + 0xFFFF) & 0xFFFF0000).to(tl.float32, bitcast=True)
    inv = tl.where(scale > 0, tl.div_rn(one, scale), 0.0)
    return scale, inv


@jit
def _store_state(s_ptr, sc_ptr, value, lin, hoff, mask, offs_m, sb_idx, M, NSB, key,
                 KIND: tl.constexpr, SR: tl.constexpr, INTERPRET: tl.constexpr, DRAW: tl.constexpr,
                 EVICT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    if KIND == 1:
        tl.store(s_ptr + lin, value, mask=mask, eviction_policy=EVICT)
    elif KIND == 2:
        tl.store(s_ptr + lin, _to_bf16(value, hoff, key, SR, INTERPRET, DRAW), mask=mask, eviction_policy=EVICT)
    elif KIND == 3 or KIND == 4:
        NB: tl.constexpr = BN // 64
        # no where(mask, value, 0) before the absmax: out of range, W, the gradient and the states were
        # loaded as 0, and every rule maps (0, 0, zero states) to zero states
        # (test_triton_kernel.py::test_rule_maps_zero_inputs_to_zero_states), so those entries are 0
        # already (saves a select per element and state, and keeping the mask's bits live)
        x = tl.reshape(value, (BM, NB, 64))
        absmax = tl.max(tl.abs(x), axis=2)
        if KIND == 4:
            qmax = 255.0
        else:
            qmax = 127.0
        # the codes against the stored scale
        scale, inv = _block_scale(absmax, tl.full(absmax.shape, qmax, tl.float32),
                                  tl.full(absmax.shape, 1.0, tl.float32))
        qi = _round_to_code(x * inv[:, :, None], x, KIND, INTERPRET)
        if KIND == 4:
            qs = tl.reshape(qi, (BM, BN)).to(tl.uint8)
        else:
            qs = tl.reshape(qi, (BM, BN)).to(tl.int8)
        tl.store(s_ptr + lin, qs, mask=mask, eviction_policy=EVICT)
        if INTERPRET:
            smask = (offs_m[:, None] < M) & (sb_idx[None, :] < NSB)
            tl.store(sc_ptr + offs_m[:, None].to(tl.int64) * NSB + sb_idx[None, :], scale.to(tl.bfloat16),
                     mask=smask)
        else:
            _store_scales(sc_ptr, scale, offs_m, tl.min(sb_idx, axis=0), M, NSB, BM, BN)


@jit
def _first(a, b):
    """A reduction's combine that keeps its first operand: the reduction of a value that is constant
    along the reduced axis, for its result layout only (the compiler drops the unused shuffles)."""
    return a


@jit
def _store_scales(sc_ptr, scale, offs_m, blk0, M, NSB, BM: tl.constexpr, BN: tl.constexpr):
    """Store the [BM, BN/64] block scales from the layout the absmax reduction left them in.

    A tl.store is re-anchored by Triton's coalescing pass to a layout of its own, which costs a
    shared-memory round trip and a CTA barrier per store (8 per tile: NOTES.md, int8 IR). Here each
    scale's row and block index are "reduced" over the block like the absmax (reshape to [BM, NB, 64];
    they are constant along it, so the combine keeps either operand and costs nothing), so that address,
    predicate and value share the reduction's layout, and the store is an inline ``st.global`` that no
    pass re-anchors. Lanes holding the same scale store the same value to the same address. ``scale``
    is exact in bf16: its high half is the stored bf16."""
    NB: tl.constexpr = BN // 64
    zero = tl.zeros((BM, BN), dtype=tl.int32)
    row = tl.reduce(tl.reshape(offs_m[:, None] + zero, (BM, NB, 64)), 2, _first)
    blk = tl.reduce(tl.reshape(tl.arange(0, BN)[None, :] // 64 + zero, (BM, NB, 64)), 2, _first) + blk0
    valid = tl.where((row < M) & (blk < NSB), 1, 0)
    # all operands as integers (inline asm broadcasts its operands to one another)
    addr = (sc_ptr + (row.to(tl.int64) * NSB + blk)).to(tl.int64)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .b16 lo, hi; setp.ne.s32 p, $3, 0; mov.b32 {lo, hi}, $2; "
        "@p st.global.b16 [$1], hi; }\n\tmov.u32 $0, 0;",
        "=r,l,r,r", [addr, scale.to(tl.int32, bitcast=True), valid], dtype=tl.int32, is_pure=False, pack=1)


@jit
def _epi_load(row0, col0, P, M, N, NSB, MODE: tl.constexpr, HAS_BUF: tl.constexpr, S0: tl.constexpr,
              S1: tl.constexpr, S2: tl.constexpr, EVICT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """Issue the loads of the [BM, BN] block at (row0, col0): W, the states as stored (``_load_raw``) and
    the gradient buffer. Returns (w, q0, z0, q1, z1, q2, z2, b); z* are the int8 scales.
    P: the kernel's pointers, (w, s0, s1, s2, sc0, sc1, sc2, buf, nf)."""
    w_ptr, s0_ptr, s1_ptr, s2_ptr, sc0_ptr, sc1_ptr, sc2_ptr, buf_ptr, nf_ptr = P
    offs_m = row0 + tl.arange(0, BM)
    offs_n = col0 + tl.arange(0, BN)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    base = row0.to(tl.int64) * N + col0
    rel = tl.arange(0, BM)[:, None] * N + tl.arange(0, BN)[None, :]
    sb_idx = col0 // 64 + tl.arange(0, BN // 64)
    if MODE == 1 or HAS_BUF:
        b = tl.load(buf_ptr + base + rel, mask=mask, other=0.0)
    else:
        b = tl.zeros((BM, BN), dtype=tl.float32)
    if MODE == 1:
        w = tl.zeros((BM, BN), dtype=tl.float32)
    else:
        w = tl.load(w_ptr + base + rel, mask=mask, other=0.0, eviction_policy=EVICT)
    q0, z0 = _load_raw(s0_ptr + base, sc0_ptr, rel, mask, offs_m, sb_idx, M, NSB, S0, EVICT, BM, BN)
    q1, z1 = _load_raw(s1_ptr + base, sc1_ptr, rel, mask, offs_m, sb_idx, M, NSB, S1, EVICT, BM, BN)
    q2, z2 = _load_raw(s2_ptr + base, sc2_ptr, rel, mask, offs_m, sb_idx, M, NSB, S2, EVICT, BM, BN)
    return w, q0, z0, q1, z1, q2, z2, b


@jit
def _epi_apply(acc, row0, col0, LD, P, M, N, NSB, C, K, UPDATE: tl.constexpr,
               MODE: tl.constexpr, HAS_BUF: tl.constexpr, COUNT_NF: tl.constexpr, W_BF16: tl.constexpr,
               W_SR: tl.constexpr, S0: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr, S_SR: tl.constexpr,
               INTERPRET: tl.constexpr, EVICT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """Update the [BM, BN] block at (row0, col0) of W and its states from the fp32 gradient acc and the
    values ``_epi_load`` returned for the block (LD); store W and the states. C: the rule's eight
    coefficients and grad_sign; K: the weight's and the three states' hash keys.

    Addresses are a 64-bit scalar tile base plus 32-bit in-tile offsets (fewer registers).
    """
    w_raw, q0, z0, q1, z1, q2, z2, b_raw = LD
    w_ptr, s0_ptr, s1_ptr, s2_ptr, sc0_ptr, sc1_ptr, sc2_ptr, buf_ptr, nf_ptr = P
    c0, c1, c2, c3, c4, c5, c6, c7, grad_sign = C
    key_w, key_s0, key_s1, key_s2 = K
    offs_m = row0 + tl.arange(0, BM)
    offs_n = col0 + tl.arange(0, BN)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    base = row0.to(tl.int64) * N + col0
    rel = tl.arange(0, BM)[:, None] * N + tl.arange(0, BN)[None, :]
    if MODE == 1:
        if buf_ptr.dtype.element_ty == tl.bfloat16:  # a bf16 buffer (accumulate_dtype="bf16"): fp32 sum, to nearest
            total = b_raw.to(tl.float32) + acc
            tl.store(buf_ptr + base + rel, _to_bf16(total, rel.to(tl.uint32), 0, False, INTERPRET, 0), mask=mask)
        else:
            tl.store(buf_ptr + base + rel, b_raw + acc, mask=mask)
    else:
        g = acc
        if HAS_BUF:  # an fp32 buffer, or a bf16 gradient read in place (update_from_grad): exact upcast
            g = g + b_raw.to(tl.float32)
        g = g * grad_sign
        # hash input for SR: the linear offset of each element in the whole weight, mod 2**32, as an
        # in-tile part (hoff) and the tile base, which is folded into each key (one add per element per
        # hash, not two)
        hoff = rel.to(tl.uint32)
        hbase = base.to(tl.uint32)
        hkey_w = hbase + key_w.to(tl.uint32)
        sb_idx = col0 // 64 + tl.arange(0, BN // 64)
        w_t = w_ptr + base
        s0_t = s0_ptr + base
        s1_t = s1_ptr + base
        s2_t = s2_ptr + base
        w_old = w_raw.to(tl.float32)
        s0_old = _raw_value(q0, z0, S0, INTERPRET, BM, BN)
        s1_old = _raw_value(q1, z1, S1, INTERPRET, BM, BN)
        s2_old = _raw_value(q2, z2, S2, INTERPRET, BM, BN)
        w_new, s0_new, s1_new, s2_new = UPDATE(w_old, g, s0_old, s1_old, s2_old,
                                               c0, c1, c2, c3, c4, c5, c6, c7)
        finite = tl.abs(g) < float("inf")  # False for NaN and +-Inf
        w_new = tl.where(finite, w_new, w_old)
        if COUNT_NF:  # the gradient includes the buffer: counted here, slice by slice
            _count_nonfinite(g, row0, col0, M, N, nf_ptr, BM, BN)
        if W_BF16:
            tl.store(w_t + rel, _to_bf16(w_new, hoff, hkey_w, W_SR, INTERPRET, 0), mask=mask, eviction_policy=EVICT)
        else:
            tl.store(w_t + rel, w_new, mask=mask, eviction_policy=EVICT)
        if S0 != 0:
            s0_new = tl.where(finite, s0_new, s0_old)
            # slots 0 and 1 draw from the weight's hash (key_s0 and key_s1 are not used: _random16)
            _store_state(s0_t, sc0_ptr, s0_new, rel, hoff, mask, offs_m, sb_idx, M, NSB, hkey_w,
                         S0, S_SR, INTERPRET, 1, EVICT, BM, BN)
        if S1 != 0:
            s1_new = tl.where(finite, s1_new, s1_old)
            _store_state(s1_t, sc1_ptr, s1_new, rel, hoff, mask, offs_m, sb_idx, M, NSB, hkey_w,
                         S1, S_SR, INTERPRET, 2, EVICT, BM, BN)
        if S2 != 0:
            s2_new = tl.where(finite, s2_new, s2_old)
            _store_state(s2_t, sc2_ptr, s2_new, rel, hoff, mask, offs_m, sb_idx, M, NSB, hbase + key_s2.to(tl.uint32),
                         S2, S_SR, INTERPRET, 0, EVICT, BM, BN)


@jit
def _count_nonfinite(g, row0, col0, M, N, nf_ptr, BM: tl.constexpr, BN: tl.constexpr):
    """Add the number of in-range non-finite entries of the [BM, BN] gradient block at (row0, col0) to
    ``nf_ptr`` (one CTA-wide reduction: two barriers). Called per epilogue slice where a gradient
    buffer is added first, and by ``_count_nonfinite_tile`` on a tile's accumulator (the gradient is
    ``acc * grad_sign``, grad_sign = +-1: same finiteness) whose sum is not finite."""
    offs_m = row0 + tl.arange(0, BM)
    offs_n = col0 + tl.arange(0, BN)
    inr = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    bad = tl.sum(tl.where(inr & (tl.abs(g) < float("inf")), 0, tl.where(inr, 1, 0)))
    if bad > 0:
        tl.atomic_add(nf_ptr, bad.to(tl.int64))


@jit
def _count_nonfinite_tile(acc, row0, col0, M, N, nf_ptr, BM: tl.constexpr, BN: tl.constexpr):
    """``_count_nonfinite`` of a whole tile's accumulator at one add per element on the fast path,
    instead of a test, a select and an add: the tile's sum is finite unless an entry is not finite.
    If it is not (also when finite entries overflow the sum, or when an out-of-range entry is NaN:
    a zero-padded X column times an infinite dY entry), the exact count runs and finds the truth."""
    total = tl.sum(tl.sum(acc, axis=1), axis=0)
    if not (tl.abs(total) < float("inf")):  # False for NaN and +-Inf
        _count_nonfinite(acc, row0, col0, M, N, nf_ptr, BM, BN)


@jit
def _prefetch_l2(ptr, row0, col0, M, N, BM: tl.constexpr, BN: tl.constexpr):
    """Ask L2 for the [BM, BN] tile at (row0, col0) of the row-major [M, N] tensor at ``ptr``:
    one ``prefetch.global.L2`` per 128-byte line, no registers held. Issued before a tile's mainloop
    so that its epilogue's W/state loads hit L2 instead of waiting on DRAM (NOTES.md, kernel v4).
    Rows and columns past the edge are clamped to the last valid element (a prefetch must not name
    an address outside the tensor)."""
    ES: tl.constexpr = ptr.dtype.element_ty.primitive_bitwidth // 8
    PER: tl.constexpr = 128 // ES
    LINES: tl.constexpr = (BN + PER - 1) // PER
    rows = tl.minimum(row0 + tl.arange(0, BM), M - 1)
    cols = tl.minimum(col0 + tl.arange(0, LINES) * PER, N - 1)
    p = ptr + (rows[:, None].to(tl.int64) * N + cols[None, :])
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [p],
                              dtype=tl.int32, is_pure=False, pack=1)


@jit
def _split_rows(acc, BM: tl.constexpr, BN: tl.constexpr):
    """[BM, BN] -> rows [0, BM/2) and [BM/2, BM)."""
    t = tl.permute(tl.reshape(acc, (2, BM // 2, BN)), (1, 2, 0))
    return tl.split(t)


@jit
def _load_fence(row0, INTERPRET: tl.constexpr, ON: tl.constexpr):
    """A scheduling fence after a slice's loads: a warp-wide bar.warp.sync (ptxas elides the instruction
    for a converged full mask but keeps its memory ordering), which stops ptxas from sinking the loads
    issued before it to their first uses. Without it, under a register cap and with no call in the
    epilogue to stop it, ptxas gave the W and state loads of a slice the same registers and issued them
    one after another, each a DRAM round trip (NOTES.md, twenty-fourth session). Returns ``row0``
    through the instruction so that it is not dropped as dead code (the interpreter has no inline assembly).
    ON (``_epilogue_tile``'s FENCE: the kernel's EPI_FENCE, ``KernelConfig.fence``) is by default set on
    tiles of at least 128x256 only: measured on the H100 (NOTES.md, twenty-fifth session) it took the
    16-warp 128x256 tile 5-6% faster with int8 states and 0-1% with bf16, and the 4-warp 64x128 and 64x64
    tiles 1-3% slower with int8 (their loads were grouped already); ``KernelConfig.load_fence`` overrides it
    per config."""
    if INTERPRET or not ON:
        return row0
    return tl.inline_asm_elementwise("bar.warp.sync -1;\n\tmov.b32 $0, $1;", "=r,r", [row0], dtype=tl.int32,
                                     is_pure=False, pack=1)


@jit
def _epilogue_tile(acc, row0, col0, P, M, N, NSB, C, K, UPDATE: tl.constexpr,
                   MODE: tl.constexpr, HAS_BUF: tl.constexpr, COUNT_NF: tl.constexpr, W_BF16: tl.constexpr,
                   W_SR: tl.constexpr, S0: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr, S_SR: tl.constexpr,
                   INTERPRET: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, SPLIT: tl.constexpr, LOOKAHEAD: tl.constexpr,
                   EVICT: tl.constexpr, FENCE: tl.constexpr):
    """The epilogue of one [BM, BN] tile on SPLIT (1, 2 or 4) row slices of BM/SPLIT rows, one after
    another (fewer live registers). A load issued after a store to W or a state may alias it, so
    neither the compiler nor the hardware moves it ahead: LOOKAHEAD 1 therefore issues each slice's
    loads before the previous slice's stores (the load latency is paid once per tile, not once per
    slice); 2 issues every slice's loads first (more registers: the packed W and states of the tile)."""
    Q: tl.constexpr = BM // SPLIT
    if SPLIT == 1:
        A = (acc,)
    elif SPLIT == 2:
        A = _split_rows(acc, BM, BN)
    else:
        a0, a1 = _split_rows(acc, BM, BN)
        a00, a01 = _split_rows(a0, BM // 2, BN)
        a10, a11 = _split_rows(a1, BM // 2, BN)
        A = (a00, a01, a10, a11)
    ahead: tl.constexpr = 0 if LOOKAHEAD == 0 else (1 if LOOKAHEAD == 1 else SPLIT - 1)
    L0 = _epi_load(row0, col0, P, M, N, NSB, MODE, HAS_BUF, S0, S1, S2, EVICT, Q, BN)
    row0 = _load_fence(row0, INTERPRET, FENCE)
    if SPLIT > 1 and ahead >= 1:
        L1 = _epi_load(row0 + Q, col0, P, M, N, NSB, MODE, HAS_BUF, S0, S1, S2, EVICT, Q, BN)
        row0 = _load_fence(row0, INTERPRET, FENCE)
    if SPLIT > 2 and ahead >= 2:
        L2 = _epi_load(row0 + 2 * Q, col0, P, M, N, NSB, MODE, HAS_BUF, S0, S1, S2, EVICT, Q, BN)
        row0 = _load_fence(row0, INTERPRET, FENCE)
        L3 = _epi_load(row0 + 3 * Q, col0, P, M, N, NSB, MODE, HAS_BUF, S0, S1, S2, EVICT, Q, BN)
        row0 = _load_fence(row0, INTERPRET, FENCE)
    _epi_apply(A[0], row0, col0, L0, P, M, N, NSB, C, K,
               UPDATE, MODE, HAS_BUF, COUNT_NF, W_BF16, W_SR, S0, S1, S2, S_SR, INTERPRET, EVICT, Q, BN)
    if SPLIT > 1:
        if ahead == 0:
            L1 = _epi_load(row0 + Q, col0, P, M, N, NSB, MODE, HAS_BUF, S0, S1, S2, EVICT, Q, BN)
            row0 = _load_fence(row0, INTERPRET, FENCE)
        if SPLIT > 2 and ahead == 1:
            L2 = _epi_load(row0 + 2 * Q, col0, P, M, N, NSB, MODE, HAS_BUF, S0, S1, S2, EVICT, Q, BN)
            row0 = _load_fence(row0, INTERPRET, FENCE)
        _epi_apply(A[1], row0 + Q, col0, L1, P, M, N, NSB, C, K,
                   UPDATE, MODE, HAS_BUF, COUNT_NF, W_BF16, W_SR, S0, S1, S2, S_SR, INTERPRET, EVICT, Q, BN)
    if SPLIT > 2:
        if ahead == 0:
            L2 = _epi_load(row0 + 2 * Q, col0, P, M, N, NSB, MODE, HAS_BUF, S0, S1, S2, EVICT, Q, BN)
            row0 = _load_fence(row0, INTERPRET, FENCE)
        if ahead == 1:
            L3 = _epi_load(row0 + 3 * Q, col0, P, M, N, NSB, MODE, HAS_BUF, S0, S1, S2, EVICT, Q, BN)
            row0 = _load_fence(row0, INTERPRET, FENCE)
        _epi_apply(A[2], row0 + 2 * Q, col0, L2, P, M, N, NSB, C, K,
                   UPDATE, MODE, HAS_BUF, COUNT_NF, W_BF16, W_SR, S0, S1, S2, S_SR, INTERPRET, EVICT, Q, BN)
        if ahead == 0:
            L3 = _epi_load(row0 + 3 * Q, col0, P, M, N, NSB, MODE, HAS_BUF, S0, S1, S2, EVICT, Q, BN)
            row0 = _load_fence(row0, INTERPRET, FENCE)
        _epi_apply(A[3], row0 + 3 * Q, col0, L3, P, M, N, NSB, C, K,
                   UPDATE, MODE, HAS_BUF, COUNT_NF, W_BF16, W_SR, S0, S1, S2, S_SR, INTERPRET, EVICT, Q, BN)


# BT, M, NSB and the hash keys change from call to call (token count, layer, step): never
# specialize on them, or a key that happens to be divisible by 16 would trigger a recompile.
@jit(do_not_specialize=["BT", "M", "NSB", "NUM_PROGS", "key_w", "key_s0", "key_s1", "key_s2"])
def forge_fused_kernel(
        dy_ptr, x_ptr, w_ptr, s0_ptr, s1_ptr, s2_ptr, sc0_ptr, sc1_ptr, sc2_ptr, buf_ptr, nf_ptr,
        BT, M, N, NSB, NUM_PROGS,
        c0, c1, c2, c3, c4, c5, c6, c7, grad_sign, key_w, key_s0, key_s1, key_s2,
        UPDATE: tl.constexpr, MODE: tl.constexpr, HAS_BUF: tl.constexpr, HAS_NF: tl.constexpr,
        W_BF16: tl.constexpr, W_SR: tl.constexpr,
        S0: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr, S_SR: tl.constexpr,
        DOT_PREC: tl.constexpr, INTERPRET: tl.constexpr, USE_TMA: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_SIZE: tl.constexpr,
        EPI_SPLIT: tl.constexpr, FLATTEN: tl.constexpr, PREFETCH: tl.constexpr,
        EPI_LOOKAHEAD: tl.constexpr, EPI_EVICT: tl.constexpr, EPI_FENCE: tl.constexpr):
    """One persistent program: for each of its tiles, G = dY[:, rows]^T X[:, cols], then epilogue."""
    start_pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    num_tiles = num_pid_m * num_pid_n
    k_tiles = tl.cdiv(BT, BK)
    if USE_TMA:
        dy_desc = tl.make_tensor_descriptor(dy_ptr, shape=[BT, M], strides=[M, 1], block_shape=[BK, BM])
        x_desc = tl.make_tensor_descriptor(x_ptr, shape=[BT, N], strides=[N, 1], block_shape=[BK, BN])
    offs_k = tl.arange(0, BK)
    # a second tile counter for the epilogue (as Triton's persistent-matmul tutorial): with
    # FLATTEN the tile and K loops become one software-pipelined loop, so the next tile's loads
    # are in flight while this tile's epilogue runs.
    tile_id_c = start_pid - NUM_PROGS
    for tile_id in tl.range(start_pid, num_tiles, NUM_PROGS, flatten=FLATTEN):
        pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_SIZE)
        offs_m = pid_m * BM + tl.arange(0, BM)
        offs_n = pid_n * BN + tl.arange(0, BN)
        if PREFETCH:  # the tile's epilogue operands start their trip to L2 during the mainloop
            if MODE == 1 or HAS_BUF:
                _prefetch_l2(buf_ptr, pid_m * BM, pid_n * BN, M, N, BM, BN)
            if MODE == 0:
                _prefetch_l2(w_ptr, pid_m * BM, pid_n * BN, M, N, BM, BN)
                if S0 != 0:
                    _prefetch_l2(s0_ptr, pid_m * BM, pid_n * BN, M, N, BM, BN)
                if S1 != 0:
                    _prefetch_l2(s1_ptr, pid_m * BM, pid_n * BN, M, N, BM, BN)
                if S2 != 0:
                    _prefetch_l2(s2_ptr, pid_m * BM, pid_n * BN, M, N, BM, BN)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for kt in range(0, k_tiles):
            k0 = kt * BK
            if USE_TMA:
                a = dy_desc.load([k0, pid_m * BM])  # [BK, BM]
                b = x_desc.load([k0, pid_n * BN])  # [BK, BN]
            else:
                kk = k0 + offs_k
                kmask = kk[:, None] < BT
                a = tl.load(dy_ptr + kk[:, None].to(tl.int64) * M + offs_m[None, :],
                            mask=kmask & (offs_m[None, :] < M), other=0.0)
                b = tl.load(x_ptr + kk[:, None].to(tl.int64) * N + offs_n[None, :],
                            mask=kmask & (offs_n[None, :] < N), other=0.0)
            if INTERPRET:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a.T, b, acc, input_precision=DOT_PREC)
        tile_id_c += NUM_PROGS
        pid_mc, pid_nc = _tile_coords(tile_id_c, num_pid_m, num_pid_n, GROUP_SIZE)
        row0 = pid_mc * BM
        col0 = pid_nc * BN
        # Non-finite count: from the whole tile at once where the gradient is acc * (+-1); per slice
        # (after the buffer is added) otherwise.
        if HAS_NF and not HAS_BUF and MODE == 0:
            _count_nonfinite_tile(acc, row0, col0, M, N, nf_ptr, BM, BN)
        P = (w_ptr, s0_ptr, s1_ptr, s2_ptr, sc0_ptr, sc1_ptr, sc2_ptr, buf_ptr, nf_ptr)
        C = (c0, c1, c2, c3, c4, c5, c6, c7, grad_sign)
        K = (key_w, key_s0, key_s1, key_s2)
        COUNT_NF: tl.constexpr = HAS_NF and HAS_BUF
        if EPI_SPLIT <= 4:
            _epilogue_tile(acc, row0, col0, P, M, N, NSB, C, K,
                           UPDATE, MODE, HAS_BUF, COUNT_NF, W_BF16, W_SR, S0, S1, S2, S_SR, INTERPRET,
                           BM, BN, EPI_SPLIT, EPI_LOOKAHEAD, EPI_EVICT, EPI_FENCE)
        else:  # 8 row slices: two halves of four
            H8: tl.constexpr = BM // 2
            a0, a1 = _split_rows(acc, BM, BN)
            _epilogue_tile(a0, row0, col0, P, M, N, NSB, C, K,
                           UPDATE, MODE, HAS_BUF, COUNT_NF, W_BF16, W_SR, S0, S1, S2, S_SR, INTERPRET,
                           H8, BN, 4, EPI_LOOKAHEAD, EPI_EVICT, EPI_FENCE)
            _epilogue_tile(a1, row0 + H8, col0, P, M, N, NSB, C, K,
                           UPDATE, MODE, HAS_BUF, COUNT_NF, W_BF16, W_SR, S0, S1, S2, S_SR, INTERPRET,
                           H8, BN, 4, EPI_LOOKAHEAD, EPI_EVICT, EPI_FENCE)
