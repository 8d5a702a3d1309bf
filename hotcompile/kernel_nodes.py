"""Kernel nodes that clone nothing become their mutation without a trace each.

Why: a spliced HOT site reaches Inductor's post-grad passes as ``triton_kernel_wrapper_functional``
nodes. Inductor's reinplacing pass finds that none of them needs a copy of what it writes
(their outputs are fresh buffers) and empties each node's ``tensors_to_clone``, which leaves
``decompose_triton_kernel_wrapper_functional`` only a change of target to do. It still does
it through the pattern matcher's ``replace_by_example``: one ``make_fx`` trace per node, 0.75-
1.06 s of Llama d4096's cold first compile under HOT (forward and backward graphs; H200,
fortieth stop), where Inductor's own graphs have no such node. Now 0.13-0.22 s (forty-first).

``traceless_kernel_decomposition()`` wraps that pass while HOT compiles a graph: a node with
nothing to clone and no users becomes ``triton_kernel_wrapper_mutation`` in its place, with
the arguments and the metadata Inductor's decomposition gives it (``tests/test_splice.py``
compares the two graphs). Any other node (one that clones, a torch whose node carries other
arguments) is left to Inductor's pass, which runs after, as before.
"""
from __future__ import annotations

import logging

import torch

from .scoped_patch import ScopedPatch

log = logging.getLogger("hotcompile")

_FUNCTIONAL = torch.ops.higher_order.triton_kernel_wrapper_functional
_MUTATION = torch.ops.higher_order.triton_kernel_wrapper_mutation
# the functional node's arguments on the torch versions checked (2.11, 2.13): all but the
# last are the mutation's (``triton_kernel_wrapper_functional_dense``)
_MUTATION_ARGS = ("kernel_idx", "constant_args_idx", "grid", "tma_descriptor_metadata", "kwargs")
_ARGS = frozenset(_MUTATION_ARGS + ("tensors_to_clone",))
# what the pattern matcher's replacement keeps of the node it replaces (``_transfer_meta``)
_KEPT_META = ("stack_trace", "val", "tensor_meta")

_STATE = {"replaced": 0}


def _meta_fields() -> tuple:
    return tuple(getattr(torch.fx.proxy, "_COPY_META_FIELDS", ())) + _KEPT_META


def _mutation_regions(graph: torch.fx.Graph) -> None:
    """The pattern matcher's mutation regions, numbered before any node changes, as
    Inductor's pass numbers them when it starts: the graphs after either agree."""
    from torch._inductor import pattern_matcher as pm
    should = getattr(pm, "should_compute_mutation_region_ids", None)
    compute = getattr(pm, "compute_mutation_region_ids", None)
    if should is not None and compute is not None and should(graph):
        compute(graph)


def mutations_in_place(graph: torch.fx.Graph) -> int:
    """Replace each functional kernel node of ``graph`` that clones nothing and has no users
    by its mutation node; the number replaced. (A subgraph's nodes are replaced when
    Inductor's pass recurses into it: it calls the pass by its module name, this wrapper.)
    Last node first, as Inductor's pattern pass walks them: where every node qualifies,
    the new nodes get the names Inductor's pass gives them."""
    from torch._inductor import config
    trace = getattr(config, "trace", None)
    if getattr(trace, "provenance_tracking_level", 0) == 1 or \
            getattr(trace, "log_url_for_graph_xform", None):
        return 0    # Inductor's decomposition records each replacement: left to it
    nodes = list(graph.find_nodes(op="call_function", target=_FUNCTIONAL))[::-1]
    if not nodes:
        return 0
    _mutation_regions(graph)
    fields = _meta_fields()
    replaced = 0
    for node in nodes:
        if node.users or node.args or set(node.kwargs) != _ARGS or node.kwargs["tensors_to_clone"]:
            continue
        # everything that can fail before the graph changes: a node is replaced whole or kept
        kwargs = {k: node.kwargs[k] for k in _MUTATION_ARGS}
        meta = {k: v for k, v in node.meta.items() if k in fields}
        eager = node.meta.get("eager_input_vals")
        if eager is not None:
            meta["eager_input_vals"] = ((), {k: v for k, v in eager[1].items()
                                             if k != "tensors_to_clone"})
        with graph.inserting_before(node):
            mutation = graph.call_function(_MUTATION, (), kwargs)
        mutation.meta.update(meta)
        graph.erase_node(node)
        replaced += 1
    return replaced


def _with_mutations_first(original):
    def decompose_triton_kernel_wrapper_functional(graph):
        try:
            _STATE["replaced"] += mutations_in_place(graph)
        except Exception:  # noqa: BLE001 - Inductor's pass decomposes what is left, as before
            log.warning("hotcompile: kernel nodes left to Inductor's decomposition",
                        exc_info=True)
        return original(graph)
    return decompose_triton_kernel_wrapper_functional


_PATCH = ScopedPatch("decompose_triton_kernel_wrapper_functional", _with_mutations_first)


def traceless_kernel_decomposition():
    """While the block runs, Inductor's ``decompose_triton_kernel_wrapper_functional``
    first replaces what ``mutations_in_place`` can, then runs as it is on the rest.
    Re-entrant; where this torch has no such pass, nothing changes."""
    from torch._inductor.fx_passes import post_grad
    return _PATCH.active(post_grad)


def replaced_count() -> int:
    """How many kernel nodes this process decomposed without a trace (tests, benchmarks)."""
    return _STATE["replaced"]
