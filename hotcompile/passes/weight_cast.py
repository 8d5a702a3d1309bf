"""Own autocast's cast of a rewritten site's weight: one kernel writes the copy and its maxima.

Why: the e4m3 W operand of HQ takes its scale from max |W[:, i]| (``reference.e4m3_bound_scale``).
Left to Inductor, that column maximum is fused into autocast's cast of the fp32 parameter only
when the weight has enough columns for Inductor not to split the reduction (I = 11008 yes,
4096 no: bench/colmax_fusion.py); otherwise it is a reduction of its own, a whole extra read
of the bf16 copy (~0.25 ms per Llama d4096 step on an H100). ``hot::weight_cast`` takes the
cast node's place: the same copy, bit for bit, for every reader (the forward GEMM first),
and the column maxima from the same pass over the parameter, handed to the site's backward
op (``w_col_max``), whose W kernel then reads W once. Under the FP8 forward the same maxima
give W's FP8 scale (``site.w_max``, read by ``forward.py``): the column maxima's max for a
tensor-wise scale, and row maxima the kernel then writes too for a row-wise one, so W's FP8
cast is a pointwise read of the copy instead of a reduction and a second read (and the
separate column-max reduction Inductor made beside it is gone).

A cast is taken over only where that is all it changes: the site's backward is one
``hot::linear_backward`` op reading the copy through views that keep its (O, I) layout, and
that op will be spliced (``spliced``: its W kernel then reads only forward values and the
partitioner runs it in the forward; an opaque op would read the copy in backward, and the
partitioner keeps our op's copy, 2 bytes per weight, where it recomputes a cast); the copy
comes from an fp32 graph input, nothing in backward reads it otherwise, and no activation
checkpointing policy covers the cast. Weights shared by several sites get one op.
"""
from __future__ import annotations

import operator
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch.fx import Graph, Node

from .find import CASTS, LinearSite
from .graph_utils import add_node
from .recompute import needed_in_backward

aten = torch.ops.aten
WEIGHT_CAST_OP = torch.ops.hot.weight_cast.default
UNIT_OP = torch.ops.hot.linear_backward.default
_VIEWS = (aten.permute.default, aten.t.default, aten.transpose.int, aten.view.default,
          aten._unsafe_view.default, aten.reshape.default, aten.alias.default)
_W_ARG = 10          # hot::linear_backward's w


def _source(n: Node) -> Node:
    """The node ``n`` is a view of (through ``_VIEWS``)."""
    while n.op == "call_function" and n.target in _VIEWS:
        n = n.args[0]
    return n


def _same_layout(a: Node, b: Node) -> bool:
    va, vb = a.meta.get("val"), b.meta.get("val")
    return (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor)
            and tuple(va.shape) == tuple(vb.shape) and tuple(va.stride()) == tuple(vb.stride()))


def _castable(cast: Node, ops: set) -> bool:
    """Whether autocast's ``cast`` can be replaced: an fp32 graph input rounded to bf16 /
    fp16, 2-D, not needed by backward other than through ``ops``, no checkpoint policy."""
    src, out = cast.args[0], cast.meta.get("val")
    sv = src.meta.get("val") if isinstance(src, Node) else None
    return (src.op == "placeholder" and isinstance(sv, torch.Tensor) and sv.dtype == torch.float32
            and sv.dim() == 2 and isinstance(out, torch.Tensor)
            and out.dtype in (torch.bfloat16, torch.float16) and not cast.kwargs.get("device")
            and cast.meta.get("recompute") is None and not needed_in_backward(cast, ops))


def own_weight_casts(graph: Graph, sites: List[LinearSite], kernels: str, fake_mode,
                     spliced: Callable[[Node], bool]) -> List[Node]:
    """Replace the autocast cast behind each eligible site's W by ``hot::weight_cast`` and
    give the site's op its column maxima (and, under an FP8 forward, the site its W
    maxima: ``w_max``); returns the new ops (for splicing). ``spliced``: whether a site's
    op will be spliced (``splice.refusal``). Run after ``forward.gate_forward``: a weight
    gets row maxima where a site reading it has a row-wise FP8 forward."""
    units = [s for s in sites if s.rewritten_gx is not None and s.rewritten_gx.target is UNIT_OP
             and not s.w_chain and spliced(s.rewritten_gx)]
    ops = {s.rewritten_gx for s in units}
    rowwise = {_source(s.rewritten_gx.args[_W_ARG]) for s in units
               if s.forward == "fp8_rowwise"}
    # weight_cast op -> (copy, column maxima, row maxima or None where not asked for)
    owned: Dict[Node, Tuple[Node, Node, Optional[Node]]] = {}
    for s in units:
        unit = s.rewritten_gx
        w = unit.args[_W_ARG]
        src = _source(w)
        if src.op == "call_function" and src.target is operator.getitem \
                and src.args[0] in owned and src.args[1] == 0:
            copy, col_max, row_max = owned[src.args[0]]          # a weight another site owns
        elif src.op == "call_function" and src.target in CASTS and _same_layout(w, src) \
                and _castable(src, ops):
            rows = src in rowwise
            op = add_node(graph, WEIGHT_CAST_OP, (src.args[0], src.meta["val"].dtype, kernels,
                                                  rows),
                          before=src, tag="is_forward", like=src, fake_mode=fake_mode)
            item = lambda i: add_node(graph, operator.getitem, (op, i), before=src,  # noqa: E731
                                      tag="is_forward", like=src, val=op.meta["val"][i])
            copy, col_max, row_max = item(0), item(1), item(2) if rows else None
            src.replace_all_uses_with(copy)
            graph.erase_node(src)
            owned[op] = (copy, col_max, row_max)
        else:
            continue
        if _same_layout(w, copy):       # W is the copy itself, not a transpose of it
            unit.kwargs = {**unit.kwargs, "w_col_max": col_max}
            s.w_cast = True
            if s.forward == "fp8":
                s.w_max = col_max
            elif s.forward == "fp8_rowwise" and row_max is not None:
                s.w_max = row_max
    return list(owned)
