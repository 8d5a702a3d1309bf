"""Activation buffer compression: make the forward save HLA-projected int8 x, not x.

Why it is a separate pass: where the compression runs decides what the partitioner
saves. If every backward consumer of a linear's input X is a g_W GEMM this pass rewrites,
the compression goes into the *forward* (right before the first forward GEMM reading X)
and its outputs are marked MUST_SAVE: once the g_W GEMMs are replaced and the graph is
cleaned, nothing in backward needs X and min-cut saves the 16/rank x smaller int8 buffer
instead. If X is needed in backward anyway (another op's gradient uses it), compressing
in the forward would only add memory, so the compression moves into the backward.
Several linears reading the same X (q/k/v projections) share one buffer.
"""
from __future__ import annotations

from typing import Dict, List, Tuple

import operator

import torch
from torch.fx import Graph, Node

from .find import LinearSite, is_backward
from .graph_utils import add_node

ABC_OP = torch.ops.hot.abc_compress.default
aten = torch.ops.aten
# ops through which X is "the same data": if any of these ancestors is needed in backward,
# the partitioner can rebuild X from it, so X costs nothing extra to keep
_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default,
          aten.permute.default, aten.transpose.int, aten.t.default, aten.clone.default,
          aten.alias.default, aten.expand.default, aten.squeeze.dim, aten.unsqueeze.default,
          torch.ops.prims.convert_element_type.default, aten._to_copy.default}


def needed_in_backward(x: Node, exclude: set) -> bool:
    """Whether X's data is consumed by backward anyway (through X, or any view/cast/alias
    connected to it, up or down): then the partitioner keeps it and compressing in the
    forward would only add a buffer."""
    def is_view(n):
        return n.op == "call_function" and n.target in _VIEWS

    seen, todo = set(), [x]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        for u in n.users:
            if is_backward(u):
                if u not in exclude and not is_view(u):
                    return True
                if is_view(u):
                    todo.append(u)
            elif is_view(u):
                todo.append(u)
        if is_view(n) and isinstance(n.args[0], Node):
            todo.append(n.args[0])
    return False


def _checkpoint_policy():
    from torch.utils.checkpoint import CheckpointPolicy
    return CheckpointPolicy.MUST_SAVE


def compress_inputs(graph: Graph, sites: List[LinearSite], config, fake_mode
                    ) -> Dict[Node, Tuple[Node, Node]]:
    """Insert one abc_compress per distinct X of the eligible sites; X -> (levels, scale)."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    groups: Dict[Node, List[LinearSite]] = {}
    for s in sites:
        groups.setdefault(s.x, []).append(s)
    buffers: Dict[Node, Tuple[Node, Node]] = {}
    for x, group in groups.items():
        gws = {s.gw for s in group}
        in_forward = config.abc and not needed_in_backward(x, gws)
        if in_forward:
            anchor = min((s.fwd for s in group), key=order.__getitem__)
            tag = "is_forward"
        else:
            anchor = min((s.gw for s in group), key=order.__getitem__)
            tag = "is_backward"
        args = (x, config.rank, config.hla_select, config.gw_bits, config.block, config.kernels)
        comp = add_node(graph, ABC_OP, args, before=anchor, tag=tag, like=group[0].fwd,
                        fake_mode=fake_mode)
        outs = []
        for i in range(2):
            item = add_node(graph, operator.getitem, (comp, i), before=anchor, tag=tag,
                            like=group[0].fwd, val=comp.meta["val"][i])
            outs.append(item)
        if in_forward:
            # MUST_SAVE, or inside a checkpointed region the region's policy (recompute in bwd)
            policy = x.meta.get("recompute") or _checkpoint_policy()
            for n in (comp, *outs):
                n.meta["recompute"] = policy
                if "ac_graph_id" in x.meta:
                    n.meta["ac_graph_id"] = x.meta["ac_graph_id"]
            first = "forward"
        else:
            first = "backward (x is needed in backward anyway)" if config.abc else \
                "backward (abc=False)"
        for s in group:
            s.abc = first if s is group[0] else \
                f"{first.split(' ')[0]} (shares {group[0].key}'s buffer)"
        buffers[x] = (outs[0], outs[1])
    return buffers
