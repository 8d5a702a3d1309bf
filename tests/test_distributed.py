"""DDP and FSDP2 with backend="hot": two real processes, gloo, CPU (issue 6).

What is checked, per engine (DDP under compile, FSDP2 ``fully_shard`` compiled per block,
and parameters gathered *inside* the graph with functional collectives, SimpleFSDP-style):

* every linear of every graph the engine hands the backend is rewritten, on every rank, and
  the hot ops really run (their reference bodies are counted in the workers);
* no graph break beyond the engine's own: the Dynamo graph-break counters of the hot run are
  the same as those of the same run with ``backend="inductor"``;
* after a few SGD steps the parameter *updates* match the single-process run on the
  concatenated batch: to 1e-4 for Inductor (a control for the harness), and within
  ``TOL`` for hot (see below) — while hot differs from exact arithmetic far more than that;
* each rank draws different stochastic-rounding seeds (the documented recipe: re-seed
  with ``base + rank`` after the model is built; docs/DISTRIBUTED.md says why).

Tolerance. Per-rank token counts are multiples of 16, so HLA's 16-token blocks never
straddle the rank boundary: the low-rank projection of the concatenated batch is exactly
the stack of the per-rank projections (``test_hla_blocks_split_at_rank_boundaries``
checks that without quantization). What remains is quantization: 8-bit levels whose
per-tensor scales differ per rank (``amax`` over the rank's rows, not the whole batch),
and independent stochastic-rounding bits. Each run's g_W carries a relative error of
``eps ~ (amax/rms) / (127 sqrt 6) ~ 2 %``; two independent runs differ by ``~sqrt 2 eps``
(measured 2.4 %, ``test_hla_quantized_rank_sum_within_tolerance``). Through 3 steps of a
transformer block, the distributed-vs-single gap of the updates (worst tensor, qkv) is
0.034-0.039, the same as the gap between two single-process hot runs with different
seeds (0.035-0.039, measured). So ``TOL = 0.06``: 1.5x the seed-to-seed spread, relative
Frobenius error of each parameter's update ``theta_3 - theta_0``. gx_bits=8 and a forced
per-token HQ scale keep the g_x noise of the same order (at 4 bits it alone is 10-20 %,
and LQS could switch scales at different steps per rank). Hot vs exact updates differ by
0.63-0.68 (HLA's rank-8 approximation of white-noise tokens); the test asserts > 3x TOL,
so a run that silently fell back to exact arithmetic fails.

Each test spawns two processes (``torch.multiprocessing``, file rendezvous) that compile
once with Inductor and once with hot; the parent runs the single-process references.
"""
from __future__ import annotations

import collections
import os
import sys
import tempfile

import pytest
import torch
import torch.nn.functional as F

import hotcompile  # noqa: F401  registers torch.ops.hot.* (helpers needs them)
from helpers import Block

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(),
                                reason="torch.distributed is not available")

WORLD = 2
BATCH, SEQ = 2, 16              # per rank: 32 tokens, a multiple of HLA's 16-token block
STEPS, LR = 3, 0.2
TOL = 0.06
HOT_CFG = dict(rank=8, gx_bits=8, gx_scale="token", min_features=0, exclude=())


def hot_cfg(kind: str) -> dict:
    """rank=8 forced, so HLA's low-pass really acts (hot vs exact far above TOL). Not under
    DDP: its bucket split (bucket_cap_mb=1) leaves pieces without the attention that proves
    the token layout, so those pieces keep full rank while the single-process graph gets
    rank 8 (measured: fc1.weight differs by 0.96). Known limitation: layouts are not carried
    across graph pieces. DDP therefore runs the default (full rank) config."""
    return {k: v for k, v in HOT_CFG.items() if not (kind == "ddp" and k == "rank")}
HOT_SEED = 1234                 # HOT's rounding seeds: torch.manual_seed(HOT_SEED + rank)


