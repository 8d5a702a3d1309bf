"""The joint-graph pass: a linear site's two backward mms -> one hot::linear_backward.

(A site with only one of them, x or W needing no grad, gets hot::hq_grad_input or
hot::hla_grad_weight alone.)

Top to bottom: find sites (find.py) with their token layouts (tokens.py); check every
planned op against the fake tensors *before* touching the graph (a surprise becomes a
reported fallback, not a half-rewritten graph); group inputs by base tensor and compress
each group once (abc.py); replace the GEMMs (either backward layout autograd chose);
register the sites with the runtime tables; clean dead nodes so the partitioner no longer
sees X as needed by backward.

Ranks: a site whose token layout is unknown gets full rank on one flat token axis (an
orthogonal transform: no low-pass, so nothing depends on which rows are neighbours). A
known layout gets ``config.rank``, or with ``rank="auto"`` full rank plus a fidelity
measurement while calibrating (``plan is None``) and the planned rank afterwards.
"""
from __future__ import annotations

import operator
from typing import Dict, List, Optional, Set

import torch
from torch._dynamo.utils import dynamo_timed
from torch.fx import Graph, Node

from ..kernels.formats import e4m3_gx_fused
from ..runtime import rank as RANK
from ..runtime.lqs import TABLE as LQS
from . import cost
from .abc import compress_inputs, group_by_base, rebuild_chain, saved_format
from .find import LinearSite, find_linear_sites, is_forward
from .forward import forward_plan, gate_forward, rewrite_forward
from .grad_cast import fold_gw_cast
from .recompute import parameter_weight_chain, replay_without_cast
from .graph_utils import add_node, fake_mode_of, fake_run
from .splice import config_splices, refusal, splice_ops
from .weight_cast import castable_weight, own_weight_casts
from .tokens import AxisLabels

HQ_OP = torch.ops.hot.hq_grad_input.default
HLA_OP = torch.ops.hot.hla_grad_weight.default
UNIT_OP = torch.ops.hot.linear_backward.default
E4M3_GX_OP = torch.ops.hot.e4m3_gx_backward.default
SEEDS_OP = torch.ops.hot.draw_seeds.default
SEED_SPACING = 2        # int64 seeds per op: 16-byte-aligned elements (``_share_seeds``)
ABC_OP = torch.ops.hot.abc_compress.default
aten = torch.ops.aten


class RankPlan:
    """What rank each ABC group gets in this compile.

    ``chosen is None`` with ``config.rank == "auto"``: calibrating (full rank + measure)."""

    def __init__(self, config, prefix: str, chosen: Optional[Dict[str, int]] = None):
        self.config, self.prefix, self.chosen = config, prefix, chosen

    def key(self, group: str) -> str:
        return f"{self.prefix}/{group}"

    def for_group(self, lead: LinearSite):
        """(rank, layout-applies, measure key) for the group led by ``lead``."""
        block, lay = self.config.block, lead.layout
        if lay is None or not lay.known:
            return block, False, ""
        if not self.config.auto_rank:
            r = self.config.rank
        elif self.chosen is None:
            return block, True, self.key(lead.key)
        else:
            r = self.chosen.get(self.key(lead.key), block)
        return r, r < block, ""


def _seq_len_arg(graph: Graph, lay, anchor: Node, tag: str):
    """The sequence length as an op argument: an int, or a sym_size node under dynamic shapes."""
    if isinstance(lay.seq_len, int):
        return lay.seq_len
    size = lay.source.meta["val"].shape[lay.axis]
    return add_node(graph, aten.sym_size.int, (lay.source, lay.axis), before=anchor, tag=tag,
                    val=size)


