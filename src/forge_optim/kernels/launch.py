"""Host side of the fused kernel: argument packing, the pruned config lists, and a copy-safe tuner.

The kernel updates W and the states in place, so Triton's stock autotuner (which re-runs the
kernel on the live tensors) would apply the update once per trial. ``Tuner`` instead times each
candidate config on *clones* of the weight, the states, the gradient buffer and the counter, then
launches the winner once on the real tensors. Winners are cached per (shape, BT regime, dtypes,
rule, state layout) and can be read back (``Tuner.winners``) for benchmark reports.
"""
from __future__ import annotations

import os
import threading
from dataclasses import asdict, dataclass, replace

import torch

from .._triton import interpreting, triton
from . import fused

# Triton keeps its allocator in a ContextVar, i.e. per thread: backward runs on autograd's device
# threads, so the allocator for TMA descriptors is set once in every thread that launches.
_ALLOCATOR_SET = threading.local()
_SCRATCH: dict[tuple, torch.Tensor] = {}
# TRITON_INTERPRET is read once, like triton.jit itself does when the kernels are decorated.
_INTERPRET = interpreting()


@dataclass(frozen=True)
class KernelConfig:
    BM: int = 128
    BN: int = 128  # multiple of 64 (int8 scale blocks must not straddle tiles)
    BK: int = 64
    num_warps: int = 8
    num_stages: int = 3
    group_size: int = 8
    progs_per_sm: int = 1  # persistent grid = min(tiles, SMs * progs_per_sm)
    epi_split: int = 1  # 1, 2 or 4: run the epilogue on row slices [BM/epi_split, BN] (fewer live registers)
    use_tma: bool = True  # only taken where Hopper TMA is available and the strides allow it
    flatten: bool = False  # one flattened tile x K loop: the next tile's loads overlap this epilogue
    maxnreg: int = 0  # >0: register cap per thread (more resident programs per SM, maybe spills)
    prefetch: bool = False  # L2-prefetch each tile's W/states before its mainloop (GPU only)
    # epilogue slices: 0 loads each slice after the previous one's stores; 1 issues the next slice's
    # loads before the current slice's stores; 2 issues every slice's loads first (fused._epilogue_tile)
    epi_lookahead: int = 0
    # >0: the split schedule instead of the fused one (large BT, where the GEMM dominates): cuBLAS writes
    # the fp32 weight gradient of a chunk of rows (about this many MiB, small enough to stay in L2) and a
    # BT=0 launch of this config's tile applies the update from it; the gradient never exists beyond
    # one chunk. Same random bits as the fused kernel (hash keys shifted by each chunk's offset).
    split_mb: int = 0
    # L2 evict-first policy on the epilogue's W and state loads and stores (GPU only; changes no bit): the
    # state streams through L2 once per step while dY/X tiles are re-read from it. H100, bf16 state, same
    # run: -1 to -5% on 64x64/64x128/128x256 tiles of the 14336-wide shapes, +-1% at 4096x4096 (NOTES.md,
    # twenty-third session). Ranked on the whole weight on 2026-12-07 (H100, BT=512): the twins that won are
    # default candidates, the others exploratory (SMALL_BT_CONFIGS, EXPLORE_SMALL_BT_CONFIGS).
    evict_first: bool = False
    # fused._load_fence after each epilogue slice's loads (changes no bit): -1 takes the default, on for tiles
    # of at least 128x256 only (H100, int8 state, same run: -4.6 to -6.2% there, +1 to +3% on the grouped
    # 4-warp tiles; NOTES.md, twenty-fifth session); 0 / 1 force it off / on (the exploratory twins).
    # Normalized to -1 where it equals the default, so a twin that changes nothing is the same config.
    load_fence: int = -1

    def __post_init__(self):
        if self.BN % 64 != 0:
            raise ValueError(f"BN={self.BN} must be a multiple of 64 (int8 scale blocks)")
        if self.epi_split not in (1, 2, 4, 8) or self.BM % (self.epi_split * 8) != 0:
            raise ValueError(f"epi_split={self.epi_split} must be 1, 2, 4 or 8 and leave >= 8 rows per slice")
        if self.epi_lookahead not in (0, 1, 2):
            raise ValueError(f"epi_lookahead={self.epi_lookahead} must be 0, 1 or 2")
        if self.split_mb < 0:
            raise ValueError(f"split_mb={self.split_mb} must be >= 0 (0: the fused schedule)")
        if self.load_fence not in (-1, 0, 1):
            raise ValueError(f"load_fence={self.load_fence} must be -1 (the tile's default), 0 (off) or 1 (on)")
        if self.load_fence == int(self._fence_default()):
            object.__setattr__(self, "load_fence", -1)

    def _fence_default(self) -> bool:
        return self.BM * self.BN >= 128 * 256

    @property
    def fence(self) -> bool:
        """Whether the kernel fences each epilogue slice's loads (its ``EPI_FENCE`` constexpr)."""
        return self._fence_default() if self.load_fence == -1 else bool(self.load_fence)

    @property
    def eviction_policy(self) -> str:
        """The epilogue's W/state access policy as the kernel's ``EPI_EVICT`` constexpr (tl.load/tl.store's
        ``eviction_policy``; "" is Triton's default)."""
        return "evict_first" if self.evict_first else ""

    def env(self) -> str:
        """This config as a ``FORGE_TRITON_CONFIG`` value (every launch then uses it, no tuning)."""
        return ",".join(f"{k}={int(v)}" for k, v in asdict(self).items())

    def short(self) -> str:
        return (f"{self.BM}x{self.BN}x{self.BK} w{self.num_warps} s{self.num_stages} g{self.group_size} "
                f"p{self.progs_per_sm} e{self.epi_split}{' tma' if self.use_tma else ''}{' flat' if self.flatten else ''}{f' r{self.maxnreg}' if self.maxnreg else ''}{' pf' if self.prefetch else ''}{f' la{self.epi_lookahead}' if self.epi_lookahead else ''}"
                f"{f' split{self.split_mb}' if self.split_mb else ''}{' ev' if self.evict_first else ''}"
                f"{f' fc{self.load_fence}' if self.load_fence != -1 else ''}")


