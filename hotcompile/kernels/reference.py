"""Pure-torch reference twins of every HOT kernel.

Why this module exists: it is (1) the implementation used on CPU and whenever
``kernels="reference"``, and (2) the oracle the fused Triton kernels are tested
against. It therefore fixes the *exact* numerical contract every faster
implementation must meet:

* Block Hadamard transform: Sylvester ``H_n`` (natural order, ``H_n = H_n^T``),
  applied to each run of ``n`` consecutive elements along the last axis, by the
  in-place butterfly ``(a, b) -> (a + b, a - b)`` with strides 1, 2, 4, 8.
* Random bits: Triton's Philox-4x32 at ``PHILOX_ROUNDS`` = 7 rounds
  (``tl.randint4x(seed, k, 7)``); each call yields four 32-bit words = sixteen 8-bit
  uniforms. Element ``(r, c)`` of a ``(R, C)`` tensor uses counter
  ``k = r * ceil(C / 16) + c // 16``, word ``(c % 16) // 4`` and its byte ``c % 4``
  (byte 0 the lowest bits); ``u = (u8 + 0.5) / 256``. Why so few bits: the per-token HQ
  kernel is bound by instruction issue, and the random bits were 28-35% of it (H200,
  2026-11-26, ``bench/results/diag_hq_2026-11-26*``): one Philox call per 16 elements
  instead of 8 halves them, and Philox-4x32-7 already passes TestU01's BigCrush
  (Salmon et al., SC'11, the paper that defines Philox, calls 7 rounds
  "Crush-resistant" and adds 3 as a safety margin; stochastic rounding needs no
  cryptographic one). The price: a rounding probability p is replaced by the nearest
  multiple of 1/256 (rounded half up), so each rounding is biased by at most 2**-9 of
  one quantization step, against quantization noise of up to a whole step (the
  literature's "few-bit stochastic rounding"; 16-bit uniforms, bias 2**-17, until
  2026-11-26).
* Quantization to ``Q = 2**(bits-1) - 1`` symmetric levels (4 bits: -7..7,
  8 bits: -127..127), absmax scale ``s = amax / Q`` per row or per tensor,
  ``s = 1`` where ``amax == 0``; stochastic rounding ``floor(t + u)``,
  nearest rounding ``floor(t + 0.5)``, t = v over s as ``scaled`` defines it (v times
  the correctly rounded 1 / s, one rounding); clamp to ``[-Q, Q]``. A non-finite
  amax makes the scale non-finite, so non-finite inputs give non-finite
  outputs (never a silently finite gradient).
* Scaled e4m3 (the cuBLAS FP8 paths): the value over its scale, rounded onto the e4m3
  grid (``quantize_e4m3``), ``s = amax / 448``; HQ's W takes its per-column scale from W
  itself, ``s = max|W column| / 28`` (``e4m3_bound_scale``), not from the transformed
  values, the saved x (ABC) its per-tensor one, ``s = max|x| / 28``, and g's HLA operand
  ``s = token_block_bound(g) / 448`` (the largest sum of a token block's row maxima).
* Integer GEMMs accumulate exactly (int32 on CUDA via ``torch._int_mm``,
  float64 elsewhere) and are dequantized as ``acc * s_row * s_col / 16``.
"""
from __future__ import annotations

import functools
import math

import torch

from .fp8_forward import scale_reciprocal

PHILOX_KEY_A = 0x9E3779B9
PHILOX_KEY_B = 0xBB67AE85
PHILOX_ROUND_A = 0xD2511F53
PHILOX_ROUND_B = 0xCD9E8D57
PHILOX_ROUNDS = 7     # the module doc says why not Triton's default 10
UNIFORMS_PER_COUNTER = 16   # 8-bit uniforms: four 32-bit words per Philox call
_M32 = 0xFFFFFFFF