def _precheck(site: LinearSite, config, fake_mode, rank: int, layered: bool) -> None:
    """Run the planned ops on fake tensors; on failure the site stays exact with the error."""
    try:
        if site.gw is not None:
            lay = site.layout
            s = (lay.seq_len if isinstance(lay.seq_len, int)
                 else lay.source.meta["val"].shape[lay.axis]) if layered else 0
            seq_first = layered and lay.seq_first
            fmt = saved_format(config, site.x, [site])
            xq, xs = fake_run(ABC_OP, (site.x, rank, config.gw_bits, config.block, s,
                                       seq_first, config.kernels, fmt), fake_mode)
            with fake_mode:
                gw = HLA_OP(site.grad.meta["val"], xq, xs, rank, config.gw_bits, config.block,
                            s, seq_first, "", config.kernels)
            want = tuple(site.gw.meta["val"].shape)
            if tuple(gw.shape) != (want[::-1] if site.gw_t else want):
                raise RuntimeError(f"g_W shape {tuple(gw.shape)} != {want}")
        if site.gx is not None:
            with fake_mode:
                w = site.wt.meta["val"].t()
                gx = HQ_OP(site.grad.meta["val"], w, config.gx_bits, config.gx_w_bits,
                           config.block, config.gx_scale, "", config.kernels)
            want = tuple(site.gx.meta["val"].shape)
            if tuple(gx.shape) != (want[::-1] if site.gx_t else want):
                raise RuntimeError("g_x shape mismatch")
    except Exception as e:  # noqa: BLE001 - any surprise means: leave the site exact
        site.reason = f"shape check failed: {type(e).__name__}: {e}"


def _cost_gate(sites: List[LinearSite], groups, config) -> List[LinearSite]:
    """Predict each eligible site's backward both ways (``passes/cost.py``) and leave it
    exact where HOT is not predicted to be ``config.min_speedup`` times faster. Returns the
    sites it left exact: their forward is gated on its own (``gate_forward``), so an FP8
    forward GEMM that pays is not lost with a backward that does not."""
    graphs = bool(torch._inductor.config.triton.cudagraphs)   # mode="reduce-overhead"
    size = {s.key: len(g) for g in groups.values() for s in g}
    # the g_W format is the group's (``abc.saved_format``: one saved x for all its sites, e4m3
    # only where every site's sizes suit cuBLAS's FP8 GEMM), so each site is priced on it
    gw_dims = {s.key: tuple(d for t in g for d in (t.I, t.O)) for g in groups.values() for s in g}
    # the exact backward reads W through the sites' g_x mms: where nothing else reads it,
    # a spliced HOT site will own autocast's cast (weight_cast.py), priced as the step runs it
    w_readers = {s.gx for s in sites if s.eligible and s.gx is not None}
    gated: List[LinearSite] = []
    rebuilt = set()             # recompute_operands: sites whose x backward rebuilds
    if config.recompute_operands:
        order = {n: i for i, n in enumerate(sites[0].fwd.graph.nodes)} if sites else {}
        for g in groups.values():
            if rebuild_chain(g, min(g, key=lambda s: order[s.fwd]).x, config):
                rebuilt.update(s.key for s in g)
    for s in sites:
        if not s.eligible:
            continue
        val = s.grad.meta.get("val") if s.grad is not None else None
        model = cost.model_for(val.device) if isinstance(val, torch.Tensor) else None
        dims = (s.L, s.I, s.O)       # ints, or text for sizes without a hint (report.hint)
        if model is None or not all(isinstance(d, int) for d in dims):
            dev = val.device.type if isinstance(val, torch.Tensor) else "?"
            s.cost = (None, None, f"not gated: no cost model for {dev}" if model is None
                      else "not gated: unknown sizes")
            continue
        rank = s.rank if isinstance(s.rank, int) else config.block
        share = 1.0 / size.get(s.key, 1)
        gx_gemm = cost.gx_gemm_kernel(config, val, s.I)
        gw_gemm = cost.gw_gemm_kernel(config, val, gw_dims.get(s.key, (s.I, s.O)))
        spliced = config_splices(config, s.fwd.meta.get("recompute"))
        w_owned = s.w_owned = (spliced and gx_gemm == "hq_cublas" and s.gx is not None
                               and s.gw is not None and s.w_chain is None
                               and castable_weight(s, w_readers))
        # ABC's e4m3 bound from a reduction of its own where no FP8 forward cast gives it
        x_bound = (s.gw is not None and gw_gemm == "hla_cublas"
                   and forward_plan(s, config, share)[0] == "bf16")
        price = lambda gx_e4m3: model.predict(  # noqa: E731
            *dims, rank, config.block, s.gx is not None, s.gw is not None, share, graphs,
            gx_gemm, gw_gemm, w_fp32=s.w_chain is not None, rebuild_x=s.key in rebuilt,
            gx_e4m3=gx_e4m3, spliced=spliced, w_owned=w_owned, x_bound=x_bound)
        mode = 'CUDA graphs' if graphs else 'default mode, host time included'
        fails = lambda e, h: config.min_speedup > 0 and e < config.min_speedup * h  # noqa: E731
        exact, hot = price(False)
        if s.gw is not None and _gx_on_fp8(s, config):
            # exact_gx_gemm="e4m3": the site priced with its FP8 g_x, against exact and
            # against its g_W alone beside the bf16 g_x GEMM; where either is predicted
            # faster, g_x stays exact (the refusal is read by _e4m3_gx_refusal)
            exact_e, hot_e = price(True)
            gw_alone = hot + model.kernel_ms("gx_bf16", *dims, rank, config.block)
            if fails(exact_e, hot_e):
                s.gx_e4m3_refusal = (f"cost gate: predicted backward {hot_e:.3f} ms with it vs "
                                     f"{exact_e:.3f} ms exact ({exact_e / hot_e:.2f}x < "
                                     f"min_speedup {config.min_speedup:g}; {mode})")
            elif config.min_speedup > 0 and gw_alone < hot_e:
                s.gx_e4m3_refusal = (f"cost gate: predicted backward {hot_e:.3f} ms with it vs "
                                     f"{gw_alone:.3f} ms with HOT's g_W alone ({mode})")
            else:
                exact, hot = exact_e, hot_e
        s.cost = (exact, hot, model.name)
        if fails(exact, hot):
            s.reason = (f"cost gate: predicted backward {hot:.3f} ms with HOT vs {exact:.3f} ms "
                        f"exact ({exact / hot:.2f}x < min_speedup {config.min_speedup:g}; "
                        f"{mode})")
            s.w_owned = False           # the exact backward reads autocast's W copy
            gated.append(s)
    return gated


