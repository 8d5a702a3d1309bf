"""Small helpers every pass needs: the graph's fake mode, inserting a node with metadata,
comparing sizes that may be symbolic.

Why: a node inserted into the joint graph must look like one AOTAutograd made — a
``meta["val"]`` fake tensor (shape inference downstream, the partitioner's byte counts) and
a ``partitioner_tag`` (which side of the forward/backward split it belongs to).
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch.fx import Graph, Node


def same_size(a, b) -> bool:
    """Two sizes that are the same int or the same symbolic expression. Compared by their
    expressions: ``==`` on a SymInt evaluates it, which after tracing would add a guard."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return not isinstance(a, int) and not isinstance(b, int) and str(a) == str(b)


def same_shape(a, b) -> bool:
    """Two shapes of the same rank whose sizes are each ``same_size``."""
    return len(a) == len(b) and all(map(same_size, a, b))


_COPIED_META = ("seq_nr", "stack_trace", "nn_module_stack", "fwd_nn_module_stack",
                "fwd_source_fn_stack", "source_fn_stack")


def fake_mode_of(graph: Graph):
    from torch._guards import detect_fake_mode
    vals = [n.meta.get("val") for n in graph.nodes if n.op == "placeholder"]
    return detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])


def _fake_args(args):
    """The args' fake values, nested lists included (a view's SymInt sizes)."""
    return tuple(torch.fx.node.map_arg(tuple(args), lambda a: a.meta["val"]))


def fake_run(op, args, fake_mode):
    """Run ``op``'s fake implementation on the args' metadata."""
    with fake_mode:
        return op(*_fake_args(args))


def stamp(node: Node, tag: str, like: Optional[Node], meta: Optional[dict] = None) -> None:
    """What every inserted node carries: ``like``'s provenance, the partitioner tag, extras."""
    if like is not None:
        for k in _COPIED_META:
            if k in like.meta:
                node.meta[k] = like.meta[k]
    node.meta["partitioner_tag"] = tag
    node.meta.update(meta or {})


def add_node(graph: Graph, op, args: tuple, before: Node, tag: str, like: Optional[Node] = None,
             fake_mode=None, val: Any = None) -> Node:
    with graph.inserting_before(before):
        node = graph.call_function(op, args)
    stamp(node, tag, like)
    node.meta["val"] = val if val is not None else fake_run(op, args, fake_mode)
    return node


def emit(graph: Graph, fn, args: tuple, before: Node, tag: str, like: Optional[Node],
         fake_mode, meta: Optional[dict] = None):
    """Record ``fn(*args)`` into ``graph`` before ``before`` and return its outputs as nodes.

    ``fn`` is written in aten ops (a reference twin, e.g. ``kernels.fp8_forward``); node
    arguments are passed to it as ``torch.fx.Proxy`` objects, so every op it calls becomes
    a node, in order. Each new node gets a fake value (run on its inputs' fake values,
    nested lists included: sizes of SymInt nodes), the partitioner tag, ``like``'s
    provenance metadata and the extra ``meta`` entries (e.g. an activation-checkpointing
    policy). Why: the graph then computes the reference by construction, not a
    hand-copied pattern of it."""
    tracer = torch.fx.proxy.GraphAppendingTracer(graph)
    wrap = lambda a: torch.fx.Proxy(a, tracer) if isinstance(a, Node) else a  # noqa: E731
    first = before.prev                   # the new nodes land between it and ``before``
    with graph.inserting_before(before):
        out = fn(*(wrap(a) for a in args))
    val = lambda n: n.meta["val"]  # noqa: E731
    node = first.next
    while node is not before:
        stamp(node, tag, like, meta)
        with fake_mode:
            node.meta["val"] = node.target(*torch.fx.node.map_arg(node.args, val),
                                           **torch.fx.node.map_arg(node.kwargs, val))
        node = node.next
    unwrap = lambda o: o.node if isinstance(o, torch.fx.Proxy) else o  # noqa: E731
    return tuple(unwrap(o) for o in out) if isinstance(out, tuple) else unwrap(out)