# --------------------------------------------------------------------------- Hadamard
@functools.lru_cache(maxsize=None)
def _sylvester_rows(n: int) -> tuple:
    """Sylvester H_n as rows of +-1 ints: H[i][j] = (-1) ** popcount(i & j). Plain Python,
    so the kept-row choice can be made while tensors are being traced (fake mode)."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"block must be a power of two, got {n}")
    return tuple(tuple(-1 if bin(i & j).count("1") % 2 else 1 for j in range(n))
                 for i in range(n))


@functools.lru_cache(maxsize=None)
def _hadamard_cpu(n: int) -> torch.Tensor:
    # outside any dispatch mode: a first call made while a body is traced (fake or proxy
    # tensors) must still cache a real tensor
    from torch.utils._python_dispatch import _disable_current_modes
    with _disable_current_modes():
        return torch.tensor(_sylvester_rows(n), dtype=torch.float32)


def hadamard(n: int, device=None, dtype=torch.float32) -> torch.Tensor:
    """Sylvester Hadamard matrix H_n (entries +-1, H H^T = n I, symmetric)."""
    return _hadamard_cpu(n).to(device=device, dtype=dtype)


def block_fwht(x: torch.Tensor, block: int = 16) -> torch.Tensor:
    """Apply H_block to each run of ``block`` elements along the last axis (butterfly)."""
    *lead, d = x.shape
    if d % block:
        raise ValueError(f"last axis {d} is not a multiple of block {block}")
    y = x.reshape(-1, d // block, block)
    h = 1
    while h < block:
        y = y.reshape(y.shape[0], y.shape[1], block // (2 * h), 2, h)
        a, b = y[:, :, :, 0, :], y[:, :, :, 1, :]
        y = torch.stack((a + b, a - b), dim=3)
        h *= 2
    return y.reshape(*lead, d)


def sequency(row) -> int:
    """Number of sign changes along a +-1 row (a tensor or a sequence)."""
    row = row.tolist() if isinstance(row, torch.Tensor) else row
    return sum(a != b for a, b in zip(row[1:], row[:-1]))


@functools.lru_cache(maxsize=None)
def low_pass_rows(rank: int, select: str = "1d", block: int = 16) -> tuple[int, ...]:
    """Indices of the ``rank`` lowest-frequency rows of H_block.

    ``1d``: sequency order (sign changes). ``2d``: the block is a sqrt(n) x sqrt(n)
    grid of tokens and rows are ordered by the L1 norm of their 2-D sequency pair
    (H_16 = H_4 (x) H_4), the official code's LP_L1 triangle for image tokens.
    """
    if not 1 <= rank <= block:
        raise ValueError(f"rank must be in [1, {block}], got {rank}")
    h = _sylvester_rows(block)
    if select == "1d":
        key = [(sequency(h[i]), i) for i in range(block)]
    elif select == "2d":
        side = math.isqrt(block)
        if side * side != block:
            raise ValueError(f"select='2d' needs a square block, got {block}")
        hs = _sylvester_rows(side)
        seq = [sequency(hs[i]) for i in range(side)]
        key = [(seq[i // side] + seq[i % side], max(seq[i // side], seq[i % side]), i)
               for i in range(block)]
    else:
        raise ValueError(f"select must be '1d' or '2d', got {select!r}")
    return tuple(k[-1] for k in sorted(key)[:rank])


def hla_matrix(rank: int, select: str = "1d", block: int = 16, device=None) -> torch.Tensor:
    """P: the (rank, block) matrix of kept Hadamard rows."""
    return hadamard(block, device=device)[list(low_pass_rows(rank, select, block))]


def pad_rows(x: torch.Tensor, multiple: int) -> torch.Tensor:
    extra = (-x.shape[0]) % multiple
    return torch.nn.functional.pad(x, (0, 0, 0, extra)) if extra else x


def pad_cols(x: torch.Tensor, multiple: int) -> torch.Tensor:
    extra = (-x.shape[-1]) % multiple
    return torch.nn.functional.pad(x, (0, extra)) if extra else x


def sequence_blocks(x: torch.Tensor, block: int, seq_len: int = 0,
                    seq_first: bool = False) -> torch.Tensor:
    """(L, C) rows -> (n_blocks, block, C): ``block`` neighbouring tokens of one sequence each.

    ``seq_len == 0``: the rows are one flat token axis (used at full rank, where blocking
    cannot matter). Otherwise ``L = B * seq_len`` rows ordered ``b * S + s`` (batch-first)
    or ``s * B + b`` (``seq_first``); each sequence is padded with zero tokens to a multiple
    of ``block`` (zeros contribute nothing to g_W = g^T x), so no block straddles two
    sequences. Blocks are ordered batch-major, then by position.
    """
    L, C = x.shape
    if seq_len in (0, None) or (seq_len == L and not seq_first):
        xp = pad_rows(x, block)
        return xp.reshape(xp.shape[0] // block, block, C)
    if L % seq_len:
        raise ValueError(f"{L} rows are not a whole number of sequences of {seq_len}")
    b = L // seq_len
    x3 = x.reshape(seq_len, b, C).transpose(0, 1) if seq_first else x.reshape(b, seq_len, C)
    extra = (-seq_len) % block
    if extra:
        x3 = torch.nn.functional.pad(x3, (0, 0, 0, extra))
    return x3.reshape(-1, block, C)


def hla_rows(L, rank: int, block: int = 16, seq_len=0):
    """Rows of the projected tensor: ``rank`` per block of ``block`` tokens of one sequence.
    SymInt-safe (the ops' fake implementations call it with symbolic sizes)."""
    if isinstance(seq_len, int) and seq_len == 0:
        return (L + block - 1) // block * rank
    return (L // seq_len) * ((seq_len + block - 1) // block) * rank


def hla_project(x: torch.Tensor, rank: int, select: str = "1d", block: int = 16, *,
                seq_len: int = 0, seq_first: bool = False) -> torch.Tensor:
    """(L, C) -> (hla_rows, C) fp32: each block of neighbouring tokens onto the kept rows.

    Also at full rank, where it drops nothing: on the scaled-e4m3 path the transform only
    changes the operands' rounding, yet both ways of skipping it failed the byte-level GPT
    gate (goal within 1% of Inductor; H100, 2026-11-25): the saved x rounded to nearest
    +2.05%; x and g both stochastically rounded +1.85% / +1.18% at seeds 0 / 1 in the
    product code (831049d, with g_W's exact accumulation), though its first experiment
    (b91ddfd) had passed -0.49% / +0.60%. The code is in git history."""
    xb = sequence_blocks(x.float(), block, seq_len, seq_first)
    nb, c = xb.shape[0], xb.shape[2]
    p = hla_matrix(rank, select, block, device=x.device)
    return torch.einsum("rk,bkc->brc", p, xb).reshape(nb * rank, c)


# --------------------------------------------------------------------------- random bits
def _mulhilo(a: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32 bits of a * b for uint32 values held in int64 (no overflow)."""
    a_hi, a_lo = a >> 16, a & 0xFFFF
    hi_p, lo_p = a_hi * b, a_lo * b
    hi = (hi_p + (lo_p >> 16)) >> 16
    lo = (((hi_p & 0xFFFF) << 16) + lo_p) & _M32
    return hi, lo


def philox4x32(seed, counter: torch.Tensor, rounds: int = PHILOX_ROUNDS):
    """Triton's ``tl.randint4x(seed, counter, rounds)``: four uint32 words (as int64)."""
    seed = torch.as_tensor(seed, dtype=torch.int64, device=counter.device)
    k0, k1 = seed & _M32, (seed >> 32) & _M32
    c0 = counter.to(torch.int64) & _M32
    c1 = torch.zeros_like(c0)
    c2 = torch.zeros_like(c0)
    c3 = torch.zeros_like(c0)
    for _ in range(rounds):
        hi_b, lo_b = _mulhilo(c2, PHILOX_ROUND_B)
        hi_a, lo_a = _mulhilo(c0, PHILOX_ROUND_A)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = (k0 + PHILOX_KEY_A) & _M32
        k1 = (k1 + PHILOX_KEY_B) & _M32
    return c0, c1, c2, c3


def philox_counters(cols: int) -> int:
    """Philox counters a row of ``cols`` elements uses: ceil(cols / 16). The kernels' launchers
    pass it as ``groups_per_row``; the channel-major HLA tile starts on a counter."""
    return -(-int(cols) // UNIFORMS_PER_COUNTER)


def uniform8(seed, rows: int, cols: int, device=None) -> torch.Tensor:
    """(rows, cols) fp32 uniforms in (0, 1) with the element-to-bits map in the module doc."""
    w16 = philox_counters(cols)
    counter = torch.arange(rows * w16, device=device, dtype=torch.int64)
    words = torch.stack(philox4x32(seed, counter), dim=-1)            # (rows*w16, 4)
    shifts = torch.tensor((0, 8, 16, 24), device=words.device)
    u8 = (words[..., None] >> shifts) & 0xFF                           # (rows*w16, 4, 4)
    u8 = u8.reshape(rows, w16 * 16)[:, :cols]
    return (u8.to(torch.float32) + 0.5) * (1.0 / 256.0)


def hla_uniforms(seed, channels: int, n_blk: int, rank: int, device=None) -> torch.Tensor:
    """(n_blk * rank, channels) uniforms of HLA's stochastic e4m3 g operand.

    Drawn along the layout the g_W GEMM reads, channel-major: ``uniform8`` of a
    (channels, n_blk * RP) tensor whose rows hold each block's RP = 2**ceil(log2 rank)
    coefficient slots (those past ``rank`` unused), so a kernel thread that owns a channel
    finds all of a block's counters in that channel's row (``hla.py``, ``_tile_shape``)."""
    rp = 1 << max(0, (int(rank) - 1).bit_length())
    u = uniform8(seed, channels, n_blk * rp, device=device)
    return u.reshape(channels, n_blk, rp)[:, :, :rank].reshape(channels, n_blk * rank).t()


# --------------------------------------------------------------------------- quantization
def qmax(bits: int) -> int:
    return 2 ** (bits - 1) - 1


def absmax_scale(v: torch.Tensor, bits: int, per_row: bool, q: float | None = None) -> torch.Tensor:
    """fp32 scale s = amax / Q (shape (R,) per row, () per tensor); 1 where amax == 0.
    Q = ``qmax(bits)``, or ``q`` when given (448 for scaled e4m3)."""
    amax = v.abs().amax(dim=1) if per_row else v.abs().amax()
    s = (amax.double() / (qmax(bits) if q is None else q)).float()   # correctly rounded quotient
    return torch.where(amax == 0, torch.ones_like(s), s)


def scaled(v: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """v (fp32, 2-D) over its scale s (fp32: (R,) per row, or 0-d): v * r rounded once, r =
    1 / s correctly rounded to fp32, where r is finite and non-zero; v / s (IEEE) where it
    is not (s under ~2.9e-39, where r overflows; an inf or NaN s).

    Why a product and not the quotient v / s: every kernel computes it this way, one
    multiply an element (``hadamard.scaled_quotient``), where the correctly rounded quotient
    cost two more FMAs (a Markstein correction) in kernels bound by instruction issue. The
    two differ by at most one ulp of fp32, which moves a stochastic level only where t + u
    lies within that ulp of an integer (0 to 6e-7 of levels), a nearest one also at an exact
    e4m3 tie (up to 3.4e-4 on bf16 inputs with a power-of-two maximum): one step each, far
    below the rounding's own noise (forty-eighth stop; the accuracy gates not re-run). r is divided in fp64 and rounded to fp32, which is the correctly
    rounded fp32 reciprocal on every device (``fp8_forward.scale_reciprocal``)."""
    s = s[:, None] if s.dim() == 1 else s
    r = scale_reciprocal(s)
    return torch.where(torch.isfinite(r) & (r > 0), v * r, v / s)


def quantize(v: torch.Tensor, bits: int, per_row: bool, stochastic: bool, seed=0,
             scale: torch.Tensor | None = None):
    """Symmetric quantization of a 2-D tensor: returns (int8 levels, fp32 scale)."""
    v = v.float()
    s = absmax_scale(v, bits, per_row) if scale is None else scale.float()
    scaled_v = scaled(v, s)
    if stochastic:
        noise = uniform8(seed, v.shape[0], v.shape[1], device=v.device)
    else:
        noise = torch.full_like(scaled_v, 0.5)
    q = torch.floor(scaled_v + noise).clamp_(-qmax(bits), qmax(bits))
    return torch.nan_to_num(q, nan=0.0).to(torch.int8), s


E4M3_MAX = 448.0
E4M3_BOUND_Q = E4M3_MAX / 16    # 28: a block-16 Hadamard sum is at most 16 max|input|


def e4m3_bound_scale(x: torch.Tensor, per_row: bool) -> torch.Tensor:
    """The scale of a Hadamard-transformed operand in scaled e4m3, from its *input*:
    s = max|x| / 28 (per row or per tensor; 1 where the max is 0). Used for HQ's W and
    for the saved x (ABC).

    Why a bound and not the transformed values' own amax: every coefficient of a block-16
    Sylvester transform (entries +-1) is a sum of 16 inputs, so |coefficient| <= 16 max|x| =
    448 s and nothing overflows e4m3. The input's max needs no transform, so it comes from
    the pass that makes W anyway (``weight_cast``, in place of autocast's cast, where a site
    is spliced; else a plain reduction) and the W kernel reads W once, in one launch,
    instead of transforming it twice (amax, then quantize). e4m3 keeps the same relative
    step in every normal binade, so a loose scale only shifts values down its range: on
    Gaussian data the bound is ~4x the coefficients' amax, and values below ~amax / 2**12.8
    (instead of 2**14.8) reach the subnormals. The saved x: ABC then runs one kernel (the
    max is a reduction Inductor fuses with x's producer); the byte-level GPT gate at 4 seeds
    gave -0.17, +1.26, +0.11, +0.41%, mean +0.40%, as the exact amax's 4-7-seed means
    (+0.26..+0.75%), and digits +0.45 points at 8 seeds (H100, 2026-11-26). Its one-seed
    +1.10% of the twelfth stop was the gate's noise (two Inductor runs of one seed differ by
    up to 1.5%). Not for g's HLA operand: three one-seed runs with g bounded this way all
    read +1.2..+1.6% (fifth and eleventh stops), and a CPU measurement of the fifth stop
    found, where channel magnitudes spread over e**(+-3), a g_W error 17% larger, small
    channels' coefficients falling into e4m3's subnormals; g takes the tighter
    ``token_block_bound``. Integer levels keep the exact amax (``absmax_scale``)."""
    return absmax_scale(x.float(), 8, per_row, q=E4M3_BOUND_Q)


def token_block_bound(g: torch.Tensor, block: int = 16, seq_len: int = 0,
                      seq_first: bool = False) -> torch.Tensor:
    """A bound on every HLA coefficient of g (L, C), from its tokens' maxima: fp32 ()
    max over token blocks of sum_t m_t, m_t = max_c |g[t, c]| (blocks as
    ``sequence_blocks`` makes them, padding tokens 0). The block sums are taken in fp64,
    where 16 fp32 terms within 2**25 of each other add exactly, so a sum does not depend
    on its order: the eager ops, Inductor's kernels and this twin get the same word.

    Why: a coefficient is a +-1 sum of its block's 16 values of one channel, so
    |coefficient| <= sum_t |g[t, c]| <= sum_t m_t. It takes g's HLA operand (stochastic
    e4m3) from two passes over g (amax of the projected tile, then quantize) to one: the
    per-token HQ kernel writes m_t as it reads g (``hadamard.hq_act_quant(row_max=True)``),
    and one small kernel takes the block sums and their max (``block_sum_bound``'s twin,
    ``hla.token_block_bound_bits``).
    Unlike 16 max|g| (``e4m3_bound_scale``'s rule, ~4x loose on
    Gaussian rows and up to 16x where one token dominates its block, which is how text
    gradients look; it failed the byte-level GPT gate three times), this bound is tight
    where one token dominates: on a CPU byte-level GPT's g_y it was 1.00-2.09x the exact
    amax (median ~1.3x), against 1.5-12x for 16 max|g| (2026-11-26,
    docs/BENCHMARKS.md "Sixteenth stop")."""
    m = torch.linalg.vector_norm(g, float("inf"), dim=1, dtype=torch.float32)
    return block_sum_bound(m, block, seq_len, seq_first)


def block_sum_bound(m: torch.Tensor, block: int = 16, seq_len: int = 0,
                    seq_first: bool = False) -> torch.Tensor:
    """``token_block_bound`` from the row maxima m (L,) fp32: the largest block sum."""
    blocks = sequence_blocks(m.unsqueeze(1), block, seq_len, seq_first).squeeze(2)  # (nb, block)
    return blocks.double().sum(1).amax().float()


def quantize_e4m3(v: torch.Tensor, per_row: bool, stochastic: bool = False, seed=0,
                  u: torch.Tensor | None = None, scale: torch.Tensor | None = None):
    """Scaled FP8: (v over s (``scaled``) rounded to an e4m3 value, fp32 scale s = amax / 448, or the
    given ``scale``, which must bound |v| / 448: ``e4m3_bound_scale``).

    The 8-bit operand format of cuBLAS's FP8 GEMM: 3 mantissa bits, so a relative step of
    2**-3..2**-4 instead of int8's absolute step amax / 127: on a Gaussian W about 3.5x
    int8's RMS error (0.026 vs 0.0074 relative, ``test_reference``), still far below the
    4-bit g_y it multiplies. NaN -> 0 like ``quantize``; the clamp only catches the
    quotient's last-bit overshoot.

    Rounding: to the nearest e4m3 (ties to even), or with ``stochastic`` to one of the two
    e4m3 neighbours of t (``stochastic_e4m3``, t taken as ``folded_scaled``: ``scaled(v,
    s)`` but for one rounding where |t| < 2**-6, and the IEEE quotient past r < 2**-6) with u
    from ``uniform8``
    (element (r, c) of the (R, C) tensor), or the given ``u``; the result is always an
    e4m3 value (at most 448: |t| <= 448 = 14 * 2**5 is itself on the grid of its binade).
    """
    v = v.float()
    s = absmax_scale(v, 8, per_row, q=E4M3_MAX) if scale is None else scale.float()
    if stochastic:
        t = folded_scaled(v, s).clamp(-E4M3_MAX * FOLD, E4M3_MAX * FOLD)
        t = torch.nan_to_num(t, nan=0.0)
        if u is None:
            u = uniform8(seed, t.shape[0], t.shape[1], device=t.device)
        t = stochastic_e4m3(t, u, folded=True)
    else:
        t = scaled(v, s).clamp(-E4M3_MAX, E4M3_MAX)
        t = torch.nan_to_num(t, nan=0.0)
    return t.to(torch.float8_e4m3fn), s


FOLD = 2.0 ** -120
FOLD_MIN_RECIPROCAL = 2.0 ** -6     # r * FOLD is still a normal fp32 (>= 2**-126): exact


def folded_scaled(v: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """t * 2**-120 for t = v over s, the input of the stochastic e4m3 step
    (``stochastic_e4m3(folded=True)``): v * (r * 2**-120) rounded once to fp32 (subnormals
    kept), r = 1 / s correctly rounded, where r is finite and at least 2**-6; (v / s) *
    2**-120, the IEEE quotient then the scaling, where it is not (an amax past 448 * 2**6,
    a subnormal, inf or NaN scale).

    Why: the kernels fold 2**-120 into the reciprocal, one multiply an element fewer than
    ``scaled`` then * 2**-120 (``hadamard.folded_quotient``). Where r >= 2**-6, r * 2**-120
    is exact and so is the fp64 product of two fp32 values: ``.float()`` is the one
    rounding. It equals ``scaled(v, s) * 2**-120`` but where that is subnormal (|t| <
    2**-6), there one rounding instead of two, both to a multiple of 2**-29 in t."""
    s = s[:, None] if s.dim() == 1 else s
    r = scale_reciprocal(s)
    ok = torch.isfinite(r) & (r >= FOLD_MIN_RECIPROCAL)
    fold = torch.where(ok, r * FOLD, torch.ones_like(r))
    return torch.where(ok, (v.double() * fold.double()).float(), (v / s) * FOLD)


def stochastic_e4m3(t: torch.Tensor, u: torch.Tensor, folded: bool = False) -> torch.Tensor:
    """fp32 t (finite) rounded to one of its two e4m3 neighbours: the one further from zero
    with probability equal to |t|'s distance from the nearer in units of their spacing
    (unbiased, like ``quantize``'s levels), drawn by u = (b + 0.5) / 256 from ``uniform8``.
    ``folded``: t is given as t * 2**-120 (``folded_scaled``).

    Computed on the bits, as the kernels do (``hadamard.stochastic_e4m3``): t * 2**-120 maps
    e4m3's smallest normal 2**-6 onto fp32's 2**-126, so e4m3's fixed subnormal spacing
    2**-9 lands on fp32's subnormals, whose mantissa bits sit where a normal's do; adding
    u * 2**20 = (b << 12) + 2**11 to the bits and clearing the 20 below e4m3's 3 mantissa
    bits rounds the magnitude up exactly when frac + u >= 1 (frac: the distance from the
    lower neighbour over the spacing, in 2**-20 steps), a carry out of the mantissa being
    the step into the next binade; times 2**120 scales back. Both products are exact but
    the first where it is subnormal (|t| < 2**-6), rounding t to a multiple of 2**-29.
    So for t >= 0 this is floor(t / step + u) * step, step = 2**(max(floor(log2 t), -6) -
    3), the float form the kernels used until the fifty-first stop; for t < 0 it
    is that of |t| with its sign (the same law: the byte that rounded a negative t towards
    zero now rounds it away, with the same probability), and -0 stays -0. Subnormal
    products (CPU and CUDA eager keep them; ``torch.set_flush_denormal(True)`` would not)."""
    inc = (u * 1048576.0).to(torch.int32)        # (b + 0.5) * 2**12: exact
    ts = t.float() if folded else t.float() * FOLD
    bits = (ts.view(torch.int32) + inc) & -(1 << 20)
    return bits.view(torch.float32) * 2.0 ** 120


def dequantize(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return q.float() * (s[:, None] if s.dim() == 1 else s)


def int_matmul(a: torch.Tensor, b: torch.Tensor, k_chunk: int | None = None) -> torch.Tensor:
    """Exact product of two int8 level matrices, as fp32 (int32 on CUDA where cuBLASLt allows).

    Why chunks: ``torch._int_mm`` sums in int32, which wraps silently once K * 128**2
    reaches 2**31 (K ~ 131k: the HLA g_W GEMM over ceil(L/16) * rank tokens of a long
    run). So K is split into chunks of at most ``k_chunk`` (default: the longest multiple
    of 8 with k_chunk * 128**2 < 2**31, i.e. 131,064, safe for any int8 value), each chunk
    summed exactly in int32 (or float64 off CUDA) and the chunks added in float64, exact
    below 2**53: the result is the correctly rounded fp32 of the exact integer product on
    every path. One chunk (every K up to 131k) takes the unchunked code path unchanged.
    ``k_chunk`` may be forced smaller (a multiple of 8) to test the splitting on any device.
    """
    m, k = a.shape
    n = b.shape[1]
    safe = ((2**31 - 1) // (128 * 128)) // 8 * 8
    chunk = safe if k_chunk is None else int(k_chunk)
    if not (0 < chunk <= safe and chunk % 8 == 0):
        raise ValueError(f"k_chunk={k_chunk}: must be a positive multiple of 8, at most {safe}")
    if a.is_cuda and m > 16 and k % 8 == 0 and n % 8 == 0:
        part = lambda lo, hi: torch._int_mm(a[:, lo:hi].contiguous(),
                                            b[lo:hi].t().contiguous().t())
    else:
        part = lambda lo, hi: a[:, lo:hi].double() @ b[lo:hi].double()
    if k <= chunk:
        return part(0, k).float()
    acc = part(0, chunk).double()
    for lo in range(chunk, k, chunk):            # k % 8 == 0 on the _int_mm path: so is each chunk
        acc += part(lo, min(lo + chunk, k)).double()
    return acc.float()


# --------------------------------------------------------------------------- HOT ops
def weight_cast(p: torch.Tensor, dtype: torch.dtype, row_max: bool = False):
    """Autocast's copy of an fp32 parameter p (O, I) and its maxima: (p.to(dtype), max
    |p.to(dtype)[:, i]| as the int32 bits of an fp32 value, NaN propagating; the same per
    row with ``row_max``, else an empty int32 tensor). The column maxima are the input of
    ``e4m3_bound_scale`` for the copy, which the e4m3 W operand is made from; the row
    maxima the row-wise FP8 forward's W scale (``kernels/fp8_forward.weight_operand``)."""
    w = p.to(dtype)
    m = torch.linalg.vector_norm(w, float("inf"), dim=0, dtype=torch.float32)
    r = (torch.linalg.vector_norm(w, float("inf"), dim=1, dtype=torch.float32) if row_max
         else torch.zeros(0, dtype=torch.float32, device=p.device))
    return w, m.view(torch.int32), r.view(torch.int32)


def weight_operands(w: torch.Tensor, col_max: torch.Tensor, fwd_max, forward: str,
                    hq: bool = True):
    """The forward's operands made from an owned weight copy w (O, I) (``weight_cast``'s,
    with its column maxima ``col_max``; ``passes/weight_cast.py``): (HQ's W operand, its
    scale, the FP8 forward's W operand, its scale; empty tensors for the last two with a bf16
    forward).

    HQ's: ``hq_weight(w, 8, e4m3=True)`` with its scale times 1/16, the operand of the
    cuBLAS g_x GEMM (``fused._gx``, which then does not read W in backward). ``forward``
    ("fp8" / "fp8_rowwise"; "bf16": none): ``fp8_forward.weight_operand`` of w's (I, O)
    view, its scale from ``fwd_max`` (int32 bits of W's row maxima row-wise, of its column
    maxima tensor-wise) without a reduction over W. ``hq=False``: the first two are
    ``plain_weight_e4m3(w)`` instead (``e4m3_gx_backward``'s W operand)."""
    from . import fp8_forward
    e4m3 = torch.float8_e4m3fn
    if hq:
        q, s = hq_weight(w, 8, e4m3=True)
        s = s * (1.0 / 16)
    else:
        q, s = plain_weight_e4m3(w)
    if forward == "bf16":
        return q, s, w.new_empty((0,), dtype=e4m3), w.new_empty((0,), dtype=torch.float32)
    return (q, s, *fp8_forward.weight_operand(w.t(), forward == "fp8_rowwise",
                                             max_bits=fwd_max))


# GELU's formulas (``gelu``), shared by the one-pass kernel (``producer_cast``) and the pass
# that finds them in a graph (``passes/forward._gelu_formula``): F.gelu's ``approximate``
GELU_APPROXIMATIONS = ("none", "tanh")
SQRT_HALF = 0.7071067811865476             # exact GELU: erf(x * sqrt(1/2))
SQRT_2_OVER_PI = 0.7978845608028654        # tanh's: tanh((x + x**3 * 0.044715) * sqrt(2/pi))
TANH_CUBIC = 0.044715


def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """GELU of fp32 x, op by op in the order Inductor compiles ``F.gelu`` in: exact,
    (x * 0.5) * (erf(x * sqrt(1/2)) + 1); ``approximate="tanh"``, (x * 0.5) * (tanh((x +
    x * x * x * 0.044715) * sqrt(2/pi)) + 1), which is also Hugging Face's ``gelu_new``
    (its ``pow(x, 3)`` compiled as (x * x) * x)."""
    if approximate not in GELU_APPROXIMATIONS:
        raise ValueError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
    if approximate == "tanh":
        t = torch.tanh((x + x * x * x * TANH_CUBIC) * SQRT_2_OVER_PI)
    else:
        t = torch.erf(x * SQRT_HALF)
    return (x * 0.5) * (t + 1.0)


def gelu_e4m3(h: torch.Tensor, approximate: str = "none"):
    """GELU (exact, or tanh's: ``approximate``) of h (R, W) with the row-wise e4m3 copy of
    its output, the FP8 forward's x operand of a linear fed by GELU: (y = GELU(h) in h's
    dtype, levels (R, W), scales (R,) fp32, row maxima max |y| (R,) fp32). Levels and
    scales are ``fp8_forward.e4m3_cast(y, rowwise=True)``'s; the maxima give the saved x's
    bound (``fp8_forward.max_bits``). ``producer_cast.gelu_e4m3`` is the one-pass kernel.

    GELU is ``gelu`` in fp32, rounded once to h's dtype: the graph's GELU, which this
    replaces. In the far negative tail (x < -4, where erf(x) + 1 or tanh + 1 cancels)
    compiled code (Inductor's, the kernel's) and eager CPU ``F.gelu`` differ from it by up
    to 1e-6."""
    from . import fp8_forward
    y = gelu(h.float(), approximate).to(h.dtype)
    y32 = y.float()
    m = torch.linalg.vector_norm(y32, float("inf"), dim=1)
    s = fp8_forward.scale_from_amax(m)
    return y, fp8_forward.e4m3_levels(y32, scale_reciprocal(s)[:, None]), s, m


def hq_weight(w: torch.Tensor, bits: int, block: int = 16, e4m3: bool = False):
    """The W side of HQ: H along O (the reduction axis), RTN to ``bits`` levels (or, with
    ``e4m3``, to scaled FP8: ``quantize_e4m3``), one scale per column.

    Returns the transposed operand ``(I, O_pad)`` (int8 levels or e4m3) and its (I,)
    scale, so the GEMM reads both operands K-contiguous. Per-column absmax (a scale per
    in-feature) fits the GEMM epilogue and is finer than the official per-tensor SAWB clip;
    in e4m3 the column's max of W itself bounds it (``e4m3_bound_scale``).
    """
    wt = w.float().t()
    wh = block_fwht(pad_cols(wt, block), block)                         # (I, O_pad)
    if e4m3:
        return quantize_e4m3(wh, per_row=True, scale=e4m3_bound_scale(wt, per_row=True))
    return quantize(wh, bits, per_row=True, stochastic=False)


def hq_grad_input(g: torch.Tensor, w: torch.Tensor, bits: int, per_token: bool, seed=0,
                  block: int = 16, w_bits: int | None = None, w_e4m3: bool = False) -> torch.Tensor:
    """g_x ~= g_y W via block-Hadamard quantization along O: g_y to ``bits`` levels
    (stochastic), W to ``w_bits`` levels (nearest; default: ``bits``), or to scaled FP8
    with ``w_e4m3`` (``gx_w_e4m3``: the cuBLAS FP8 GEMM's W). bits=0: exact.

    W is taken as the forward GEMM used it, in g's dtype: an fp32 parameter passed for
    autocast's bf16 copy of it (``HOTConfig.recompute_operands``) is rounded first."""
    w = w.to(g.dtype)
    gh = block_fwht(pad_cols(g.float(), block), block)                 # (L, O_pad)
    if bits == 0:
        wh = block_fwht(pad_cols(w.float().t(), block), block)
        return (gh.double() @ wh.double().t() / block).to(g.dtype)
    qg, sg = quantize(gh, bits, per_row=per_token, stochastic=True, seed=seed)
    qw, sw = hq_weight(w, bits if w_bits is None else w_bits, block, e4m3=w_e4m3)
    if w_e4m3:       # products of levels and e4m3 values are exact in fp64, and so is the sum
        acc = (qg.double() @ qw.double().t()).float()
    else:
        acc = int_matmul(qg, qw.t())                                   # (L, I)
    sg = sg[:, None] if sg.dim() == 1 else sg
    return (acc * sg * (sw[None, :] / block)).to(g.dtype)


def k_major_saved(q: torch.Tensor, pad_to: int = 16) -> torch.Tensor:
    """The saved activation's layout: (L', I) values held in a K-major (I, L'_pad) buffer
    (L'_pad = L' rounded up to ``pad_to``, pad zeroed), returned as its (L', I) view with
    strides (1, L'_pad). The g_W GEMMs read that buffer directly (``fused._k_major``);
    the op's fake gives these strides, so every path of the op must."""
    rows, cols = q.shape
    ld = -(-rows // pad_to) * pad_to
    buf = q.new_zeros((cols, ld))
    buf[:, :rows] = q.t()
    return buf[:, :rows].t()


def abc_compress(x: torch.Tensor, rank: int, select: str = "1d", bits: int = 8,
                 block: int = 16, *, seq_len: int = 0, seq_first: bool = False,
                 fmt: str = "int8"):
    """The saved activation: HLA-projected x (L', I), quantized per tensor with RTN:
    ``bits`` levels (``fmt="int8"``) or scaled e4m3 (``fmt="e4m3"``: the cuBLAS FP8 g_W
    GEMM's operand, ``formats.gw_rule``; ``bits`` unused; its scale the bound max|x| / 28,
    ``e4m3_bound_scale``)."""
    xt = hla_project(x, rank, select, block, seq_len=seq_len, seq_first=seq_first)
    if fmt == "e4m3":
        return quantize_e4m3(xt, per_row=False, scale=e4m3_bound_scale(x, per_row=False))
    if fmt != "int8":
        raise ValueError(f"abc_compress: fmt must be 'int8' or 'e4m3', got {fmt!r}")
    return quantize(xt, bits, per_row=False, stochastic=False)


def hla_grad_weight(g: torch.Tensor, xt: torch.Tensor, x_scale: torch.Tensor, rank: int,
                    select: str = "1d", bits: int = 8, seed=0, block: int = 16, *,
                    seq_len: int = 0, seq_first: bool = False,
                    out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """g_W ~= g_y^T x over the low-pass token coefficients, in ``out_dtype`` (default g's:
    fp32 where the graph casts g_W to an fp32 parameter's gradient anyway,
    ``passes/grad_cast.py``).

    ``xt`` is the projected x: int8 levels (with ``x_scale``), floats (x_scale = 1), or
    scaled e4m3 (``abc_compress(fmt="e4m3")``), in which case g's coefficients become
    scaled e4m3 with stochastic rounding (``quantize_e4m3``, its scale from the bound
    ``token_block_bound`` / 448, its uniforms drawn channel-major: ``hla_uniforms``;
    ``bits`` unused): the operands of the cuBLAS FP8 GEMM.
    bits=0 skips quantizing the gradient (with rank=block this is exact).
    """
    gt = hla_project(g, rank, select, block, seq_len=seq_len, seq_first=seq_first)  # (L', O)
    if xt.dtype == torch.float8_e4m3fn:
        u = hla_uniforms(seed, gt.shape[1], gt.shape[0] // rank, rank, device=g.device)
        bound = token_block_bound(g, block, seq_len, seq_first)
        qg, sg = quantize_e4m3(gt, per_row=False, stochastic=True, seed=seed, u=u,
                               scale=absmax_scale(bound, 8, False, q=E4M3_MAX))
        # products of e4m3 values are exact in fp64; the sum nearly so (the GEMM's is not)
        acc = (qg.double().t() @ xt.double()).float()
    elif bits == 0:
        xf = xt.double() * x_scale.double()
        return (gt.double().t() @ xf / block).to(out_dtype or g.dtype)
    else:
        qg, sg = quantize(gt, bits, per_row=False, stochastic=True, seed=seed)
        acc = int_matmul(qg.t(), xt) if xt.dtype == torch.int8 else \
            (qg.double().t() @ xt.double()).float()
    return (acc * (sg * x_scale.float() / block)).to(out_dtype or g.dtype)


GRAD_E4M3_FLOOR = 2.0 ** -100
"""The smallest amax ``grad_e4m3_scale`` divides: the scale's reciprocal stays finite (a
kernel multiplies by it), and a gradient that small quantizes to zero either way."""


def grad_e4m3_scale(g: torch.Tensor) -> torch.Tensor:
    """fp32 (L,) scales of g's plain e4m3 operand, one per token: max(max_c |g[t, c]|,
    2**-100) / 448, correctly rounded; NaN and inf stay (that row's values then quantize
    to 0, as ``quantize_e4m3``'s NaN).

    Why per token, not per tensor: one scale for the tensor put a confident token's whole
    row (all of it far below the batch's largest gradient) into e4m3's subnormals, and
    the byte-level GPT gate read +21.7% (H200, 2026-11-29, 35th stop); per token, each
    row's largest value maps to 448."""
    amax = torch.linalg.vector_norm(g, float("inf"), dim=1, dtype=torch.float32)
    return (torch.clamp_min(amax, GRAD_E4M3_FLOOR).double() / E4M3_MAX).float()


def grad_uniforms(seed, rows: int, cols: int, device=None) -> torch.Tensor:
    """(rows, cols) uniforms of g's plain e4m3 operand: ``uniform8``, row-major, the map of
    every per-token operand (the per-token kernel's rows are tokens:
    ``hadamard.grad_e4m3``)."""
    return uniform8(seed, rows, cols, device=device)


def grad_e4m3(g: torch.Tensor, seed=0):
    """g (L, C) -> (stochastic scaled e4m3 (L, C), fp32 (L,) scales ``grad_e4m3_scale``):
    the g_x GEMM's A operand of a layer whose g_x takes no Hadamard
    (``exact_gx_gemm="e4m3"``). Unbiased like every stochastic operand here; a scale per
    token, so a row's small entries keep their own e4m3 binade (3 mantissa bits) down to
    its max * 2**-12.8 and reach the subnormals below."""
    s = grad_e4m3_scale(g)
    u = grad_uniforms(seed, g.shape[0], g.shape[1], device=g.device)
    return quantize_e4m3(g, per_row=True, stochastic=True, u=u, scale=s)


def plain_weight_e4m3(w: torch.Tensor):
    """W (O, I) -> (W^T as scaled e4m3 (I, O), fp32 (I,) scale max |W[:, i]| / 448),
    nearest rounding: the g_x GEMM's B operand without a transform (``grad_e4m3``'s
    partner), one scale per output column of g_x."""
    return quantize_e4m3(w.float().t().contiguous(), per_row=True)


def e4m3_gx_backward(g: torch.Tensor, w: torch.Tensor, xt: torch.Tensor,
                     x_scale: torch.Tensor, rank: int, seed=0, block: int = 16, *,
                     seq_len: int = 0, seq_first: bool = False,
                     gw_dtype: torch.dtype | None = None, gw_bits: int = 8):
    """(g_x, g_W) of a layer whose g_x keeps no Hadamard nor 4-bit levels but runs on FP8:
    g_x = ``grad_e4m3``(g) @ ``plain_weight_e4m3``(W)^T, with fp32 accumulation (the
    products of e4m3 values are exact in fp64; the GEMM sums in fp32), and g_W as
    ``hla_grad_weight`` (g's levels of ``gw_bits`` where x is saved as int8 levels). Bits:
    g_x's from ``seed``, g_W's from ``seed + 1``."""
    gq, gs = grad_e4m3(g, seed)
    wq, ws = plain_weight_e4m3(w.to(g.dtype))
    acc = (gq.double() @ wq.double().t()).float()
    gx = (acc * gs[:, None] * ws[None, :]).to(g.dtype)
    gw = hla_grad_weight(g, xt, x_scale, rank, "1d", gw_bits, seed + 1, block,
                         seq_len=seq_len, seq_first=seq_first, out_dtype=gw_dtype)
    return gx, gw


def linear_backward(g: torch.Tensor, w: torch.Tensor, xt: torch.Tensor, x_scale: torch.Tensor,
                    rank: int, gx_bits: int, w_bits: int, gw_bits: int, per_token: bool, seed=0,
                    block: int = 16, *, seq_len: int = 0, seq_first: bool = False,
                    w_e4m3: bool = False, gw_dtype: torch.dtype | None = None):
    """A linear layer's whole HOT backward from one seed: (g_x, g_W). The g_x side draws
    its bits from ``seed``, the g_W side from ``seed + 1`` (another Philox key). g_W in
    ``gw_dtype`` (default g's)."""
    gx = hq_grad_input(g, w, gx_bits, per_token, seed, block, w_bits=w_bits, w_e4m3=w_e4m3)
    gw = hla_grad_weight(g, xt, x_scale, rank, "1d", gw_bits, seed + 1, block,
                         seq_len=seq_len, seq_first=seq_first, out_dtype=gw_dtype)
    return gx, gw
