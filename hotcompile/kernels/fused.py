"""The three HOT ops on fused Triton kernels: same signatures, semantics, dtypes and shapes
as the reference functions of the same name (``reference.py``).

Each op is a short pipeline of single-pass kernels (``hadamard``, ``hla``, ``gemm``):

* ``hq_grad_input``: W (O, I) -> H along O + RTN levels (I, O_pad) in one kernel;
  g (L, O) -> H along O + stochastic levels (L, O_pad), per-token (one read of g) or
  per-tensor (two reads: a global amax first); then one GEMM over O_pad with
  acc * s_g * s_W / 16 in its epilogue. The GEMM (``gx_path``): cuBLAS FP8 where it
  applies (bf16 g_y with per-token scales on Ada/Hopper; W then scaled e4m3 when its
  levels would not be exact), else this package's INT8 kernel.
* ``abc_compress``: x (L, I) -> projected, RTN int8 levels (L', I) (or scaled e4m3) and a
  per-tensor scale, held K-major: a view of the (I, L'_pad) buffer the g_W GEMM reads.
* ``hla_grad_weight``: g (L, O) -> projected stochastic int8 levels written transposed
  (O, L'); the saved buffer read as it is (both GEMM operands along L'); one GEMM with
  acc * s_g * s_x / 16 in its epilogue. When the saved
  activation is e4m3 (``formats.gw_rule``), g's coefficients are stochastic e4m3 (one
  launch, the scale from ``reference.token_block_bound``) and the GEMM is cuBLAS FP8 with
  tensor-wise scales.

``seed`` is a 0-d int64 tensor on the device (kernels load it: CUDA-graph replays read
the current value) or a Python int. Only ``block=16`` has fused kernels; other blocks,
``bits=0`` (no quantization), bits outside 2..8 and float ``xt`` fall back to the
reference implementation, as do empty tensors.
"""
from __future__ import annotations

import torch

from . import formats, gemm, grad_out, hadamard, hla
from .launch import recording_launches
from . import reference as ref

_FUSED_BLOCK = 16


def _fused_bits(bits: int) -> bool:
    return 2 <= bits <= 8


def hq_grad_input(g: torch.Tensor, w: torch.Tensor, bits: int, per_token: bool, seed=0,
                  block: int = 16, warm_other_scale: bool = False,
                  w_bits: int | None = None) -> torch.Tensor:
    """g_x ~= g_y W via block-Hadamard 4/8-bit quantization along O. g: (L, O), w: (O, I).

    ``warm_other_scale`` (LQS calibration steps): also run the other scaling's kernels once
    and drop the result, so that whichever choice LQS makes is already compiled when a
    CUDA graph captures the step (a first compile inside capture invalidates it)."""
    w_bits = bits if w_bits is None else w_bits
    if (block != _FUSED_BLOCK or not (_fused_bits(bits) and _fused_bits(w_bits))
            or g.numel() == 0 or w.numel() == 0):
        return ref.hq_grad_input(g, w, bits, per_token, seed, block, w_bits=w_bits)
    if warm_other_scale:
        hq_grad_input(g, w, bits, not per_token, seed, block, False, w_bits)
    return _gx(g, w, bits, w_bits, per_token, seed)


def gx_path(g: torch.Tensor, w: torch.Tensor, bits: int, w_bits: int, per_token: bool):
    """(GEMM path, W as scaled FP8?) of a fused g_x: ``gemm.gx_format``, ``formats.w_is_e4m3``
    (the reference twin takes the second as ``w_e4m3``)."""
    fmt = gemm.gx_format(g, w.shape[1], bits, w_bits, per_token)
    return fmt, formats.w_is_e4m3(fmt, w_bits)


