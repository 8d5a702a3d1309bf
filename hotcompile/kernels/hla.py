"""HLA: project each block of 16 tokens onto r low-pass Hadamard rows, then quantize to INT8.

Why a kernel of its own: the transform runs along the *token* axis (rows), so a tile of
BT blocks of 16 tokens x BC channels is loaded (contiguous along channels) so that every
thread owns whole token columns, transformed with the same register butterfly as
``hadamard.py`` (``fwht16``), and only the r kept coefficients are gathered, quantized and
stored (``_tile_shape``: which thread owns what, and why). Used twice per linear layer:

* ``abc_compress`` (forward, the saved activation): x (L, I) -> levels, nearest rounding,
  one per-tensor scale, written K-major as (I, L'_pad) (the g_W GEMM's layout);
  L' = ceil(L / 16) * r.
* the g side of ``hla_grad_weight`` (backward): g (L, O) -> levels with stochastic
  rounding, written transposed as (O, L') so the g_W GEMM reads both operands along its
  reduction axis. Uniforms: ``reference.uniform8`` over the (L', O) tensor for int8
  levels, ``reference.hla_uniforms`` (channel-major) for scaled e4m3.

Both write int8 levels, or (``E4M3``, the cuBLAS FP8 g_W path) scaled e4m3 with the same
scale rule at Q = 448: ``hadamard.to_e4m3``, stochastic onto the e4m3 grid for g.

Per-tensor scales need the global amax first: phase 1 projects every tile and atomically
maxes its amax into one word, phase 2 re-projects (tiles in reverse order, for L2 hits)
and quantizes. The e4m3 operands skip phase 1, their scales coming from bounds: the saved
x's from max|x| / 28 (``reference.e4m3_bound_scale``; max|x| a reduction Inductor fuses
with x's producer), g's from ``reference.token_block_bound`` / 448 (g's row maxima from
the per-token HQ kernel, their block sums and max from ``_block_bound_kernel``).
Only int8 levels run both phases.
L is padded with zero tokens to a multiple of 16, like the reference.

Numerics: the reference projects with a dense fp32 ``einsum`` whose summation order is the
BLAS library's; this kernel sums by the butterfly. Values can differ in the last bit, so
a level sitting exactly on a rounding boundary can differ by one (measured in the tests:
a few per million); the scale and every other level are equal.
"""
from __future__ import annotations

import os

import torch
import triton
from torch._subclasses.fake_tensor import is_fake
import triton.language as tl

from .launch import declare_writes, launch
from . import gemm, reference as ref
from .hadamard import (abs_bits, counter_uniforms, fwht16, ieee_quotients, input_amax_bits,
                       input_max_bits, interpreting, philox_uniform8, quantize, scalar_buffer,
                       scale_from_amax_bits, seed_pointer, to_e4m3)


@triton.jit
def _pick(y, k: tl.constexpr):
    """Column k (a compile-time constant) of a (M, 16) tile: four splits along its index
    bits, each keeping the half that k's bit names. Register renaming, no data movement."""
    M: tl.constexpr = y.shape[0]
    t = tl.reshape(y, (M, 2, 2, 2, 2))       # (.., bit3, bit2, bit1, bit0)
    a, b = tl.split(t)
    if (k & 1) == 0:
        t = a
    else:
        t = b
    a, b = tl.split(t)
    if (k & 2) == 0:
        t = a
    else:
        t = b
    a, b = tl.split(t)
    if (k & 4) == 0:
        t = a
    else:
        t = b
    a, b = tl.split(t)
    if (k & 8) == 0:
        t = a
    else:
        t = b
    return t


@triton.jit
def _kept(y, j: tl.constexpr, RANK: tl.constexpr, KEPT: tl.constexpr):
    """Coefficient j of the kept list (row ``(KEPT >> 4j) & 15`` of H_16); padding past rank."""
    if j < RANK:
        return _pick(y, (KEPT >> (4 * j)) & 15)
    else:
        return _pick(y, 0)


@triton.jit
def _join_kept(y, base: tl.constexpr, stride: tl.constexpr, LEVELS: tl.constexpr,
               RANK: tl.constexpr, KEPT: tl.constexpr):
    """Kept coefficients base, base + stride, ... (2**LEVELS of them) joined so that the
    flattened trailing axes list them in order (join adds the *last* axis, so the first
    split is on the lowest bit of the position)."""
    if LEVELS == 0:
        return _kept(y, base, RANK, KEPT)
    elif LEVELS == 1:
        return tl.join(_kept(y, base, RANK, KEPT), _kept(y, base + stride, RANK, KEPT))
    elif LEVELS == 2:
        return tl.join(_join_kept(y, base, 2 * stride, 1, RANK, KEPT),
                       _join_kept(y, base + stride, 2 * stride, 1, RANK, KEPT))
    elif LEVELS == 3:
        return tl.join(_join_kept(y, base, 2 * stride, 2, RANK, KEPT),
                       _join_kept(y, base + stride, 2 * stride, 2, RANK, KEPT))
    else:
        return tl.join(_join_kept(y, base, 2 * stride, 3, RANK, KEPT),
                       _join_kept(y, base + stride, 2 * stride, 3, RANK, KEPT))


@triton.jit
def gather_kept(y, RP: tl.constexpr, RANK: tl.constexpr, KEPT: tl.constexpr):
    """(M, 16) coefficients -> (M, RP): the kept rows in the reference's order, entries
    past ``RANK`` padding. ``KEPT`` packs the kept row indices, 4 bits each. Selection is
    resolved at compile time: only splits and joins, so it stays in registers."""
    M: tl.constexpr = y.shape[0]
    LEVELS: tl.constexpr = (RP >= 2) + (RP >= 4) + (RP >= 8) + (RP >= 16)
    return tl.reshape(_join_kept(y, 0, 1, LEVELS, RANK, KEPT), (M, RP))


