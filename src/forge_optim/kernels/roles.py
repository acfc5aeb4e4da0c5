"""A role-split schedule of the fused kernel: GEMM programs and update programs side by side.

The fused kernel (``fused.forge_fused_kernel``) runs each tile's wgrad mainloop and then its epilogue in
the same program, so per program the tensor cores and the state traffic take turns: measured, the kernel
costs about GEMM time plus state traffic at ~65% of copy bandwidth (benchmarks/NOTES.md). Here one grid
holds two kinds of programs that run at the same time on the same SMs:

- ``NUM_PROD`` producers walk the tiles (GROUP_SIZE swizzle) and compute ``G = dY[:, rows]^T X[:, cols]``
  with the fused kernel's mainloop, count its non-finite entries, and store the fp32 tile into a ring of
  ``RING`` tile slots small enough to stay in L2;
- ``NUM_CONS`` consumers take the tiles in the same order, wait for their slot, and run the fused
  kernel's epilogue (``fused._epi_load`` / ``fused._epi_apply``: the same rule code and rounding) with
  the gradient read from the slot; then they free the slot.

A slot's two flags (ready, free) hold ``EPOCH + tile + 1`` (EPOCH: the launch's number << 32, so values of
an earlier launch never match and no flag is reset between launches). The producer writes the slot,
passes a CTA barrier and publishes ``ready`` with a release; the consumer's acquire of ``ready`` orders
its reads of the slot (which bypass L1: ``.cg``) after them; its release of ``free`` after its last read
lets the next producer of that slot overwrite it. The gradient is the same fp32 tile as the fused
kernel's accumulator (same tiles, same K order), so W and the states get the fused kernel's bits.

Waiting programs spin, so every program of the grid must be resident at once (the host checks the
compiled kernel's registers and shared memory against the SMs before launching): then each producer's
wait ends when the consumer of the tile ``RING`` behind finishes, which needs only earlier tiles, and no
wait is circular. Under ``TRITON_INTERPRET=1`` programs run one after another in program order, so the
host makes the ring as large as the tile count: producers (the lower program ids) never wait.
"""
from __future__ import annotations

from .._triton import jit, tl
from . import fused


@jit
def _spin_until(flag_ptr, want):
    """Wait until the int64 flag reaches ``want`` (acquire: the writer's stores before its release are
    visible after this). One thread of the program performs each scalar atomic."""
    seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="gpu")
    while seen < want:
        seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="gpu")


@jit
def _publish(flag_ptr, value):
    """Every thread's stores (or loads) of the slot before this are done, then the flag is set (release)."""
    tl.debug_barrier()
    tl.atomic_xchg(flag_ptr, value, sem="release", scope="gpu")


@jit
def _slot_slice(slot_ptr, r0, BN: tl.constexpr, Q: tl.constexpr):
    """Rows [r0, r0 + Q) of a [BM, BN] fp32 slot, read from L2 (``.cg``: an L1 line of the slot's
    previous use must not be served)."""
    rel = (r0 + tl.arange(0, Q))[:, None] * BN + tl.arange(0, BN)[None, :]
    return tl.load(slot_ptr + rel, cache_modifier=".cg")


@jit(do_not_specialize=["BT", "M", "NSB", "NUM_PROD", "NUM_CONS", "RING", "EPOCH",
                        "key_w", "key_s0", "key_s1", "key_s2"])
