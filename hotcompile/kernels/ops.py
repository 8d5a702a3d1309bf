"""The ``hot::`` custom ops the graph passes insert.

Why plain ``torch.library.custom_op``: the ops are inserted into the joint graph after
AOT tracing, where a ``triton_op`` would not be decomposed anyway (it runs as an extern
call either way, see TORCH_NOTES.md), and ``custom_op`` lets one Python body choose the
fused Triton implementation on CUDA and the reference twin elsewhere.

Randomness: seeds come from torch's generator of the tensor's device (``torch.randint``
on that device), so ``torch.manual_seed`` makes a run reproducible and CUDA-graph replays
draw fresh bits (the generator is capture-aware). In a compiled backward the pass inserts
one ``hot::draw_seeds`` for the whole graph and hands each op its element (``seeds``,
``seed_index``: a view, no launch); an op called without them draws its own.
"""
from __future__ import annotations

import os
from typing import Optional

import torch
from torch import Tensor

from . import formats, reference as ref
from ..runtime import rank as RANK
from ..runtime.lqs import TABLE as LQS, capturing

_SEED_HIGH = 2 ** 62
_RANK_STRIDE = 0x2545F4914F6CDD1D % _SEED_HIGH   # odd, so distinct ranks get distinct offsets


def _rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def draw_seed(device: torch.device) -> Tensor:
    """A Philox seed from torch's generator of ``device``, offset by the distributed rank.

    Why the rank: with the same ``torch.manual_seed`` on every rank (the usual recipe, so the
    initial weights agree) the ranks would otherwise draw identical rounding bits, whose
    errors are correlated and do not average out in the gradient all-reduce
    (docs/DISTRIBUTED.md). The offset keeps runs reproducible for a given world size.
    """
    return _by_rank(torch.randint(0, _SEED_HIGH, (), device=device, dtype=torch.int64))


def _by_rank(seeds: Tensor) -> Tensor:
    rank = _rank()
    return seeds + (rank * _RANK_STRIDE) % _SEED_HIGH if rank else seeds


@torch.library.custom_op("hot::draw_seeds", mutates_args=(),
                         tags=(torch.Tag.nondeterministic_seeded,))
def draw_seeds(like: Tensor, n: int) -> Tensor:
    """``n`` Philox seeds on ``like``'s device, each offset by the rank as ``draw_seed``'s:
    one launch for every HOT op of a backward graph instead of one per op."""
    return _by_rank(torch.randint(0, _SEED_HIGH, (n,), device=like.device, dtype=torch.int64))


@draw_seeds.register_fake
def _(like, n):
    return torch.empty((n,), dtype=torch.int64, device=like.device)


def _seed(g: Tensor, seeds: Optional[Tensor], seed_index: int) -> Tensor:
    """The op's seed: its element of the graph's ``draw_seeds`` (a view), or a fresh draw."""
    return seeds.select(0, seed_index) if seeds is not None else draw_seed(g.device)


def triton_usable(t: Tensor, kernels: str) -> bool:
    """Whether this call should run the fused Triton kernels."""
    if kernels == "reference":
        return False
    if t.is_cuda:
        return True
    if kernels == "triton":
        if os.environ.get("TRITON_INTERPRET") == "1":
            return True
        raise RuntimeError("HOTConfig.kernels='triton' needs a CUDA tensor "
                           "(or TRITON_INTERPRET=1 on CPU); got a CPU tensor")
    return False


def _fused():
    from . import fused  # imported lazily: triton is only needed on the fused path
    return fused


def _hq_scaling(scale: str, site: str, g: Tensor, bits: int, block: int) -> tuple[bool, bool]:
    """(per-token scales?, also warm the other scaling's kernels?) for a g_x quantization:
    the config's fixed choice, or LQS's for this site (which, while it calibrates on CUDA
    outside capture, compiles both so that a later CUDA-graph capture meets no first compile)."""
    if scale != "lqs":
        return scale == "token", False
    calibrating = g.is_cuda and LQS.calibrating(site)
    return LQS.per_token(site, g, bits, block), calibrating and not capturing(g)


def _cuda_capability(t: Tensor) -> Optional[tuple[int, int]]:
    return torch.cuda.get_device_capability(t.device) if t.is_cuda else None


