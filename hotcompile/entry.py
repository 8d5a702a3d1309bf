"""The torch.compile backend: AOTAutograd + Inductor, with HOT's joint-graph pass.

Why through ``compile_fx`` with ``joint_custom_pre_pass``: Inductor runs that hook inside
its partition function, on the joint forward+backward graph, before its own joint passes
and before the min-cut partitioner decides what the forward saves — exactly where the
backward GEMMs can be swapped and the saved input replaced by the compressed buffer.
``aot_module_simplified``'s keyword arguments differ between torch 2.11 and 2.13; this
entry point is the same on both.

The pass is a plain callable on purpose: Inductor then bypasses its FX/AOT caches for the
graph, so the pass (and its report, dumps and LQS registrations) runs on every compile.
"""
from __future__ import annotations

import itertools
import logging
import traceback
from typing import List, Optional

import torch

from .config import HOTConfig
from .debug.report import Report, record_site
from .kernels import ops as _ops  # noqa: F401  registers torch.ops.hot.*
from .passes.rewrite import rewrite_joint_graph

log = logging.getLogger("hotcompile")
_GRAPH_IDS = itertools.count()


class JointPass:
    """The callable handed to Inductor; records what it did into ``sink``."""

    def __init__(self, config: HOTConfig, sink: Report, graph_index: int):
        self.config, self.sink, self.graph_index = config, sink, graph_index

    def __call__(self, graph: torch.fx.Graph) -> None:
        before = str(graph) if self.config.dump_dir else None
        try:
            sites = rewrite_joint_graph(graph, self.config)
        except Exception as e:  # noqa: BLE001 - fall back, never crash the user's compile
            log.warning("hotcompile: joint-graph pass failed, graph %d left to Inductor: %s",
                        self.graph_index, e)
            log.debug("%s", traceback.format_exc())
            self.sink.errors.append(f"graph {self.graph_index}: {type(e).__name__}: {e}")
            if self.config.dump_dir:   # the failed graph still gets its joint dump
                from .debug.dump import dump_joint
                dump_joint(self.config, self.graph_index, before, graph, [], [])
            return
        records = [record_site(s, self.graph_index, self.config) for s in sites]
        self.sink.layers.extend(records)
        if self.config.dump_dir:
            from .debug.dump import dump_joint
            dump_joint(self.config, self.graph_index, before, graph, sites, records)


class HotBackend:
    """``torch.compile(model, backend=HotBackend(config))``; ``.report`` lists every site."""

    def __init__(self, config: Optional[HOTConfig] = None):
        self.config = config or HOTConfig()
        self.report = Report()
        self._check_kernels()

    def _check_kernels(self) -> None:
        if self.config.kernels == "triton":
            try:
                import triton  # noqa: F401
            except ImportError as e:
                raise ValueError("HOTConfig.kernels='triton' but triton is not importable") from e

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: List, **kwargs):
        from torch._inductor.compile_fx import compile_fx

        graph_index = next(_GRAPH_IDS)
        patches = {"joint_custom_pre_pass": JointPass(self.config, self.report, graph_index)}
        mode, options = kwargs.get("mode"), kwargs.get("options")
        if mode and mode != "default":
            patches.update(torch._inductor.list_mode_options(mode, kwargs.get("dynamic")))
        if options:
            patches.update(options)
        if self.config.dump_dir:
            from .debug.dump import fw_bw_dump_patches
            patches.update(fw_bw_dump_patches(self.config, graph_index))
        return compile_fx(gm, example_inputs, config_patches=patches)


def backend(config: Optional[HOTConfig] = None) -> HotBackend:
    """A backend for ``torch.compile`` with this configuration."""
    return HotBackend(config)


def hot(gm: torch.fx.GraphModule, example_inputs: List, **kwargs):
    """Entry point of ``backend="hot"`` (group ``torch_dynamo_backends``): default config."""
    return HotBackend()(gm, example_inputs, **kwargs)