# Interpreter: tiny blocks so that the CPU tests stay fast; 3 programs exercise the persistent loop.
INTERPRET_CONFIG = KernelConfig(BM=32, BN=64, BK=16, num_warps=4, num_stages=1, group_size=2,
                                progs_per_sm=3, epi_split=1, use_tma=False)

# GPU candidates, pruned per BT regime. Small BT: the epilogue's memory traffic dominates, so
# more programs per SM (one tile's epilogue overlaps another's mainloop) and narrower tiles.
# Large BT: the GEMM dominates, so wide tiles and deep pipelines.
SMALL_BT_CONFIGS = (
    KernelConfig(128, 128, 64, 8, 3, 8, 1, 4),
    KernelConfig(64, 128, 64, 4, 4, 8, 2, 4),  # v1 winner at BT <= 1024
    KernelConfig(128, 128, 64, 8, 2, 8, 2, 8, maxnreg=128),  # 2 programs/SM, some spills
    KernelConfig(64, 128, 64, 4, 2, 8, 4, 8, maxnreg=128),  # 4 programs/SM, some spills
    KernelConfig(64, 128, 64, 4, 3, 8, 3, 8, maxnreg=168),  # 3 programs/SM (v2 winner)
    KernelConfig(128, 256, 64, 16, 3, 8, 1, 8),  # half the L2 re-reads of dY/X of a 64x128 tile
    KernelConfig(256, 128, 64, 16, 3, 8, 1, 8),
    # v4: the same schedules with the tile's W/states prefetched into L2 before the mainloop
    # (2026-12-03: with each slice's loads issued ahead of the previous slice's stores: -3 to -20%)
    KernelConfig(64, 128, 64, 4, 3, 8, 3, 8, maxnreg=168, prefetch=True, epi_lookahead=1),
    KernelConfig(64, 128, 64, 4, 4, 8, 2, 4, prefetch=True),
    KernelConfig(128, 256, 64, 16, 3, 8, 1, 8, prefetch=True),
    # promoted from the exploratory list (H100, results/bt512-explore-2026-12-05-h100): the 16-warp tiles above
    # with each slice's loads issued before the previous slice's stores (offline the same spills as
    # lookahead 0); they won 8 of 10 BT=512 whole-weight timings there: bf16 -0.5 to -1.1%, int8 -4.5 to -5.3%
    KernelConfig(128, 256, 64, 16, 3, 8, 1, 8, epi_lookahead=1),
    KernelConfig(256, 128, 64, 16, 3, 8, 1, 8, epi_lookahead=1),
    # promoted from the exploratory list (H100, results/retune-2026-12-07-h100, after the load fence): the L2
    # evict-first twins that won BT=512 whole-weight timings there, same bits: 128x256 la1 ev won 4 of 5 int8
    # shapes (-1 to -4% against the same tile without it) and the bf16 lm_head; 64x128 p3 ev the bf16
    # 14336x4096 (-2%)
    KernelConfig(128, 256, 64, 16, 3, 8, 1, 8, epi_lookahead=1, evict_first=True),
    KernelConfig(64, 128, 64, 4, 3, 8, 3, 8, maxnreg=168, evict_first=True),
    # (the last two stay last: tests and benchmarks name the 64x64 one as SMALL_BT_CONFIGS[-2])
    # promoted from the exploratory list (H200, results/kernel-2026-12-02-explore.json): small tiles,
    # 4 programs/SM; 64x64 won 1024x4096 and 4096x4096 at BT=512 (-14% against the best above)
    KernelConfig(64, 64, 64, 4, 3, 8, 4, 4, maxnreg=128, prefetch=True, epi_lookahead=1),
    KernelConfig(32, 128, 64, 4, 3, 8, 4, 4, maxnreg=128, prefetch=True, epi_lookahead=1),
)
LARGE_BT_CONFIGS = (
    KernelConfig(128, 128, 64, 8, 4, 8, 1, 4, epi_lookahead=1),  # v1 winner at BT >= 2048
    KernelConfig(128, 128, 64, 8, 4, 8, 1, 8),
    KernelConfig(128, 128, 64, 8, 5, 8, 1, 4),
    KernelConfig(128, 128, 64, 8, 4, 8, 1, 4, flatten=True),
    KernelConfig(128, 256, 64, 16, 4, 8, 1, 8, epi_lookahead=1),  # BT=8192 winner (-4 to -7% with lookahead)
    KernelConfig(128, 128, 128, 8, 3, 8, 1, 4),
)
# L2 prefetch of W/states at BT >= 2048: candidates at mid BT only. At BT=8192 they won 1 of 14 whole-weight
# timings, by 2% (H200, 2026-12-03: tune_shapes.py 0 of 10, 0.6-17% slower than the best; tuner_fidelity.py
# 1 of 4), but they can tie on the tuner's 4096-row sub-problem: one picked there ran the lm_head 1.24x slower.
LARGE_BT_PREFETCH_CONFIGS = (
    KernelConfig(128, 128, 64, 8, 4, 8, 1, 4, prefetch=True),
    KernelConfig(128, 256, 64, 16, 4, 8, 1, 8, prefetch=True),
)
# BT = 0: an unfused parameter stepped from its gradient (the fp32 gradient enters as the buffer).
# There is no mainloop, so only the epilogue's tile and the programs per SM matter.
ELEMENTWISE_CONFIGS = (
    KernelConfig(64, 128, 64, 4, 1, 8, 4, 2, use_tma=False),
    KernelConfig(128, 128, 64, 8, 1, 8, 2, 4, use_tma=False),
)
MID_BT_CONFIGS = (SMALL_BT_CONFIGS[4], SMALL_BT_CONFIGS[5], SMALL_BT_CONFIGS[7], SMALL_BT_CONFIGS[9])\
    + LARGE_BT_CONFIGS[:4] + LARGE_BT_PREFETCH_CONFIGS
