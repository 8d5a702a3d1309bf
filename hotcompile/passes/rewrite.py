"""Rewrite each eligible linear's backward: g_x mm -> hot::hq_grad_input, g_W mm -> hot::hla_grad_weight.

The whole joint-graph pass is here, top to bottom: find sites (find.py), check every
planned op against the fake tensors *before* touching the graph (so a surprise becomes a
reported fallback, not a half-rewritten graph), compress the saved inputs (abc.py),
replace the GEMMs, register the sites with the LQS table, and clean dead nodes so the
partitioner no longer sees X as needed by backward.
"""
from __future__ import annotations

from typing import List

import torch
from torch.fx import Graph

from .abc import compress_inputs
from .find import LinearSite, find_linear_sites
from .graph_utils import add_node, fake_mode_of, fake_run
from .lqs import TABLE as LQS

HQ_OP = torch.ops.hot.hq_grad_input.default
HLA_OP = torch.ops.hot.hla_grad_weight.default
ABC_OP = torch.ops.hot.abc_compress.default


def _precheck(site: LinearSite, config, fake_mode) -> None:
    """Run the planned ops on fake tensors; on failure the site stays exact with the error."""
    try:
        xq, xs = fake_run(ABC_OP, (site.x, config.rank, config.hla_select, config.gw_bits,
                                   config.block, config.kernels), fake_mode)
        with fake_mode:
            gw = HLA_OP(site.grad.meta["val"], xq, xs, config.rank, config.hla_select,
                        config.gw_bits, config.block, config.kernels)
        want = tuple(site.gw.meta["val"].shape)
        if tuple(gw.shape) != (want[::-1] if site.w_in_out else want):
            raise RuntimeError(f"g_W shape {tuple(gw.shape)} != {tuple(site.gw.meta['val'].shape)}")
        if site.gx is not None:
            gx = fake_run(HQ_OP, (site.grad, site.gx.args[1], config.gx_bits, config.block,
                                  config.gx_scale, site.key, config.kernels), fake_mode)
            if tuple(gx.shape) != tuple(site.gx.meta["val"].shape):
                raise RuntimeError("g_x shape mismatch")
    except Exception as e:  # noqa: BLE001 - any surprise means: leave the site exact
        site.reason = f"shape check failed: {type(e).__name__}: {e}"


def rewrite_joint_graph(graph: Graph, config) -> List[LinearSite]:
    """The joint-graph pass. Mutates ``graph``; returns every site found, with verdicts."""
    sites = find_linear_sites(graph, config)
    fake_mode = fake_mode_of(graph)
    if fake_mode is None:
        for s in sites:
            s.reason = s.reason or "graph has no fake tensors to check shapes against"
        return sites
    for s in sites:
        if s.eligible:
            _precheck(s, config, fake_mode)
    todo = [s for s in sites if s.eligible]
    if not todo:
        return sites
    buffers = compress_inputs(graph, todo, config, fake_mode)
    for s in todo:
        xq, xs = buffers[s.x]
        gw = add_node(graph, HLA_OP, (s.grad, xq, xs, config.rank, config.hla_select,
                                      config.gw_bits, config.block, config.kernels),
                      before=s.gw, tag="is_backward", like=s.gw, fake_mode=fake_mode)
        s.rewritten_gw = gw
        if s.w_in_out:   # the graph wants g_W as (I, O)
            gw = add_node(graph, torch.ops.aten.permute.default, (gw, [1, 0]), before=s.gw,
                          tag="is_backward", like=s.gw, fake_mode=fake_mode)
        s.gw.replace_all_uses_with(gw)
        if s.gx is not None:
            gx = add_node(graph, HQ_OP, (s.grad, s.gx.args[1], config.gx_bits, config.block,
                                         config.gx_scale, s.key, config.kernels),
                          before=s.gx, tag="is_backward", like=s.gx, fake_mode=fake_mode)
            s.gx.replace_all_uses_with(gx)
            s.rewritten_gx = gx
            LQS.register(s.key, config.lqs_calibration_steps, config.lqs_ratio,
                         config.lqs_recalibrate_every, config.lqs_file,
                         forced=None if config.gx_scale == "lqs" else config.gx_scale)
    for s in todo:
        for old in (s.gx, s.gw):
            if old is not None and not old.users:
                graph.erase_node(old)
    graph.eliminate_dead_code()
    graph.lint()
    return sites
