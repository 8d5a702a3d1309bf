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
"""
from __future__ import annotations

import operator
from typing import Callable, Dict, Optional

import torch
from torch._inductor import inductor_prims  # noqa: F401  registers force_stride_order
from torch.fx import Graph, Node

from ..kernels import ops
from ..kernels.launch import recording
from .graph_utils import stamp
from .kernel_access import memoized_kernel_access

aten = torch.ops.aten
WRAPPER = torch.ops.higher_order.triton_kernel_wrapper_functional
BODIES: Dict[object, Callable] = {
    torch.ops.hot.linear_backward.default: ops.linear_backward_body,
    torch.ops.hot.hq_grad_input.default: ops.hq_grad_input_body,
    torch.ops.hot.hla_grad_weight.default: ops.hla_grad_weight_body,
    torch.ops.hot.e4m3_gx_backward.default: ops.e4m3_gx_backward_body,
    torch.ops.hot.abc_compress.default: ops.abc_compress_body,
    torch.ops.hot.weight_cast.default: ops.weight_cast_body,
    torch.ops.hot.weight_operands.default: ops.weight_operands_body,
}


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


def trace_body(node: Node, fake_mode) -> torch.fx.GraphModule:
    """The op's fused body traced on its arguments' fake values: aten ops and one
    ``triton_kernel_wrapper_functional`` per kernel launch."""
    slots = [i for i, a in enumerate(node.args) if isinstance(a, Node)]
    kslots = [k for k, v in node.kwargs.items() if isinstance(v, Node)]
    consts = list(node.args)
    body = BODIES[node.target]

    def run(*tensors):
        args, kwargs = list(consts), dict(node.kwargs)
        for i, t in zip(slots, tensors):
            args[i] = t
        for k, t in zip(kslots, tensors[len(slots):]):
            kwargs[k] = t
        return body(*args, **kwargs)

    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx
    fakes = [n.meta["val"] for n in _inputs(node)]
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


def _realized(graph: Graph, arg: Node, node: Node, fake_mode) -> Node:
    """``arg`` as one buffer with its traced strides, for all the kernels that read it.

    Why: Inductor gives a user kernel an input with exactly the strides it was traced with.
    An input not yet in memory (a fused pointwise result such as GELU's backward) is then
    computed into a fresh copy for *each* kernel reading it: three writes of g_y for the
    HQ and the two HLA launches (H100 output code, 2026-11-24). ``force_stride_order``
    makes Inductor realize it once, in that layout (a no-op for a tensor already there)."""
    val = arg.meta.get("val")
    if arg.op == "placeholder" or not isinstance(val, torch.Tensor) or val.dim() == 0:
        return arg
    with graph.inserting_before(node):
        fixed = graph.call_function(torch.ops.prims.inductor_force_stride_order.default,
                                    (arg, list(val.stride())))
    with fake_mode:
        fixed.meta["val"] = torch.empty_strided(val.shape, val.stride(), dtype=val.dtype,
                                                device=val.device)
    return fixed


def splice(graph: Graph, node: Node, fake_mode) -> None:
    """Replace ``node`` by its traced body: the new nodes carry its partitioner tag,
    provenance and (forward ABC) its save policy; its users read the body's outputs."""
    tuple_out = isinstance(node.meta["val"], (tuple, list))
    if tuple_out and any(u.target is not operator.getitem for u in node.users):
        raise RuntimeError("a user other than getitem reads the op's outputs")
    gm = trace_body(node, fake_mode)
    before = node.prev
    slots = [_realized(graph, a, node, fake_mode) for a in _inputs(node)]
    places = [n for n in gm.graph.nodes if n.op == "placeholder"]
    val_map = dict(zip(places, slots))
    with graph.inserting_before(node):
        out = graph.graph_copy(gm.graph, val_map)
    extra = {k: node.meta[k] for k in ("recompute", "ac_graph_id") if k in node.meta}
    n = before.next
    while n is not node:
        stamp(n, node.meta.get("partitioner_tag", "is_backward"), node, extra)
        n = n.next
    outs = out if isinstance(out, (tuple, list)) else (out,)
    if tuple_out:
        for user in list(node.users):
            user.replace_all_uses_with(outs[user.args[1]])
            graph.erase_node(user)
    else:
        node.replace_all_uses_with(outs[0])
    graph.erase_node(node)


def splice_ops(graph: Graph, nodes, fake_mode) -> Dict[Node, str]:
    """Splice every node of ``nodes`` that ``refusal`` allows; node -> how it launches
    ("Inductor", or "hot:: op (<reason>)"). A failed trace leaves the op, with the error."""
    how: Dict[Node, str] = {}
    with memoized_kernel_access():      # the sites repeat a few launches: analyse each once
        for node in nodes:
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
