"""Keep the activations the partitioner saves for backward in FP8 (``saved_activations="fp8"``).

Why after the partition and not in the joint graph: which tensors are kept is the min-cut
partitioner's decision (it recomputes a LayerNorm's output or a GELU's from what it keeps
anyway). Compressing in the joint graph would compress tensors it would have recomputed
and keep both a GELU's input and output where it keeps one. Run on its result, the pass
changes only what is really kept: each eligible saved tensor S becomes the parts of
``kernels.saved_fp8.compress_centred(S)`` (or ``compress``) at the same place among the
forward's outputs and the backward's inputs, and the backward reads ``decompress`` of them
wherever it read S.

What is eligible, and why the rest is not (each kept tensor's reason goes to the report):
- a floating-point tensor of bf16, fp16 or fp32, dense (contiguous or a permutation of
  it: a transposed input), whose rows (its memory's last axis) hold at least ``MIN_ROW``
  elements: a per-row scale costs 4 bytes a row (a row over 1024 wide is scaled in blocks);
- made from the step's activations: not a graph input, not a user output (kept anyway),
  not made from parameters and constants only (a weight's bf16 copy: its error would
  enter every g_x; a causal mask);
- read in backward only by ops that tolerate a 2^-4 relative error per element
  (``TOLERANT``, through views): GEMMs (a weight gradient), the pointwise algebra and
  reductions of LayerNorm / RMSNorm / GELU / SiLU backward. Not attention's saved inputs
  and output (flash attention recomputes softmax(q k^T) and checks it against the saved
  log-sum-exp: a perturbed q or k moves every probability), not logits whose softmax the
  backward recomputes (an error of |z| / 16 in an exponent: cross-entropy's saved logits),
  and not an op the pass does not know (it keeps the exact tensor).

Rows are stored centred (``saved_fp8.compress_centred``: t - mean, the mean kept too) unless a
backward op compares S (``comparison_step``): the error is then 2^-4 of S's spread, not of an
offset it carries (a residual-stream summand with a large bias, whose LayerNorm backward
recomputes x - mean); a compared S (ReLU's mask) keeps plain rows, where zero stays zero.
A row longer than 1024 is scaled in blocks (``saved_fp8.block_of``: 3072 -> 3 x 1024), so
that Inductor compresses it in one pass with its producer (a persistent reduction). A bf16
row that a norm reduces in the forward is centred whole (``norm_reads_rows``): its mean
joins the norm's kernel. ``"auto"`` narrows an fp32 tensor only where it centres whole rows
(``_centred_in_blocks``): with block means of its LayerNorms' wide outputs, ViT-H/14 ran
slower than Inductor.

A kept tensor that is a pointwise function of another one to compress (GELU's output beside
its input: ``recompute.kept_chain``) is not kept: the backward rebuilds it from the other's
restoration. Each restoration sits right before its first reader, and the backward is
compiled in this order (``entry.SAVED_BACKWARD_PATCHES``).
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Callable, Dict, List, Optional, Set, Tuple

import torch
from torch.fx import GraphModule, Node

from ..kernels import saved_fp8
from . import op_sets
from .graph_utils import emit, fake_mode_of, same_shape, same_size
from .recompute import kept_chain, replay
from .saved_readers import VIEWS, comparison_step, reaches, reject_reader

aten = torch.ops.aten
prims = torch.ops.prims

MIN_ROW = 64
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_HALF = (torch.bfloat16, torch.float16)


@dataclasses.dataclass
class SavedSummary:
    """What one graph keeps for backward, before and after (bytes at the traced sizes)."""
    compressed: int = 0
    kept: int = 0
    bytes_before: int = 0
    bytes_after: int = 0
    reasons: Dict[str, int] = dataclasses.field(default_factory=dict)   # kept exact, why
    formats: Dict[str, int] = dataclasses.field(default_factory=dict)   # compressed: "fp8", "bf16"
    # each kept tensor: [forward node, dtype, shape, "fp8" or why exact]
    tensors: List[list] = dataclasses.field(default_factory=list)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _hint(v) -> int:
    h = getattr(getattr(v, "node", None), "hint", None)
    return int(h if h is not None else v)


def _nbytes(val) -> int:
    n = 1
    for s in val.shape:
        n *= _hint(s)
    return n * val.element_size()


def _from_activations(fw: GraphModule, params: Set[str]) -> Set[Node]:
    """Forward nodes that depend on an input other than a parameter."""
    live: Set[Node] = set()
    for n in fw.graph.nodes:
        if n.op == "placeholder":
            if n.name not in params:
                live.add(n)
        elif any(a in live for a in n.all_input_nodes):
            live.add(n)
    return live


def _reject_saved(s: Node, user_outs: Set[Node], live: Set[Node]) -> Optional[str]:
    val = s.meta["val"]
    if val.dtype not in _DTYPES:
        return f"dtype {str(val.dtype).replace('torch.', '')}"
    base = s
    while base.op == "call_function" and base.target in VIEWS - {
            aten.clone.default, prims.convert_element_type.default, aten._to_copy.default}:
        base = base.args[0]
    if base.op == "placeholder":
        return "a graph input" if base is s else "a view of a graph input"
    if base in user_outs:
        return "also a forward output" if base is s else "a view of a forward output"
    if s not in live:
        return "made from parameters or constants only"
    if s.meta.get("saved_tensor_with_no_vc_check"):
        return "stashed without a version check"
    return None


def memory_order(val) -> Optional[List[int]]:
    """The permutation that makes ``val`` contiguous (``val.permute(p)`` is its memory read
    in order; the identity for a contiguous tensor), or None if ``val`` is not a
    permutation of a dense layout. Why: a transposed input kept for ``x^T @ g`` (GPT-2's
    Conv1D layers keep ``x^T``) is compressed along its memory rows, the same rows as the
    activation it transposes. Sizes and strides by their hints (no guard installed)."""
    sizes = [_hint(d) for d in val.shape]
    strides = [_hint(d) for d in val.stride()]
    # at equal strides the larger axis goes outside: a (rows, 1) statistic (LayerNorm's mean,
    # rstd, strides (1, 1)) keeps rows of 1, so it is never narrowed; the price is that a
    # (1, n) tensor with strides (1, 1) has rows of 1 too and stays exact
    order = sorted(range(val.dim()), key=lambda i: (-strides[i], -sizes[i]))
    expect = 1
    for i in reversed(order):
        if sizes[i] != 1 and strides[i] != expect:
            return None
        expect *= sizes[i]
    return order


def _reject_layout(val) -> Optional[str]:
    order = memory_order(val) if val.dim() else None
    if order is None:
        return "not dense" if val.dim() else f"rows shorter than {MIN_ROW}"
    last = val.shape[order[-1]]
    if not isinstance(last, int):
        return "rows of a dynamic width"
    if last < MIN_ROW:
        return f"rows shorter than {MIN_ROW}"
    return None


def device_reason(fw: GraphModule) -> Optional[str]:
    """Why this graph's device cannot hold e4m3 tensors, or None: Triton converts to e4m3
    from compute capability 8.9 on (Ada, Hopper); the CPU through Inductor's C++ code."""
    for n in fw.graph.find_nodes(op="placeholder"):
        v = n.meta.get("val")
        if not isinstance(v, torch.Tensor):
            continue
        if v.device.type == "cuda":
            cap = torch.cuda.get_device_capability(v.device)
            if cap < (8, 9):
                return f"e4m3 needs compute capability >= 8.9 (got {cap[0]}.{cap[1]})"
        elif v.device.type != "cpu":
            return f"no e4m3 conversion on {v.device.type}"
    return None


