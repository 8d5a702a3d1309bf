"""Activation buffer compression: make the forward save HLA-projected int8 x, not x.

Why it is a separate pass: where the compression runs decides what the partitioner
saves. If every backward consumer of a linear's input X is a g_W GEMM this pass rewrites,
the compression goes into the *forward* (right before the first forward GEMM reading X)
and its outputs are marked MUST_SAVE: once the g_W GEMMs are replaced and the graph is
cleaned, nothing in backward needs X and min-cut saves the 16/rank x smaller int8 buffer
instead. If X is needed in backward anyway (another op's gradient uses it), compressing
in the forward would only add memory, so the compression moves into the backward.
With ``recompute_operands`` (``passes/recompute.py``), the same holds when X is a pointwise function of tensors backward
keeps anyway (a LayerNorm's output from its input and statistics, GELU's output from its
input, SwiGLU's product from gate and up): X is marked MUST_RECOMPUTE, the partitioner
rebuilds it in backward from what it saves regardless, and the compression runs there.
Several linears reading the same data (q/k/v or gate/up projections) share one buffer,
made in the forward: inputs are grouped by their *base* tensor, found through the views
and casts each projection applies on its own (under autocast each gets its own cast and
view of the same x), not by node identity.
"""
from __future__ import annotations

from typing import Dict, List, Tuple

import operator

import torch
from torch.fx import Graph, Node
from torch.utils.checkpoint import CheckpointPolicy

from ..kernels.formats import gw_format_for
from .find import LinearSite
from .graph_utils import add_node
from .recompute import mark_recompute, needed_in_backward, recompute_chain

ABC_OP = torch.ops.hot.abc_compress.default
aten = torch.ops.aten
# ops that keep x's elements in the same order (a view, a copy, a dtype cast)
_SAME_DATA = {aten.view.default, aten._unsafe_view.default, aten.reshape.default,
              aten.clone.default, aten.alias.default,
              torch.ops.prims.convert_element_type.default, aten._to_copy.default}


def base_of(x: Node) -> Node:
    """The tensor x's elements come from, in the same order, through views and casts."""
    while x.op == "call_function" and x.target in _SAME_DATA and isinstance(x.args[0], Node):
        x = x.args[0]
    return x


def group_by_base(sites: List[LinearSite]) -> Dict[tuple, List[LinearSite]]:
    """Sites with a g_W grouped by the data their x holds (base tensor and 2-D shape)."""
    groups: Dict[tuple, List[LinearSite]] = {}
    for s in sites:
        if s.gw is None:
            continue
        shape = tuple(str(d) for d in s.x.meta["val"].shape)
        groups.setdefault((base_of(s.x), shape), []).append(s)
    for group in groups.values():
        for s in group:
            s.group = group[0].key
    return groups


def rebuild_chain(group: List[LinearSite], x: Node, config):
    """With ``recompute_operands``: the forward ops backward reruns to rebuild ``x`` (the
    input the group's compression reads) from tensors it keeps anyway
    (``recompute.recompute_chain``), or None (off, ``abc=False``, x kept by backward
    anyway, or not rebuildable). Sites reading views of one base only."""
    if not (config.recompute_operands and config.abc):
        return None
    gws = {s.gw for s in group}
    if any(needed_in_backward(s.x, gws) for s in group) or \
            not all(base_of(s.x) is base_of(x) for s in group):
        return None
    return recompute_chain(x, gws)


def saved_format(config, x: Node, sites) -> str:
    """The saved activation's format for input ``x`` read by ``sites`` (``formats.gw_rule``):
    it decides the g_W GEMM's path, so the forward fixes it at compile time from the device
    and the sites' in- and out-features (e4m3 only where cuBLAS's FP8 GEMM takes them all)."""
    val = x.meta.get("val")
    device = val.device if isinstance(val, torch.Tensor) else torch.device("cpu")
    return gw_format_for(config.gw_format, device, tuple(d for s in sites for d in (s.I, s.O)))


def compress_inputs(graph: Graph, groups: Dict[tuple, List[LinearSite]], config, fake_mode,
                    layout_args, gx_on_fp8=lambda s: False) -> Dict[str, Tuple[Node, Node]]:
    """Insert one abc_compress per group (``group_by_base``'s); group name (``site.group``) ->
    (levels, scale).

    ``layout_args(group, anchor, tag)`` gives the op's (rank, seq_len, seq_first) for the group.
    ``gx_on_fp8(site)``: whether an exact_gx site's g_x mm becomes part of its backward op
    (``exact_gx_gemm="e4m3"`` applied: ``rewrite._e4m3_gx_refusal``)."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    buffers: Dict[str, Tuple[Node, Node]] = {}
    for group in groups.values():
        gws = {s.gw for s in group}
        first_fwd = min(group, key=lambda s: order[s.fwd])
        x = first_fwd.x
        in_forward = config.abc and not any(needed_in_backward(s.x, gws) for s in group)
        chain = rebuild_chain(group, x, config) if in_forward else None
        if chain:
            # backward rebuilds X from what it keeps anyway, and compresses it there
            mark_recompute(chain)
            in_forward = False
        if in_forward:
            anchor = first_fwd.fwd
            tag = "is_forward"
        else:
            # before the group's first backward mm (a site's whole backward is one op,
            # placed before the first of its g_x and g_W mms; where exact_gx_gemm="e4m3"
            # puts an exact_gx site's g_x on FP8, that g_x mm too: its op replaces it)
            anchor = min((n for s in group
                          for n in (s.gx, s.gw, s.gx_exact if gx_on_fp8(s) else None)
                          if n is not None),
                         key=order.__getitem__)
            tag = "is_backward"
        rank, seq_len, seq_first = layout_args(group, anchor, tag)
        fmt = saved_format(config, x, group)
        for s in group:
            s.gw_format = fmt
        args = (x, rank, config.gw_bits, config.block, seq_len, seq_first, config.kernels, fmt)
        comp = add_node(graph, ABC_OP, args, before=anchor, tag=tag, like=group[0].fwd,
                        fake_mode=fake_mode)
        outs = []
        for i in range(2):
            item = add_node(graph, operator.getitem, (comp, i), before=anchor, tag=tag,
                            like=group[0].fwd, val=comp.meta["val"][i])
            outs.append(item)
        if in_forward:
            # MUST_SAVE, or inside a checkpointed region the region's policy (recompute in bwd)
            policy = x.meta.get("recompute") or CheckpointPolicy.MUST_SAVE
            for n in (comp, *outs):
                n.meta["recompute"] = policy
                if "ac_graph_id" in x.meta:
                    n.meta["ac_graph_id"] = x.meta["ac_graph_id"]
            first = "forward"
        elif chain:
            first = (f"rebuilt in backward (from tensors kept anyway, {len(chain)} ops; "
                     f"compressed there)")
        else:
            first = "backward (x is needed in backward anyway)" if config.abc else \
                "backward (abc=False)"
        for s in group:
            s.abc = first if s is group[0] else \
                f"{first.split(' ')[0]} (shares {group[0].key}'s buffer)"
        buffers[group[0].group] = (outs[0], outs[1])   # by the group's name (``group_by_base``)
    return buffers
