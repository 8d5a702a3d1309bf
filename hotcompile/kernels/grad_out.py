"""Both backward operands of a linear layer from one kernel pair over the output gradient g_y.

Why this module: the backward of ``y = x W^T`` quantizes g_y (L, O) twice,

* HQ (the g_x path): H_16 along O, stochastic rounding, a per-token or per-tensor scale
  (``hadamard.hq_act_quant``), and
* HLA (the g_W path): H_16 along the token axis, keep ``rank`` low-pass rows of every
  16-token block, stochastic rounding, a per-tensor scale, written transposed
  (``hla.hla_quant(..., transposed=True, pad_to=16)``).

Run separately they read g_y from memory three times (per-token HQ: one pass; HLA: two,
its per-tensor scale needs a global amax first) or four times (per-tensor HQ: two more).
Both transforms act on the same 16-token x 16-channel tiles (HOT_SPEC, "Cost model"), so
here every program owns one tile of 16*BT tokens x BC channels and derives both operands
from it, in two launches:

* phase 1: transform the tile both ways and atomically max the amax into one zeroed
  int32 buffer (float bits, ``abs_bits``: integer max == float max, NaN wins): word 0 the
  HLA amax, then the HQ amax, one word per token or one for the tensor;
* phase 2: the same tiles in reverse order (those phase 1 read last are still in L2):
  transform again, quantize and store both operands.

g_y thus comes from DRAM twice (the second time partly from L2) whatever the HQ scaling.
Used by ``hot::linear_backward`` up to HLA rank 8 only (``ops.ONE_PASS_MAX_RANK``): at rank
16 the (16-token x BC x 16) coefficient tile next to the HQ half made the pair slower than
the two separate kernels on the H100 at every shape and tile tried (2026-11-23).
Per-token HQ becomes two-phase as well (a row's scale needs all of O and a tile holds a
slice of it), but its first read is the one HLA needs anyway.

Inside a program the tile is read in two register layouts: the HLA half loads it whole, so
every thread holds 8 channels x 16 tokens and the token-axis transform, kept-row gather,
Philox words and transposed stores stay in its registers (``hla.py``'s layout); the HQ
half then re-reads it from L1 in slices of HR tokens, each thread holding 16 consecutive
channels (``hadamard.py``'s layout). Compiled for sm_90, a single load feeding both halves
costs a shared-memory round trip of the tile plus 7 conversions of the HLA Philox words,
and keeping both halves' values live at once spills past 255 registers; the second read
from L1 costs neither (numbers in ``tile_shape``).

Bit-identity with the separate kernels holds by construction: the transforms are the same
fp32 butterflies on the same loaded values (``hadamard._load_fwht_rows``,
``hla._load_project``), the amax words hold the same maxima (a max is order-free), the
scales come from ``scale_from_amax_bits`` and the levels from the very quantize-and-store
helpers of ``hadamard.py`` and ``hla.py``, whose Philox counters depend only on an
element's position in its operand: HQ element (t, c) of the (L, O_pad) operand uses counter
``t * O_pad/16 + c // 16``; HLA coefficient j of token block b at channel c, element
(b * rank + j, c) of the (L', O) operand, uses ``(b * rank + j) * ceil(O/16) + c // 16``.
So no tile shape changes a bit. One corner: per-token HQ takes the IEEE-division fallback
for a whole slice of HR rows when one of them has a scale whose reciprocal overflows
(amax below ~2e-38 at 4 bits), where the separate kernel decides for its own row group; the fast
path equals the IEEE quotient whenever the reciprocal is finite (the premise the separate
kernel rests on too), so the levels agree either way.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .launch import launch
from . import hadamard, hla
from . import reference as ref
from .hadamard import (_load_fwht_rows, _quantize_store_rows, abs_bits, ieee_quotients,
                       interpreting, qmax, reciprocal_is_finite, scale_from_amax_bits, seed_pointer)
from .hla import _load_project, _packed_rows, _quantize_store_tile, _tile_origin

# =========================================================================== HLA half


@triton.jit
def _hla_half(g_ptr, q_ptr, s_ptr, amax_ptr, seed_ptr, seed_add, blk0, col0, S, n_sblk, stride_b,
              stride_s, O, stride_g, ld_q, n_blk, groups, is_first, PHASE: tl.constexpr,
              BT: tl.constexpr, BC: tl.constexpr,
              RP: tl.constexpr, RANK: tl.constexpr, KEPT: tl.constexpr, Q: tl.constexpr,
              INTERPRET: tl.constexpr):
    """The tile's HLA coefficients (BT, BC, RP): phase 1 maxes their amax into word 0,
    phase 2 quantizes them into the transposed (O, L'_pad) operand (``hla._hla_kernel``,
    stochastic, transposed); the first program stores the scale."""
    v = _load_project(g_ptr, blk0, col0, n_blk, S, n_sblk, stride_b, stride_s, O, stride_g, BT,
                      BC, RP, RANK, KEPT, 8)
    if PHASE == 1:
        keep = (tl.arange(0, RP) < RANK)[None, None, :]
        tl.atomic_max(amax_ptr, tl.max(tl.where(keep, abs_bits(v), 0)))
    else:
        seed = tl.load(seed_ptr) + seed_add
        s = scale_from_amax_bits(tl.load(amax_ptr), Q)
        inv_s = tl.math.div_rn(1.0, s)
        if is_first:
            tl.store(s_ptr, s)
        # an inf in g makes s inf and its reciprocal 0: the IEEE path (``quantize``)
        _quantize_store_tile(q_ptr, v, s, inv_s, seed, blk0, col0, n_blk, O, ld_q, groups,
                             BT, BC, RP, RANK, Q, True, True, INTERPRET,
                             ieee_quotients(inv_s))


# =========================================================================== HQ half


@triton.jit
def _hq_rows(g_ptr, q_ptr, s_ptr, amax_ptr, seed, rows, col0, L, O, O_pad, stride_g, groups,
             is_first, PHASE: tl.constexpr, PER_TOKEN: tl.constexpr, BC: tl.constexpr,
             Q: tl.constexpr, FP8: tl.constexpr, INTERPRET: tl.constexpr):
    """HR tokens of the tile, transformed along O. Phase 1 maxes their amax into word
    1 + token (per token) or word 1; phase 2 quantizes them into the (L, O_pad) operand
    (``_hq_token_kernel`` / ``_hq_tensor_kernel`` numerics). Scales are stored by the
    tiles of column 0 (per token) or by the first rows of the first program."""
    v = _load_fwht_rows(g_ptr, rows, col0, L, O, stride_g, BC)
    if PER_TOKEN:
        if PHASE == 1:
            tl.atomic_max(amax_ptr + 1 + rows, tl.max(abs_bits(v), axis=1), mask=rows < L)
        else:
            s = scale_from_amax_bits(tl.load(amax_ptr + 1 + rows, mask=rows < L, other=0), Q)
            inv_s = tl.math.div_rn(1.0, s)
            if reciprocal_is_finite(inv_s):
                _quantize_store_rows(q_ptr, v, s[:, None], inv_s[:, None], seed, rows, col0, L,
                                     O_pad, O_pad, groups, BC, Q, True, FP8, INTERPRET, False)
            else:
                _quantize_store_rows(q_ptr, v, s[:, None], inv_s[:, None], seed, rows, col0, L,
                                     O_pad, O_pad, groups, BC, Q, True, FP8, INTERPRET, True)
            if col0 == 0:
                tl.store(s_ptr + rows, s, mask=rows < L)
    else:
        if PHASE == 1:
            tl.atomic_max(amax_ptr + 1, tl.max(abs_bits(v)))
        else:
            s = scale_from_amax_bits(tl.load(amax_ptr + 1), Q)
            inv_s = tl.math.div_rn(1.0, s)
            if is_first:
                tl.store(s_ptr, s)
            _quantize_store_rows(q_ptr, v, s, inv_s, seed, rows, col0, L, O_pad, O_pad,
                                 groups, BC, Q, True, FP8, INTERPRET,
                                 ieee_quotients(inv_s))


# =========================================================================== the kernel


@triton.jit
def _slice_rows(blk0, r, n_blk, S, n_sblk, stride_b, stride_s, L, HR: tl.constexpr):
    """Rows of tokens r .. r+HR-1 of the tile's token blocks (``hla._token_rows`` order);
    padding positions of a sequence map to row L, which every HQ mask drops."""
    i = r + tl.arange(0, HR)
    blk = blk0 + i // 16
    pos = (blk % n_sblk) * 16 + i % 16
    rows = (blk // n_sblk).to(tl.int64) * stride_b + pos.to(tl.int64) * stride_s
    return tl.where((pos < S) & (blk < n_blk), rows, L)


@triton.jit
def _grad_out_kernel(g_ptr, hq_ptr, hq_s_ptr, hla_ptr, hla_s_ptr, amax_ptr, hq_seed_ptr,
                     hla_seed_ptr, hla_seed_add, L, O, O_pad, stride_g, ld_hla, S, n_sblk,
                     stride_b, stride_s, n_blk, hq_groups, hla_groups,
                     PHASE: tl.constexpr, PER_TOKEN: tl.constexpr, BT: tl.constexpr,
                     BC: tl.constexpr, HR: tl.constexpr, RP: tl.constexpr, RANK: tl.constexpr,
                     KEPT: tl.constexpr, HQ_Q: tl.constexpr, HLA_Q: tl.constexpr,
                     FP8: tl.constexpr, INTERPRET: tl.constexpr):
    """One tile of BT blocks of 16 tokens x BC channels per program (phase 1 or 2, module
    doc). Tiles form a row-major grid over (blocks/BT, O_pad/BC); phase 2 visits them in
    reverse. A block is 16 neighbouring positions of one sequence (``hla.token_layout``);
    the HLA half reads the whole tile, the HQ half the same tokens HR at a time, from L1."""
    pid = tl.program_id(0)
    n_ct = tl.cdiv(O_pad, BC)
    if PHASE == 1:
        t = pid
    else:
        t = tl.num_programs(0) - 1 - pid
    blk0, col0 = _tile_origin(t, n_ct, BT, BC)
    _hla_half(g_ptr, hla_ptr, hla_s_ptr, amax_ptr, hla_seed_ptr, hla_seed_add, blk0, col0, S,
              n_sblk, stride_b, stride_s, O, stride_g, ld_hla, n_blk, hla_groups, pid == 0,
              PHASE, BT, BC, RP, RANK, KEPT, HLA_Q, INTERPRET)
    if PHASE == 2:
        hq_seed = tl.load(hq_seed_ptr)
    else:
        hq_seed = 0
    for r in tl.static_range(0, 16 * BT, HR):
        rows = _slice_rows(blk0, r, n_blk, S, n_sblk, stride_b, stride_s, L, HR)
        _hq_rows(g_ptr, hq_ptr, hq_s_ptr, amax_ptr, hq_seed, rows, col0, L, O, O_pad, stride_g,
                 hq_groups, pid + r == 0, PHASE, PER_TOKEN, BC, HQ_Q, FP8, INTERPRET)


# =========================================================================== launcher


def tile_shape(O_pad: int, interp: bool) -> tuple[int, int, int, int]:
    """(BT token blocks, BC channels, warps, HR tokens per HQ slice) of a program's tile.

    H100: one 16-token block by BC = 256 * warps channels, the tile of ``hla._tile_shape``:
    Triton's coalesced load layout gives every thread 8 consecutive channels (one 16-byte
    bf16 vector) of all 16 tokens, so the HLA half has no layout conversion but the one
    before its int8 store (as in hla.py). The HQ half re-reads HR = 4 tokens at a time; in
    phase 2 its int8 store makes each thread own 16 consecutive channels (two 16-byte
    loads), the whole H_16 run: no conversion at all (as in ``_hq_tensor_kernel``). Its
    slice must have another shape than the HLA load (HR < 16 * BT), or Triton's coalescing
    gives both loads one layout again. Compiled for sm_90 (Triton 3.6, ptxas; bf16, rank 8;
    4 warps x 1024 channels or 1 warp x 256): phase 1 112-116 registers, phase 2 168, no
    spills; HR = 8 raises per-tensor phase 2 to 237 registers, HR = 16 spills. In phase 1
    nothing anchors the HQ slices to the 16-channel layout, so their last butterfly stage
    goes through shared memory (two conversions per slice, like ``_hq_tensor_kernel``'s
    phase 1). Warps: the count that pads O_pad least, then the most (O = 768, 2304, 11008:
    1 warp x 256 channels; 3072, 4096, 12288: 4 warps x 1024).
    HOT_GRAD_OUT_TILE="BT,BC,WARPS,HR" overrides (tuning, and tests of other shapes).
    """
    if "HOT_GRAD_OUT_TILE" in os.environ:
        bt, bc, warps, hr = (int(v) for v in os.environ["HOT_GRAD_OUT_TILE"].split(","))
        pow2 = lambda n: n >= 1 and n & (n - 1) == 0
        if not (pow2(bt) and pow2(bc) and bc >= 16 and pow2(hr) and hr <= 16 * bt
                and pow2(warps)):
            raise ValueError("HOT_GRAD_OUT_TILE: powers of two with BC >= 16 and "
                             f"HR <= 16 * BT, got {bt},{bc},{warps},{hr}")
        return bt, bc, warps, hr
    if interp:      # few programs: the interpreter's cost is per operation, not per element
        return 1, 64, 4, 16
    warps = min((4, 2, 1), key=lambda w: (-(-O_pad // (256 * w)) * 256 * w, -w))
    return 1, 256 * warps, warps, 4


def grad_out_quant(g: torch.Tensor, hq_bits: int, per_token: bool, hq_seed, rank: int,
                   select: str, hla_bits: int, hla_seed, fp8: bool = False, *,
                   hla_seed_add: int = 0, seq_len: int = 0, seq_first: bool = False):
    """HQ and HLA operands of g (L, O) from one kernel pair.

    Returns ``(hq_levels, hq_scale, hla_levels_t, hla_scale)``, bit-identical to
    ``hadamard.hq_act_quant(g, hq_bits, per_token, hq_seed, fp8)`` and
    ``hla.hla_quant(g, rank, select, hla_bits, stochastic=True, seed=hla_seed + hla_seed_add,
    transposed=True, pad_to=16, seq_len=seq_len, seq_first=seq_first)``: levels (L, O_pad)
    int8 (e4m3 with ``fp8``) with an fp32 scale (L,) or (); levels (O, L'_pad) int8,
    L' = blocks * rank, columns past L' left unwritten, with an fp32 scale (). Seeds: ints
    or 1-element int64 tensors; ``hla_seed_add`` lets both halves read one seed tensor
    and still draw independent bits (another Philox key). Block 16.
    """
    for name, bits in (("hq_bits", hq_bits), ("hla_bits", hla_bits)):
        if not 2 <= int(bits) <= 8:
            raise ValueError(f"{name} must be in [2, 8], got {bits}")
    if g.dim() != 2:
        raise ValueError(f"g must be 2-D (L, O), got shape {tuple(g.shape)}")
    kept = _packed_rows(rank, select)                 # validates rank and select
    lay = dict(seq_len=seq_len, seq_first=seq_first)
    if g.numel() == 0:                                # no tile to launch: the separate path
        hla_s = hla_seed + hla_seed_add if hla_seed_add else hla_seed
        return (*hadamard.hq_act_quant(g, hq_bits, per_token, hq_seed, fp8),
                *hla.hla_quant(g, rank, select, hla_bits, stochastic=True, seed=hla_s,
                               transposed=True, pad_to=16, **lay))
    if g.stride(-1) != 1:
        g = g.contiguous()
    L, O = g.shape
    S, n_sblk, stride_b, stride_s, n_blk = hla.token_layout(L, seq_len, seq_first)
    O_pad = -(-O // 16) * 16
    ld_hla = -(-(n_blk * rank) // 16) * 16
    dev = g.device
    hq_q = torch.empty((L, O_pad), dtype=hadamard.level_dtype(fp8), device=dev)
    hq_s = torch.empty((L,), dtype=torch.float32, device=dev) if per_token else \
        hadamard.scalar_buffer(dev)
    hla_q = torch.empty((O, ld_hla), dtype=torch.int8, device=dev)
    hla_s = hadamard.scalar_buffer(dev)
    amax = torch.zeros((1 + (L if per_token else 1),), dtype=torch.int32, device=dev)
    interp = interpreting()
    bt, bc, warps, hr = tile_shape(O_pad, interp)
    grid = (triton.cdiv(n_blk, bt) * triton.cdiv(O_pad, bc),)
    hq_seed_t = seed_pointer(hq_seed, dev)
    hla_seed_t = hq_seed_t if hla_seed is hq_seed else seed_pointer(hla_seed, dev)
    args = (g, hq_q, hq_s, hla_q, hla_s, amax, hq_seed_t, hla_seed_t, int(hla_seed_add), L, O,
            O_pad, g.stride(0), ld_hla, S, n_sblk, stride_b, stride_s, n_blk,
            ref.philox_counters(O_pad), ref.philox_counters(O))
    meta = dict(PER_TOKEN=bool(per_token), BT=bt, BC=bc, HR=hr, RP=hla._pow2_at_least(rank),
                RANK=rank, KEPT=kept, HQ_Q=qmax(hq_bits), HLA_Q=qmax(hla_bits), FP8=bool(fp8),
                INTERPRET=interp, num_warps=warps)
    launch(_grad_out_kernel, grid, *args, PHASE=1, **meta)
    launch(_grad_out_kernel, grid, *args, PHASE=2, **meta)
    return hq_q, hq_s, hla_q, hla_s