def _twin_w_e4m3(g: Tensor, w: Tensor, bits: int, w_bits: int, per_token: bool,
                 block: int) -> bool:
    """Whether the reference twin takes W as scaled e4m3 (``reference.hq_grad_input``'s
    ``w_e4m3``): where the fused g_x on this device does (``formats.gx_rule``: cuBLAS FP8,
    an 8-bit W), so that ``kernels="reference"`` on a GPU computes what the fused path
    computes there. Before, it kept integer W levels (about 4x more exact than e4m3), and
    the GPU compiled test's fused gradients came out up to 2x further from fp64 than the
    twin's (proj's g_W 0.0075 vs 0.0036, H100 2026-11-25, diag_gw_accum2_*); with this rule
    the two agree within 0.4% at every gradient (proj 0.00912 vs 0.00909,
    diag_twin_2026-11-25T2307_h100.txt). Where the fused op itself falls
    back to the reference (other blocks, levels outside 2..8 bits) it keeps integer levels."""
    cap = _cuda_capability(g)
    if cap is None or block != 16 or not (2 <= bits <= 8 and 2 <= w_bits <= 8):
        return False
    path = formats.gx_rule(bits, w_bits, per_token, g.dtype, w.shape[1], cap,
                           os.environ.get("HOT_GEMM_FORMAT"))
    return formats.w_is_e4m3(path, w_bits)


# ----------------------------------------------------------------------- HQ (g_x)
def hq_grad_input_body(g: Tensor, w: Tensor, bits: int, w_bits: int, block: int, scale: str,
                       site: str, kernels: str, seeds: Optional[Tensor] = None,
                       seed_index: int = 0) -> Tensor:
    """g_x ~= g W with block Hadamard along O: g to ``bits`` levels (stochastic), W to
    ``w_bits`` levels. g: (L, O), w: (O, I). ``site``: the runtime key (LQS table)."""
    per_token, warm_other = _hq_scaling(scale, site, g, bits, block)
    seed = _seed(g, seeds, seed_index)
    if triton_usable(g, kernels):
        return _fused().hq_grad_input(g, w, bits, per_token, seed, block,
                                      warm_other_scale=warm_other, w_bits=w_bits)
    return ref.hq_grad_input(g, w, bits, per_token, seed, block, w_bits=w_bits,
                             w_e4m3=_twin_w_e4m3(g, w, bits, w_bits, per_token, block))


hq_grad_input = torch.library.custom_op("hot::hq_grad_input", mutates_args=())(
    hq_grad_input_body)


@hq_grad_input.register_fake
def _(g, w, bits, w_bits, block, scale, site, kernels, seeds=None, seed_index=0):
    torch._check(g.shape[1] == w.shape[0], lambda: "hq_grad_input: g and w disagree on O")
    return g.new_empty((g.shape[0], w.shape[1]))