# every config any BT regime may run (precompilation, codegen reports, GPU bit-identity tests)
ALL_TUNED_CONFIGS = tuple(dict.fromkeys(SMALL_BT_CONFIGS + MID_BT_CONFIGS + LARGE_BT_CONFIGS))


GPU_TEST_CONFIG = SMALL_BT_CONFIGS[0]


# Not tuned by default: smaller tiles and more resident programs for the latency-bound small layers
# (1024x4096 at BT=512 runs at ~0.4 TB/s with the default list). FORGE_TUNE_EXPLORE=1 adds them to the
# small-BT candidates, so one benchmark run shows whether any deserves a place in the list above.
EXPLORE_SMALL_BT_CONFIGS = (
    KernelConfig(32, 128, 64, 4, 3, 8, 4, 4, maxnreg=128),
    KernelConfig(64, 128, 128, 4, 2, 8, 2, 8, maxnreg=168, prefetch=True),  # 98 KB smem: 2 per SM
    KernelConfig(64, 256, 64, 8, 2, 8, 2, 8, maxnreg=128, prefetch=True),
    KernelConfig(128, 128, 64, 8, 2, 8, 2, 8, maxnreg=128, prefetch=True),
    # the 2-program 128x128 with lookahead 1 (offline: 40 B of spills): never won (H100, 2026-12-05)
    KernelConfig(128, 128, 64, 8, 2, 8, 2, 8, maxnreg=128, epi_lookahead=1),
    # evict-first twins of the other H100 BT=512 winners (twenty-third session's A/B: 64x64 p4 -5% at BT=64 on
    # the 14336-wide shapes); on the whole weight at BT=512 they won nothing (H100, 2026-12-07)
    KernelConfig(64, 128, 64, 4, 3, 8, 3, 8, maxnreg=168, prefetch=True, epi_lookahead=1, evict_first=True),
    KernelConfig(64, 64, 64, 4, 3, 8, 4, 4, maxnreg=128, prefetch=True, epi_lookahead=1, evict_first=True),
    # the load fence on the one tile whose slice loads stay split without it (offline SASS, int8;
    # results/sass-2026-12-07-slice-loads-gated.json): 0.94-1.00x of its unfenced twin on the H100 (int8,
    # BT=512, results/retune-2026-12-07-h100), but it won no entry
    KernelConfig(64, 128, 64, 4, 3, 8, 3, 8, maxnreg=168, prefetch=True, epi_lookahead=1, load_fence=1),
    # BK=128 twins of the 16-warp winners, 2 stages (192 KB of shared memory; offline 100 / 84 B of int8 spills
    # against 84): half the K loop's CTA barriers per tile, which hold 12-16% of the stall samples in the H100
    # profile of 128x256 la1 at BT=512; read by region, those barriers wait for the tensor cores (the K loop
    # runs at ~90% of their peak), so 0.99-1.01x is predicted; not yet timed (NOTES.md, twenty-eighth session)
    KernelConfig(128, 256, 128, 16, 2, 8, 1, 8, epi_lookahead=1, evict_first=True),
    KernelConfig(256, 128, 128, 16, 2, 8, 1, 8, epi_lookahead=1),
)


def candidate_configs(bt: int) -> tuple[KernelConfig, ...]:
    if bt == 0:
        return ELEMENTWISE_CONFIGS
    if bt <= 1024:
        if os.environ.get("FORGE_TUNE_EXPLORE") == "1":
            return SMALL_BT_CONFIGS + EXPLORE_SMALL_BT_CONFIGS
        return SMALL_BT_CONFIGS
    if bt <= 4096:
        return MID_BT_CONFIGS
    return LARGE_BT_CONFIGS


