"""Low-precision GEMM with the dequantization fused into the epilogue.

    out[m, n] = acc[m, n] * row_scale[m] * (col_scale[n] * alpha)        (vectors or scalars)
    acc = A @ B over integer levels, exact

Why fused: the accumulator is a (M, N) tile in registers; scaling it there costs two
multiplies per output element instead of a second pass over an fp32 (M, N) tensor.

Both operands are given K-major: A as (M, K) and B *transposed*, as Bt (N, K), each with
unit stride along K. Hopper's 8-bit tensor-core instructions (wgmma with s8 or e4m3
inputs) read shared-memory operands only in K-major order; an MN-major operand makes
Triton transpose it through registers and shared memory on every K step (measured in
the compiled code: byte-wise shared stores, no async copies), so callers transpose once.

Two operand formats, same levels:
* INT8 x INT8 -> int32 accumulate, exact. An int32 sum of K products |qa*qb| <= 127*127
  can wrap once K * 127 * 127 >= 2**31, i.e. from K ~ 133k on: the HLA g_W GEMM reduces
  over ceil(L/16) * rank tokens, 140k for L = 140k tokens at rank 16. The wrap is silent,
  so for such K the launcher sets the constexpr ``CHUNKED``: the K loop runs in chunks of
  ``K_CHUNK`` elements (``int8_k_chunk``: the longest multiple of every BK whose partial
  cannot wrap), and after each chunk the accumulator's high bits are carried into a second
  int32 tile: ``hi += acc >> 16; acc &= 0xFFFF`` (the exact split acc = hi' * 2**16 + lo,
  0 <= lo < 2**16). The sum hi * 2**16 + acc stays exact (|hi| <= K / 4 + 1: no wrap for any int32 K),
  and the epilogue converts it with ONE rounding, fp32(hi) * 2**16 + fp32(lo), exact parts
  while |hi| < 2**24 (|sum| < 2**40, K < 68M): the chunked result is the correctly rounded
  fp32 of the exact integer sum, the same number an unwrapped int32 (or the float64
  reference) gives, not an fp32 running sum that rounds at every chunk. The carry costs
  three integer ops per accumulator element once per chunk (~1000 K steps), a scalar test
  per K step and one extra (BM, BN) int32 tile of registers; measured on the H100 at
  768x140000x768 it runs at the speed of the plain (wrapping) loop. For K <= K_CHUNK (every shape but the longest token axes, and any 4-bit
  GEMM: 7 * 7 levels wrap only beyond K ~ 43M) ``CHUNKED`` is False and the kernel compiles
  to exactly the code it had before the guard, so results are bit-identical.
* FP8 e4m3 x e4m3 -> fp32 accumulate, for levels |q| <= 15 (4/5-bit HQ), all exact in e4m3.
  Hopper's FP8 tensor cores are reported (DeepSeek-V3 report) to keep only about 14 bits
  when adding into the accumulator, so ``EXACT_ACC`` moves each BLOCK_K partial product
  into a separate fp32 accumulator (``max_num_imprecise_acc``). Where exactness ends:
  (1) each BK = 128 partial must be an integer below 2**14 for the tensor core's short
  adder: true for 4-bit levels (128 * 49 = 6272), NOT guaranteed for 5-bit ones
  (128 * 225 = 28800), which ``gx_format`` may route here when forced (bits <= 5);
  (2) the fp32 sum of the partials is exact while every running sum stays below 2**24,
  i.e. K * qa * qb <= 2**24: K <= 342,392 for 4-bit (the GPU test checks a worst case
  with sums near 6e5); beyond that each add rounds to 24 bits (relative error ~6e-8 per
  add, no wrap: unlike int32, fp32 degrades gracefully). Without ``EXACT_ACC`` (fast
  accumulation) exactness ends near |acc| ~ 2**14 already. Nothing can overflow or turn
  NaN for any K: |acc| <= K * 448**2 < 2**31 * 2**18 is far below fp32's 3.4e38, the levels
  (|q| <= 15) never hit the e4m3 NaN byte (0x7F/0xFF), and the masked K tail loads the byte
  0 (+0.0), never the unwritten pad of a ``transpose_padded`` buffer. The FP8 path is
  therefore never chunked. On the H100 the INT8 path
  was faster than FP8 at every benchmarked shape (FP8 exact 445-680 TFLOP/s, FP8 with
  fast accumulation 580-920, INT8 670-1220 on the g_x GEMM), so ``gx_format`` picks INT8 of
  the two (and cuBLAS FP8 over both where it applies).

Where cuBLAS's FP8 GEMM applies (``gx_format``: the g_x GEMM with per-token g_y levels in
e4m3), it runs instead of this kernel: ``cublas_fp8_mm`` (faster than both formats here).

Tiles come from the shape (``tile_config``), never from timing at run time: a new token
count (dynamic shapes) must not tune inside backward or under CUDA-graph capture, and every
process must launch the same code.

(A TMA-descriptor variant of this kernel, with an optionally warp-specialized load loop,
compiled for sm_90 but stalled on the H100 at its first launch; it was removed
rather than shipped unverified. Loads here are pointer-based with a cp.async pipeline.)

Tails: M and N tails are handled by clamping the row indices of the loads (rows past
the end re-read row 0; their results are masked on store) and K tails by masked loads.
The epilogue's multiplication order matches the reference:
acc * row_scale, then * (col_scale * alpha); two scalars: acc * (row_scale * (col_scale * alpha)).
"""
from __future__ import annotations

