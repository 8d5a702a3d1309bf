"""What backward keeps anyway, and what it can rebuild from that instead of keeping more.

Why: the min-cut partitioner runs after HOT's pass and keeps, for backward, every forward
value an opaque op there reads (it will not recompute a value that backward would have to
materialize anyway). HOT's ops read two operands that are often cheap to rebuild:

* a linear's input X, when it is a pointwise function of tensors kept regardless (a
  LayerNorm or RMSNorm output: the norm's input and statistics are kept for its own
  backward; GELU's output from its input; SwiGLU's product from gate and up). Marking the
  ops between X and those tensors MUST_RECOMPUTE makes the partitioner rebuild X in
  backward (the same ops on the same values: bit-identical), where ``passes/abc.py``
  compresses it, instead of keeping a compressed copy from the forward;
* under autocast, W: the bf16 copy of an fp32 parameter, which the partitioner keeps
  for the g_x op. That op can read the parameter (held anyway) and round it to bf16 as it
  reads (``hadamard.hq_weight_quant(round_to=)``, ``reference.hq_grad_input``): the same
  values, no copy kept, and no extra pass (2 more bytes read per weight).

After the partition (``passes/saved.py``, kept activations compressed), one more case:

* a kept tensor that is a pointwise function of another kept tensor (a GELU's output, kept
  for the next GEMM's weight gradient, beside its input, kept for GELU's backward). The
  partitioner keeps both; with both compressed, the backward rebuilds the first from the
  restoration of the second (``kept_chain``, ``replay``): half the bytes, and the forward
  kernel that compressed both lost half its row statistics.

``bench/saved_tensors.py`` shows what it is worth: on Llama d4096 the bf16 weight copies are
most of what the step keeps at 2048 tokens; on ViT-B the compressed input buffers are ~15%.
``HOTConfig.recompute_operands`` turns both on.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch.fx import Node
from torch.utils.checkpoint import CheckpointPolicy

from .find import LinearSite, is_backward
from .graph_utils import add_node
from .op_sets import CASTS, SAME_DATA

aten = torch.ops.aten


def needed_in_backward(x: Node, exclude: set) -> bool:
    """Whether X's data is consumed by backward anyway (through X, or any view/cast/alias
    connected to it, up or down): then the partitioner keeps it and compressing in the
    forward would only add a buffer."""
    def is_view(n):
        return n.op == "call_function" and n.target in SAME_DATA

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


MAX_RECOMPUTE = 24      # nodes: a norm's affine tail, GELU's or SwiGLU's few pointwise ops


def cheap(n: Node) -> bool:
    """A forward op the backward may run again at no memory cost: a view, or a pointwise
    op that draws no random numbers."""
    if n.op != "call_function":
        return False
    if n.target in SAME_DATA:
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
        if not cheap(n) or is_backward(n) or n.meta.get("recompute") is not None:
            return None
        chain.append(n)
        if len(chain) > MAX_RECOMPUTE:
            return None
        todo.extend(n.all_input_nodes)
    return chain


def mark_recompute(chain: List[Node]) -> None:
    for n in chain:
        n.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE


def parameter_weight_chain(s: LinearSite) -> Optional[List[Node]]:
    """The views and the one cast that make the site's W operand from an fp32 parameter
    (autocast's bf16 copy), in graph order, when no other backward op reads that copy; else
    None. HOT's g_x op can then read the parameter itself and round as it reads
    (``hadamard.hq_weight_quant(round_to=)``): the copy is not kept, and nothing is
    recomputed. ``exclude``: the site's own g_x mm, which the rewrite replaces."""
    if s.gx is None:
        return None
    chain = recompute_chain(s.wt, {s.gx})
    if not chain:
        return None
    casts = [n for n in chain if n.target in CASTS]
    rest = [n for n in chain if n.target not in CASTS]
    leaves = {a for n in chain for a in n.all_input_nodes if a not in chain}
    if (len(casts) != 1 or any(n.target not in SAME_DATA or n.kwargs for n in rest)
            or len(leaves) != 1 or next(iter(leaves)).op != "placeholder"):
        return None
    src = casts[0].args[0].meta.get("val")
    out = casts[0].meta.get("val")
    if not (isinstance(src, torch.Tensor) and isinstance(out, torch.Tensor)
            and out.dtype == s.dtype and src.dtype == torch.float32):
        return None
    order = {n: i for i, n in enumerate(s.wt.graph.nodes)}
    return sorted(chain, key=order.__getitem__)


def replay_without_cast(graph, chain: List[Node], before: Node, like: Node, fake_mode) -> Node:
    """The chain's views applied to the parameter itself, in backward: W (in fp32) with the
    operand's layout."""
    leaves = {a: a for n in chain for a in n.all_input_nodes if a not in chain}
    return replay(graph, chain, leaves, before, like, fake_mode, skip=CASTS)


def kept_chain(s: Node, sources: set, position: dict,
               symbols: frozenset = frozenset()) -> Optional[Tuple[Node, List[Node]]]:
    """(the source, the forward nodes from it to ``s`` in graph order) when kept tensor
    ``s`` is made from exactly one node of ``sources`` (other kept tensors) by ``cheap``
    ops whose every other input is a constant or one of ``symbols`` (sizes the backward
    receives too: a dynamic batch's SymInts); else None. Why so strict: the backward
    replays the chain on the source's restoration, where a parameter, a size only the
    forward computed or a second activation does not exist. No kwargs, at most
    ``MAX_RECOMPUTE`` nodes."""
    chain, todo, seen, found = [], [s], set(), set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n is not s and n in sources:
            found.add(n)
            continue
        inputs = [a for a in n.all_input_nodes if a not in symbols]
        if not cheap(n) or n.kwargs or not all(
                isinstance(a.meta.get("val"), torch.Tensor) for a in inputs):
            return None
        chain.append(n)
        if len(chain) > MAX_RECOMPUTE:
            return None
        todo.extend(inputs)
    if len(found) != 1:
        return None
    return found.pop(), sorted(chain, key=position.__getitem__)


def replay(graph, chain: List[Node], inputs: dict, before: Node, like: Node, fake_mode,
           skip=frozenset()) -> Node:
    """A chain's nodes again in ``graph`` (the backward) before ``before``, reading
    ``inputs`` (node -> backward node: a kept tensor's restoration, the symbols; every
    input from outside the chain must be there) where they read the originals; its last.
    A node whose target is in ``skip`` is not replayed: its readers read its first arg."""
    mapped = dict(inputs)
    for n in chain:
        if n.target in skip:
            mapped[n] = mapped[n.args[0]]
            continue
        args = torch.fx.node.map_arg(n.args, lambda a: mapped[a])
        mapped[n] = add_node(graph, n.target, args, before=before, tag="is_backward",
                             like=like, fake_mode=fake_mode)
    return mapped[chain[-1]]
