"""One mutation analysis per distinct Triton launch while a graph with spliced kernels compiles.

Why: every ``triton_kernel_wrapper`` node costs a TTIR generation plus a walk of it
(``torch._higher_order_ops.triton_kernel_wrap.identify_accessed_tensors``) to learn which
arguments the kernel writes: once when splicing traces a body under functionalisation, and
again when Inductor lowers the node. Nothing caches it, and a model's sites repeat the same
few launches (ViT-B: 48 sites, 7 launches each then, 4 distinct shapes), so a fully rewritten
ViT-B compile spent minutes regenerating identical TTIR (2-core CPU: ~0.1 s per launch,
~90% of the splicing pass).

The analysis is a pure function of the kernel and what its TTIR depends on: the value of
each constexpr, what Triton's specialisation keeps of each other integer (its type by range,
whether it is 1, whether 16 divides it: torch builds the TTIR from exactly that), the value
of other non-tensor arguments, and each tensor argument's dtype (tracing replaces fake
tensors and Inductor buffers by stand-ins of that dtype). Keying integers by their
specialisation lets layers of different widths share one analysis (Llama's 4096 and 11008).
``memoized_kernel_access()`` installs a memo keyed on exactly that for the duration of a
compile (the outermost block: the memo is dropped when it ends, so nothing outlives the
compile that analysed it) and restores the original function afterwards; a launch whose
arguments it cannot key (symbolic sizes, unknown objects) goes to the original, uncached.
Each caller gets its own copy of the result.

Before any of that, a launch of a kernel that declares its writes
(``kernels.launch.declare_writes``: every kernel a default compile splices) is answered from
the declaration where torch's analysis gives the written arguments alone (torch 2.11's
``identify_mutated_tensors``, a list of names): no TTIR at all. Why: in a cold first compile
the memo still generates one TTIR per distinct launch, about 1.8 s of Llama d4096's on the
H200 (fortieth stop). Torch 2.13's analysis also gives reads and whether an epilogue may be
fused into the kernel, which no declaration states: there the TTIR analysis runs as before.
With ``CHECK_DECLARED`` (the test suite sets it; ``HOTCOMPILE_CHECK_WRITES=1``) every launch
with a declaration is analysed too and a declaration that differs raises.
"""
from __future__ import annotations

import contextlib
import copy
import inspect
import os
import threading
from typing import Any, Optional

import torch

from ..kernels.launch import declared_writes

# the analysis' name: torch 2.13 (reads and writes); earlier releases (writes only)
_NAMES = ("identify_accessed_tensors", "identify_mutated_tensors")
_LOCK = threading.Lock()
_DEPTH = 0
_ORIGINAL = None
_NAME = None
_MEMO: "dict[tuple, Any]" = {}
STATS = {"hits": 0, "misses": 0, "unkeyed": 0, "declared": 0, "checked": 0}
# every differing declaration found under CHECK_DECLARED (the splicing pass catches the
# raise and keeps the op, so the tests' fixture fails on this list instead)
MISMATCHES: list = []
CHECK_DECLARED = os.environ.get("HOTCOMPILE_CHECK_WRITES") == "1"
_WRITES_ONLY = False       # the installed analysis answers with written names alone


def _int_class(v: int) -> tuple:
    """What Triton's specialisation keeps of a runtime (non-constexpr) integer argument: its
    type (i32, i64 or u64 by range), whether it is 1 (made a constant) and whether 16
    divides it (the divisibility hint)."""
    kind = "i32" if -2 ** 31 <= v < 2 ** 31 else ("u64" if v >= 2 ** 63 else "i64")
    return ("int", kind, v == 1, v % 16 == 0)