# what a norm's statistics take of its input on the way to the row reduction: RMSNorm's
# x * x or x ** 2, a cast under autocast, a residual or bias added in the norm's kernel
_NORM_WALK = op_sets.CASTS | {aten.pow.Tensor_Scalar, aten.mul.Tensor, aten.square.default,
                              aten.add.Tensor, aten.sub.Tensor}
_ROW_REDUCTIONS = frozenset({aten.mean.dim, aten.sum.dim_IntList, aten.var_mean.correction,
                             aten.var.correction})


def _shape(n) -> Optional[list]:
    v = n.meta.get("val") if isinstance(n, Node) else None
    return list(v.shape) if isinstance(v, torch.Tensor) else None


def norm_reads_rows(s: Node) -> bool:
    """Whether the forward reduces ``s`` over its last axis (through casts, squares, adds and
    views that keep its rows: a linear's 2-D output viewed back to (batch, seq, width)):
    LayerNorm's mean and variance, RMSNorm's mean of squares. A bf16 row mean of ``s`` is
    then one more reduction of that kernel's row (``saved_fp8.narrow``)."""
    width = _shape(s)[-1]
    todo, walked = [s], {s}
    while todo:
        n = todo.pop()
        shape = _shape(n)
        for u in n.users:
            if u.target in _ROW_REDUCTIONS and u.args[0] is n:
                dims = u.args[1] if len(u.args) > 1 else u.kwargs.get("dim")
                dims = [dims] if isinstance(dims, int) else dims or ()     # None: every axis
                if [d % len(shape) for d in dims] == [len(shape) - 1]:
                    return True
                continue
            out = _shape(u)
            if u in walked or out is None:
                continue
            # pointwise: n itself, not broadcast; a view: the same rows of ``width``
            if ((u.target in _NORM_WALK and same_shape(out, shape))
                    or (u.target in op_sets.SHAPE_VIEWS and out and same_size(out[-1], width))):
                walked.add(u)
                todo.append(u)
    return False


