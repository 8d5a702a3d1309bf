"""Activations kept for backward in FP8 (``HOTConfig(saved_activations="fp8")``): each row
of a saved tensor (each block of a long row, below) as e4m3 levels and one fp32 scale,
written in aten ops only.

Why aten ops: the compression is an amax over each row and one pointwise pass, which
Inductor fuses with the kernel that produces the tensor in the forward (the residual add,
the bias + GELU after a GEMM); the decompression is pointwise, fused into the backward
kernels that read it (LayerNorm's and GELU's backward) or, before a GEMM, one pass. Called
on real tensors these functions are the reference; called on ``torch.fx.Proxy`` objects
(``passes/graph_utils.emit``) they record the same ops into the compiled graphs.

Numerics: rows along the last axis (a "row" below is a block of a long one), s =
max(amax(|row|), 1e-12) * (1 / 448), q = e4m3(clamp(t * (1 / s), -448, 448)) rounded to
nearest even; back: q * s in the saved tensor's dtype. e4m3 keeps 3 mantissa bits: a relative
error of at most 2^-4 per element (6.25%), values under about 2^-18 of the row's max round to
zero. A NaN or an infinity in a row makes that whole row (block) NaN after the round trip
(amax is NaN or inf; inf * 0 is NaN): a non-finite activation still gives non-finite
gradients, as it would have exactly.

Centred rows (``compress_centred``): the row's mean m is kept beside the scale (4 more bytes a
row) and the levels hold t - m. Why: the error is 2^-4 of what is stored, and a backward that
reads t - m (LayerNorm's x - mean, recomputed from a residual-stream summand kept with a large
offset) would otherwise see an error of |t| / 16 in a quantity far smaller than |t|. Over a row,
sum((t - m)^2) <= sum(t^2), so centring never makes the row's error larger in the L2 sense; but
an exact zero of t comes back as a value near zero, so it is only for tensors no backward op
compares (ReLU's mask). amax(|t - m|) is max(max(t) - m, m - min(t)): the mean, max and min are
one reduction loop over the row, the same fl(t_i - m) the levels take.

Row blocks (``Rows``): a row longer than ``ROW_BLOCK`` is scaled (and centred) in blocks of
``block_of(width)`` elements, each with its own scale and mean. Why: Inductor keeps a row in
registers (a persistent reduction: one read of the producer, the statistics and the levels in
one pass) only up to 1024 elements; a longer row is read twice, and the producer (a GELU of a
GEMM's output) recomputed, in a loop. ViT-B's 3072-wide GELU output took 277 us a layer that
way (4x its bandwidth time; docs/BENCHMARKS.md, twenty-sixth stop). The per-element bound is
the same (2^-4 of the value, plain; of the block's spread, centred), and a block's scale
follows its own values; a width with no divisor ``block_of`` accepts stays one looped row.
Blocks are views: on real tensors the functions take a contiguous copy of a non-contiguous
input (the pass hands them its memory order, which is contiguous).
"""
from __future__ import annotations

import dataclasses

import torch

from .fp8_forward import e4m3_levels, scale_from_amax, scale_reciprocal

aten = torch.ops.aten
prims = torch.ops.prims

# HOTConfig.saved_activations: "bf16" narrows fp32 kept tensors to bf16 only; "fp8" keeps bf16 /
# fp16 ones as e4m3 rows and narrows fp32 ones to bf16; "fp8_all" keeps fp32 ones as e4m3 too
FORMATS = ("auto", "exact", "bf16", "fp8", "fp8_all")

ROW_BLOCK = 1024        # Inductor's limit for a persistent inner reduction
MIN_BLOCK = 256         # at 256, a scale and a mean already cost 3% of the e4m3 bytes


