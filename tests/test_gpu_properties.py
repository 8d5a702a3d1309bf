"""The property suite's random models on the GPU path: the fused Triton kernels spliced into
Inductor's graph, FP8 operands on cuBLAS, every site forced (cost gate off).

Why: ``test_properties.py`` runs the pass on the CPU with the reference kernels, where no
kernel is spliced, no operand is FP8 and no alignment rule applies. What users run is the
GPU path, whose graph surgery differs (spliced kernel nodes, the forward's FP8 casts, the
weight casts shared by a layer, saved buffers handed to the backward). The same
generated models go through it here, and the same five properties are checked
(``test_properties.check_properties``): no raise and no internal fall-back, gradients
close to eager, a specific reason for every exact site, no activation product rewritten,
frozen weights without gradient.

Config: ``gpu_near_exact``: rank 16 of 16 and 8-bit levels where the format has levels,
every size and name eligible, ``min_speedup=0``, the kernels and formats the GPU picks
(Hopper: g_W's operands in e4m3, the row-wise FP8 forward under autocast). Feature sizes
are mostly multiples of 16 (16, 32, 48, some 24) so most sites meet the FP8 alignment and
are rewritten; the others stay exact with their reason. One suite runs the shipped
defaults (4-bit HQ, rank 16) with a bound only gross errors cross.

Tolerance (property 2): e4m3 keeps 3 mantissa bits, so each FP8 operand carries ~2-4% RMS
relative noise (rounding to nearest, more with stochastic rounding), against ~1% for the
CPU suite's 8-bit levels; it compounds through stacked layers, most where a gradient
cancels (a key projection's, across the softmax). The bounds (``GPU_TOL``, with what they
were set from) sit below what a structural error gives (a wrong pairing or role: error ~1,
cosine ~0; a dropped term of a shared weight's two: ~0.5). Each example's worst error
is appended to ``$HOT_PROPS_LOG`` (a JSON line) when it is set, so a run documents the
noise it met.
"""
import json
import os

import pytest
import torch
from hypothesis import given, settings

import hotcompile
import test_properties as P

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

GPU_FEATS = (16, 32, 48, 16, 32, 48, 24)
# Measured on the H200 (calls 232-234, 93 examples): worst 0.287 / cosine 0.969, three
# attentions stacked in fp32 whose last key projection is 16 wide: the CPU's reference twins
# give that case's gradient 0.351 / 0.951 with e4m3 g_W operands and 0.163 with int8 ones
# (quantization noise of a gradient that cancels across the softmax's keys, not a kernel's);
# the next worst 0.115. A dropped term (~0.5) or a wrong pairing (~1) still crosses it.
GPU_TOL = {d: (0.40, 0.94) for d in (None, torch.bfloat16, torch.float16)}
DEFAULTS_TOL = {d: (0.6, 0.8) for d in (None, torch.bfloat16, torch.float16)}


def gpu_near_exact(**extra) -> "hotcompile.HOTConfig":
    """The CPU suite's near-exact settings on the GPU's own kernels and formats (``extra``
    fields override)."""
    return hotcompile.HOTConfig(**{**dict(rank=16, block=16, gx_bits=8, gx_w_bits=8, gw_bits=8,
                                          min_features=0, min_speedup=0, exclude=(),
                                          gx_scale="token"), **extra})


def shipped_defaults(**extra) -> "hotcompile.HOTConfig":
    """The defaults, with every site forced: what a user gets where the gate says yes."""
    return hotcompile.HOTConfig(**dict(min_features=0, min_speedup=0, exclude=()), **extra)


def _log(r, suite: str) -> None:
    path = os.environ.get("HOT_PROPS_LOG")
    if not path:
        return
    errs, floored = P.grad_errors(r)           # cancelled gradients counted apart
    recs = r.report.layers
    with open(path, "a") as f:
        f.write(json.dumps({
            "suite": suite, "case": repr(r.case), "dtype": str(r.case.dtype),
            "sites": len(recs), "rewritten": sum(rec.reason is None for rec in recs),
            "paths": sorted({f"{rec.gx_path} | {rec.gw_path} | forward {rec.forward} | "
                             f"{rec.launch}" for rec in recs if rec.reason is None}),
            "reasons": sorted({rec.reason for rec in recs if rec.reason is not None}),
            "worst_rel": max((e for _, e, _ in errs), default=0.0),
            "worst_cos": min((c for _, _, c in errs), default=1.0),
            "floored": len(floored)}) + "\n")