def bt_regime(bt: int) -> int:
    """Bucket BT so that a tuned winner is reused across nearby token counts (0 stays its own)."""
    if bt == 0:
        return 0
    b = 64
    while b < bt:
        b *= 2
    return b


def state_kind(view) -> int:
    if view.quantized:
        return fused.S_UINT8 if view.data.dtype == torch.uint8 else fused.S_INT8
    if view.data.dtype == torch.bfloat16:
        return fused.S_BF16
    return fused.S_FP32


def _scratch(size: int, alignment: int, stream) -> torch.Tensor:
    """The kernel writes its TMA descriptors here. One buffer per (device, stream), grown when
    needed: launches on one stream run in order, so reuse is safe, and it saves an allocator call
    (~15 us of host time) per launch."""
    key = (torch.cuda.current_device(), stream)
    buf = _SCRATCH.get(key)
    if buf is None or buf.numel() < size or buf.data_ptr() % alignment:
        buf = _SCRATCH[key] = torch.empty(max(size, 1 << 16), dtype=torch.int8, device="cuda")
    return buf


def _ensure_allocator():
    if not getattr(_ALLOCATOR_SET, "done", False):
        triton.set_allocator(_scratch)
        _ALLOCATOR_SET.done = True


_SM_COUNT: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


_CAPABILITY: dict[int, tuple[int, int]] = {}


def _capability(device: torch.device) -> tuple[int, int]:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _CAPABILITY:
        _CAPABILITY[idx] = torch.cuda.get_device_capability(idx)
    return _CAPABILITY[idx]


def _tma_ok(dy: torch.Tensor, x: torch.Tensor) -> bool:
    if _INTERPRET or dy.device.type != "cuda":
        return False
    if _capability(dy.device)[0] < 9:
        return False
    for t in (dy, x):
        es = t.element_size()
        if t.data_ptr() % 16 or (t.stride(0) * es) % 16:
            return False
    return True