import functools
import math
import os

import torch
import triton
import triton.language as tl

from .formats import gx_rule
from .hadamard import interpreting
from .launch import launch


@triton.jit
def _grouped_tile(pid, M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    """Program id -> (tile row, tile col), GROUP_M tile rows at a time so that the B tiles
    a group reuses stay in L2."""
    n_m = tl.cdiv(M, BM)
    n_n = tl.cdiv(N, BN)
    per_group = GROUP_M * n_n
    first_m = (pid // per_group) * GROUP_M
    rows = tl.minimum(n_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % rows, (pid % per_group) // rows


@triton.jit
def _dequant_epilogue(acc, rs_ptr, cs_ptr, alpha, offs_m, offs_n, M, N,
                      ROW_VEC: tl.constexpr, COL_VEC: tl.constexpr):
    accf = acc.to(tl.float32)
    if COL_VEC:
        cs = (tl.load(cs_ptr + offs_n, mask=offs_n < N, other=0.0) * alpha)[None, :]
    else:
        cs = tl.load(cs_ptr) * alpha
    if ROW_VEC:
        out = (accf * tl.load(rs_ptr + offs_m, mask=offs_m < M, other=0.0)[:, None]) * cs
    elif COL_VEC:
        out = (accf * tl.load(rs_ptr)) * cs
    else:
        out = accf * (tl.load(rs_ptr) * cs)
    return out


@triton.jit
def _load_k_step(a_ptrs, b_ptrs, offs_k, K, k, BK: tl.constexpr, EVEN_K: tl.constexpr):
    """The A and Bt tiles of K step ``k`` (the pointers already point at it), masked past K
    unless K is a multiple of BK."""
    if EVEN_K:
        a = tl.load(a_ptrs)
        b = tl.load(b_ptrs)
    else:
        k_left = K - k * BK
        a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0)
        b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0)
    return a, b


@triton.jit
def _scaled_mm_kernel(a_ptr, bt_ptr, out_ptr, rs_ptr, cs_ptr, alpha, M, N, K, lda, ldb, ldo,
                      ROW_VEC: tl.constexpr, COL_VEC: tl.constexpr, FP8: tl.constexpr,
                      EXACT_ACC: tl.constexpr, EVEN_K: tl.constexpr,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                      CHUNKED: tl.constexpr = False, K_CHUNK: tl.constexpr = 0):
    pid_m, pid_n = _grouped_tile(tl.program_id(0), M, N, BM, BN, GROUP_M)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    rows_a = tl.where(offs_m < M, offs_m, 0)
    rows_b = tl.where(offs_n < N, offs_n, 0)
    a_ptrs = a_ptr + rows_a.to(tl.int64)[:, None] * lda + offs_k[None, :]
    b_ptrs = bt_ptr + rows_b.to(tl.int64)[None, :] * ldb + offs_k[:, None]
    if FP8:
        acc = tl.zeros((BM, BN), dtype=tl.float32)
    else:
        acc = tl.zeros((BM, BN), dtype=tl.int32)
    if CHUNKED:
        # INT8 with a K whose int32 sum could wrap (module doc): each chunk of K_CHUNK
        # elements adds at most K_CHUNK * qa * qb < 2**31 - 2**16 to an accumulator that
        # starts in [0, 2**16); its high bits then move to ``hi``, exactly.
        tl.static_assert(not FP8, "the FP8 path accumulates in fp32 and is never chunked")
        tl.static_assert(K_CHUNK % BK == 0, "K_CHUNK must be a multiple of BK")
        STEPS: tl.constexpr = K_CHUNK // BK
        hi = tl.zeros((BM, BN), dtype=tl.int32)
        # one flat loop with a runtime-conditional carry, not a loop over chunks around a
        # loop over K steps: that nested form measured 6-17x slower on the H100 (presumably
        # its inner loop is not software-pipelined); this one runs at the plain loop's speed
        for k in range(0, tl.cdiv(K, BK)):
            a, b = _load_k_step(a_ptrs, b_ptrs, offs_k, K, k, BK, EVEN_K)
            acc = tl.dot(a, b, acc, out_dtype=tl.int32)
            a_ptrs += BK
            b_ptrs += BK
            if k % STEPS == STEPS - 1:           # end of a chunk
                hi += acc >> 16                  # arithmetic shift: floor(acc / 2**16)
                acc = acc & 0xFFFF               # acc - floor(acc / 2**16) * 2**16, in [0, 2**16)
        hi += acc >> 16                          # the last (partial) chunk's carry
        acc = acc & 0xFFFF
        # one rounding of the exact hi * 2**16 + lo (both parts exact in fp32, module doc)
        acc = hi.to(tl.float32) * 65536.0 + acc.to(tl.float32)
    else:
        # the un-chunked loop: the common case, as before the guard
        for k in range(0, tl.cdiv(K, BK)):
            a, b = _load_k_step(a_ptrs, b_ptrs, offs_k, K, k, BK, EVEN_K)
            if FP8:
                a = a.to(tl.float8e4nv, bitcast=True)
                b = b.to(tl.float8e4nv, bitcast=True)
                if EXACT_ACC:
                    acc = tl.dot(a, b, acc, max_num_imprecise_acc=BK)
                else:
                    acc = tl.dot(a, b, acc)
            else:
                acc = tl.dot(a, b, acc, out_dtype=tl.int32)
            a_ptrs += BK
            b_ptrs += BK
    out = _dequant_epilogue(acc, rs_ptr, cs_ptr, alpha, offs_m, offs_n, M, N, ROW_VEC, COL_VEC)
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * ldo + offs_n[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask)


CONFIGS = {  # name: (BM, BN, BK, warps, stages, relative time of one tile per unit of K)
    "wide": (128, 256, 128, 8, 3, 3.05),
    "square": (128, 128, 128, 8, 4, 3.86),
    "square4": (128, 128, 128, 4, 4, 3.64),
    "narrow": (64, 128, 128, 4, 4, 4.50),
}
"""The tiles the INT8 GEMM launches with. The last number, a tile's time per unit of K per
BM*BN (relative), is fitted on the H100 from the largest shapes of the tile sweep
(bench/results/gemm_tiles_2026-11-23T220410: d4096 up g_x, 8192 x 4096 x 14336, 8+ waves)."""


@functools.lru_cache(maxsize=4096)
def tile_config(M: int, N: int, K: int, sms: int) -> str:
    """The tile of a (M, N, K) GEMM, chosen from the shape alone: no timing at run time, so
    a new token count never tunes inside backward, and the choice is the same in every
    process and under CUDA-graph capture. Model: the tile with the least
    ``ceil(tiles / sms) * BM * BN * rate`` (full waves of equal tiles; K is common to all).
    Against the H100 sweep of 28 GEMMs at HOT's shapes it picks the fastest tile for 22,
    and loses 7-14% on the rest (small ViT-B and d768 GEMMs, <= 0.1 ms)."""
    def t(name):
        bm, bn, _, _, _, rate = CONFIGS[name]
        return -(-(triton.cdiv(M, bm) * triton.cdiv(N, bn)) // sms) * bm * bn * rate
    return min(CONFIGS, key=t)


@functools.lru_cache(maxsize=None)
def sm_count(index: int) -> int:
    """The SMs of CUDA device ``index`` (a GEMM's tile, the HLA kernel's tiles a program)."""
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.lru_cache(maxsize=None)
def _capability(index) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _launch(args, flags, M: int, N: int, K: int, config: str | None = None) -> None:
    """Launch with the shape's tile (``tile_config``) or a named one (benchmarks)."""
    name = config or tile_config(M, N, K, sm_count(args[0].device.index or 0))
    bm, bn, bk, warps, stages, _ = CONFIGS[name]
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)
    launch(_scaled_mm_kernel, grid, *args, **flags, EVEN_K=K % bk == 0, BM=bm, BN=bn, BK=bk,
           GROUP_M=8, num_warps=warps, num_stages=stages)


# FP8 accumulation mode: exact (promote every BLOCK_K) unless HOT_FP8_FAST_ACC=1.
EXACT_FP8_ACC = os.environ.get("HOT_FP8_FAST_ACC") != "1"

# ----------------------------------------------------------------- int32 overflow guard
_INT32_MAX = 2**31 - 1
_CARRY_LO = 2**16        # between chunks the kernel leaves acc in [0, 2**16) (module doc)
INT8_LEVEL_MAX = 128     # |q| bound of any int8 value (-128 too): used when bits are unknown
_INTERP_BK = 32          # the interpreter's tile (see scaled_mm)
# every K_CHUNK must be a multiple of each BK a launch may use
_K_ALIGN = math.lcm(_INTERP_BK, *(c[2] for c in CONFIGS.values()))


def _level_pair(level_max) -> tuple[int, int]:
    if level_max is None:
        return INT8_LEVEL_MAX, INT8_LEVEL_MAX
    qa, qb = level_max if isinstance(level_max, tuple) else (level_max, level_max)
    if not (1 <= qa <= INT8_LEVEL_MAX and 1 <= qb <= INT8_LEVEL_MAX):
        raise ValueError(f"level_max must lie in [1, {INT8_LEVEL_MAX}], got {level_max!r}")
    return int(qa), int(qb)


@functools.lru_cache(maxsize=None)
def int8_k_chunk(level_max: int | tuple[int, int] | None = None) -> int:
    """Longest K span (a multiple of every BK) the INT8 kernel may sum in int32.

    ``level_max``: bound on |level| of both operands (an int), or of A and B separately
    (a pair): 127 for 8-bit levels, 7 for 4-bit. None (the caller does not know its bits)
    assumes any int8 value, |q| <= 128, conservatively. The kernel's accumulator starts a
    chunk in [0, 2**16) (what the carry leaves) and adds at most chunk * qa * qb, so
    chunk * qa * qb <= 2**31 - 2**16 keeps it below 2**31: 133,120 for 8-bit levels
    (133,120 * 127**2 = 2,147,092,480 < 2**31), 130,944 when the bits are unknown, ~43.8M
    for 4-bit (a 4-bit GEMM is never chunked in practice).
    """
    qa, qb = _level_pair(level_max)
    chunk = (_INT32_MAX - (_CARRY_LO - 1)) // (qa * qb)
    return chunk - chunk % _K_ALIGN


def _forced_chunk_from_env() -> int | None:
    value = os.environ.get("HOT_GEMM_K_CHUNK")
    return int(value) if value else None


# Testing override of the chunk (HOT_GEMM_K_CHUNK=<elements>, or set this attribute): lets
# the chunked INT8 path run on small K, e.g. under the interpreter or through fused ops.
K_CHUNK_OVERRIDE: int | None = _forced_chunk_from_env()


def _k_chunk(K: int, level_max, k_chunk: int | None, interp: bool) -> int | None:
    """The K_CHUNK an INT8 launch of reduction length K needs, or None when K fits."""
    safe = int8_k_chunk(level_max)
    forced = k_chunk if k_chunk is not None else K_CHUNK_OVERRIDE
    if forced is None:
        return safe if K > safe else None
    align = _INTERP_BK if interp else _K_ALIGN
    if not (0 < forced <= safe and forced % align == 0):
        raise ValueError(f"k_chunk={forced}: must be a positive multiple of {align} "
                         f"(the BK of every tile) and at most {safe} (int32 wrap bound)")
    return forced if K > forced else None


def _as_operand(t: torch.Tensor) -> torch.Tensor:
    """Levels as the kernel reads them: int8 as is, e4m3 as its raw bytes."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def scaled_mm(a: torch.Tensor, bt: torch.Tensor, row_scale: torch.Tensor,
              col_scale: torch.Tensor, alpha: float, out_dtype: torch.dtype,
              k: int | None = None, exact_acc: bool | None = None, *,
              level_max: int | tuple[int, int] | None = None,
              k_chunk: int | None = None, config: str | None = None) -> torch.Tensor:
    """(a @ bt[:, :k].T) * row_scale[:, None] * (col_scale[None, :] * alpha) -> out_dtype.

    a (M, >=K) and bt (N, >=K): int8 or float8_e4m3fn levels, unit stride along K (only the
    first ``k`` columns are read, default a.shape[1]). Scales are fp32 vectors or 0-d.

    INT8 only (the int32 overflow guard, module doc): ``level_max`` bounds |level| (int, or
    (A, B) pair; default: any int8 value), from which ``int8_k_chunk`` derives the longest
    K summed in int32; a longer K runs the chunked kernel. ``k_chunk`` (or
    ``K_CHUNK_OVERRIDE``) forces a shorter chunk, for tests: a multiple of the BK in use
    (32 under the interpreter, 128 compiled) no larger than the safe one. ``config``:
    a tile of ``CONFIGS`` instead of ``tile_config``'s choice (benchmarks).
    """
    assert a.dtype == bt.dtype and a.stride(1) == 1 and bt.stride(1) == 1
    M, N = a.shape[0], bt.shape[0]
    K = a.shape[1] if k is None else k
    out = torch.empty((M, N), dtype=out_dtype, device=a.device)
    if M == 0 or N == 0:
        return out
    fp8 = a.dtype == torch.float8_e4m3fn
    exact = EXACT_FP8_ACC if exact_acc is None else exact_acc
    interp = interpreting()
    chunk = None if fp8 else _k_chunk(K, level_max, k_chunk, interp)
    flags = dict(ROW_VEC=row_scale.dim() == 1, COL_VEC=col_scale.dim() == 1, FP8=fp8,
                 EXACT_ACC=exact and fp8, CHUNKED=chunk is not None, K_CHUNK=chunk or 0)
    # the interpreter truncates fp32 -> bf16 (the GPU rounds to nearest even): there,
    # store fp32 and let torch round
    res = out if not (interp and out_dtype == torch.bfloat16) else \
        torch.empty((M, N), dtype=torch.float32, device=a.device)
    args = (_as_operand(a), _as_operand(bt), res, row_scale, col_scale, float(alpha), M, N, K,
            a.stride(0), bt.stride(0), res.stride(0))
    if interp:
        launch(_scaled_mm_kernel, (triton.cdiv(M, 32) * triton.cdiv(N, 32),),
               *args, **flags, EVEN_K=K % _INTERP_BK == 0, BM=32, BN=32, BK=_INTERP_BK, GROUP_M=4)
    else:
        _launch(args, flags, M, N, K, config)
    if res is not out:
        out.copy_(res)
    return out


# =========================================================================== operand helpers


@triton.jit
def _transpose_kernel(src_ptr, dst_ptr, R, C, lds, ldd, BR: tl.constexpr, BC: tl.constexpr):
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    x = tl.load(src_ptr + r.to(tl.int64)[:, None] * lds + c[None, :],
                mask=(r < R)[:, None] & (c < C)[None, :])
    tl.store(dst_ptr + c.to(tl.int64)[:, None] * ldd + r[None, :], tl.trans(x),
             mask=(c < C)[:, None] & (r < R)[None, :])


def transpose_padded(x: torch.Tensor, pad_to: int = 16) -> torch.Tensor:
    """x (R, C) -> a (C, R_pad) buffer holding x.T in its first R columns (R_pad = R rounded
    up to ``pad_to``, so rows stay 16-byte aligned for vector loads; the pad is unwritten)."""
    R, C = x.shape
    r_pad = -(-R // pad_to) * pad_to
    dst = torch.empty((C, r_pad), dtype=x.dtype, device=x.device)
    if R and C:
        b = 32 if interpreting() else 64
        launch(_transpose_kernel, (triton.cdiv(R, b), triton.cdiv(C, b)), x, dst, R, C,
               x.stride(0), r_pad, BR=b, BC=b)
    return dst


# =========================================================================== format choice

def gx_format(g: torch.Tensor, n: int, g_bits: int, w_bits: int, per_token: bool) -> str:
    """The g_x GEMM's path: "cublas_fp8", "int8" (this file's kernel) or "fp8" (forced).

    A rule, not a measurement at run time. cuBLAS FP8 (``torch._scaled_mm``, row-wise
    scales) wherever it applies: g_y's stochastic levels are exact in e4m3 (|q| <= 15),
    W goes to scaled FP8 when its levels would not be (``formats.w_is_e4m3``), the per-token
    and per-in-feature scales are its row-wise scales, its output is bf16 and N a
    multiple of 16. H100, bench/results/layers_2026-11-24T000659: 1.18-1.62x faster than
    the INT8 kernel over 12 layer shapes (GPT d4096 fc1 1.53 vs 1.91 ms, ViT-B qkv 0.040
    vs 0.066 ms). Elsewhere
    (per-tensor g_y, 8-bit g_y, fp32/fp16 output, pre-Ada GPUs) the INT8 kernel, which
    beat the Triton FP8 path everywhere measured (layers_2026-11-23T214911: 1090-1270 vs
    440-680 TFLOP/s at GPT sizes). HOT_GEMM_FORMAT=int8 / fp8 forces the Triton kernel
    with INT8 / exact-FP8 levels (other chips, experiments).
    """
    if g.device.type != "cuda" or interpreting():
        return "int8"
    return gx_rule(g_bits, w_bits, per_token, g.dtype, n, _capability(g.device.index),
                   os.environ.get("HOT_GEMM_FORMAT"))


def cublas_fp8_mm(a: torch.Tensor, bt: torch.Tensor, row_scale: torch.Tensor,
                  col_scale: torch.Tensor, out_dtype: torch.dtype, *,
                  fast_accum: bool) -> torch.Tensor:
    """a (M, K) e4m3 @ bt (N, K) e4m3 ^T * row_scale * col_scale on cuBLAS: row-wise
    scales (vectors (M,) and (N,): the g_x GEMM) or tensor-wise (two 0-d: the g_W GEMM).

    ``fast_accum``: cuBLAS's fast FP8 accumulation, which keeps the whole sum in the tensor
    core's short accumulator instead of promoting it to fp32 as it goes. The g_x GEMM takes
    it: 5-15% faster (layers_2026-11-23T235509), its products (4-bit level x e4m3) are exact
    and it stays within 0.1-0.2% (relative norm) of its exactly summed reference twin at
    every layer shape of layers_2026-11-24T000659, against the ~20% error of the 4-bit g_y
    itself. The g_W GEMM must not: its reduction runs over the tokens, where a gradient
    component common to every token (a bias-like direction of g_y against x's mean) adds
    up coherently, thousands of terms long, and the short accumulator's truncations add up
    with it. H100: the GPU test's block at 2048 tokens on the unprojected full-rank path
    (since reverted) had proj's g_W 0.027 from fp64 with fast accumulation against 0.0036
    for the exactly summed twin; synthetic g_W operands with a shared component lost 12.5%
    at Llama's 8192 tokens and 19% at ViT-B's 12608, against 0.17% exactly summed, for
    1-6% more GEMM time (bench/results/diag_gw_accum_*). The Hadamard over tokens should
    shrink that error (it gathers such a component into one coefficient of 16: a 16x
    shorter coherent run; reasoning, not measured) but cannot remove it. The g_x GEMM
    showed no such loss (0.17-0.20% either way with g along W's columns,
    diag_gw_accum2_*), and exact accumulation would cost it 10-20% there. (torchao's
    float8 training defaults agree on g_W: fast accumulation for the forward GEMM only;
    it keeps g_x exact too.)"""
    if row_scale.dim() == 0 and col_scale.dim() == 0:
        return torch._scaled_mm(a, bt.t(), row_scale, col_scale, out_dtype=out_dtype,
                                use_fast_accum=fast_accum)
    return torch._scaled_mm(a, bt.t(), row_scale.unsqueeze(1), col_scale.unsqueeze(0),
                            out_dtype=out_dtype, use_fast_accum=fast_accum)