def _compress_one(fw: GraphModule, bw: GraphModule, s: Node, ph: Node, first_use: Node, fake,
                  fmt: str) -> Tuple[List[Node], Callable[[Node], Node]]:
    """Kept tensor ``s`` (``ph`` in the backward) -> the forward's nodes of its compressed
    form (``fmt``: "fp8": e4m3 levels and scale, "bf16": the narrowed tensor; ", centred":
    of t - m, with the block's mean m as one more part); the backward's readers of ``ph``
    read its restoration instead. Rows are the memory's rows (``memory_order``), scaled and
    centred in the blocks of ``saved_fp8.block_of`` (bf16 rows a norm reduces: whole). Also
    returned: a function that restores it once more, before a given backward node (for a
    kept tensor rebuilt from it)."""
    val = s.meta["val"]
    centred = fmt.endswith("centred")
    order = memory_order(val)                            # dense: ``_reject_layout`` passed
    identity = order == list(range(len(order)))
    back = None if identity else sorted(range(len(order)), key=order.__getitem__)
    shape = [val.shape[i] for i in order]                # of the rows in memory order
    width = int(shape[-1])                               # static: ``_reject_layout`` passed
    block = saved_fp8.block_of(width)

    def rows_of(t):
        """The blocks of ``t`` (a proxy of ``shape``): a dynamic size is read off ``t``."""
        if block == width:
            return saved_fp8.Rows(width, block)
        return saved_fp8.Rows(width, block, tuple(
            d if isinstance(d, int) else aten.sym_size.int(t, i) for i, d in enumerate(shape)))

    if fmt.startswith("fp8"):
        compress = saved_fp8.compress_centred if centred else saved_fp8.compress
        pack = lambda t: compress(t, rows_of(t))  # noqa: E731
        unpack = lambda q, scale, *mean: saved_fp8.decompress(  # noqa: E731
            q, scale, val.dtype, *mean, rows=rows_of(q))
    elif bf16_whole_rows(s, val):
        # bf16, whole rows (``saved_fp8.narrow``): no view, no size read off the tensor
        whole = saved_fp8.Rows(width, width)
        pack = lambda t: saved_fp8.narrow(t, whole, centred)  # noqa: E731
        unpack = lambda b, *mean: saved_fp8.widen(b, val.dtype, *mean)  # noqa: E731
    else:
        # plain bf16 has no statistics: no blocks, no size read off the tensor
        pack = lambda t: saved_fp8.narrow(  # noqa: E731
            t, rows_of(t) if centred else None, centred)
        unpack = lambda b, *mean: saved_fp8.widen(  # noqa: E731
            b, val.dtype, *mean, rows=rows_of(b) if mean else None)
    # right after S: Inductor fuses the compression with S's producer and frees S at its
    # last forward read, not at the end of the forward
    parts = emit(fw.graph, lambda t: pack(t if identity else aten.permute.default(t, order)),
                 (s,), s.next, "is_forward", s, fake)
    with bw.graph.inserting_before(ph):
        bparts = [bw.graph.placeholder(p.name) for p in parts]
    for p, b in zip(parts, bparts):
        b.meta["val"] = p.meta["val"]

    def restore(*packed):
        t = unpack(*packed)
        return t if identity else aten.permute.default(t, back)

    def restore_before(node: Node) -> Node:
        return emit(bw.graph, restore, tuple(bparts), node, "is_backward", ph, fake)
    # right before its first reader: the backward is compiled without Inductor's peak-memory
    # reorder (``entry.SAVED_BACKWARD_PATCHES``), so it runs in this order, and a restoration
    # at the backward's start would hold every layer's restored tensor from the start
    ph.replace_all_uses_with(restore_before(first_use))
    bw.graph.erase_node(ph)
    return list(parts), restore_before