# ----------------------------------------------------------------------- models and data
def make_model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "ddp":
        # 3.2 MB of parameters: DDPOptimizer splits the block at 1 MB buckets, so linears
        # get their input X as a placeholder (view of one) of a piece
        return Block(256)
    return torch.nn.Sequential(Block(64), Block(64))


def model_dim(kind: str) -> int:
    return 256 if kind == "ddp" else 64


def global_batch(kind: str):
    g = torch.Generator().manual_seed(42)
    d = model_dim(kind)
    x = torch.randn(WORLD * BATCH, SEQ, d, generator=g)
    y = torch.randn(WORLD * BATCH, SEQ, d, generator=g)
    return x, y


def train(model, step_fn_model, x, y, params=None, loss_scale=1.0, after_backward=None,
          steps=STEPS):
    """``steps`` of SGD on MSE; ``step_fn_model`` is what is called (compiled / wrapped)."""
    opt = torch.optim.SGD(params if params is not None else model.parameters(), lr=LR)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        (F.mse_loss(step_fn_model(x), y) * loss_scale).backward()
        if after_backward is not None:
            after_backward()
        opt.step()


class GatheredLinear(torch.nn.Module):
    """A linear whose weight/bias are dim-0 shards, all-gathered *inside* the graph."""

    def __init__(self, lin: torch.nn.Linear, group):
        super().__init__()
        import torch.distributed as dist
        w, r = dist.get_world_size(group), dist.get_rank(group)
        self.weight = torch.nn.Parameter(lin.weight.detach().chunk(w)[r].clone())
        self.bias = torch.nn.Parameter(lin.bias.detach().chunk(w)[r].clone())
        self.group = group

    def forward(self, x):
        from torch.distributed._functional_collectives import all_gather_tensor_autograd as ag
        return F.linear(x, ag(self.weight, 0, self.group), ag(self.bias, 0, self.group))


def gather_inside(model: torch.nn.Module, group) -> torch.nn.Module:
    for name, child in list(model.named_children()):
        if isinstance(child, torch.nn.Linear):
            setattr(model, name, GatheredLinear(child, group))
        else:
            gather_inside(child, group)
    return model


def full_state(model: torch.nn.Module, kind: str) -> dict:
    """Every parameter as a full tensor, named like the plain model's."""
    import torch.distributed as dist
    out = {}
    for name, p in model.named_parameters():
        name = name.replace("module.", "").replace("_orig_mod.", "")
        t = p.detach()
        if hasattr(t, "full_tensor"):                       # FSDP2 DTensor
            t = t.full_tensor()
        elif kind == "gathered" and isinstance(_owner(model, name), GatheredLinear):
            parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
            dist.all_gather(parts, t.contiguous())
            t = torch.cat(parts)
        out[name] = t.clone()
    return out


def _allreduce_replicated(model) -> None:
    import torch.distributed as dist
    for name, p in model.named_parameters():
        if not isinstance(_owner(model, name), GatheredLinear) and p.grad is not None:
            dist.all_reduce(p.grad)


def _owner(model, name):
    mod = model
    for part in name.split(".")[:-1]:
        mod = getattr(mod, part)
    return mod


def wrap_engine(model, kind: str, be):
    """(wrapped, callable, params) of ``model`` under the engine ``kind``, compiled with ``be``."""
    import torch.distributed as dist
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        wrapped = DDP(model, bucket_cap_mb=1)
        return wrapped, torch.compile(wrapped, backend=be), wrapped.parameters()
    if kind == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (WORLD,))
        for blk in model:
            fully_shard(blk, mesh=mesh)
            blk.compile(backend=be)
        wrapped = fully_shard(model, mesh=mesh)
        return wrapped, wrapped, model.parameters()
    wrapped = gather_inside(model, dist.group.WORLD)        # "gathered"
    return wrapped, torch.compile(wrapped, backend=be), wrapped.parameters()


