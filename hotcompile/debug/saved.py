"""What the forward keeps for backward, named by what produced it and what backward uses it for.

Why: a training step's peak memory is mostly the tensors alive between forward and backward.
HOT changes some of them (a linear's input becomes the compressed ABC buffer), but which
tensors are kept at all is decided after HOT's pass, by Inductor's min-cut partitioner: it
may keep a LayerNorm input, a GELU input, attention's output and log-sum-exp, or a bf16 copy
of a weight, and recompute others. The compiled graphs say exactly what was kept: the
forward returns each kept tensor and the backward takes it as a placeholder of the same
name. So, on the post-grad graphs:

* ``forward_producers``: each forward output, walked back through views and dtype casts
  to the op that made it, labelled by the user-level function Dynamo recorded
  (``source_fn_stack``: ``Linear``, ``LayerNorm``, ``gelu``, ``scaled_dot_product_attention``)
  and its module; HOT's own ops by name; a graph input (parameter or user input) as
  ``graph input``, and a view or cast of one (autocast's bf16 weight copy) as
  ``copy of a graph input``;
* ``saved_uses``: each backward placeholder but the tangents, walked forward through views
  to the ops that read it, labelled ``<function> backward`` (``fwd_source_fn_stack``), or
  ``<function> (recomputed)`` where the partitioner recomputes a forward op from it.

The dump writes both per graph (``dump.py``) and the summary groups bytes by producer and use
(``summary.saved_rows``). Module paths are relative to the frame Dynamo compiled (after a
graph break inside a block, the block), as in Dynamo's own names.
"""
from __future__ import annotations

import operator
from typing import Dict, List, Optional

import torch

from .sources import split_source

# ops that only re-view or re-type a tensor: the kept tensor is its source's data
_PASS_THROUGH = {"view", "_unsafe_view", "reshape", "permute", "transpose", "t", "expand",
                 "squeeze", "unsqueeze", "select", "slice", "alias", "clone", "_to_copy",
                 "convert_element_type", "as_strided", "contiguous", "unfold"}

GRAPH_INPUT = "graph input"
INPUT_COPY = "copy of a graph input"


def _op_name(target) -> str:
    packet = getattr(target, "overloadpacket", None)
    if packet is not None:
        return getattr(packet, "__name__", str(packet)).split(".")[-1]
    return getattr(target, "__name__", str(target))


def _aten_name(n: torch.fx.Node) -> str:
    """The aten op a node came from (``native_layer_norm`` for its decomposed pieces)."""
    orig = n.meta.get("original_aten")
    return _op_name(orig) if orig is not None else _op_name(n.target)


def _is_hot(target) -> bool:
    return str(target).startswith("hot.")


def _passes_through(n: torch.fx.Node) -> bool:
    return n.op == "call_function" and not _is_hot(n.target) and \
        _op_name(n.target) in _PASS_THROUGH and bool(n.args) and \
        isinstance(n.args[0], torch.fx.Node)


def _fn_label(stack) -> Optional[str]:
    """The user-level function of a ``source_fn_stack`` entry: a module class's name, a
    function's ``__name__``, or the recorded string."""
    if not stack:
        return None
    name, fn = stack[-1]
    if isinstance(fn, str):
        return fn
    return getattr(fn, "__name__", None) or str(name)


def _module(meta: dict, key: str) -> Optional[str]:
    stack = meta.get(key)
    if not isinstance(stack, dict) or not stack:
        return None
    path = list(stack.values())[-1]
    path = path[0] if isinstance(path, tuple) else path
    return split_source(str(path))[1] or None


def _origin(n: torch.fx.Node) -> torch.fx.Node:
    while _passes_through(n):
        n = n.args[0]
    return n


def producer_of(n: torch.fx.Node) -> dict:
    """{"producer": label, "module": path or None} of one forward value."""
    o = _origin(n)
    if o.op == "placeholder":
        return {"producer": GRAPH_INPUT if o is n else INPUT_COPY, "module": None,
                "input": o.name}
    op = o.args[0] if o.target is operator.getitem and isinstance(o.args[0], torch.fx.Node) else o
    if _is_hot(op.target):
        return {"producer": f"HOT {_op_name(op.target)}", "module": _module(op.meta,
                                                                            "nn_module_stack")}
    label = _fn_label(op.meta.get("source_fn_stack")) or _aten_name(op)
    return {"producer": label, "module": _module(op.meta, "nn_module_stack")}


def forward_producers(graph: torch.fx.Graph) -> Dict[str, dict]:
    """Every value the forward graph returns (the user's outputs and the kept tensors), by
    name: what produced it."""
    out = next(n for n in graph.nodes if n.op == "output")
    found: List[torch.fx.Node] = []
    torch.fx.node.map_arg(out.args[0], found.append)
    return {a.name: producer_of(a) for a in found}


def _use_label(u: torch.fx.Node) -> str:
    if u.op == "output":
        return "returned as a gradient"
    if _is_hot(u.target):
        return f"HOT {_op_name(u.target)}"
    fwd = _fn_label(u.meta.get("fwd_source_fn_stack"))
    if fwd:
        return f"{fwd} backward"
    rec = _fn_label(u.meta.get("source_fn_stack"))
    if rec:
        return f"{rec} (recomputed)"
    return _aten_name(u)


def _uses(p: torch.fx.Node) -> List[torch.fx.Node]:
    out, todo, seen = [], list(p.users), set()
    while todo:
        u = todo.pop()
        if u in seen:
            continue
        seen.add(u)
        if _passes_through(u) and u.args[0] in seen | {p}:
            todo.extend(u.users)
        else:
            out.append(u)
    return out


def saved_uses(graph: torch.fx.Graph) -> Dict[str, dict]:
    """Every backward placeholder but the tangents, by name: the sorted labels of the ops
    that read it and the modules they belong to."""
    found = {}
    for p in graph.nodes:
        if p.op != "placeholder" or "tangents" in p.name:
            continue
        users = _uses(p)
        mods = {_module(u.meta, "fwd_nn_module_stack") or _module(u.meta, "nn_module_stack")
                for u in users}
        found[p.name] = {"use": sorted({_use_label(u) for u in users}) or ["unused"],
                         "use_module": sorted(m for m in mods if m)}
    return found