def rewrite_joint_graph(graph: Graph, config, params: Optional[Set[Node]] = None,
                        plan: Optional[RankPlan] = None) -> List[LinearSite]:
    """The joint-graph pass. Mutates ``graph``; returns every site found, with verdicts."""
    plan = plan or RankPlan(config, "-")
    labels = AxisLabels(graph, is_forward)
    with dynamo_timed("hot.find_linear_sites"):
        sites = find_linear_sites(graph, config, params, labels)
    fake_mode = fake_mode_of(graph)
    if fake_mode is None:
        for s in sites:
            s.reason = s.reason or "graph has no fake tensors to check shapes against"
        return sites
    groups = group_by_base([s for s in sites if s.eligible])
    choice: Dict[str, tuple] = {}       # by every member: the gate may leave the first exact
    for group in groups.values():
        lead = group[0]
        rank, layered, measure = plan.for_group(lead)
        for s in group:
            choice[s.key] = (rank, layered, measure)
            s.layout = lead.layout
            _precheck(s, config, fake_mode, rank, layered)
            s.rank = rank
    for s in sites:
        if s.eligible and s.gw is None and s.gx is not None:
            _precheck(s, config, fake_mode, config.block, False)
    if config.recompute_operands:       # decided once: the gate prices it, the rewrite uses it
        for s in sites:
            if s.eligible:
                s.w_chain = parameter_weight_chain(s)
    gated = _cost_gate(sites, groups, config)
    todo = [s for s in sites if s.eligible]
    if not todo and not gated:
        return sites
    groups = {k: [s for s in g if s.eligible] for k, g in groups.items()}
    groups = {k: g for k, g in groups.items() if g}
    seq_args: Dict[str, tuple] = {}

    # a group keeps the name its first site gave it (``site.group``: its buffers, its x's
    # cast, its rank's key) when the cost gate leaves that site exact
    def layout_args(group, anchor, tag):
        rank, layered, _ = choice[group[0].key]
        lay = group[0].layout
        seq = _seq_len_arg(graph, lay, anchor, tag) if layered else 0
        seq_args[group[0].group] = (rank, seq, bool(layered and lay.seq_first))
        return seq_args[group[0].group]

    buffers = compress_inputs(graph, groups, config, fake_mode, layout_args,
                              lambda s: _gx_on_fp8(s, config))
    order = {n: i for i, n in enumerate(graph.nodes)}   # the original mms keep their order
    for group in groups.values():
        lead = group[0]
        rank, seq, seq_first = seq_args[lead.group]
        measure = choice[lead.key][2]
        xq, xs = buffers[lead.group]
        for s in group:
            hla_args = (s.grad, xq, xs, rank, config.gw_bits, config.block, seq, seq_first,
                        measure, config.kernels)
            why_not = _e4m3_gx_refusal(s, config) if s.gx is None else "HQ"
            if why_not is None:
                # exact_gx_gemm="e4m3": g_x on FP8 with g_W, one op for both
                anchor = min(s.gx_exact, s.gw, key=order.__getitem__)
                op = add_node(graph, E4M3_GX_OP, hla_args + (
                    _weight(graph, s, anchor, fake_mode, s.gx_exact),), before=anchor,
                    tag="is_backward", like=s.gw, fake_mode=fake_mode)
                s.rewritten_gw, s.gx_e4m3 = op, True
                gx, gw = (add_node(graph, operator.getitem, (op, i), before=anchor,
                                   tag="is_backward", like=s.gw, val=op.meta["val"][i])
                          for i in range(2))
                _replace(graph, s.gx_exact, gx, s.gx_t, fake_mode)
            elif s.gx is None:
                if s.gx_exact is not None and config.exact_gx_gemm == "e4m3":
                    s.gx_kept += f"; exact_gx_gemm='e4m3' not applied: {why_not}"
                gw = add_node(graph, HLA_OP, hla_args, before=s.gw, tag="is_backward",
                              like=s.gw, fake_mode=fake_mode)
                s.rewritten_gw = gw
            else:   # one op for the site's whole backward, before the first of its mms
                anchor = min(s.gx, s.gw, key=order.__getitem__)
                unit = add_node(graph, UNIT_OP, hla_args + (
                    _weight(graph, s, anchor, fake_mode), config.gx_bits, config.gx_w_bits,
                    config.gx_scale, plan.key(s.key)), before=anchor, tag="is_backward",
                    like=s.gw, fake_mode=fake_mode)
                s.rewritten_gx = s.rewritten_gw = unit
                gx, gw = (add_node(graph, operator.getitem, (unit, i), before=anchor,
                                   tag="is_backward", like=s.gw, val=unit.meta["val"][i])
                          for i in range(2))
                _replace(graph, s.gx, gx, s.gx_t, fake_mode)
            _replace(graph, s.gw, gw, s.gw_t, fake_mode)
    for s in todo:
        if s.gx is None or s.rewritten_gx is not None:
            continue
        key = plan.key(s.key)
        gx = add_node(graph, HQ_OP, (s.grad, _weight(graph, s, s.gx, fake_mode), config.gx_bits,
                                     config.gx_w_bits, config.block, config.gx_scale, key,
                                     config.kernels),
                      before=s.gx, tag="is_backward", like=s.gx, fake_mode=fake_mode)
        s.rewritten_gx = gx
        _replace(graph, s.gx, gx, s.gx_t, fake_mode)
    _share_seeds(graph, todo, fake_mode)
    # weight_cast needs each site's forward format; a site the cost gate kept exact gets its
    # forward gated alone (its backward reads x and autocast's W copy as before)
    gate_forward(todo + gated, config)
    for s in todo:
        for old in (s.gx, s.gw, s.gx_exact if s.gx_e4m3 else None):
            if old is not None and not old.users:
                graph.erase_node(old)
        if s.rewritten_gw is not None:
            s.gw_fp32 = fold_gw_cast(graph, s.rewritten_gw, fake_mode)
    casts = own_weight_casts(graph, todo, config.kernels, fake_mode,
                             lambda op: will_splice(op, config))
    producers = rewrite_forward(graph, todo + gated, config, fake_mode, buffers)
    with dynamo_timed("hot.splice"):    # its own line in a compile's timed phases
        _splice(graph, todo, buffers, config, fake_mode, casts + producers, gated)
    graph.eliminate_dead_code()
    graph.lint()
    register_runtime(config, registrations(sites))
    return sites


