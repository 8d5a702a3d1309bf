"""Where a site's forward output may become a strided view, and making the graph say so.

An FP8 forward GEMM whose out-features O are not a multiple of 16 (GPT-2's 50257-token
head, BERT's 30522) runs on W padded with zero rows (``fp8_forward.out_padding``); its
(L, O) output is then a view of the first O columns of an (L, O + pad) buffer, row stride
O + pad. Why a proof first: the graph's readers were traced on a contiguous output. An aten
op computes from any strides (Inductor lowers it on the layout it meets), but ``view`` can
refuse strides it cannot split, ``as_strided`` (and an op reading strides or the storage
offset) would see the buffer's strides instead of the traced ones, an op outside aten (a
custom op, a HOT op, a higher-order op) may assume its input contiguous, and a graph output
would hand the user logits of other strides than eager's (``logits.view(-1, V)`` raising
where it did not). So the padding is taken only where every reader of the output, and of
every view of it, is an aten or prims op that reads no layout, no view is a graph output,
and each view re-run on the strided value succeeds. ``restride`` then updates the views'
fake values, so that what Inductor reads of the graph has the strides it will meet.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
from torch.fx import Node
from torch.fx.node import map_arg

aten = torch.ops.aten

# aten ops whose result depends on the input's layout, not only on its values
LAYOUT_READERS = (aten.as_strided.default, aten.as_strided_scatter.default,
                  aten.sym_stride.int, aten.sym_storage_offset.default)


def _returns_alias(target) -> bool:
    schema = getattr(target, "_schema", None)
    return bool(schema is not None and schema.returns
                and schema.returns[0].alias_info is not None)


def views_of(y: Node) -> Tuple[List[Node], Optional[str]]:
    """(the readers of ``y`` that alias it, transitively, in graph order; None) where every
    reader passes, else ([], why not)."""
    found: Dict[Node, None] = {}
    stack = [y]
    while stack:
        for u in stack.pop().users:
            if u.op == "output":
                return [], "is returned from the graph"
            space = getattr(u.target, "namespace", None)
            if u.op != "call_function" or space not in ("aten", "prims"):
                name = u.target if space else getattr(u.target, "__name__", u.target)
                return [], f"is read by {name}, not an aten op"
            if u.target in LAYOUT_READERS:
                return [], f"is read by {u.target}, which reads its strides"
            if _returns_alias(u.target) and u not in found:
                found[u] = None
                stack.append(u)
    order = {n: i for i, n in enumerate(y.graph.nodes)} if found else {}
    return sorted(found, key=order.__getitem__), None


def strided_value(val: torch.Tensor, pad: int) -> torch.Tensor:
    """The fake (L, O) value ``val`` as the first O columns of an (L, O + pad) buffer."""
    L, O = val.shape
    with val.fake_mode:
        wide = torch.empty_strided((L, O + pad), (O + pad, 1), dtype=val.dtype,
                                   device=val.device)
        return aten.slice.Tensor(wide, 1, 0, O)


def _rerun(y: Node, val: torch.Tensor, views: List[Node]) -> Dict[Node, torch.Tensor]:
    vals = {y: val}
    get = lambda a: vals.get(a, a.meta.get("val"))  # noqa: E731
    with val.fake_mode:
        for v in views:
            vals[v] = v.target(*map_arg(v.args, get), **map_arg(v.kwargs, get))
    return vals


def refusal(y: Node, pad: int) -> Optional[str]:
    """Why ``y``, a forward GEMM's (L, O) output, cannot be a view of an (L, O + pad)
    buffer (None where it can)."""
    val = y.meta.get("val")
    if not isinstance(val, torch.Tensor) or getattr(val, "fake_mode", None) is None:
        return "no fake value to check its readers against"
    views, why = views_of(y)
    if why:
        return f"the GEMM's output {why}"
    try:
        _rerun(y, strided_value(val, pad), views)
    except Exception as e:  # noqa: BLE001 - any failure means: keep the contiguous output
        return f"a view of the GEMM's output fails on its strides: {type(e).__name__}: {e}"
    return None


def restride(y: Node) -> None:
    """After ``y`` became the strided view: its views' fake values, re-run on it."""
    views, why = views_of(y)
    if why:
        raise RuntimeError(f"{y.name}: {why}")
    for v, val in _rerun(y, y.meta["val"], views).items():
        v.meta["val"] = val
