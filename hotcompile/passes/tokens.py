"""Which rows of a linear's flattened input form one sequence: HLA blocks must hold neighbours.

HLA keeps the low-pass Hadamard coefficients of every 16 *neighbouring* tokens. The
flattened input ``x: (L, I)`` of a linear mixes a batch axis and a sequence axis, in an
order only the graph knows: batch-first ``(B, S, I)`` gives rows ``b*S + s``,
sequence-first ``(S, B, I)`` (``nn.MultiheadAttention`` default, Megatron) gives rows
``s*B + b``; a plain ``(N, I)`` batch has no sequence at all. Blocking 16 consecutive
rows is right only in the first case.

How it is proven, not assumed: every forward tensor's axes are labelled with *atoms*
(fresh at graph inputs and at ops we do not model), carried through views, permutes,
pointwise ops, full slices, matmuls (rows stay rows) and embeddings. A model mixes tokens of one
sequence and never tokens of different samples: attention (the key axis of
``scaled_dot_product_attention``, a softmax or a contraction over it), pooling over
tokens, selecting a class token. So an op that reduces or contracts over some of the
row atoms while leaving the others apart names those atoms the sequence, and the rest
the batch. A site whose row atoms no such op separates, or separates inconsistently,
has an unknown layout: the pass gives it full rank (no low-pass, no blocking
assumption) and the report says why.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import operator
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch.fx import Graph, Node

from .graph_utils import same_size
from .op_sets import SHAPE_VIEWS

aten = torch.ops.aten
prims = torch.ops.prims

Atom = tuple          # ("in", id) fresh, or ("split", parent, part, size)
Axes = List[tuple]    # per axis: tuple of atoms, outermost first

_fresh = itertools.count()

_SAME = {aten.clone.default, aten.alias.default, aten._to_copy.default, aten.detach.default,
         prims.convert_element_type.default, aten.contiguous.default, aten.lift_fresh_copy.default}
_REDUCE = {aten.sum.dim_IntList, aten.mean.dim, aten.amax.default, aten.amin.default,
           aten.var.correction, aten.var_mean.correction, aten.max.dim, aten.min.dim,
           aten.logsumexp.default, aten.prod.dim_int, aten.std.correction}
_SOFTMAX = {aten._softmax.default, aten._log_softmax.default, aten.softmax.int,
            aten.log_softmax.int}
_SDPA = tuple(getattr(aten, n).default for n in (
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_cudnn_attention",
    "scaled_dot_product_attention", "_scaled_dot_product_fused_attention_overrideable")
    if hasattr(aten, n))


def _size(v) -> Optional[int]:
    if isinstance(v, int):
        return v
    h = getattr(getattr(v, "node", None), "hint", None)
    return int(h) if h is not None else None


def _val(n):
    return n.meta.get("val") if isinstance(n, Node) else None


def _shape(n) -> Optional[List[Optional[int]]]:
    v = _val(n)
    return [_size(d) for d in v.shape] if isinstance(v, torch.Tensor) else None


def _fresh_axes(n) -> Optional[Axes]:
    sh = _shape(n)
    if sh is None:
        return None
    return [(("in", next(_fresh)),) if d != 1 else () for d in sh]


def _atom_size(a: Atom, sizes: Dict[Atom, int]) -> Optional[int]:
    return a[3] if a[0] == "split" else sizes.get(a)


def _root(a: Atom) -> Atom:
    while a[0] == "split":
        a = a[1]
    return a


@dataclasses.dataclass
class TokenLayout:
    """How the rows of one linear's 2-D input split into sequences.

    ``seq_len`` is tokens per sequence (an int, or a graph node giving it under dynamic
    shapes); ``seq_first``: rows are ``s * B + b`` instead of ``b * S + s``. ``seq_len is None``
    means unknown: ``reason`` says why."""

    seq_len: object = None
    seq_first: bool = False
    reason: Optional[str] = None
    source: Optional[Node] = None     # N-D tensor with the sequence axis, and which axis
    axis: Optional[int] = None

    @property
    def known(self) -> bool:
        return self.seq_len is not None

    def describe(self) -> str:
        if not self.known:
            return f"unknown ({self.reason})"
        s = self.seq_len if isinstance(self.seq_len, int) else "S"
        return f"{'seq-first' if self.seq_first else 'batch-first'}, {s} tokens/sequence"


class AxisLabels:
    """Forward dataflow of axis atoms over a joint graph, plus the token-mixing events."""

    def __init__(self, graph: Graph, is_forward):
        self.axes: Dict[Node, object] = {}
        self.sizes: Dict[Atom, int] = {}
        self.events: List[Tuple[frozenset, frozenset]] = []   # (mixed roots, partial roots)
        for n in graph.nodes:
            if n.op == "placeholder" or (n.op == "call_function" and is_forward(n)):
                try:
                    out = self._visit(n)
                except Exception:   # noqa: BLE001 - an op we misread: fresh labels
                    out = None
                self.axes[n] = out if out is not None else _fresh_axes(n)
                self._note_sizes(n)

    # ------------------------------------------------------------------ helpers
    def _note_sizes(self, n: Node) -> None:
        ax, sh = self.axes.get(n), _shape(n)
        if not isinstance(ax, list) or sh is None or len(ax) != len(sh):
            return
        for atoms, d in zip(ax, sh):
            if len(atoms) == 1 and atoms[0][0] == "in" and d is not None:
                self.sizes.setdefault(atoms[0], d)

    def of(self, n) -> Optional[Axes]:
        ax = self.axes.get(n) if isinstance(n, Node) else None
        return ax if isinstance(ax, list) else None

    def _mix(self, atoms: Sequence[Atom]) -> None:
        mixed = frozenset(_root(a) for a in atoms)
        partial = frozenset(_root(a) for a in atoms if a[0] == "split")
        if mixed:
            self.events.append((mixed, partial))

    def _regroup(self, src: Axes, shape: List[Optional[int]]) -> Optional[Axes]:
        """Axes of a view of ``src`` to ``shape``: flatten the atoms, regroup by sizes."""
        flat = [a for axis in src for a in axis]
        out: Axes = []
        for d in shape:
            if d is None:
                return None
            group, prod = [], 1
            while prod < d:
                if not flat:
                    return None
                a = flat.pop(0)
                s = _atom_size(a, self.sizes)
                if s is None:
                    return None
                if prod * s <= d:
                    group.append(a)
                    prod *= s
                elif d % prod == 0 and s % (d // prod) == 0:
                    outer = d // prod
                    group.append(("split", a, "outer", outer))
                    flat.insert(0, ("split", a, "inner", s // outer))
                    prod = d
                else:
                    return None
            out.append(tuple(group))
        return out if not flat else None

    def _pointwise(self, n: Node) -> Optional[Axes]:
        sh = _shape(n)
        if sh is None:
            return None
        ins = [a for a in n.args if isinstance(a, Node) and self.of(a) is not None]
        out: Axes = []
        for i in range(1, len(sh) + 1):
            label = None
            for a in ins:
                ax, ash = self.of(a), _shape(a)
                if ash is not None and len(ash) >= i and ash[-i] == sh[-i] and sh[-i] != 1:
                    label = ax[-i]
                    break
            out.append(label if label is not None else ((("in", next(_fresh)),) if sh[-i] != 1 else ()))
        return out[::-1]

    @staticmethod
    def _dims(d, rank: int) -> List[int]:
        if d is None:
            return list(range(rank))
        d = [d] if isinstance(d, int) else list(d)
        return [x % rank for x in d] if rank else []

    # ------------------------------------------------------------------ the transfer function
    def _visit(self, n: Node) -> object:
        if n.op == "placeholder":
            return None
        t, args = n.target, n.args
        a0 = self.of(args[0]) if args else None
        if t is operator.getitem:
            src = self.axes.get(args[0])
            return src[args[1]] if isinstance(src, tuple) and args[1] < len(src) else None
        if t in _SAME:
            return a0
        if t in SHAPE_VIEWS:
            return self._regroup(a0, _shape(n)) if a0 is not None else None
        if t == aten.expand.default and a0 is not None:
            sh = _shape(n)
            pad = [()] * (len(sh) - len(a0)) + list(a0)
            return [ax if ax else ((("in", next(_fresh)),) if d != 1 else ()) for ax, d in zip(pad, sh)]
        if t == aten.permute.default and a0 is not None:
            return [a0[d % len(a0)] for d in args[1]]
        if t == aten.transpose.int and a0 is not None:
            out, i, j = list(a0), args[1] % len(a0), args[2] % len(a0)
            out[i], out[j] = out[j], out[i]
            return out
        if t == aten.t.default and a0 is not None:
            return a0[::-1]
        if t in (aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default):
            a, b = (args[1], args[2]) if t in (aten.addmm.default, aten.baddbmm.default) else args[:2]
            la, lb = self.of(a), self.of(b)
            if la is None or lb is None:
                return None
            self._mix(la[-1])
            return [*la[:-1], lb[-1]]
        if t in _SDPA:
            q, k = self.of(args[0]), self.of(args[1])
            if q is None or k is None:
                return None
            self._mix(k[-2])
            return (q,) + tuple(_fresh_axes_val(v) for v in _val(n)[1:]) \
                if isinstance(_val(n), (tuple, list)) else q
        if t in _SOFTMAX and a0 is not None:
            self._mix(a0[args[1] % len(a0)])
            return a0
        if t in _REDUCE and a0 is not None:
            rank = len(a0)
            dims = self._dims(args[1] if len(args) > 1 else n.kwargs.get("dim"), rank)
            for d in dims:
                self._mix(a0[d])
            keep = (args[2] if len(args) > 2 else n.kwargs.get("keepdim", False))
            out = [() if i in dims else ax for i, ax in enumerate(a0)] if keep else \
                [ax for i, ax in enumerate(a0) if i not in dims]
            v = _val(n)
            return tuple(out for _ in v) if isinstance(v, (tuple, list)) else out
        if t == aten.select.int and a0 is not None:
            d = args[1] % len(a0)
            self._mix(a0[d])
            return [ax for i, ax in enumerate(a0) if i != d]
        if t == aten.unbind.int and a0 is not None:
            d = (args[1] if len(args) > 1 else 0) % len(a0)
            return tuple([ax for i, ax in enumerate(a0) if i != d] for _ in _val(n))
        if t in (aten.split.Tensor, aten.split_with_sizes.default) and a0 is not None:
            d = (args[2] if len(args) > 2 else 0) % len(a0)
            outs = []
            for v in _val(n):
                ax = list(a0)
                if _size(v.shape[d]) != _shape(args[0])[d]:
                    ax[d] = (("in", next(_fresh)),)
                outs.append(ax)
            return tuple(outs)
        if t == aten.slice.Tensor and a0 is not None:
            # x[:, None] under dynamic shapes is a full slice of a symbolic axis: same atoms;
            # a part of an axis is a new one (compared as expressions: no guard installed)
            d = (args[1] if len(args) > 1 else 0) % len(a0)
            step = args[4] if len(args) > 4 else 1
            full = step == 1 and same_size(_val(n).shape[d], _val(args[0]).shape[d])
            out = list(a0)
            if not full:
                out[d] = (("in", next(_fresh)),) if _size(_val(n).shape[d]) != 1 else ()
            return out
        if t == aten.embedding.default:
            w, idx = self.of(args[0]), self.of(args[1])
            return [*idx, w[-1]] if w is not None and idx is not None else None
        if isinstance(getattr(t, "tags", None), (list, tuple)) and torch.Tag.pointwise in t.tags:
            return self._pointwise(n)
        return None

    # ------------------------------------------------------------------ the question
    def layout(self, x: Node) -> TokenLayout:
        """The sequence layout of the rows of 2-D ``x`` (the input of a forward GEMM)."""
        ax, sh = self.of(x), _shape(x)
        if ax is None or sh is None or len(ax) != 2:
            return TokenLayout(reason="the input's axes could not be traced")
        rows = list(ax[0])
        if len(rows) < 2:
            return TokenLayout(reason="rows are independent samples (no sequence axis)")
        roots = [_root(a) for a in rows]
        if len(set(roots)) != len(roots) or any(a[0] == "split" for a in rows):
            return TokenLayout(reason="rows interleave parts of one axis")
        row_set = frozenset(roots)
        seqs = set()
        for mixed, partial in self.events:
            hit = mixed & row_set
            if not hit or hit == row_set:
                continue          # no row atom, or every row mixed (a loss over all tokens)
            if partial & hit:
                return TokenLayout(reason="tokens are mixed in windows smaller than the sequence")
            seqs.add(hit)
        if not seqs:
            return TokenLayout(reason="no op mixes tokens within a sequence (no attention or "
                               "pooling over a row axis in this graph)")
        if len(seqs) > 1:
            return TokenLayout(reason="different ops mix different row axes")
        seq = next(iter(seqs))
        k = len(seq)
        if set(roots[-k:]) == seq:
            seq_first = False
        elif set(roots[:k]) == seq:
            seq_first = True
        else:
            return TokenLayout(reason="the sequence axes sit between batch axes")
        sizes = [self.sizes.get(a) for a in (roots[:k] if seq_first else roots[-k:])]
        if any(s is None for s in sizes):
            return TokenLayout(reason="sequence length unknown")
        length = math.prod(sizes)
        target = tuple(rows[:k] if seq_first else rows[-k:])
        src, axis = self._axis_source(x, target)
        seq_len = length
        sym = _val(src).shape[axis] if src is not None else None
        if sym is not None and not isinstance(sym, int):
            seq_len = None   # symbolic: the pass materialises it from (src, axis)
        elif src is None and not all(isinstance(d, int) for d in _val(x).shape):
            return TokenLayout(reason="dynamic sequence length with no axis to read it from")
        return TokenLayout(seq_len=seq_len if seq_len is not None else "symbolic",
                           seq_first=seq_first, source=src, axis=axis)

    def _axis_source(self, x: Node, target: tuple):
        """A node up x's view/cast chain with one axis labelled exactly ``target``."""
        n = x
        for _ in range(16):
            ax = self.of(n)
            if ax is not None:
                for i, a in enumerate(ax):
                    if tuple(a) == target:
                        return n, i
            if n.op != "call_function" or not (n.target in SHAPE_VIEWS or n.target in _SAME
                                               or n.target == aten.permute.default):
                break
            n = n.args[0]
        return None, None


def _fresh_axes_val(v):
    if not isinstance(v, torch.Tensor):
        return None
    return [(("in", next(_fresh)),) if _size(d) != 1 else () for d in v.shape]
