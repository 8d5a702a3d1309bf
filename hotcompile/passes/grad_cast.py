"""Fold the fp32 cast of a rewritten g_W into its GEMM: the op writes the fp32 gradient.

Why: under bf16 autocast the weight is an fp32 parameter, so the joint graph computes g_W
in bf16 (the dtype of the mm it replaced) and then casts it to fp32, the parameter's
gradient. That cast is a pass of its own over g_W: a kernel reading the bf16 result and
writing it again at twice the size (Llama d4096, H100 output code 2026-11-26: 14 such
kernels per step, 0.78 ms, as much as an HLA kernel's whole cost there). The FP8 and INT8
g_W GEMMs accumulate in fp32 and can write fp32 directly, so the op is told to
(``gw_fp32``) and the cast leaves the graph. The gradient is then the GEMM's fp32 result
itself, not that result rounded to bf16 and widened: as exact or more.

A cast is folded only where it is the g_W result's sole consumer, reached through views
alone; any other reader (a sum with another gradient of a tied weight, a hook, a second
use) keeps the graph as it was.
"""
from __future__ import annotations

import operator
from typing import Optional

import torch
from torch.fx import Graph, Node

from .graph_utils import fake_run
from .op_sets import LAYOUT_VIEWS

aten = torch.ops.aten
prims = torch.ops.prims

_HALF = (torch.bfloat16, torch.float16)


def _to_fp32(n: Node) -> bool:
    """Whether ``n`` casts its first argument to fp32 and does nothing else."""
    if n.target is prims.convert_element_type.default:
        return len(n.args) > 1 and n.args[1] == torch.float32
    if n.target is aten._to_copy.default:
        return set(n.kwargs) <= {"dtype", "layout", "device"} and \
            n.kwargs.get("dtype") == torch.float32 and len(n.args) == 1
    return False


def _fp32_cast_through_views(out: Node) -> Optional[tuple]:
    """(views, cast) when ``out``'s only consumer chain is views then one fp32 cast."""
    chain, n = [], out
    while len(n.users) == 1:
        (u,) = n.users
        if u.args[0] is not n:
            return None
        if u.target in LAYOUT_VIEWS:
            chain.append(u)
            n = u
            continue
        return (chain, u) if _to_fp32(u) else None
    return None


def fold_gw_cast(graph: Graph, op: Node, fake_mode) -> bool:
    """If ``op``'s g_W (a ``hot::hla_grad_weight`` result, or output 1 of
    ``hot::linear_backward``) in bf16/fp16 is only cast to fp32, through views: have the op
    write fp32 (its ``gw_fp32``) and drop the cast. Returns whether it folded."""
    tuple_out = isinstance(op.meta.get("val"), (tuple, list))
    if tuple_out:
        outs = [u for u in op.users if u.target is operator.getitem and u.args[1] == 1]
        if len(outs) != 1:
            return False
        out = outs[0]
    else:
        out = op
    val = out.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dtype not in _HALF:
        return False
    found = _fp32_cast_through_views(out)
    if found is None:
        return False
    chain, cast = found
    op.kwargs = {**op.kwargs, "gw_fp32": True}
    with fake_mode:
        wide = val.to(torch.float32)
    if tuple_out:
        vals = list(op.meta["val"])
        vals[1] = wide
        op.meta["val"] = type(op.meta["val"])(vals)
    out.meta["val"] = wide
    for n in chain:     # views take no kwargs: their fake values from the args alone
        n.meta["val"] = fake_run(n.target, n.args, fake_mode)
    last = chain[-1] if chain else out
    cast.replace_all_uses_with(last)
    graph.erase_node(cast)
    return True
