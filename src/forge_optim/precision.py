"""How fp32 register values are stored back: bf16 with stochastic or nearest rounding, int8 blocks.

The integer hash here is the one the Triton kernel uses (``kernels/precision.py`` mirrors it on
uint32), so the torch and Triton backends draw the same random bits for the same element.
"""
from __future__ import annotations

import functools

import torch

MASK32 = 0xFFFFFFFF
HASH_MUL = 0x045D9F3B  # < 2**31: products of 32-bit values stay inside int64
INT8_BLOCK = 64  # contiguous elements along the last (D_in) axis that share one scale
# Scales are stored in bf16, rounded up from absmax/qmax: bf16 keeps fp32's exponent range (no scale
# underflows or overflows), rounding up keeps every code within [-qmax, qmax], and the step grows by
# less than 2**-7 of itself. Half the bytes of fp32 scales: 0.47 GiB on an 8B model (NOTES.md, tenth
# session). Codes are computed against the stored scale, so dequantizing is exact to it.
SCALE_DTYPE = torch.bfloat16
SIGNED_QMAX = 127.0  # signed states (m): int8 in [-127, 127]
UNSIGNED_QMAX = 255.0  # non-negative states (v): uint8 in [0, 255], floored to >= 1 when v > 0

# Stores that draw random bits, one key each. The states in slots 0 and 1 draw from the weight's hash
# instead of hashes of their own (``random16``): slot 0 its high half, slot 1 the high half of its
# product with DRAW2_MUL. W and m never share bits; v's bits are a function of W's and m's (each draw
# is uniform on its own, so each store stays unbiased), and the kernel computes one hash for all three
# stores of an Adam-family update (NOTES.md, twenty-first session).
SITE_WEIGHT, SITE_STATE0 = 0, 1
DRAW_LOW, DRAW_HIGH, DRAW_MIXED = 0, 1, 2  # which 16 bits of the hash a store adds (``random16``)
DRAW2_MUL = 0x5BD1E995  # odd (a bijection mod 2**32) and < 2**31 (int64 products)
# A row-sparse step's gathered rows (Backend.update_from_row_sparse) re-key their site's key with this.
SITE_GATHERED = 0x51


def hash32(x: torch.Tensor) -> torch.Tensor:
    """Six-operation integer hash on int64 tensors holding uint32 values (0x45d9f3b mixer)."""
    x = (((x >> 16) ^ x) * HASH_MUL) & MASK32
    x = (((x >> 16) ^ x) * HASH_MUL) & MASK32
    return (x >> 16) ^ x


def _mix_host(x: int) -> int:
    x &= MASK32
    x = (((x >> 16) ^ x) * HASH_MUL) & MASK32
    x = (((x >> 16) ^ x) * HASH_MUL) & MASK32
    return ((x >> 16) ^ x) & MASK32


@functools.lru_cache(maxsize=65536)
def _param_key(seed: int, param_index: int) -> int:
    """The (seed, parameter) part of ``step_key``: fixed for a run, so mixed once, not every step
    (two of the six Python-integer mixes a fused update's keys cost on the host)."""
    return _mix_host(_mix_host(seed ^ 0x9E3779B9) ^ (param_index * 0x01000193 + 0x7F4A7C15))


def step_key(seed: int, param_index: int, step: int) -> int:
    """The (seed, parameter, step) part of a key; ``site_key`` derives one key per store site."""
    return _mix_host(_param_key(seed, param_index) ^ (step * 0x000343FD + 0x269EC3))


def site_key(base: int, site: int) -> int:
    """A store site's key, < 2**31 so Triton passes it as int32."""
    return _mix_host(base ^ (site * 0x2545F491 + 0x6A09E667)) & 0x7FFFFFFF


def stream_key(seed: int, param_index: int, step: int, site: int) -> int:
    """Per (seed, parameter, step, store site) key, < 2**31 so Triton passes it as int32."""
    return site_key(step_key(seed, param_index, step), site)


def random16(offsets: torch.Tensor, key: int, draw: int = DRAW_LOW) -> torch.Tensor:
    """16 random bits per element from its linear offset in the parameter: the low half of the hash
    (DRAW_LOW), its high half (DRAW_HIGH, a second, disjoint draw), or the high half of the hash times
    DRAW2_MUL mod 2**32 (DRAW_MIXED, a third draw: uniform, since the hash of a uniformly random key is
    uniform and the multiply is a bijection, but a function of the other two)."""
    h = hash32((offsets + key) & MASK32)
    if draw == DRAW_HIGH:
        return h >> 16
    if draw == DRAW_MIXED:
        return ((h * DRAW2_MUL) & MASK32) >> 16
    return h & 0xFFFF


