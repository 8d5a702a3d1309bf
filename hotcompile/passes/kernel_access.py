"""One mutation analysis per distinct Triton launch while a graph with spliced kernels compiles.

Why: every ``triton_kernel_wrapper`` node costs a TTIR generation plus a walk of it
(``torch._higher_order_ops.triton_kernel_wrap.identify_accessed_tensors``) to learn which
arguments the kernel writes: once when splicing traces a body under functionalisation, and
again when Inductor lowers the node. Nothing caches it, and a model's sites repeat the same
few launches (ViT-B: 48 sites, 7 launches each, 4 distinct shapes), so a fully rewritten
ViT-B compile spent minutes regenerating identical TTIR (2-core CPU: ~0.1 s per launch,
~90% of the splicing pass).

The analysis is a pure function of the kernel and what its TTIR depends on: the value of
every non-tensor argument (constexprs, and the integers Triton specialises) and each tensor
argument's dtype (tracing replaces fake tensors and Inductor buffers by stand-ins of that
dtype). ``memoized_kernel_access()`` installs a memo keyed on exactly that for the duration
of a compile (the outermost block: the memo is dropped when it ends, so nothing outlives the
compile that analysed it) and restores the original function afterwards; a launch whose
arguments it cannot key (symbolic sizes, unknown objects) goes to the original, uncached.
Each caller gets its own copy of the result.
"""
from __future__ import annotations

import contextlib
import copy
import threading
from typing import Any, Optional

import torch

# the analysis' name: torch 2.13 (reads and writes); earlier releases (writes only)
_NAMES = ("identify_accessed_tensors", "identify_mutated_tensors")
_LOCK = threading.Lock()
_DEPTH = 0
_ORIGINAL = None
_NAME = None
_MEMO: "dict[tuple, Any]" = {}
STATS = {"hits": 0, "misses": 0, "unkeyed": 0}


def _describe(value) -> Optional[tuple]:
    """What of an argument the TTIR depends on, or None when it cannot be said."""
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype)
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


def _key(kernel, kwargs: dict, tma) -> Optional[tuple]:
    parts = []
    for name in sorted(kwargs):
        d = _describe(kwargs[name])
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


def _memoized(kernel, kwargs, tma_descriptor_metadata, *rest, **more):
    key = None if rest or more else _key(kernel, kwargs, tma_descriptor_metadata)
    if key is None:
        STATS["unkeyed"] += 1
        return _ORIGINAL(kernel, kwargs, tma_descriptor_metadata, *rest, **more)
    with _LOCK:
        hit = _MEMO.get(key)
        if hit is not None:
            STATS["hits"] += 1
            return copy.deepcopy(hit)
    result = _ORIGINAL(kernel, kwargs, tma_descriptor_metadata)
    with _LOCK:
        STATS["misses"] += 1
        _MEMO[key] = copy.deepcopy(result)
    return result


@contextlib.contextmanager
def memoized_kernel_access():
    """Memoize Triton kernels' mutation analysis while the block runs (re-entrant). Where
    this torch has no such function, nothing changes."""
    global _DEPTH, _ORIGINAL, _NAME
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
                _MEMO.clear()