def will_splice(op: Node, config) -> bool:
    """Whether ``_splice`` will try to splice ``op`` (a trace can still fail: the op stays)."""
    return bool(config.splice) and refusal(op) is None


def _splice(graph: Graph, sites: List[LinearSite], buffers, config, fake_mode,
            casts: List[Node], forward_only: List[LinearSite] = ()) -> None:
    """With ``config.splice``: every HOT op's fused body into the graph (``splice.py``), so
    Inductor launches the kernels; each site records how its backward launches, and its ABC
    and W cast (``casts``: the forward's ``hot::weight_cast`` ops and producers' casts)
    where those differ. ``forward_only``: sites with an exact backward, whose one HOT op
    can be x's cast in its producer."""
    abc_ops = {k: v[0].args[0] for k, v in buffers.items()}
    w_casts = {id(s): s.w_cast for s in sites if s.w_cast is not None}
    nodes: List[Node] = list(casts)
    for s in sites:
        for n in (abc_ops.get(s.group), s.rewritten_gx, s.rewritten_gw):
            if n is not None and n not in nodes:
                nodes.append(n)
    how = splice_ops(graph, nodes, fake_mode) if config.splice else \
        {n: "hot:: op (splice=False)" for n in nodes}
    for s in sites:
        s.launch = how.get(s.rewritten_gx or s.rewritten_gw, "")
        comp = abc_ops.get(s.group)
        if comp is not None and how.get(comp) != s.launch:
            s.launch += f"; its ABC: {how.get(comp)}"
        cast = w_casts.get(id(s))
        if cast is not None and how.get(cast) != s.launch.split(";")[0]:
            s.launch += f"; its W cast: {how.get(cast)}"
    for s in (*sites, *forward_only):
        if s.x_cast is not None:
            s.x_cast_launch = how.get(s.x_cast, "")


