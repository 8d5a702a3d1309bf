"""Where HOT's compiles differ from plain ``torch.compile``'s Inductor, and why.

Each setting here was measured to cost HOT's graphs first-step time that Inductor's own graphs
do not pay (docs/BENCHMARKS.md, thirtieth and thirty-first stops). A user's explicit choice
wins: a ``TORCHINDUCTOR_*`` variable in the environment, or ``torch.compile(options=...)``,
which the backend applies after these.

- ``graph_patches()``: the Inductor config every HOT graph compiles with, which depends on
  whether the graph launches Triton kernels that are not HOT's (``other_kernels``).
- ``start_compile_workers()``: Inductor's compile workers, started when the backend is
  called, as Inductor's own backend starts them, with HOT's Triton kernels launched through
  Inductor's static launcher.
- ``SAVED_BACKWARD_PATCHES``: the backward of a graph whose kept activations are compressed.
"""
from __future__ import annotations

import logging
import os
from typing import Optional

import torch

log = logging.getLogger("hotcompile")

DYNAMIC_RBLOCK = "TORCHINDUCTOR_DYNAMIC_SCALE_RBLOCK"
STATIC_USER_LAUNCH = "TORCHINDUCTOR_STATIC_LAUNCH_USER_DEFINED_TRITON_KERNELS"


# Namespaces of ops whose kernels are Inductor's or HOT's own, never a user's Triton kernel.
_OWN_NAMESPACES = frozenset({"aten", "prims", "hot", "inductor", "_c10d_functional",
                             "c10d_functional", "profiler"})
_STATE = {"static_workers": False}     # whether this process's workers launch user kernels
                                       # statically (HOT started them so, or the user asked)


def _has_static_user_launch() -> bool:
    return hasattr(torch._inductor.config, "static_launch_user_defined_triton_kernels")


def _maybe_triton_op(target) -> Optional[str]:
    """The qualified name of an op that may launch user-defined Triton kernels in Inductor's
    code: a ``torch.library.triton_op`` (torch 2.13 lists them; where it does not, any op
    outside ``_OWN_NAMESPACES``). A custom op of compiled C++/CUDA code (a flash-attention
    package's) is not one: Inductor calls it as it is."""
    if isinstance(target, torch._ops.OpOverload):
        name = target._schema.name
    elif isinstance(target, torch._ops.OpOverloadPacket):
        name = target._qualified_op_name
    else:
        return None
    if name.split("::")[0] in _OWN_NAMESPACES:
        return None
    import torch._library.triton as triton_ops
    registry = getattr(triton_ops, "triton_ops_to_kernels", None)
    return name if registry is None or name in registry else None


def other_kernels(gm: torch.fx.GraphModule) -> Optional[str]:
    """Why the graph Dynamo gave may launch Triton kernels that are not HOT's, or None.

    A user-defined Triton kernel call (``triton_kernel_wrapper_*``), or a call to a
    ``triton_op``, whose kernels Inductor launches as user-defined ones
    (``_maybe_triton_op``). Subgraphs (higher-order ops' bodies) are searched too. Why it
    matters: Inductor's static launcher is not safe for every user kernel (a 16-bit float
    scalar argument is passed as a 32-bit one; a host tensor descriptor argument fails the
    compile with a ``KeyError`` in torch 2.13), so such a graph keeps Triton's launchers
    (``graph_patches``)."""
    for module in gm.modules():
        graph = getattr(module, "graph", None)
        if not isinstance(graph, torch.fx.Graph):
            continue
        for n in graph.nodes:
            if n.op != "call_function":
                continue
            t = n.target
            if isinstance(t, torch._ops.HigherOrderOperator) and \
                    t.name().startswith("triton_kernel_wrapper"):
                return f"`{n.name}` launches a user-defined Triton kernel"
            op = _maybe_triton_op(t)
            if op is not None:
                return f"`{n.name}` calls `{op}`, which may launch Triton kernels"
    return None