def forge_roles_kernel(
        dy_ptr, x_ptr, w_ptr, s0_ptr, s1_ptr, s2_ptr, sc0_ptr, sc1_ptr, sc2_ptr, buf_ptr, nf_ptr,
        ring_ptr, flag_ptr,
        BT, M, N, NSB, NUM_PROD, NUM_CONS, RING, EPOCH,
        c0, c1, c2, c3, c4, c5, c6, c7, grad_sign, key_w, key_s0, key_s1, key_s2,
        UPDATE: tl.constexpr, HAS_BUF: tl.constexpr, HAS_NF: tl.constexpr,
        W_BF16: tl.constexpr, W_SR: tl.constexpr,
        S0: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr, S_SR: tl.constexpr,
        DOT_PREC: tl.constexpr, INTERPRET: tl.constexpr, USE_TMA: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_SIZE: tl.constexpr,
        EPI_SPLIT: tl.constexpr, EPI_LOOKAHEAD: tl.constexpr):
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    num_tiles = num_pid_m * num_pid_n
    ready_ptr = flag_ptr
    free_ptr = flag_ptr + RING
    if pid < NUM_PROD:
        k_tiles = tl.cdiv(BT, BK)
        dy_src, x_src = fused._wgrad_sources(dy_ptr, x_ptr, BT, M, N, USE_TMA, BM, BN, BK)
        for tile_id in tl.range(pid, num_tiles, NUM_PROD, num_stages=1):  # (no loads hoisted over a wait)
            pid_m, pid_n = fused._tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_SIZE)
            acc = fused._wgrad_tile(dy_src, x_src, pid_m, pid_n, BT, M, N, k_tiles, USE_TMA, INTERPRET, DOT_PREC,
                                    BM, BN, BK)
            if HAS_NF and not HAS_BUF:  # as the fused kernel: from the whole tile, here off the update's path
                fused._count_nonfinite_tile(acc, pid_m * BM, pid_n * BN, M, N, nf_ptr, BM, BN)
            slot = tile_id % RING
            if tile_id >= RING:  # the slot's previous tile must have been read by its consumer
                _spin_until(free_ptr + slot, EPOCH + (tile_id - RING) + 1)
            slot_ptr = ring_ptr + slot.to(tl.int64) * (BM * BN)
            tl.store(slot_ptr + tl.arange(0, BM)[:, None] * BN + tl.arange(0, BN)[None, :], acc)
            _publish(ready_ptr + slot, EPOCH + tile_id + 1)
    else:
        P = (w_ptr, s0_ptr, s1_ptr, s2_ptr, sc0_ptr, sc1_ptr, sc2_ptr, buf_ptr, nf_ptr)
        C = (c0, c1, c2, c3, c4, c5, c6, c7, grad_sign)
        K = (key_w, key_s0, key_s1, key_s2)
        COUNT_NF: tl.constexpr = HAS_NF and HAS_BUF
        Q: tl.constexpr = BM // EPI_SPLIT
        for tile_id in tl.range(pid - NUM_PROD, num_tiles, NUM_CONS, num_stages=1):
            pid_m, pid_n = fused._tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_SIZE)
            row0 = pid_m * BM
            col0 = pid_n * BN
            slot = tile_id % RING
            _spin_until(ready_ptr + slot, EPOCH + tile_id + 1)
            slot_ptr = ring_ptr + slot.to(tl.int64) * (BM * BN)
            # the epilogue on EPI_SPLIT row slices; with EPI_LOOKAHEAD the next slice's loads are issued
            # before this slice's stores (as fused._epilogue_tile)
            L = fused._epi_load(row0, col0, P, M, N, NSB, 0, HAS_BUF, S0, S1, S2, Q, BN)
            G = _slot_slice(slot_ptr, 0, BN, Q)
            for s in tl.static_range(EPI_SPLIT):
                if EPI_LOOKAHEAD and s + 1 < EPI_SPLIT:
                    L_next = fused._epi_load(row0 + (s + 1) * Q, col0, P, M, N, NSB, 0, HAS_BUF, S0, S1, S2, Q, BN)
                    G_next = _slot_slice(slot_ptr, (s + 1) * Q, BN, Q)
                fused._epi_apply(G, row0 + s * Q, col0, L, P, M, N, NSB, C, K,
                                 UPDATE, 0, HAS_BUF, COUNT_NF, W_BF16, W_SR, S0, S1, S2, S_SR, INTERPRET, Q, BN)
                if s + 1 < EPI_SPLIT:
                    if not EPI_LOOKAHEAD:
                        L_next = fused._epi_load(row0 + (s + 1) * Q, col0, P, M, N, NSB, 0, HAS_BUF, S0, S1, S2,
                                                 Q, BN)
                        G_next = _slot_slice(slot_ptr, (s + 1) * Q, BN, Q)
                    L = L_next
                    G = G_next
            _publish(free_ptr + slot, EPOCH + tile_id + 1)


# ---------------------------------------------------------------------------------------------
# Host side (as launch.launch for the fused kernel).
import torch  # noqa: E402
from dataclasses import dataclass  # noqa: E402

from . import launch as _launch  # noqa: E402


@dataclass(frozen=True)
class RolesConfig:
    BM: int = 128
    BN: int = 128  # multiple of 64 (int8 scale blocks)
    BK: int = 64
    num_warps: int = 8
    num_stages: int = 3
    group_size: int = 8
    producers_per_sm: int = 1
    consumers_per_sm: int = 1
    ring_per_producer: int = 2  # slots = max(producers, consumers) x this (each slot BM x BN fp32)
    epi_split: int = 8  # 128x128 at 8 warps: 128 registers, no spills (1 producer + 1 consumer per SM)
    epi_lookahead: int = 1
    maxnreg: int = 128

    def short(self) -> str:
        return (f"roles {self.BM}x{self.BN}x{self.BK} w{self.num_warps} s{self.num_stages} g{self.group_size} "
                f"P{self.producers_per_sm}C{self.consumers_per_sm} ring{self.ring_per_producer} e{self.epi_split}"
                f"{f' la{self.epi_lookahead}' if self.epi_lookahead else ''}{f' r{self.maxnreg}' if self.maxnreg else ''}")


# per (device, stream): [ring, flags, launches so far]; launches on one stream run in order
_RINGS: dict[tuple, list] = {}
_RESIDENT: dict[tuple, int] = {}  # compiled specialization -> programs per SM


