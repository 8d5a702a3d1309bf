"""Splice each ``hot::`` op's fused body into the joint graph, so Inductor launches its kernels.

Why: a ``hot::`` custom op inserted after AOT tracing is an opaque extern call. At run time
each one pays Python dispatch, the op's own Python (format and tile choices) and Triton's
Python launcher for every kernel inside: ~0.3 ms of host time per site in default compile
mode, more than the GPU work of a ViT-B layer. Traced instead with ``wrap_triton``
(``kernels/launch.py``) and copied into the graph, the same body becomes
``triton_kernel_wrapper_functional`` nodes that Inductor compiles into direct launches from
its generated wrapper (TORCH_NOTES.md), with its own buffer planning around them.

Same kernels, same arguments, same order: a spliced site computes bit for bit what its
``hot::`` op computes (``tests/test_gpu_compiled.py`` checks it on the GPU).

Choices the op makes in Python at run time are frozen by the trace, so a node is spliced
only where none remain (``refusal`` says why not, and the report shows it):
LQS picking a site's scaling (``gx_scale="lqs"``), a rank calibration measuring g_W
(``rank="auto"`` while it calibrates), and shapes that vary (dynamic shapes: tiles and grids
come from sizes). A trace that would mutate one of the op's inputs (Triton's mutation
analysis failing on a kernel) is refused too: functionalisation would copy the input back.
The op stays the fallback: the graph is correct either way.

The forward's W ops (``hot::weight_cast``, ``hot::weight_operands``: one of each per weight)
are spliced in groups: consecutive ops of one kind and configuration become one traced
body whose kernels serve up to ``hadamard.WEIGHT_SLOTS`` weights per launch (``GROUPS``,
``weight_groups``), so a layer's seven weights take two launches instead of fourteen.
"""
from __future__ import annotations

import logging
import operator
from typing import Callable, Dict, Optional

import torch
from torch._inductor import inductor_prims  # noqa: F401  registers force_stride_order
from torch.fx import Graph, Node

from ..kernels import ops
from ..kernels.hadamard import WEIGHT_SLOTS
from ..kernels.launch import recording
from .graph_utils import stamp
from .kernel_access import memoized_kernel_access

aten = torch.ops.aten
log = logging.getLogger(__name__)
WRAPPER = torch.ops.higher_order.triton_kernel_wrapper_functional
FORCE_STRIDES = torch.ops.prims.inductor_force_stride_order.default
BODIES: Dict[object, Callable] = {
    torch.ops.hot.linear_backward.default: ops.linear_backward_body,
    torch.ops.hot.hq_grad_input.default: ops.hq_grad_input_body,
    torch.ops.hot.hla_grad_weight.default: ops.hla_grad_weight_body,
    torch.ops.hot.e4m3_gx_backward.default: ops.e4m3_gx_backward_body,
    torch.ops.hot.abc_compress.default: ops.abc_compress_body,
    torch.ops.hot.gelu_e4m3.default: ops.gelu_e4m3_body,
    torch.ops.hot.weight_cast.default: ops.weight_cast_body,
    torch.ops.hot.weight_operands.default: ops.weight_operands_body,
}
# ops spliced in groups: op -> the body taking a list of their argument tuples
GROUPS: Dict[object, Callable] = {
    torch.ops.hot.weight_cast.default: ops.weight_cast_group_body,
    torch.ops.hot.weight_operands.default: ops.weight_operands_group_body,
}
# at most this many weight elements per group: a group's copies and forward operands are
# made before the first of its sites runs (2 + 1 bytes per element under the row-wise FP8
# forward, at most 768 MiB for a group; Inductor keeps the freed copies' buffers for the
# next group). Llama d4096's 14 layer weights (2.0e8 per layer) go as 8 + 6.
GROUP_ELEMENTS = 1 << 28


def _inputs(node: Node) -> list:
    """The op's tensor inputs in trace order: Node arguments, then Node keyword arguments."""
    return [a for a in node.args if isinstance(a, Node)] + \
        [v for v in node.kwargs.values() if isinstance(v, Node)]


def _arg(node: Node, name: str, vals: list):
    """The value of the op's argument ``name`` (by its schema), or None if it has none."""
    names = [a.name for a in node.target._schema.arguments]
    return vals[names.index(name)] if name in names and names.index(name) < len(vals) else None