def _rebuilt(fw: GraphModule, plan: List, symbols: frozenset) -> Dict[Node, tuple]:
    """Which of the tensors to compress the backward rebuilds instead, from the restoration
    of another (``recompute.kept_chain``): kept tensor -> (source, chain). Walked in forward
    order, so a source is decided before what is made from it; a tensor rebuilt is no
    source, and one made from it walks on to that tensor's own source. Only centred ones: a
    tensor a backward op compares (ReLU's mask) keeps the forward's values, not a function
    of a round trip."""
    position = {n: i for i, n in enumerate(fw.graph.nodes)}
    sources = {s for s, *_ in plan}
    rebuilt = {}
    for s, _, fmt, *_ in sorted(plan, key=lambda p: position[p[0]]):
        found = (kept_chain(s, sources - {s}, position, symbols) if fmt.endswith("centred")
                 else None)
        if found is not None:
            rebuilt[s] = found
            sources.discard(s)
    return rebuilt


def _saved_descs(out: Node, num_fwd_outputs: int, outs: List, new_saved: List):
    """The forward output node's ``meta["desc"]`` for the new saved list: each saved value
    keeps its descriptor's kind, renumbered (Inductor reads them: ``lowering.
    _has_saved_lowp_output_use``); the compressed parts are plain saved-for-backward. A
    list that did not match the outputs before is dropped rather than left misaligned."""
    descs = out.meta.get("desc")
    if descs is None:
        return
    if len(descs) != len(outs):
        out.meta.pop("desc")
        return
    was = {}
    for v, d in zip(outs[num_fwd_outputs:], descs[num_fwd_outputs:]):
        if isinstance(v, Node):
            was.setdefault(v, d)
    try:
        from torch._functorch._aot_autograd.descriptors import SavedForBackwardsAOTOutput
    except ImportError:                                         # pragma: no cover
        out.meta.pop("desc", None)
        return
    new = list(descs[:num_fwd_outputs])
    for i, v in enumerate(new_saved):
        old = was.get(v)
        new.append(type(old)(i) if old is not None and hasattr(old, "idx")
                   else SavedForBackwardsAOTOutput(i))
    out.meta["desc"] = new