def launch(*, weight, dy, x, rule_update=None, coeffs=(0.0,) * 8, states=(None, None, None),
           grad_sign=1.0, grad_buffer=None, nonfinite=None, stochastic_weight=False,
           stochastic_state=False, key_weight=0, key_states=(0, 0, 0), mode=fused.MODE_UPDATE,
           config: KernelConfig):
    """Launch the kernel once. ``states`` is a 3-tuple of StateView or None, indexed by slot.

    In accumulate mode ``weight`` is the fp32 buffer (the kernel adds the tile into it).
    """
    interp = _INTERPRET
    M, N = weight.shape
    BT = dy.shape[0]
    if config.split_mb and BT > 0 and mode == fused.MODE_UPDATE and grad_buffer is None:
        return split_launch(weight=weight, dy=dy, x=x, rule_update=rule_update, coeffs=coeffs, states=states,
                            grad_sign=grad_sign, nonfinite=nonfinite, stochastic_weight=stochastic_weight,
                            stochastic_state=stochastic_state, key_weight=key_weight, key_states=key_states,
                            config=config)
    nsb = (N + 63) // 64
    dummy = weight
    ptrs, scales, kinds = [], [], []
    for view in states:
        if view is None:
            ptrs.append(dummy)
            scales.append(dummy)
            kinds.append(fused.S_NONE)
        else:
            ptrs.append(view.data)
            scales.append(view.scale if view.quantized else dummy)
            kinds.append(state_kind(view))
    cfg = config
    if not interp and dy.element_size() == 4 and cfg.BK > 32:
        # fp32 operands: half the K depth keeps the pipelined stages inside shared memory
        cfg = replace(cfg, BK=32)
    tiles = -(-M // cfg.BM) * -(-N // cfg.BN)  # not triton.cdiv: a constexpr_function, ~20 us per call on the host
    if interp:
        nprogs = max(1, min(tiles, cfg.progs_per_sm))
        use_tma = False
    else:
        nprogs = max(1, min(tiles, _sm_count(weight.device) * cfg.progs_per_sm))
        use_tma = cfg.use_tma and BT > 0 and _tma_ok(dy, x)
        if use_tma:
            _ensure_allocator()
    accumulate = mode == fused.MODE_ACCUMULATE
    buf = weight if accumulate else grad_buffer
    w_bf16 = weight.dtype == torch.bfloat16
    dot_prec = "ieee" if (dy.dtype == torch.float32 or x.dtype == torch.float32) else "tf32"
    args = (dy, x, weight, ptrs[0], ptrs[1], ptrs[2], scales[0], scales[1], scales[2],
            buf if buf is not None else dummy, nonfinite if nonfinite is not None else dummy,
            BT, M, N, nsb, nprogs,
            float(coeffs[0]), float(coeffs[1]), float(coeffs[2]), float(coeffs[3]), float(coeffs[4]),
            float(coeffs[5]), float(coeffs[6]), float(coeffs[7]), float(grad_sign),
            _i32(key_weight), _i32(key_states[0]), _i32(key_states[1]), _i32(key_states[2]))
    # the constexprs, in the kernel's signature order (the direct launch below passes them positionally)
    meta = (rule_update if rule_update is not None else _noop_update(), mode,
            grad_buffer is not None and not accumulate, nonfinite is not None and not accumulate,
            w_bf16 and not accumulate, bool(stochastic_weight),
            0 if accumulate else kinds[0], 0 if accumulate else kinds[1], 0 if accumulate else kinds[2],
            bool(stochastic_state), dot_prec, interp, use_tma,
            cfg.BM, cfg.BN, cfg.BK, cfg.group_size, cfg.epi_split, cfg.flatten and not interp,
            cfg.prefetch and not interp, cfg.epi_lookahead, "" if interp else cfg.eviction_policy,
            cfg.fence and not interp)
    options = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if cfg.maxnreg and not interp:
        options["maxnreg"] = cfg.maxnreg
    if interp or not FAST_LAUNCH:
        fused.forge_fused_kernel[(nprogs,)](*args, *meta, **options)
        return None
    # what ran, for a caller that re-launches it with new dY, X, coefficients and keys (LaunchPlan)
    return direct_launch(fused.forge_fused_kernel, nprogs, args, meta, options), nprogs, args, meta


def split_rows(M: int, N: int, split_mb: int) -> int:
    """Rows per chunk of the split schedule: about ``split_mb`` MiB of fp32 gradient, a multiple of 64."""
    return max(64, min(M, ((split_mb << 20) // (4 * N)) // 64 * 64))


def _wgrad_fp32(dy_cols: torch.Tensor, x: torch.Tensor, out: torch.Tensor) -> None:
    """out = dY[:, rows]^T X, accumulated and written in fp32 (cuBLAS on CUDA; fp32 inputs follow
    torch.backends.cuda.matmul.allow_tf32, where the fused kernel always takes the ieee dot)."""
    if dy_cols.dtype == torch.float32 or not dy_cols.is_cuda:
        torch.mm(dy_cols.t().float(), x.float(), out=out)
    else:
        torch.mm(dy_cols.t(), x, out_dtype=torch.float32, out=out)


def split_launch(*, weight, dy, x, states, key_weight, key_states, config, **kw) -> None:
    """The split schedule (``KernelConfig.split_mb``): per chunk of rows, the fp32 gradient from cuBLAS
    into one scratch chunk, then a BT=0 launch that updates those rows from it. Returns None: there is
    no single compiled launch to replay."""
    M, N = weight.shape
    rows = split_rows(M, N, config.split_mb)
    tile = replace(config, split_mb=0)
    scratch = torch.empty((rows, N), dtype=torch.float32, device=weight.device)
    for r0 in range(0, M, rows):
        r1 = min(M, r0 + rows)
        g = scratch[: r1 - r0]
        _wgrad_fp32(dy[:, r0:r1], x, g)
        shift = r0 * N  # the hash reads (element offset + key) mod 2**32: the fused kernel's random bits
        launch(weight=weight[r0:r1], dy=dy[:0, r0:r1], x=x[:0],
               states=tuple(None if v is None else v.rows(r0, r1) for v in states), grad_buffer=g,
               key_weight=key_weight + shift, key_states=tuple(k + shift for k in key_states), config=tile, **kw)
    return None


# ---------------------------------------------------------------------------------------------
# Direct launch. Triton's JITFunction.run re-derives, on every call, the specialization of all 29
# runtime arguments (dtype and 16-byte alignment of each pointer, divisibility and range of each
# int) to find the compiled kernel: ~40 us of host time per launch on the H200's host, ~10 ms per
# step of an 8B model. Here the compiled kernel is cached under a key that holds *at least* what
# Triton specializes on (pointer dtype + alignment, for every int whether it is 1, divisible by 16
# and within int32, every constexpr, the launch options, the device), so a hit always has the same
# specialization as the call that compiled it; a miss goes through Triton's own path once.
# FORGE_FAST_LAUNCH=0 turns it off (A/B measurements, or a Triton whose launcher differs).
FAST_LAUNCH = os.environ.get("FORGE_FAST_LAUNCH", "1") != "0"
_DIRECT: dict[tuple, object] = {}
_I32_MIN, _I32_MAX = -(1 << 31), (1 << 31) - 1


def _spec_key(ptrs: tuple, ints: tuple, keys: tuple, meta: tuple, options: tuple, device: int) -> tuple:
    """What Triton may specialize a launch on, for the fused kernel's argument layout: each pointer's
    dtype and 16-byte alignment; for each size, whether it is 1, divisible by 16, within int32; for
    each hash key (do_not_specialize, int32 by construction) whether it is 1; every constexpr; the
    launch options and device. The float coefficients are always fp32 (passed through float())."""
    aligned = 0
    for t in ptrs:
        aligned = (aligned << 1) | (t.data_ptr() & 15 == 0)
    return (device, options, meta, tuple([t.dtype for t in ptrs]), aligned,
            tuple([(v == 1, v & 15 == 0, _I32_MIN <= v <= _I32_MAX) for v in ints]),
            tuple([k == 1 for k in keys]))


def _hooked(hook) -> bool:
    """Triton 3.6 keeps launch hooks in a HookChain that is never None: empty means no hook."""
    return hook is not None and bool(getattr(hook, "calls", True))


def direct_launch(kernel, grid0: int, args: tuple, meta: tuple, options: dict, n_ptrs: int = 11, n_ints: int = 5,
                  n_floats: int = 9):
    """Launch ``kernel`` on a 1-D grid, skipping Triton's per-call argument specialization when a
    kernel with the same specialization was compiled before (see the comment above). ``args`` is
    laid out as the fused kernel's: pointers, sizes, float coefficients, then int32 hash keys."""
    if hooks_active():
        return kernel[(grid0,)](*args, *meta, **options)  # profilers (proton) hook the launch: keep it
    device = torch.cuda.current_device()
    key = _spec_key(args[:n_ptrs], args[n_ptrs:n_ptrs + n_ints], args[n_ptrs + n_ints + n_floats:], meta,
                    tuple(options.items()), device)
    compiled = _DIRECT.get(key)
    if compiled is None:
        compiled = kernel[(grid0,)](*args, *meta, **options)
        if compiled is not None and not hasattr(compiled, "result"):  # not an async-compile future
            _DIRECT[key] = compiled
        return compiled
    relaunch(compiled, grid0, args, meta, device)
    return compiled


# Argument positions in the fused kernel's signature (see fused.forge_fused_kernel).
ARG_DY, ARG_X, ARG_BT, ARG_COEFFS, ARG_GRAD_SIGN, ARG_KEYS = 0, 1, 11, 16, 24, 25


def relaunch(compiled, nprogs: int, args, meta: tuple, device: int) -> None:
    """Launch an already compiled kernel with ``args`` (same specialization as when it was compiled:
    the caller guarantees it). No argument inspection at all."""
    # Triton's allocator is per thread (a ContextVar): a plan made in autograd's backward thread and run
    # from the main one (the update a step applies from a buffer; a benchmark) must set it here too.
    _ensure_allocator()
    compiled.run(nprogs, 1, 1, torch._C._cuda_getCurrentRawStream(device), compiled.function,
                 compiled.packed_metadata, None, None, None, *args, *meta)


# ---------------------------------------------------------------------------------------------
# Static launch. What a direct launch still pays on the host is Triton's launcher: a Python __call__
# (the TMA scratch through the allocator hook) and a generated C function that asks about every
# pointer argument (a data_ptr() call and a cuPointerGetAttribute driver query for each of the 11
# tensors). A prepared plan's weight, state and buffer pointers never change, so the plan can hand
# the kernel plain integers through torch's C++ launcher for Triton kernels
# (torch._C._StaticCudaLauncher, which inductor launches its own kernels with): one C call that
# copies the arguments into place and calls cuLaunchKernel. On by default since its GPU tests passed
# on an H100 (2026-12-05: the bits of Triton's launcher for fp32/bf16/int8 states and varying token
# counts); FORGE_STATIC_LAUNCH=0 turns it off. The layout is also checked offline, against the sm_90a
# PTX entry (test_kernel_codegen.py): a wrong layout would not raise, it would write wrong weights.
# Not used where the compiled kernel needs what that launcher does not do (clusters, programmatic
# dependent launch, cooperative grids, host-side TMA descriptors, profiler scratch), nor where torch
# has no such launcher (then Triton's launcher is used, as before).
STATIC_LAUNCH = os.environ.get("FORGE_STATIC_LAUNCH", "1") != "0"
# Triton's scalar types -> the launcher's type characters (pointers are "O": an int is taken as is)
_TYPE_CHARS = {"i1": "i", "i8": "b", "i16": "h", "i32": "i", "i64": "l", "u1": "I", "u8": "B", "u16": "H",
               "u32": "I", "u64": "K", "fp16": "f", "bf16": "f", "fp32": "f", "f32": "f", "fp64": "d"}
_N_SCALARS = 13  # 8 coefficients, the gradient sign, 4 hash keys: contiguous from ARG_COEFFS


def static_layout(compiled) -> tuple[tuple[int, ...], str] | None:
    """Which runtime arguments the compiled kernel takes (constexprs, including ints Triton specialized
    to 1, are baked in), and their type characters for torch's launcher, the two scratch pointers
    Triton 3.x appends included; None if that launcher cannot launch this kernel as Triton would."""
    md = compiled.metadata
    if (getattr(md, "num_ctas", 1) != 1 or getattr(md, "launch_pdl", False)
            or getattr(md, "launch_cooperative_grid", False) or getattr(md, "tensordesc_meta", None)
            or getattr(md, "profile_scratch_size", 0) or not hasattr(md, "global_scratch_size")
            or not hasattr(md, "profile_scratch_size")):  # (then the kernel's last two parameters are both scratch)
        return None
    src = compiled.src
    names = list(src.fn.arg_names)

    def index(k):
        return names.index(k) if isinstance(k, str) else (k[0] if isinstance(k, tuple) else k)

    sig = {index(k): v for k, v in src.signature.items()}
    consts = {index(k) for k in getattr(src, "constants", {})}
    keep, tys = [], []
    for i in sorted(sig):
        ty = sig[i]
        if ty == "constexpr" or i in consts:
            continue
        if ty.startswith("*"):
            tys.append("O")
        elif ty in _TYPE_CHARS:
            tys.append(_TYPE_CHARS[ty])
        else:  # a TMA descriptor argument, or a type this table does not know
            return None
        keep.append(i)
    return tuple(keep), "".join(tys) + "OO"  # + global scratch, profile scratch


class StaticLaunch:
    """One compiled fused kernel bound to its fixed pointers, launched by torch's C++ launcher;
    ``run`` fills in dY, X, the coefficients and keys (see the comment above)."""

    __slots__ = ("launcher", "function", "nprogs", "num_warps", "shared", "tys", "template", "i_dy", "i_x",
                 "i_bt", "i_scalars", "scratch_bytes", "scratch_align", "scratch")

    @classmethod
    def make(cls, compiled, nprogs: int, args) -> "StaticLaunch | None":
        launcher = getattr(torch._C, "_StaticCudaLauncher", None)
        function = getattr(compiled, "function", None)
        if launcher is None or not function:
            return None
        layout = static_layout(compiled)
        if layout is None:
            return None
        keep, tys = layout
        pos = {i: j for j, i in enumerate(keep)}
        scalars = range(ARG_COEFFS, ARG_COEFFS + _N_SCALARS)
        if ARG_DY not in pos or ARG_X not in pos or any(pos.get(i) != pos.get(ARG_COEFFS, -1) + k
                                                        for k, i in enumerate(scalars)):
            return None
        self = cls()
        self.launcher, self.function, self.nprogs = launcher, function, int(nprogs)
        md = compiled.metadata
        self.num_warps, self.shared, self.tys = int(md.num_warps), int(md.shared), tys
        template = []
        for j, i in enumerate(keep):
            v = args[i]
            if tys[j] == "O":
                v = 0 if v is None else v.data_ptr()  # dY and X (None in a plan's record): filled per launch
            template.append(v)
        self.template = template + [0, 0]
        self.i_dy, self.i_x, self.i_scalars = pos[ARG_DY], pos[ARG_X], pos[ARG_COEFFS]
        self.i_bt = pos.get(ARG_BT)  # None where Triton made BT a constant (BT == 1)
        self.scratch_bytes = int(md.global_scratch_size) * self.nprogs
        self.scratch_align = int(getattr(md, "global_scratch_align", 1) or 1)
        self.scratch = {}  # stream -> (buffer, its address): the reference keeps the buffer alive
        return self

    def run(self, dy: torch.Tensor, x: torch.Tensor, bt: int, scalars: list, device: int) -> None:
        """``bt``: dY's rows (the caller keeps it in the specialization class this kernel was compiled
        for); ``scalars``: the 8 coefficients, the gradient sign and the 4 int32 keys, in kernel order."""
        stream = torch._C._cuda_getCurrentRawStream(device)
        a = self.template.copy()
        a[self.i_dy] = dy.data_ptr()
        a[self.i_x] = x.data_ptr()
        if self.i_bt is not None:
            a[self.i_bt] = bt
        i = self.i_scalars
        a[i:i + _N_SCALARS] = scalars
        if self.scratch_bytes:
            rec = self.scratch.get(stream)
            if rec is None:
                buf = _scratch(self.scratch_bytes, self.scratch_align, stream)
                rec = self.scratch[stream] = (buf, buf.data_ptr())
            a[-2] = rec[1]
        self.launcher._launch_kernel(self.function, self.nprogs, 1, 1, self.num_warps, self.shared, self.tys,
                                     tuple(a), stream)


def hooks_active() -> bool:
    rt = triton.knobs.runtime
    return _hooked(rt.launch_enter_hook) or _hooked(rt.launch_exit_hook)


def _i32(key: int) -> int:
    """A hash key mod 2**32 as a signed 32-bit argument (the kernel reads its bits as uint32)."""
    key = int(key) & 0xFFFFFFFF
    return key - (1 << 32) if key >= (1 << 31) else key


def _noop_update():
    from ..rules.sgd import SGD  # any rule: accumulate mode never calls it

    return SGD.triton_update


# The timings note of a config taken from a tuned table (kernels/tuned.py); bench's kernel_configs reads it.
TABLE_NOTE = "tuned on the whole weight"


class Tuner:
    """Chooses a config per problem key by timing candidates on clones; never touches live tensors."""

    def __init__(self):
        self.cache: dict[tuple, KernelConfig] = {}
        self.timings: dict[tuple, list] = {}
        forced = os.environ.get("FORGE_TRITON_CONFIG")
        self.forced = KernelConfig(**_parse_cfg(forced)) if forced else None

    @property
    def winners(self) -> dict[str, dict]:
        return {repr(k): asdict(v) for k, v in self.cache.items()}

    def pick(self, key: tuple, bt: int, run_on_clones, device: torch.device | None = None) -> KernelConfig:
        """``run_on_clones(cfg)`` returns a zero-argument callable that launches cfg on clones.

        A config tuned offline on the whole weight for this key and device (kernels/tuned.py) is
        taken after one trial launch on clones; otherwise the candidates are timed on clones."""
        if _INTERPRET:
            return INTERPRET_CONFIG
        if self.forced is not None:
            return self.forced
        if key in self.cache:
            return self.cache[key]
        shipped = self._shipped(key, run_on_clones, device)
        if shipped is not None:
            return shipped
        cands = candidate_configs(bt)
        if len(cands) == 1:
            self.cache[key] = cands[0]
            return cands[0]
        from triton.testing import do_bench

        results = []
        for cfg in cands:
            try:
                fn = run_on_clones(cfg)
                fn()  # compile
                torch.cuda.synchronize()
                t = do_bench(fn, warmup=5, rep=25, return_mode="median")
            except Exception as err:  # a config that fails to compile (resources) is skipped
                results.append((float("inf"), cfg, repr(err)[:200]))
                continue
            results.append((t, cfg, ""))
        results.sort(key=lambda r: r[0])
        if results[0][0] == float("inf"):
            raise RuntimeError(f"no Triton config compiled for {key}: {results[0][2]}")
        self.cache[key] = results[0][1]
        # after a shipped config's failure note, if there was one
        self.timings[key] = self.timings.get(key, []) + [(r[1].short(), r[0], r[2]) for r in results]
        return results[0][1]

    def _shipped(self, key: tuple, run_on_clones, device) -> KernelConfig | None:
        from . import tuned

        if not tuned.enabled():
            return None
        name = torch.cuda.get_device_name(device)
        cfg = tuned.lookup(key, name)
        if cfg is None:
            return None
        try:  # compiles, and proves the config fits this build (shared memory, registers)
            run_on_clones(cfg)()
        except Exception as err:  # noqa: BLE001 - a config that fails here is tuned at run time instead
            self.timings[key] = [(cfg.short(), float("inf"), f"shipped config failed: {err!r}"[:200])]
            return None
        self.cache[key] = cfg
        self.timings[key] = [(cfg.short(), None, f"{TABLE_NOTE}: {tuned.table_name(name)}")]
        return cfg


_BOOL_FIELDS = ("use_tma", "flatten", "prefetch", "evict_first")


def _parse_cfg(text: str) -> dict:
    out = {}
    for part in text.split(","):
        k, v = part.split("=")
        out[k.strip()] = (v.strip().lower() in ("1", "true")) if k.strip() in _BOOL_FIELDS else int(v)
    return out


# ---------------------------------------------------------------------------------------------
# Parallel warm-up of Triton's on-disk cache: each (config, variant) takes seconds to compile and
# the compiler is single-threaded, so a tuner that tries many configs for several state layouts
# spends most of its time compiling. Worker processes compile them side by side on a tiny problem
# with the same specialization (N divisible by 16; BT, M, NSB and the keys are never specialized).

def _precompile_one(spec: dict) -> str:
    import time

    from .. import precision
    from ..backends.base import StateView
    from ..rules import RULES
    from ..rules.base import StateSpec

    t0 = time.time()
    M, N, BT = 256, 1024, 64
    dev = "cuda"
    cfg = KernelConfig(**spec["config"])
    in_dtype = getattr(torch, spec.get("in_dtype", "bfloat16"))
    dy = torch.randn(BT, M, device=dev).to(in_dtype)
    x = torch.randn(BT, N, device=dev).to(in_dtype)
    mode = spec.get("mode", fused.MODE_UPDATE)
    if mode == fused.MODE_ACCUMULATE:
        launch(weight=torch.zeros(M, N, device=dev), dy=dy, x=x, mode=mode, config=cfg)
    else:
        w = torch.randn(M, N, device=dev).to(getattr(torch, spec.get("w_dtype", "bfloat16")))
        views = []
        for slot, kind in enumerate(spec["kinds"]):
            if kind == fused.S_NONE:
                views.append(None)
                continue
            sp = StateSpec(f"s{slot}", slot, nonnegative=kind == fused.S_UINT8)
            if kind in (fused.S_INT8, fused.S_UINT8):
                dt = torch.uint8 if kind == fused.S_UINT8 else torch.int8
                views.append(StateView(sp, torch.ones(M, N, device=dev, dtype=dt),
                                       torch.ones(M, (N + 63) // 64, device=dev, dtype=precision.SCALE_DTYPE)))
            else:
                dt = torch.bfloat16 if kind == fused.S_BF16 else torch.float32
                views.append(StateView(sp, torch.ones(M, N, device=dev, dtype=dt)))
        rule = RULES[spec.get("rule", "AdamW")]
        launch(weight=w, dy=dy, x=x, rule_update=rule.triton_update, coeffs=(0.0,) * 8, states=tuple(views),
               grad_buffer=torch.zeros(M, N, device=dev) if spec.get("grad_buffer") else None,
               nonfinite=torch.zeros((), dtype=torch.int64, device=dev) if spec.get("nonfinite", True) else None,
               stochastic_weight=spec.get("sr_w", True), stochastic_state=spec.get("sr_s", True), config=cfg)
    torch.cuda.synchronize()
    return f"{cfg.short()} {spec.get('kinds')} {time.time() - t0:.1f}s"


def precompile(specs: list[dict], workers: int | None = None) -> list[str]:
    """Compile kernel variants in parallel processes (fills Triton's cache; returns one line each).

    Each spec: config (KernelConfig or its dict), kinds (3 state kinds), w_dtype, in_dtype, rule,
    sr_w, sr_s, nonfinite, grad_buffer, mode. Failures are reported, not raised.
    """
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    specs = [dict(s, config=asdict(s["config"]) if isinstance(s["config"], KernelConfig) else s["config"])
             for s in specs]
    if not specs:
        return []
    workers = workers or min(len(specs), max(1, (os.cpu_count() or 2) - 1))
    out = []
    with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn")) as ex:
        futs = [ex.submit(_precompile_one, s) for s in specs]
        for s, f in zip(specs, futs):
            try:
                out.append(f.result())
            except Exception as err:  # noqa: BLE001
                out.append(f"FAILED {s['config']} {s.get('kinds')}: {err!r}"[:300])
    return out