def _symbolic(v) -> bool:
    if isinstance(v, torch.Tensor):
        return any(isinstance(d, torch.SymInt) for d in (*v.shape, *v.stride()))
    return isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool))


def refusal(node: Node) -> Optional[str]:
    """Why ``node`` (a ``hot::`` op) must stay an op, or None when it can be spliced."""
    op = node.target
    if op not in BODIES:
        return "not a spliceable hot:: op"
    vals = [a.meta.get("val") if isinstance(a, Node) else a for a in node.args]
    first = next((v for v in vals if isinstance(v, torch.Tensor)), None)
    if first is None or first.device.type != "cuda":
        return "not on a CUDA device (the reference kernels run there)"
    if _arg(node, "kernels", vals) == "reference":
        return "kernels='reference'"
    if _arg(node, "scale", vals) == "lqs":
        return "gx_scale='lqs' chooses the scaling at run time"
    if _arg(node, "measure", vals):
        return "rank calibration measures g_W at run time"
    if any(_symbolic(v) for v in vals):
        return "dynamic shapes (tiles and grids are chosen from sizes)"
    if node.meta.get("recompute") not in (None, torch.utils.checkpoint.CheckpointPolicy.MUST_SAVE):
        return "inside an activation-checkpointed region"
    return None


def config_splices(config, recompute=None) -> bool:
    """Whether ``refusal`` will pass a site's ops, told before they exist (the cost gate
    prices the host time of spliced and unspliced sites differently): the config's run-time
    choices and activation checkpointing (``recompute``, the site's forward node's policy).
    Device and sizes are the gate's own conditions (CUDA, static sizes)."""
    return (bool(config.splice) and config.kernels != "reference" and config.gx_scale != "lqs"
            and config.rank != "auto"
            and recompute in (None, torch.utils.checkpoint.CheckpointPolicy.MUST_SAVE))


def _rebuild(node: Node, tensors) -> tuple:
    """The op's (args, kwargs) with its Node inputs (``_inputs`` order) replaced by ``tensors``."""
    args, kwargs, it = list(node.args), dict(node.kwargs), iter(tensors)
    args = [next(it) if isinstance(a, Node) else a for a in args]
    kwargs = {k: next(it) if isinstance(v, Node) else v for k, v in kwargs.items()}
    return args, kwargs


def _trace(run, nodes, fake_mode) -> torch.fx.GraphModule:
    """``run`` traced on the fake values of ``nodes``' inputs: aten ops and one
    ``triton_kernel_wrapper_functional`` per kernel launch."""
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx
    fakes = [n.meta["val"] for node in nodes for n in _inputs(node)]
    with recording(), fake_mode:    # decomposed as AOT decomposes the rest for Inductor
        gm = make_fx(torch.func.functionalize(run), decomposition_table=select_decomp_table(),
                     tracing_mode="fake")(*fakes)
    mutated = [n for n in gm.graph.nodes if n.op == "call_function"
               and n.target is aten.copy_.default and n.args[0].op == "placeholder"]
    if mutated:
        raise RuntimeError(f"the trace writes into its inputs {[n.args[0].name for n in mutated]}")
    if not any(n.target is WRAPPER for n in gm.graph.nodes):
        # the body fell back to the reference twin (a block or bit width without fused
        # kernels): as aten ops Inductor could re-associate its float math
        raise RuntimeError("no fused kernel for this configuration (the op runs the reference)")
    return gm


def trace_body(node: Node, fake_mode) -> torch.fx.GraphModule:
    """The op's fused body traced on its arguments' fake values."""
    body = BODIES[node.target]

    def run(*tensors):
        args, kwargs = _rebuild(node, tensors)
        return body(*args, **kwargs)
    return _trace(run, [node], fake_mode)


def _defaults(node: Node) -> list:
    """The schema's defaults of the positional arguments ``node`` leaves out."""
    return [a.default_value for a in node.target._schema.arguments[len(node.args):]
            if not a.kwarg_only]


def trace_group(nodes: list, fake_mode) -> torch.fx.GraphModule:
    """The group body (``GROUPS``) of ``nodes`` (one op, arguments agreeing but for their
    tensors, no keyword arguments) traced on their inputs: each call is handed over whole,
    defaults filled in, and the body returns every node's outputs in order."""
    body = GROUPS[nodes[0].target]
    counts = [len(_inputs(n)) for n in nodes]

    def run(*tensors):
        calls, at = [], 0
        for n, c in zip(nodes, counts):
            args = _rebuild(n, tensors[at:at + c])[0]
            calls.append(tuple(args) + tuple(_defaults(n)))
            at += c
        return tuple(t for out in body(calls) for t in out)
    return _trace(run, nodes, fake_mode)