# ----------------------------------------------------------------------- the worker
def _instrument(record: dict) -> None:
    """Count the hot ops' reference bodies (what the compiled graphs really call) and
    record the Philox seed each stochastic op drew, and each site's input X."""
    from hotcompile.kernels import reference as ref
    import hotcompile.passes.rewrite as rewrite

    def wrap(name, seed_pos):
        fn = getattr(ref, name)

        def counted(*args, **kwargs):
            record["calls"][name] += 1
            if seed_pos is not None:
                record["seeds"].append(int(kwargs.get("seed", args[seed_pos] if len(args) > seed_pos
                                                       else 0)))
            return fn(*args, **kwargs)
        setattr(ref, name, counted)
    wrap("hq_grad_input", 4)
    wrap("hla_grad_weight", 6)
    wrap("abc_compress", None)

    find = rewrite.find_linear_sites

    def logged(graph, config, *args, **kwargs):
        sites = find(graph, config, *args, **kwargs)
        for s in sites:
            x, kind = s.x, "computed"
            while x.op == "call_function" and x.target in (torch.ops.aten.view.default,
                                                           torch.ops.aten._unsafe_view.default):
                x = x.args[0]
            if x.op == "placeholder":
                kind = "placeholder" if x is s.x else "view(placeholder)"
            record["x_kinds"].append(kind)
        return sites
    rewrite.find_linear_sites = logged


def _save_and_exit(obj, rank: int, out_dir: str, timeout_s: float = 600.0) -> None:
    """Save this rank's result, wait until every rank has saved its own, then leave with
    ``os._exit(0)``.

    Why not return through ``destroy_process_group`` and interpreter shutdown: gloo's
    teardown is flaky on this 2-core machine. One rank was seen stuck in a futex after both
    result files were written, which hung CI. Another died with "terminate called without an
    active exception", a C++ thread destroyed at exit. A rank whose peers' files all exist
    knows that every collective finished on every rank (each rank saves after its last
    one), so nothing is left that needs a clean teardown."""
    import time
    path = os.path.join(out_dir, f"rank{rank}.pt")
    torch.save(obj, path + ".tmp")
    os.replace(path + ".tmp", path)                  # peers never see a partial file
    deadline = time.monotonic() + timeout_s
    while not all(os.path.exists(os.path.join(out_dir, f"rank{r}.pt")) for r in range(WORLD)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank}: peers did not finish within {timeout_s} s")
        time.sleep(0.05)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _worker(rank: int, kind: str, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist
    torch.set_num_threads(1)
    torch._inductor.config.compile_threads = 1     # no compile-worker pool per rank: 2 cores
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=WORLD)
    try:
        import hotcompile
        from torch._dynamo.utils import counters
        x, y = global_batch(kind)
        x, y = x[rank * BATCH:(rank + 1) * BATCH], y[rank * BATCH:(rank + 1) * BATCH]
        result = {}
        for name in ("inductor", "hot"):
            torch._dynamo.reset()
            counters.clear()
            record = {"calls": collections.Counter(), "seeds": [], "x_kinds": []}
            if name == "hot":
                _instrument(record)
                be = hotcompile.backend(hotcompile.HOTConfig(**hot_cfg(kind)))
            else:
                be = "inductor"
            model = make_model(kind)
            wrapped, run, params = wrap_engine(model, kind, be)
            scale, sync = 1.0, None
            if kind == "gathered":
                # the in-graph reduce-scatter sums shard grads: scale the loss by 1/world to
                # average; the replicated LayerNorm parameters are all-reduced by hand
                scale, sync = 1.0 / WORLD, lambda: _allreduce_replicated(wrapped)
            torch.manual_seed(HOT_SEED + rank)       # HOT's rounding seeds differ per rank
            train(model, run, x, y, params, scale, sync)
            result[name] = {
                "params": full_state(wrapped, kind),
                "graph_breaks": dict(counters["graph_break"]),
                "unique_graphs": counters["stats"]["unique_graphs"],
                **record,
            }
            if name == "hot":
                result[name]["report"] = [(r.graph, r.name, r.reason) for r in be.report.layers]
                result[name]["errors"] = list(be.report.errors)
        _save_and_exit(result, rank, out_dir)
    finally:                    # reached only on an error: report it with a normal teardown
        dist.destroy_process_group()