def graph_patches(other: Optional[str] = None) -> dict:
    """Inductor config for a graph HOT compiles; ``other``: ``other_kernels``' answer for it.

    ``dynamic_scale_rblock=False`` unless ``TORCHINDUCTOR_DYNAMIC_SCALE_RBLOCK`` is set. Why:
    that heuristic compiles a halved-RBLOCK variant of a register-heavy reduction after
    loading it, but only when its tuned config is not in the autotune cache, which is the
    case in the first process that loads a graph from a warm cache, not in the cold one that
    compiled it. HOT's graphs have such reductions (by elimination, the RMSNorms that also
    centre the kept bf16 residual, ``passes/saved.py``), so the second process recompiled
    four Triton kernels on its first step: Llama d4096's first step with a warm cache took
    5.2-6.1 s against Inductor's 3.0-3.6 s (1.70-1.74x); without the scaling in HOT's graphs
    3.05 s against 2.76 (1.10x), at the same step time (H100, thirtieth stop).

    Unless ``TORCHINDUCTOR_STATIC_LAUNCH_USER_DEFINED_TRITON_KERNELS`` is set: a graph whose
    only user-defined kernels are HOT's gets ``static_launch_user_defined_triton_kernels``
    for the kernels compiled in this process (the workers' share is
    ``start_compile_workers``'s); a graph with other kernels (``other``), where the workers
    would launch them statically, gets no static launcher at all
    (``use_static_cuda_launcher=False``, which Inductor passes on to its workers): Triton's
    launchers, as before, for every kernel of that graph."""
    patches = {}
    if DYNAMIC_RBLOCK not in os.environ:
        patches["dynamic_scale_rblock"] = False
    if STATIC_USER_LAUNCH not in os.environ and _has_static_user_launch():
        if other is None:
            patches["static_launch_user_defined_triton_kernels"] = True
        elif _STATE["static_workers"] and hasattr(torch._inductor.config,
                                                  "use_static_cuda_launcher"):
            patches["use_static_cuda_launcher"] = False
    return patches


def _pool_started() -> bool:
    from torch._inductor.async_compile import AsyncCompile
    return AsyncCompile.process_pool.cache_info().currsize > 0


def start_compile_workers(static: bool = True) -> bool:
    """Start Inductor's compile workers now, as Inductor's own backend does when it is
    called (``maybe_warm_pool``), so that they start while AOTAutograd traces; with
    ``static`` (the graph's only user-defined kernels are HOT's), so that they launch
    user-defined kernels through Inductor's static launcher. Returns whether this process's
    workers do.

    Why the static launcher: Inductor launches its own kernels through it, but a user-defined
    kernel (every HOT kernel spliced into a graph) gets Triton's launcher unless
    ``static_launch_user_defined_triton_kernels`` is on, and Triton builds that launcher with
    the host C compiler, one per kernel signature, one after another in the compiling
    process. Llama d4096's cold first step built six (4.5 s of HOT's 28.3 s against
    Inductor's 21.3 s, H100, thirty-first stop). The workers read that setting from their
    environment when they start (Inductor passes them no other config), so it is set in the
    environment they start with, and only there: this process's environment is restored.

    The workers serve every graph the process compiles afterwards. A later HOT graph with
    kernels of its own (``other_kernels``) compiles without any static launch
    (``graph_patches``); a later graph compiled with plain Inductor does not pass through
    HOT, and its user-defined kernels get the static launcher from these workers
    (docs/DEBUGGING.md says when that is unsafe and how to opt out).
    Nothing changes where the workers are already running (something compiled before HOT's
    first graph) or where the user set the variable: their choice stands, and a kernel the
    static launcher cannot launch still gets Triton's (Inductor checks each kernel)."""
    from torch._inductor import config
    from torch._inductor.async_compile import maybe_warm_pool
    if STATIC_USER_LAUNCH in os.environ:
        maybe_warm_pool()
        _STATE["static_workers"] = os.environ[STATIC_USER_LAUNCH] == "1"
        return _STATE["static_workers"]
    if not static or _pool_started() or not _has_static_user_launch() or \
            config.worker_start_method != "subprocess":    # other pools start workers later
        maybe_warm_pool()
        return _STATE["static_workers"]
    os.environ[STATIC_USER_LAUNCH] = "1"
    try:
        maybe_warm_pool()
    finally:
        del os.environ[STATIC_USER_LAUNCH]
    _STATE["static_workers"] = _pool_started()
    log.debug("hotcompile: compile workers %s", "started with static launches of user "
              "kernels" if _STATE["static_workers"] else
              "not started (Inductor compiles in this process)")
    return _STATE["static_workers"]


# Inductor config for the backward of a graph whose kept activations are compressed. Why no
# peak-memory reorder: its estimate chose, for ViT-B with FP8 kept tensors in row blocks, an
# order that runs every restoration and weight-gradient GEMM after the whole g_x chain, each
# layer's GELU and qkv gradients (129 MiB a layer) alive until then: peak 4.12 GiB against
# 3.90 with the partitioner's layer-by-layer order (H100, docs/BENCHMARKS.md, 27th stop).
SAVED_BACKWARD_PATCHES = {"reorder_for_peak_memory": False}