def _describe(value, constexpr: bool = True) -> Optional[tuple]:
    """What of an argument the TTIR depends on, or None when it cannot be said."""
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype)
    if isinstance(value, int) and not isinstance(value, bool) and not constexpr:
        return _int_class(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return (type(value).__name__, value)
    get_dtype = getattr(value, "get_dtype", None)          # an Inductor buffer (TensorBox)
    if callable(get_dtype) and hasattr(value, "get_size"):
        return ("tensor", get_dtype())
    try:
        import triton.language as tl
        if isinstance(value, tl.dtype):                   # a dtype constexpr (tl.bfloat16)
            return ("tl.dtype", str(value))
    except ImportError:  # pragma: no cover
        pass
    return None


def _kernel_key(kernel):
    """The kernel's identity for the analysis: a JITFunction itself; an autotuner (torch
    wraps every launch that names ``num_warps`` in a fresh one-config autotuner) by the
    function it tunes and its configs' arguments (the analysis traces the first)."""
    fn = getattr(kernel, "fn", None)
    configs = getattr(kernel, "configs", None)
    if fn is None or configs is None:
        return kernel
    return (_kernel_key(fn), tuple(repr(sorted(c.all_kwargs().items())) for c in configs))


def _runtime_params(kernel) -> frozenset:
    """Names of the kernel's non-constexpr parameters (none known: every value is keyed)."""
    fn = kernel
    while getattr(fn, "fn", None) is not None and not hasattr(fn, "params"):
        fn = fn.fn                                   # an autotuner (or a chain of them)
    try:
        return frozenset(p.name for p in fn.params if not p.is_constexpr)
    except (AttributeError, TypeError):
        return frozenset()


def _key(kernel, kwargs: dict, tma) -> Optional[tuple]:
    parts = []
    runtime = _runtime_params(kernel)
    for name in sorted(kwargs):
        d = _describe(kwargs[name], constexpr=name not in runtime)
        if d is None:
            return None
        parts.append((name,) + d)
    try:
        tma_key = repr(sorted(tma.items())) if tma else ""
        kernel_key = _kernel_key(kernel)
        hash(kernel_key)
    except (TypeError, AttributeError):
        return None
    return (kernel_key, tuple(parts), tma_key)


def _declared(kernel, kwargs, tma) -> Optional[tuple]:
    """The launch's declared writes, or None (no declaration, TMA descriptors, an argument
    the declaration cannot read)."""
    if tma:
        return None
    try:
        return declared_writes(kernel, kwargs)
    except Exception:  # noqa: BLE001 - a declaration that cannot answer: analyse instead
        return None


def written_names(result) -> list:
    """The written argument names of an analysis result: torch 2.11's list of names, or
    torch 2.13's ``TensorAccesses`` (its writes)."""
    if isinstance(result, (list, tuple)):
        return list(result)
    return [dep.name for dep in result.read_writes.writes]


def _check(kernel, kwargs, declared, result) -> None:
    STATS["checked"] += 1
    tensors = {n for n, v in kwargs.items() if (_describe(v) or ("",))[0] == "tensor"}
    got = sorted(n for n in written_names(result) if n in tensors)
    if got != sorted(declared):
        name = getattr(getattr(kernel, "fn", kernel), "__name__", kernel)
        msg = (f"{name}: declared writes {sorted(declared)}, Triton's analysis {got} "
               "(constexprs decide: fix the kernel's declare_writes)")
        MISMATCHES.append(msg)
        raise AssertionError(msg)


def _memoized(kernel, kwargs, tma_descriptor_metadata, *rest, **more):
    declared = None
    if (_WRITES_ONLY or CHECK_DECLARED) and not (rest or more):    # else nothing reads it
        declared = _declared(kernel, kwargs, tma_descriptor_metadata)
    if declared is not None and _WRITES_ONLY and not CHECK_DECLARED:
        STATS["declared"] += 1
        return list(declared)
    key = None if rest or more else _key(kernel, kwargs, tma_descriptor_metadata)
    if key is None:
        STATS["unkeyed"] += 1
        result = _ORIGINAL(kernel, kwargs, tma_descriptor_metadata, *rest, **more)
    else:
        with _LOCK:
            hit = _MEMO.get(key)
        if hit is not None:
            STATS["hits"] += 1
            result = copy.deepcopy(hit)
        else:
            result = _ORIGINAL(kernel, kwargs, tma_descriptor_metadata)
            with _LOCK:
                STATS["misses"] += 1
                _MEMO[key] = copy.deepcopy(result)
    if declared is not None and CHECK_DECLARED:
        _check(kernel, kwargs, declared, result)
        if _WRITES_ONLY:          # what the graph gets without the check
            return list(declared)
    return result


def _answers_names(fn) -> bool:
    """Whether an analysis function returns the written names alone (a list): torch 2.11's
    ``identify_mutated_tensors``, by its name and return annotation."""
    if getattr(fn, "__name__", "") != "identify_mutated_tensors":
        return False
    try:
        ret = inspect.signature(fn).return_annotation
    except (TypeError, ValueError):
        return False
    return "list" in str(ret).lower()


@contextlib.contextmanager
def memoized_kernel_access():
    """Memoize Triton kernels' mutation analysis while the block runs (re-entrant). Where
    this torch has no such function, nothing changes."""
    global _DEPTH, _ORIGINAL, _NAME, _WRITES_ONLY
    try:
        from torch._higher_order_ops import triton_kernel_wrap as twrap
    except ImportError:  # pragma: no cover - torch without user-kernel support
        twrap = None
    name = next((n for n in _NAMES if hasattr(twrap, n)), None) if twrap else None
    if name is None:  # pragma: no cover
        yield
        return
    with _LOCK:
        if _DEPTH == 0:
            _ORIGINAL, _NAME = getattr(twrap, name), name
            _WRITES_ONLY = _answers_names(_ORIGINAL)
            setattr(twrap, name, _memoized)
        _DEPTH += 1
    try:
        yield
    finally:
        with _LOCK:
            _DEPTH -= 1
            if _DEPTH == 0:
                setattr(twrap, _NAME, _ORIGINAL)
                _ORIGINAL = _NAME = None
                _WRITES_ONLY = False
                _MEMO.clear()