def to_bf16(x: torch.Tensor, stochastic: bool, key: int = 0, offsets: torch.Tensor | None = None,
            draw: int = DRAW_LOW) -> torch.Tensor:
    """fp32 -> bf16. Stochastic: round up with probability equal to the discarded fraction.

    Adding 16 random bits to the fp32 bit pattern and truncating is unbiased for finite values
    and leaves Inf/NaN as they are (their low bits are masked back off).
    """
    x = x.float()
    if not stochastic:
        return x.to(torch.bfloat16)
    bits = x.view(torch.int32).to(torch.int64)
    bits = (bits + random16(offsets, key, draw)) & ~0xFFFF
    return bits.to(torch.int32).view(torch.float32).to(torch.bfloat16)


def store_float(dst: torch.Tensor, value32: torch.Tensor, stochastic: bool, key: int, offsets,
                draw: int = DRAW_LOW) -> None:
    """Write fp32 values into a float tensor of any supported dtype."""
    if dst.dtype == torch.bfloat16:
        dst.copy_(to_bf16(value32, stochastic, key, offsets, draw))
    else:
        dst.copy_(value32)


def _blocked(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """[R, C] -> [R, nblocks, INT8_BLOCK], zero-padded; returns the padding."""
    rows, cols = x.shape
    pad = (-cols) % INT8_BLOCK
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.view(rows, -1, INT8_BLOCK), pad


def round_up_bf16(x32: torch.Tensor) -> torch.Tensor:
    """Non-negative finite fp32 -> the smallest bf16 value >= it, as fp32 (exact in bf16)."""
    bits = x32.float().contiguous().view(torch.int32).to(torch.int64)
    bits = (bits + 0xFFFF) & ~0xFFFF
    return bits.to(torch.int32).view(torch.float32)


def _block_scale(absmax: torch.Tensor, qmax: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, 1/scale) of blocks with this absmax: scale = absmax/qmax rounded up to bf16 (as fp32),
    and its correctly rounded reciprocal (0 for an all-zero block). The kernel computes the same."""
    scale = round_up_bf16(absmax / qmax)
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    return scale, inv


def quantize(x32: torch.Tensor, nonnegative: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Absmax-quantize a [R, C] fp32 block per 64 elements along C.

    Signed states go to int8 (scale >= absmax/127); non-negative ones (second moments) to uint8
    (scale >= absmax/255) and any positive value is floored to one step, so that a second moment
    never reads back as zero under a non-zero first moment (that would blow up 1/sqrt(v)).
    Codes round x/scale to nearest, so |x - code*scale| <= scale/2 (the floor aside).
    Returns (q with x32's shape, bf16 scales [R, ceil(C/64)]).
    """
    rows, cols = x32.shape
    xb, pad = _blocked(x32.float())
    absmax = xb.abs().amax(dim=-1)
    qmax = UNSIGNED_QMAX if nonnegative else SIGNED_QMAX
    scale, inv = _block_scale(absmax, qmax)
    q = torch.round(xb * inv.unsqueeze(-1))
    if nonnegative:
        q = torch.where(xb > 0, q.clamp(1.0, qmax), torch.zeros_like(q))
        q = q.to(torch.uint8)
    else:
        q = q.clamp(-qmax, qmax).to(torch.int8)
    q = q.view(rows, -1)[:, :cols]
    return q, scale.to(SCALE_DTYPE)


def quantized_full(rows: int, cols: int, value: float, nonnegative: bool,
                   device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize(torch.full((rows, cols), value))`` without the weight-sized fp32 temporaries
    (a 128256x4096 embedding would need ~7 GiB of them): every block of a constant has absmax
    |value|, so all its elements share one code and one scale, computed here on one block exactly
    as quantize() computes them."""
    v = torch.tensor(value, dtype=torch.float32).item()  # the fp32 value quantize() would see
    q1, s1 = quantize(torch.full((1, 1), v, dtype=torch.float32), nonnegative)
    nb = -(-cols // INT8_BLOCK)
    scale = torch.full((rows, nb), s1.item(), dtype=SCALE_DTYPE, device=device)
    q = torch.full((rows, cols), q1.item(), dtype=int8_dtype(nonnegative), device=device)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    rows, cols = q.shape
    qb, _ = _blocked(q.float())
    return (qb * scale.float().unsqueeze(-1)).view(rows, -1)[:, :cols]


def int8_dtype(nonnegative: bool) -> torch.dtype:
    return torch.uint8 if nonnegative else torch.int8


def num_scale_blocks(cols: int) -> int:
    return (cols + INT8_BLOCK - 1) // INT8_BLOCK