def _gx(g, w, bits: int, w_bits: int, per_token: bool, seed, gq=None, path=None,
        w_amax=None, wq=None) -> torch.Tensor:
    """The fused g_x: W and (unless given as ``gq`` = (levels, scale)) g_y quantized for the
    GEMM path (``path``, else ``gx_path``'s), then that GEMM. ``w_amax``: W's zeroed
    workspace (``hq_weight_quant``'s ``amax``); ``wq``: W's scaled-e4m3 operand when the
    forward wrote it (``weight_operands``), for a path that takes one."""
    fmt, e4m3 = path or gx_path(g, w, bits, w_bits, per_token)
    cublas = fmt == "cublas_fp8"
    if wq is not None:
        if not e4m3:
            raise ValueError(f"g_x: the forward wrote W as scaled e4m3, but this g_x runs "
                             f"{fmt} with {w_bits}-bit W levels")
        qw, sw = wq
    else:
        qw, sw = hadamard.hq_weight_quant(w, w_bits, fp8=fmt == "fp8" or cublas, e4m3=e4m3,
                                          scale_mul=1.0 / 16 if cublas else 1.0,
                                          round_to=g.dtype, amax=w_amax)
    qg, sg = gq if gq is not None else hadamard.hq_act_quant(g, bits, per_token, seed,
                                                             fp8=fmt != "int8")
    if cublas:
        return gemm.cublas_fp8_mm(qg, qw, sg, sw, g.dtype, fast_accum=True)
    return gemm.scaled_mm(qg, qw, sg, sw, 1.0 / 16, g.dtype)


def _castable(p: torch.Tensor, dtype: torch.dtype) -> bool:
    return p.dtype == torch.float32 and dtype in (torch.bfloat16, torch.float16) \
        and p.dim() == 2 and p.numel() > 0


def weight_casts(ps: list, dtype: torch.dtype, row_max: bool = False) -> list:
    """The forward's copies of fp32 parameters and their maxima (``reference.weight_cast``
    of each), one kernel launch per ``hadamard.WEIGHT_SLOTS`` of them
    (``hadamard.weight_casts``); the reference for any other parameter."""
    fused = [i for i, p in enumerate(ps) if _castable(p, dtype)]
    outs = [None] * len(ps)
    for i, out in zip(fused, hadamard.weight_casts([ps[i] for i in fused], dtype, row_max)):
        outs[i] = out
    return [out if out is not None else ref.weight_cast(p, dtype, row_max)
            for p, out in zip(ps, outs)]


def weight_operands(calls: list, forward: str, hq: bool = True) -> list:
    """``reference.weight_operands`` of each (w, col_max, fwd_max) of ``calls``: one read of
    each copy writes HQ's scaled-e4m3 W operand (or with ``hq=False`` the plain one) and,
    under an FP8 ``forward``, that forward's W operand, one launch per
    ``hadamard.WEIGHT_SLOTS`` copies (``hadamard.hq_weight_operands``)."""
    rowwise = forward == "fp8_rowwise"
    fused = [i for i, (w, _, _) in enumerate(calls)
             if w.dtype in (torch.bfloat16, torch.float16) and w.numel() > 0]
    ws = [calls[i][0].contiguous() for i in fused]
    fwd = None
    if forward != "bf16":
        fwd = [(calls[i][2] if rowwise else torch.amax(calls[i][2], 0), rowwise) for i in fused]
    made = hadamard.hq_weight_operands(ws, [calls[i][1] for i in fused], fwd,
                                       scale_mul=1.0 / 16 if hq else 1.0, rotate=hq)
    outs = [None] * len(calls)
    for i, out in zip(fused, made):
        if fwd is None:
            none = out[0].new_empty((0,), dtype=torch.float8_e4m3fn)
            out = (*out, none, none.float())
        outs[i] = out
    return [out if out is not None else ref.weight_operands(*call, forward, hq)
            for call, out in zip(calls, outs)]


