"""The g_x GEMM that ``exact_gx`` keeps (the output head's), on row-wise FP8 where asked
(``HOTConfig.exact_gx_format="fp8_rowwise"``).

Why not HQ: the head's g_y is the loss's gradient over the whole vocabulary (Llama: 8192 x
32000); HQ's block Hadamard over rows that wide is the two-sweep path, and HQ on the whole
head failed the byte-level gate at 4-bit levels. In 8-bit e4m3 through HQ it passed the
gates but did not pay: the Hadamard pass over g_y, W's pass and the GEMM together cost
what the bf16 GEMM costs (bench/NOTES_kernels.md, twenty-first stop). Here the casts are
plain row-wise e4m3 (``kernels.fp8_forward.kept_grad_input``: amax per row; g_y rounded
stochastically, W to nearest), recorded as aten ops, so Inductor fuses g_y's into the
kernel that makes g_y (the cross-entropy's backward) and W's into a transposing cast, and
no HOT kernel runs. Why stochastic: with g_y rounded to nearest the word-level GPT's val
loss was +0.04 / +1.39 / +1.23% against Inductor (3 seeds) where the FP8 forward alone
gave -0.29 / +0.58 / +0.25%: nearest rounding of the many small softmax probabilities is
biased, and the bias adds up over the vocabulary. The GEMM accumulates in fp32 (``fast_accum=False``), unlike the forward: on
Llama's head (8192 x 32000 -> 4096) fast accumulation took 1.38 ms against 1.82 ms (2.62
in bf16), and on a synthetic logit-like g_y its error against fp64 was the same (2.69e-2
both; bench/head_gx_gemm.py), but in training it ruined the word-level GPT (val loss
+11.7% and +10.9% against Inductor, 2 seeds; +1.4% and +1.2% with fp32 accumulation;
docs/BENCHMARKS.md, twenty-second stop): a synthetic g_y does not predict the sum over
the whole vocabulary.
"""
from __future__ import annotations

from typing import List

import torch
from torch.fx import Graph

from ..kernels import fp8_forward as F8
from .find import LinearSite
from .graph_utils import add_node, emit

aten = torch.ops.aten


def kept_gx_rule(site: LinearSite, config) -> tuple[str, str]:
    """(format, reason) of a site's kept g_x GEMM: ``config.exact_gx_format`` where the GEMM
    fits FP8 (``fp8_forward.forward_rule`` on g_y's dtype and the site's I and O), else
    "bf16" with the reason."""
    if config.exact_gx_format == "bf16" or site.kept_gx_mm is None or not site.eligible:
        return "bf16", ""
    g = site.grad.meta.get("val") if site.grad is not None else None
    if not isinstance(g, torch.Tensor) or g.dim() != 2:
        return "bf16", "no 2-D fake g_y to check the FP8 GEMM against"
    return F8.forward_rule(config.exact_gx_format, g.device, site.I, site.O, g.dtype, "g_x")


def rewrite_kept_gx(graph: Graph, sites: List[LinearSite], config, fake_mode) -> None:
    """Put each rewritten site's kept g_x mm on FP8 where ``kept_gx_rule`` allows; the
    report's g_x column says which (``site.kept_gx_format``) and why not."""
    for s in sites:
        fmt, why = kept_gx_rule(s, config)
        if fmt == "bf16":
            if why:
                s.gx_kept += f"; bf16: {why}"
            continue
        mm = s.kept_gx_mm
        g_dtype, device = s.grad.meta["val"].dtype, s.grad.meta["val"].device
        w_dtype = s.wt.meta["val"].dtype

        def gx(g, wt):          # g (L, O) @ W (O, I), W = wt^T
            return F8.kept_grad_input(g, aten.permute.default(wt, [1, 0]), g_dtype, w_dtype,
                                      device)

        new = emit(graph, gx, (s.grad, s.wt), mm, "is_backward", mm, fake_mode)
        if s.gx_t:              # the graph's mm computed g_x transposed
            new = add_node(graph, aten.permute.default, (new, [1, 0]), before=mm,
                           tag="is_backward", like=mm, fake_mode=fake_mode)
        mm.replace_all_uses_with(new)
        graph.erase_node(mm)
        s.kept_gx_mm, s.kept_gx_format = new, fmt
