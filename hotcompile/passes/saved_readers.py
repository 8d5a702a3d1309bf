"""What the backward does with a kept tensor S (``passes/saved.py``): which readers tolerate
S's round trip, and whether S reaches an exponent, a divisor or a comparison.

Why a module of its own: the rewrite (``saved.py``) decides where and how S is stored; this
decides whether it may be, by walking the backward graph from S's placeholder. Each walk is
``reaches(S, step)`` with a step that says found / stop / walk on for one reader: through
views and casts (``VIEWS``) and shifts and scales (``_LINEAR``), S's error keeps its size.
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch.fx import Node

from .op_sets import CASTS, SAME_DATA

aten = torch.ops.aten
prims = torch.ops.prims

# ops that only move or re-type S, or read part of it: the pass follows them to S's real
# readers
VIEWS = SAME_DATA | {aten.squeeze.dims, aten.squeeze.default, aten.slice.Tensor,
                     aten.select.int}
# readers for which S's e4m3 round trip is an error of the size HOT's own operands have
TOLERANT = {
    aten.mm.default, aten.bmm.default, aten.addmm.default,
    aten.mul.Tensor, aten.mul.Scalar, aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor,
    aten.sub.Scalar, aten.div.Tensor, aten.div.Scalar, aten.neg.default, aten.abs.default,
    aten.pow.Tensor_Scalar, aten.erf.default,
    aten.tanh.default, aten.sigmoid.default, aten.relu.default,
    aten.sum.dim_IntList, aten.sum.default, aten.mean.dim, aten.var_mean.correction,
    aten.native_layer_norm.default, aten.native_layer_norm_backward.default,
    aten.gelu.default, aten.gelu_backward.default, aten.silu.default,
    aten.silu_backward.default, aten.sigmoid_backward.default, aten.tanh_backward.default,
    aten.threshold_backward.default, aten.where.self, aten.le.Scalar, aten.lt.Scalar,
    aten.ge.Scalar, aten.gt.Scalar,
}


def _readers(node: Node) -> Iterable[Node]:
    """S's readers in backward, through the ops that only view or re-type it."""
    for u in node.users:
        if u.op == "call_function" and u.target in VIEWS:
            yield from _readers(u)
        else:
            yield u


# ops through which S's error stays an absolute error of the same size (a shift, a scale)
_LINEAR = VIEWS | {aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar,
                    aten.neg.default, aten.mul.Scalar, aten.div.Scalar, aten.mul.Tensor,
                    aten.div.Tensor}
_EXPONENTIALS = {aten.exp.default, aten.exp2.default, aten.expm1.default,
                 aten._softmax.default, aten._log_softmax.default}


def _logistic(exp: Node) -> bool:
    """``exp`` only feeds 1 + exp(.): a sigmoid's denominator (SiLU's backward recomputes
    sigmoid(x) = 1 / (1 + exp(-x)) under autocast), bounded in (0, 1) whatever the error
    in its exponent: where exp(-x) is off by a large factor, sigmoid(x) is near 0."""
    return exp.target is aten.exp.default and all(
        u.op == "call_function" and u.target in (aten.add.Tensor, aten.add.Scalar)
        and 1 in u.args and exp in u.args for u in exp.users)


def reaches(node: Node, step) -> bool:
    """Walk S's backward readers: ``step(reader, its input)`` says True (found), False (stop
    here) or None (walk on through this reader)."""
    todo, seen = [node], set()
    while todo:
        n = todo.pop()
        for u in n.users:
            if u in seen or u.op != "call_function":
                continue
            seen.add(u)
            verdict = step(u, n)
            if verdict:
                return True
            if verdict is None:
                todo.append(u)
    return False