def _share_seeds(graph: Graph, sites: List[LinearSite], fake_mode) -> None:
    """One ``hot::draw_seeds`` before the graph's first HOT backward op, each op reading its
    own element (``seeds``, ``seed_index``): one launch for the graph's random bits instead
    of a ``randint`` per op.

    Each op's element sits 16 bytes from the next (index ``SEED_SPACING * i``): a kernel
    given an 8-byte-aligned seed pointer compiles as a variant of one given a 16-byte-aligned
    one (Triton's divisibility hint), so with odd indices every other site would carry its own
    copy of each kernel, each loaded and given a launcher when a process starts."""
    ops: List[Node] = []
    for s in sites:
        for n in (s.rewritten_gx, s.rewritten_gw):
            if n is not None and n not in ops:
                ops.append(n)
    if not ops:
        return
    order = {n: i for i, n in enumerate(graph.nodes)}
    ops.sort(key=order.__getitem__)
    seeds = add_node(graph, SEEDS_OP, (ops[0].args[0], SEED_SPACING * len(ops)), before=ops[0],
                     tag="is_backward", like=ops[0], fake_mode=fake_mode)
    for i, n in enumerate(ops):
        n.args = tuple(n.args) + (seeds, SEED_SPACING * i)


def _weight(graph: Graph, s: LinearSite, before: Node, fake_mode,
            gx: Optional[Node] = None) -> Node:
    """W as (O, I) for the g_x op: the forward's (I, O) operand transposed back (a view),
    placed right before the op: the graph's own W for the g_x mm may come later than the
    site's first backward mm. With ``recompute_operands``, the fp32 parameter behind
    autocast's copy, the op rounding it as it reads (``passes/recompute.py``). ``gx``: the
    g_x mm it stands in for (default ``s.gx``)."""
    gx = gx or s.gx
    wt = replay_without_cast(graph, s.w_chain, before, gx, fake_mode) if s.w_chain else s.wt
    return add_node(graph, aten.permute.default, (wt, [1, 0]), before=before,
                    tag="is_backward", like=gx, fake_mode=fake_mode)