AUTO_CFG = dict(rank="auto", rank_calibration_start=1, rank_calibration_steps=1,
                gx_bits=8, min_features=0, exclude=())


def _auto_worker(rank: int, kind: str, init_file: str, out_dir: str) -> None:
    """rank="auto" under the engine: call 1 of each graph warms up, call 2 measures, call 3
    decides (all-reduced) and runs the recompiled graph. 6 steps: Dynamo may compile a
    DDP piece anew after the first step (a new graph counts its calls from 1)."""
    import torch.distributed as dist
    torch.set_num_threads(1)
    torch._inductor.config.compile_threads = 1
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=WORLD)
    try:
        import hotcompile
        x, y = global_batch(kind)
        # different data per rank: a rank-local decision would differ between ranks
        x = x[rank * BATCH:(rank + 1) * BATCH]
        y = y[rank * BATCH:(rank + 1) * BATCH]
        be = hotcompile.backend(hotcompile.HOTConfig(**AUTO_CFG))
        compiles = []
        orig = be._compile
        be._compile = lambda *a, **k: compiles.append(a[2]) or orig(*a, **k)
        model = make_model(kind)
        wrapped, run, params = wrap_engine(model, kind, be)
        torch.manual_seed(HOT_SEED + rank)
        train(model, run, x, y, params, steps=6)
        for r in be.report.layers:
            r.refresh_lqs()
        _save_and_exit({"compiles": compiles,
                        "report": [(r.graph, r.name, r.reason, r.rank, r.rank_errors)
                                   for r in be.report.layers],
                        "finite": all(bool(torch.isfinite(t).all())
                                      for t in full_state(wrapped, kind).values())},
                       rank, out_dir)
    finally:                    # reached only on an error: report it with a normal teardown
        dist.destroy_process_group()


def run_distributed(kind: str, worker=None) -> list:
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(worker or _worker, args=(kind, os.path.join(tmp, "rdzv"), tmp),
                           nprocs=WORLD, start_method="spawn")
        return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False)
                for r in range(WORLD)]


# ----------------------------------------------------------------------- the references
def single_process(kind: str, backend) -> dict:
    """The same steps in one process on the concatenated batch."""
    torch._dynamo.reset()
    model = make_model(kind)
    x, y = global_batch(kind)
    run = model if backend is None else torch.compile(model, backend=backend)
    train(model, run, x, y)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def updates(params: dict, init: dict) -> dict:
    return {n: params[n] - init[n] for n in init}


def rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def worst(a: dict, b: dict) -> tuple[float, str]:
    return max((rel(a[n], b[n]), n) for n in b)