def _ring(device: torch.device, slots: int, tile: int) -> list:
    key = (device.index if device.type == "cuda" else -1, torch.cuda.current_stream(device).cuda_stream
           if device.type == "cuda" else 0)
    r = _RINGS.get(key)
    if r is None or r[0].numel() < slots * tile or r[1].numel() < 2 * slots:
        # new flags start at 0, below every EPOCH + tile + 1
        r = _RINGS[key] = [torch.empty(slots * tile, dtype=torch.float32, device=device),
                           torch.zeros(2 * slots, dtype=torch.int64, device=device), 0]
    r[2] += 1
    return r


def resident_per_sm(compiled, device: torch.device) -> int:
    """How many programs of ``compiled`` one SM holds at once (registers, shared memory, threads)."""
    compiled._init_handles()  # loads the module: n_regs is known from then on
    props = torch.cuda.get_device_properties(device)
    warps = compiled.metadata.num_warps
    regs_per_warp = -(-compiled.n_regs * 32 // 256) * 256
    by_regs = 4 * (getattr(props, "regs_per_multiprocessor", 65536) // 4 // regs_per_warp) // warps
    smem_sm = getattr(props, "shared_memory_per_multiprocessor", 233472)
    by_smem = smem_sm // (compiled.metadata.shared + 1024)
    by_threads = getattr(props, "max_threads_per_multi_processor", 2048) // (32 * warps)
    return max(0, min(by_regs, by_smem, by_threads, 32))


def launch_roles(*, weight, dy, x, rule_update, coeffs=(0.0,) * 8, states=(None, None, None), grad_sign=1.0,
                 grad_buffer=None, nonfinite=None, stochastic_weight=False, stochastic_state=False, key_weight=0,
                 key_states=(0, 0, 0), config: RolesConfig):
    """One update of ``weight`` and its states from dY^T X by the role-split schedule (update mode only)."""
    interp = _launch._INTERPRET
    M, N = weight.shape
    BT = dy.shape[0]
    cfg = config
    nsb = (N + 63) // 64
    dummy = weight
    ptrs, scales, kinds = _launch.state_args(states, dummy)
    tiles = -(-M // cfg.BM) * -(-N // cfg.BN)
    if interp:
        n_prod, n_cons, ring_slots, use_tma = min(tiles, 2), min(tiles, 2), tiles, False
    else:
        sms = _launch._sm_count(weight.device)
        n_prod = max(1, min(tiles, sms * cfg.producers_per_sm))
        n_cons = max(1, min(tiles, sms * cfg.consumers_per_sm))
        # every consumer needs slots of its own beyond the one it is reading, or it waits for a producer's
        # store after each tile (2026-12-06 H100, first run: a ring of one slot per consumer)
        ring_slots = max(1, min(tiles, max(n_prod, n_cons) * cfg.ring_per_producer))
        use_tma = BT > 0 and _launch._tma_ok(dy, x)
        if use_tma:
            _launch._ensure_allocator()
    ring, flags, epoch = _ring(weight.device, ring_slots, cfg.BM * cfg.BN)
    dot_prec = "ieee" if (dy.dtype == torch.float32 or x.dtype == torch.float32) else "tf32"
    args = (dy, x, weight, ptrs[0], ptrs[1], ptrs[2], scales[0], scales[1], scales[2],
            grad_buffer if grad_buffer is not None else dummy, nonfinite if nonfinite is not None else dummy,
            ring, flags,
            BT, M, N, nsb, n_prod, n_cons, ring_slots, epoch << 32,
            *[float(c) for c in coeffs[:8]], float(grad_sign),
            _launch._i32(key_weight), _launch._i32(key_states[0]), _launch._i32(key_states[1]),
            _launch._i32(key_states[2]))
    meta = (rule_update, grad_buffer is not None, nonfinite is not None, weight.dtype == torch.bfloat16,
            bool(stochastic_weight), kinds[0], kinds[1], kinds[2], bool(stochastic_state), dot_prec, interp,
            use_tma, cfg.BM, cfg.BN, cfg.BK, cfg.group_size, cfg.epi_split, cfg.epi_lookahead)
    options = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if cfg.maxnreg and not interp:
        options["maxnreg"] = cfg.maxnreg
    grid = n_prod + n_cons
    if interp:
        forge_roles_kernel[(grid,)](*args, *meta, **options)
        return None
    # every program must be resident at once (they wait on one another): check before the first launch
    key = (weight.device.index, meta, tuple(options.items()), tuple(str(a.dtype) for a in args[:13]),
           tuple(a.data_ptr() % 16 == 0 for a in args[:13]))
    per_sm = _RESIDENT.get(key)
    if per_sm is None:
        compiled = forge_roles_kernel.warmup(*args, *meta, grid=(grid,), **options)
        per_sm = _RESIDENT[key] = resident_per_sm(compiled, weight.device)
    if grid > per_sm * _launch._sm_count(weight.device):
        raise RuntimeError(f"role-split schedule {cfg.short()}: {grid} programs but only {per_sm} per SM fit "
                           f"({_launch._sm_count(weight.device)} SMs); fewer programs per SM or a register cap")
    return _launch.direct_launch(forge_roles_kernel, grid, args, meta, options, n_ptrs=13, n_ints=8)
