"""The torch.compile backend: AOTAutograd + Inductor, with HOT's joint-graph pass.

Why through ``compile_fx`` with ``joint_custom_pre_pass``: Inductor runs that hook inside
its partition function, on the joint forward+backward graph, before its own joint passes
and before the min-cut partitioner decides what the forward saves — exactly where the
backward GEMMs can be swapped and the saved input replaced by the compressed buffer.
``aot_module_simplified``'s keyword arguments differ between torch 2.11 and 2.13; this
entry point is the same on both.

The pass is a ``CustomGraphPass`` whose ``uuid()`` covers hotcompile's code and the
config, so Inductor's FX graph and AOTAutograd caches keep working: a second process
compiling the same model loads the compiled graphs instead of re-running the pass and
Inductor. A cache hit runs no pass, so each pass run stores its report records and
run-time registrations (``compile_cache``) and a hit loads them back. With ``dump_dir``
set the caches are off for hot's compiles: dumps are written by the pass itself.

Roles are proven here: the backend sees which example inputs are ``nn.Parameter``s and
hands the pass the matching joint-graph placeholders; only those can be a linear's weight.
Layers are named after the module the user compiled (``names.py``). A graph compiled
without grad (an eval forward) has no backward: its layers are listed apart, not counted.
With ``rank="auto"`` a graph is compiled to calibrate (full rank, measuring), and once its
window is measured, compiled once more with the chosen ranks (``_AutoRankGraph``).

Start-up: Inductor's ``compile_fx`` is imported with this module, as ``torch.compile``
imports it for Inductor's own backend when it is called (1.3 s on the H100 machine, which
would otherwise land in the first step); the compile workers start when the backend is
called, as Inductor's do. The few Inductor settings HOT's graphs compile with that plain
``torch.compile`` does not use, and why, are in ``inductor_settings.py``.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import logging
import traceback
import weakref
from typing import Callable, List, Optional, Set

import torch

from torch._dynamo.utils import dynamo_timed
from torch._inductor.compile_fx import compile_fx, compile_fx_inner
from torch._inductor.custom_graph_pass import CustomGraphPass, CustomPartitionerFn

from . import compile_cache
from .config import HOTConfig
from .debug.report import Report, SiteRecord, record_site
from .inductor_settings import (SAVED_BACKWARD_PATCHES, early_kernel_compiles, graph_patches,
                                other_kernels, start_compile_workers)
from .kernel_nodes import traceless_kernel_decomposition
from .kernels import ops as _ops  # noqa: F401  registers torch.ops.hot.*
from .names import (SharedGraphNames, alias_records, compiled_root, naming_of, param_slots,
                    source_name)
from .passes.find import Naming, ParamSet, find_linear_sites
from .passes.kernel_access import memoized_kernel_access
from .passes.rewrite import RankPlan, register_runtime, registrations, rewrite_joint_graph
from .passes.saved import compress_saved
from .runtime import rank as RANK

log = logging.getLogger("hotcompile")
_GRAPH_IDS = itertools.count()
_BACKEND_IDS = itertools.count()


def _is_parameter(value, node: Optional[torch.fx.Node]) -> bool:
    """Whether a Dynamo graph input is a parameter of the compiled module."""
    if isinstance(value, torch.nn.Parameter):
        return True
    name = source_name(node)
    if isinstance(name, str) and "_parameters" in name:
        return True
    # graphs Dynamo split itself (DDP buckets) keep its names for lifted parameters
    return node is not None and "_parameters_" in str(node.target)


def parameter_positions(gm: torch.fx.GraphModule, example_inputs: List) -> Set[int]:
    """Positions among the joint graph's primals that hold parameters.

    AOTAutograd lifts the GraphModule's own parameters and buffers first, then the
    example inputs in order (checked on torch 2.11 and 2.13)."""
    own_params = len(dict(gm.named_parameters(remove_duplicate=False)))
    lifted = own_params + len(dict(gm.named_buffers(remove_duplicate=False)))
    nodes = [n for n in gm.graph.nodes if n.op == "placeholder"]
    pos = set(range(own_params))
    for i, v in enumerate(example_inputs):
        if _is_parameter(v, nodes[i] if i < len(nodes) else None):
            pos.add(lifted + i)
    return pos


INFERENCE = "inference graph (compiled without grad): no backward to rewrite"


def is_inference(graph: torch.fx.Graph) -> bool:
    """A graph Inductor compiles for a forward without grad (``torch.no_grad()``, eval,
    inputs and weights needing no grad): no tangents and no backward node. Inductor runs
    the joint passes on it too."""
    for n in graph.nodes:
        if n.op == "placeholder" and "tangents" in n.name:
            return False
        if n.meta.get("partitioner_tag") == "is_backward":
            return False
    return True


class JointPass(CustomGraphPass):
    """The joint-graph pass handed to Inductor; records what it did into ``sink``.

    ``uuid()`` covers everything the rewritten graph depends on besides the graph itself:
    the package's code, the config (its dump folder aside), which inputs are parameters
    and their names, the runtime-key prefix and the chosen ranks. ``store_key`` names where the records of
    this run are kept for cache hits (``compile_cache``)."""

    def __init__(self, config: HOTConfig, sink: Report, graph_index: int,
                 param_positions: Optional[Set[int]] = None, plan: Optional[RankPlan] = None,
                 store_key: Optional[str] = None, naming: Optional[Naming] = None):
        self.config, self.sink, self.graph_index = config, sink, graph_index
        self.param_positions, self.plan = param_positions, plan
        self.naming = naming or Naming()
        self.store_key = store_key
        self.sites: List = []
        self.records: List[SiteRecord] = []
        self.ran = False
        self.failed = False
        self.regs: dict = {"lqs": [], "rank": []}

    def uuid(self) -> str:
        cfg = {k: v for k, v in self.config.to_dict().items() if k != "dump_dir"}
        plan = (self.plan.prefix, sorted((self.plan.chosen or {}).items())) if self.plan else None
        return compile_cache.code_hash() + "-" + repr(
            (sorted(cfg.items(), key=str), sorted(self.param_positions or ()), plan,
             self.naming))

    def _params(self, graph: torch.fx.Graph):
        if self.param_positions is None:
            return None
        primals = [n for n in graph.nodes if n.op == "placeholder" and "tangents" not in n.name]
        at = dict(enumerate(primals))
        names = {at[i]: fqns for i, fqns in self.naming.params if i in at}
        buffers = {at[i]: name for i, name in self.naming.buffers if i in at}
        frozen = {at[i] for i in self.naming.frozen if i in at}
        return ParamSet((at[i] for i in self.param_positions if i in at), names, self.naming,
                        buffers, frozen)

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.ran = True
        before = str(graph) if self.config.dump_dir else None
        inference = is_inference(graph)
        try:
            if inference:       # no backward: list the layers, change nothing
                sites = find_linear_sites(graph, self.config, self._params(graph))
                for s in sites:
                    s.reason = INFERENCE
            else:
                sites = rewrite_joint_graph(graph, self.config, self._params(graph), self.plan)
        except Exception as e:  # noqa: BLE001 - fall back, never crash the user's compile
            log.warning("hotcompile: joint-graph pass failed, graph %d left to Inductor: %s",
                        self.graph_index, e)
            log.debug("%s", traceback.format_exc())
            self.sink.errors.append(f"graph {self.graph_index}: {type(e).__name__}: {e}")
            self.failed = True
            if self.config.dump_dir:   # the failed graph still gets its joint dump
                from .debug.dump import dump_joint
                dump_joint(self.config, self.graph_index, before, graph, [], [])
            return
        self.sites = sites
        self.regs = registrations(sites)
        records = [record_site(s, self.graph_index, self.config, self.plan) for s in sites]
        for r in records:
            r.inference = inference
        self.records = records
        self._publish(records)
        if self.store_key:
            compile_cache.save(self.store_key, records, self.regs)
        if self.config.dump_dir:
            from .debug.dump import dump_joint
            dump_joint(self.config, self.graph_index, before, graph, sites, records)

    def _publish(self, records: List[SiteRecord]) -> None:
        self.sink.layers[:] = [r for r in self.sink.layers if r.graph != self.graph_index]
        self.sink.layers.extend(records)
        log_summary(self.graph_index, records)

    def restore(self) -> bool:
        """After a compile that did not run the pass (a cache hit): the stored records into
        the report and the stored registrations into the run-time tables."""
        payload = compile_cache.load(self.store_key) if self.store_key else None
        if payload is None:
            return False
        self.regs = payload["registrations"]
        register_runtime(self.config, self.regs)
        if payload.get("saved"):
            self.sink.saved[self.graph_index] = payload["saved"]
        fields = {f.name for f in dataclasses.fields(SiteRecord)}
        records = [SiteRecord(graph=self.graph_index, **{k: v for k, v in d.items() if k in fields})
                   for d in payload["records"]]
        for r in records:
            r.refresh_lqs()
        self._publish(records)
        return True


class SavedPartitioner(CustomPartitionerFn):
    """Inductor's min-cut partition, then FP8 / bf16 for the activations it keeps
    (``saved_activations``, ``passes/saved.py``): installed as Inductor's
    ``custom_partitioner_fn``, which runs after the joint passes, HOT's included.

    ``uuid()`` is the joint pass's: the same code and config decide both. The summary goes
    to the report and, with the joint pass's records, to hotcompile's store for cache hits.
    A failure in the rewrite leaves Inductor's own partition (computed again: the first
    one may be half rewritten)."""

    def __init__(self, joint: "JointPass"):
        self.joint = joint

    def uuid(self) -> str:
        return "saved-fp8-" + self.joint.uuid()

    # Inductor deep-copies and pickles its config for cache keys, this field included
    # (2.13 lists it in neither of its ignore lists): a copy is this object, a pickle its
    # uuid (the joint pass it reports to holds graph nodes, which do neither)
    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        return str, (self.uuid(),)

    def __call__(self, gm: torch.fx.GraphModule, joint_inputs, **kwargs):
        from torch._functorch.partitioners import min_cut_rematerialization_partition
        joint = self.joint
        primals = [n for n in gm.graph.find_nodes(op="placeholder") if "tangents" not in n.name]
        params = {primals[i].name for i in joint.param_positions or () if i < len(primals)}
        fw, bw = min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)
        if not joint_inputs or not joint.ran or joint.failed:
            # a higher-order op's subgraph, partitioned on its own (AOTAutograd passes it no
            # joint inputs): its placeholders are not the joint graph's, so which of them
            # are parameters is unknown here; kept as Inductor partitioned it. A graph whose
            # HOT pass failed is compiled as Inductor would, its kept tensors included.
            return fw, bw
        try:
            with dynamo_timed("hot.compress_saved"):
                summary = compress_saved(fw, bw, kwargs["num_fwd_outputs"], params,
                                         joint.config.saved_activations).to_dict()
        except Exception as e:  # noqa: BLE001 - fall back to Inductor's partition, never crash
            log.warning("hotcompile: graph %d: saved activations kept exact: %s",
                        joint.graph_index, e)
            log.debug("%s", traceback.format_exc())
            joint.sink.errors.append(f"graph {joint.graph_index}: saved activations: "
                                     f"{type(e).__name__}: {e}")
            return min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)
        joint.sink.saved[joint.graph_index] = summary
        if joint.store_key and not joint.failed:    # a failed pass stores nothing (as before)
            compile_cache.save(joint.store_key, joint.records, joint.regs, saved=summary)
        return fw, bw


def _short(reason: str) -> str:
    """A reason's head, without its details and numbers, to count alike reasons together."""
    return reason.split(":")[0].split(" (")[0]