# ----------------------------------------------------------------------- ABC (forward)
def abc_compress_body(x: Tensor, rank: int, bits: int, block: int, seq_len: int,
                      seq_first: bool, kernels: str, fmt: str,
                      amax: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """x (L, I) -> (HLA-projected x (hla_rows, I), fp32 scale ()): int8 levels, or with
    ``fmt="e4m3"`` scaled FP8, the cuBLAS g_W GEMM's operand (``formats.gw_rule``), held
    K-major (``reference.k_major_saved``) on every path.

    Blocks hold ``block`` neighbouring tokens of one sequence of ``seq_len`` tokens
    (rows ``b*S + s``, or ``s*B + b`` with ``seq_first``); ``seq_len=0``: one flat axis.
    ``amax``: max |x| as a (1,) int32 word of fp32 bits (``hadamard.input_amax_bits``'s
    form), where the graph has it already (the FP8 forward's cast of the same x,
    ``fp8_forward.e4m3_cast(bound=True)``): the e4m3 levels' bound, without a read of x
    of its own. The reference twin computes it from x: the same value."""
    lay = dict(seq_len=seq_len, seq_first=seq_first, fmt=fmt)
    if triton_usable(x, kernels):
        return _fused().abc_compress(x, rank, "1d", bits, block, amax=amax, **lay)
    q, s = ref.abc_compress(x, rank, "1d", bits, block, **lay)
    return ref.k_major_saved(q), s


abc_compress = torch.library.custom_op("hot::abc_compress", mutates_args=())(
    abc_compress_body)


@abc_compress.register_fake
def _(x, rank, bits, block, seq_len, seq_first, kernels, fmt, amax=None):
    rows = ref.hla_rows(x.shape[0], rank, block, seq_len)
    dtype = torch.float8_e4m3fn if fmt == "e4m3" else torch.int8
    ld = (rows + 15) // 16 * 16          # reference.k_major_saved: K-major, as every path
    return (x.new_empty_strided((rows, x.shape[1]), (1, ld), dtype=dtype),
            x.new_empty((), dtype=torch.float32))


# ----------------------------------------------------------------------- GELU + FP8 cast (forward)
def gelu_e4m3_body(h: Tensor, kernels: str,
                   approximate: str = "none") -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """GELU of h (R, W) (exact, or tanh's: ``approximate``) and the row-wise e4m3 copy of
    its output (``reference.gelu_e4m3``):
    put in place of a GELU whose output is a rewritten site's x under the row-wise FP8
    forward (``passes/forward.py``), where Inductor's fusion of GELU and the cast loops
    over each row twice. One pass on the GPU (``producer_cast``). Every output is
    row-major (h is read as such)."""
    h = h.contiguous()
    if triton_usable(h, kernels):
        from . import producer_cast
        if producer_cast.fusable(h):
            return producer_cast.gelu_e4m3(h, approximate)
    return ref.gelu_e4m3(h, approximate)


gelu_e4m3 = torch.library.custom_op("hot::gelu_e4m3", mutates_args=())(gelu_e4m3_body)


@gelu_e4m3.register_fake
def _(h, kernels, approximate="none"):
    R = h.shape[0]
    return (torch.empty_like(h, memory_format=torch.contiguous_format),
            h.new_empty(h.shape, dtype=torch.float8_e4m3fn),
            h.new_empty((R,), dtype=torch.float32), h.new_empty((R,), dtype=torch.float32))


# ----------------------------------------------------------------------- HLA (g_W)
def _gw_dtype(g: Tensor, gw_fp32: bool) -> torch.dtype:
    return torch.float32 if gw_fp32 else g.dtype


def hla_grad_weight_body(g: Tensor, xq: Tensor, x_scale: Tensor, rank: int, bits: int,
                         block: int, seq_len: int, seq_first: bool, measure: str, kernels: str,
                         seeds: Optional[Tensor] = None, seed_index: int = 0,
                         gw_fp32: bool = False) -> Tensor:
    """g_W ~= g^T x over the kept low-pass token coefficients. g: (L, O) -> (O, I).

    ``measure``: a rank-calibration key (``runtime.rank``): also measure, on this step's
    real g and x, g_W's error at every rank against this full-rank result. ``gw_fp32``:
    g_W in fp32 rather than g's dtype (``passes/grad_cast.py``)."""
    seed = _seed(g, seeds, seed_index)
    lay = dict(seq_len=seq_len, seq_first=seq_first, out_dtype=_gw_dtype(g, gw_fp32))
    if measure:
        RANK.measure(measure, g, xq, x_scale, block, seq_len, seq_first)
    if triton_usable(g, kernels):
        return _fused().hla_grad_weight(g, xq, x_scale, rank, "1d", bits, seed, block, **lay)
    return ref.hla_grad_weight(g, xq, x_scale, rank, "1d", bits, seed, block, **lay)


hla_grad_weight = torch.library.custom_op("hot::hla_grad_weight", mutates_args=())(
    hla_grad_weight_body)


@hla_grad_weight.register_fake
def _(g, xq, x_scale, rank, bits, block, seq_len, seq_first, measure, kernels, seeds=None,
      seed_index=0, gw_fp32=False):
    torch._check(xq.shape[0] == ref.hla_rows(g.shape[0], rank, block, seq_len),
                 lambda: "hla_grad_weight: compressed buffer rows disagree with g")
    return g.new_empty((g.shape[1], xq.shape[1]), dtype=_gw_dtype(g, gw_fp32))


# ----------------------------------------------------------------------- both (one site)
ONE_PASS_MAX_RANK = 8
"""Largest HLA rank for which ``hot::linear_backward`` derives both operands of g in one kernel
pair. H100, bf16 g, per-token HQ: at rank 8 the pair beats the separate kernels (8192x4096:
0.165 vs 0.201 ms; per-tensor HQ 0.165 vs 0.299 ms; results/grad_out_2026-11-22T1300); at
rank 16 it loses everywhere but the narrowest g (16384x4096: 0.437 vs 0.312 ms, 16384x16384:
1.59 vs 1.24 ms; 12608x768: 0.146 vs 0.158; layers_2026-11-23T214911 and the grad_out tile
sweep of that session, no tile shape better): the (16-token x BC x 16) coefficient tile no
longer fits the registers next to the HQ half."""


def linear_backward_body(g: Tensor, xq: Tensor, x_scale: Tensor, rank: int, gw_bits: int,
                         block: int, seq_len: int, seq_first: bool, measure: str, kernels: str,
                         w: Tensor, gx_bits: int, w_bits: int, scale: str, site: str,
                         seeds: Optional[Tensor] = None, seed_index: int = 0,
                         gw_fp32: bool = False, w_q: Optional[Tensor] = None,
                         w_s: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """(g_x, g_W) of one linear site: ``hq_grad_input`` and ``hla_grad_weight`` in one op:
    one dispatch, one seed drawn (g_W's bits from seed + 1), and up to rank
    ``ONE_PASS_MAX_RANK`` one kernel pair reading g for both operands.

    The first ten arguments are ``hla_grad_weight``'s, in its order, and the rest are
    ``hq_grad_input``'s: tools that read a site's g_W op (its buffer, its rank-measure key)
    read either op alike. ``gw_fp32``: g_W in fp32 (``hla_grad_weight``). ``w_q``, ``w_s``:
    W's scaled-e4m3 operand from the forward's ``weight_operands`` (the fused g_x reads it
    instead of quantizing W; the reference twin quantizes w itself, to the same values)."""
    per_token, warm_other = _hq_scaling(scale, site, g, gx_bits, block)
    seed = _seed(g, seeds, seed_index)
    if measure:
        RANK.measure(measure, g, xq, x_scale, block, seq_len, seq_first)
    lay = dict(seq_len=seq_len, seq_first=seq_first, gw_dtype=_gw_dtype(g, gw_fp32))
    if triton_usable(g, kernels):
        return _fused().linear_backward(g, w, xq, x_scale, rank, gx_bits, w_bits, gw_bits,
                                        per_token, seed, block, **lay,
                                        one_pass=rank <= ONE_PASS_MAX_RANK,
                                        warm_other_scale=warm_other, w_q=w_q, w_s=w_s)
    return ref.linear_backward(g, w, xq, x_scale, rank, gx_bits, w_bits, gw_bits, per_token,
                               seed, block, **lay,
                               w_e4m3=_twin_w_e4m3(g, w, gx_bits, w_bits, per_token, block))


linear_backward = torch.library.custom_op("hot::linear_backward", mutates_args=())(
    linear_backward_body)


@linear_backward.register_fake
def _(g, xq, x_scale, rank, gw_bits, block, seq_len, seq_first, measure, kernels, w, gx_bits,
      w_bits, scale, site, seeds=None, seed_index=0, gw_fp32=False, w_q=None, w_s=None):
    torch._check(g.shape[1] == w.shape[0], lambda: "linear_backward: g and w disagree on O")
    torch._check(xq.shape[0] == ref.hla_rows(g.shape[0], rank, block, seq_len),
                 lambda: "linear_backward: compressed buffer rows disagree with g")
    return g.new_empty((g.shape[0], w.shape[1])), \
        g.new_empty((g.shape[1], xq.shape[1]), dtype=_gw_dtype(g, gw_fp32))


# ----------------------------------------------------------------------- exact_gx on FP8
def e4m3_gx_backward_body(g: Tensor, xq: Tensor, x_scale: Tensor, rank: int, gw_bits: int,
                          block: int, seq_len: int, seq_first: bool, measure: str, kernels: str,
                          w: Tensor, seeds: Optional[Tensor] = None, seed_index: int = 0,
                          gw_fp32: bool = False, w_q: Optional[Tensor] = None,
                          w_s: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """(g_x, g_W) of a layer named in ``exact_gx`` under ``exact_gx_gemm="e4m3"``: g_x with no
    Hadamard and no 4-bit levels, on the FP8 GEMM (``reference.e4m3_gx_backward``: g
    stochastically rounded to e4m3 with a scale per token, W^T rounded to e4m3 per column,
    fp32 accumulation), g_W as ``hla_grad_weight``. The first ten arguments are
    ``hla_grad_weight``'s, as ``linear_backward``'s are. On the GPU the per-token kernel
    writes g's e4m3 operand and g's row maxima (the HLA bound) from one read of g
    (``fused.e4m3_gx_backward``); where the fused path does not apply there
    (``formats.e4m3_gx_fused``), g_x is exact. ``w_q``, ``w_s``:
    W's plain e4m3 operand from the forward's ``weight_operands(hq=False)``."""
    seed = _seed(g, seeds, seed_index)
    if measure:
        RANK.measure(measure, g, xq, x_scale, block, seq_len, seq_first)
    lay = dict(seq_len=seq_len, seq_first=seq_first, gw_dtype=_gw_dtype(g, gw_fp32))
    if triton_usable(g, kernels):
        return _fused().e4m3_gx_backward(g, w, xq, x_scale, rank, seed, block, **lay,
                                         w_q=w_q, w_s=w_s, gw_bits=gw_bits)
    return ref.e4m3_gx_backward(g, w, xq, x_scale, rank, seed, block, **lay, gw_bits=gw_bits)


e4m3_gx_backward = torch.library.custom_op("hot::e4m3_gx_backward", mutates_args=())(
    e4m3_gx_backward_body)


@e4m3_gx_backward.register_fake
def _(g, xq, x_scale, rank, gw_bits, block, seq_len, seq_first, measure, kernels, w, seeds=None,
      seed_index=0, gw_fp32=False, w_q=None, w_s=None):
    torch._check(g.shape[1] == w.shape[0], lambda: "e4m3_gx_backward: g and w disagree on O")
    torch._check(xq.shape[0] == ref.hla_rows(g.shape[0], rank, block, seq_len),
                 lambda: "e4m3_gx_backward: compressed buffer rows disagree with g")
    return g.new_empty((g.shape[0], w.shape[1])), \
        g.new_empty((g.shape[1], xq.shape[1]), dtype=_gw_dtype(g, gw_fp32))


# ----------------------------------------------------------------------- W's cast (forward)
def weight_cast_body(p: Tensor, dtype: torch.dtype, kernels: str,
                     row_max: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """Autocast's copy of an fp32 parameter (O, I), its column maxima (int32 bits of
    max |copy[:, i]|) and, with ``row_max``, its row maxima (else empty),
    ``reference.weight_cast``: put in place of autocast's cast of a rewritten site's W
    (``passes/weight_cast.py``), so neither the e4m3 W operand's scale nor the FP8
    forward's costs a read of W of its own."""
    return weight_cast_group_body([(p, dtype, kernels, row_max)])[0]


def weight_cast_group_body(calls: list) -> list:
    """``weight_cast_body`` of each call (its arguments, which agree on all but ``p``): the
    spliced form of several ``hot::weight_cast`` ops, one kernel launch for up to
    ``hadamard.WEIGHT_SLOTS`` of them (``passes/splice.py``)."""
    _, dtype, kernels, row_max = calls[0]
    ps = [c[0] for c in calls]
    if all(triton_usable(p, kernels) for p in ps):
        return _fused().weight_casts(ps, dtype, row_max)
    return [ref.weight_cast(p, dtype, row_max) for p in ps]


weight_cast = torch.library.custom_op("hot::weight_cast", mutates_args=())(weight_cast_body)


@weight_cast.register_fake
def _(p, dtype, kernels, row_max=False):
    return (p.new_empty(p.shape, dtype=dtype), p.new_empty((p.shape[1],), dtype=torch.int32),
            p.new_empty((p.shape[0] if row_max else 0,), dtype=torch.int32))


def weight_operands_body(w: Tensor, col_max: Tensor, fwd_max: Optional[Tensor], forward: str,
                         kernels: str, hq: bool = True) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The forward's operands of an owned weight copy (``reference.weight_operands``): HQ's
    scaled-e4m3 W (``hq``; else the plain e4m3 W^T of ``e4m3_gx_backward``) and the FP8
    forward's W (``forward``) from one read of the copy on the GPU, so W's FP8 cast for
    the forward GEMM is no pass of its own (``passes/weight_cast.py``)."""
    return weight_operands_group_body([(w, col_max, fwd_max, forward, kernels, hq)])[0]


def weight_operands_group_body(calls: list) -> list:
    """``weight_operands_body`` of each call (agreeing on ``forward``, ``kernels``, ``hq``),
    the spliced form of several ``hot::weight_operands`` ops: one kernel launch for up to
    ``hadamard.WEIGHT_SLOTS`` copies of a tile (``passes/splice.py``)."""
    _, _, _, forward, kernels, hq = calls[0]
    if all(triton_usable(c[0], kernels) for c in calls):
        return _fused().weight_operands([c[:3] for c in calls], forward, hq)
    return [ref.weight_operands(*c[:4], hq) for c in calls]


weight_operands = torch.library.custom_op("hot::weight_operands", mutates_args=())(
    weight_operands_body)


@weight_operands.register_fake
def _(w, col_max, fwd_max, forward, kernels, hq=True):
    O, I = w.shape
    e4m3, f32 = torch.float8_e4m3fn, torch.float32
    none = w.new_empty((0,), dtype=e4m3), w.new_empty((0,), dtype=f32)
    hq_out = (w.new_empty((I, -(-O // 16) * 16 if hq else O), dtype=e4m3),
              w.new_empty((I,), dtype=f32))
    if forward == "bf16":
        return (*hq_out, *none)
    q = w.new_empty_strided((I, O), (1, I), dtype=e4m3)     # a row-major (O, I) buffer, viewed
    s = w.new_empty_strided((1, O), (O, 1), dtype=f32) if forward == "fp8_rowwise" else \
        w.new_empty((), dtype=f32)
    return (*hq_out, q, s)
