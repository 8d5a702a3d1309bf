"""Small helpers every pass needs: the graph's fake mode, and inserting a node with metadata.

Why: a node inserted into the joint graph must look like one AOTAutograd made — a
``meta["val"]`` fake tensor (shape inference downstream, the partitioner's byte counts) and
a ``partitioner_tag`` (which side of the forward/backward split it belongs to).
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch.fx import Graph, Node

_COPIED_META = ("seq_nr", "stack_trace", "nn_module_stack", "fwd_nn_module_stack",
                "fwd_source_fn_stack", "source_fn_stack")


def fake_mode_of(graph: Graph):
    from torch._guards import detect_fake_mode
    vals = [n.meta.get("val") for n in graph.nodes if n.op == "placeholder"]
    return detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])


def _fake_args(args):
    return tuple(a.meta["val"] if isinstance(a, Node) else a for a in args)


def fake_run(op, args, fake_mode):
    """Run ``op``'s fake implementation on the args' metadata."""
    with fake_mode:
        return op(*_fake_args(args))


def add_node(graph: Graph, op, args: tuple, before: Node, tag: str, like: Optional[Node] = None,
             fake_mode=None, val: Any = None) -> Node:
    with graph.inserting_before(before):
        node = graph.call_function(op, args)
    if like is not None:
        for k in _COPIED_META:
            if k in like.meta:
                node.meta[k] = like.meta[k]
    node.meta["partitioner_tag"] = tag
    node.meta["val"] = val if val is not None else fake_run(op, args, fake_mode)
    return node