def abc_compress(x: torch.Tensor, rank: int, select: str = "1d", bits: int = 8,
                 block: int = 16, *, seq_len: int = 0, seq_first: bool = False,
                 fmt: str = "int8", amax: torch.Tensor | None = None):
    """The saved activation: HLA-projected x (hla_rows, I) as int8 levels, or with
    ``fmt="e4m3"`` as scaled FP8 (the cuBLAS g_W GEMM's operand); fp32 scale ().
    ``amax`` (e4m3): max |x| as ``hadamard.input_amax_bits`` gives it, where the caller
    has it (default: a reduction over x here).

    Written K-major by the kernel (``reference.k_major_saved``: an (L', I) view of an
    (I, L'_pad) buffer), the layout both g_W GEMMs read, so no transpose runs in backward.
    H100 (kernel_ab_2026-11-24T174155): 0.069 vs 0.075 + 0.025 ms (row-major + transpose)
    at 8192 x 4096, 0.164 vs 0.170 + 0.068 ms at 8192 x 11008."""
    lay = dict(seq_len=seq_len, seq_first=seq_first)
    if block != _FUSED_BLOCK or not _fused_bits(bits) or x.numel() == 0:
        q, s = ref.abc_compress(x, rank, select, bits, block, **lay, fmt=fmt)
        return ref.k_major_saved(q), s
    e4m3 = fmt == "e4m3"
    q, s = hla.hla_quant(x, rank, select, bits, stochastic=False, e4m3=e4m3,
                         transposed=True, pad_to=16, amax=amax if e4m3 else None, **lay)
    return q.narrow(1, 0, ref.hla_rows(x.shape[0], rank, block, seq_len)).t(), s