def log_summary(graph_index: int, records: List[SiteRecord]) -> None:
    """One line per compiled graph: INFO when layers were rewritten (or took the FP8 forward
    alone), WARNING when a graph with linear layers got nothing (``backend="hot"`` would
    otherwise do nothing silently)."""
    if not records:
        return
    if all(r.inference for r in records):
        log.info("hot: graph %d: inference graph (compiled without grad): %d linear layers, "
                 "not rewritten: no backward", graph_index, len(records))
        return
    done = sum(r.rewritten for r in records)
    alone = sum(not r.rewritten and r.forward != "bf16" for r in records)
    why = collections.Counter(_short(r.reason) for r in records if not r.rewritten)
    exact = ", ".join(f"{n} {w}" for w, n in why.most_common(3))
    msg = (f"hot: graph {graph_index}: {done}/{len(records)} linear layers rewritten"
           + (f" ({len(records) - done} exact: {exact})" if why else "")
           + (f"; {alone} of the exact with the FP8 forward alone" if alone else ""))
    log.log(logging.INFO if done or alone else logging.WARNING, msg)


class HotBackend:
    """``torch.compile(model, backend=HotBackend(config))``; ``.report`` lists every site.

    Layers are named after ``root``, the module the user compiled (as in its
    ``named_modules()``): given here, or found on the stack at each compile
    (``compiled_root``); with neither (a compiled function), as Dynamo names them."""

    def __init__(self, config: Optional[HOTConfig] = None,
                 root: Optional[torch.nn.Module] = None):
        self.config = config or HOTConfig()
        self.report = Report()
        self.id = next(_BACKEND_IDS)
        self._root = weakref.ref(root) if root is not None else None

    def root(self) -> Optional[torch.nn.Module]:
        if self._root is not None:
            return self._root()
        try:
            return compiled_root()
        except Exception:  # noqa: BLE001 - no root: names as Dynamo gives them
            return None

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: List, **kwargs):
        graph_index = next(_GRAPH_IDS)
        other = other_kernels(gm)
        if _device_of(example_inputs).type == "cuda":
            start_compile_workers(static=other is None)
        positions = parameter_positions(gm, example_inputs)
        root = self.root()
        try:
            naming = naming_of(gm, example_inputs, positions, root)
        except Exception as e:  # noqa: BLE001 - names are a report matter: never fail here
            log.debug("hotcompile: graph %d: layer names relative to the frame: %s",
                      graph_index, e)
            root, naming = None, naming_of(gm, example_inputs, positions, None)
        plan = RankPlan(self.config, f"{self.id}/{graph_index}")
        compiled, joint = self._compile(gm, example_inputs, graph_index, positions, plan, kwargs,
                                        naming, other)
        groups = list(joint.regs.get("rank", ()))
        if groups:
            compiled = _AutoRankGraph(self, gm, graph_index, positions, kwargs, compiled, groups,
                                      naming)
        return self._watch_reuse(gm, example_inputs, graph_index, positions, naming, root,
                                 compiled)

    def _watch_reuse(self, gm, example_inputs, graph_index, positions, naming, root, compiled):
        """A graph compiled in a child module's frame: Dynamo may run it for the child's
        siblings too; ``SharedGraphNames`` reports them under their own names."""
        if root is None or not any(p for _, p in naming.prefixes) or not any(
                r.graph == graph_index for r in self.report.layers):
            return compiled
        try:
            _, slots = param_slots(gm, positions)
            return SharedGraphNames(self, graph_index, compiled, slots, naming, root,
                                    example_inputs)
        except Exception as e:  # noqa: BLE001 - reporting only: run the graph unwatched
            log.debug("hotcompile: graph %d not watched for reuse: %s", graph_index, e)
            return compiled

    def add_aliases(self, graph_index: int, moves: dict) -> None:
        """Rows for the modules that run graph ``graph_index`` compiled for another
        (``moves``: the frame's prefix at compile time -> the one it runs with now)."""
        mine = [r for r in self.report.layers if r.graph == graph_index and not r.compiled_for]
        known = {r.key for r in self.report.layers if r.graph == graph_index}
        new, notes = alias_records(mine, moves, self.config)
        new = [r for r in new if r.key not in known]
        if not new:
            return
        self.report.layers.extend(new)
        self.report.notes.extend(notes)
        for n in notes:
            log.warning("hot: %s", n)
        done = sum(r.rewritten for r in new)
        log.info("hot: graph %d also runs %s (Dynamo reuses the graph compiled for %s): "
                 "%d/%d linear layers rewritten", graph_index, ", ".join(moves.values()),
                 ", ".join(moves), done, len(new))
        if self.config.dump_dir:
            from .debug.dump import add_records
            add_records(self.config, graph_index, new)

    def _compile(self, gm, example_inputs, graph_index, positions, plan, kwargs, naming=None,
                 other=None):
        joint = JointPass(self.config, self.report, graph_index, positions, plan, naming=naming)
        joint.store_key = compile_cache.graph_key(gm, example_inputs, joint.uuid())
        patches = {"joint_custom_pre_pass": joint, **graph_patches(other)}
        if "use_static_cuda_launcher" in patches:          # only for a graph with `other`
            log.info("hotcompile: graph %d compiles with Triton's own kernel launchers: %s",
                     graph_index, other)
        if self.config.saved_activations != "exact":
            patches["custom_partitioner_fn"] = SavedPartitioner(joint)
        mode, options = kwargs.get("mode"), kwargs.get("options")
        if mode and mode != "default":
            patches.update(torch._inductor.list_mode_options(mode, kwargs.get("dynamic")))
        if options:
            patches.update(options)
        caches = True
        if self.config.dump_dir:
            from .debug.dump import fw_bw_dump_patches
            patches.update(fw_bw_dump_patches(self.config, graph_index))
            patches["fx_graph_cache"] = caches = False      # dumps come from the pass itself
        with torch._functorch.config.patch(enable_autograd_cache=caches
                                           and torch._functorch.config.enable_autograd_cache), \
                memoized_kernel_access():
            inner = _inner_compile
            if self.config.saved_activations != "exact":
                inner = functools.partial(
                    _inner_compile,
                    backward_patches=lambda: SAVED_BACKWARD_PATCHES
                    if _rows_restored(self.report.saved.get(graph_index)) else None)
            compiled = compile_fx(gm, example_inputs, inner_compile=inner,
                                  config_patches=patches)
        if not joint.ran and not joint.restore():
            msg = (f"graph {graph_index}: served from Inductor's cache, but its site records "
                   "were not found in hotcompile's store; the report omits its layers")
            log.warning("hotcompile: %s", msg)
            self.report.notes.append(msg)
        return compiled, joint