def _e4m3_gx_refusal(s: LinearSite, config) -> Optional[str]:
    """Why an exact_gx site's g_x does not go on FP8 (``exact_gx_gemm="e4m3"``), or None.
    On a GPU: where ``formats.e4m3_gx_fused`` holds (elsewhere the op would keep g_x
    exact, so the pass leaves the mm as it is and says why); on a CPU the reference twin
    computes it."""
    if config.exact_gx_gemm != "e4m3" or s.gx_exact is None:
        return "exact_gx_gemm='bf16', or not an exact_gx site"
    if s.gx_e4m3_refusal:
        return s.gx_e4m3_refusal
    g = s.grad.meta.get("val")
    if not isinstance(g, torch.Tensor):
        return "no fake value for g"
    if g.device.type != "cuda":
        return None
    if config.block != 16:
        return f"block={config.block} (the fused kernels take blocks of 16)"
    if not all(isinstance(d, int) for d in (s.O, s.I)):
        return "sizes vary (dynamic shapes)"
    if not e4m3_gx_fused(g.device, g.dtype, s.O, s.I):
        return "needs FP8 tensor cores, bf16 g, and O and I multiples of 16"
    return None


def _gx_on_fp8(s: LinearSite, config) -> bool:
    """Whether an exact_gx site's kept g_x goes on FP8 (``exact_gx_gemm="e4m3"``, nothing
    refusing it): the gate prices it, ABC is placed before its mm, the rewrite takes it."""
    return s.gx is None and _e4m3_gx_refusal(s, config) is None


def _replace(graph: Graph, old: Node, new: Node, transposed: bool, fake_mode) -> None:
    """Route ``old``'s users to ``new`` (transposed back where the graph's mm computed the
    transpose of the gradient)."""
    if transposed:
        new = add_node(graph, aten.permute.default, (new, [1, 0]), before=old,
                       tag="is_backward", like=old, fake_mode=fake_mode)
    old.replace_all_uses_with(new)


def registrations(sites: List[LinearSite]) -> Dict[str, List[str]]:
    """The run-time table entries the rewritten graph's ops look up: LQS keys of HQ sites,
    rank-measurement keys of calibrating HLA groups (stored with the compile-cache
    records, so a cache hit registers the same)."""
    lqs = [s.rewritten_gx.args[14 if s.rewritten_gx.target is UNIT_OP else 6]
           for s in sites if s.rewritten_gx is not None]
    rank = sorted({s.rewritten_gw.args[8] for s in sites
                   if s.rewritten_gw is not None and s.rewritten_gw.args[8]})
    return {"lqs": lqs, "rank": rank}


def register_runtime(config, regs: Dict[str, List[str]]) -> None:
    for key in regs.get("lqs", ()):
        LQS.register(key, config.lqs_calibration_steps, config.lqs_ratio,
                     config.lqs_recalibrate_every, config.lqs_file,
                     forced=None if config.gx_scale == "lqs" else config.gx_scale)
    for key in regs.get("rank", ()):
        RANK.register(key, config.block)