def block_of(width: int) -> int:
    """The length of the blocks a row of ``width`` elements is scaled in: the row itself up
    to ``ROW_BLOCK``, else its largest divisor in [MIN_BLOCK, ROW_BLOCK] that is a multiple of
    16 (3072 -> 1024, 11008 -> 688), else the row (a width with no such divisor)."""
    if width <= ROW_BLOCK:
        return width
    for b in range(ROW_BLOCK, MIN_BLOCK - 1, -16):
        if width % b == 0:
            return b
    return width


@dataclasses.dataclass(frozen=True)
class Rows:
    """The blocks one kept tensor is scaled in: its rows (last axis, ``width`` long) cut into
    blocks of ``block``; ``shape`` views the blocks back (ints; on ``torch.fx.Proxy`` tensors
    the proxies of ``aten.sym_size`` for dynamic sizes). One block a row: no view at all, and
    the statistics keep the tensor's shape with a last axis of 1."""
    width: int
    block: int
    shape: tuple = ()

    def __post_init__(self):
        if self.block != self.width and len(self.shape) == 0:
            raise ValueError(f"Rows({self.width}, {self.block}) needs the shape to view the "
                             "blocks back")

    @classmethod
    def of(cls, t) -> "Rows":
        return cls(int(t.shape[-1]), block_of(int(t.shape[-1])), tuple(t.shape))

    def split(self, t):
        if self.block == self.width:
            return t
        if isinstance(t, torch.Tensor) and not t.is_contiguous():   # a real tensor (reference)
            t = t.contiguous()
        return aten.view.default(t, [-1, self.block])

    def join(self, t):
        return t if self.block == self.width else aten.view.default(t, list(self.shape))


def compress(t, rows: Rows | None = None):
    """``t`` (any float dtype, at least 1-D) -> (e4m3 levels, shape of ``t``; fp32 scale, one
    per block of ``rows`` (default ``Rows.of(t)``): ``t``'s shape with a last axis of 1 when a
    row is one block, else (blocks, 1))."""
    rows = rows or Rows.of(t)
    t32 = rows.split(prims.convert_element_type.default(t, torch.float32))
    scale = scale_from_amax(aten.amax.default(aten.abs.default(t32), [-1], True))
    return rows.join(e4m3_levels(t32, scale_reciprocal(scale))), scale


def _centre(t32, n: int):
    """(row mean m, amax(|t - m|)) of fp32 rows of length ``n``. The mean is sum(t / n), whose
    terms cannot overflow; a row whose spread t - m overflows all the same (elements near
    fp32's maximum of both signs) gets m = 0 and amax(|t|): plain rows, finite where
    ``compress`` is. NaN rows stay NaN (isinf(NaN) is False)."""
    mean = aten.sum.dim_IntList(aten.mul.Tensor(t32, 1.0 / n), [-1], True)
    hi = aten.amax.default(t32, [-1], True)
    lo = aten.amin.default(t32, [-1], True)
    amax = aten.maximum.default(aten.sub.Tensor(hi, mean), aten.sub.Tensor(mean, lo))
    over = aten.isinf.default(amax)
    # m times 0 where it overflowed (m itself is finite there); ops that stay in the graph
    # after Inductor's decompositions (``zeros_like`` does not)
    mean = aten.mul.Tensor(mean, prims.convert_element_type.default(
        aten.logical_not.default(over), torch.float32))
    amax = aten.where.self(over, aten.maximum.default(hi, aten.neg.default(lo)), amax)
    return mean, amax


def compress_centred(t, rows: Rows | None = None):
    """``t`` -> (e4m3 levels of t - m, fp32 scale, fp32 block mean m); the scale and m as
    ``compress``'s scale. ``rows``: given when ``t`` is a ``torch.fx.Proxy``, whose shape is
    not known here."""
    rows = rows or Rows.of(t)
    t32 = rows.split(prims.convert_element_type.default(t, torch.float32))
    mean, amax = _centre(t32, rows.block)
    scale = scale_from_amax(amax)
    q = e4m3_levels(aten.sub.Tensor(t32, mean), scale_reciprocal(scale))
    return rows.join(q), scale, mean


