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
- ``early_kernel_compiles()``: HOT's kernels go to the compile workers when Inductor's
  wrapper defines them, as Inductor's own kernels do, not when the compiled module loads.
"""
from __future__ import annotations

import ast
import contextlib
import logging
import os
from typing import Optional

import torch

from .scoped_patch import ScopedPatch

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


_MISSING = object()


def _kernel_source(body: str) -> Optional[tuple]:
    """``(name, source, device)`` of the ``async_compile.triton(name, '''source''',
    device_str=...)`` statement Inductor's wrapper writes for a kernel, as the compiled module
    will evaluate it when it loads, or None for anything else."""
    try:
        tree = ast.parse(body.strip())
    except SyntaxError:
        return None
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Expr):
        return None
    call = tree.body[0].value
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
            and call.func.attr == "triton" and len(call.args) == 2
            and all(isinstance(a, ast.Constant) and isinstance(a.value, str)
                    for a in call.args)):
        return None
    device = next((k.value.value for k in call.keywords if k.arg == "device_str"
                   and isinstance(k.value, ast.Constant)), "cuda")
    return call.args[0].value, call.args[1].value, device


def _submit_early(body: str) -> None:
    """Start compiling a kernel the wrapper just defined, if the workers are ready; the
    module's own ``async_compile.triton`` call then finds it by its source (a body read
    wrongly would only cost a compile nobody waits for)."""
    from torch._inductor.async_compile import AsyncCompile
    found = _kernel_source(body)
    if found is None or not AsyncCompile.use_process_pool():
        return
    name, source, device = found
    AsyncCompile().triton(name, source, device_str=device)


def early_kernel_compiles():
    """While the block runs, each user-defined Triton kernel (every HOT kernel spliced into a
    graph) that Inductor's Python wrapper defines is submitted to the compile workers at
    once, as Inductor's scheduler submits its own kernels when it generates them
    (``codegen/triton.py``, ``define_kernel``). Re-entrant; where this torch lays the wrapper
    out differently, or a kernel's definition cannot be read, nothing changes: the module
    compiles it when it loads, as before.

    Why: Inductor writes a user-defined kernel into the compiled module and compiles it only
    when the module is loaded, after the whole graph's code generation, so the slowest HOT
    kernel's compile (up to 2.5 s for an HLA variant, one CPU core) was waited on in full:
    in Llama d4096's cold first step the backward's device thread waited 2.4 s on compile
    futures and the forward's load 1.7 s, against Inductor's kernels compiling during code
    generation (H200, fortieth stop). The same source is compiled either way, by the same
    workers; only the start moves earlier."""
    try:
        from torch._inductor.codegen.wrapper import PythonWrapperCodegen
    except ImportError:  # pragma: no cover
        return contextlib.nullcontext()
    return _EARLY_PATCH.active(PythonWrapperCodegen)


def _submitting_early(original):
    """``define_user_defined_triton_kernel`` that also submits each kernel body the wrapper
    defines (``early_kernel_compiles``)."""
    def define_user_defined_triton_kernel(self, *args, **kwargs):
        define_kernel = getattr(self, "define_kernel", None)
        if define_kernel is None or _cpp_wrapper():     # a C++ wrapper embeds it
            return original(self, *args, **kwargs)      # otherwise
        defined = []

        def capture(*a, **k):
            body = k.get("kernel_body", a[1] if len(a) > 1 else None)
            if isinstance(body, str):
                defined.append(body)
            return define_kernel(*a, **k)

        try:
            before = vars(self).get("define_kernel", _MISSING)
            self.define_kernel = capture
        except (TypeError, AttributeError):     # no instance attributes: as is
            return original(self, *args, **kwargs)
        try:
            return original(self, *args, **kwargs)
        finally:
            if before is _MISSING:
                self.__dict__.pop("define_kernel", None)
            else:
                self.define_kernel = before
            for body in defined:
                try:
                    _submit_early(body)
                except Exception:  # noqa: BLE001 - the load compiles it
                    log.debug("hotcompile: early compile not submitted", exc_info=True)
    return define_user_defined_triton_kernel


_EARLY_PATCH = ScopedPatch("define_user_defined_triton_kernel", _submitting_early)


def _cpp_wrapper() -> bool:
    """Whether the graph being compiled gets a C++ wrapper (the config, or the graph's own)."""
    from torch._inductor import config
    if getattr(config, "cpp_wrapper", False):
        return True
    try:
        from torch._inductor.virtualized import V
        return bool(getattr(V.graph, "cpp_wrapper", False))
    except Exception:  # noqa: BLE001 - no graph being compiled: the config decides
        return False
