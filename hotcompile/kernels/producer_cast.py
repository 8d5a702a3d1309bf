"""GELU with the row-wise e4m3 copy of its output in one pass: the FP8 forward's x operand
of a linear fed by GELU (fc2 of a ViT or BERT MLP), written by its producer.

Why a kernel of HOT's own: the FP8 forward's cast (``fp8_forward.e4m3_cast``, aten ops)
is fused by Inductor into GELU's kernel, but a 3072-wide row is past Inductor's
persistent-reduction limit (1024 elements), so that kernel loops over each row twice and
computes GELU (its ``erf``) twice: once for the row maxima, once for the levels. At ViT-B
bs64 (12608 x 3072) it took 0.187 ms a site on the H200 (sixtieth stop, call 282), 2.3 ms
of a forced step. Here a program holds its rows in registers, chunk by chunk: GELU once,
the bf16 output stored, the row maxima taken from the held values, then the levels and the
scale; one read of h, one write of each output (bench/producer_casts.py's prototype: 0.066
ms, at copy speed, forty-seventh stop).

Numerics: GELU in fp32 in the op order Inductor compiles ``F.gelu``, with the same libdevice
``erf``, rounded to bf16: bit for bit Inductor's fusion of GELU and the cast on the H200
(sixtieth stop, 3072 to 8192 wide). The twin (``reference.gelu_e4m3``), computed op by op,
agrees within a bf16 step: in the far negative tail (x < -4, where erf(x) + 1 cancels) the
compiled code contracts that sum differently, by up to 1e-6. Levels and scale are
``e4m3_cast``'s of the bf16 output (exact reciprocal). bf16 rows of up to ``MAX_WIDTH``
columns only (``fusable``): the pass leaves anything else to Inductor.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

from .hadamard import (E4M3_AMAX_FLOOR, E4M3_INV_MAX, abs_bits, e4m3_from_clamped,
                       interpreting, round_to_bf16)
from .launch import declare_writes, launch
from . import reference as ref

CHUNK = 1024                  # columns a program holds per chunk (a power of two; ``tile``)
MAX_WIDTH = 8 * CHUNK         # wider rows would spill the held chunks out of registers
SQRT_HALF = tl.constexpr(ref.SQRT_HALF)             # GELU's constants, as the twin's
SQRT_2_OVER_PI = tl.constexpr(ref.SQRT_2_OVER_PI)
TANH_CUBIC = tl.constexpr(ref.TANH_CUBIC)


def fusable(h: torch.Tensor) -> bool:
    """Whether ``gelu_e4m3`` takes h: 2-D bf16, rows contiguous, 1..MAX_WIDTH columns."""
    return (h.dim() == 2 and h.dtype == torch.bfloat16 and h.is_contiguous()
            and 0 < h.shape[1] <= MAX_WIDTH)


@triton.jit
def _gelu_chunk(h_ptr, y_ptr, rows, i: tl.constexpr, R, W, BC: tl.constexpr,
                TANH: tl.constexpr, INTERPRET: tl.constexpr):
    """Columns [i*BC, (i+1)*BC) of the program's rows: GELU in fp32 as Inductor compiles it,
    rounded to bf16 and stored; returned as fp32. Exact GELU: (x * 0.5) * (erf(x *
    sqrt(1/2)) + 1); tanh's (``TANH``): (x * 0.5) * (tanh((x + x * x * x * 0.044715) *
    sqrt(2/pi)) + 1), its cube as two products, (x * x) * x (Inductor's ``pow(x, 3)`` too).
    The interpreter has no libdevice: numpy's erf, and tanh from exp."""
    cols = i * BC + tl.arange(0, BC)
    mask = (rows < R)[:, None] & (cols < W)[None, :]
    offs = rows.to(tl.int64)[:, None] * W + cols[None, :]
    x = tl.load(h_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if TANH:
        z = (x + x * x * x * TANH_CUBIC) * SQRT_2_OVER_PI
        if INTERPRET:
            t = 1.0 - 2.0 / (tl.exp(2.0 * z) + 1.0)
        else:
            t = libdevice.tanh(z)
    elif INTERPRET:
        t = tl.erf(x * SQRT_HALF)
    else:
        t = libdevice.erf(x * SQRT_HALF)
    y = (x * 0.5) * (t + 1.0)
    if INTERPRET:       # its fp32 -> bf16 cast truncates: rounded in integer ops first
        y = round_to_bf16(y)
    y = y.to(tl.bfloat16)
    tl.store(y_ptr + offs, y, mask=mask)
    return y.to(tl.float32)


@triton.jit
def _gelu_e4m3_kernel(h_ptr, y_ptr, q_ptr, s_ptr, m_ptr, R, W, BR: tl.constexpr,
                      BC: tl.constexpr, CHUNKS: tl.constexpr, TANH: tl.constexpr,
                      INTERPRET: tl.constexpr):
    """BR rows a program, CHUNKS chunks of BC columns each held in registers: y = GELU(h)
    (bf16; tanh's with ``TANH``), then per row m = max |y| (an integer max of the bits:
    NaN propagates), the scale s = max(m, 1e-12) / 448 and the levels e4m3(clamp(y * (1 /
    s), +-448))."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    amax = tl.zeros((BR, BC), dtype=tl.int32)
    held = ()
    for i in tl.static_range(CHUNKS):
        y = _gelu_chunk(h_ptr, y_ptr, rows, i, R, W, BC, TANH, INTERPRET)
        amax = tl.maximum(amax, abs_bits(y))
        held = held + (y,)
    m = cast_held_rows(held, amax, rows, R, W, q_ptr, s_ptr, BC, CHUNKS, INTERPRET)
    tl.store(m_ptr + rows, m, mask=rows < R)


@triton.jit
def cast_held_rows(held, amax, rows, R, W, q_ptr, s_ptr, BC: tl.constexpr,
                   CHUNKS: tl.constexpr, INTERPRET: tl.constexpr):
    """The row-wise e4m3 copy of rows a producer holds as CHUNKS fp32 chunks (``held``) of
    BC columns, with ``amax`` their running |values| as int32 bits: per row m = max |y|,
    the scale s = max(m, 1e-12) / 448 (stored) and the levels e4m3(clamp(y * (1 / s),
    +-448)) (stored row-major), 1 / s correctly rounded as ``fp8_forward.e4m3_cast``'s.
    Returns m (fp32)."""
    m = tl.max(amax, axis=1).to(tl.float32, bitcast=True)
    s = tl.maximum(m, E4M3_AMAX_FLOOR, propagate_nan=tl.PropagateNan.ALL) * E4M3_INV_MAX
    inv = tl.math.div_rn(1.0, s)
    for i in tl.static_range(CHUNKS):
        cols = i * BC + tl.arange(0, BC)
        mask = (rows < R)[:, None] & (cols < W)[None, :]
        t = tl.clamp(held[i] * inv[:, None], -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL)
        tl.store(q_ptr + rows.to(tl.int64)[:, None] * W + cols[None, :],
                 e4m3_from_clamped(t, INTERPRET), mask=mask)
    tl.store(s_ptr + rows, s, mask=rows < R)
    return m


declare_writes(_gelu_e4m3_kernel, lambda a: ("y_ptr", "q_ptr", "s_ptr", "m_ptr"))


def tile(width: int, interp: bool) -> tuple[int, int, int]:
    """(rows a program, columns a chunk, warps): one row a program, chunks of 2048 columns
    past 6144, of 512 from 1025 to 1536 (where 1024 would pad more), else up to 1024; 8
    values a thread a chunk (at most). Swept on the H200 (sixty-first stop, 13 tiles at 6 shapes,
    1536 to 8192 wide, ``gelu_e4m3_tiles_2026-12-03T0936_h200_s61``, every tile bit-equal):
    the fastest tile at each shape. Against the sixtieth stop's rule (1024 columns, 4
    warps, 8 past 4096): 8.6% faster at 8192 wide, 3.7% at 5120, 22% at 1536, the same
    elsewhere; 65-68% of a copy of the bytes (two or four rows a program, 16 warps, 2048
    columns below 8192: none faster)."""
    if interp:
        return 2, 64, 4
    if width > 6 * CHUNK:
        bc = 2 * CHUNK
    elif width > CHUNK:
        bc = CHUNK // 2 if width <= 3 * CHUNK // 2 else CHUNK
    else:
        bc = max(64, triton.next_power_of_2(width))
    return 1, bc, max(1, bc // 256)


def gelu_e4m3(h: torch.Tensor, approximate: str = "none"):
    """``reference.gelu_e4m3`` on one kernel: (GELU(h) bf16 (R, W), its row-wise e4m3 levels
    (R, W) row-major, scales (R,) fp32, row maxima max |y| (R,) fp32). h: ``fusable``;
    ``approximate``: F.gelu's ("none": erf's formula, "tanh")."""
    if approximate not in ref.GELU_APPROXIMATIONS:
        raise ValueError(f"gelu_e4m3: approximate must be one of {ref.GELU_APPROXIMATIONS}, "
                         f"got {approximate!r}")
    if not fusable(h):
        raise ValueError(f"gelu_e4m3: needs 2-D contiguous bf16 rows of at most {MAX_WIDTH} "
                         f"columns, got {tuple(h.shape)} {h.dtype}")
    R, W = h.shape
    y = torch.empty_like(h)
    q = torch.empty((R, W), dtype=torch.float8_e4m3fn, device=h.device)
    s = torch.empty((R,), dtype=torch.float32, device=h.device)
    m = torch.empty((R,), dtype=torch.float32, device=h.device)
    interp = interpreting()
    br, bc, warps = tile(W, interp)
    if R:
        launch(_gelu_e4m3_kernel, (triton.cdiv(R, br),), h, y, q, s, m, R, W, BR=br, BC=bc,
               CHUNKS=triton.cdiv(W, bc), TANH=approximate == "tanh", INTERPRET=interp,
               num_warps=warps)
    return y, q, s, m
