"""What backward keeps anyway, and what it can rebuild from that instead of keeping more.

Why: the min-cut partitioner runs after HOT's pass and keeps, for backward, every forward
value an opaque op there reads (it will not recompute a value that backward would have to
materialize anyway). HOT's ops read two operands that are often cheap to rebuild from
tensors kept regardless: a linear's input X (a LayerNorm, GELU or SwiGLU output: the norm's
input and statistics, GELU's input, SwiGLU's gate and up are kept for their own backward)
and, under autocast, the low-precision copy of W (a cast of the fp32 parameter, which is
held anyway). Keeping such an operand costs its bytes; marking the ops between it and the
kept tensors MUST_RECOMPUTE makes the partitioner rebuild it in backward instead (the same
ops on the same values: bit-identical), at the price of one pointwise pass there.

``bench/saved_tensors.py`` shows what it is worth: on Llama d4096 the bf16 weight copies are
most of what the step keeps at 2048 tokens; on ViT-B the compressed input buffers are ~15%.
``HOTConfig.recompute_operands`` turns it on; ``passes/abc.py`` then compresses a rebuilt X
in backward, and ``recompute_weights`` here lets the g_x op's W be rebuilt.
"""
from __future__ import annotations

from typing import List, Optional

import torch
from torch.fx import Node

from .find import LinearSite, is_backward

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


# of those, the ops that write new memory (a view of the parameter costs nothing to keep)
_COPIES = {torch.ops.prims.convert_element_type.default, aten._to_copy.default,
           aten.clone.default}


def _checkpoint_policy(name: str):
    from torch.utils.checkpoint import CheckpointPolicy
    return getattr(CheckpointPolicy, name)


MAX_RECOMPUTE = 24      # nodes: a norm's affine tail, GELU's or SwiGLU's few pointwise ops


def _cheap(n: Node) -> bool:
    """A forward op the backward may run again at no memory cost: a view, or a pointwise
    op that draws no random numbers."""
    if n.op != "call_function":
        return False
    if n.target in _VIEWS:
        return True
    tags = getattr(n.target, "tags", ())
    return torch.Tag.pointwise in tags and torch.Tag.nondeterministic_seeded not in tags


def recompute_chain(x: Node, exclude: set) -> Optional[List[Node]]:
    """The forward nodes X is computed from out of tensors backward keeps anyway, or None.

    Walking up from X through views and pointwise ops, every branch must end at a graph
    input (held anyway) or at a node backward consumes anyway (``needed_in_backward``: a
    LayerNorm's input and statistics, GELU's input, SwiGLU's gate and up). Then the
    partitioner can rebuild X in backward from what it saves regardless, and a compressed
    copy of X saved from the forward would only add memory. None when a branch meets
    anything else (a GEMM, a reduction, a random op, a checkpointed region's policy) or
    the chain is longer than ``MAX_RECOMPUTE``."""
    chain, todo, seen = [], [x], set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op in ("placeholder", "get_attr"):
            continue
        if n is not x and needed_in_backward(n, exclude):
            continue
        if not _cheap(n) or is_backward(n) or n.meta.get("recompute") is not None:
            return None
        chain.append(n)
        if len(chain) > MAX_RECOMPUTE:
            return None
        todo.extend(n.all_input_nodes)
    return chain


def mark_recompute(chain: List[Node]) -> None:
    for n in chain:
        n.meta["recompute"] = _checkpoint_policy("MUST_RECOMPUTE")


def recompute_weights(sites: List[LinearSite]) -> None:
    """Let backward rebuild the W operand of each site whose g_x HOT rewrites, when W is a
    view or cast of a graph input (autocast's bf16 copy of the fp32 parameter) that no
    other backward op reads: the forward then keeps nothing for it. ``exclude``: the
    site's own g_x mm, which the rewrite replaces by HOT's op reading the same W."""
    for s in sites:
        if s.gx is None:
            continue
        chain = recompute_chain(s.wt, {s.gx})
        if chain and any(n.target not in _VIEWS or n.target in _COPIES for n in chain):
            mark_recompute(chain)
            s.w_recompute = len(chain)