def _k_major(q: torch.Tensor) -> torch.Tensor:
    """The saved (L', I) activation -> the (I, L'_pad) K-major buffer the g_W GEMMs read
    (``pad_to`` 16; pad columns zero for the cuBLAS GEMM, which reads them all; the INT8
    kernel masks them).

    ABC's own buffer (``abc_compress``, strides (1, L'_pad)) is that buffer: returned as
    is when L' is a multiple of 16 (every full-rank site; rank 8 with an even block
    count), else copied with its pad, since the view does not reach the pad. A row-major
    (L', I) tensor goes through the transpose kernel (1-byte elements: int8 or e4m3)."""
    k = q.shape[0]
    k_pad = -(-k // 16) * 16
    if q.stride(0) == 1 and q.shape[1] > 1:
        if k == k_pad and q.stride(1) == k:
            return q.t()
        return torch.nn.functional.pad(q.t().view(torch.int8), (0, k_pad - k)).view(q.dtype)
    out = gemm.transpose_padded(q.view(torch.int8), 16).view(q.dtype)
    if q.dtype == torch.float8_e4m3fn and out.shape[1] > k:
        out.narrow(1, k, out.shape[1] - k).zero_()
    return out


def _gw(g, xt, x_scale, rank: int, select: str, bits: int, seed, lay, qg=None,
        seed_add: int = 0, amax=None, out_dtype=None) -> torch.Tensor:
    """The fused g_W GEMM: g's projected levels (given as ``qg`` = transposed levels and
    scale, or computed with Philox key seed + ``seed_add``, written transposed by the HLA
    kernel: as fast as row-major plus a transpose, one launch fewer, layers_2026-11-24T030739)
    against the saved activation; cuBLAS FP8 when that is e4m3 (``formats.gw_rule``), else the
    INT8 kernel. ``amax``: the HLA kernel's word (``hla.hla_quant``). ``out_dtype``
    (default g's): fp32 where the graph casts g_W to an fp32 parameter's gradient anyway
    (``passes/grad_cast.py``): the GEMM writes it, and no cast kernel runs."""
    out_dtype = out_dtype or g.dtype
    k = ref.hla_rows(g.shape[0], rank, _FUSED_BLOCK, lay["seq_len"])
    if xt.shape[0] != k:
        raise ValueError(f"g_W: the saved activation has {xt.shape[0]} rows, expected {k} "
                         f"for {g.shape[0]} tokens at rank {rank}")
    xs = x_scale if isinstance(x_scale, torch.Tensor) else torch.tensor(float(x_scale))
    xs = xs.to(device=g.device, dtype=torch.float32)
    fp8 = xt.dtype == torch.float8_e4m3fn
    qg = qg or hla.hla_quant(g, rank, select, bits, stochastic=True, seed=seed,
                             seed_add=seed_add, transposed=True, pad_to=16, e4m3=fp8,
                             scale_mul=1.0 / _FUSED_BLOCK if fp8 else 1.0, amax=amax,
                             **lay)
    if fp8:
        # bf16 and fp32 outputs are what the H100 runs measured; fp16 goes through fp32
        out = gemm.cublas_fp8_mm(qg[0], _k_major(xt), qg[1], xs,
                                 torch.float32 if out_dtype == torch.float16 else out_dtype,
                                 fast_accum=False)
        return out.to(out_dtype)
    return gemm.scaled_mm(qg[0], _k_major(xt), qg[1], xs, 1.0 / 16, out_dtype, k=k)


def hla_grad_weight(g: torch.Tensor, xt: torch.Tensor, x_scale: torch.Tensor, rank: int,
                    select: str = "1d", bits: int = 8, seed=0, block: int = 16, *,
                    seq_len: int = 0, seq_first: bool = False,
                    out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """g_W ~= g_y^T x over the kept low-pass token coefficients. g: (L, O) -> (O, I), in
    ``out_dtype`` (default g's). ``xt``: ``abc_compress``'s buffer in either format."""
    lay = dict(seq_len=seq_len, seq_first=seq_first)
    if (block != _FUSED_BLOCK or not _fused_bits(bits)
            or xt.dtype not in (torch.int8, torch.float8_e4m3fn)
            or g.numel() == 0 or xt.numel() == 0):
        return ref.hla_grad_weight(g, xt, x_scale, rank, select, bits, seed, block, **lay,
                                   out_dtype=out_dtype)
    return _gw(g, xt, x_scale, rank, select, bits, seed, lay, out_dtype=out_dtype)


def linear_backward(g: torch.Tensor, w: torch.Tensor, xt: torch.Tensor, x_scale: torch.Tensor,
                    rank: int, gx_bits: int, w_bits: int, gw_bits: int, per_token: bool, seed=0,
                    block: int = 16, *, seq_len: int = 0, seq_first: bool = False,
                    one_pass: bool = True, warm_other_scale: bool = False,
                    gw_dtype: torch.dtype | None = None, w_q=None, w_s=None):
    """One linear layer's whole HOT backward: (g_x, g_W), bit-equal to ``hq_grad_input(g, w,
    gx_bits, per_token, seed)`` and ``hla_grad_weight(g, xt, x_scale, rank, "1d", gw_bits,
    seed + 1, out_dtype=gw_dtype)``. One seed for the site (the HLA side adds 1 on the device). ``one_pass``:
    g is read by one kernel pair for both operands (``grad_out``; int8 saved activations
    only), else by the two separate kernels (faster at rank 16: ``ops.ONE_PASS_MAX_RANK``).
    ``w_q``, ``w_s``: W's scaled-e4m3 operand from the forward (``weight_operands``), else
    quantized here."""
    lay = dict(seq_len=seq_len, seq_first=seq_first)
    if (block != _FUSED_BLOCK or not all(_fused_bits(b) for b in (gx_bits, w_bits, gw_bits))
            or xt.dtype not in (torch.int8, torch.float8_e4m3fn)
            or g.numel() == 0 or w.numel() == 0 or xt.numel() == 0):
        return (hq_grad_input(g, w, gx_bits, per_token, seed, block, warm_other_scale, w_bits),
                hla_grad_weight(g, xt, x_scale, rank, "1d", gw_bits, seed + 1, block, **lay,
                                out_dtype=gw_dtype))
    path = gx_path(g, w, gx_bits, w_bits, per_token)
    fp8 = path[0] != "int8"
    qg_t, bound = None, None
    if one_pass and xt.dtype == torch.int8:
        qg, sg, *qg_t = grad_out.grad_out_quant(g, gx_bits, per_token, seed, rank, "1d",
                                                gw_bits, seed, fp8, hla_seed_add=1, **lay)
    else:
        # per token, the HQ kernel also writes g's row maxima and zeroes a word: the e4m3
        # HLA operand's bound, their largest block sum, is maxed into it by one kernel
        row_max = per_token and xt.dtype == torch.float8_e4m3fn
        qg, sg, *rm = hadamard.hq_act_quant(g, gx_bits, per_token, seed, fp8=fp8,
                                            row_max=row_max)
        if rm:
            bound = hla.token_block_bound_bits(g, seq_len, seq_first, *rm)
    if warm_other_scale:
        hq_grad_input(g, w, gx_bits, not per_token, seed, block, False, w_bits)
    # the amax words of the W kernel (levels; an e4m3 W takes its column maxima from a
    # reduction) and of g's HLA kernel (int8 levels; e4m3 takes a bound from a reduction):
    # zeroed by one launch (traced for Inductor, each kernel zeroes its own: a shared
    # buffer written through two views would be functionalised into scatters)
    n_w = 0 if path[1] else w.shape[1]
    n_hla = int(qg_t is None and xt.dtype == torch.int8)
    ws = None if recording_launches() or not n_w + n_hla else \
        torch.zeros((n_w + n_hla,), dtype=torch.int32, device=g.device)
    gx = _gx(g, w, gx_bits, w_bits, per_token, seed, gq=(qg, sg), path=path,
             w_amax=ws.narrow(0, 0, n_w) if ws is not None and n_w else None,
             wq=None if w_q is None else (w_q, w_s))
    if qg_t is None:    # g's HLA operand from its own kernel: Philox key seed + 1
        gw = _gw(g, xt, x_scale, rank, "1d", gw_bits, seed, lay, seed_add=1,
                 amax=bound if bound is not None else
                 ws.narrow(0, n_w, 1) if ws is not None and n_hla else None,
                 out_dtype=gw_dtype)
    else:
        gw = _gw(g, xt, x_scale, rank, "1d", gw_bits, seed, lay, qg=tuple(qg_t),
                 out_dtype=gw_dtype)
    return gx, gw


def e4m3_gx_backward(g: torch.Tensor, w: torch.Tensor, xt: torch.Tensor, x_scale: torch.Tensor,
                     rank: int, seed=0, block: int = 16, *, seq_len: int = 0,
                     seq_first: bool = False, gw_dtype: torch.dtype | None = None,
                     w_q=None, w_s=None, gw_bits: int = 8):
    """``reference.e4m3_gx_backward`` on the GPU: the per-token kernel writes g's e4m3 copy
    with a scale per token and g's row maxima from one read of g (``hadamard.grad_e4m3``);
    the maxima give the e4m3 HLA operand's bound; the HLA kernel writes g_W's operand;
    then the two FP8 GEMMs. W's plain e4m3 operand comes from the forward (``w_q``, ``w_s``)
    or one W kernel here. Where ``formats.e4m3_gx_fused`` does not hold, g_x is exact
    (g W) and g_W the fused ``hla_grad_weight``."""
    lay = dict(seq_len=seq_len, seq_first=seq_first)
    L, O = g.shape
    if block != _FUSED_BLOCK or g.numel() == 0 or w.numel() == 0 or xt.numel() == 0 \
            or xt.dtype not in (torch.int8, torch.float8_e4m3fn) or not _fused_bits(gw_bits) \
            or not formats.e4m3_gx_fused(g.device, g.dtype, O, w.shape[1]):
        return (g @ w.to(g.dtype),
                hla_grad_weight(g, xt, x_scale, rank, "1d", gw_bits, seed + 1, block, **lay,
                                out_dtype=gw_dtype))
    # the e4m3 HLA operand's scale comes from a bound of g's block sums, from the row
    # maxima the copy's kernel writes; int8 levels take their own amax
    e4m3_hla = xt.dtype == torch.float8_e4m3fn
    g8, s8, *rm = hadamard.grad_e4m3(g, seed, row_max=e4m3_hla)
    bound = hla.token_block_bound_bits(g, seq_len, seq_first, *rm) if e4m3_hla else None
    if w_q is None:
        w_q, w_s = hadamard.hq_weight_quant(w, 8, fp8=True, e4m3=True, rotate=False,
                                            round_to=g.dtype)
    gx = gemm.cublas_fp8_mm(g8, w_q, s8, w_s, g.dtype, fast_accum=False)
    gw = _gw(g, xt, x_scale, rank, "1d", gw_bits, seed, lay, seed_add=1, amax=bound,
             out_dtype=gw_dtype)
    return gx, gw
