"""Block Hadamard transform (n = 16) along the contiguous axis, fused with quantization.

Why one kernel: the transform is four add/sub stages per element and the quantizer a
handful more, so the pass is bound by memory traffic, not arithmetic. Running them as
separate torch ops would read and write the tensor once per op; fused, the bf16 input
is read and the int8 levels are written once (per-token scales), or the input is read
twice (per-tensor scales, which need a global max before the first level is known).

Numerics are the contract of ``reference.py``, bit for bit:

* ``fwht16``: Sylvester ``H_16`` by the butterfly ``(a, b) -> (a + b, a - b)`` on index
  bits 0, 1, 2, 3 in that order, in fp32, exactly the additions ``reference.block_fwht``
  performs (so the transformed values are identical, not merely close).
* ``philox_uniform8``: one ``tl.randint4x`` call (``reference.PHILOX_ROUNDS`` rounds)
  per 16 elements with the counter and byte map of ``reference.uniform8``.
* ``quantize``: ``clamp(floor(t + u), -Q, Q)``, t = v over its scale as
  ``reference.scaled`` defines it (``scaled_quotient``), NaN mapped to level 0, as
  ``reference.quantize`` does.

The building blocks (``fwht16_lastdim``, ``philox_uniform8``, ``quantize``, ...) are
shared with ``hla.py``, which applies the same transform along the token axis.
"""
from __future__ import annotations

import math
import os
from typing import Optional

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

from .fp8_forward import AMAX_FLOOR, E4M3_MAX
from .launch import declare_writes, launch
from .reference import (E4M3_BOUND_Q, FOLD, FOLD_MIN_RECIPROCAL, GRAD_E4M3_FLOOR, PHILOX_ROUNDS,
                        philox_counters)

_ROUNDS = tl.constexpr(PHILOX_ROUNDS)
E4M3_AMAX_FLOOR = tl.constexpr(AMAX_FLOOR)
E4M3_INV_MAX = tl.constexpr(1.0 / E4M3_MAX)
# reference.GRAD_E4M3_FLOOR's fp32 bits (a power of two: its exponent field alone)
_GRAD_E4M3_FLOOR_BITS = tl.constexpr((127 + math.frexp(GRAD_E4M3_FLOOR)[1] - 1) << 23)
# the stochastic e4m3 step works on t * 2**-120 (``stochastic_e4m3``); a reciprocal of at
# least 2**-6 times 2**-120 is still a normal fp32, so exact (``folded_quotient``)
_FOLD = tl.constexpr(FOLD)
_UNFOLD = tl.constexpr(2.0 ** 120)
_FOLDED_E4M3_MAX = tl.constexpr(E4M3_MAX * FOLD)
_FOLD_MIN_RECIPROCAL = tl.constexpr(FOLD_MIN_RECIPROCAL)

# =========================================================================== building blocks

# byte K (0 .. 3) of a word as the float bits 0x4B0000bb (``_byte_float_bits``). prmt.b32
# d, a, b, sel: nibble i of sel picks byte i of d from bytes 0-3 of a, 4-7 of b. The
# constant is a, the word b, so d = (b.byte K = 4 + K, a.byte 0 = 0, 0, a.byte 3 = 0x4B):
# with the constant as b, ptxas folds it into the instruction's immediate and loads each
# selector into a register instead (a move a use: more instructions than the masks saved)
_PRMT_BYTE = tl.constexpr(tuple("{ .reg .b32 c; mov.b32 c, 0x4B000000; "
                                 f"prmt.b32 $0, c, $1, 0x300{4 + k}; }}" for k in range(4)))
# byte K of a word as the word 0x0000bb80 (``_byte_increment``): d = (a.byte 0 = 0x80, b.byte
# K = 4 + K, a.byte 1 = 0, a.byte 1 = 0), the constant again prmt's first source
_PRMT_INCREMENT = tl.constexpr(tuple("{ .reg .b32 c; mov.b32 c, 0x00000080; "
                                      f"prmt.b32 $0, c, $1, 0x11{4 + k}0; }}" for k in range(4)))
# held chunks from which the per-token kernel builds its uniforms by ``prmt``: 3 and 6 held
# chunks (ViT's 3072, Llama's 11008) were level or 2-3% faster with it, one chunk (4096)
# 13% slower (H200, forty-ninth stop: kernel_ab_2026-11-30T230644 and ..T233032)
_PERMUTE_CHUNKS = tl.constexpr(3)


@triton.jit
def _butterfly_rotate(x):
    """One FWHT stage on a (M, 16) tile, then a rotation of the four index bits.

    ``split`` only separates the last axis, so every stage butterflies the *lowest*
    index bit: element pairs (2i, 2i+1) become (a + b, a - b). Writing the sums to
    the first half and the differences to the second half (join, then transpose the
    (8, 2) view to (2, 8)) rotates the index bits right by one. After four stages each
    original bit has been butterflied once, in the order 0, 1, 2, 3 like the reference,
    and the bits are back in their natural positions: the output is in Sylvester order.
    All of it is register renaming when a thread owns its 16-element runs.
    """
    M: tl.constexpr = x.shape[0]
    a, b = tl.split(tl.reshape(x, (M, 8, 2)))
    return tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 2, 1)), (M, 16))


@triton.jit
def fwht16(x):
    """H_16 on each row of a (M, 16) fp32 tile."""
    return _butterfly_rotate(_butterfly_rotate(_butterfly_rotate(_butterfly_rotate(x))))