def _rows_restored(summary: Optional[dict]) -> bool:
    """Whether a graph's backward restores e4m3 rows (or rebuilds from them): then it is
    compiled with ``SAVED_BACKWARD_PATCHES``. Not for bf16 copies alone (``"auto"``'s and
    ``"bf16"``'s, whose restoration is a cast Inductor fuses into the reader): ViT-B's peak
    with them is 4.897 GiB with Inductor's reorder and without (H100, 26th-28th stops), and
    an fp32 graph under ``"auto"`` is not rewritten at all."""
    formats = (summary or {}).get("formats") or {}
    return any(f != "bf16" for f in formats)


def _inner_compile(*args, backward_patches: Optional[Callable[[], Optional[dict]]] = None,
                   **kwargs):
    """Inductor's per-graph compile inside the launch-analysis memo (``kernel_access``), the
    backward with ``backward_patches()`` to Inductor's config (asked when the backward is
    compiled: after the partition, which decides whether it applies).

    Why here and not only around ``compile_fx``: AOTAutograd compiles the backward lazily,
    on its first call, outside the backend's scope (Inductor wraps this same function to
    keep its config patches there). Unmemoized, lowering the backward re-analyses every HOT
    launch in it (Triton's mutation analysis took 4.4 s of Llama d4096's cold first step on
    the H100, the splicing pass's memoized share included). HOT's kernels are also sent to
    the compile workers as the wrapper defines them (``early_kernel_compiles``), and the
    kernel nodes that clone nothing are decomposed without a trace each
    (``traceless_kernel_decomposition``)."""
    patches = (backward_patches() if backward_patches and kwargs.get("is_backward") else None) or {}
    with memoized_kernel_access(), early_kernel_compiles(), traceless_kernel_decomposition(), \
            torch._inductor.config.patch(patches):
        return compile_fx_inner(*args, **kwargs)