def _realized(graph: Graph, arg: Node, node: Node, fake_mode) -> Node:
    """``arg`` as one buffer with its traced strides, for all the kernels that read it.

    Why: Inductor gives a user kernel an input with exactly the strides it was traced with.
    An input not yet in memory (a fused pointwise result such as GELU's backward) is then
    computed into a fresh copy for *each* kernel reading it: three writes of g_y for the
    HQ and the two HLA launches (H100 output code, 2026-11-24). ``force_stride_order``
    makes Inductor realize it once, in that layout (a no-op for a tensor already there).

    In backward, its other readers that Inductor cannot fuse with that copy read the
    buffer too (``_unfusable_readers``)."""
    val = arg.meta.get("val")
    if arg.op == "placeholder" or not isinstance(val, torch.Tensor) or val.dim() == 0:
        return arg
    if arg.target is FORCE_STRIDES:     # an earlier site's realization, shared
        return arg
    readers = []
    if (arg.meta.get("partitioner_tag") == "is_backward"
            and node.meta.get("partitioner_tag") == "is_backward"):
        done = [u for u in arg.users if u.target is FORCE_STRIDES
                and u.args[1] == list(val.stride())]
        if done:                        # the same input twice in one group
            return done[0]
        readers = _unfusable_readers(arg, node)
    with graph.inserting_after(arg) if readers else graph.inserting_before(node):
        fixed = graph.call_function(FORCE_STRIDES, (arg, list(val.stride())))
    with fake_mode:
        fixed.meta["val"] = torch.empty_strided(val.shape, val.stride(), dtype=val.dtype,
                                                device=val.device)
    if readers:
        stamp(fixed, "is_backward", node)
        for user in readers:
            user.replace_input_with(arg, fixed)
    return fixed


def _unfusable_readers(arg: Node, node: Node) -> list:
    """The readers of backward input ``arg`` (other than ``node``) that should read the
    buffer ``_realized`` makes, which then goes right after ``arg``: every reader but a
    pointwise op (which Inductor fuses with the copy, computing ``arg`` once either way)
    and the graph's output (its strides are the traced ones).

    Why: where ``arg`` is a pointwise result not yet in memory (GELU's backward giving g of
    fc1), ``force_stride_order`` lowers to a copy that computes it into a buffer, and
    ``arg`` itself stays unmaterialized: a reduction, an extern GEMM or another site
    lowered from ``arg`` computes it again. By the step profile the bias gradient's sum
    over tokens did so inside its reduction (ViT-L/16 bs128, 24 fc1 sites rewritten: that
    kernel 0.058 -> 0.245 ms a site, 4.3 ms a step, all the FP8 GEMMs' gain); reading the
    buffer, ViT-L's first 4 blocks gained 1.7% over no site rewritten, where the whole
    model had lost 0.3% (fifty-ninth stop). Backward only: no saved tensor changes."""
    return [u for u in arg.users if u is not node and u.op != "output"
            and torch.Tag.pointwise not in getattr(u.target, "tags", ())]


def splice(graph: Graph, node: Node, fake_mode) -> None:
    """Replace ``node`` by its traced body (``splice_group`` of one)."""
    splice_group(graph, [node], fake_mode)