def check_engine(kind: str, n_sites: int):
    import hotcompile
    results = run_distributed(kind)
    init = {n: p.detach().clone() for n, p in make_model(kind).named_parameters()}
    exact = updates(single_process(kind, None), init)
    hot_single = updates(single_process(kind, hotcompile.backend(
        hotcompile.HOTConfig(**hot_cfg(kind)))),
                         init)
    for rank, res in enumerate(results):
        ind, hot = res["inductor"], res["hot"]
        # the harness itself: the distributed Inductor run is the single-process run
        err, name = worst(updates(ind["params"], init), exact)
        assert err < 1e-4, (rank, name, err)
        # every linear of every graph rewritten, and the hot ops ran every step
        assert not hot["errors"], hot["errors"]
        # (identical blocks may share one compiled graph: the report then lists one block)
        assert {r[1].split(".")[-1] for r in hot["report"]} == {"qkv", "proj", "fc1", "fc2"}
        assert all(r[2] is None for r in hot["report"]), hot["report"]
        assert hot["calls"]["hla_grad_weight"] == n_sites * STEPS, hot["calls"]
        assert hot["calls"]["hq_grad_input"] == n_sites * STEPS, hot["calls"]
        assert hot["calls"]["abc_compress"] == n_sites * STEPS, hot["calls"]
        assert ind["calls"] == {}                         # instrumentation only in the hot run
        # no graph break beyond the engine's own
        assert hot["graph_breaks"] == ind["graph_breaks"], (hot["graph_breaks"],
                                                            ind["graph_breaks"])
        assert hot["unique_graphs"] == ind["unique_graphs"]
        # parameters: hot on 2 ranks == hot on the concatenated batch, within TOL
        got = updates(hot["params"], init)
        err, name = worst(got, hot_single)
        gap, _ = worst(hot_single, exact)
        print(f"{kind} rank {rank}: worst rel(update dist-hot, single-hot) = {err:.4f} ({name}); "
              f"hot vs exact = {gap:.3f}")
        assert err < TOL, (rank, name, err)
        # full rank (ddp): only 8-bit noise, measured 0.038; rank 8: 0.63-0.68
        assert gap > (0.02 if kind == "ddp" else 3 * TOL), gap
    # seeds: every rank drew its own
    s0, s1 = (set(r["hot"]["seeds"]) for r in results)
    assert s0 and s1 and not (s0 & s1)
    return results


@pytest.mark.slow      # 2 processes x 2 compiles: 55-95 s on the shared 2-core box
def test_ddp_hot_matches_single_process():
    results = check_engine("ddp", n_sites=4)
    for res in results:
        graphs = {r[0] for r in res["hot"]["report"]}
        assert len(graphs) > 1, "DDPOptimizer did not split the graph at bucket boundaries"
        # a linear's input arrived from another piece, as a placeholder
        assert any(k != "computed" for k in res["hot"]["x_kinds"]), res["hot"]["x_kinds"]


@pytest.mark.slow      # 2 processes x 2 compiles: 55-95 s on the shared 2-core box
def test_fsdp2_hot_matches_single_process():
    check_engine("fsdp", n_sites=8)


@pytest.mark.slow      # 2 processes x 2 compiles: 55-95 s on the shared 2-core box
def test_params_gathered_inside_graph_hot_matches_single_process():
    """SimpleFSDP-style: W = wait_tensor(all_gather_into_tensor(shard)) in the graph,
    g_W reduce-scattered in the graph after HLA."""
    check_engine("gathered", n_sites=8)


@pytest.mark.slow      # 2 processes x 2 engines' compiles
@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_auto_rank_decides_alike_on_every_rank(kind):
    """rank="auto" under DDP (graph pieces) and FSDP2 (per-block compile): every graph
    decides once, from measurements all-reduced over ranks (ranks see different data, so a
    local decision would differ), recompiles once, and training goes on finite."""
    r0, r1 = run_distributed(kind, _auto_worker)
    for res in (r0, r1):
        assert res["finite"]
        counts = collections.Counter(res["compiles"])
        assert res["report"] and all(r[2] is None for r in res["report"]), res["report"]
        measured = {r[0] for r in res["report"] if r[4]}
        # DDP pieces whose layout cannot be proven keep full rank and measure nothing
        assert measured and all(isinstance(r[3], int) and (r[4] or r[3] == 16)
                                for r in res["report"]), res["report"]
        # calibration + final compile for each measuring graph, one compile for the others
        assert all(counts[g] == (2 if g in measured else 1) for g in counts), (counts, measured)
    pick = lambda res: sorted((r[0], r[1], r[3], r[4] and round(r[4][1], 9))
                              for r in res["report"])
    assert pick(r0) == pick(r1)