def bf16_whole_rows(s: Node, val: torch.Tensor) -> bool:
    """Whether kept tensor ``s`` narrowed to bf16 is centred in whole rows (one mean a row of
    its memory): rows of at most ``saved_fp8.ROW_BLOCK`` (one block), or rows a norm reduces
    in the forward (``norm_reads_rows``: the mean joins the norm's reduction). Otherwise in
    the blocks of ``saved_fp8.block_of``."""
    order = memory_order(val)
    width = int(val.shape[order[-1]])
    return saved_fp8.block_of(width) == width or (order == list(range(len(order)))
                                                   and norm_reads_rows(s))


def _centred_in_blocks(s: Node, val: torch.Tensor, asked: str) -> Optional[str]:
    """Why ``saved_activations="auto"`` keeps fp32 tensor ``s`` as it is rather than narrow it
    to bf16 centred in blocks, or None where it would centre whole rows
    (``bf16_whole_rows``): a whole row's mean joins a reduction the forward runs anyway, a
    block mean of a wider row is a second reduction of another shape in its producer's
    kernel. Measured: ViT-H/14's first 8 blocks (LayerNorm's output 1280 wide, blocks of
    640) ran 0.960x Inductor with no linear rewritten and it narrowed, 0.995x with it kept
    and 0.999x with nothing narrowed (16 rounds); ViT-H bs64 under the default 0.989x ->
    1.045x (docs/BENCHMARKS.md, fifty-eighth and fifty-ninth stops). The explicit
    ``"bf16"`` and ``"fp8"`` keep such tensors narrowed: the user asked for the memory."""
    if bf16_whole_rows(s, val):
        return None
    width = int(val.shape[memory_order(val)[-1]])
    return (f"float32 kept as it is (saved_activations={asked}): centring its {width}-wide "
            f"rows as bf16 takes blocks of {saved_fp8.block_of(width)}, a reduction of their "
            f"own")


def computes_in_half(fw: GraphModule) -> bool:
    """Whether the forward computes anything in bf16 or fp16 (autocast, a half-precision
    model): where ``saved_activations="auto"`` keeps fp32 tensors as bf16. An fp32 graph's
    user has asked for fp32 throughout, so there it keeps them exact."""
    return any(isinstance(v := n.meta.get("val"), torch.Tensor) and v.dtype in _HALF
               for n in fw.graph.nodes if n.op == "call_function")


def _format(dtype: torch.dtype, mode: str) -> Optional[str]:
    """How ``saved_activations=mode`` keeps a tensor of ``dtype``: "bf16", "fp8" or None
    (as it is)."""
    if dtype == torch.float32 and mode in ("bf16", "fp8"):
        return "bf16"
    if mode in ("fp8", "fp8_all") and dtype in _DTYPES:
        return "fp8"
    return None