def decompress(q, scale, dtype: torch.dtype, mean=None, rows: Rows | None = None):
    """The saved tensor back in ``dtype`` from ``compress``'s pair (or ``compress_centred``'s
    triple: ``mean`` added back); ``rows`` as they were compressed (default ``Rows.of(q)``)."""
    rows = rows or Rows.of(q)
    t32 = aten.mul.Tensor(rows.split(prims.convert_element_type.default(q, torch.float32)),
                          scale)
    if mean is not None:
        t32 = aten.add.Tensor(t32, mean)
        if dtype != torch.float32:
            # m plus a level rounded away from m can pass the dtype's largest value, which
            # no element of t did (fp16: 65000 came back as inf)
            big = torch.finfo(dtype).max
            t32 = aten.clamp_max.default(aten.clamp_min.default(t32, -big), big)
    return rows.join(prims.convert_element_type.default(t32, dtype))


def narrow(t, rows: Rows | None = None, centred: bool = True):
    """An fp32 kept tensor as bf16 (``saved_activations="bf16"`` / ``"fp8"``): 2x, a relative
    error of 2^-9 (a LayerNorm's fp32 x_hat, whose e4m3 round trip cost the byte-level GPT
    gate 1.3% beside the FP8 forward, docs/BENCHMARKS.md, twenty-fifth stop). Centred as
    ``compress_centred`` is, for the same reason (an offset of 16 against a spread of 1 made
    an error of 2.5% in LayerNorm's x - mean): (bf16 t - m, fp32 mean m of each block of
    ``rows``); plain: (bf16 t,).

    ``rows`` default: whole rows of a real tensor (on a ``torch.fx.Proxy``, whose width is
    not known here, the caller passes ``Rows(width, width)``). The pass centres a row that
    a norm reduces in the forward whole: bf16 has no scale to follow a block, the row's mean
    is the one LayerNorm subtracts, and it is a reduction over the same row as the norm's,
    so Inductor computes it in the norm's kernel. Blocks of 1024 there cost Llama d4096 a
    pass of its own per 4096-wide residual, 0.3-0.5 ms a step (docs/BENCHMARKS.md,
    twenty-ninth stop). Any other wide row keeps e4m3's blocks: one persistent reduction
    with its producer."""
    if not centred:
        return (prims.convert_element_type.default(t, torch.bfloat16),)
    rows = rows or Rows(int(t.shape[-1]), int(t.shape[-1]))
    t32 = rows.split(prims.convert_element_type.default(t, torch.float32))
    mean, _ = _centre(t32, rows.block)
    b = prims.convert_element_type.default(aten.sub.Tensor(t32, mean), torch.bfloat16)
    return rows.join(b), mean


def widen(b, dtype: torch.dtype, mean=None, rows: Rows | None = None):
    """``narrow``'s tensor back in ``dtype`` (``rows`` as it was narrowed; default whole)."""
    if mean is None:
        return prims.convert_element_type.default(b, dtype)
    t32 = prims.convert_element_type.default(b, torch.float32)
    if rows is None:                                            # whole rows: no view
        return prims.convert_element_type.default(aten.add.Tensor(t32, mean), dtype)
    t32 = aten.add.Tensor(rows.split(t32), mean)
    return rows.join(prims.convert_element_type.default(t32, dtype))


def round_trip(t, centred: bool = False, fmt: str = "fp8"):
    """What backward sees of ``t``: the reference of one compressed saved tensor (``fmt``
    "fp8": e4m3 rows, "bf16": narrowed)."""
    if fmt == "bf16":
        b, *mean = narrow(t, centred=centred)
        return widen(b, t.dtype, *mean)
    if centred:
        q, s, m = compress_centred(t)
        return decompress(q, s, t.dtype, m)
    q, s = compress(t)
    return decompress(q, s, t.dtype)