@pytest.mark.parametrize("rank,select,per_rank,exact", [
    (8, "1d", 32, True), (8, "2d", 32, True), (6, "1d", 48, True),    # multiples of 16: always
    (8, "2d", 24, False), (6, "1d", 20, False), (8, "1d", 25, False),  # blocks straddle ranks
    (8, "1d", 24, True),      # 1d, r=8: the kept rows span pair-constant vectors (see docs)
])
def test_hla_blocks_split_at_rank_boundaries(rank, select, per_rank, exact):
    """Without quantization, per-rank HLA g_W summed over ranks is the concatenated batch's
    g_W exactly when per-rank token counts are multiples of the 16-token block (for 1d
    sequency order and rank 2^k, multiples of 16 / 2^k suffice); otherwise not."""
    from hotcompile.kernels import reference as ref
    torch.manual_seed(0)

    def hla(g, x):
        return ref.hla_grad_weight(g, ref.hla_project(x, rank, select), torch.ones(()), rank,
                                   select, bits=0)

    g, x = torch.randn(WORLD * per_rank, 24).double(), torch.randn(WORLD * per_rank, 40).double()
    whole = hla(g, x)
    parts = sum(hla(g[r * per_rank:(r + 1) * per_rank], x[r * per_rank:(r + 1) * per_rank])
                for r in range(WORLD))
    assert (rel(parts, whole) < 1e-5) == exact, rel(parts, whole)      # fp32 reference


def test_hla_quantized_rank_sum_within_tolerance():
    """With 8-bit levels (per-tensor scales per rank, independent rounding bits) the summed
    per-rank g_W differs from the concatenated batch's by a few percent: the basis of TOL."""
    from hotcompile.kernels import reference as ref
    torch.manual_seed(0)
    n = 256                                                   # tokens per rank

    def hla(g, x, seed):
        xq, xs = ref.abc_compress(x, 8)
        return ref.hla_grad_weight(g, xq, xs, 8, bits=8, seed=seed)

    errs = []
    for t in range(4):
        g, x = torch.randn(WORLD * n, 96), F.gelu(torch.randn(WORLD * n, 128))
        exact = ref.hla_grad_weight(g, ref.hla_project(x, 8), torch.ones(()), 8, bits=0)
        whole = hla(g, x, seed=100 + t)
        parts = sum(hla(g[r * n:(r + 1) * n], x[r * n:(r + 1) * n], seed=10 * t + r)
                    for r in range(WORLD))
        errs.append((rel(whole, exact), rel(parts, exact), rel(parts, whole)))
    e_whole, e_parts, gap = (max(e[i] for e in errs) for i in range(3))
    print(f"8-bit HLA error vs unquantized: one process {e_whole:.4f}, {WORLD} ranks {e_parts:.4f},"
          f" between them {gap:.4f}")
    assert e_parts < 0.03 and e_whole < 0.03 and gap < TOL / 2


def test_same_seeds_do_not_average_out():
    """Why each rank must draw its own rounding bits: with identical seeds the rounding
    errors of different ranks are correlated (same uniforms at the same positions) and
    their sum does not shrink like independent noise. 8 simulated ranks, HLA g_W."""
    from hotcompile.kernels import reference as ref
    torch.manual_seed(0)
    world, n = 8, 128

    def summed_error(same: bool) -> float:
        errs = []
        for t in range(6):
            gs = [torch.randn(n, 64) for _ in range(world)]
            xs = [F.gelu(torch.randn(n, 64)) for _ in range(world)]     # non-zero-mean x
            exact = sum(ref.hla_grad_weight(g, ref.hla_project(x, 8), torch.ones(()), 8, bits=0)
                        for g, x in zip(gs, xs))
            total = 0
            for r, (g, x) in enumerate(zip(gs, xs)):
                xq, xs_ = ref.abc_compress(x, 8)
                total = total + ref.hla_grad_weight(g, xq, xs_, 8, bits=8,
                                                    seed=1000 * t + (0 if same else r + 1))
            errs.append(rel(total, exact))
        return sum(errs) / len(errs)
    same, independent = summed_error(True), summed_error(False)
    print(f"summed 8-bit HLA error over {world} ranks: same seeds {same:.4f}, "
          f"per-rank seeds {independent:.4f}")
    assert same > 1.1 * independent, (same, independent)
