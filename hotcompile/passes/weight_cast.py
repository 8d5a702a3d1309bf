"""Own autocast's cast of a rewritten site's weight: one kernel writes the copy and its maxima,
and one read of the copy writes every operand the step makes from W.

Why: the e4m3 W operand of HQ takes its scale from max |W[:, i]| (``reference.e4m3_bound_scale``).
Left to Inductor, that column maximum is fused into autocast's cast of the fp32 parameter only
when the weight has enough columns for Inductor not to split the reduction (I = 11008 yes,
4096 no: bench/colmax_fusion.py); otherwise it is a reduction of its own, a whole extra read
of the bf16 copy (~0.25 ms per Llama d4096 step on an H100). ``hot::weight_cast`` takes the
cast node's place: the same copy, bit for bit, for every reader (the forward GEMM first),
its column maxima and, where a reading site has a row-wise FP8 forward, its row maxima, all
from one pass over the parameter.

``hot::weight_operands`` then reads the copy once where the sites' g_x takes W as scaled
e4m3 (``formats.unit_w_is_e4m3``: the cuBLAS FP8 g_x on Ada/Hopper): its W kernel writes
HQ's operand (handed to the sites' backward ops as ``w_q``, ``w_s``, so they read no W)
and, under an FP8 forward, that forward's W operand with its scale from the maxima
(``site.w_fp8``, read by ``forward.py``). Before, W's FP8 cast was a pointwise kernel of its
own reading the copy again: W kernel + cast 0.0421 / 0.0988 / 0.1522 ms against 0.0306 /
0.0708 / 0.0709 ms in one kernel at Llama d4096's three W shapes (H100,
bench/results/kernel_ab_2026-11-27T043458). Elsewhere an FP8 site gets W's maxima
(``site.w_max``): the column maxima's max for a tensor-wise scale, the row maxima for a
row-wise one, so its cast is one pointwise read of the copy, not a reduction and a read.

The same holds for a ``hot::e4m3_gx_backward`` site (``exact_gx_gemm="e4m3"``): its
``hot::weight_operands(hq=False)`` writes the plain e4m3 W^T its FP8 g_x reads.

The pass puts one op of each kind per weight; ``splice.py`` launches consecutive ones
together (up to ``hadamard.WEIGHT_SLOTS`` weights per kernel launch: a layer's seven take two
launches, not fourteen).

A cast is taken over only where that is all it changes: the site's backward is one
``hot::linear_backward`` (or ``hot::e4m3_gx_backward``) op reading the copy through views
that keep its (O, I) layout, and
that op will be spliced (``spliced``: its W operand then comes from forward values only;
an opaque op would read the copy in backward, and the partitioner keeps our op's copy, 2
bytes per weight, where it recomputes a cast); the copy comes from an fp32 graph input,
nothing in backward reads it otherwise, and no activation checkpointing policy covers the
cast. Weights shared by several sites get one op of each.
"""
from __future__ import annotations

import operator
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch.fx import Graph, Node

from ..kernels.formats import unit_w_is_e4m3
from .find import LinearSite
from .op_sets import CASTS, LAYOUT_VIEWS
from .graph_utils import add_node
from .recompute import needed_in_backward

aten = torch.ops.aten
WEIGHT_CAST_OP = torch.ops.hot.weight_cast.default
WEIGHT_OPERANDS_OP = torch.ops.hot.weight_operands.default
UNIT_OP = torch.ops.hot.linear_backward.default
E4M3_GX_OP = torch.ops.hot.e4m3_gx_backward.default
_COPY_VIEWS = LAYOUT_VIEWS | {aten.alias.default}   # W's copy, read through a transpose or alias
_W_ARG = 10          # hot::linear_backward's w, and hot::e4m3_gx_backward's


def _w_reader(s: LinearSite) -> Optional[Node]:
    """The site's backward op that reads W whole: its ``hot::linear_backward``, or its
    ``hot::e4m3_gx_backward`` (``exact_gx_gemm="e4m3"``), else None."""
    if s.rewritten_gx is not None and s.rewritten_gx.target is UNIT_OP:
        return s.rewritten_gx
    if s.rewritten_gw is not None and s.rewritten_gw.target is E4M3_GX_OP:
        return s.rewritten_gw
    return None


def _source(n: Node) -> Node:
    """The node ``n`` is a view of (through ``_COPY_VIEWS``)."""
    while n.op == "call_function" and n.target in _COPY_VIEWS:
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


def castable_weight(s: LinearSite, readers: set) -> bool:
    """Whether ``own_weight_casts`` can take over the cast behind site s's W, told before the
    rewrite (the cost gate prices such a W as the step will run it, ``cost.STEP_KERNELS``):
    W is, through layout views, autocast's cast of an fp32 2-D graph input that backward
    reads only through ``readers`` (the eligible sites' g_x mms) and views. The rest of the
    takeover's conditions (both gradients HOT's in one spliced op, g_x taking W as e4m3) are
    the gate's to check."""
    src = _source(s.wt)
    return src.op == "call_function" and src.target in CASTS and _castable(src, readers)