def compress_saved(fw: GraphModule, bw: GraphModule, num_fwd_outputs: int,
                   params: Set[str], mode: str = "fp8") -> SavedSummary:
    """Rewrite ``fw`` / ``bw`` (the partitioner's pair) in place; see the module docstring.
    ``params``: names of ``fw``'s placeholders that hold parameters; ``mode``:
    ``HOTConfig.saved_activations``."""
    summary = SavedSummary()
    reasons: collections.Counter = collections.Counter()
    asked, auto = mode, mode == "auto"
    if auto:
        mode = "bf16" if computes_in_half(fw) else "exact"
        asked = f"auto: {'a bf16 / fp16' if mode == 'bf16' else 'an fp32'} graph"
    out = next(iter(fw.graph.find_nodes(op="output")))
    outs = list(out.args[0])
    user_outs = {o for o in outs[:num_fwd_outputs] if isinstance(o, Node)}
    saved = outs[num_fwd_outputs:]
    bw_inputs = {n.name: n for n in bw.graph.find_nodes(op="placeholder")}
    live = _from_activations(fw, params)
    no_device = device_reason(fw)
    first_bw = next(n for n in bw.graph.nodes if n.op != "placeholder")
    position = {n: i for i, n in enumerate(bw.graph.nodes)}
    fake = fake_mode_of(fw.graph)
    # what takes each saved value's place, in the order of the backward's inputs
    slots: Dict[int, List] = {i: [s] for i, s in enumerate(saved)}
    plan = []                                   # (forward node, backward input, format, row)
    for i, s in enumerate(saved):
        val = s.meta.get("val") if isinstance(s, Node) else None
        if not isinstance(val, torch.Tensor):
            continue
        size = _nbytes(val)
        summary.bytes_before += size
        ph = bw_inputs.get(s.name)
        fmt = _format(val.dtype, mode)
        layout = _reject_layout(val)
        why = ((no_device if fmt == "fp8" else None) or _reject_saved(s, user_outs, live)
               or (f"{str(val.dtype).replace('torch.', '')} kept as it is "
                   f"(saved_activations={asked})" if fmt is None else None)
               or ("not found among the backward's inputs" if ph is None else reject_reader(ph))
               # bf16 too: a row statistic ((rows, 1): LayerNorm's mean, rstd) narrowed saves
               # 2 bytes a row and puts |mean| / 512 into x - mean
               or layout)
        if why is None and not reaches(ph, comparison_step):
            fmt += ", centred"
            if auto and fmt.startswith("bf16"):
                why = _centred_in_blocks(s, val, asked)
        summary.tensors.append([s.name, str(val.dtype).replace("torch.", ""),
                                [_hint(d) for d in val.shape], why or fmt])
        if why:
            reasons[why] += 1
            summary.kept += 1
            summary.bytes_after += size
            continue
        plan.append((s, ph, fmt, summary.tensors[-1], i))
    # the sizes the backward receives (a dynamic batch's SymInts), for a rebuilt tensor's views
    symbols = {s: bw_inputs[s.name] for s in saved if isinstance(s, Node) and s.name in bw_inputs
               and not isinstance(s.meta.get("val"), torch.Tensor)}
    rebuilt = _rebuilt(fw, plan, frozenset(symbols))
    restorers = {}
    for s, ph, fmt, row, i in plan:
        if s in rebuilt:
            slots[i] = []
            continue
        first_use = min(ph.users, key=position.__getitem__, default=first_bw)
        slots[i], restorers[s] = _compress_one(fw, bw, s, ph, first_use, fake, fmt)
        summary.compressed += 1
        summary.formats[fmt.split(",")[0]] = summary.formats.get(fmt.split(",")[0], 0) + 1
        summary.bytes_after += sum(_nbytes(p.meta["val"]) for p in slots[i])
    for s, ph, fmt, row, _ in plan:
        if s not in rebuilt:
            continue
        source, chain = rebuilt[s]
        first_use = min(ph.users, key=position.__getitem__, default=first_bw)
        t = replay(bw.graph, chain, {**symbols, source: restorers[source](first_use)},
                   first_use, ph, fake)
        ph.replace_all_uses_with(t)
        bw.graph.erase_node(ph)
        row[3] = f"rebuilt from {source.name}"
        summary.compressed += 1
        summary.formats["rebuilt"] = summary.formats.get("rebuilt", 0) + 1
    new_saved = [v for i in range(len(saved)) for v in slots[i]]
    if summary.compressed:
        _saved_descs(out, num_fwd_outputs, outs, new_saved)
        kept = type(out.args[0])(list(outs[:num_fwd_outputs]) + new_saved)
        out.args = (kept,) + tuple(out.args[1:])
        fw.graph.lint()
        bw.graph.lint()
        fw.recompile()
        bw.recompile()
    summary.reasons = dict(reasons.most_common())
    return summary