def check_on_gpu(case, suite: str, config_fn=gpu_near_exact, tol=None, **config):
    r = P.run_case(case, device="cuda", config_fn=config_fn, **config)
    _log(r, suite)
    P.check_properties(r, tol or GPU_TOL)
    return r


SETTINGS = dict(P.SETTINGS)


@pytest.mark.slow
@settings(max_examples=15, **SETTINGS)
@given(case=P.cases(kinds=("linear", "linear", "linear", "shared", "break", "swap",
                           "token_slice"), max_blocks=4, feats=GPU_FEATS))
def test_gpu_linear_spellings_layouts_fp32(case):
    """Every linear spelling, layout and input view on the GPU path (fp32 model)."""
    check_on_gpu(case, "spellings_fp32")


@pytest.mark.slow
@settings(max_examples=15, **SETTINGS)
@given(case=P.cases(kinds=("linear", "tied", "frozen_pair", "frozen_pair", "shared", "break"),
                    max_blocks=4, layouts=("2d", "2d", "bsd", "sbd", "4d"), x_grad=0.25,
                    dtypes=(torch.bfloat16, None), feats=GPU_FEATS))
def test_gpu_frozen_shared_tied(case):
    """Frozen, shared and tied weights on the GPU path, in fp32 and under bf16 autocast."""
    check_on_gpu(case, "frozen_shared_tied")


@pytest.mark.slow
@settings(max_examples=15, **SETTINGS)
@given(case=P.cases(kinds=("linear", "linear", "attn", "attn", "input_prod", "mixed_use",
                           "gram", "break", "swap", "token_slice"), max_blocks=4,
                    dtypes=(torch.bfloat16, None), feats=GPU_FEATS))
def test_gpu_activation_products_never_rewritten(case):
    """Activation and parameter products beside linears on the GPU path."""
    check_on_gpu(case, "products")


@pytest.mark.slow
@settings(max_examples=15, **SETTINGS)
@given(case=P.cases(kinds=("linear", "linear", "shared", "tied", "frozen_pair", "attn",
                           "input_prod", "mixed_use", "gram", "break", "swap", "token_slice"),
                    dtypes=(torch.bfloat16, torch.float16), max_blocks=3, feats=GPU_FEATS))
def test_gpu_autocast_bf16_fp16(case):
    """Everything under CUDA autocast: the row-wise FP8 forward where bf16 allows it."""
    check_on_gpu(case, "autocast")


@pytest.mark.slow
@settings(max_examples=12, **SETTINGS)
@given(case=P.cases(kinds=("linear", "linear", "shared", "tied", "frozen_pair", "attn",
                           "mixed_use", "break", "token_slice"),
                    dtypes=(torch.bfloat16, None), max_blocks=3, feats=GPU_FEATS))
def test_gpu_shipped_defaults_forced(case):
    """The shipped defaults (4-bit HQ) with every site forced: properties 1, 3-5 as they
    are, property 2 at a bound only a structural error crosses (``DEFAULTS_TOL``)."""
    check_on_gpu(case, "defaults", config_fn=shipped_defaults, tol=DEFAULTS_TOL)


@pytest.mark.slow
@settings(max_examples=15, **SETTINGS)
@given(case=P.cases(**{**P.SUITES["gated"], "feats": GPU_FEATS}))
def test_gpu_fp8_forward_beside_sites_whose_backward_stays_exact(case):
    """The forward's FP8 gate decided apart from the backward's on the GPU path: a cost
    table tossing a coin for each site's backward (``test_properties.run_coin_gated``) and
    letting every forward take FP8 (row-wise under bf16 autocast, tensor-wise in fp32), so
    sites rewritten whole (spliced kernels) sit beside sites that keep autograd's backward
    with the FP8 forward alone, GELU's kernel making x for either (exact and tanh's GELU,
    ``gelu_new`` among the activations)."""
    fwd = "fp8_rowwise" if case.dtype == torch.bfloat16 else "fp8"
    r = P.run_coin_gated(case, device="cuda", config_fn=gpu_near_exact, forward=fwd,
                         min_speedup=1.0)
    _log(r, "gated")
    P.check_properties(r, GPU_TOL)