@triton.jit
def _token_rows(blk0, n_blk, S, n_sblk, stride_b, stride_s, BT: tl.constexpr):
    """Rows of x holding the 16 tokens of blocks blk0 .. blk0+BT-1, and which exist.

    Block ``blk`` is block ``blk % n_sblk`` of sequence ``blk // n_sblk``; its token k sits
    at position s = (blk % n_sblk) * 16 + k of that sequence, in row
    ``b * stride_b + s * stride_s`` (batch-first: (S, 1); sequence-first: (1, B); one flat
    token axis: S = L, stride_s = 1). Positions past S are the zero padding of a sequence."""
    i = tl.arange(0, BT * 16)
    blk = blk0 + i // 16
    pos = (blk % n_sblk) * 16 + i % 16
    rows = (blk // n_sblk).to(tl.int64) * stride_b + pos.to(tl.int64) * stride_s
    return rows, (pos < S) & (blk < n_blk)


@triton.jit
def _tile_tokens(blk0, n_blk, S, n_sblk, stride_b, stride_s, BT: tl.constexpr, FLAT: tl.constexpr):
    """Rows of the tile's BT * 16 tokens and which exist (``_token_rows``; with ``FLAT``
    block b's tokens are rows 16 b .. 16 b + 15, no per-row division)."""
    if FLAT:
        tok = blk0 * 16 + tl.arange(0, BT * 16)
        return tok, tok < S * (n_blk // n_sblk)
    else:
        return _token_rows(blk0, n_blk, S, n_sblk, stride_b, stride_s, BT)


@triton.jit
def _project_blocks(x, RP: tl.constexpr, RANK: tl.constexpr, KEPT: tl.constexpr):
    """(BT, N, 16 tokens) fp32 -> (BT, N, RP): each block's kept coefficients."""
    BT: tl.constexpr = x.shape[0]
    N: tl.constexpr = x.shape[1]
    y = gather_kept(fwht16(tl.reshape(x, (BT * N, 16))), RP, RANK, KEPT)
    return tl.reshape(y, (BT, N, RP))


@triton.jit
def _load_project(x_ptr, blk0, col0, n_blk, S, n_sblk, stride_b, stride_s, C, stride_x,
                  BT: tl.constexpr, BC: tl.constexpr,
                  RP: tl.constexpr, RANK: tl.constexpr, KEPT: tl.constexpr, CPT: tl.constexpr,
                  FLAT: tl.constexpr = False, EVEN_C: tl.constexpr = False):
    """Blocks blk0 .. blk0+BT-1 of 16 neighbouring tokens, channels col0 .. col0+BC-1,
    projected onto the kept rows: a (BT, BC, RP) fp32 tile, coefficients last (entries
    >= rank: padding). ``CPT`` < 8 caps the load's vector at CPT channels, so a warp's
    32 threads span 32 * CPT channels and each thread keeps every token of its own
    (``_tile_shape``). ``FLAT``: block b's tokens are rows 16 b .. 16 b + 15 (one token axis,
    or batch-first sequences whose length is a multiple of 16): no per-row division.
    ``EVEN_C``: BC divides C, no channel mask."""
    tok, valid = _tile_tokens(blk0, n_blk, S, n_sblk, stride_b, stride_s, BT, FLAT)
    cols = col0 + tl.arange(0, BC)
    if CPT < 8:
        cols = tl.max_contiguous(cols, CPT)
    if EVEN_C:
        mask = valid[:, None]
    else:
        mask = valid[:, None] & (cols < C)[None, :]
    x = tl.load(x_ptr + tok[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    # token axis last: a relabelling of the tile's registers (each thread owns whole
    # token columns)
    x = tl.permute(tl.reshape(x.to(tl.float32), (BT, 16, BC)), (0, 2, 1))
    return _project_blocks(x, RP, RANK, KEPT)


@triton.jit
def _load_pairs(x_ptr, blk0, col0, n_blk, S, n_sblk, stride_b, stride_s, C, stride_x,
                BT: tl.constexpr, BC: tl.constexpr, FLAT: tl.constexpr, EVEN_C: tl.constexpr):
    """Channels col0 .. col0+BC-1 of a 2-byte x, tokens of blocks blk0 .. blk0+BT-1, read as
    4-byte words of two neighbouring channels: a (BT, BC / 2, 16) int32 tile in which each
    lane holds the 16 tokens of one block of one word (``_pair_half`` splits it).

    Why this layout: it is the one Triton gives the K-major store of a (BT, channels, RP)
    tile (BT lanes a channel, each storing its block's RP bytes, so a warp's store fills
    whole 32-byte sectors), so the tile is never converted through shared memory, and a
    thread holds 32 values, not 64. The 2-channel vector tile (``CPT`` = 2: all BT blocks of
    two channels a thread) was converted before its store; one channel a lane with all
    blocks (forty-third stop) stored half sectors and was slower. Needs C, the row stride
    and x's offset even (``_pairs_fit``)."""
    tok, valid = _tile_tokens(blk0, n_blk, S, n_sblk, stride_b, stride_s, BT, FLAT)
    tok = tl.reshape(tok, (BT, 1, 16))
    valid = tl.reshape(valid, (BT, 1, 16))
    words = tl.max_contiguous(col0 // 2 + tl.arange(0, BC // 2), 1)     # one word a lane
    if EVEN_C:
        mask = valid
    else:
        mask = valid & (words * 2 < C)[None, :, None]
    # contiguity 1 on every axis: Triton gives the lanes axis 0 (blocks), then axis 1
    words_ptr = x_ptr.to(tl.pointer_type(tl.int32))
    if FLAT:
        # a block's 16 rows as its first row's address plus k 64-bit strides: sm_90 code adds
        # one uniform stride a load (2 instructions) instead of a row product and a
        # sign-extended add (4; forty-fourth stop). ``tl.cast``, not ``.to``: torch 2.11's
        # mutation analysis builds the TTIR with every scalar argument a constexpr, which
        # has no ``.to`` (the spliced GPU tests failed so, forty-fifth stop)
        sw = tl.cast(stride_x // 2, tl.int64)
        first = ((blk0 + tl.arange(0, BT)) * 16).to(tl.int64) * sw
        base = words_ptr + first[:, None, None] + words[None, :, None]
        return tl.load(base + (tl.arange(0, 16).to(tl.int64) * sw)[None, None, :], mask=mask,
                       other=0)
    return tl.load(words_ptr + words[None, :, None] + tok * (stride_x // 2), mask=mask, other=0)


@triton.jit
def _pair_half(w, HALF: tl.constexpr, DTYPE: tl.constexpr):
    """The even (HALF 0) or odd (1) channels of a word tile as fp32 (little-endian: the
    even channel is the low half)."""
    if DTYPE == tl.bfloat16:
        if HALF == 0:
            return (w << 16).to(tl.float32, bitcast=True)
        else:
            return (w & -65536).to(tl.float32, bitcast=True)
    else:
        if HALF == 0:
            return w.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        else:
            return (w >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _channel_uniforms(seed, first, NG: tl.constexpr, INTERPRET: tl.constexpr):
    """(BC, NG * 16) uniforms: counters first[c] .. first[c] + NG - 1 of each channel c,
    joined one counter at a time so every counter stays in the registers of the thread that
    owns its channel (a (BC, NG) counter tensor spreads NG over lanes)."""
    BC: tl.constexpr = first.shape[0]
    if NG == 1:
        return tl.reshape(counter_uniforms(seed, first.to(tl.uint32), not INTERPRET, True),
                          (BC, 16))
    else:
        lo = _channel_uniforms(seed, first, NG // 2, INTERPRET)
        hi = _channel_uniforms(seed, first + NG // 2, NG // 2, INTERPRET)
        return tl.reshape(tl.permute(tl.join(lo, hi), (0, 2, 1)), (BC, NG * 16))


@triton.jit
def _quantize_store_tile(q_ptr, v, s, inv_s, seed, blk0, col0, n_blk, C, ldq, groups_per_row,
                         BT: tl.constexpr, BC: tl.constexpr, RP: tl.constexpr, RANK: tl.constexpr,
                         Q: tl.constexpr, STOCHASTIC: tl.constexpr, TRANSPOSED: tl.constexpr,
                         INTERPRET: tl.constexpr, IEEE_DIV, E4M3: tl.constexpr = False):
    """Quantize a (BT, BC, RP) tile (to int8 levels, or with E4M3 to scaled FP8:
    ``to_e4m3``) and store it at rows (blk0 + b) * rank + j of (L', C), or at the
    transposed positions of a (C, L'_pad) buffer.

    (Quantizing 8 coefficients at a time removes phase 2's register spills at rank 16,
    yet ran 10% slower on the H100, 2026-11-24; so did a register cap of 128 or 168. One
    kept row at a time, each with its own Philox counter, kept the 16-byte stores and had
    no spills, yet ran at the same speed, with or without a cap: bench/NOTES_kernels.md,
    seventh stop.)"""
    j = tl.arange(0, RP)
    rows = (blk0 + tl.arange(0, BT))[:, None] * RANK + j[None, :]            # (BT, RP)
    cols = col0 + tl.arange(0, BC)
    if STOCHASTIC and E4M3:   # uniforms along each channel's padded coefficients
        # (reference.hla_uniforms): counters c * groups_per_row + (blk * RP + j) // 16, all
        # of them in the thread that owns channel c (blk0 * RP is a multiple of 16)
        u = _channel_uniforms(seed, cols.to(tl.int64) * groups_per_row + blk0 * RP // 16,
                              BT * RP // 16, INTERPRET)                       # (BC, NG*16)
        u = tl.permute(tl.reshape(u, (BC, BT, RP)), (1, 0, 2))
    elif STOCHASTIC:   # uniforms follow the (L', C) layout: generate there, then turn
        u = philox_uniform8(seed, tl.reshape(rows, (BT * RP,)), col0, groups_per_row, BC)
        u = tl.permute(tl.reshape(u, (BT, RP, BC)), (0, 2, 1))
    else:
        u = 0.5
    q = _levels(v, s, inv_s, u, Q, STOCHASTIC, INTERPRET, IEEE_DIV, E4M3)
    valid = ((blk0 + tl.arange(0, BT)) < n_blk)[:, None] & (j < RANK)[None, :]
    mask = valid[:, None, :] & (cols < C)[None, :, None]
    if TRANSPOSED:
        ptrs = q_ptr + cols.to(tl.int64)[None, :, None] * ldq + rows[:, None, :]
    else:
        ptrs = q_ptr + rows.to(tl.int64)[:, None, :] * ldq + cols[None, :, None]
    tl.store(ptrs, q, mask=mask)


@triton.jit
def _levels(v, s, inv_s, u, Q: tl.constexpr, STOCHASTIC: tl.constexpr, INTERPRET: tl.constexpr,
            IEEE_DIV, E4M3: tl.constexpr, CLAMP: tl.constexpr = True):
    """v over s as scaled e4m3 (``to_e4m3``) or int8 levels (``quantize``), rounding by u."""
    if E4M3:
        return to_e4m3(v, s, inv_s, IEEE_DIV or INTERPRET, INTERPRET, u, STOCHASTIC, FINITE=True,
                       CLAMP=CLAMP)
    else:
        return quantize(v, s, inv_s, u, Q, IEEE_DIV or INTERPRET, not INTERPRET,
                        INTERPRET).to(tl.int8)


@triton.jit
def _quantize_store_half(q_ptr, v, s, inv_s, seed, blk0, cols, n_blk, C, ldq, groups_per_row,
                         RANK: tl.constexpr, Q: tl.constexpr, STOCHASTIC: tl.constexpr,
                         INTERPRET: tl.constexpr, IEEE_DIV, E4M3: tl.constexpr):
    """``_quantize_store_tile`` of one half of ``_load_pairs``: a (BT, N, RP) tile of the
    channels ``cols``, one block of one channel a lane, stored transposed (K-major).
    Stochastic (e4m3) at RP = 16 only: one Philox counter a block, in the lane that owns it
    (``reference.hla_uniforms``: counter c * groups_per_row + block)."""
    BT: tl.constexpr = v.shape[0]
    N: tl.constexpr = v.shape[1]
    RP: tl.constexpr = v.shape[2]
    j = tl.arange(0, RP)
    blk = blk0 + tl.arange(0, BT)
    rows = blk[:, None] * RANK + j[None, :]                                   # (BT, RP)
    if STOCHASTIC:
        tl.static_assert(E4M3 and RP == 16, "pairs: e4m3 uniforms, one counter a block")
        counters = cols.to(tl.int64)[None, :] * groups_per_row + blk[:, None]
        u = tl.reshape(counter_uniforms(seed, counters.to(tl.uint32), not INTERPRET, True),
                       (BT, N, RP))
    else:
        u = 0.5
    q = _levels(v, s, inv_s, u, Q, STOCHASTIC, INTERPRET, IEEE_DIV, E4M3, CLAMP=False)
    valid = (blk < n_blk)[:, None] & (j < RANK)[None, :]
    mask = valid[:, None, :] & (cols < C)[None, :, None]
    tl.store(q_ptr + cols.to(tl.int64)[None, :, None] * ldq + rows[:, None, :], q, mask=mask)


@triton.jit
def _tile_origin(t, n_ct, BT: tl.constexpr, BC: tl.constexpr):
    """First token block and first channel of tile t (row-major grid, n_ct tiles per row)."""
    return (t // n_ct) * BT, (t % n_ct) * BC


@triton.jit
def _hla_kernel(x_ptr, q_ptr, s_ptr, amax_ptr, seed_ptr, seed_add, scale_mul, S, n_sblk, stride_b,
                stride_s, C, stride_x, ldq, n_blk, groups_per_row, PHASE: tl.constexpr,
                BT: tl.constexpr, BC: tl.constexpr, RP: tl.constexpr, RANK: tl.constexpr,
                KEPT: tl.constexpr, Q: tl.constexpr, STOCHASTIC: tl.constexpr,
                TRANSPOSED: tl.constexpr, INTERPRET: tl.constexpr, E4M3: tl.constexpr,
                CPT: tl.constexpr, FLAT: tl.constexpr, EVEN_C: tl.constexpr,
                BOUND: tl.constexpr, STEP: tl.constexpr = 0, PAIRS: tl.constexpr = False,
                ROW_STRIDE: tl.constexpr = 0):
    """One tile of BT token blocks x BC channels per program (phase 2: ``_phase2_tiles``).

    Phase 1: project, atomically max the amax of the kept coefficients into ``amax_ptr``
    (zeroed). Phase 2: scale, re-project, quantize, store; tiles in reverse order so the
    ones phase 1 read last (still in L2) come first. The stored scale is s * scale_mul
    (a power of two: exact). ``BOUND``: phase 2 alone, ``amax_ptr`` holding max |x| (the
    saved x's bound scale, ``reference.abc_compress``), rounded to the type x is read as
    (``hadamard.input_max_bits``). g's e4m3 operand also runs phase 2 alone, ``amax_ptr``
    holding its ``reference.token_block_bound`` (an fp32 word, used as it is).
    ``ROW_STRIDE`` > 0: x's row stride, known when the kernel is compiled (``row_stride``),
    used in place of ``stride_x``.
    """
    if ROW_STRIDE > 0:
        stride_x = ROW_STRIDE
    pid = tl.program_id(0)
    n_ct = tl.cdiv(C, BC)
    if PHASE == 1:
        blk0, col0 = _tile_origin(pid, n_ct, BT, BC)
        keep = (tl.arange(0, RP) < RANK)[None, None, :]
        if PAIRS:
            w = _load_pairs(x_ptr, blk0, col0, n_blk, S, n_sblk, stride_b, stride_s, C,
                            stride_x, BT, BC, FLAT, EVEN_C)
            m = 0
            for h in tl.static_range(2):
                v = _project_blocks(_pair_half(w, h, x_ptr.dtype.element_ty), RP, RANK, KEPT)
                m = tl.maximum(m, tl.max(tl.where(keep, abs_bits(v), 0)))
        else:
            v = _load_project(x_ptr, blk0, col0, n_blk, S, n_sblk, stride_b, stride_s, C,
                              stride_x, BT, BC, RP, RANK, KEPT, CPT, FLAT, EVEN_C)
            m = tl.max(tl.where(keep, abs_bits(v), 0))
        tl.atomic_max(amax_ptr, m)
    else:
        if STOCHASTIC:
            seed = tl.load(seed_ptr) + seed_add
        else:   # nearest rounding: no seed (callers pass any pointer)
            seed = 0
        amax = tl.load(amax_ptr)
        if BOUND:
            amax = input_max_bits(amax, x_ptr.dtype.element_ty)
        s = scale_from_amax_bits(amax, Q)
        inv_s = tl.math.div_rn(1.0, s)
        if pid == 0:
            tl.store(s_ptr, s * scale_mul)
        n_tiles = tl.cdiv(n_blk, BT) * n_ct
        # s finite and non-zero: every quotient is finite, the reciprocal's path is taken
        # (a run-time flag, not two inlined copies of the loop: ``hadamard.ieee_quotients``)
        ieee = ieee_quotients(inv_s, STOCHASTIC and E4M3)
        _phase2_tiles(x_ptr, q_ptr, s, inv_s, seed, pid, n_tiles, n_ct, S, n_sblk, stride_b,
                      stride_s, C, stride_x, ldq, n_blk, groups_per_row, BT, BC, RP, RANK,
                      KEPT, Q, STOCHASTIC, TRANSPOSED, INTERPRET, ieee, E4M3, CPT, FLAT,
                      EVEN_C, STEP, PAIRS)


declare_writes(_hla_kernel, lambda a: ("amax_ptr",) if a["PHASE"] == 1 else ("q_ptr", "s_ptr"))


@triton.jit
def _phase2_tiles(x_ptr, q_ptr, s, inv_s, seed, pid, n_tiles, n_ct, S, n_sblk, stride_b,
                  stride_s, C, stride_x, ldq, n_blk, groups_per_row, BT: tl.constexpr,
                  BC: tl.constexpr, RP: tl.constexpr, RANK: tl.constexpr, KEPT: tl.constexpr,
                  Q: tl.constexpr, STOCHASTIC: tl.constexpr, TRANSPOSED: tl.constexpr,
                  INTERPRET: tl.constexpr, IEEE_DIV, E4M3: tl.constexpr,
                  CPT: tl.constexpr, FLAT: tl.constexpr, EVEN_C: tl.constexpr,
                  STEP: tl.constexpr, PAIRS: tl.constexpr):
    """Phase 2's tile(s) of this program, in reverse order: the tiles phase 1 read last
    come first (L2). For int8 levels and ABC the grid covers every tile, so the loop runs
    once; written as a loop (scale, seed and branch settled before it) it measured 4-14%
    faster than the same tile code inline, bit-identical (H100,
    kernel_ab_2026-11-24T1643*_h100.md). g's e4m3 operand takes up to 4 tiles a program
    (``tiles_per_program``): with the word-pair tile it is issue-bound and that pays on the
    H200 (5-7%), where the older tiles looping over several tiles were slower (H100,
    kernel_ab_2026-11-24T164302_h100.md)."""
    for t in tl.range(pid, n_tiles, tl.num_programs(0), num_stages=1):
        blk0, col0 = _tile_origin(n_tiles - 1 - t, n_ct, BT, BC)
        if STEP == 0 or STEP == BT:
            _tile_step(x_ptr, q_ptr, s, inv_s, seed, blk0, col0, S, n_sblk, stride_b, stride_s,
                       C, stride_x, ldq, n_blk, groups_per_row, BT, BC, RP, RANK, KEPT, Q,
                       STOCHASTIC, TRANSPOSED, INTERPRET, IEEE_DIV, E4M3, CPT, FLAT, EVEN_C,
                       PAIRS)
        else:   # STEP blocks at a time: the registers of a STEP-block tile
            for i in tl.range(0, BT, STEP, num_stages=1):
                _tile_step(x_ptr, q_ptr, s, inv_s, seed, blk0 + i, col0, S, n_sblk, stride_b,
                           stride_s, C, stride_x, ldq, n_blk, groups_per_row, STEP, BC, RP,
                           RANK, KEPT, Q, STOCHASTIC, TRANSPOSED, INTERPRET, IEEE_DIV, E4M3,
                           CPT, FLAT, EVEN_C, PAIRS)


@triton.jit
def _tile_step(x_ptr, q_ptr, s, inv_s, seed, blk0, col0, S, n_sblk, stride_b, stride_s, C,
               stride_x, ldq, n_blk, groups_per_row, BT: tl.constexpr, BC: tl.constexpr,
               RP: tl.constexpr, RANK: tl.constexpr, KEPT: tl.constexpr, Q: tl.constexpr,
               STOCHASTIC: tl.constexpr, TRANSPOSED: tl.constexpr, INTERPRET: tl.constexpr,
               IEEE_DIV, E4M3: tl.constexpr, CPT: tl.constexpr, FLAT: tl.constexpr,
               EVEN_C: tl.constexpr, PAIRS: tl.constexpr):
    """Load, project, quantize and store BT token blocks x BC channels (with ``PAIRS``
    read as word pairs, ``_load_pairs``, and stored as their even and odd halves)."""
    if PAIRS:
        w = _load_pairs(x_ptr, blk0, col0, n_blk, S, n_sblk, stride_b, stride_s, C, stride_x,
                        BT, BC, FLAT, EVEN_C)
        even = col0 + 2 * tl.arange(0, BC // 2)
        for h in tl.static_range(2):
            v = _project_blocks(_pair_half(w, h, x_ptr.dtype.element_ty), RP, RANK, KEPT)
            _quantize_store_half(q_ptr, v, s, inv_s, seed, blk0, even + h, n_blk, C, ldq,
                                 groups_per_row, RANK, Q, STOCHASTIC, INTERPRET, IEEE_DIV, E4M3)
    else:
        v = _load_project(x_ptr, blk0, col0, n_blk, S, n_sblk, stride_b, stride_s, C,
                          stride_x, BT, BC, RP, RANK, KEPT, CPT, FLAT, EVEN_C)
        _quantize_store_tile(q_ptr, v, s, inv_s, seed, blk0, col0, n_blk, C, ldq,
                             groups_per_row, BT, BC, RP, RANK, Q, STOCHASTIC, TRANSPOSED,
                             INTERPRET, IEEE_DIV, E4M3)


@triton.jit
def _block_bound_kernel(m_ptr, out_ptr, S, n_sblk, stride_b, stride_s, n_blk, BB: tl.constexpr):
    """``reference.block_sum_bound`` of row maxima m, maxed into the int32 word ``out_ptr``
    (zeroed: the per-token HQ kernel zeroes it as it writes m): each program sums BB token
    blocks of 16 rows (positions past S count 0, as the reference's padding tokens) and
    maxes the sums' fp32 bits (``abs_bits``: NaN wins, as the reference's ``amax``).

    The sums are fp64, like the reference's: 16 fp32 terms within 2**25 of each other add
    exactly, so the tree order here gives the reference's word; rounding each sum to fp32
    before the max gives the max's rounding (rounding is monotone). Why a kernel: as torch
    ops the block sums and their max were two Inductor reductions (one does not fuse into
    the other: their shapes differ), two launches per site instead of one."""
    blk = tl.program_id(0) * BB + tl.arange(0, BB)
    pos = (blk % n_sblk)[:, None] * 16 + tl.arange(0, 16)[None, :]
    rows = (blk // n_sblk).to(tl.int64)[:, None] * stride_b + pos.to(tl.int64) * stride_s
    m = tl.load(m_ptr + rows, mask=(blk < n_blk)[:, None] & (pos < S), other=0.0)
    sums = tl.sum(m.to(tl.float64), axis=1).to(tl.float32)
    tl.atomic_max(out_ptr, tl.max(abs_bits(sums), axis=0))


declare_writes(_block_bound_kernel, lambda a: ("out_ptr",))


# =========================================================================== launcher


def token_block_bound_bits(g: torch.Tensor, seq_len: int = 0, seq_first: bool = False,
                           row_max: torch.Tensor | None = None,
                           word: torch.Tensor | None = None) -> torch.Tensor:
    """``reference.token_block_bound`` of g (L, C) as the (1,) int32 bits of its fp32 word
    (the form the HLA kernel reads its amax in). From g's row maxima ``row_max`` when a
    kernel that read g wrote them (``hadamard.hq_act_quant(row_max=True)``, which also
    zeroes ``word``), in one launch (``_block_bound_kernel``); else a torch reduction.

    Why the HQ kernel and not Inductor computes the row maxima: fused into g's producer,
    a row max turned the rotary-embedding backward (q and k's g) into a strided reduction
    kernel, 0.41 -> 0.68 ms per Llama step (H100, 2026-11-26), where the per-token HQ
    kernel, which reads every row whole anyway, maxes it for one instruction an element."""
    if row_max is None:
        return ref.token_block_bound(g, 16, seq_len, seq_first).reshape(1).view(torch.int32)
    if word is None:
        word = torch.zeros((1,), dtype=torch.int32, device=g.device)
    S, n_sblk, stride_b, stride_s, n_blk = token_layout(g.shape[0], seq_len, seq_first)
    bb = 64
    launch(_block_bound_kernel, (triton.cdiv(n_blk, bb),), row_max, word, S, n_sblk,
           stride_b, stride_s, n_blk, BB=bb)
    return word


def _packed_rows(rank: int, select: str) -> int:
    """The kept H_16 row indices, in the reference's order, packed 4 bits each."""
    return sum(r << (4 * j) for j, r in enumerate(ref.low_pass_rows(rank, select, 16)))


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _tile_shape(C: int, interp: bool, rp: int = 16,
                channel_major: bool = False) -> tuple[int, int, int, int]:
    """(BT token blocks, BC channels, warps, CPT channels per thread) of a program's tile.

    Row-map kernels (nearest rounding, int8 levels): BC = 256 * warps makes Triton's
    coalesced load layout give every thread 8 consecutive channels (one 16-byte bf16
    vector) of all 16 tokens of a block: the token-axis transform, the kept-row gather and
    the Philox words are then all in registers, with no layout conversion through shared
    memory (compiled code: 6 instructions per element in phase 1, against 19 and 8
    conversions for a 16 x 128 tile on 4 warps). (Since the 8-bit uniforms, one counter
    covers 16 channels, two threads' worth: the stochastic int8 path, used on GPUs without
    FP8, may compute each Philox call twice or convert layouts; timed in
    ``kernel_ab_2026-11-26*_u8``.) Warps: the
    count that pads C least, then the most.

    ``channel_major`` (K-major stores, and the stochastic e4m3 operand, whose Philox
    counters run along each channel's coefficients, ``reference.hla_uniforms``): each
    thread owns CPT channels (default 2, ``HOT_HLA_CPT``) of all BT * 16 tokens, so its
    uniforms come from its own counters and its kept coefficients leave as one
    BT * RANK-byte run per channel. BT (``HOT_HLA_BT``) is the smallest count whose runs
    fill a 32-byte sector, at most 4 (rank 16: 2, rank 8: 4), and a multiple of
    16 / RP so each tile starts on a counter (16 uniforms per counter). H100
    (kernel_ab_2026-11-24T174155): half-sector runs (BT = 1 at rank 16) cost 17-45%: g's
    operand at 8192 x 11008 0.287 -> 0.237 ms, ABC written K-major 0.305 -> 0.164 ms, now
    faster than row-major + transpose (0.238).

    A 2-byte x with even C, row stride and offset (``_pairs_fit``; every site's bf16 g
    and x) takes the word-pair tile instead (``_load_pairs``: BT lanes a word of two
    channels, one block each; ``hla_quant`` sets BC = 2 * 32 / BT * warps): the K-major
    store's own layout, no conversion through shared memory, 32 values a thread. H200,
    forty-third stop (``kernel_ab_2026-11-30T041935_h200_s43_final``): g's operand
    0.0508 -> 0.0456, 0.1218 -> 0.1091, 0.0571 -> 0.0508-0.0517 ms at Llama's 4096 and
    11008 and ViT's 3072; ABC as a site runs it 0.0326 -> 0.0312, 0.0810 -> 0.0763,
    0.0129 -> 0.0119 ms. ``HOT_HLA_PAIRS=0`` keeps the CPT tile (A/B). The tile with all
    BT blocks of one channel a lane (no conversion either) stored half sectors a warp
    instruction: ABC 0.061 -> 0.076 ms (``kernel_ab_2026-11-30T035122_h200_s43_pairs_one_channel``).
    HOT_HLA_TILE="BT,BC,WARPS" overrides the row-map tile (tuning).
    """
    bt_min = max(1, ref.UNIFORMS_PER_COUNTER // rp) if channel_major else 1
    bt = int(os.environ.get("HOT_HLA_BT", max(bt_min, min(4, 32 // rp)))) if channel_major else 1
    if bt % bt_min:
        raise ValueError(f"HOT_HLA_BT={bt}: must be a multiple of {bt_min} at this rank")
    if interp:      # the GPU's token blocks per tile, so CPU tests cover multi-block tiles
        return bt, 32, 4, 8
    if channel_major:
        cpt = int(os.environ.get("HOT_HLA_CPT", "2"))
        warps = 4
        return bt, 32 * cpt * warps, warps, cpt
    if "HOT_HLA_TILE" in os.environ:
        bt, bc, warps = (int(v) for v in os.environ["HOT_HLA_TILE"].split(","))
        return bt, bc, warps, 8
    warps = min((4, 2, 1), key=lambda w: (-(-C // (256 * w)) * 256 * w, -w))
    return 1, 256 * warps, warps, 8


def tiles_per_program(n_tiles: int, device: torch.device, stochastic: bool) -> int:
    """Tiles each program of a phase-2-alone launch (e4m3 levels) takes in turn
    (``_phase2_tiles``): 4 for g's stochastic operand where that still leaves 8 programs an
    SM, else fewer; 1 for ABC and under the interpreter. ``HOT_HLA_TPP`` sets it (tuning).

    Why: g's operand is bound by instruction issue (Nsight Compute, forty-fourth stop: 73-77%
    of issue slots busy, DRAM 46-51%), and a program's prologue (the seed, the scale and its
    correctly rounded reciprocal, the tile loop's bounds) is ~15% of its instructions for one
    tile; four tiles pay it once. H200 (``kernel_ab_2026-11-30T073930_h200_s44_tpp``): Llama
    8192 x 4096 0.0452 -> 0.0435 ms (2 tiles: 0.0430), 8192 x 11008 0.1084 -> 0.1006, ViT
    12608 x 3072 0.0510 -> 0.0483, bytes unchanged. ABC is nearer its memory bound: no gain
    at 2 tiles, slower at 4 and 8 (0.0119 -> 0.0125 ms at ViT's 768), so it keeps one."""
    if "HOT_HLA_TPP" in os.environ:
        tpp = int(os.environ["HOT_HLA_TPP"])
        if tpp < 1:
            raise ValueError(f"HOT_HLA_TPP={tpp}: must be at least 1")
        return tpp
    if not stochastic or interpreting() or device.type != "cuda":
        return 1
    return max(1, min(4, n_tiles // (8 * gemm.sm_count(device.index or 0))))


def _channel_major(stochastic: bool, e4m3: bool, transposed: bool) -> bool:
    """The channel-major tile: g's stochastic e4m3 operand (its Philox map needs it) and
    every K-major store of nearest levels (ABC): runs of BT * RANK bytes per channel."""
    return (stochastic and e4m3) or (transposed and not stochastic)


def tile_plan(C: int, rp: int, *, stochastic: bool, e4m3: bool, transposed: bool,
              pairs_fit: bool = True) -> tuple[int, int, int, int, int, bool]:
    """(BT, BC, warps, CPT, STEP, PAIRS): the tile ``hla_quant`` launches for a C-channel
    x (``pairs_fit``: ``_pairs_fit(x)``), one place for it and ``bench/kernel_regs.py``.

    Word pairs (``_load_pairs``: one block of one word a lane) wherever the tile is
    channel-major and K-major, and for g's stochastic operand at full rank only (one
    Philox counter a block); a warp holds 32 / BT words x BT blocks, so BC = 2 * 32 / BT *
    warps. ``HOT_HLA_PAIRS=0`` keeps the 2-channel vectors (A/B runs)."""
    channel_major = _channel_major(stochastic, e4m3, transposed)
    interp = interpreting()
    bt, bc, warps, cpt = _tile_shape(C, interp, rp, channel_major)
    pairs = channel_major and transposed and (rp == 16 or not stochastic) and pairs_fit \
        and os.environ.get("HOT_HLA_PAIRS", "1") != "0"
    step = 0
    if stochastic and e4m3:
        bt, step = _stepped_blocks(bt, rp)
    if pairs and not interp:
        bc = 2 * (32 // (step or bt)) * warps
    return bt, bc, warps, cpt, step, pairs


def _pairs_fit(x: torch.Tensor) -> bool:
    """Whether the channel-major tile can read x as 4-byte words of two channels
    (``_load_pairs``): 2-byte elements, an even number of channels, an even row
    stride and an even element offset, so every word is two channels of one token, and a
    4-byte aligned address: checked on a real tensor; a fake one (a site traced for
    splicing) has none, and there the storage is an aligned allocation (Inductor's buffers,
    and graph inputs, which its wrapper copies when misaligned). A symbolic offset or stride
    (dynamic shapes) is not proved even: the tile keeps 2-channel vector loads."""
    if x.element_size() != 2:
        return False
    dims = (x.shape[1], x.stride(0), x.storage_offset())
    if not all(isinstance(d, int) and d % 2 == 0 for d in dims):
        return False
    return is_fake(x) or x.data_ptr() % 4 == 0


def row_stride(x: torch.Tensor, pairs: bool) -> int:
    """x's row stride as the kernel's constexpr ``ROW_STRIDE`` (0: a run-time argument).

    Why: the word-pair tile reads each block's 16 rows as its first row's address plus k
    strides. With the stride a run-time value, sm_90 code adds it in 64 bits before every
    load (2 instructions a 4-byte word); known at compile time, the 16 loads take it as
    immediate offsets from one address. That is one kernel compiled per row width (a
    model has a few), so only the word-pair tile, which every site's bf16 g and x takes,
    gets it, and a symbolic stride (dynamic shapes) stays a run-time argument."""
    stride = x.stride(0)
    return stride if pairs and isinstance(stride, int) and stride > 0 else 0


def _stepped_blocks(bt: int, rp: int) -> tuple[int, int]:
    """(BT, STEP) of g's stochastic e4m3 operand: ``bt`` token blocks a program
    (``_tile_shape``'s: a 32-byte run per channel), in one step (STEP 0) unless tuned.

    Why one step: at rank 16, 4 blocks in 2-block steps of a loop (the 2-block tile's
    registers, 167) ran 6-8% faster than 2 blocks on the H100
    (``hla_step_2026-11-26T1931_h100``, ``..T1933_h100_r16``), but since the channel uniforms are joined in the load's registers
    (forty-second stop) the 2-block tile alone is 0.3-4% faster on the H200 at Llama's and
    ViT's widths, in two runs (``kernel_ab_2026-11-30T003909_h200_s42``, ``..T004957``:
    0.0506 vs 0.0522, 0.1235 vs 0.1240, 0.0580 vs 0.0584 ms). 4 blocks in one step need
    235-255 registers and are slower (0.076 ms); 1-block steps (96 registers) store 16-byte
    half-sector runs and were 60% slower (H100). At rank 8 the 4-block tile is one step
    already. ``HOT_HLA_STEP="BT,STEP"`` sets both (tuning: ``bench/hla_tile_sweep.py``);
    ``HOT_HLA_BT`` the blocks of one step. The levels do not depend on the tile (Philox
    counters follow the element)."""
    if "HOT_HLA_STEP" in os.environ:
        total, step = (int(v) for v in os.environ["HOT_HLA_STEP"].split(","))
        per_counter = max(1, ref.UNIFORMS_PER_COUNTER // rp)
        if total % step or step % per_counter:
            raise ValueError(f"HOT_HLA_STEP={total},{step}: STEP must divide BT and be a "
                             f"multiple of {per_counter} at this rank")
        return total, step
    return bt, 0


def _blocks_are_row_runs(S: int, stride_b: int, stride_s: int) -> bool:
    """Whether block b's tokens are rows 16 b .. 16 b + 15 (``_load_project``'s ``FLAT``),
    for a ``token_layout``: one token axis (stride_b 0), or sequences whose positions are
    consecutive rows (stride_s 1: batch-first, or a single sequence-first one) and whose
    length is a multiple of 16, so no block is padded."""
    return stride_b == 0 or (stride_s == 1 and S % 16 == 0)


def token_layout(L: int, seq_len: int = 0, seq_first: bool = False):
    """(S, blocks per sequence, row stride of a sequence, row stride of a position, blocks)
    for the kernels; ``seq_len == 0``: one flat token axis."""
    if seq_len in (0, None):
        return L, -(-L // 16), 0, 1, -(-L // 16)
    if L % seq_len:
        raise ValueError(f"{L} rows are not a whole number of sequences of {seq_len}")
    b, n_sblk = L // seq_len, -(-seq_len // 16)
    strides = (1, b) if seq_first else (seq_len, 1)
    return seq_len, n_sblk, strides[0], strides[1], b * n_sblk


def hla_quant(x: torch.Tensor, rank: int, select: str, bits: int, *, stochastic: bool, seed=0,
              transposed: bool = False, pad_to: int = 1, seq_len: int = 0,
              seq_first: bool = False, seed_add: int = 0, e4m3: bool = False,
              scale_mul: float = 1.0, amax: torch.Tensor | None = None):
    """Project x (L, C) along its tokens onto ``rank`` kept rows per block of 16
    neighbouring tokens of one sequence (``reference.sequence_blocks``) and quantize.

    ``seed_add`` is added to the seed on the device (another Philox key from the same seed
    tensor: no launch to compute seed + k). Returns (levels, fp32 0-d scale): int8 levels,
    or with ``e4m3`` scaled FP8 (``reference.quantize_e4m3``, ``bits`` unused); the scale
    is multiplied by ``scale_mul`` (a power of two: a GEMM's constant factor rides on it).
    Levels are (L', C) row-major, or with ``transposed`` a (C, L'_pad) buffer
    (L'_pad = L' rounded up to ``pad_to``) holding the transpose; its columns past L'
    are left unwritten (consumers must mask them), except in e4m3, where they are zeroed:
    the cuBLAS GEMM reads all L'_pad columns. ``amax``, int8 levels: a zeroed (1,) int32
    workspace the caller made with others in one launch (default: its own); the saved x's
    e4m3 levels: max |x| as ``input_amax_bits`` gives it (default: computed here; in a
    site a reduction fused into x's producer gives it). e4m3 levels run
    phase 2 alone, their scale from a bound: the saved x (nearest rounding) from max |x| /
    28; g (stochastic) from ``token_block_bound`` / 448, ``amax`` holding it when the
    caller has it (``token_block_bound_bits`` from the HQ kernel's row maxima), else a torch
    reduction here.
    """
    if x.stride(-1) != 1:
        x = x.contiguous()
    L, C = x.shape
    S, n_sblk, stride_b, stride_s, n_blk = token_layout(L, seq_len, seq_first)
    rows_out = n_blk * rank
    dev = x.device
    dtype = torch.float8_e4m3fn if e4m3 else torch.int8
    if transposed:
        ldq = -(-rows_out // pad_to) * pad_to
        q = torch.empty((C, ldq), dtype=dtype, device=dev)
        if e4m3 and ldq > rows_out:
            q.narrow(1, rows_out, ldq - rows_out).zero_()
    else:
        ldq = C
        q = torch.empty((rows_out, C), dtype=dtype, device=dev)
    s = scalar_buffer(dev)
    # e4m3: one launch, the scale from a bound: the saved x (nearest rounding) from max |x|
    # (reference.abc_compress), g (stochastic) from its token blocks' row maxima
    # (reference.token_block_bound)
    bound = e4m3 and not stochastic
    if bound and amax is None:
        amax = input_amax_bits(x)
    elif e4m3 and amax is None:
        amax = token_block_bound_bits(x, seq_len, seq_first)
    elif amax is None:
        amax = torch.zeros((1,), dtype=torch.int32, device=dev)
    rp = _pow2_at_least(rank)
    bt, bc, warps, cpt, step, pairs = tile_plan(C, rp, stochastic=stochastic, e4m3=e4m3,
                                                transposed=transposed, pairs_fit=_pairs_fit(x))
    channel_major = _channel_major(stochastic, e4m3, transposed)
    n_tiles = triton.cdiv(n_blk, bt) * triton.cdiv(C, bc)
    grid = (n_tiles,)
    if e4m3:    # phase 2 alone: a program may take several tiles (``_phase2_tiles``)
        grid = (triton.cdiv(n_tiles, tiles_per_program(n_tiles, dev, stochastic)),)
    meta = dict(BT=bt, BC=bc, RP=rp, RANK=rank, KEPT=_packed_rows(rank, select),
                Q=(int(ref.E4M3_BOUND_Q) if bound else 448) if e4m3 else 2 ** (bits - 1) - 1,
                STOCHASTIC=stochastic, BOUND=bound,
                TRANSPOSED=transposed, INTERPRET=interpreting(), E4M3=e4m3, CPT=cpt,
                FLAT=_blocks_are_row_runs(S, stride_b, stride_s), EVEN_C=C % bc == 0,
                STEP=step, PAIRS=pairs, ROW_STRIDE=row_stride(x, pairs), num_warps=warps)
    groups = ref.philox_counters(n_blk * rp if channel_major else C)   # per row of uniforms
    seed_t = seed_pointer(seed, dev) if stochastic else amax    # amax: an unread placeholder
    args = (x, q, s, amax, seed_t, int(seed_add), float(scale_mul), S, n_sblk, stride_b,
            stride_s, C, x.stride(0), ldq, n_blk, groups)
    if not e4m3:
        launch(_hla_kernel, grid, *args, PHASE=1, **meta)
    launch(_hla_kernel, grid, *args, PHASE=2, **meta)
    return q, s
