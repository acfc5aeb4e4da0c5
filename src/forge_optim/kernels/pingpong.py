"""Hopper ping-pong variant of the fused kernel, written in Gluon (sm_90 only).

Why a second kernel: the Triton kernel (``fused.py``) runs each tile's GEMM mainloop and its
optimizer epilogue one after the other in the same warps, and at small BT the epilogue's state
traffic is as long as the mainloop, so the two add up (NOTES.md, "what bounds the epilogue").
Triton 3.6 cannot overlap them on Hopper. Gluon exposes warp specialization, so here one program
per SM holds three partitions:

- a loader warp that streams the dY and X tiles of every tile of this program through a ring of
  ``STAGES`` shared-memory buffers with TMA;
- two consumer warpgroups that take the tiles of this program in turn (even / odd). Each one runs
  the wgmma mainloop of its tile into its own fp32 accumulator, then the epilogue of that tile.
  While one consumer is in its epilogue (memory-bound), the other runs its mainloop (tensor cores):
  CUTLASS's "ping-pong" schedule.

The ring is consumed in tile order, so the two consumers' mainloops alternate naturally.

The epilogue computes exactly what ``fused._epi_apply`` computes for MODE_UPDATE without a gradient
buffer: the rule's ``triton_update`` (the same @triton.jit function), the non-finite guard and
count, and bf16 stores by the same hashed stochastic rounding (``fused._to_bf16``) or RNE. States are
fp32 or bf16, or int8/uint8 codes with their bf16 block scales (epilogue slices one 64-column block wide;
bit-identical to the Triton kernel's on an H100, but 1.24-1.27x slower, so the backend does not use it);
gradient buffers and accumulate mode use the Triton kernel.

Where it runs: the Triton backend launches it for a tuning key whose entry in this device's tuned table
names it (``{"kernel": "pingpong", ...}``, ``table_dict``; ``backends/triton_backend.py``), and falls back to
the Triton kernel for a launch it cannot take (``supported``). Prepared updates re-launch the compiled
kernel with new dY/X descriptors only (``relaunch``).
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, replace

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from . import fused
from .launch import _capability, _i32, _sm_count, state_kind


# the same GROUP_SIZE swizzle as the Triton kernel (a @triton.jit function: Gluon can call it)
_tile_coords = fused._tile_coords

# The partitions below synchronize only through mbarrier parity waits. tests/test_pingpong_protocol.py writes
# their waits and arrivals out again and checks every interleaving on CPU (no race, no deadlock): change both.


@gluon.jit
def _operand_loader(dy_desc, x_desc, w_desc, s0_desc, s1_desc, s2_desc, a_bufs, b_bufs, w_bufs, s0_bufs, s1_bufs, s2_bufs,
        ready, empty, order, st_ready, st_empty, nf_ptr, M, N, NPROG,
        c0, c1, c2, c3, c4, c5, c6, c7, grad_sign, key_w, key_s0, key_s1, key_s2, sc0_ptr, sc1_ptr, sc2_ptr, NSB,
        UPDATE: gl.constexpr, HAS_NF: gl.constexpr, W_BF16: gl.constexpr, W_SR: gl.constexpr,
        S0: gl.constexpr, S1: gl.constexpr, S2: gl.constexpr, S_SR: gl.constexpr,
        BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
        GROUP_SIZE: gl.constexpr, EPI_N: gl.constexpr, ST_BYTES: gl.constexpr, SLOTS: gl.constexpr):
    """1 warp: the dY and X tiles of every tile of this program, in order, through the ring."""
    pid = gl.program_id(0)
    BT = dy_desc.shape[0]
    k_tiles = gl.cdiv(BT, BK)
    num_pid_m = gl.cdiv(M, BM)
    num_pid_n = gl.cdiv(N, BN)
    num_tiles = num_pid_m * num_pid_n
    nbytes: gl.constexpr = dy_desc.block_type.nbytes + x_desc.block_type.nbytes
    c = pid * 0  # a runtime counter (a literal 0 would be a constexpr)
    for tile_id in range(pid, num_tiles, NPROG):
        pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_SIZE)
        for kk in range(k_tiles):
            s = c % STAGES
            ph = (c // STAGES) & 1
            # a fresh mbarrier counts as having completed the phase before phase 0
            mbarrier.wait(empty.index(s), ph ^ 1)
            mbarrier.expect(ready.index(s), nbytes)
            tma.async_copy_global_to_shared(dy_desc, [kk * BK, pid_m * BM], ready.index(s), a_bufs.index(s))
            tma.async_copy_global_to_shared(x_desc, [kk * BK, pid_n * BN], ready.index(s), b_bufs.index(s))
            c += 1


@gluon.jit
def _state_loader(dy_desc, x_desc, w_desc, s0_desc, s1_desc, s2_desc, a_bufs, b_bufs, w_bufs, s0_bufs, s1_bufs, s2_bufs,
        ready, empty, order, st_ready, st_empty, nf_ptr, M, N, NPROG,
        c0, c1, c2, c3, c4, c5, c6, c7, grad_sign, key_w, key_s0, key_s1, key_s2, sc0_ptr, sc1_ptr, sc2_ptr, NSB,
        UPDATE: gl.constexpr, HAS_NF: gl.constexpr, W_BF16: gl.constexpr, W_SR: gl.constexpr,
        S0: gl.constexpr, S1: gl.constexpr, S2: gl.constexpr, S_SR: gl.constexpr,
        BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
        GROUP_SIZE: gl.constexpr, EPI_N: gl.constexpr, ST_BYTES: gl.constexpr, SLOTS: gl.constexpr):
    """1 warp: W and the states of this program's tile j into slot (j mod SLOTS), as soon as the tile
    that used the slot before (j - SLOTS) has been stored. With SLOTS == 2 (one slot per consumer) that is
    while the consumer runs tile j's mainloop; with 3 or 4 the loads start one or two tiles earlier."""
    pid = gl.program_id(0)
    num_pid_m = gl.cdiv(M, BM)
    num_pid_n = gl.cdiv(N, BN)
    num_tiles = num_pid_m * num_pid_n
    SN: gl.constexpr = BN // EPI_N
    j = pid * 0
    for tile_id in range(pid, num_tiles, NPROG):
        pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_SIZE)
        slot = j % SLOTS
        mbarrier.wait(st_empty.index(slot), ((j // SLOTS) & 1) ^ 1)
        bar = st_ready.index(slot)
        mbarrier.expect(bar, ST_BYTES)
        for i in gl.static_range(EPI_N):
            coord = [pid_m * BM, pid_n * BN + i * SN]
            tma.async_copy_global_to_shared(w_desc, coord, bar, w_bufs.index(slot * EPI_N + i))
            if S0 != 0:
                tma.async_copy_global_to_shared(s0_desc, coord, bar, s0_bufs.index(slot * EPI_N + i))
            if S1 != 0:
                tma.async_copy_global_to_shared(s1_desc, coord, bar, s1_bufs.index(slot * EPI_N + i))
            if S2 != 0:
                tma.async_copy_global_to_shared(s2_desc, coord, bar, s2_bufs.index(slot * EPI_N + i))
        j += 1


@gluon.jit
def _consume(cid: gl.constexpr, dy_desc, x_desc, w_desc, s0_desc, s1_desc, s2_desc, a_bufs, b_bufs, w_bufs, s0_bufs, s1_bufs, s2_bufs,
        ready, empty, order, st_ready, st_empty, nf_ptr, M, N, NPROG,
        c0, c1, c2, c3, c4, c5, c6, c7, grad_sign, key_w, key_s0, key_s1, key_s2, sc0_ptr, sc1_ptr, sc2_ptr, NSB,
        UPDATE: gl.constexpr, HAS_NF: gl.constexpr, W_BF16: gl.constexpr, W_SR: gl.constexpr,
        S0: gl.constexpr, S1: gl.constexpr, S2: gl.constexpr, S_SR: gl.constexpr,
        BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
        GROUP_SIZE: gl.constexpr, EPI_N: gl.constexpr, ST_BYTES: gl.constexpr, SLOTS: gl.constexpr):
    """One consumer warpgroup: the tiles of this program whose local index is ``cid`` mod 2."""
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BN, 16])
    pid = gl.program_id(0)
    BT = dy_desc.shape[0]
    k_tiles = gl.cdiv(BT, BK)
    num_pid_m = gl.cdiv(M, BM)
    num_pid_n = gl.cdiv(N, BN)
    num_tiles = num_pid_m * num_pid_n
    SN: gl.constexpr = BN // EPI_N
    c = cid * k_tiles
    n_done = pid * 0  # tiles this consumer has done (a runtime value: a literal 0 is a constexpr)
    # the layout of an epilogue slice, and a per-thread count of non-finite gradient elements that
    # is reduced (and added to nf_ptr) once at the end: a reduction per slice cost ~10% (NOTES.md)
    SL: gl.constexpr = _split_n(gl.zeros((BM, BN), gl.float32, acc_layout), EPI_N)[0].type.layout
    bad = gl.zeros((BM, SN), gl.int32, SL)
    for tile_id in range(pid + cid * NPROG, num_tiles, 2 * NPROG):
        pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_SIZE)
        # The two consumers' mainloops take turns (CUTLASS's ordered math barrier): a consumer starts
        # only when the other has finished the previous tile's mainloop, so every ring slot is at
        # most one use behind the counter it is waited on with (a parity wait cannot alias).
        if cid == 0:
            if n_done > 0:
                mbarrier.wait(order.index(0), (n_done - 1) & 1)
        else:
            mbarrier.wait(order.index(1), n_done & 1)
        acc = gl.zeros((BM, BN), gl.float32, acc_layout)
        prev_s = 0
        for kk in range(k_tiles):
            s = c % STAGES
            ph = (c // STAGES) & 1
            mbarrier.wait(ready.index(s), ph)
            a = a_bufs.index(s).permute((1, 0))  # [BM, BK] view of the [BK, BM] dY tile
            b = b_bufs.index(s)  # [BK, BN]
            acc = warpgroup_mma(a, b, acc, is_async=True)
            # at most one wgmma in flight: the previous stage is free again
            acc = warpgroup_mma_wait(1, deps=(acc,))
            if kk > 0:
                mbarrier.arrive(empty.index(prev_s), count=1)
            prev_s = s
            c += 1
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(empty.index(prev_s), count=1)
        mbarrier.arrive(order.index(1 - cid), count=1)  # the other consumer's mainloop may start
        c += k_tiles  # skip the other consumer's tile in the ring

        # ---- epilogue: W and states are already in shared memory (the state loader), results go
        # back through the same buffers and TMA stores. Out-of-range rows/columns: TMA loads zeros
        # (G = 0 there: finite, not counted) and the stores are clipped, so no masks.
        j = 2 * n_done + cid  # this program's local tile index
        slot = j % SLOTS
        if SLOTS == 1:
            # One slot: tile j's load is issued only once tile j-1 (the other consumer's) has been stored, and
            # this consumer's mainloop can end before tile j-1's load has landed: the parity wait below would
            # then see that load's predecessor (tile j-2's) as tile j's. Waiting for tile j-1's release first
            # (st_empty's phase j-1: at most one behind, since this consumer released tile j-2) rules that out
            # and costs nothing, since tile j's load cannot start before that release anyway.
            if j > 0:
                mbarrier.wait(st_empty.index(0), (j - 1) & 1)
        mbarrier.wait(st_ready.index(slot), (j // SLOTS) & 1)
        row0 = pid_m * BM
        col0 = pid_n * BN
        base = (row0.to(gl.int64) * N + col0).to(gl.uint32)  # hash input: linear offset mod 2**32
        accs = _split_n(acc, EPI_N)
        rm = gl.arange(0, BM, layout=gl.SliceLayout(1, SL))
        rn = gl.arange(0, SN, layout=gl.SliceLayout(0, SL))
        for i in gl.static_range(EPI_N):
            cols = i * SN + rn
            if BM > 64:
                # the same offsets (mod 2**32), formed per tile: with a 128-row accumulator, the hoisted
                # tile-invariant rm * N + cols of every slice spilled (900 B at 128x128, NOTES thirty-sixth session)
                hoff = (row0 + rm).to(gl.uint32)[:, None] * N.to(gl.uint32) + (col0 + cols).to(gl.uint32)[None, :]
            else:
                hoff = (rm[:, None] * N + cols[None, :]).to(gl.uint32) + base
            # in range: only for the non-finite count (outside, a zero X column times an infinite
            # dY entry gives NaN, which must not be counted)
            inb = ((row0 + rm) < M)[:, None] & ((col0 + cols) < N)[None, :]
            b = slot * EPI_N + i
            # int8 states (SN == 64): one scale per row of the slice, at block (col0 + i*SN) / 64
            srow = row0 + rm
            soff = srow.to(gl.int64) * NSB + (col0 + i * SN) // 64
            smask = (srow < M) & ((col0 + i * SN) // 64 < NSB)
            bad = _epilogue_slice(accs[i], hoff, inb, bad, w_bufs.index(b), s0_bufs.index(b), s1_bufs.index(b),
                            s2_bufs.index(b), c0, c1, c2, c3, c4, c5, c6, c7, grad_sign,
                            key_w, key_s0, key_s1, key_s2, sc0_ptr, sc1_ptr, sc2_ptr, soff, smask,
                            UPDATE, HAS_NF, W_BF16, W_SR, S0, S1, S2, S_SR, SL)
        fence_async_shared()
        for i in gl.static_range(EPI_N):
            b = slot * EPI_N + i
            coord = [row0, col0 + i * SN]
            tma.async_copy_shared_to_global(w_desc, coord, w_bufs.index(b))
            if S0 != 0:
                tma.async_copy_shared_to_global(s0_desc, coord, s0_bufs.index(b))
            if S1 != 0:
                tma.async_copy_shared_to_global(s1_desc, coord, s1_bufs.index(b))
            if S2 != 0:
                tma.async_copy_shared_to_global(s2_desc, coord, s2_bufs.index(b))
        tma.store_wait(0)  # the buffers have been read out: the state loader may refill them
        mbarrier.arrive(st_empty.index(slot), count=1)
        n_done += 1
    if HAS_NF:
        nbad = gl.sum(gl.sum(bad, axis=1), axis=0)
        if nbad > 0:
            gl.atomic_add(nf_ptr, nbad.to(gl.int64))


@gluon.jit
def _split_n(x, FACTOR: gl.constexpr):
    """Split [BM, BN] into FACTOR column slices [BM, BN/FACTOR] (slice i = columns [i*BN/FACTOR, ...))
    without moving data: in the wgmma accumulator layout a thread's columns are spread over its
    registers (as the Blackwell tutorial's _split_n does for TMEM)."""
    split_count: gl.constexpr = FACTOR.bit_length() - 1
    xs = (x, )
    for _ in gl.static_range(split_count):
        next_xs = ()
        for j in gl.static_range(len(xs)):
            x = xs[j]
            next_xs += x.reshape(x.shape[0], 2, x.shape[1] // 2).permute(0, 2, 1).split()
        xs = next_xs
    return xs


@gluon.jit
def _epilogue_slice(acc, hoff, inb, bad, w_buf, s0_buf, s1_buf, s2_buf,
                    c0, c1, c2, c3, c4, c5, c6, c7, grad_sign, key_w, key_s0, key_s1, key_s2,
                    sc0_ptr, sc1_ptr, sc2_ptr, soff, smask,
                    UPDATE: gl.constexpr, HAS_NF: gl.constexpr, W_BF16: gl.constexpr, W_SR: gl.constexpr,
                    S0: gl.constexpr, S1: gl.constexpr, S2: gl.constexpr, S_SR: gl.constexpr,
                    SL: gl.constexpr):
    """fused._epi_apply's MODE_UPDATE path (no gradient buffer) on one slice, in shared memory."""
    g = acc * grad_sign
    w_old = w_buf.load(SL).to(gl.float32)
    zero = gl.zeros_like(g)
    s0_old = _load_state(s0_buf, sc0_ptr, soff, smask, zero, S0, SL)
    s1_old = _load_state(s1_buf, sc1_ptr, soff, smask, zero, S1, SL)
    s2_old = _load_state(s2_buf, sc2_ptr, soff, smask, zero, S2, SL)
    w_new, s0_new, s1_new, s2_new = UPDATE(w_old, g, s0_old, s1_old, s2_old, c0, c1, c2, c3, c4, c5, c6, c7)
    finite = gl.abs(g) < float("inf")  # False for NaN and +-Inf
    w_new = gl.where(finite, w_new, w_old)
    if HAS_NF:
        bad += gl.where(inb & (finite == 0), 1, 0)
    if W_BF16:
        w_buf.store(fused._to_bf16(w_new, hoff, key_w, W_SR, False, 0))
    else:
        w_buf.store(w_new)
    _store_state(s0_buf, gl.where(finite, s0_new, s0_old), hoff, key_w, sc0_ptr, soff, smask, S0, S_SR, 1)  # fused._random16
    _store_state(s1_buf, gl.where(finite, s1_new, s1_old), hoff, key_w, sc1_ptr, soff, smask, S1, S_SR, 2)
    _store_state(s2_buf, gl.where(finite, s2_new, s2_old), hoff, key_s2, sc2_ptr, soff, smask, S2, S_SR, 0)
    return bad


@gluon.jit
def _load_state(buf, sc_ptr, soff, smask, zero, KIND: gl.constexpr, SL: gl.constexpr):
    """fp32 value of one state's slice: fp32/bf16 from shared memory, or int8/uint8 codes (shared memory)
    times their row's block scale (global memory; the slice is one 64-column block wide)."""
    if KIND == 0:
        return zero
    elif KIND == 1 or KIND == 2:
        return buf.load(SL).to(gl.float32)
    else:
        sc = gl.load(sc_ptr + soff, mask=smask, other=0.0).to(gl.float32)
        return fused._code_to_f32(buf.load(SL), KIND, False) * sc[:, None]


@gluon.jit
def _store_state(buf, value, hoff, key, sc_ptr, soff, smask, KIND: gl.constexpr, SR: gl.constexpr,
                 DRAW: gl.constexpr):
    if KIND == 1:
        buf.store(value)
    elif KIND == 2:
        buf.store(fused._to_bf16(value, hoff, key, SR, False, DRAW))
    elif KIND == 3 or KIND == 4:
        # fused._store_state's int8 path on a one-block-wide slice: the row's absmax is the block's (out of
        # range entries are 0, as there, so no where(mask))
        absmax = gl.max(gl.abs(value), axis=1)
        if KIND == 4:
            qmax = 255.0
        else:
            qmax = 127.0
        scale, inv = fused._block_scale(absmax, gl.full_like(absmax, qmax), gl.full_like(absmax, 1.0))
        qi = fused._round_to_code(value * inv[:, None], value, KIND, False)
        if KIND == 4:
            buf.store(qi.to(gl.uint8))
        else:
            buf.store(qi.to(gl.int8))
        gl.store(sc_ptr + soff, scale.to(gl.bfloat16), mask=smask)


@gluon.jit
def _consumer0(dy_desc, x_desc, w_desc, s0_desc, s1_desc, s2_desc, a_bufs, b_bufs, w_bufs, s0_bufs, s1_bufs, s2_bufs,
        ready, empty, order, st_ready, st_empty, nf_ptr, M, N, NPROG,
        c0, c1, c2, c3, c4, c5, c6, c7, grad_sign, key_w, key_s0, key_s1, key_s2, sc0_ptr, sc1_ptr, sc2_ptr, NSB,
        UPDATE: gl.constexpr, HAS_NF: gl.constexpr, W_BF16: gl.constexpr, W_SR: gl.constexpr,
        S0: gl.constexpr, S1: gl.constexpr, S2: gl.constexpr, S_SR: gl.constexpr,
        BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
        GROUP_SIZE: gl.constexpr, EPI_N: gl.constexpr, ST_BYTES: gl.constexpr, SLOTS: gl.constexpr):
    _consume(0, dy_desc, x_desc, w_desc, s0_desc, s1_desc, s2_desc, a_bufs, b_bufs, w_bufs, s0_bufs, s1_bufs, s2_bufs,
        ready, empty, order, st_ready, st_empty, nf_ptr, M, N, NPROG,
        c0, c1, c2, c3, c4, c5, c6, c7, grad_sign, key_w, key_s0, key_s1, key_s2, sc0_ptr, sc1_ptr, sc2_ptr, NSB,
        UPDATE, HAS_NF, W_BF16, W_SR, S0, S1, S2, S_SR, BM, BN, BK, STAGES, GROUP_SIZE, EPI_N, ST_BYTES, SLOTS)


@gluon.jit
def _consumer1(dy_desc, x_desc, w_desc, s0_desc, s1_desc, s2_desc, a_bufs, b_bufs, w_bufs, s0_bufs, s1_bufs, s2_bufs,
        ready, empty, order, st_ready, st_empty, nf_ptr, M, N, NPROG,
        c0, c1, c2, c3, c4, c5, c6, c7, grad_sign, key_w, key_s0, key_s1, key_s2, sc0_ptr, sc1_ptr, sc2_ptr, NSB,
        UPDATE: gl.constexpr, HAS_NF: gl.constexpr, W_BF16: gl.constexpr, W_SR: gl.constexpr,
        S0: gl.constexpr, S1: gl.constexpr, S2: gl.constexpr, S_SR: gl.constexpr,
        BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
        GROUP_SIZE: gl.constexpr, EPI_N: gl.constexpr, ST_BYTES: gl.constexpr, SLOTS: gl.constexpr):
    _consume(1, dy_desc, x_desc, w_desc, s0_desc, s1_desc, s2_desc, a_bufs, b_bufs, w_bufs, s0_bufs, s1_bufs, s2_bufs,
        ready, empty, order, st_ready, st_empty, nf_ptr, M, N, NPROG,
        c0, c1, c2, c3, c4, c5, c6, c7, grad_sign, key_w, key_s0, key_s1, key_s2, sc0_ptr, sc1_ptr, sc2_ptr, NSB,
        UPDATE, HAS_NF, W_BF16, W_SR, S0, S1, S2, S_SR, BM, BN, BK, STAGES, GROUP_SIZE, EPI_N, ST_BYTES, SLOTS)


@gluon.jit(do_not_specialize=["M", "NPROG", "key_w", "key_s0", "key_s1", "key_s2"])
def forge_pingpong_kernel(
        dy_desc, x_desc, w_desc, s0_desc, s1_desc, s2_desc, nf_ptr, M, N, NPROG,
        c0, c1, c2, c3, c4, c5, c6, c7, grad_sign, key_w, key_s0, key_s1, key_s2, sc0_ptr, sc1_ptr, sc2_ptr, NSB,
        UPDATE: gl.constexpr, HAS_NF: gl.constexpr, W_BF16: gl.constexpr, W_SR: gl.constexpr,
        S0: gl.constexpr, S1: gl.constexpr, S2: gl.constexpr, S_SR: gl.constexpr,
        BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
        GROUP_SIZE: gl.constexpr, EPI_N: gl.constexpr, ST_BYTES: gl.constexpr, SLOTS: gl.constexpr,
        CONSUMER_REGS: gl.constexpr):
    SN: gl.constexpr = BN // EPI_N
    a_bufs = gl.allocate_shared_memory(dy_desc.dtype, [STAGES, BK, BM], dy_desc.layout)
    b_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BK, BN], x_desc.layout)
    # SLOTS slots (tiles in flight) of EPI_N column slices of W and of each state
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [SLOTS * EPI_N, BM, SN], w_desc.layout)
    if S0 != 0:
        s0_bufs = gl.allocate_shared_memory(s0_desc.dtype, [SLOTS * EPI_N, BM, SN], s0_desc.layout)
    else:
        s0_bufs = w_bufs  # never touched
    if S1 != 0:
        s1_bufs = gl.allocate_shared_memory(s1_desc.dtype, [SLOTS * EPI_N, BM, SN], s1_desc.layout)
    else:
        s1_bufs = w_bufs
    if S2 != 0:
        s2_bufs = gl.allocate_shared_memory(s2_desc.dtype, [SLOTS * EPI_N, BM, SN], s2_desc.layout)
    else:
        s2_bufs = w_bufs
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    order = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    st_ready = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
    st_empty = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(order.index(i), count=1)
    for i in gl.static_range(SLOTS):
        mbarrier.init(st_ready.index(i), count=1)
        mbarrier.init(st_empty.index(i), count=1)
    fence_async_shared()
    # a JITFunction must be wrapped to travel in the partitions' argument tuples
    U: gl.constexpr = gl.constexpr(UPDATE)
    gl.warp_specialize([
        (_consumer0, (dy_desc, x_desc, w_desc, s0_desc, s1_desc, s2_desc, a_bufs, b_bufs, w_bufs, s0_bufs, s1_bufs, s2_bufs,
        ready, empty, order, st_ready, st_empty, nf_ptr, M, N, NPROG,
        c0, c1, c2, c3, c4, c5, c6, c7, grad_sign, key_w, key_s0, key_s1, key_s2, sc0_ptr, sc1_ptr, sc2_ptr, NSB,
        U, HAS_NF, W_BF16, W_SR, S0, S1, S2, S_SR, BM, BN, BK, STAGES, GROUP_SIZE, EPI_N, ST_BYTES, SLOTS)),
        (_consumer1, (dy_desc, x_desc, w_desc, s0_desc, s1_desc, s2_desc, a_bufs, b_bufs, w_bufs, s0_bufs, s1_bufs, s2_bufs,
        ready, empty, order, st_ready, st_empty, nf_ptr, M, N, NPROG,
        c0, c1, c2, c3, c4, c5, c6, c7, grad_sign, key_w, key_s0, key_s1, key_s2, sc0_ptr, sc1_ptr, sc2_ptr, NSB,
        U, HAS_NF, W_BF16, W_SR, S0, S1, S2, S_SR, BM, BN, BK, STAGES, GROUP_SIZE, EPI_N, ST_BYTES, SLOTS)),
        (_operand_loader, (dy_desc, x_desc, w_desc, s0_desc, s1_desc, s2_desc, a_bufs, b_bufs, w_bufs, s0_bufs, s1_bufs, s2_bufs,
        ready, empty, order, st_ready, st_empty, nf_ptr, M, N, NPROG,
        c0, c1, c2, c3, c4, c5, c6, c7, grad_sign, key_w, key_s0, key_s1, key_s2, sc0_ptr, sc1_ptr, sc2_ptr, NSB,
        U, HAS_NF, W_BF16, W_SR, S0, S1, S2, S_SR, BM, BN, BK, STAGES, GROUP_SIZE, EPI_N, ST_BYTES, SLOTS)),
        (_state_loader, (dy_desc, x_desc, w_desc, s0_desc, s1_desc, s2_desc, a_bufs, b_bufs, w_bufs, s0_bufs, s1_bufs, s2_bufs,
        ready, empty, order, st_ready, st_empty, nf_ptr, M, N, NPROG,
        c0, c1, c2, c3, c4, c5, c6, c7, grad_sign, key_w, key_s0, key_s1, key_s2, sc0_ptr, sc1_ptr, sc2_ptr, NSB,
        U, HAS_NF, W_BF16, W_SR, S0, S1, S2, S_SR, BM, BN, BK, STAGES, GROUP_SIZE, EPI_N, ST_BYTES, SLOTS)),
    ], [4, 1, 1], [CONSUMER_REGS, 24, 24])


# The four partitions repeat one long parameter list on purpose: Gluon requires every worker of a
# warp_specialize to have the same signature, and in Triton 3.6 an @aggregate of these fields cannot
# be built inside the kernel (a plain __init__ is rejected as an unsupported function).

# ---------------------------------------------------------------------------------------------
# Host side.

@dataclass(frozen=True)
class PingPongConfig:
    BM: int = 64  # rows of a consumer's tile (one wgmma covers 64 rows; 128: two per K step, 128 accumulator registers)
    BN: int = 64  # 64x128 tiles ran 2-2.5x slower per element on the H200 (NOTES.md)
    BK: int = 64
    stages: int = 6  # dY/X ring depth in shared memory
    group_size: int = 8
    epi_n: int = 2  # epilogue column slices (TMA boxes of W/states are [BM, BN/epi_n])
    consumer_regs: int = 232
    progs_per_sm: int = 1  # 2: two programs per SM (more warps to hide the epilogue's ALU latency)
    maxnreg: int = 0  # register cap per thread of the whole program (needed for 2 programs per SM)
    # tiles whose W and states are in shared memory at once. 2: one per consumer, so a consumer's next
    # tile is loaded only after its last one is stored; 3-4 start those loads a tile or two earlier;
    # 1: a tile's are loaded once the previous tile is stored (a bf16 128x128 tile's take 96 KB)
    state_slots: int = 2

    def short(self) -> str:
        return (f"pingpong {self.BM}x{self.BN}x{self.BK} s{self.stages} g{self.group_size} e{self.epi_n} "
                f"r{self.consumer_regs} p{self.progs_per_sm}{f' m{self.maxnreg}' if self.maxnreg else ''}"
                f"{f' t{self.state_slots}' if self.state_slots != 2 else ''}")

    def tile_bytes(self, w_bytes: int, state_bytes: int) -> int:
        """W and the states of one tile (state_bytes: bytes per element, summed over the states)."""
        return self.BM * self.BN * (w_bytes + state_bytes)

    def smem_bytes(self, w_bytes: int, state_bytes: int) -> int:
        """Shared memory: the dY/X ring plus ``state_slots`` slots of a tile's W and states."""
        return (self.stages * self.BK * (self.BM + self.BN) * 2 + self.state_slots * self.tile_bytes(w_bytes, state_bytes)
                + 1024)


DEFAULT_CONFIG = PingPongConfig()
# What a tuned table (kernels/tuned/*.json) may name, as {"kernel": "pingpong", **fields}: the schedules
# benchmarks/pp_sweep.py times. On an H100 (2026-12-07) the 64x128 ones ran 0.80-0.94x of the shipped
# Triton tile at BT=256-1024 on the 4096-wide and wider Llama-3.1-8B weights, and 1.9x slower on
# 1024x4096 (8 tiles per program: the pipeline never fills), so the tables name them per shape.
TABLE_KERNEL = "pingpong"
CANDIDATES = ([PingPongConfig(BN=64, epi_n=2, stages=6)]
              # (s6 at 64x128 does not fit with bf16 W and states: fit_config runs it as s5)
              + [PingPongConfig(BN=128, epi_n=e, stages=s) for s in (4, 5) for e in (2, 4, 8)]
              + [PingPongConfig(BN=128, epi_n=4, stages=5, group_size=16)]
              # three to five tiles' states in flight: 4-5% faster at BT=256 on the H100 (short mainloops),
              # slower at BT >= 512 (fewer dY/X stages; NOTES thirtieth session)
              + [PingPongConfig(BN=64, epi_n=2, stages=6, state_slots=4),
                 PingPongConfig(BN=64, epi_n=2, stages=5, state_slots=5),
                 PingPongConfig(BN=128, epi_n=4, stages=3, group_size=16, state_slots=3)])

# int8 states need one-scale-block-wide epilogue slices (BN // epi_n == 64); spills 24 B and 548 B at sm_90a.
# Bit-identical to the Triton kernel on an H100 (test_gpu_pingpong_int8_writes_the_triton_kernels_bits) but
# 1.24-1.27x slower than its int8 tile at BT=512 (NOTES thirtieth session), so no table or tuner names them.
INT8_CONFIGS = [PingPongConfig(BN=64, epi_n=1, stages=6), PingPongConfig(BN=128, epi_n=2, stages=5, group_size=16)]


def table_dict(cfg: PingPongConfig) -> dict:
    """``cfg`` as a tuned table stores it (``from_table`` reads it back)."""
    return {"kernel": TABLE_KERNEL, **asdict(cfg)}


def from_table(d: dict) -> PingPongConfig:
    fields = {k: v for k, v in d.items() if k != "kernel"}
    return PingPongConfig(**fields)
SMEM_LIMIT = 227 * 1024  # per SM; a program gets SMEM_LIMIT // progs_per_sm


def fit_config(cfg: PingPongConfig, w_bytes: int, state_bytes: int) -> PingPongConfig | None:
    """cfg with fewer ring stages (down to 2), then fewer state slots (down to 2), then half-width tiles,
    until shared memory fits."""
    while cfg.smem_bytes(w_bytes, state_bytes) > SMEM_LIMIT // cfg.progs_per_sm:
        if cfg.stages > 2:
            cfg = replace(cfg, stages=cfg.stages - 1)
        elif cfg.state_slots > 2:
            cfg = replace(cfg, state_slots=cfg.state_slots - 1)
        elif cfg.BN > 64:
            cfg = replace(cfg, BN=cfg.BN // 2, epi_n=max(1, cfg.epi_n // 2))
        else:
            return None
    return cfg


def supported(weight, dy, x, states, grad_buffer=None) -> str | None:
    """None if this kernel can run the update, else the reason it cannot (the Triton kernel then does)."""
    if weight.device.type != "cuda":
        return "not on CUDA"
    if _capability(weight.device)[0] != 9:
        return "needs Hopper (sm_90)"
    if dy.dtype != torch.bfloat16 or x.dtype != torch.bfloat16:
        return "dY and X must be bf16"
    if grad_buffer is not None:
        return "gradient buffer (accumulation) not supported"
    if weight.dtype not in (torch.bfloat16, torch.float32):
        return "weight must be bf16 or fp32"
    for v in states:
        if v is None:
            continue
        if v.quantized:
            if v.data.dtype not in (torch.int8, torch.uint8) or v.scale.dtype != torch.bfloat16:
                return "int8 states need int8/uint8 codes and bf16 scales"
            if v.scale.shape != (weight.shape[0], (weight.shape[1] + 63) // 64) or not v.scale.is_contiguous():
                return "int8 scales must be a contiguous [rows, ceil(cols / 64)] tensor"
        elif v.data.dtype not in (torch.bfloat16, torch.float32):
            return "states must be fp32, bf16 or int8"
    for t in (dy, x):
        if t.stride(-1) != 1 or (t.stride(0) * 2) % 16 or t.data_ptr() % 16:
            return "dY/X not TMA-compatible (16-byte aligned rows)"
    for t in [weight] + [v.data for v in states if v is not None]:
        if not t.is_contiguous() or (t.shape[1] * t.element_size()) % 16 or t.data_ptr() % 16:
            return "weight/states not TMA-compatible (contiguous, 16-byte aligned rows)"
    return None


def _constexprs(cfg: PingPongConfig, update, has_nf: bool, w_bf16: bool, w_sr: bool, kinds, s_sr: bool,
                w_bytes: int, state_bytes: int) -> dict:
    """The kernel's constexpr arguments for ``cfg``, in signature order (``launch``'s record appends
    their values to the runtime arguments)."""
    return dict(UPDATE=update, HAS_NF=has_nf, W_BF16=w_bf16, W_SR=w_sr, S0=kinds[0], S1=kinds[1], S2=kinds[2],
                S_SR=s_sr, BM=cfg.BM, BN=cfg.BN, BK=cfg.BK, STAGES=cfg.stages, GROUP_SIZE=cfg.group_size,
                EPI_N=cfg.epi_n, ST_BYTES=cfg.tile_bytes(w_bytes, state_bytes), SLOTS=cfg.state_slots,
                CONSUMER_REGS=cfg.consumer_regs)


# PingPongPlan re-launches through EncodedRelaunch (W's and the states' TMA descriptors encoded once per plan):
# 17.5 us of host per launch against relaunch's 43.3, same bits (H100, NOTES thirty-second session).
# FORGE_PP_ENCODED=0, read at import, falls back to ``relaunch``.
ENCODED_RELAUNCH = os.environ.get("FORGE_PP_ENCODED", "1") != "0"

# positions in ``launch``'s argument list
ARG_DY, ARG_X, ARG_COEFFS, ARG_GRAD_SIGN, ARG_KEYS = 0, 1, 10, 18, 19


def launch(*, weight, dy, x, rule_update, coeffs=(0.0,) * 8, states=(None, None, None), grad_sign=1.0,
           nonfinite=None, stochastic_weight=False, stochastic_state=False, key_weight=0, key_states=(0, 0, 0),
           config: PingPongConfig = DEFAULT_CONFIG):
    """One fused update of ``weight`` (and its fp32/bf16/int8 states) from G = dY^T X; see ``supported``.
    int8 states need epilogue slices one scale block wide (``BN // epi_n == 64``)."""
    M, N = weight.shape
    sdata = [v.data if v is not None else None for v in states]
    state_bytes = sum(t.element_size() for t in sdata if t is not None)
    cfg = fit_config(config, weight.element_size(), state_bytes)
    if cfg is None:
        raise ValueError("ping-pong kernel: W and states do not fit in shared memory")
    sn = cfg.BN // cfg.epi_n
    quantized = [v is not None and v.quantized for v in states]
    if any(quantized) and sn != 64:
        raise ValueError(f"ping-pong kernel: int8 states need epilogue slices of 64 columns (one scale block), "
                         f"got BN // epi_n = {cfg.BN} // {cfg.epi_n} = {sn}")
    tiles = -(-M // cfg.BM) * -(-N // cfg.BN)
    nprog = max(1, min(tiles, _sm_count(weight.device) * cfg.progs_per_sm))
    gdt = {torch.bfloat16: gl.bfloat16, torch.float32: gl.float32, torch.int8: gl.int8, torch.uint8: gl.uint8}
    scales = [v.scale if q else weight for v, q in zip(states, quantized)]

    def desc(t, block):
        return TensorDescriptor.from_tensor(t, block, gl.NVMMASharedLayout.get_default_for(block, gdt[t.dtype]))

    dy_desc = desc(dy, [cfg.BK, cfg.BM])
    x_desc = desc(x, [cfg.BK, cfg.BN])
    w_desc = desc(weight, [cfg.BM, sn])
    s_descs = [desc(t, [cfg.BM, sn]) if t is not None else w_desc for t in sdata]
    kinds = [fused.S_NONE if v is None else state_kind(v) for v in states]
    c = [float(v) for v in coeffs]
    args = [dy_desc, x_desc, w_desc, s_descs[0], s_descs[1], s_descs[2],
            nonfinite if nonfinite is not None else weight,
            M, N, nprog, c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7], float(grad_sign),
            _i32(key_weight), _i32(key_states[0]), _i32(key_states[1]), _i32(key_states[2]),
            scales[0], scales[1], scales[2], (N + 63) // 64]
    meta = _constexprs(cfg, rule_update, nonfinite is not None, weight.dtype == torch.bfloat16, bool(stochastic_weight),
                       kinds, bool(stochastic_state), weight.element_size(), state_bytes)
    compiled = forge_pingpong_kernel[(nprog,)](*args, **meta, num_warps=4,
                                               **({"maxnreg": cfg.maxnreg} if cfg.maxnreg else {}))
    # what ran, for a caller that re-launches it with new dY, X, coefficients and keys (``relaunch``):
    # the arguments in signature order, constexprs included, as Triton's launcher takes them. Not dY's
    # and X's descriptors: they hold the tensors, which must be freed after backward (a plan per layer
    # keeping them cost 1.5 GiB of peak on Llama-3.1-8B); their shared-memory layouts are enough.
    args[ARG_DY] = args[ARG_X] = None
    return compiled, nprog, args + list(meta.values()), (cfg.BK, cfg.BM, cfg.BN, dy_desc.layout, x_desc.layout)


def relaunch(record, dy, x, coeffs, grad_sign: float, key_weight: int, key_states, device: int) -> None:
    """Launch a kernel ``launch`` compiled again, with new dY, X (same widths, dtypes, and the same BT
    class as the caller checks), coefficients and keys. The W and state descriptors are reused."""
    compiled, nprog, args, (bk, bm, bn, dy_layout, x_layout) = record
    a = list(args)
    a[ARG_DY] = TensorDescriptor.from_tensor(dy, [bk, bm], dy_layout)
    a[ARG_X] = TensorDescriptor.from_tensor(x, [bk, bn], x_layout)
    a[ARG_COEFFS:ARG_GRAD_SIGN] = [float(c) for c in coeffs]
    a[ARG_GRAD_SIGN] = float(grad_sign)
    a[ARG_KEYS:ARG_KEYS + 4] = [_i32(key_weight)] + [_i32(k) for k in key_states]
    compiled.run(nprog, 1, 1, torch._C._cuda_getCurrentRawStream(device), compiled.function,
                 compiled.packed_metadata, None, None, None, *a)


class EncodedRelaunch:
    """``relaunch`` without Triton's per-launch descriptor work. Triton's launcher (``CudaLauncher`` ->
    ``wrap_handle_tensordesc``) expands every TensorDescriptor argument at every launch: a Python loop over
    the ~44 arguments and one ``fill_tma_descriptor`` (cuTensorMapEncodeTiled) per descriptor, six here,
    though W's and the states' are the same tensors at every step of a plan (the optimizer's fast path
    checks their addresses). This encodes those four once, and dY's and X's once per (address, shape,
    strides): a compiled step's allocator tends to hand a layer's dY and X the same addresses every step,
    and a descriptor is nothing but those numbers and the block's layout. Then it calls
    the launcher's C ``launch`` with the arguments Triton's wrapper would have built (tests/
    test_pingpong_kernel.py compares the two argument lists). ``make`` returns None where the launcher is
    not the one this was written against (triton 3.6's), or needs per-launch scratch memory: ``relaunch``
    then serves, as it does with FORGE_PP_ENCODED=0."""

    __slots__ = ("c_launch", "nprog", "function", "coop", "pdl", "packed", "rest", "dy_meta", "x_meta", "bk",
                 "bm", "bn", "dy_layout", "x_layout", "p_coeffs", "p_keys", "inputs")

    INPUTS_KEPT = 8  # (dY, X) descriptor pairs kept per plan

    @classmethod
    def make(cls, record) -> "EncodedRelaunch | None":
        from triton.backends.nvidia.driver import make_tensordesc_arg

        compiled, nprog, args, (bk, bm, bn, dy_layout, x_layout) = record
        run = compiled.run
        inner = getattr(run, "launch", None)
        try:
            cells = dict(zip(inner.__code__.co_freevars, (c.cell_contents for c in inner.__closure__)))
            c_launch, tmeta, tidx = cells["launcher"], cells["tensordesc_meta"], cells["tensordesc_indices"]
        except (AttributeError, KeyError, TypeError, ValueError):
            return None
        if (getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1)
                or getattr(run, "num_ctas", 1) != 1 or sorted(tidx)[:2] != [ARG_DY, ARG_X]):
            return None
        self = cls()
        metas = dict(zip(sorted(tidx), tmeta))
        rest, where = [], {}
        for i, a in enumerate(args):
            if i in (ARG_DY, ARG_X):
                continue
            where[i] = len(rest)
            rest.extend(make_tensordesc_arg(a, metas[i]) if i in metas else [a])
        if where[ARG_GRAD_SIGN] != where[ARG_COEFFS] + 8 or where[ARG_KEYS] != where[ARG_GRAD_SIGN] + 1:
            return None
        self.c_launch, self.nprog, self.function, self.packed = c_launch, nprog, compiled.function, compiled.packed_metadata
        self.coop, self.pdl = run.launch_cooperative_grid, run.launch_pdl
        self.rest, self.dy_meta, self.x_meta = rest, metas[ARG_DY], metas[ARG_X]
        self.bk, self.bm, self.bn, self.dy_layout, self.x_layout = bk, bm, bn, dy_layout, x_layout
        self.p_coeffs, self.p_keys = where[ARG_COEFFS], where[ARG_KEYS]
        self.inputs = {}  # (dY's and X's address, shape, strides) -> their expanded descriptor arguments
        return self

    def __call__(self, dy, x, coeffs, grad_sign: float, key_weight: int, key_states, device: int) -> None:
        # (the imports a launch needs are the module's: an import statement per call cost ~1.6 us of the ~10)
        key = (dy.data_ptr(), *dy.shape, *dy.stride(), x.data_ptr(), *x.shape, *x.stride())
        inputs = self.inputs.get(key)
        if inputs is None:
            from triton.backends.nvidia.driver import make_tensordesc_arg

            if len(self.inputs) >= self.INPUTS_KEPT:
                self.inputs.clear()
            inputs = self.inputs[key] = (
                *make_tensordesc_arg(TensorDescriptor.from_tensor(dy, [self.bk, self.bm], self.dy_layout), self.dy_meta),
                *make_tensordesc_arg(TensorDescriptor.from_tensor(x, [self.bk, self.bn], self.x_layout), self.x_meta))
        rest = list(self.rest)
        p = self.p_coeffs
        rest[p:p + 9] = [float(c) for c in coeffs] + [float(grad_sign)]
        rest[self.p_keys:self.p_keys + 4] = [_i32(key_weight)] + [_i32(k) for k in key_states]
        self.c_launch(self.nprog, 1, 1, torch._C._cuda_getCurrentRawStream(device), self.function, self.coop,
                      self.pdl, None, None, self.packed, None, None, None, *inputs, *rest)


def compile_offline(cfg: PingPongConfig = DEFAULT_CONFIG, w_dtype=torch.bfloat16, state_dtype=torch.bfloat16,
                    rule: str = "AdamW", nonfinite: bool = True):
    """Compile the kernel for sm_90a without a GPU (Triton's bundled toolchain): the CompiledKernel,
    whose ``asm["ptx"]`` feeds ``ptxas -v`` (registers, spills) in tests and reports."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from ..rules import RULES

    fn = forge_pingpong_kernel
    names = fn.arg_names
    wb = torch.tensor([], dtype=w_dtype).element_size()
    sb = torch.tensor([], dtype=state_dtype).element_size()
    rl = RULES[rule]
    n_states = len(rl.state_specs(dict(rl.defaults)))
    cfg = fit_config(cfg, wb, n_states * sb)
    if cfg is None:
        raise ValueError("does not fit in shared memory")
    sn = cfg.BN // cfg.epi_n
    gdt = {torch.bfloat16: gl.bfloat16, torch.float32: gl.float32, torch.int8: gl.int8, torch.uint8: gl.uint8}
    tname = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.int8: "i8", torch.uint8: "u8"}

    def td(dt, block):
        return f"tensordesc<{tname[dt]}[{block[0]}, {block[1]}],{gl.NVMMASharedLayout.get_default_for(block, gdt[dt])!r}>"

    if state_dtype == torch.int8:  # AdamW's int8 mode: m signed, v unsigned (precision.quantize)
        kinds = [fused.S_INT8, fused.S_UINT8, 0][:n_states] + [0] * (3 - n_states)
    else:
        kind = fused.S_BF16 if state_dtype == torch.bfloat16 else fused.S_FP32
        kinds = [kind if i < n_states else 0 for i in range(3)]
    sdt = {fused.S_INT8: torch.int8, fused.S_UINT8: torch.uint8, fused.S_BF16: torch.bfloat16,
           fused.S_FP32: torch.float32}
    consts = _constexprs(cfg, rl.triton_update, nonfinite, w_dtype == torch.bfloat16, True, kinds, True, wb,
                         n_states * sb)
    sig = {}
    for n in names:
        if n in consts:
            sig[n] = "constexpr"
        elif n == "dy_desc":
            sig[n] = td(torch.bfloat16, [cfg.BK, cfg.BM])
        elif n == "x_desc":
            sig[n] = td(torch.bfloat16, [cfg.BK, cfg.BN])
        elif n == "w_desc":
            sig[n] = td(w_dtype, [cfg.BM, sn])
        elif n in ("s0_desc", "s1_desc", "s2_desc"):
            sig[n] = td(sdt[kinds[int(n[1])]] if kinds[int(n[1])] else w_dtype, [cfg.BM, sn])
        elif n == "nf_ptr":
            sig[n] = "*i64"
        elif n in ("sc0_ptr", "sc1_ptr", "sc2_ptr"):
            sig[n] = "*bf16"
        elif n in ("M", "N", "NPROG", "key_w", "key_s0", "key_s1", "key_s2", "NSB"):
            sig[n] = "i32"
        else:
            sig[n] = "fp32"
    attrs = {(names.index("N"),): [["tt.divisibility", 16]], (names.index("nf_ptr"),): [["tt.divisibility", 16]]}
    src = GluonASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()},
                         attrs=attrs)
    opts = dict(num_warps=4)
    if cfg.maxnreg:
        opts["maxnreg"] = cfg.maxnreg
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