def _exponent_step(u: Node, n: Node) -> Optional[bool]:
    """``reaches`` step: does backward exponentiate S shifted or scaled (softmax(z) =
    exp(z - max - log sum) recomputed from saved logits)? There the round trip's error of
    up to |z| / 16 lands in the exponent. A square stops the walk: GELU's backward takes
    exp(-x^2 / 2), whose error is damped by the factor itself (x exp(-x^2 / 2) vanishes
    where x is large); so does a sigmoid's 1 + exp(-x) (``_logistic``)."""
    if u.target in _EXPONENTIALS:
        return not _logistic(u)
    if u.target in (aten.mul.Tensor, aten.div.Tensor) and u.args[0] is u.args[1]:
        return False
    return None if u.target in _LINEAR else False


_POLES = {aten.reciprocal.default, aten.rsqrt.default, aten.sqrt.default, aten.log.default,
          aten.log2.default, aten.log1p.default}


def _divisor_step(u: Node, n: Node) -> Optional[bool]:
    """``reaches`` step: does backward divide by S (scaled, shifted or raised to a power),
    take its log, root or a negative power? The round trip turns elements under about 2^-18
    of their row's max into exact zeros, and 1 / 0 is a NaN gradient where the exact one is
    finite (log(x^2)'s 2 / x)."""
    if (u.target in _POLES or (u.target is aten.div.Tensor and u.args[1] is n)
            or (u.target is aten.pow.Tensor_Scalar and u.args[1] < 0)):
        return True
    # a power of S is zero where S is
    return None if u.target in _LINEAR or u.target in (aten.pow.Tensor_Scalar,
                                                        aten.abs.default) else False


def _ops(*names):
    """The aten overloads named ``op.overload`` that this torch has."""
    found = set()
    for name in names:
        op, overload = name.split(".")
        packet = getattr(aten, op, None)
        if packet is not None and hasattr(packet, overload):
            found.add(getattr(packet, overload))
    return found


_COMPARISONS = _ops(
    "le.Scalar", "lt.Scalar", "ge.Scalar", "gt.Scalar", "eq.Scalar", "ne.Scalar",
    "le.Tensor", "lt.Tensor", "ge.Tensor", "gt.Tensor", "eq.Tensor", "ne.Tensor",
    "relu.default", "sign.default", "sgn.default", "signbit.default", "heaviside.default",
    "logical_not.default", "logical_and.default", "logical_or.default", "logical_xor.default",
    "where.self", "where.ScalarSelf", "where.ScalarOther", "where.Scalar",
    "clamp.default", "clamp.Tensor", "clamp_min.default", "clamp_min.Tensor",
    "clamp_max.default", "clamp_max.Tensor", "maximum.default", "minimum.default",
    "threshold.default", "threshold_backward.default", "hardtanh_backward.default",
    "leaky_relu_backward.default", "elu_backward.default", "hardshrink_backward.default",
    "softshrink_backward.default", "hardsigmoid_backward.default",
    "hardswish_backward.default", "prelu.default")


def comparison_step(u: Node, n: Node) -> Optional[bool]:
    """``reaches`` step: does backward compare S (shifted or scaled), mask by it or cast it
    to bool or an integer (a zero test)? Then S is not centred (``saved_fp8.
    compress_centred``): an exact zero of a ReLU's output must come back as zero, and it
    does only without the row mean."""
    if u.target in _COMPARISONS:
        return True
    if u.target in CASTS:
        dtype = u.args[1] if len(u.args) > 1 else u.kwargs.get("dtype")
        if dtype is not None and not (dtype.is_floating_point or dtype.is_complex):
            return True
    return None if u.target in _LINEAR else False


def reject_reader(node: Node) -> Optional[str]:
    if reaches(node, _exponent_step):
        return "exponentiated in backward (softmax of saved logits)"
    if reaches(node, _divisor_step):
        return "divided by in backward (a zero from the round trip would be a NaN)"
    for r in _readers(node):
        if r.op != "call_function":
            return f"read by {r.op}"
        if r.target not in TOLERANT:
            name = getattr(r.target, "__name__", str(r.target))
            return f"read in backward by {name}"
    return None