def splice_group(graph: Graph, nodes: list, fake_mode) -> None:
    """Replace ``nodes`` (one node, or a ``weight_groups`` group) by one traced body, put
    where the first of them was: the new nodes carry its partitioner tag, provenance and
    (forward ABC) save policy; each node's users read its outputs from the body."""
    for node in nodes:
        tuple_out = isinstance(node.meta["val"], (tuple, list))
        if tuple_out and any(u.target is not operator.getitem for u in node.users):
            raise RuntimeError("a user other than getitem reads the op's outputs")
        if len(nodes) > 1 and not tuple_out:
            raise RuntimeError("a group of ops with one output each")
    first = nodes[0]
    gm = trace_body(first, fake_mode) if len(nodes) == 1 else trace_group(nodes, fake_mode)
    if len(nodes) > 1:      # checked before the graph changes
        outs = gm.graph.output_node().args[0]
        if len(outs) != sum(len(n.meta["val"]) for n in nodes):
            raise RuntimeError("the group's body returns another number of outputs")
    before = first.prev
    slots = [_realized(graph, a, first, fake_mode) for node in nodes for a in _inputs(node)]
    places = [n for n in gm.graph.nodes if n.op == "placeholder"]
    val_map = dict(zip(places, slots))
    with graph.inserting_before(first):
        out = graph.graph_copy(gm.graph, val_map)
    extra = {k: first.meta[k] for k in ("recompute", "ac_graph_id") if k in first.meta}
    n = before.next
    while n is not first:
        stamp(n, first.meta.get("partitioner_tag", "is_backward"), first, extra)
        n = n.next
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    for node in nodes:
        if isinstance(node.meta["val"], (tuple, list)):
            mine, outs = outs[:len(node.meta["val"])], outs[len(node.meta["val"]):]
            for user in list(node.users):
                user.replace_all_uses_with(mine[user.args[1]])
                graph.erase_node(user)
        else:
            node.replace_all_uses_with(outs.pop(0))
        graph.erase_node(node)


def _elements(node: Node) -> int:
    v = node.args[0].meta.get("val")
    return v.numel() if isinstance(v, torch.Tensor) else GROUP_ELEMENTS


def weight_groups(graph: Graph, nodes: list) -> list:
    """``nodes`` (ops of one ``GROUPS`` kind) cut into groups spliced as one body each:
    consecutive in graph order, the same non-tensor arguments, tensor dtypes and devices (a
    launch's slots share them) and graph metadata (the body takes the first op's tag and
    save policy), at most ``WEIGHT_SLOTS`` ops and ``GROUP_ELEMENTS`` weight elements, and
    every input defined before the group's first op (where its body goes)."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    groups: list = []
    for node in sorted(nodes, key=order.__getitem__):
        key = None if node.kwargs else [    # an op called with keywords goes alone
            (getattr(a.meta.get("val"), "dtype", None), getattr(a.meta.get("val"), "device", None))
            if isinstance(a, Node) else a for a in node.args] + _defaults(node) \
            + [node.meta.get(k) for k in ("partitioner_tag", "recompute", "ac_graph_id")]
        g = groups[-1] if groups else None
        if g is not None and key is not None and g["key"] == key \
                and len(g["nodes"]) < WEIGHT_SLOTS \
                and g["elements"] + _elements(node) <= GROUP_ELEMENTS \
                and all(order[a] < order[g["nodes"][0]] for a in _inputs(node)):
            g["nodes"].append(node)
            g["elements"] += _elements(node)
        else:
            groups.append({"key": key, "nodes": [node], "elements": _elements(node)})
    return [g["nodes"] for g in groups]


def splice_ops(graph: Graph, nodes, fake_mode) -> Dict[Node, str]:
    """Splice every node of ``nodes`` that ``refusal`` allows; node -> how it launches
    ("Inductor", or "hot:: op (<reason>)"). A failed trace leaves the op, with the error.
    The forward's W ops go first, in groups (``weight_groups``; a group whose trace fails is
    spliced op by op): the operands' groups are cut after the casts' bodies are in place,
    where their inputs then are."""
    how: Dict[Node, str] = {}
    todo = list(nodes)
    with memoized_kernel_access():      # the sites repeat a few launches: analyse each once
        for kind in GROUPS:
            mine = [n for n in todo if n.target is kind and refusal(n) is None]
            for group in weight_groups(graph, mine):
                if len(group) > 1:
                    try:
                        splice_group(graph, group, fake_mode)
                        how.update((n, "Inductor") for n in group)
                    except Exception as e:  # noqa: BLE001 - op by op below, each its reason
                        log.warning("hotcompile: %d %s ops spliced one by one, not as one "
                                    "launch: %s: %s", len(group), kind, type(e).__name__, e)
            todo = [n for n in todo if n not in how]
        for node in todo:
            why = refusal(node)
            if why is None:
                try:
                    splice(graph, node, fake_mode)
                    how[node] = "Inductor"
                    continue
                except Exception as e:  # noqa: BLE001 - the op is the correct fallback
                    why = f"trace failed: {type(e).__name__}: {e}"
            how[node] = f"hot:: op ({why})"
    return how