@triton.jit
def fwht16_lastdim(x):
    """H_16 on each run of 16 consecutive elements along the last axis of a (R, C) tile."""
    R: tl.constexpr = x.shape[0]
    C: tl.constexpr = x.shape[1]
    return tl.reshape(fwht16(tl.reshape(x, (R * C // 16, 16))), (R, C))


@triton.jit
def abs_bits(x):
    """|x| as int32 bits: integer order equals float order for |x|, and NaN ranks above +inf,
    so an integer max propagates NaN (a float max would silently drop it)."""
    return x.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def input_max_bits(amax_bits, DTYPE: tl.constexpr):
    """A max |x| word (``input_amax_bits``) rounded to the element type DTYPE the kernel
    reads x as: the max of the values it reads. Why: when Inductor fuses that reduction
    with x's producer (W's: autocast's cast of the fp32 parameter), it may take the max of
    the values before their rounding to bf16 / fp16 (it elides the intermediate cast), and
    rounding is monotone, so rounding the max gives the max of the rounded values either
    way (NaN and inf stay)."""
    if DTYPE == tl.bfloat16:
        m = round_to_bf16(amax_bits.to(tl.float32, bitcast=True))
        return m.to(tl.int32, bitcast=True)
    elif DTYPE == tl.float16:
        m = amax_bits.to(tl.float32, bitcast=True).to(tl.float16).to(tl.float32)
        return m.to(tl.int32, bitcast=True)
    else:
        return amax_bits


@triton.jit
def scale_from_amax_bits(amax_bits, Q: tl.constexpr):
    """s = amax / Q (IEEE division, like the reference), 1 where amax == 0; NaN/inf stay."""
    amax = amax_bits.to(tl.float32, bitcast=True)
    return tl.where(amax == 0.0, 1.0, tl.math.div_rn(amax, Q * 1.0))


@triton.jit
def _byte_float_bits(w, K: tl.constexpr, PERMUTE: tl.constexpr):
    """Byte K (0 = lowest bits) of a Philox word as the low mantissa byte of 2**23: the
    float's bits are 0x4B0000bb, its value 2**23 + b exactly (no int->float conversion).

    ``PERMUTE`` (GPU only: inline PTX): one ``prmt`` picks the bytes (b, 0, 0, 0x4B) from
    the word and the constant 0x4B000000 (``_PRMT_BYTE``). Written as a shift, a mask and
    an or, ptxas gives two instructions for three of the four bytes (``PRMT`` or ``LOP3``
    to isolate, ``LOP3`` to or). Where it pays is measured, per tile: g's HLA operand,
    0.75 instructions an element fewer, 3-4% faster (H200, forty-ninth stop); the
    per-token HQ tile at 4096 wide took 80 registers instead of 64 with it and ran 13%
    slower, so row-major tiles (``philox_uniform8``) keep the arithmetic."""
    if PERMUTE:
        return tl.inline_asm_elementwise(_PRMT_BYTE[K], "=r,r", [w], dtype=tl.uint32,
                                         is_pure=True, pack=1)
    else:
        if K == 0:
            b = w & 0xFF
        else:
            b = (w >> (8 * K)) & 0xFF
        return b | 0x4B000000


@triton.jit
def _byte_increment(w, K: tl.constexpr, PERMUTE: tl.constexpr):
    """Byte K of a Philox word as the stochastic e4m3 step's increment (b << 12) | 0x800, the
    uniform (b + 0.5) / 256 in units of 2**-20 of a binade's e4m3 spacing
    (``stochastic_e4m3``). ``PERMUTE``: one ``prmt`` gives 0x0000bb80 (``_PRMT_INCREMENT``),
    whose shift by 4 ptxas folds into the add that uses it (``LEA``)."""
    if PERMUTE:
        d = tl.inline_asm_elementwise(_PRMT_INCREMENT[K], "=r,r", [w], dtype=tl.uint32,
                                      is_pure=True, pack=1)
        return d << 4
    else:
        if K == 0:
            b = w & 0xFF
        else:
            b = (w >> (8 * K)) & 0xFF
        return (b << 12) | 0x800


@triton.jit
def _byte_word(w, K: tl.constexpr, PERMUTE: tl.constexpr, INCREMENTS: tl.constexpr):
    if INCREMENTS:
        return _byte_increment(w, K, PERMUTE)
    else:
        return _byte_float_bits(w, K, PERMUTE)


@triton.jit
def _words_in_order(w0, w1, w2, w3, K: tl.constexpr, PERMUTE: tl.constexpr,
                    INCREMENTS: tl.constexpr = False):
    """Byte K of the four words, joined so that the flattened trailing axes list the words
    in order (join adds the *last* axis: [..., word // 2, word % 2])."""
    return tl.join(tl.join(_byte_word(w0, K, PERMUTE, INCREMENTS),
                           _byte_word(w2, K, PERMUTE, INCREMENTS)),
                   tl.join(_byte_word(w1, K, PERMUTE, INCREMENTS),
                           _byte_word(w3, K, PERMUTE, INCREMENTS)))


@triton.jit
def philox_uniform8(seed, rows, col0, groups_per_row, BC: tl.constexpr,
                    PERMUTE: tl.constexpr = False, INCREMENTS: tl.constexpr = False):
    """Uniforms u = (u8 + 0.5) / 256 for elements (rows[i], col0 + j), j < BC, of a tensor
    whose rows hold ``groups_per_row`` = ceil(C / 16) Philox counters (reference.uniform8).

    Element (r, c) uses counter r * groups_per_row + c // 16, word (c % 16) // 4, byte c % 4:
    build the (BR, BC/16, word (2 x 2), byte (2 x 2)) tensor by joins and flatten it. col0
    must be a multiple of 16 and BC of 16. Each byte becomes the float 2**23 + b (its bits
    0x4B0000bb, built by a byte permute or mask, ``_byte_float_bits``), and one FMA gives
    (2**23 + b) / 256 - (2**15 - 2**-9) = (b + 0.5) / 256 exactly (the product is a power-of-
    two scaling, the constant has 24 significant bits, the result 9): sm_90 code compiled for
    Llama's kernels, 1.25-1.4 instructions per element fewer than 1 + b/256 - (1 - 2**-9)
    built by a shift, a mask-and-or and an add (forty-second stop).

    (A Philox round written with 64-bit products saves two IMADs per round, but 64-bit
    values stop Triton from moving the join layouts back onto the counter, and the
    shared-memory layout conversions that result cost more than the IMADs saved.)

    ``INCREMENTS``: the same draws as the stochastic e4m3 step's int32 increments
    (``_byte_increment``) instead of floats.
    """
    BR: tl.constexpr = rows.shape[0]
    groups = col0 // 16 + tl.arange(0, BC // 16)
    counter = (rows.to(tl.int64)[:, None] * groups_per_row + groups[None, :]).to(tl.uint32)
    return tl.reshape(counter_uniforms(seed, counter, PERMUTE, INCREMENTS), (BR, BC))


@triton.jit
def counter_uniforms(seed, counter, PERMUTE: tl.constexpr, INCREMENTS: tl.constexpr = False):
    """The 16 uniforms of each Philox counter of a uint32 tensor, as trailing axes
    (2, 2, 2, 2) that flatten to element 4 * word + byte (``reference.uniform8``);
    ``PERMUTE``: bytes picked by ``prmt`` (``_byte_float_bits``; GPU only). ``INCREMENTS``:
    each as the stochastic e4m3 step's int32 increment (``_byte_increment``), not a float."""
    w0, w1, w2, w3 = tl.randint4x(seed, counter, _ROUNDS)   # 32-bit counter: high word 0
    b0 = _words_in_order(w0, w1, w2, w3, 0, PERMUTE, INCREMENTS)
    b1 = _words_in_order(w0, w1, w2, w3, 1, PERMUTE, INCREMENTS)
    b2 = _words_in_order(w0, w1, w2, w3, 2, PERMUTE, INCREMENTS)
    b3 = _words_in_order(w0, w1, w2, w3, 3, PERMUTE, INCREMENTS)
    bits = tl.join(tl.join(b0, b2), tl.join(b1, b3))   # [.., 4 w + b]
    if INCREMENTS:
        return bits.to(tl.int32, bitcast=True)
    else:
        # (2**23 + b) / 256 - (2**15 - 2**-9) = (b + 0.5) / 256: both steps exact, one FMA
        return tl.math.fma(bits.to(tl.float32, bitcast=True), 0.00390625, -32767.998046875)


@triton.jit
def mul_rn(a, b):
    """a * b rounded once to fp32 (PTX ``mul.rn.f32``). Why not ``a * b``: Triton contracts a
    product and the sum that follows it into one FMA (one rounding instead of two), so
    ``floor(v * r + u)`` would not be the twin's two roundings. ``.rn`` forbids the
    contraction; libdevice's ``mul_rn`` would also flush subnormals (``.ftz``). GPU only:
    the interpreter runs numpy, which never contracts (``scaled_quotient``)."""
    return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b],
                                     dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def scaled_quotient(v, s, inv_s, IEEE_DIV, INTERPRET: tl.constexpr):
    """v over its scale s, as ``reference.scaled`` defines it: v * r rounded once, r = 1 / s
    correctly rounded (``inv_s``: ``div_rn``), where r is finite and non-zero, and the IEEE
    quotient v / s where it is not (s under ~2.9e-39, where r overflows; an inf or NaN s).

    One multiply an element. Until the forty-eighth stop the contract was v / s correctly
    rounded, computed as v * r plus one Markstein correction (two more FMAs an element,
    in kernels bound by instruction issue). The two differ by at most one fp32 ulp of t:
    a stochastic level moves only where t + u sits within that ulp of an integer (0 to
    6e-7 of levels measured), a nearest one also where the exact quotient is an e4m3 tie
    (up to 3.4e-4 on bf16 inputs with a power-of-two maximum), one step each, far below
    the rounding's own noise; -0 stays -0 (-0 * r).

    ``IEEE_DIV``: some scale of the program has no usable reciprocal (``ieee_quotients``,
    a run-time flag or a constexpr); each element then picks by its own scale's, so the
    levels do not depend on which rows share a program. Why not a select between the two
    quotients: both would be live at once, and this branch, however rare, sets the whole
    kernel's registers (the int8 HLA tile, at 255, spilled 712 bytes a thread instead of
    176 and ran 26% slower at 11008 channels; the per-token HQ tile took 91 registers
    instead of 72: kernel_ab_2026-11-30T200050, offline sm_90a). So a program of one scale
    (a 0-d ``inv_s``) divides (that scale is the one without a reciprocal), and per-row
    scales take one path, (v * r') / s' with r' = r, s' = 1 where r is usable and r' = 1,
    s' = s where it is not: each exact where it is the identity."""
    if INTERPRET:
        t = tl.where((inv_s < float("inf")) & (inv_s > 0.0), v * inv_s, tl.math.div_rn(v, s))
    else:
        if IEEE_DIV:
            if len(inv_s.shape) == 0:      # one scale, and it has no usable reciprocal
                t = tl.math.div_rn(v, s)
            else:   # per scale: (v * r) / 1 where r is usable, (v * 1) / s where it is not
                ok = (inv_s < float("inf")) & (inv_s > 0.0)
                t = tl.math.div_rn(mul_rn(v, tl.where(ok, inv_s, 1.0)), tl.where(ok, 1.0, s))
        else:
            t = mul_rn(v, inv_s)
    return t


@triton.jit
def quantize(v, s, inv_s, u, Q: tl.constexpr, IEEE_DIV, AS_INT: tl.constexpr,
             INTERPRET: tl.constexpr = False):
    """Levels clamp(floor(t + u), -Q, Q) with NaN -> 0, t = v over s (``scaled_quotient``), as
    int32 (AS_INT) or fp32. ``IEEE_DIV``: a constexpr, or a run-time flag
    (``ieee_quotients``): then both paths are compiled as one branch around the quotient
    alone, not two copies of the caller. Integer levels come from ``cvt.rmi`` (floor and
    convert in one instruction).

    The clamp is a no-op for Q < 64 on the reciprocal's path: |v| <= amax = Q * s up to two
    roundings of 2**-24, r = 1 / s and the product one more each, so |t| <= Q (1 + 2**-22),
    and u lies in [2**-9, 1 - 2**-9] (or is 0.5), hence -Q <= floor(t + u) <= Q whenever
    Q * 2**-22 < 2**-9. It is skipped there (two instructions per element); 8-bit levels
    (Q = 127) keep it.

    The IEEE path clamps before adding u: its scales are subnormal (or 0), too coarse for
    that bound (an fp32 row [10 * 2**-149, 0, ..] has s = 2**-149 at 4 bits, v / s = 10).
    NaN: the IEEE path selects 0 for a NaN quotient. The reciprocal's path has none to
    select: callers take it only where ``reciprocal_is_finite`` holds, so s is finite and
    non-zero, every |v| <= Q * s is finite, and so is every quotient. That is what lets the
    float levels (not AS_INT: e4m3 operands) be one floor (``frnd``) instead of
    ``cvt.rmi`` to int32 and back to fp32 (one instruction per element fewer; sm_90 code
    of the per-token kernel, forty-second stop).
    """
    if IEEE_DIV:
        # clamped here: a subnormal s (this path's reason) has lost the precision the bound
        # below rests on, and a zero one gives inf; NaN -> level 0 (floor(0 + u) = 0, u < 1);
        # clamp(floor(t + u)) = floor(clamp(t) + u) for integer bounds and u in [0, 1)
        t = scaled_quotient(v, s, inv_s, True, INTERPRET)
        t = tl.where(t == t, tl.clamp(t, -Q * 1.0, Q * 1.0), 0.0)
    else:
        t = scaled_quotient(v, s, inv_s, False, INTERPRET)
    t = t + u
    if Q >= 64:
        t = tl.clamp(t, -Q * 1.0, Q * 1.0)
    if AS_INT:
        q = libdevice.float2int_rd(t)
    else:
        q = tl.floor(t)
    return q


@triton.jit
def to_e4m3(v, s, inv_s, IEEE_DIV, INTERPRET: tl.constexpr, inc=0,
            STOCHASTIC: tl.constexpr = False, FINITE: tl.constexpr = False,
            CLAMP: tl.constexpr = True):
    """Scaled FP8 (reference.quantize_e4m3): v over s (``scaled_quotient``) clamped to
    +-448, NaN -> 0, rounded to the nearest e4m3 (ties to even), or with STOCHASTIC to
    one of its two e4m3 neighbours drawn by the int32 increments ``inc``
    (``stochastic_e4m3``).

    On the GPU the nearest conversion is the hardware's ``cvt.rn``. Triton 3.6's
    interpreter rounds wrongly when the mantissa carries into the exponent (31.9 -> 16), so
    there the value is first rounded onto the e4m3 grid in fp32 (exact steps: a power-of-two
    spacing, 2**-9 below the smallest normal 2**-6; rounding to an integer by adding and
    subtracting 1.5 * 2**23, exact in the interpreter's numpy fp32) and the conversion
    has nothing left to round (a negative value that rounds to zero stays -0, as the
    conversion gives; the add-and-subtract alone would give +0). A stochastic result is
    on the grid already.

    ``FINITE``: the caller has proved every quotient
    of the reciprocal's path finite (taken only for a per-tensor scale that is finite and
    non-zero, with |v| <= the amax it came from), so there the NaN -> 0 select is dropped;
    with ``CLAMP`` False, on the GPU, the clamp too (the conversion saturates: one
    instruction an element; ptxas gave the HLA kernel's 2-channel tile 229 registers
    without it instead of 168, so only the word-pair tile takes it). ``IEEE_DIV`` as in ``quantize``."""
    if STOCHASTIC:      # the step's input is t * 2**-120 (``folded_quotient``)
        top = _FOLDED_E4M3_MAX
    else:
        top = 448.0
    if IEEE_DIV:
        t = _e4m3_input(v, s, inv_s, True, INTERPRET, STOCHASTIC)
        t = tl.clamp(t, -top, top, propagate_nan=tl.PropagateNan.ALL)
        t = tl.where(t == t, t, 0.0)
    else:
        t = _e4m3_input(v, s, inv_s, False, INTERPRET, STOCHASTIC)
        if FINITE:
            if CLAMP or INTERPRET:
                t = tl.clamp(t, -top, top)
            # else no clamp: the GPU's conversion (cvt.rn.satfinite) saturates at +-448, and
            # past 448 both roundings give a value at or past it (floor(t / step + u) >= 14
            # steps of 32), so the bytes are the clamped ones (``test_gpu_e4m3_saturates``)
        else:
            t = tl.clamp(t, -top, top, propagate_nan=tl.PropagateNan.ALL)
            t = tl.where(t == t, t, 0.0)
    return e4m3_from_clamped(t, INTERPRET, inc, STOCHASTIC, FOLDED=True)


@triton.jit
def _e4m3_input(v, s, inv_s, IEEE_DIV: tl.constexpr, INTERPRET: tl.constexpr,
                STOCHASTIC: tl.constexpr):
    if STOCHASTIC:
        return folded_quotient(v, s, inv_s, IEEE_DIV, INTERPRET)
    else:
        return scaled_quotient(v, s, inv_s, IEEE_DIV, INTERPRET)


@triton.jit
def folded_quotient(v, s, inv_s, IEEE_DIV, INTERPRET: tl.constexpr):
    """t * 2**-120 for t = v over s, the stochastic e4m3 step's input (``stochastic_e4m3``;
    ``reference.folded_scaled``, bit for bit): v * (r * 2**-120) rounded once, r = 1 / s
    correctly rounded, where r is finite and at least 2**-6 (so r * 2**-120 is a normal
    fp32, exact); (v / s) * 2**-120, the IEEE quotient, where it is not.

    Why: the step used to take t = v * r and multiply it by 2**-120; the constant folded
    into the reciprocal saves that multiply, one instruction of ~17 an element in g's HLA
    operand, which is bound by instruction issue: 0.7-2% faster, bytes unchanged on
    Gaussian g (H200, fifty-third stop, ``kernel_ab_2026-12-01T143553``). The one rounding
    differs from the two only where the product is an fp32 subnormal (|t| < 2**-6),
    rounding t to a multiple of 2**-29 either way. Only scales over 448 * 2**6 (an amax
    past 28672) lose the fast path, and take the IEEE one (``ieee_quotients(FOLDED)``).
    ``IEEE_DIV`` as in ``scaled_quotient``: per-row scales then pick per row, so a row's
    values do not depend on which rows share its program."""
    if INTERPRET:
        ok = (inv_s < float("inf")) & (inv_s >= _FOLD_MIN_RECIPROCAL)
        t = tl.where(ok, v * (inv_s * _FOLD), tl.math.div_rn(v, s) * _FOLD)
    else:
        if IEEE_DIV:
            if len(inv_s.shape) == 0:      # one scale, and it has no usable reciprocal
                t = mul_rn(tl.math.div_rn(v, s), _FOLD)
            else:   # per scale: ((v * r') / 1) * 1 where r' is usable, ((v * 1) / s) * 2**-120
                ok = (inv_s < float("inf")) & (inv_s >= _FOLD_MIN_RECIPROCAL)
                q = tl.math.div_rn(mul_rn(v, tl.where(ok, inv_s * _FOLD, 1.0)),
                                   tl.where(ok, 1.0, s))
                t = mul_rn(q, tl.where(ok, 1.0, _FOLD))
        else:
            t = mul_rn(v, inv_s * _FOLD)
    return t


@triton.jit
def stochastic_e4m3(ts, inc, INTERPRET: tl.constexpr):
    """fp32 t, given as ``ts`` = t * 2**-120 (finite; past +-448 only where a saturating
    conversion follows; ``folded_quotient``), rounded to
    one of its two e4m3 neighbours, the one further from zero with probability equal to |t|'s
    distance from the nearer one in units of their spacing (``reference.stochastic_e4m3``,
    bit for bit): on the bits of t * 2**-120, add ``inc`` = (b << 12) | 0x800 (b a random
    byte: the uniform (b + 0.5) / 256 in units of 2**-20 of the spacing) and clear the 20
    bits below e4m3's mantissa, then scale back by 2**120.

    Why 2**-120: it maps e4m3's smallest normal 2**-6 to fp32's, 2**-126, so e4m3's
    subnormals (a fixed spacing of 2**-9) land on fp32's, whose mantissa bits sit where a
    normal's do: one mask is the floor onto the e4m3 grid in every binade, and a carry out
    of the mantissa is the rounding up into the next binade. Both products are exact but the
    first where t * 2**-120 is subnormal, which rounds t to a multiple of 2**-29 (the spacing
    over 2**20). Four instructions an element here (a shifted add, a mask, a ``mul.rn`` and
    the conversion's half; the 2**-120 rides on the scale's reciprocal, ``folded_quotient``)
    where the float form floor(t / step + u) * step took nine with its uniform (the
    exponent's step and reciprocal, an FMA, a floor, a multiply): g's HLA operand is bound
    by instruction issue (forty-ninth stop). ``mul.rn.f32`` keeps subnormals (libdevice's
    ``mul_rn`` and ``.ftz`` would flush them); the interpreter's numpy keeps them too."""
    bits = (ts.to(tl.int32, bitcast=True) + inc) & -1048576     # 0xFFF00000
    q = bits.to(tl.float32, bitcast=True)
    if INTERPRET:
        return q * _UNFOLD
    else:
        return mul_rn(q, _UNFOLD)


@triton.jit
def e4m3_from_clamped(t, INTERPRET: tl.constexpr, inc=0, STOCHASTIC: tl.constexpr = False,
                      FOLDED: tl.constexpr = False):
    """fp32 ``t`` already within +-448 (NaN allowed) -> e4m3: the nearest (ties to even), or
    with STOCHASTIC a neighbour drawn by the increments ``inc`` (``stochastic_e4m3``; why
    the interpreter rounds onto the grid first: ``to_e4m3``). ``FOLDED``: ``t`` is given
    times 2**-120 (``folded_quotient``), stochastic rounding only."""
    if STOCHASTIC:
        if not FOLDED:
            if INTERPRET:
                t = t * _FOLD
            else:
                t = mul_rn(t, _FOLD)
        t = stochastic_e4m3(t, inc, INTERPRET)
    elif INTERPRET:
        # biased exponent in place, at least 2**-6's (the subnormal step 2**-9 below it)
        ebits = tl.maximum(t.to(tl.int32, bitcast=True) & 0x7F800000, 121 << 23)
        step = (ebits - (3 << 23)).to(tl.float32, bitcast=True)          # 2**(e - 3)
        r = ((t / step + 12582912.0) - 12582912.0) * step   # |t / step| <= 16: RNE via 1.5 * 2**23
        t = tl.where(r == 0.0, t * 0.0, r)    # an underflow keeps its sign, as cvt.rn's -0
    q = t.to(tl.float8e4nv)
    if INTERPRET:       # its conversion turns NaN into 384; the GPU's gives NaN (0x7F)
        q = tl.where(t == t, q, tl.full(t.shape, 0x7F, tl.uint8).to(tl.float8e4nv, bitcast=True))
    return q


@triton.jit
def reciprocal_is_finite(inv_s, FOLDED: tl.constexpr = False):
    """Whether every reciprocal of a program's scales (one, or a tensor of them) is finite and
    non-zero, a scalar condition. The quotient v * r needs it finite, and a scale under
    ~2.9e-39 (1 / FLT_MAX: the maxima of subnormals) has an infinite one; a zero row's scale
    is 1. Non-zero excludes an infinite scale (a row holding an inf), and a NaN fails both
    tests (a max would skip it): where it holds, every quotient is finite (``quantize``).
    ``FOLDED``: at least 2**-6 (``folded_quotient``'s r * 2**-120 exact), not just non-zero."""
    if FOLDED:
        ok = (inv_s < float("inf")) & (inv_s >= _FOLD_MIN_RECIPROCAL)
    else:
        ok = (inv_s < float("inf")) & (inv_s > 0.0)
    return tl.min(ok.to(tl.int32) + tl.zeros((1,), tl.int32)) == 1   # (1,): a scale alone


@triton.jit
def ieee_quotients(inv_s, FOLDED: tl.constexpr = False):
    """The run-time ``IEEE_DIV`` of a program whose scales' reciprocals are ``inv_s``: not
    ``reciprocal_is_finite``. Every kernel takes it from here: a copy of the condition that
    tested only ``inv_s < inf`` sent an inf in g down the reciprocal's path (grad_out's HLA
    half, forty-second stop). Why a flag and not two calls under a branch: each call inlines
    the whole tile loop (loads, transform, Philox, stores), which doubled the kernels'
    code and their compile time (an HLA variant took 2.45 s, H200, fortieth stop), for a
    path only scales under ~2.9e-39 take. ``FOLDED``: for the stochastic e4m3 step, whose
    reciprocal carries 2**-120 (``folded_quotient``: scales over 448 * 2**6 divide too)."""
    return reciprocal_is_finite(inv_s, FOLDED) == 0


@triton.jit
def store_levels(ptrs, q, mask, FP8: tl.constexpr):
    """Store integer levels (int32 from ``quantize``'s ``AS_INT``, or fp32) as int8, or as
    e4m3 (every |level| <= 15 is exact in e4m3). Levels stored as e4m3 come as fp32
    floors (``quantize``: no clamp below 64 levels, no NaN select on the reciprocal's
    path), one conversion fewer than through int32 (the per-token HQ kernel is bound by
    instruction issue: bench/NOTES_kernels.md)."""
    if FP8:
        tl.store(ptrs, q.to(tl.float32).to(tl.float8e4nv), mask=mask)
    else:
        tl.store(ptrs, q.to(tl.int8), mask=mask)


# =========================================================================== activation side


@triton.jit
def _load_rows(g_ptr, rows, col0, L, O, stride_g, BC: tl.constexpr):
    """g[rows, col0:col0+BC] as fp32 (zeros outside L x O: the reference's zero padding
    of O)."""
    cols = col0 + tl.arange(0, BC)
    mask = (rows < L)[:, None] & (cols < O)[None, :]
    x = tl.load(g_ptr + rows.to(tl.int64)[:, None] * stride_g + cols[None, :], mask=mask, other=0.0)
    return x.to(tl.float32)


@triton.jit
def _load_fwht_rows(g_ptr, rows, col0, L, O, stride_g, BC: tl.constexpr):
    """``_load_rows``, each run of 16 columns transformed."""
    return fwht16_lastdim(_load_rows(g_ptr, rows, col0, L, O, stride_g, BC))


@triton.jit
def _quantize_store_rows(q_ptr, v, s, inv_s, seed, rows, col0, L, O_pad, ldq, groups_per_row,
                         BC: tl.constexpr, Q: tl.constexpr, STOCHASTIC: tl.constexpr,
                         FP8: tl.constexpr, INTERPRET: tl.constexpr, IEEE_DIV,
                         PLAIN: tl.constexpr = False, PERMUTE: tl.constexpr = False):
    """Quantize a (BR, BC) tile at (rows, col0) and store it: integer levels, or with
    ``PLAIN`` the scaled e4m3 values themselves (``to_e4m3``). ``PERMUTE``: the uniforms'
    bytes by ``prmt`` (``_byte_float_bits``; GPU only)."""
    if STOCHASTIC:   # e4m3 (PLAIN) rounds by integer increments, levels by float uniforms
        u = philox_uniform8(seed, rows, col0, groups_per_row, BC, PERMUTE, PLAIN)
    else:
        u = 0.5
    cols = col0 + tl.arange(0, BC)
    mask = (rows < L)[:, None] & (cols < O_pad)[None, :]
    ptrs = q_ptr + rows.to(tl.int64)[:, None] * ldq + cols[None, :]
    if PLAIN:
        tl.store(ptrs, to_e4m3(v, s, inv_s, IEEE_DIV or INTERPRET, INTERPRET, u, STOCHASTIC),
                 mask=mask)
    else:
        q = quantize(v, s, inv_s, u, Q, IEEE_DIV or INTERPRET, not (INTERPRET or FP8),
                     INTERPRET)
        store_levels(ptrs, q, mask, FP8)


@triton.jit
def _token_tile(g_ptr, rows, col0, L, O, stride_g, BC: tl.constexpr, PLAIN: tl.constexpr):
    """A (BR, BC) tile of g as the per-token kernel quantizes it: each run of 16 columns
    transformed, or with ``PLAIN`` as read."""
    if PLAIN:
        return _load_rows(g_ptr, rows, col0, L, O, stride_g, BC)
    else:
        return _load_fwht_rows(g_ptr, rows, col0, L, O, stride_g, BC)


@triton.jit
def _token_scale(amax_bits, Q: tl.constexpr, PLAIN: tl.constexpr):
    """A row's scale from its max |value| bits: amax / Q, or with ``PLAIN``
    max(amax, reference.GRAD_E4M3_FLOOR) / 448 (``reference.grad_e4m3_scale``: its
    reciprocal stays finite unless the row holds a NaN; an inf row's is 0, and its
    values come out 0 as the twin's)."""
    if PLAIN:
        return scale_from_amax_bits(tl.maximum(amax_bits, _GRAD_E4M3_FLOOR_BITS), 448)
    else:
        return scale_from_amax_bits(amax_bits, Q)


@triton.jit
def _quantize_row_chunks(g_ptr, q_ptr, s, inv_s, seed, rows, L, O, O_pad, stride_g, ldq,
                         groups_per_row, BC: tl.constexpr, Q: tl.constexpr, FP8: tl.constexpr,
                         INTERPRET: tl.constexpr, IEEE_DIV, PLAIN: tl.constexpr):
    """Second sweep of a row set: re-read, re-transform and quantize each column chunk."""
    for col0 in range(0, O_pad, BC):
        v = _token_tile(g_ptr, rows, col0, L, O, stride_g, BC, PLAIN)
        _quantize_store_rows(q_ptr, v, s, inv_s, seed, rows, col0, L, O_pad, ldq, groups_per_row,
                             BC, Q, True, FP8, INTERPRET, IEEE_DIV, PLAIN)


@triton.jit
def _held_chunk(g_ptr, rows, i: tl.constexpr, L, O, stride_g, xm, vm, BC: tl.constexpr,
                PLAIN: tl.constexpr, ROW_MAX: tl.constexpr):
    """Chunk i (columns i * BC ..) of a row set, read, transformed (unless ``PLAIN``) and
    folded into the elementwise running maxima of |x| (``ROW_MAX``) and |v|."""
    x = _load_rows(g_ptr, rows, i * BC, L, O, stride_g, BC)
    if PLAIN:
        v = x
    else:
        v = fwht16_lastdim(x)
    if i == 0:
        vm = abs_bits(v)
        if ROW_MAX:
            xm = abs_bits(x)
    else:
        vm = tl.maximum(vm, abs_bits(v))
        if ROW_MAX:
            xm = tl.maximum(xm, abs_bits(x))
    return v, xm, vm


@triton.jit
def _hq_token_kernel(g_ptr, q_ptr, s_ptr, seed_ptr, m_ptr, z_ptr, L, O, O_pad, stride_g, ldq,
                     groups_per_row, BR: tl.constexpr, BC: tl.constexpr, CHUNKS: tl.constexpr,
                     Q: tl.constexpr, FP8: tl.constexpr, INTERPRET: tl.constexpr,
                     ROW_MAX: tl.constexpr, PLAIN: tl.constexpr):
    """Per-token (per-row) scales: one program owns BR whole rows.

    ``CHUNKS`` = n (1 to ``HELD_CHUNKS``): a row is n chunks of BC columns, each read and
    transformed once and held in registers until the row's scale is known, then quantized
    from them: one read, one write, one transform (``token_tile``). ``CHUNKS`` = 0, for
    rows too wide to hold: a first sweep over the row's chunks keeps an elementwise running max (reduced
    across lanes once, at the end) and a second sweep, which re-reads the chunks while
    they are still in L1/L2, transforms them again and quantizes them.
    ``ROW_MAX``: also store max |g[row, :]| (fp32, NaN if the row has one) at ``m_ptr``,
    the input of g's HLA bound (``hla.token_block_bound_bits``), and zero the int32 word at
    ``z_ptr``, which the bound's kernel then maxes into: no fill launch of its own.
    ``PLAIN``: no transform and no levels: g itself stochastically rounded to e4m3 at its
    row's scale (``reference.grad_e4m3``, the operand of an FP8 g_x without a Hadamard).
    """
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    seed = tl.load(seed_ptr)
    if ROW_MAX:
        if tl.program_id(0) == 0:
            tl.store(z_ptr, 0)
    if CHUNKS > 0:
        xm = tl.zeros((BR, BC), dtype=tl.int32)
        vm = xm
        held = ()
        for i in tl.static_range(CHUNKS):     # unrolled: each chunk's values stay in registers
            v, xm, vm = _held_chunk(g_ptr, rows, i, L, O, stride_g, xm, vm, BC, PLAIN, ROW_MAX)
            held = held + (v,)
        if ROW_MAX:
            if PLAIN:
                xm = vm
            tl.store(m_ptr + rows, tl.max(xm, axis=1).to(tl.float32, bitcast=True),
                     mask=rows < L)
        s = _token_scale(tl.max(vm, axis=1), Q, PLAIN)
        inv_s = tl.math.div_rn(1.0, s)
        ieee = ieee_quotients(inv_s, PLAIN)
        for i in tl.static_range(CHUNKS):
            _quantize_store_rows(q_ptr, held[i], s[:, None], inv_s[:, None], seed, rows, i * BC,
                                 L, O_pad, ldq, groups_per_row, BC, Q, True, FP8, INTERPRET,
                                 ieee, PLAIN, (CHUNKS >= _PERMUTE_CHUNKS) and not INTERPRET)
    else:
        amax = tl.zeros((BR, BC), dtype=tl.int32)
        xmax = tl.zeros((BR, BC), dtype=tl.int32)
        for col0 in range(0, O_pad, BC):
            x = _load_rows(g_ptr, rows, col0, L, O, stride_g, BC)
            if PLAIN:
                amax = tl.maximum(amax, abs_bits(x))
            else:
                if ROW_MAX:
                    xmax = tl.maximum(xmax, abs_bits(x))
                amax = tl.maximum(amax, abs_bits(fwht16_lastdim(x)))
        if ROW_MAX:
            if PLAIN:
                xmax = amax
            tl.store(m_ptr + rows, tl.max(xmax, axis=1).to(tl.float32, bitcast=True),
                     mask=rows < L)
        s = _token_scale(tl.max(amax, axis=1), Q, PLAIN)
        inv_s = tl.math.div_rn(1.0, s)
        _quantize_row_chunks(g_ptr, q_ptr, s[:, None], inv_s[:, None], seed, rows, L, O, O_pad,
                             stride_g, ldq, groups_per_row, BC, Q, FP8, INTERPRET,
                             ieee_quotients(inv_s, PLAIN), PLAIN)
    tl.store(s_ptr + rows, s, mask=rows < L)


declare_writes(_hq_token_kernel,
               lambda a: ("q_ptr", "s_ptr") + ("m_ptr", "z_ptr") * bool(a["ROW_MAX"]))


@triton.jit
def _tile_rows_col0(t, n_ct, BR: tl.constexpr, BC: tl.constexpr):
    """Rows and first column of tile t in a row-major grid of (BR, BC) tiles, n_ct per row."""
    return (t // n_ct) * BR + tl.arange(0, BR), (t % n_ct) * BC


@triton.jit
def _hq_tensor_kernel(g_ptr, q_ptr, s_ptr, amax_ptr, seed_ptr, L, O, O_pad, stride_g, ldq,
                      groups_per_row, PHASE: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
                      Q: tl.constexpr, FP8: tl.constexpr, INTERPRET: tl.constexpr):
    """Per-tensor scale in two launches, one (BR, BC) tile per program.

    Phase 1 transforms its tile and atomically maxes the tile's amax (int bits) into
    ``amax_ptr`` (zeroed by the caller). Phase 2 turns the global amax into the scale,
    re-reads and re-transforms its tile and quantizes it. Phase 2 walks the tiles in
    *reverse* order: blocks are scheduled roughly by program id, so the tiles phase 1 read
    last (still in L2) are read first. One tile per program, not a persistent loop: the
    block scheduler overlaps the memory latency of many small programs. Measured on H100
    (bf16 g): 43-48% of the copy bandwidth for the minimal bytes, against 42% for a
    persistent grid of 4 programs per SM with per-program partial maxima; reading g twice
    caps it at 60%.
    """
    pid = tl.program_id(0)
    n_ct = tl.cdiv(O_pad, BC)
    if PHASE == 1:
        rows, col0 = _tile_rows_col0(pid, n_ct, BR, BC)
        v = _load_fwht_rows(g_ptr, rows, col0, L, O, stride_g, BC)
        tl.atomic_max(amax_ptr, tl.max(abs_bits(v)))
    else:
        rows, col0 = _tile_rows_col0(tl.num_programs(0) - 1 - pid, n_ct, BR, BC)
        seed = tl.load(seed_ptr)
        s = scale_from_amax_bits(tl.load(amax_ptr), Q)
        inv_s = tl.math.div_rn(1.0, s)
        if pid == 0:
            tl.store(s_ptr, s)
        v = _load_fwht_rows(g_ptr, rows, col0, L, O, stride_g, BC)
        _quantize_store_rows(q_ptr, v, s, inv_s, seed, rows, col0, L, O_pad, ldq,
                             groups_per_row, BC, Q, True, FP8, INTERPRET,
                             ieee_quotients(inv_s))


# =========================================================================== weight side


@triton.jit
def round_to_bf16(x):
    """fp32 -> the nearest bf16 (ties to even), kept in fp32: x.to(torch.bfloat16).float().
    In integer ops because Triton 3.6's interpreter truncates its fp32 -> bf16 cast; NaN
    stays NaN, overflow rounds to inf, as the conversion does."""
    b = x.to(tl.int32, bitcast=True)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536           # -65536: 0xFFFF0000
    return tl.where(x == x, b.to(tl.float32, bitcast=True), x)   # a NaN's payload may carry


@triton.jit
def _load_weight_tile(w_ptr, ins, o0, O, I, stride_wo, stride_wi, BO: tl.constexpr,
                      ROUND: tl.constexpr):
    """W[o0:o0+BO, ins] as an fp32 (BO, BI) tile, rounded to ROUND (a dtype, or None)."""
    o = o0 + tl.arange(0, BO)
    mask = (o < O)[:, None] & (ins < I)[None, :]
    x = tl.load(w_ptr + o.to(tl.int64)[:, None] * stride_wo + ins.to(tl.int64)[None, :] * stride_wi,
                mask=mask, other=0.0)        # (BO, BI): rows of W, vector loads along I
    if ROUND == tl.bfloat16:
        x = round_to_bf16(x.to(tl.float32))
    elif ROUND is not None:
        x = x.to(ROUND)
    return x.to(tl.float32)


@triton.jit
def _store_forward_weight(f_ptr, fs_ptr, fmax_ptr, x, ins, o0, O, I, first,
                          BO: tl.constexpr, ROWWISE: tl.constexpr, INTERPRET: tl.constexpr):
    """The FP8 forward's W operand from the tile x = W[o0:o0+BO, ins] (fp32), bit for bit
    ``fp8_forward.e4m3_cast`` as Inductor compiles it: s = max(amax, 1e-12) * (1 / 448),
    q = e4m3(clamp(x * (1 / s), +-448)), NaN kept, 1 / s correctly rounded
    (``fp8_forward.scale_reciprocal``: Triton's fp32 ``/`` would be the GPU's approximate
    ``div.full``). amax: W's row maxima (ROWWISE; int32 bits at ``fmax_ptr[o]``) or its
    maximum (``fmax_ptr[0]``). q goes to the row-major (O, I) buffer at ``f_ptr``; the
    programs of the first in-feature block (``first``) store s: per row at ``fs_ptr[o]``,
    or the one scale at ``fs_ptr[0]`` from the program that also holds row 0."""
    o = o0 + tl.arange(0, BO)
    if ROWWISE:
        amax = tl.load(fmax_ptr + o, mask=o < O, other=0).to(tl.float32, bitcast=True)
    else:
        amax = tl.load(fmax_ptr).to(tl.float32, bitcast=True)
    s = tl.maximum(amax, E4M3_AMAX_FLOOR, propagate_nan=tl.PropagateNan.ALL) * E4M3_INV_MAX
    inv = tl.math.div_rn(1.0, s)
    if ROWWISE:
        t = x * inv[:, None]
    else:
        t = x * inv
    t = tl.clamp(t, -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL)
    mask = (o < O)[:, None] & (ins < I)[None, :]
    tl.store(f_ptr + o.to(tl.int64)[:, None] * I + ins[None, :], e4m3_from_clamped(t, INTERPRET),
             mask=mask)
    if first:
        if ROWWISE:
            tl.store(fs_ptr + o, s, mask=o < O)
        elif o0 == 0:
            tl.store(fs_ptr, s)


@triton.jit
def _hq_weight_program(pid, w_ptr, q_ptr, s_ptr, amax_ptr, f_ptr, fs_ptr, fmax_ptr, scale_mul, O, I,
                       O_pad, stride_wo, stride_wi, ldq, PHASE: tl.constexpr, BI: tl.constexpr,
                       BO: tl.constexpr, Q: tl.constexpr, FP8: tl.constexpr, E4M3: tl.constexpr,
                       INTERPRET: tl.constexpr, ROUND: tl.constexpr, FWD: tl.constexpr,
                       ROTATE: tl.constexpr):
    """The W side of HQ (reference.hq_weight): q[i, :] = RTN(H along O of W[:, i] / s_i),
    levels (Q = 2**(bits-1) - 1) or, with E4M3, scaled FP8 (Q = 448, ``to_e4m3``).
    The stored scale is s_i * scale_mul (a power of two: exact). FWD (1: tensor-wise,
    2: row-wise; 0: none): the same read of W also writes the FP8 forward's W operand
    (``_store_forward_weight``), so W is read once for both GEMMs that use it. Without
    ROTATE (e4m3 only, Q = 448): W's plain transpose, ``reference.plain_weight_e4m3``.

    Output row i (in-feature i) needs the amax over all of O, and W is small next to g,
    so levels use the two-phase scheme of ``_hq_tensor_kernel`` on a 2-D grid of
    (BI in-features, BO outputs) tiles: phase 1 atomically maxes each row's tile amax into
    ``amax_ptr[i]`` (zeroed), phase 2 quantizes (``_hq_weight_kernel`` walks its tiles in
    reverse order then: W mostly from L2). E4M3 runs phase 2 alone: ``amax_ptr[i]`` holds
    max |W[:, i]| (``input_amax_bits``) and Q = 28 (``reference.e4m3_bound_scale``). ``pid``
    is the program's tile within this weight.
    """
    n_ot = tl.cdiv(O_pad, BO)
    ins = (pid // n_ot) * BI + tl.arange(0, BI)
    o0 = (pid % n_ot) * BO
    x = _load_weight_tile(w_ptr, ins, o0, O, I, stride_wo, stride_wi, BO, ROUND)
    if ROTATE:
        v = fwht16_lastdim(tl.trans(x))         # (BI, BO): transformed along O
    else:
        v = tl.trans(x)
    if FWD != 0 and PHASE == 2:
        _store_forward_weight(f_ptr, fs_ptr, fmax_ptr, x, ins, o0, O, I, pid // n_ot == 0, BO,
                              FWD == 2, INTERPRET)
    if PHASE == 1:
        tl.atomic_max(amax_ptr + ins, tl.max(abs_bits(v), axis=1), mask=ins < I)
    else:
        amax = tl.load(amax_ptr + ins, mask=ins < I, other=0)
        if E4M3:    # W's column max, in the type W is read as (ROUND, else W's own)
            if ROUND is not None:
                amax = input_max_bits(amax, ROUND)
            else:
                amax = input_max_bits(amax, w_ptr.dtype.element_ty)
        s = scale_from_amax_bits(amax, Q)
        inv_s = tl.math.div_rn(1.0, s)
        if E4M3:
            cols = o0 + tl.arange(0, BO)
            mask = (ins < I)[:, None] & (cols < O_pad)[None, :]
            ptrs = q_ptr + ins.to(tl.int64)[:, None] * ldq + cols[None, :]
            if INTERPRET:     # the interpreter's path (``scaled_quotient``) in one copy
                tl.store(ptrs, to_e4m3(v, s[:, None], inv_s[:, None], True, INTERPRET), mask=mask)
            elif reciprocal_is_finite(inv_s):
                tl.store(ptrs, to_e4m3(v, s[:, None], inv_s[:, None], False, INTERPRET), mask=mask)
            else:
                tl.store(ptrs, to_e4m3(v, s[:, None], inv_s[:, None], True, INTERPRET), mask=mask)
        elif reciprocal_is_finite(inv_s):
            _quantize_store_rows(q_ptr, v, s[:, None], inv_s[:, None], 0, ins, o0, I, O_pad, ldq,
                                 0, BO, Q, False, FP8, INTERPRET, False)
        else:
            _quantize_store_rows(q_ptr, v, s[:, None], inv_s[:, None], 0, ins, o0, I, O_pad, ldq,
                                 0, BO, Q, False, FP8, INTERPRET, True)
        if o0 == 0:
            tl.store(s_ptr + ins, s * scale_mul, mask=ins < I)



@triton.jit
def _hq_weight_kernel(w_ptr, q_ptr, s_ptr, amax_ptr, scale_mul, O, I, O_pad, stride_wo,
                      stride_wi, ldq, PHASE: tl.constexpr, BI: tl.constexpr, BO: tl.constexpr,
                      Q: tl.constexpr, FP8: tl.constexpr, E4M3: tl.constexpr,
                      INTERPRET: tl.constexpr, ROUND: tl.constexpr, ROTATE: tl.constexpr):
    """One weight's W operand for a g_x that makes its own (``hq_weight_quant``): levels in
    two phases, or scaled e4m3 in one; phase 2 walks the tiles in reverse (W mostly from L2
    after phase 1)."""
    pid = tl.program_id(0)
    if PHASE == 2:
        pid = tl.num_programs(0) - 1 - pid
    _hq_weight_program(pid, w_ptr, q_ptr, s_ptr, amax_ptr, w_ptr, w_ptr, w_ptr, scale_mul, O, I,
                       O_pad, stride_wo, stride_wi, ldq, PHASE, BI, BO, Q, FP8, E4M3, INTERPRET,
                       ROUND, 0, ROTATE)


declare_writes(_hq_weight_kernel,
               lambda a: ("amax_ptr",) if a["PHASE"] == 1 else ("q_ptr", "s_ptr"))


@triton.jit
def _weight_operands_kernel(w0, q0, s0, a0, f0, fs0, fm0, O0, I0, e0,
                            w1, q1, s1, a1, f1, fs1, fm1, O1, I1, e1,
                            w2, q2, s2, a2, f2, fs2, fm2, O2, I2, e2,
                            w3, q3, s3, a3, f3, fs3, fm3, O3, I3, e3,
                            w4, q4, s4, a4, f4, fs4, fm4, O4, I4, e4,
                            w5, q5, s5, a5, f5, fs5, fm5, O5, I5, e5,
                            w6, q6, s6, a6, f6, fs6, fm6, O6, I6, e6,
                            w7, q7, s7, a7, f7, fs7, fm7, O7, I7, e7,
                            scale_mul, N: tl.constexpr, BI: tl.constexpr, BO: tl.constexpr,
                            Q: tl.constexpr, INTERPRET: tl.constexpr, FWD: tl.constexpr,
                            ROTATE: tl.constexpr):
    """The forward's W operands of up to 8 weight copies (``WEIGHT_SLOTS``) in one launch:
    slot k (k < N) owns programs [e(k-1), e(k)) and runs ``_hq_weight_program``'s scaled
    e4m3 phase on its contiguous (O_k, I_k) copy (q rows padded to O_pad = O_k rounded up
    to 16): HQ's operand (``ROTATE``; else the plain W^T) and, with FWD, the FP8 forward's
    W operand from the same read (``hq_weight_operands``). The slots share a dtype.

    Why slots: a layer's seven weights took seven launches here and seven in the cast
    (issue 11 item 3: at most one HOT kernel per site in the forward). Triton has no array
    of pointers a traced launch can pass (``wrap_triton`` takes tensors), so each weight
    has its own arguments, and a program takes its slot's with scalar selects, slot after
    slot: one copy of the body, which compiles as fast as a one-weight kernel (a body
    inlined per slot took 11.3 s to compile for seven slots against 1.4 s, sm_90 on this
    package's CPU box; Llama d4096's cold first step read 2.16x Inductor's with it, H200).

    Slots past N are compiled out: nothing refers to their arguments (``_slotted`` passes
    slot 0's read-only input there). Not even a call may take them: Inductor's mutation
    analysis reads the TTIR before inlining and counts every tensor passed to a call whose
    result is stored through as written; slot 0's output, repeated in a later slot, then
    came back from the functional kernel node as that slot's untouched clone (wrong
    gradients, thirty-ninth stop)."""
    pid = tl.program_id(0)
    first, O, I, w, q, s, a, f, fs, fm = 0, O0, I0, w0, q0, s0, a0, f0, fs0, fm0
    if N > 1:
        on = pid >= e0
        first, O, I = tl.where(on, e0, first), tl.where(on, O1, O), tl.where(on, I1, I)
        w, q, s = tl.where(on, w1, w), tl.where(on, q1, q), tl.where(on, s1, s)
        a, f = tl.where(on, a1, a), tl.where(on, f1, f)
        fs, fm = tl.where(on, fs1, fs), tl.where(on, fm1, fm)
    if N > 2:
        on = pid >= e1
        first, O, I = tl.where(on, e1, first), tl.where(on, O2, O), tl.where(on, I2, I)
        w, q, s = tl.where(on, w2, w), tl.where(on, q2, q), tl.where(on, s2, s)
        a, f = tl.where(on, a2, a), tl.where(on, f2, f)
        fs, fm = tl.where(on, fs2, fs), tl.where(on, fm2, fm)
    if N > 3:
        on = pid >= e2
        first, O, I = tl.where(on, e2, first), tl.where(on, O3, O), tl.where(on, I3, I)
        w, q, s = tl.where(on, w3, w), tl.where(on, q3, q), tl.where(on, s3, s)
        a, f = tl.where(on, a3, a), tl.where(on, f3, f)
        fs, fm = tl.where(on, fs3, fs), tl.where(on, fm3, fm)
    if N > 4:
        on = pid >= e3
        first, O, I = tl.where(on, e3, first), tl.where(on, O4, O), tl.where(on, I4, I)
        w, q, s = tl.where(on, w4, w), tl.where(on, q4, q), tl.where(on, s4, s)
        a, f = tl.where(on, a4, a), tl.where(on, f4, f)
        fs, fm = tl.where(on, fs4, fs), tl.where(on, fm4, fm)
    if N > 5:
        on = pid >= e4
        first, O, I = tl.where(on, e4, first), tl.where(on, O5, O), tl.where(on, I5, I)
        w, q, s = tl.where(on, w5, w), tl.where(on, q5, q), tl.where(on, s5, s)
        a, f = tl.where(on, a5, a), tl.where(on, f5, f)
        fs, fm = tl.where(on, fs5, fs), tl.where(on, fm5, fm)
    if N > 6:
        on = pid >= e5
        first, O, I = tl.where(on, e5, first), tl.where(on, O6, O), tl.where(on, I6, I)
        w, q, s = tl.where(on, w6, w), tl.where(on, q6, q), tl.where(on, s6, s)
        a, f = tl.where(on, a6, a), tl.where(on, f6, f)
        fs, fm = tl.where(on, fs6, fs), tl.where(on, fm6, fm)
    if N > 7:
        on = pid >= e6
        first, O, I = tl.where(on, e6, first), tl.where(on, O7, O), tl.where(on, I7, I)
        w, q, s = tl.where(on, w7, w), tl.where(on, q7, q), tl.where(on, s7, s)
        a, f = tl.where(on, a7, a), tl.where(on, f7, f)
        fs, fm = tl.where(on, fs7, fs), tl.where(on, fm7, fm)
    O_pad = tl.cdiv(O, 16) * 16
    _hq_weight_program(pid - first, w, q, s, a, f, fs, fm, scale_mul, O, I, O_pad, I, 1, O_pad,
                       2, BI, BO, Q, True, True, INTERPRET, None, FWD, ROTATE)


declare_writes(_weight_operands_kernel, lambda a: tuple(
    f"{role}{k}" for k in range(a["N"]) for role in ("q", "s") + ("f", "fs") * (a["FWD"] != 0)))


@triton.jit
def _cast_program(pid, p_ptr, w_ptr, amax_ptr, rmax_ptr, O, I, stride_po, stride_pi,
                  ROWS: tl.constexpr, BO: tl.constexpr, BI: tl.constexpr,
                  BF16: tl.constexpr, ROW_MAX: tl.constexpr):
    """Autocast's copy of an fp32 parameter (O, I), plus its column maxima: w = p rounded
    to w's type (contiguous), and max |w[:, i]| atomically maxed into ``amax_ptr[i]``
    (zeroed; int32 bits, ``abs_bits``: NaN wins), the e4m3 W kernel's scale input. With
    ROW_MAX, max |w[o, :]| into ``rmax_ptr[o]`` the same way: the row-wise FP8 forward's
    W scale (``kernels/fp8_forward.py``), so its cast is one pointwise read of the copy. A
    program walks ROWS rows of BI columns, BO rows at a time, and maxes its columns once.

    Why one kernel: the copy is written anyway (the forward GEMM reads it), and Inductor
    fuses a column max into that cast only when the weight has enough columns not to split
    the reduction (bench/colmax_fusion.py); otherwise the max was a whole extra read of W."""
    n_it = tl.cdiv(I, BI)
    r0 = (pid // n_it) * ROWS
    ins = (pid % n_it) * BI + tl.arange(0, BI)
    m = tl.zeros((BI,), dtype=tl.int32)
    for o0 in range(r0, r0 + ROWS, BO):
        o = o0 + tl.arange(0, BO)
        mask = (o < O)[:, None] & (ins < I)[None, :]
        x = tl.load(p_ptr + o.to(tl.int64)[:, None] * stride_po
                    + ins.to(tl.int64)[None, :] * stride_pi, mask=mask, other=0.0)
        if BF16:    # in integer ops: the interpreter truncates its own fp32 -> bf16 cast
            y = round_to_bf16(x)
        else:
            y = x.to(w_ptr.dtype.element_ty).to(tl.float32)
        tl.store(w_ptr + o.to(tl.int64)[:, None] * I + ins[None, :],
                 y.to(w_ptr.dtype.element_ty), mask=mask)
        bits = abs_bits(y)
        m = tl.maximum(m, tl.max(bits, axis=0))
        if ROW_MAX:
            tl.atomic_max(rmax_ptr + o, tl.max(bits, axis=1), mask=o < O)
    tl.atomic_max(amax_ptr + ins, m, mask=ins < I)


@triton.jit
def _weight_cast_kernel(p0, w0, c0, r0, O0, I0, sp0, si0, e0,
                        p1, w1, c1, r1, O1, I1, sp1, si1, e1,
                        p2, w2, c2, r2, O2, I2, sp2, si2, e2,
                        p3, w3, c3, r3, O3, I3, sp3, si3, e3,
                        p4, w4, c4, r4, O4, I4, sp4, si4, e4,
                        p5, w5, c5, r5, O5, I5, sp5, si5, e5,
                        p6, w6, c6, r6, O6, I6, sp6, si6, e6,
                        p7, w7, c7, r7, O7, I7, sp7, si7, e7,
                        N: tl.constexpr, ROWS: tl.constexpr, BO: tl.constexpr,
                        BI: tl.constexpr, BF16: tl.constexpr, ROW_MAX: tl.constexpr):
    """Autocast's copies of up to 8 fp32 parameters (``WEIGHT_SLOTS``) and their maxima in
    one launch: slot k (k < N) owns programs [e(k-1), e(k)) and runs ``_cast_program`` on
    its parameter (p, its copy w, column maxima c, row maxima r, shape, strides). Why slots,
    taken by selects, and why nothing refers to those past N: ``_weight_operands_kernel``."""
    pid = tl.program_id(0)
    first, O, I, sp, si, p, w, c, r = 0, O0, I0, sp0, si0, p0, w0, c0, r0
    if N > 1:
        on = pid >= e0
        first, O, I = tl.where(on, e0, first), tl.where(on, O1, O), tl.where(on, I1, I)
        sp, si = tl.where(on, sp1, sp), tl.where(on, si1, si)
        p, w = tl.where(on, p1, p), tl.where(on, w1, w)
        c, r = tl.where(on, c1, c), tl.where(on, r1, r)
    if N > 2:
        on = pid >= e1
        first, O, I = tl.where(on, e1, first), tl.where(on, O2, O), tl.where(on, I2, I)
        sp, si = tl.where(on, sp2, sp), tl.where(on, si2, si)
        p, w = tl.where(on, p2, p), tl.where(on, w2, w)
        c, r = tl.where(on, c2, c), tl.where(on, r2, r)
    if N > 3:
        on = pid >= e2
        first, O, I = tl.where(on, e2, first), tl.where(on, O3, O), tl.where(on, I3, I)
        sp, si = tl.where(on, sp3, sp), tl.where(on, si3, si)
        p, w = tl.where(on, p3, p), tl.where(on, w3, w)
        c, r = tl.where(on, c3, c), tl.where(on, r3, r)
    if N > 4:
        on = pid >= e3
        first, O, I = tl.where(on, e3, first), tl.where(on, O4, O), tl.where(on, I4, I)
        sp, si = tl.where(on, sp4, sp), tl.where(on, si4, si)
        p, w = tl.where(on, p4, p), tl.where(on, w4, w)
        c, r = tl.where(on, c4, c), tl.where(on, r4, r)
    if N > 5:
        on = pid >= e4
        first, O, I = tl.where(on, e4, first), tl.where(on, O5, O), tl.where(on, I5, I)
        sp, si = tl.where(on, sp5, sp), tl.where(on, si5, si)
        p, w = tl.where(on, p5, p), tl.where(on, w5, w)
        c, r = tl.where(on, c5, c), tl.where(on, r5, r)
    if N > 6:
        on = pid >= e5
        first, O, I = tl.where(on, e5, first), tl.where(on, O6, O), tl.where(on, I6, I)
        sp, si = tl.where(on, sp6, sp), tl.where(on, si6, si)
        p, w = tl.where(on, p6, p), tl.where(on, w6, w)
        c, r = tl.where(on, c6, c), tl.where(on, r6, r)
    if N > 7:
        on = pid >= e6
        first, O, I = tl.where(on, e6, first), tl.where(on, O7, O), tl.where(on, I7, I)
        sp, si = tl.where(on, sp7, sp), tl.where(on, si7, si)
        p, w = tl.where(on, p7, p), tl.where(on, w7, w)
        c, r = tl.where(on, c7, c), tl.where(on, r7, r)
    _cast_program(pid - first, p, w, c, r, O, I, sp, si, ROWS, BO, BI, BF16, ROW_MAX)


declare_writes(_weight_cast_kernel, lambda a: tuple(
    f"{role}{k}" for k in range(a["N"]) for role in ("w", "c") + ("r",) * bool(a["ROW_MAX"])))


# =========================================================================== launchers


# how triton.jit made this module's kernels: TRITON_INTERPRET=1 when it was imported
_INTERPRETED = not isinstance(_hq_weight_kernel, triton.runtime.jit.JITFunction)


def interpreting() -> bool:
    """Whether this package's kernels run under Triton's CPU interpreter.

    Decided by what ``triton.jit`` made of them (TRITON_INTERPRET=1 when this module was
    imported), not by the variable's value now. Set later in the process (by a test module
    choosing the interpreter after triton was imported compiled, or by a user), it does not
    change what the kernels are; following it sent compiled kernels down the interpreter's
    launch paths (its tiles, INTERPRET=True, running them on the spot), so tracing a site
    for splicing failed ("data pointer on an invalid python storage")."""
    if not _INTERPRETED:
        return False
    _patch_interpreter_loop_bounds()
    return True


def _patch_interpreter_loop_bounds() -> None:
    """Let ``range(n)`` take a runtime scalar under the interpreter with NumPy >= 2.3.

    Triton 3.6's interpreter holds every scalar argument as a 1-element array and turns
    it into a loop bound with ``int(array)``, which NumPy 2.3+ rejects ("only
    0-dimensional arrays can be converted to Python scalars"). Compiled kernels are not
    affected; this only re-points the interpreter's ``__index__`` at the array's element.
    """
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_hot_loop_bounds", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._hot_loop_bounds = True
    interpreter._patch_lang_tensor = patched


def qmax(bits: int) -> int:
    return 2 ** (bits - 1) - 1


def level_dtype(fp8: bool) -> torch.dtype:
    return torch.float8_e4m3fn if fp8 else torch.int8


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def column_tile(width: int, max_tile: int = 4096,
                max_waste: float | None = None) -> tuple[int, bool]:
    """(BC, ONE_TILE) for rows of ``width`` (a multiple of 16).

    A whole row in one power-of-two tile saves the second read and transform, but lanes
    past ``width`` idle (their Philox words too): one tile when nothing is wasted (width a
    power of two, up to ``max_tile``) and for short rows (<= 1024) with up to a third
    wasted. Otherwise two sweeps over power-of-two chunks: the widest chunk (up to
    ``max_tile``) whose padding is at most ``max_waste`` of the row, or with ``max_waste``
    None the one that pads the row least (the widest among equals). The per-token kernel
    passes 1/8 (``token_tile``: H100 measurements there); the per-tensor kernel the least
    padding (3072 -> 3 x 1024: 0.066 ms vs 0.073 ms as one 4096 tile).
    """
    full = _pow2_at_least(width)
    if (full == width and full <= max_tile) or (full <= min(1024, max_tile) and 3 * full <= 4 * width):
        return full, True
    padded = lambda bc: -(-width // bc) * bc         # noqa: E731
    if max_waste is not None:
        bc = _pow2_at_least(max_tile)
        while bc > 16 and padded(bc) - width > max_waste * width:
            bc //= 2
        return bc, False
    best = None
    bc = 16
    while bc <= max_tile:
        key = (padded(bc), -bc)
        if best is None or key < best[0]:
            best = (key, bc)
        bc *= 2
    return best[1], False


def seed_pointer(seed, device) -> torch.Tensor:
    """The seed as a 1-element int64 device tensor (kernels load it, so a CUDA graph that
    captures the launch keeps reading whatever value the seed tensor holds at replay).
    A Python int becomes a device fill, not a host-to-device copy (capture forbids those);
    nothing is cached, so no tensor outlives the call inside a CUDA-graph memory pool."""
    if isinstance(seed, torch.Tensor):
        return seed.to(device=device, dtype=torch.int64).reshape(1)
    return torch.full((1,), int(seed), dtype=torch.int64, device=device)


def scalar_buffer(device) -> torch.Tensor:
    """A 0-d fp32 buffer a kernel writes, as a view of a (1,) allocation: Inductor lowers a
    0-d ``empty`` to a fill kernel (a launch), a 1-element one to a bare allocation."""
    return torch.empty((1,), dtype=torch.float32, device=device).view(())


HELD_CHUNKS = 6   # the most column chunks of a row the per-token kernel holds in registers


def token_tile(O_pad: int, interp: bool) -> tuple[int, int, int, int]:
    """(BC, CHUNKS, BR rows, warps) of the per-token kernel on rows of ``O_pad``.

    A power-of-two row up to 4096 (``HOT_HQ_TOKEN_TILE`` caps it) is one chunk; any other
    row is cut into the widest power-of-two chunks that pad it by at most 1/8. Up to
    ``HELD_CHUNKS`` chunks are held in registers (CHUNKS = their count: one read, one
    transform); a wider row takes two sweeps (CHUNKS = 0). A row of three or more 4096-wide
    chunks is held as 2048-wide ones where they fit (same padding, at most ``HELD_CHUNKS``).
    BR = 2048 / BC rows (1 to 8); 4 warps, 8 for 4096-wide chunks of a row of more than
    8192 values. The interpreter keeps small
    tiles (at most 1024 columns, 256 elements per row set, least padding): its cost is per
    operation, and the levels do not depend on the tile (Philox counters follow the
    element).

    H200, 8192 tokens (kernel_ab_2026-11-30T004957_h200_s42): the rule's picks against the
    two sweeps before it, ms: 768 as 3 x 256 (8 rows) 0.0094 vs 0.0126 as one 1024 tile;
    2304 as 5 x 512 (4 rows) 0.0245 vs 0.0356; 3072 as 3 x 1024 0.0285 vs 0.0400; 11008 as
    3 x 4096 on 8 warps 0.106 vs 0.135; 16384 0.136 vs 0.178. Held on 4 warps instead,
    11008 took 0.140; 2304 with 2 rows a program 0.060. Forty-eighth stop
    (kernel_ab_2026-11-30T200846): 11008 as 6 x 2048 on 4 warps 0.0931 vs 3 x 4096 on 8
    warps 0.1016 (on 8 warps 0.278), 12288 0.0964 vs 0.1050; 16384 (8 such chunks, more
    than are held) keeps 4 x 4096 on 8 warps (0.130). Earlier (H100, two sweeps only):
    4 warps never slower than 8 there, and wide chunks beat the least-padded narrow ones
    even with some padding. ``HOT_HQ_TOKEN_FORCE="BC,BR,WARPS[,CHUNKS]"`` sets the tile
    (tuning and tests; CHUNKS defaults to 1 when BC >= O_pad, else 0)."""
    force = os.environ.get("HOT_HQ_TOKEN_FORCE")
    if force:
        bc, br, warps, *chunks = (int(t) for t in force.split(","))
        chunks = chunks[0] if chunks else int(bc >= O_pad)
        if bc < 16 or bc & (bc - 1) or not 0 <= chunks <= HELD_CHUNKS or 0 < chunks * bc < O_pad:
            raise ValueError(f"HOT_HQ_TOKEN_FORCE={force}: BC must be a power of two >= 16 and "
                             f"CHUNKS 0 (two sweeps) or 1..{HELD_CHUNKS} chunks covering the "
                             f"{O_pad} columns")
        return bc, chunks, br, warps
    if interp:
        bc, one = column_tile(O_pad, max_tile=1024)
        chunks = 1 if one else -(-O_pad // bc)
        return bc, chunks if chunks <= HELD_CHUNKS else 0, max(1, min(8, 256 // bc)), 4
    max_tile = int(os.environ.get("HOT_HQ_TOKEN_TILE", "4096"))
    bc = _pow2_at_least(O_pad)
    if bc > max_tile or bc != O_pad:
        bc = _pow2_at_least(max_tile)
        while bc > 16 and -(-O_pad // bc) * bc - O_pad > O_pad / 8:
            bc //= 2
    chunks = -(-O_pad // bc)
    half = -(-O_pad // (bc // 2))
    if bc == 4096 and chunks > 2 and half <= HELD_CHUNKS and half * bc // 2 == chunks * bc:
        bc, chunks = bc // 2, half     # held as twice the 2048-wide chunks, on 4 warps
    chunks = chunks if chunks <= HELD_CHUNKS else 0
    br = max(1, min(8, 2048 // bc))
    return bc, chunks, br, 8 if br == 1 and bc >= 4096 and chunks * bc > 8192 else 4


def input_amax_bits(x: torch.Tensor, dim=None):
    """max |x| (of all of x, or along ``dim``) as the int32 bits of an fp32 value, the form
    the kernels read (``abs_bits``): the input of ``reference.e4m3_bound_scale``. A plain
    torch reduction: one kernel when a ``hot::`` op runs it, and when a site is spliced
    (``kernels/launch.py``) a reduction Inductor compiles with the graph around it (for x,
    fused with x's producer; for W, autocast's copy of a parameter, ``weight_cast`` gives
    the maxima instead where the site is spliced: Inductor split W's reduction into kernels
    of its own, bench/colmax_fusion.py). NaN
    propagates (torch's max does). The kernels round the word to the type they read x as
    (``input_max_bits``)."""
    m = torch.linalg.vector_norm(x, float("inf"), dim=dim, dtype=torch.float32)
    return m.reshape(-1).view(torch.int32)


def hq_act_quant(g: torch.Tensor, bits: int, per_token: bool, seed, fp8: bool = False,
                 row_max: bool = False):
    """Transform g (L, O) along O (zero-padded to O_pad), quantize with stochastic rounding.

    Returns (levels (L, O_pad) int8 or e4m3, fp32 scale (L,) if per_token else ()), and
    with ``row_max`` (per token only) two more outputs: max |g| of each row (L,) fp32, and a
    (1,) int32 word the kernel zeroed, the accumulator of g's HLA bound
    (``hla.token_block_bound_bits``).
    """
    if g.stride(-1) != 1:
        g = g.contiguous()
    if per_token:
        return _per_token(g, qmax(bits), seed, fp8, row_max, plain=False)
    if row_max:
        raise ValueError("hq_act_quant: row_max needs per_token")
    L, O = g.shape
    O_pad = -(-O // 16) * 16
    dev = g.device
    q = torch.empty((L, O_pad), dtype=level_dtype(fp8), device=dev)
    s = scalar_buffer(dev)
    amax = torch.zeros((1,), dtype=torch.int32, device=dev)
    interp = interpreting()
    bc, _ = column_tile(O_pad, max_tile=512 if not interp else 64)
    br = max(1, (4096 if not interp else 128) // bc)
    grid = (triton.cdiv(L, br) * triton.cdiv(O_pad, bc),)
    args = (g, q, s, amax, seed_pointer(seed, dev), L, O, O_pad, g.stride(0), O_pad,
            philox_counters(O_pad))
    meta = dict(BR=br, BC=bc, Q=qmax(bits), FP8=fp8, INTERPRET=interp,
                num_warps=4 if interp else 8)
    launch(_hq_tensor_kernel, grid, *args, PHASE=1, **meta)
    launch(_hq_tensor_kernel, grid, *args, PHASE=2, **meta)
    return q, s


def grad_e4m3(g: torch.Tensor, seed, row_max: bool = False):
    """``reference.grad_e4m3`` on the GPU: g (L, O) -> (stochastic scaled e4m3 (L, O), fp32
    (L,) scales, one per token), the A operand of an FP8 g_x without a Hadamard
    (``exact_gx_gemm="e4m3"``), by the per-token kernel: each row read once (twice where it
    is wider than a tile, the second time from L2) and its e4m3 copy written once. With
    ``row_max``, also (row maxima, a zeroed int32 word) as ``hq_act_quant``'s: the same
    read gives g's HLA bound (``hla.token_block_bound_bits``). Where O is not a multiple
    of 16 the values are a view of (L, O rounded up to 16) rows (the FP8 GEMM's K needs a
    multiple of 16 anyway: ``formats.e4m3_gx_fused``).

    Why its own pass and not a side store of the HLA kernel (which reads g anyway): that
    kernel's threads own channels and hold every token of their tile, so a per-token scale
    is a vector each thread keeps beside the projection's values; the copy took it from 168
    to 255 registers and from 0.34 to 0.96 ms at 8192 x 32000 (H200, 2026-11-29), where a
    row-major pass costs about one read and one byte-per-element write."""
    if g.stride(-1) != 1:
        g = g.contiguous()
    q, s, *rm = _per_token(g, 448, seed, True, row_max, plain=True)
    return (q[:, :g.shape[1]], s, *rm)


def _per_token(g, Q: int, seed, fp8: bool, row_max: bool, plain: bool):
    """One launch of ``_hq_token_kernel`` over g's rows (``token_tile``)."""
    L, O = g.shape
    O_pad = -(-O // 16) * 16
    dev = g.device
    q = torch.empty((L, O_pad), dtype=level_dtype(fp8), device=dev)
    seed_t = seed_pointer(seed, dev)
    s = torch.empty((L,), dtype=torch.float32, device=dev)
    m = torch.empty((L,), dtype=torch.float32, device=dev) if row_max else s  # s: unread
    z = torch.empty((1,), dtype=torch.int32, device=dev) if row_max else seed_t
    interp = interpreting()
    bc, chunks, br, warps = token_tile(O_pad, interp)
    launch(_hq_token_kernel, (triton.cdiv(L, br),),
           g, q, s, seed_t, m, z, L, O, O_pad, g.stride(0), O_pad, philox_counters(O_pad),
           BR=br, BC=bc, CHUNKS=chunks, Q=Q, FP8=fp8, INTERPRET=interp,
           ROW_MAX=row_max, PLAIN=plain, num_warps=warps)
    return (q, s, m, z) if row_max else (q, s)


_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def weight_tile(O_pad: int, interp: bool, e4m3: bool = False) -> tuple[int, int, int]:
    """(BI in-features, BO outputs, warps) of a W kernel program.

    Levels (two launches): 64 in-features (128 contiguous bytes of each bf16 W row) by 128
    outputs on 4 warps: 2-9% faster than 32 x 256 on 8 warps at Llama d4096's W shapes
    (H100, bench/results/kernel_ab_2026-11-24T160024_h100.md; 64 x 256, 128 x 64 and
    16 x 256 in between). Scaled e4m3 (one launch): 128 x 64 on 4 warps, 2-5% faster than
    64 x 128 at the same shapes (kernel_ab_2026-11-25T012614). The tile does not change a
    bit. HOT_HQ_W_TILE="BI,BO,WARPS" overrides (tuning)."""
    if interp:
        bi, bo, warps = 8, 64, 4
    elif "HOT_HQ_W_TILE" in os.environ:
        bi, bo, warps = (int(v) for v in os.environ["HOT_HQ_W_TILE"].split(","))
    else:
        bi, bo, warps = (128, 64, 4) if e4m3 else (64, 128, 4)
    return bi, min(bo, _pow2_at_least(O_pad)), warps


WEIGHT_SLOTS = 8     # weights one launch of the forward's W kernels serves (their slots)


def _slotted(slots: list, per_slot: int) -> list:
    """The arguments of a slotted launch: the used slots' ``slots`` (``per_slot`` values
    each, slot 0's first value a tensor the kernel only reads), then for each unused slot
    slot 0's values with every tensor replaced by that read-only one. The kernel's N compiles
    those slots out (nothing refers to them), and were one ever referred to, it could only be
    read: no written buffer is passed twice."""
    used = len(slots) // per_slot
    idle = [slots[0] if isinstance(v, torch.Tensor) else v for v in slots[:per_slot]]
    return slots + idle * (WEIGHT_SLOTS - used)


def _one_device(ts: list, what: str) -> None:
    """A slotted launch's tensors live on one device (one launch cannot span two)."""
    if len({t.device for t in ts}) > 1:
        raise ValueError(f"{what}: the weights of one launch must be on one device")


def weight_casts(ps: list, dtype: torch.dtype, row_max: bool = False) -> list:
    """``reference.weight_cast`` of each fp32 parameter p (O, I) of ``ps``: [(p.to(dtype),
    max |that| per column as int32 bits, per row with ``row_max`` (else an empty tensor))],
    one ``_weight_cast_kernel`` launch per ``WEIGHT_SLOTS`` parameters (tile: ``cast_tile``)."""
    _one_device(ps, "weight_casts")
    rows, bo, bi, warps = cast_tile(interpreting())
    outs = []
    for start in range(0, len(ps), WEIGHT_SLOTS):
        slots, end = [], 0
        for p in ps[start:start + WEIGHT_SLOTS]:
            O, I = p.shape
            w = torch.empty((O, I), dtype=dtype, device=p.device)
            amax = torch.zeros((I,), dtype=torch.int32, device=p.device)
            rmax = torch.zeros((O if row_max else 0,), dtype=torch.int32, device=p.device)
            outs.append((w, amax, rmax))
            end += triton.cdiv(O, rows) * triton.cdiv(I, bi)
            # without row maxima the kernel never touches rmax_ptr: p stands in (read-only,
            # so no written argument is aliased, and never a null pointer for an empty tensor)
            slots += [p, w, amax, rmax if row_max else p, O, I, p.stride(0), p.stride(1), end]
        launch(_weight_cast_kernel, (end,), *_slotted(slots, 9), N=len(slots) // 9, ROWS=rows,
               BO=bo, BI=bi, BF16=dtype == torch.bfloat16, ROW_MAX=row_max, num_warps=warps)
    return outs


def weight_cast(p: torch.Tensor, dtype: torch.dtype, row_max: bool = False):
    """``weight_casts`` of one parameter."""
    return weight_casts([p], dtype, row_max)[0]


def cast_tile(interp: bool) -> tuple[int, int, int, int]:
    """(ROWS per program, BO rows per step, BI columns, warps) of ``_weight_cast_kernel``.

    128 x 64 tiles (one step per program) on 4 warps: the fastest summed over Llama d4096's
    three W shapes in two sweeps of 10 tiles (H100, bench/results/kernel_ab_2026-11-26T163434
    and ..T163539): 0.0395 / 0.0958 / 0.0958 ms at 4096x4096 / 11008x4096 / 4096x11008
    (95-98% of copy bandwidth), against 0.036 / 0.093 / 0.093 ms for the bare torch cast and
    0.056 / 0.138 / 0.134 ms for cast plus column maxima. Narrow, tall tiles win: 64 x 64 and
    32 x 256 rows were within 1%, 64 x 128 1-5% slower, 32 x 256 (the first pick) 10-16%;
    rows of 512 or 1024 columns, 8 warps, 2 warps and row loops (BO < ROWS) all slower
    (kernel_ab_2026-11-26T142204 too). HOT_WCAST_TILE="ROWS,BO,BI,WARPS" overrides (tuning)."""
    if interp:
        return 16, 8, 64, 4
    if "HOT_WCAST_TILE" in os.environ:
        return tuple(int(v) for v in os.environ["HOT_WCAST_TILE"].split(","))
    return 128, 128, 64, 4


def hq_weight_quant(w: torch.Tensor, bits: int, fp8: bool = False, e4m3: bool = False,
                    scale_mul: float = 1.0, round_to: Optional[torch.dtype] = None,
                    amax: Optional[torch.Tensor] = None, rotate: bool = True):
    """reference.hq_weight: W (O, I) -> (levels (I, O_pad), per-in-feature fp32 scale (I,)),
    for a g_x that makes W's operand itself (the forward's are ``hq_weight_operands``).

    ``fp8``: the levels stored as e4m3; ``e4m3``: scaled FP8 instead of levels (``bits``
    unused). The returned scale is multiplied by ``scale_mul``, a power of two: the cuBLAS
    FP8 GEMM has no alpha, so the g_x GEMM's 1/16 rides on W's scale at no cost.
    ``round_to`` (bf16 / fp16): W is rounded to it as it is read, as if ``w.to(round_to)``
    had been passed: an fp32 parameter stands for autocast's copy of it, which then need
    not be kept for backward (``HOTConfig.recompute_operands``). ``amax`` (levels only): a
    zeroed (I,) int32 workspace the caller made with others in one launch (default: its
    own). In e4m3 the scale comes from W's column maxima (``reference.e4m3_bound_scale``),
    a torch reduction; the kernel runs once. ``rotate=False`` (e4m3 only): no transform,
    s = max |W[:, i]| / 448 (``reference.plain_weight_e4m3``: the g_x operand of
    ``exact_gx_gemm="e4m3"``)."""
    if not rotate and not e4m3:
        raise ValueError("hq_weight_quant: rotate=False needs e4m3")
    O, I = w.shape
    O_pad = -(-O // 16) * 16
    dev = w.device
    q = torch.empty((I, O_pad), dtype=level_dtype(fp8 or e4m3), device=dev)
    s = torch.empty((I,), dtype=torch.float32, device=dev)
    if e4m3:
        amax = input_amax_bits(w, dim=0)
    elif amax is None:
        amax = torch.zeros((I,), dtype=torch.int32, device=dev)
    interp = interpreting()
    bi, bo, warps = weight_tile(O_pad, interp, e4m3)
    grid = (triton.cdiv(I, bi) * triton.cdiv(O_pad, bo),)
    args = (w, q, s, amax, float(scale_mul), O, I, O_pad, w.stride(0), w.stride(1), O_pad)
    rnd = _TL_DTYPES.get(round_to) if w.dtype == torch.float32 else None   # never an upcast
    q_max = (int(E4M3_BOUND_Q) if rotate else int(E4M3_MAX)) if e4m3 else qmax(bits)
    meta = dict(BI=bi, BO=bo, Q=q_max, FP8=fp8, E4M3=e4m3, INTERPRET=interp, ROUND=rnd,
                ROTATE=rotate, num_warps=warps)     # all named: wrap_triton fills no defaults
    if not e4m3:
        launch(_hq_weight_kernel, grid, *args, PHASE=1, **meta)
    launch(_hq_weight_kernel, grid, *args, PHASE=2, **meta)
    return q, s


def hq_weight_operands(ws: list, col_maxes: list, forward: Optional[list] = None,
                       scale_mul: float = 1.0, rotate: bool = True) -> list:
    """The forward's scaled-e4m3 W operands of owned weight copies (``passes/weight_cast.py``),
    one ``_weight_operands_kernel`` launch per ``WEIGHT_SLOTS`` copies of a tile: for each
    contiguous w (O, I) of ``ws`` with its column maxima (int32 bits, ``weight_casts``'),
    (q (I, O_pad) e4m3, fp32 scale (I,) times ``scale_mul``) as ``hq_weight_quant(w, 8,
    e4m3=True, scale_mul=, rotate=)`` gives, bit for bit.

    ``forward`` = [(maxima, rowwise)] per weight: the same read also writes the FP8
    forward's W operand (``_store_forward_weight``; maxima as int32 bits: W's row maxima
    (O,) row-wise, else a 1-element max of W), returned after the two as (the column-major
    (I, O) e4m3 view of a row-major (O, I) buffer, fp32 scale: (1, O) row-wise, else 0-d),
    the operand and scale ``fp8_forward.weight_operand`` gives. All weights of one call
    share ``forward``'s kind (row-wise, tensor-wise or none), a dtype and a device.
    ``rotate=False`` (the plain W^T of ``exact_gx_gemm="e4m3"``) takes O a multiple of 16
    only (``formats.e4m3_gx_fused`` asks it of that path anyway)."""
    if not ws:
        return []
    _one_device(ws, "hq_weight_operands")
    if len({w.dtype for w in ws}) > 1:
        raise ValueError("hq_weight_operands: the copies of one call must share a dtype")
    interp = interpreting()
    kinds = {rowwise for _, rowwise in forward} if forward is not None else {None}
    if len(kinds) != 1:
        raise ValueError("hq_weight_operands: the weights disagree on the forward's scale kind")
    fwd = {None: 0, False: 1, True: 2}[kinds.pop()]
    q_max = int(E4M3_BOUND_Q) if rotate else int(E4M3_MAX)
    outs: list = [None] * len(ws)
    chunks: dict = {}           # tile -> the weights it serves, in order
    for i, w in enumerate(ws):
        if not w.is_contiguous():
            raise ValueError("hq_weight_operands: the copies are contiguous (weight_casts')")
        if not rotate and w.shape[0] % 16:
            raise ValueError("hq_weight_operands: the plain operand (rotate=False) needs O a "
                             "multiple of 16 (the FP8 g_x GEMM's K)")
        chunks.setdefault(weight_tile(-(-w.shape[0] // 16) * 16, interp, True), []).append(i)
    for (bi, bo, warps), idx in chunks.items():
        for start in range(0, len(idx), WEIGHT_SLOTS):
            slots, end = [], 0
            for i in idx[start:start + WEIGHT_SLOTS]:
                w = ws[i]
                O, I = w.shape
                O_pad = -(-O // 16) * 16
                dev = w.device
                q = torch.empty((I, O_pad), dtype=torch.float8_e4m3fn, device=dev)
                s = torch.empty((I,), dtype=torch.float32, device=dev)
                f = fs = fmax = w        # read-only stand-ins: the kernel never touches them
                if fwd:
                    fmax = forward[i][0]
                    f = torch.empty((O, I), dtype=torch.float8_e4m3fn, device=dev)
                    fs = torch.empty((O,) if fwd == 2 else (), dtype=torch.float32, device=dev)
                    outs[i] = (q, s, f.t(), fs.view(1, O) if fwd == 2 else fs)
                else:
                    outs[i] = (q, s)
                end += triton.cdiv(I, bi) * triton.cdiv(O_pad, bo)
                slots += [w, q, s, col_maxes[i], f, fs, fmax, O, I, end]
            launch(_weight_operands_kernel, (end,), *_slotted(slots, 10), float(scale_mul),
                   N=len(slots) // 10, BI=bi, BO=bo, Q=q_max, INTERPRET=interp, FWD=fwd,
                   ROTATE=rotate, num_warps=warps)
    return outs
