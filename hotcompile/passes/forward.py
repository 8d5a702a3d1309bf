"""The forward pass: a rewritten site's forward GEMM on FP8 (``HOTConfig.forward``: "fp8"
with tensor-wise scales, "fp8_rowwise" with one per token and per output feature).

Why only rewritten sites: the FP8 forward rides on the decision the backward's cost gate
made (a site HOT leaves exact stays exactly as Inductor compiles it), and it has a gate
of its own (``cost.CostModel.predict_forward``): the two casts cost a pass over x and W,
which small GEMMs do not pay back. Sites that share an input (q/k/v, gate/up: one ABC
group) share one cast of it. The replacement is ``kernels.fp8_forward`` recorded op for
op (``graph_utils.emit``): aten ops Inductor fuses and launches, and the reference twin
the tests compare against. The forward's saved tensors do not change: backward reads W
and ABC's buffer, never the FP8 operands. Where ``hot::weight_cast`` made W (``weight_cast.
py``, run between the gate and the rewrite), ``hot::weight_operands`` wrote W's FP8 operand
in the same read of the copy as HQ's (``site.w_fp8``), or W's scale comes from the maxima
the cast wrote (``site.w_max``) and W's FP8 cast is one pointwise read of the copy.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Tuple

import torch
from torch.fx import Graph, Node
from torch.utils.checkpoint import CheckpointPolicy

from ..kernels import fp8_forward as F8
from ..kernels.reference import SQRT_2_OVER_PI, SQRT_HALF, TANH_CUBIC
from . import cost, strided_output
from .abc import ABC_OP
from .find import LinearSite
from .graph_utils import emit

aten = torch.ops.aten


def _bias(site: LinearSite):
    return site.fwd.args[0] if site.fwd.target == aten.addmm.default else None


def gate_forward(sites: List[LinearSite], config) -> None:
    """Set each site's ``forward`` (the requested FP8 format, what ``"auto"`` resolves to
    on its device, or "bf16") and, for bf16 where FP8 was asked for, ``forward_reason``."""
    if config.forward == "bf16":
        return
    shares: Dict[str, int] = {}
    for s in sites:
        if s.group:
            shares[s.group] = shares.get(s.group, 0) + 1
    for s in sites:
        s.forward, s.forward_reason, ms = forward_plan(s, config, 1.0 / shares.get(s.group, 1))
        s.forward_ms = ms or s.forward_ms


def forward_plan(s: LinearSite, config, x_share: float = 1.0):
    """(format, reason, (bf16 ms, FP8 ms) or None) of site s's forward: what ``gate_forward``
    gives it, rewritten (the backward's gate asks first: where the forward stays bf16, ABC
    takes its bound from a reduction of its own, ``cost.STEP_KERNELS``). ``x_share``: the
    site's part of a cast of x shared by its group. A site whose weight cast the backward's
    gate priced as HOT's own (``site.w_owned``) gets W's FP8 operand from the one read that
    writes HQ's (``weight_cast._weight_operands``, priced there): no cast of W of its own.
    A row-wise site whose x is GELU's output gets its cast from GELU's kernel
    (``_gelu_producer``, ``hot::gelu_e4m3``), priced as that kernel's time over GELU's
    (``cost.STEP_KERNELS``); ``recompute_operands`` keeps the op out (the backward rebuilds
    GELU's output there), so the price of a cast reading x."""
    if config.forward == "bf16":
        return "bf16", "", None
    x, y = s.x.meta.get("val"), s.fwd.meta.get("val")
    if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
        # "auto" asked nothing it could resolve: no reason
        return "bf16", ("" if config.forward == "auto" else
                        "no fake tensor to check the FP8 GEMM against"), None
    pad = F8.out_padding(s.O) if isinstance(s.O, int) else 0
    no_pad = _padding_refusal(s, pad) if pad else None
    fmt, why = F8.forward_rule(config.forward, x.device, s.I, s.O, y.dtype,
                               pad_out=bool(pad) and no_pad is None)
    if no_pad and why.startswith("FP8 forward needs out-features"):
        why = f"{why}; W not padded: {no_pad}"
    ms = None
    if fmt != "bf16":
        model = cost.model_for(x.device)
        if model is not None and isinstance(s.L, int):
            gelu = (fmt == "fp8_rowwise" and not config.recompute_operands
                    and _gelu_producer(s.x) is not None)
            # priced at the padded width (Inductor pads an unaligned bf16 GEMM too)
            exact, fp8 = ms = model.predict_forward(s.L, s.I, s.O + pad, x_share,
                                                    w_owned=s.w_owned, gelu=gelu)
            if config.min_speedup > 0 and exact < config.min_speedup * fp8:
                fmt, why = "bf16", (f"cost gate: predicted forward {fp8:.3f} ms in FP8 vs "
                                    f"{exact:.3f} ms bf16 ({exact / fp8:.2f}x < min_speedup "
                                    f"{config.min_speedup:g})")
    s.forward_pad = pad if fmt != "bf16" else 0
    return fmt, why, ms


def _padding_refusal(s: LinearSite, pad: int) -> Optional[str]:
    """Why site s's FP8 forward cannot pad W by ``pad`` rows (None where it can): only a
    site whose backward stays exact (a rewritten site's W operand and maxima can come from
    HOT's weight kernels, written at O rows), and only where the output may be a strided
    view (``strided_output.refusal``)."""
    if s.eligible:
        return "only where the backward stays exact"
    return strided_output.refusal(s.fwd, pad)


def _bound_reader(s: LinearSite, buffers: Dict[str, Tuple[Node, Node]]) -> Optional[Node]:
    """The ``hot::abc_compress`` node of ``s``'s group when it can take its e4m3 bound,
    max |x|, from this site's FP8 cast of x: it runs in the forward, saves e4m3 (a bound
    scale; int8 levels take their scale from the projection instead), reads the very node
    the cast reads, and has no bound yet."""
    outs = buffers.get(s.group or s.key)
    comp = outs[0].args[0] if outs else None
    if comp is None or comp.target is not ABC_OP or s.gw_format != "e4m3":
        return None
    has_bound = len(comp.args) == len(ABC_OP._schema.arguments)     # ``amax`` given
    if has_bound or comp.meta.get("partitioner_tag") != "is_forward" or comp.args[0] is not s.x:
        return None
    return comp


def rewrite_forward(graph: Graph, sites: List[LinearSite], config, fake_mode,
                    buffers: Optional[Dict[str, Tuple[Node, Node]]] = None) -> None:
    """Replace the forward GEMM of every rewritten site the gate (``gate_forward``, run
    first) let through. ``buffers``: ``abc.compress_inputs``'s; a group's compression
    that reads the x the FP8 forward casts takes its bound from the cast's maxima
    (``fp8_forward.max_bits``): the cast goes before it. Where x is GELU's output, GELU
    and the row-wise cast become one ``hot::gelu_e4m3`` (``_gelu_producer``): returned, for
    the splicing pass."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    todo = sorted((s for s in sites if s.forward != "bf16"), key=lambda s: order[s.fwd])
    casts: Dict[object, tuple] = {}
    producers: List[Node] = []
    for s in todo:
        pad = s.forward_pad
        if pad and (why := strided_output.refusal(s.fwd, pad)):    # a reader came since
            s.forward, s.forward_reason, s.forward_pad = "bf16", f"W not padded: {why}", 0
            continue
        meta = {k: s.fwd.meta[k] for k in ("recompute", "ac_graph_id") if k in s.fwd.meta}
        rowwise = s.forward == "fp8_rowwise"
        key = (s.group or s.key, rowwise)
        if key not in casts:     # the group's first forward GEMM: cast x there, once
            x_dtype = s.x.meta["val"].dtype
            comp = _bound_reader(s, buffers or {})
            gelu = _gelu_producer(s.x) if rowwise else None
            if gelu is not None:
                out = _cast_in_gelu(graph, *gelu, s.x, config.kernels, fake_mode)
                producers.append(out[0])
                _repoint(sites, gelu[0], out[1])
                for t in todo:
                    if (t.group or t.key) == key[0]:
                        t.x_cast = out[0]
                out = out[2:]
            else:
                out = emit(graph, lambda x: F8.e4m3_cast(x, rowwise, contiguous=True,
                                                         dtype=x_dtype, bound=comp is not None),
                           (s.x,), comp or s.fwd, "is_forward", s.fwd, fake_mode, meta)
            if comp is not None:
                comp.args = comp.args + (out[2],)
            casts[key] = out[:2]
        xq, sx = casts[key]
        dtype = s.fwd.meta["val"].dtype
        w_dtype = s.wt.meta["val"].dtype

        def site_gemm(wt, xq, sx, bias, w_max, dtype=dtype, rowwise=rowwise, w_dtype=w_dtype,
                      O=s.O, pad=pad):
            wq, sw = F8.weight_operand(wt, rowwise, w_dtype, w_max, pad)
            return F8.padded_linear(xq, sx, wq, sw, bias, dtype, O, pad)

        if s.w_fp8 is not None:     # hot::weight_operands wrote W's operand
            y = emit(graph, lambda xq, sx, wq, sw, bias: F8.scaled_linear(xq, sx, wq, sw, bias,
                                                                         dtype),
                     (xq, sx, *s.w_fp8, _bias(s)), s.fwd, "is_forward", s.fwd, fake_mode, meta)
        else:
            y = emit(graph, site_gemm, (s.wt, xq, sx, _bias(s), s.w_max), s.fwd, "is_forward",
                     s.fwd, fake_mode, meta)
        s.fwd.replace_all_uses_with(y)
        graph.erase_node(s.fwd)
        _repoint(sites, s.fwd, y)
        if pad:     # y is the padded GEMM's strided view: its views' values say so
            strided_output.restride(y)
    return producers


# what may stand between GELU's output and x: views, and the clone a Dropout(p=0) leaves in
# a training graph (timm's Mlp: fc1, GELU, dropout, fc2)
PASS_THROUGH = (aten.view.default, aten._unsafe_view.default, aten.reshape.default,
                aten.clone.default)
# what autograd holds a saved value by (``alias(tanh)`` for tanh's backward): no copy
ALIASES = (aten.alias.default, aten.view.default, aten._unsafe_view.default,
           aten.reshape.default)
CAST = torch.ops.prims.convert_element_type.default


def _gelu_producer(x: Node) -> Optional[Tuple[Node, Node, str]]:
    """(GELU's bf16 output node, its bf16 input h, F.gelu's ``approximate``) where ``x`` is
    that output through views (or a clone: ``PASS_THROUGH``) and ``hot::gelu_e4m3`` can make
    x and its row-wise cast in one pass, bit for bit as Inductor computes them: GELU in the
    forward, on row-major bf16 of static shape whose rows are x's
    (``producer_cast.fusable``). The joint graph holds GELU decomposed (``_gelu_formula``),
    h read as itself or cast to fp32: ``F.gelu`` (exact or tanh's) as fp32 ops between
    cast(h, fp32) and a cast to bf16; Hugging Face's ``gelu_new`` (GPT-2) as CUDA autocast
    runs it, its ``pow`` in fp32 and so the ops after it, then autocast's cast to bf16 for
    the next linear. Those Inductor computes in fp32 and rounds once, as the op does. Left
    to Inductor (``_rounds_inside``): a formula with an op computing in bf16 (``gelu_new``
    in a bf16 model: Inductor's bits then depend on which of those ops it stores, which
    the partitioner decides later, and torch 2.13 rounds one it saves for backward), and
    one whose ops have a reader outside it in the forward (Inductor would store that op's
    value and compute GELU's output from it in another kernel). Not where the backward
    rebuilds GELU's output (a recompute policy on it: ``recompute_operands``, ABC
    compressing in backward, activation checkpointing): the partitioner would run the
    whole op again there, levels and all, where the aten chain rebuilds GELU alone.
    Anything else keeps the cast in aten ops, which Inductor fuses as it can."""
    y = x
    while y.target in PASS_THROUGH:
        y = y.args[0]
    if not isinstance(y, Node) or y.meta.get("partitioner_tag") != "is_forward":
        return None
    if y.meta.get("recompute") not in (None, CheckpointPolicy.MUST_SAVE):
        return None
    root = y
    if _cast(root, torch.bfloat16):               # the formula's fp32 result cast down
        root = root.args[0]
        while isinstance(root, Node) and root.target in PASS_THROUGH:
            root = root.args[0]
    found = _gelu_formula(root)
    if found is None:
        return None
    c, approximate = found
    h = _uncast(c)
    if _rounds_inside(root, y, h):
        return None
    hv, xv, yv = h.meta.get("val"), x.meta.get("val"), y.meta.get("val")
    if not all(isinstance(v, torch.Tensor) for v in (hv, xv, yv)) or xv.dim() != 2:
        return None
    if any(not isinstance(d, int) for d in (*hv.shape, *xv.shape)):
        return None                     # sizes the kernel's grid would have to follow
    from ..kernels.producer_cast import MAX_WIDTH
    ok = (hv.dtype == yv.dtype == torch.bfloat16 and hv.dim() >= 1 and hv.is_contiguous()
          and xv.is_contiguous() and hv.shape[-1] == xv.shape[1] and 0 < xv.shape[1] <= MAX_WIDTH)
    return (y, h, approximate) if ok else None


def _uncast(n):
    """a where n is cast(a, fp32) (how an op reads bf16 a in fp32), else n."""
    return n.args[0] if _cast(n, torch.float32) else n


def _formula_ops(n, h: Node, ops: Dict[Node, None]) -> Dict[Node, None]:
    """The ops of the formula from ``n`` down to h (h and its fp32 casts excluded)."""
    if isinstance(n, Node) and _uncast(n) is not h and n not in ops:
        ops[n] = None
        for a in n.args:
            _formula_ops(a, h, ops)
    return ops


def _rounds_inside(root: Node, y: Node, h: Node) -> bool:
    """Whether Inductor may round inside the formula rooted at ``root`` (GELU's output
    ``y`` being root or its cast through views) where ``hot::gelu_e4m3`` does not, or
    fuse it otherwise than in one kernel: an op computing in bf16 other than the halving
    of h (exact), or an op read in the forward by a node outside the formula (Inductor
    stores that value and may compute GELU's output from it in another kernel: rounded
    if bf16; exact if fp32, but that fusion is Inductor's choice, left to it). Backward
    readers are the partitioner's: an fp32 value it keeps or rebuilds is exact."""
    ops = _formula_ops(root, h, {})
    n = y
    while n is not root:                           # the cast and views down to the root
        ops[n] = None
        n = n.args[0]
    for n in ops:
        v = n.meta.get("val")
        if getattr(v, "dtype", torch.float32) != torch.float32 and n is not y:
            half = _times(n, 0.5)
            if half is None or _uncast(half) is not h:
                return True
        if n is not y and any(u not in ops and not _backward_only(u) for u in n.users):
            return True
    return False


def _backward_only(n: Node) -> bool:
    """Whether n is a backward node, or an alias or view (autograd's hold on a value it
    saves: ``alias(tanh)`` for tanh's backward) read by backward nodes alone."""
    if n.meta.get("partitioner_tag") == "is_backward":
        return True
    return (n.target in ALIASES and bool(n.users)
            and all(_backward_only(u) for u in n.users))


def _cast(n: Node, dtype: torch.dtype) -> bool:
    return isinstance(n, Node) and n.target is CAST and n.args[1] == dtype


def _operands(n, target) -> Optional[tuple]:
    """n's two operands where n is a ``target`` node of two, else None."""
    if not isinstance(n, Node) or n.target is not target or len(n.args) != 2:
        return None
    return n.args


def _times(n, const) -> Optional[Node]:
    """a where n is mul(a, const) or mul(const, a), else None."""
    args = _operands(n, aten.mul.Tensor)
    if args and const in args:
        a = args[0] if args[1] == const else args[1]
        return a if isinstance(a, Node) else None
    return None


def _plus_one(n) -> Optional[Node]:
    """a where n is add(a, 1) or add(1, a), else None."""
    args = _operands(n, aten.add.Tensor)
    if args and 1 in args:
        a = args[0] if args[1] == 1 else args[1]
        return a if isinstance(a, Node) else None
    return None


def _is_cube(n, c: Node) -> bool:
    """Whether n is c ** 3 (c as itself or cast to fp32: ``_uncast``): mul(mul(c, c), c) in
    either order (tanh's decomposition), or pow(c, 3) (Hugging Face's ``gelu_new``), which
    Inductor lowers to the same products."""
    same = lambda a: isinstance(a, Node) and _uncast(a) is c  # noqa: E731
    if isinstance(n, Node) and n.target is aten.pow.Tensor_Scalar:
        return same(n.args[0]) and n.args[1] == 3
    args = _operands(n, aten.mul.Tensor)
    for sq, one in (args, args[::-1]) if args else ():
        pair = _operands(sq, aten.mul.Tensor)
        if same(one) and pair and all(same(a) for a in pair):
            return True
    return False


def _gelu_formula(g) -> Optional[Tuple[Node, str]]:
    """(c, approximate) where ``g`` is GELU of c as ``reference.gelu`` computes it, each
    product's and sum's operands in either order and every other read of c as c or its
    fp32 cast (``_uncast``): mul(mul(c, 0.5), add(t, 1)) with t = erf(mul(c, sqrt(1/2)))
    ("none") or tanh(mul(add(c, mul(c**3, 0.044715)), sqrt(2/pi))) ("tanh"), else None."""
    args = _operands(g, aten.mul.Tensor)
    for half, one in (args, args[::-1]) if args else ():
        c, t = _times(half, 0.5), _plus_one(one)
        if c is None or t is None:
            continue
        base = _uncast(c)
        same = lambda a: isinstance(a, Node) and _uncast(a) is base  # noqa: E731
        if t.target is aten.erf.default and same(_times(t.args[0], SQRT_HALF)):
            return c, "none"
        if t.target is aten.tanh.default:
            inner = _operands(_times(t.args[0], SQRT_2_OVER_PI), aten.add.Tensor)
            for a, b in (inner, inner[::-1]) if inner else ():
                if same(a) and _is_cube(_times(b, TANH_CUBIC), base):
                    return c, "tanh"
    return None


def _cast_in_gelu(graph: Graph, gelu: Node, h: Node, approximate: str, x: Node,
                  kernels: str, fake_mode):
    """Replace GELU's output node ``gelu`` by ``hot::gelu_e4m3`` on the rows of its input
    ``h`` (``approximate``: which GELU): (that op, GELU's output in its shape, x's e4m3
    levels, their (L, 1) scale view as ``e4m3_cast`` gives it, max |x| as ``max_bits``'s
    word for the saved x's bound). GELU's users (x's view among them) read the op's
    output: the same values (``reference.gelu_e4m3``); its decomposed ops go with
    dead-code elimination, unless something else reads them."""
    shape = list(gelu.meta["val"].shape)
    rows, width = x.meta["val"].shape

    def body(h):
        out = torch.ops.hot.gelu_e4m3.default(aten.view.default(h, [rows, width]), kernels,
                                               approximate)
        y, q, s, m = (out[i] for i in range(4))
        return (y, aten.view.default(y, shape), q,
                aten.as_strided.default(s, [rows, 1], [1, 1]), F8.max_bits(m, True))

    meta = {k: gelu.meta[k] for k in ("recompute", "ac_graph_id") if k in gelu.meta}
    out = emit(graph, body, (h,), gelu, "is_forward", gelu, fake_mode, meta)
    op = out[0].args[0]
    gelu.replace_all_uses_with(out[1])
    graph.erase_node(gelu)
    return (op, *out[1:])


def _repoint(sites: List[LinearSite], old: Node, new: Node) -> None:
    """Every site field (and token layout) that held ``old``, a forward GEMM just replaced,
    holds ``new`` instead: the site's own ``fwd``, and the ``x`` of a site that reads it
    with no op between (two linears back to back). Why: that ``x`` kept the erased node,
    and the next site's FP8 cast read a node no longer in the graph ("referenced
    nonexistent value addmm": the GPU property suite, fiftieth stop)."""
    for t in sites:
        for f in dataclasses.fields(t):
            if getattr(t, f.name) is old:
                setattr(t, f.name, new)
        if t.layout is not None and getattr(t.layout, "source", None) is old:
            t.layout.source = new