def _symbolic(gm: torch.fx.GraphModule) -> bool:
    for n in gm.graph.nodes:
        v = n.meta.get("example_value", n.meta.get("val"))
        if isinstance(v, torch.SymInt) or (isinstance(v, torch.Tensor) and any(
                not isinstance(d, int) for d in v.shape)):
            return True
    return False


class _AutoRankGraph:
    """A compiled graph whose HLA ranks are still being measured (``rank="auto"``).

    Runs the calibration compile (full rank) for ``rank_calibration_start`` calls, opens
    the measuring window for the next ``rank_calibration_steps``; at the next call reads
    the measurements once (``runtime.rank.decide``), compiles
    the graph once more with the chosen ranks and runs that from then on. Graphs with
    symbolic shapes keep full rank: a recompile outside Dynamo would specialise them.
    """

    def __init__(self, backend, gm, graph_index, positions, kwargs, compiled, groups,
                 naming=None):
        self.backend, self.gm, self.graph_index, self.naming = backend, gm, graph_index, naming
        self.positions, self.kwargs, self.compiled, self.groups = positions, kwargs, compiled, groups
        self.calls, self.pending = 0, True
        self._boxed_call = getattr(compiled, "_boxed_call", False)

    def __call__(self, *a):
        # DDPOptimizer runs each compiled piece on fake tensors while compiling the next:
        # that is not a training step
        if self.pending and not _fake(a):
            self.calls += 1
            cfg = self.backend.config
            if self.calls == 1:
                RANK.prepare(self.groups, _device_of(a))
            if self.calls == cfg.rank_calibration_start + 1:
                RANK.open_window(self.groups)
            elif self.calls > cfg.rank_calibration_start + cfg.rank_calibration_steps:
                chosen = RANK.decide(self.groups, cfg.rank_tolerance, cfg.rank_calibration_steps)
                if chosen is not None:
                    self.pending = False
                    if _symbolic(self.gm):
                        log.info("hotcompile: graph %d has dynamic shapes: auto rank kept full "
                                 "rank (measured: %s)", self.graph_index, chosen)
                        self.backend.report.notes.append(
                            f"graph {self.graph_index}: rank='auto' with dynamic shapes keeps "
                            "full rank")
                    else:
                        args = _flat(a)
                        plan = RankPlan(cfg, f"{self.backend.id}/{self.graph_index}", chosen)
                        self.compiled, _ = self.backend._compile(
                            self.gm, args, self.graph_index, self.positions, plan, self.kwargs,
                            self.naming, other_kernels(self.gm))
                        self._boxed_call = getattr(self.compiled, "_boxed_call", False)
                        del args
        return self.compiled(*a)


def _flat(args) -> list:
    """A compiled graph's arguments, boxed (one list) or not."""
    return list(args[0] if len(args) == 1 and isinstance(args[0], list) else args)


def _fake(args) -> bool:
    from torch._guards import detect_fake_mode
    return detect_fake_mode(_flat(args)) is not None


def _device_of(args) -> torch.device:
    return next((t.device for t in _flat(args) if isinstance(t, torch.Tensor)),
                torch.device("cpu"))


def backend(config: Optional[HOTConfig] = None) -> HotBackend:
    """A backend for ``torch.compile`` with this configuration."""
    return HotBackend(config)


_HOT_REPORT = Report()


def hot_report() -> Report:
    """The report of every graph compiled with ``backend="hot"`` in this process."""
    return _HOT_REPORT


def hot(gm: torch.fx.GraphModule, example_inputs: List, **kwargs):
    """Entry point of ``backend="hot"`` (group ``torch_dynamo_backends``): default config;
    what it did goes to ``hot_report()``."""
    be = HotBackend()
    be.report = _HOT_REPORT
    return be(gm, example_inputs, **kwargs)
