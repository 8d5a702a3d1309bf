"""Every Triton launch of this package goes through ``launch``: run now, or record for Inductor.

Why one door: the same Python bodies (``fused.py``) serve two ways of running.

* Called from a ``hot::`` custom op (eager, or an opaque extern call in a compiled graph),
  ``launch`` is ``kernel[grid](...)``: Triton's own launcher, from Python.
* Traced by the splicing pass (``passes/splice.py``) inside ``recording()``, ``launch``
  goes through ``torch.library.wrap_triton``: the trace holds one
  ``triton_kernel_wrapper_functional`` node per launch, which the pass copies into the
  joint graph. Inductor then launches the kernels itself from its generated wrapper, with
  its own buffer planning, and no Python dispatch or Triton launcher runs between them
  (TORCH_NOTES.md: +24 us per site instead of +70 us per custom op, measured on the H100).

Recording is a flag of the tracing thread, not an argument: the bodies stay one function
for both ways, and a launch outside ``recording()`` never pays ``wrap_triton``'s
higher-order-op dispatch.

Each kernel a default compile splices also declares which of its tensor arguments it writes
(``declare_writes``, beside the kernel). Why: Inductor learns that for a recorded launch by
generating the kernel's TTIR and walking it (``passes/kernel_access.py``), about 1.8 s of
Llama d4096's cold first compile on the H200 (fortieth stop) for a fact that is fixed by the
kernel's code and a few of its constexprs. The declaration stands in for that analysis where
torch's analysis is writes-only (torch 2.11); the tests check every declaration against the
analysis on every launch they record (``kernel_access.CHECK_DECLARED``).
"""
from __future__ import annotations

import contextlib
import threading
from typing import Callable, Dict, Optional, Tuple

_STATE = threading.local()


def recording_launches() -> bool:
    """Whether launches are being recorded for Inductor (inside ``recording()``)."""
    return getattr(_STATE, "on", False)


@contextlib.contextmanager
def recording():
    """Record launches (``wrap_triton``) instead of running them, in this thread."""
    before = recording_launches()
    _STATE.on = True
    try:
        yield
    finally:
        _STATE.on = before


# Triton's launch defaults (``triton.Config``'s), which Inductor also applies to a user kernel
# recorded without a config
_DEFAULT_CONFIG = {"num_warps": 4, "num_stages": 3}


def unpassed_parameters(kernel, n_positional: int, named) -> list:
    """The parameters of a Triton kernel that a launch with ``n_positional`` arguments and
    the ``named`` ones leaves to their defaults. Why it matters beyond ``wrap_triton``:
    torch's mutation analysis of such a launch cannot build the kernel's TTIR and then
    reports every tensor argument written (forty-fourth stop)."""
    names = getattr(kernel, "arg_names", None) or ()
    return [n for n in names[n_positional:] if n not in named]


def launch(kernel, grid, *args, **meta) -> None:
    """``kernel[grid](*args, **meta)``, or its ``wrap_triton`` record inside ``recording()``.

    Recording leaves out ``num_warps`` / ``num_stages`` where they equal Triton's defaults.
    Why: a recorded launch that names them becomes a one-config autotuner, and Inductor then
    keys the kernel's definition on every scalar argument (its shapes), so each layer shape
    got its own copy of the same kernel in the output code; each copy is loaded, hashed and
    given a launcher when a process starts (24 copies for Llama d4096: loading them took
    0.78 s of a warm start on the H100, 0.34-0.48 s for the 10 left). Without them, kernels
    that differ only in their runtime scalars share one.

    Every parameter must be passed, defaults included: a recorded launch fills none
    (``wrap_triton`` fails, and the op silently stays unspliced), so an eager launch that
    leans on a default is refused here too, where the CPU tests see it."""
    missing = unpassed_parameters(kernel, len(args), meta)
    if missing:
        raise TypeError(f"launch of {getattr(kernel, '__name__', kernel)}: pass every "
                        f"parameter (a recorded launch fills no defaults): {missing}")
    if recording_launches():
        import torch
        meta = {k: v for k, v in meta.items() if _DEFAULT_CONFIG.get(k, object()) != v}
        torch.library.wrap_triton(kernel)[grid](*args, **meta)
    else:
        kernel[grid](*args, **meta)


# kernel (the JITFunction) -> its written tensor arguments, from the launch's arguments by name
_WRITES: Dict[object, Callable[[dict], Tuple[str, ...]]] = {}


def declare_writes(kernel, writes: Callable[[dict], Tuple[str, ...]]) -> None:
    """Declare the tensor arguments ``kernel`` writes (stores or atomics through), as a
    function of its arguments by name (its constexprs decide): every one it may write, none
    it never writes. A wrong declaration is a wrong gradient (an output read as the untouched
    clone of its input), so each is checked against Triton's mutation analysis in the tests."""
    _WRITES[kernel] = writes


def declared_writes(kernel, kwargs: dict) -> Optional[Tuple[str, ...]]:
    """The declared written arguments of a launch of ``kernel`` (a JITFunction, or the
    autotuner torch wraps one in) with ``kwargs`` (every argument by name), in parameter
    order; None where the kernel declares none."""
    fn = kernel
    while fn not in _WRITES and getattr(fn, "fn", None) is not None:
        fn = fn.fn
    declare = _WRITES.get(fn)
    if declare is None:
        return None
    names = set(declare(kwargs))
    unknown = names - set(fn.arg_names)
    if unknown:       # a misspelt name would be an under-declaration: refuse, never drop
        raise ValueError(f"{fn.__name__} declares writes to {sorted(unknown)}, "
                         "which are not its parameters")
    return tuple(n for n in fn.arg_names if n in names)