def _w_in_forward(unit: Node) -> bool:
    """Whether the unit op's g_x will take W as scaled e4m3: the operand the forward's
    ``hot::weight_operands`` writes (``formats.unit_w_is_e4m3``; the op checks it again)."""
    g, xq, w = (unit.args[i].meta.get("val") for i in (0, 1, _W_ARG))
    if not all(isinstance(v, torch.Tensor) for v in (g, xq, w)) \
            or xq.dtype not in (torch.int8, torch.float8_e4m3fn):
        return False
    a = unit.args
    return unit_w_is_e4m3(g, w.shape[1], a[5], a[11], a[12], a[4], a[13] == "token")


def own_weight_casts(graph: Graph, sites: List[LinearSite], kernels: str, fake_mode,
                     spliced: Callable[[Node], bool]) -> List[Node]:
    """Replace the autocast cast behind each eligible site's W by ``hot::weight_cast``, and
    where the sites' g_x takes W as scaled e4m3 add ``hot::weight_operands`` after it: one
    read of the copy writes HQ's W operand (given to the sites' ops as ``w_q``, ``w_s``)
    and, under an FP8 forward, that forward's W operand (``site.w_fp8``). Other FP8 sites
    get W's maxima for their scale (``site.w_max``). Returns the new ops (for splicing).
    ``spliced``: whether a site's op will be spliced (``splice.refusal``). Run after
    ``forward.gate_forward``: a weight gets row maxima where a site reading it has a
    row-wise FP8 forward."""
    units = [s for s in sites if _w_reader(s) is not None and not s.w_chain
             and spliced(_w_reader(s))]
    ops = {_w_reader(s) for s in units}
    rowwise = {_source(_w_reader(s).args[_W_ARG]) for s in units
               if s.forward == "fp8_rowwise"}
    # weight_cast op -> (copy, column maxima, row maxima or None where not asked for)
    owned: Dict[Node, Tuple[Node, Node, Optional[Node]]] = {}
    readers: Dict[Node, List[LinearSite]] = {}      # op -> sites whose W is its copy as is
    for s in units:
        unit = _w_reader(s)
        w = unit.args[_W_ARG]
        src = _source(w)
        if src.op == "call_function" and src.target is operator.getitem \
                and src.args[0] in owned and src.args[1] == 0:
            op = src.args[0]                                     # a weight another site owns
        elif src.op == "call_function" and src.target in CASTS and _same_layout(w, src) \
                and _castable(src, ops):
            rows = src in rowwise
            op = add_node(graph, WEIGHT_CAST_OP, (src.args[0], src.meta["val"].dtype, kernels,
                                                  rows),
                          before=src, tag="is_forward", like=src, fake_mode=fake_mode)
            item = lambda i: add_node(graph, operator.getitem, (op, i), before=src,  # noqa: E731
                                      tag="is_forward", like=src, val=op.meta["val"][i])
            owned[op] = (item(0), item(1), item(2) if rows else None)
            src.replace_all_uses_with(owned[op][0])
            graph.erase_node(src)
        else:
            continue
        if _same_layout(w, owned[op][0]):       # W is the copy itself, not a transpose of it
            s.w_cast = op
            readers.setdefault(op, []).append(s)
    new = list(owned)
    for op, readers_of in readers.items():
        new += _weight_operands(graph, op, owned[op], readers_of, kernels, fake_mode)
    return new


def _weight_operands(graph: Graph, op: Node, outs, readers: List[LinearSite], kernels: str,
                     fake_mode) -> List[Node]:
    """Give one owned weight's readers their operands: ``hot::weight_operands`` where any
    reader's g_x takes W as scaled e4m3 (the forward operand in it too when the FP8 readers
    agree on a format), else W's maxima for each FP8 reader's scale."""
    copy, col_max, row_max = outs
    maxima = {"fp8": col_max, "fp8_rowwise": row_max}
    for s in readers:
        s.w_max = maxima.get(s.forward)
    hq = [s for s in readers if s.rewritten_gx is not None and _w_in_forward(s.rewritten_gx)]
    plain = [s for s in readers if s.gx_e4m3]
    if not hq and not plain:
        return []
    if hq:              # a weight read both ways (never seen): the plain readers make theirs
        plain = []
    fmts = {s.forward for s in readers if s.w_max is not None}
    forward = fmts.pop() if len(fmts) == 1 else "bf16"
    after = (row_max or col_max).next                # right after the weight_cast's outputs
    wo = add_node(graph, WEIGHT_OPERANDS_OP, (copy, col_max, maxima.get(forward), forward,
                                              kernels, not plain),
                  before=after, tag="is_forward", like=copy, fake_mode=fake_mode)
    item = lambda i: add_node(graph, operator.getitem, (wo, i), before=after,  # noqa: E731
                              tag="is_forward", like=copy, val=wo.meta["val"][i])
    w_q, w_s = item(0), item(1)
    for s in hq + plain:
        op = _w_reader(s)
        op.kwargs = {**op.kwargs, "w_q": w_q, "w_s": w_s}
    if forward != "bf16":
        fwd = item(2), item(3)
        for s in readers:
            if s.forward == forward:
                s.w_fp8, s.w_max = fwd, None
    return [wo]
