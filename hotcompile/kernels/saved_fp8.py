"""Activations kept for backward in FP8 (``HOTConfig(saved_activations="fp8")``): each row
of a saved tensor as e4m3 levels and one fp32 scale, written in aten ops only.

Why aten ops: the compression is an amax over each row and one pointwise pass, which
Inductor fuses with the kernel that produces the tensor in the forward (the residual add,
the bias + GELU after a GEMM); the decompression is pointwise, fused into the backward
kernels that read it (LayerNorm's and GELU's backward) or, before a GEMM, one pass. Called
on real tensors these functions are the reference; called on ``torch.fx.Proxy`` objects
(``passes/graph_utils.emit``) they record the same ops into the compiled graphs.

Numerics: rows along the last axis, s = max(amax(|row|), 1e-12) * (1 / 448), q =
e4m3(clamp(t * (1 / s), -448, 448)) rounded to nearest even; back: q * s in the saved
tensor's dtype. e4m3 keeps 3 mantissa bits: a relative error of at most 2^-4 per element
(6.25%), values under about 2^-18 of the row's max round to zero. A NaN or an infinity in a row
makes the whole row NaN after the round trip (amax is NaN or inf; inf * 0 is NaN): a
non-finite activation still gives non-finite gradients, as it would have exactly.

Centred rows (``compress_centred``): the row's mean m is kept beside the scale (4 more bytes a
row) and the levels hold t - m. Why: the error is 2^-4 of what is stored, and a backward that
reads t - m (LayerNorm's x - mean, recomputed from a residual-stream summand kept with a large
offset) would otherwise see an error of |t| / 16 in a quantity far smaller than |t|. Over a row,
sum((t - m)^2) <= sum(t^2), so centring never makes the row's error larger in the L2 sense; but
an exact zero of t comes back as a value near zero, so it is only for tensors no backward op
compares (ReLU's mask). amax(|t - m|) is max(max(t) - m, m - min(t)): the mean, max and min are
one reduction loop over the row, the same fl(t_i - m) the levels take.
"""
from __future__ import annotations

import torch

from .fp8_forward import e4m3_levels, scale_from_amax

aten = torch.ops.aten
prims = torch.ops.prims

# HOTConfig.saved_activations: "bf16" narrows fp32 kept tensors to bf16 only; "fp8" keeps bf16 /
# fp16 ones as e4m3 rows and narrows fp32 ones to bf16; "fp8_all" keeps fp32 ones as e4m3 too
FORMATS = ("exact", "bf16", "fp8", "fp8_all")


def compress(t):
    """``t`` (any float dtype, at least 1-D) -> (e4m3 levels, shape of ``t``; fp32 scale,
    ``t``'s shape with a last axis of 1)."""
    t32 = prims.convert_element_type.default(t, torch.float32)
    scale = scale_from_amax(aten.amax.default(aten.abs.default(t32), [-1], True))
    return e4m3_levels(t32, aten.reciprocal.default(scale)), scale


def compress_centred(t):
    """``t`` -> (e4m3 levels of t - m, fp32 scale, fp32 row mean m); the scale and m have
    ``t``'s shape with a last axis of 1."""
    t32 = prims.convert_element_type.default(t, torch.float32)
    mean = aten.mean.dim(t32, [-1], True)
    amax = aten.maximum.default(aten.sub.Tensor(aten.amax.default(t32, [-1], True), mean),
                                aten.sub.Tensor(mean, aten.amin.default(t32, [-1], True)))
    scale = scale_from_amax(amax)
    return e4m3_levels(aten.sub.Tensor(t32, mean), aten.reciprocal.default(scale)), scale, mean


def decompress(q, scale, dtype: torch.dtype, mean=None):
    """The saved tensor back in ``dtype`` from ``compress``'s pair (or ``compress_centred``'s
    triple: ``mean`` added back)."""
    t32 = aten.mul.Tensor(prims.convert_element_type.default(q, torch.float32), scale)
    if mean is not None:
        t32 = aten.add.Tensor(t32, mean)
    return prims.convert_element_type.default(t32, dtype)


def narrow(t):
    """An fp32 kept tensor as bf16 (``saved_activations="bf16"`` / ``"fp8"``): 2x, a relative
    error of 2^-9 (a LayerNorm's fp32 x_hat, whose e4m3 round trip cost the byte-level GPT
    gate 1.3% beside the FP8 forward, docs/BENCHMARKS.md, twenty-fifth stop)."""
    return prims.convert_element_type.default(t, torch.bfloat16)


def widen(t, dtype: torch.dtype):
    """``narrow``'s tensor back in ``dtype``."""
    return prims.convert_element_type.default(t, dtype)


def round_trip(t, centred: bool = False):
    """What backward sees of ``t``: the reference of one compressed saved tensor."""
    if centred:
        q, s, m = compress_centred(t)
        return decompress(q, s, t.dtype, m)
    q, s = compress(t)
    return decompress(q, s, t.dtype)
