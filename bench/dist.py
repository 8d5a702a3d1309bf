"""Multi-GPU training with backend="hot": DDP and FSDP2, bf16 Inductor vs hot, per rank.

    torchrun --nproc_per_node 2 bench/dist.py --out $OUT              # the 2-GPU run
    python -m torch.distributed.run --nproc_per_node 2 bench/dist.py --out $OUT   # same
    torchrun --nproc_per_node 2 bench/dist.py --tiny --out /tmp/r     # CPU smoke (gloo)
    python bench/dist.py --tiny                                        # one process, no torchrun

One launch runs every (engine, backend) pair in turn in the same process group: engines
``ddp`` (``torch.compile(DDP(model))``: Dynamo's DDPOptimizer splits the graph at bucket
boundaries and the backend compiles each piece) and ``fsdp`` (FSDP2 ``fully_shard`` per
block and on the root, each block compiled: the recipe FSDP2 documents; its hooks are never
traced on torch 2.13, so parameters are all-gathered outside the compiled graphs); backends
``inductor`` (the honest baseline) and ``hot`` (``HOTConfig`` defaults, ``head`` exact).

Model: a GPT (common.GPT: learned positions, pre-norm, GELU MLP) with ``--layers`` blocks,
``--width`` 2048, ``--seq`` 2048, ``--batch`` sequences per rank. Precision: DDP keeps fp32
parameters under bf16 autocast; FSDP2 uses ``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)`` (the usual setup of each). A step is forward + cross-entropy +
backward (gradient all-reduce / reduce-scatter included) + AdamW.

Per rank: median step time over ``--steps`` timed steps after ``--warmup`` (compile and LQS
calibration), tokens/s, peak allocated and reserved CUDA memory over the timed steps
(peak RSS on CPU), compile time (first step minus median), what hot rewrote. Rank 0 writes
``<out>/dist_<date>_<device>.{json,md}`` after every pair (a run cut short keeps what it
finished). CUDA uses NCCL with ``NCCL_NVLS_ENABLE=0`` (NVLink multicast off); CPU uses gloo.

HOT's stochastic-rounding seeds: each rank re-seeds its generators with ``--seed + rank``
after the model is built and sharded, so rounding noise is independent across ranks
(docs/DISTRIBUTED.md says why). Per-rank tokens (batch x seq) should be a multiple of 16
so HLA's token blocks never straddle ranks; the script warns otherwise.
"""
from __future__ import annotations

import argparse
import collections
import datetime
import gc
import os
import resource
import statistics
import sys
import time
import traceback

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")     # before any NCCL communicator exists

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH)
try:
    import hotcompile  # noqa: F401
except ImportError:                                  # a plain checkout, not pip-installed
    sys.path.insert(0, os.path.dirname(BENCH))
    import hotcompile  # noqa: F401

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import common as C  # noqa: E402

ENGINES = ("ddp", "fsdp")
# the full run's sizes (--tiny has its own)
FULL = dict(layers=4, d=2048, heads=16, seq=2048, batch=4, vocab=32768, steps=10, warmup=5)
BACKENDS = ("inductor", "hot")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=C.RESULTS_DIR, help="directory for the JSON + markdown")
    p.add_argument("--engines", default=",".join(ENGINES))
    p.add_argument("--backends", default=",".join(BACKENDS))
    p.add_argument("--tiny", action="store_true",
                   help="small config for a CPU smoke check (default on a machine without CUDA)")
    # sizes default to None and are filled in after parsing: the full run's, or --tiny's
    p.add_argument("--layers", type=int)
    # "--width" first: torchrun's own parser takes "--d" for an abbreviation of its options
    # ("ambiguous option: --d could match --duplicate-stdout-filters", torch 2.11)
    p.add_argument("--width", "--d", dest="d", type=int, help="model width")
    p.add_argument("--heads", type=int)
    p.add_argument("--seq", type=int)
    p.add_argument("--batch", type=int, help="sequences per rank")
    p.add_argument("--vocab", type=int)
    p.add_argument("--steps", type=int, help="timed steps")
    p.add_argument("--warmup", type=int, help="untimed steps (compile, LQS)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=None,
                   help="compute dtype (default bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0, help="DDP bucket size")
    p.add_argument("--kernels", default="auto", choices=("auto", "triton", "reference"),
                   help="HOTConfig.kernels")
    p.add_argument("--hot", nargs="*", default=[], metavar="KEY=VALUE",
                   help="other HOTConfig fields, e.g. gx_scale=token rank=8")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        a.tiny = True
    # small enough for two gloo processes on a laptop; d=256 keeps every block linear above
    # HOTConfig's default min_features=256
    sizes = (dict(layers=2, d=256, heads=4, seq=64, batch=2, vocab=512, steps=3, warmup=2)
             if a.tiny else FULL)
    for k, v in sizes.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    return a


# ----------------------------------------------------------------------------- setup
def init_distributed():
    """(rank, world, device); works under torchrun and as a plain single process."""
    if "RANK" not in os.environ:                     # python bench/dist.py: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT",
                                                                              "29517"))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    if torch.cuda.is_available():
        torch.cuda.set_device(local)
        device, backend = torch.device("cuda", local), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    kw = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, timeout=datetime.timedelta(minutes=10), **kw)
    return rank, world, device


def build_model(args, device):
    torch.manual_seed(args.seed)                      # identical initial weights on every rank
    with torch.device(device):
        return C.GPT(vocab=args.vocab, d=args.d, layers=args.layers, heads=args.heads,
                     seq=args.seq)


def make_backend(name, args):
    if name == "inductor":
        return "inductor", None
    cfg = hotcompile.HOTConfig(kernels=args.kernels, **C.parse_overrides(args.hot))
    be = hotcompile.backend(cfg)
    return be, be


def wrap(engine, model, backend, args, device, world):
    """(callable model, parameters to optimize) for one engine."""
    if engine == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                  bucket_cap_mb=args.bucket_cap_mb, gradient_as_bucket_view=True)
        return torch.compile(ddp, backend=backend), ddp.parameters()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mesh = init_device_mesh(device.type, (world,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if args.dtype == "bf16" else MixedPrecisionPolicy()
    for blk in model.blocks:
        fully_shard(blk, mesh=mesh, mp_policy=mp)
        blk.compile(backend=backend)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model, model.parameters()


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20    # KiB on Linux


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ----------------------------------------------------------------------------- one pair
def run_pair(engine, backend_name, args, rank, world, device) -> dict:
    C.reset_compile_state()
    torch._dynamo.utils.counters.clear()
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit,
                                                2 * args.layers + 8)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    model = build_model(args, device)
    backend, be = make_backend(backend_name, args)
    run, params = wrap(engine, model, backend, args, device, world)
    opt = torch.optim.AdamW(params, lr=1e-4)
    # HOT's rounding seeds (and anything else random from here on) differ per rank
    torch.manual_seed(args.seed + 1000 + rank)
    gen = torch.Generator(device=device).manual_seed(args.seed + rank)
    amp = engine == "ddp" and args.dtype == "bf16"

    def step():
        idx = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen,
                            device=device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            logits = run(idx[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), idx[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    times = []
    t0 = time.perf_counter()
    loss = step()
    sync(device)
    first = time.perf_counter() - t0
    for _ in range(args.warmup - 1):
        loss = step()
    sync(device)
    dist.barrier()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(args.steps):
        t = time.perf_counter()
        loss = step()
        sync(device)
        times.append(time.perf_counter() - t)
    med = statistics.median(times)
    rec = {"engine": engine, "backend": backend_name, "rank": rank,
           "step_ms": 1e3 * med, "step_ms_min": 1e3 * min(times),
           "step_ms_all": [1e3 * t for t in times],
           "tokens_per_s": args.batch * args.seq / med,
           "compile_s": max(0.0, first - med), "final_loss": loss.item()}
    if device.type == "cuda":
        rec["peak_alloc_gib"] = torch.cuda.max_memory_allocated(device) / 2 ** 30
        rec["peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / 2 ** 30
    else:
        rec["peak_rss_gib"] = peak_rss_gib()        # process high-water mark, not per pair
    if be is not None:
        rep = be.report
        before, after = rep.saved_bytes()
        rec.update(hot_sites_rewritten=len(rep.rewritten), hot_sites_total=len(rep.layers),
                   hot_exact=sorted({f"{r.name}: {r.reason}" for r in rep.exact}),
                   hot_forward_counts=dict(collections.Counter(r.forward for r in rep.rewritten)),
                   hot_errors=list(rep.errors), hot_saved_x_before=before,
                   hot_saved_x_after=after, hot_graphs=len({r.graph for r in rep.layers}))
    counters = torch._dynamo.utils.counters
    rec["graph_breaks"] = sum(counters["graph_break"].values())
    rec["unique_graphs"] = counters["stats"]["unique_graphs"]
    del run, params, opt, model
    return rec


# ----------------------------------------------------------------------------- output
def summarize(records, env, args) -> str:
    by = {}
    for r in records:
        by.setdefault((r["engine"], r["backend"]), []).append(r)
    gpu = env["device_type"] == "cuda"
    mem = "peak alloc GiB / rank" if gpu else "peak RSS GiB / rank"
    head = ["engine", "backend", "step ms (median, max over ranks)", "tokens/s / rank",
            "vs inductor", mem, "compile s", "hot sites", "graph breaks", "final loss"]
    rows = []
    for (engine, backend), rs in by.items():
        if any("error" in r for r in rs):
            err = next(r["error"] for r in rs if "error" in r)
            rows.append([engine, backend, "failed: " + err.splitlines()[-1][:120]] +
                        ["-"] * (len(head) - 3))
            continue
        step = max(r["step_ms"] for r in rs)
        base = by.get((engine, "inductor"))
        speed = "-"
        if backend != "inductor" and base and not any("error" in r for r in base):
            speed = f"{max(r['step_ms'] for r in base) / step:.3f}x"
        key = "peak_alloc_gib" if gpu else "peak_rss_gib"
        mems = " / ".join(C.fmt(r.get(key)) for r in sorted(rs, key=lambda r: r["rank"]))
        sites = "-"
        if "hot_sites_total" in rs[0]:
            sites = f"{rs[0]['hot_sites_rewritten']}/{rs[0]['hot_sites_total']}"
            fwd = rs[0].get("hot_forward_counts") or {}
            if fwd:
                sites += " (forward " + ", ".join(f"{k} {v}" for k, v in sorted(fwd.items())) + ")"
        rows.append([engine, backend, C.fmt(step), C.fmt(min(r["tokens_per_s"] for r in rs), 0),
                     speed, mems, C.fmt(max(r["compile_s"] for r in rs), 1), sites,
                     str(rs[0]["graph_breaks"]), C.fmt(rs[0]["final_loss"], 3)])
    cfg = (f"GPT {args.layers} blocks, d={args.d}, heads={args.heads}, seq={args.seq}, "
           f"batch {args.batch}/rank, vocab {args.vocab}, {args.dtype}, world {env['world']}, "
           f"{env['backend']}; {args.steps} timed steps after {args.warmup}; AdamW")
    lines = ["# Distributed training: DDP / FSDP2, Inductor vs hot", "",
             f"{env['date']} · {env['device']} × {env['world']} · torch {env['torch']} · "
             f"hotcompile {env.get('hotcompile')} · git {env.get('git')}", "", cfg, "",
             C.md_table(head, rows), "",
             "Step time: median over the timed steps, the slowest rank. Memory: peak over the "
             "timed steps on each rank (params, grads, AdamW state, activations). hot sites: "
             "linear layers rewritten / found in the graphs rank 0 compiled (the head stays "
             "exact by default; identical blocks that share one compiled graph count once), "
             "and the forward GEMM format of the rewritten ones. "
             "Graph breaks: Dynamo's count, the engine's own included."]
    exact = sorted({e for r in records for e in r.get("hot_exact", [])})
    if exact:
        lines += ["", "Layers hot left exact (rank 0): " + "; ".join(exact[:20])]
    return "\n".join(lines) + "\n"


def main(argv=None):
    args = parse_args(argv)
    rank, world, device = init_distributed()
    if args.dtype is None:
        args.dtype = "bf16" if device.type == "cuda" else "fp32"
    if device.type == "cpu":
        C.configure_cpu_compile(device)
    if (args.batch * args.seq) % 16 and rank == 0:
        print(f"warning: {args.batch * args.seq} tokens per rank is not a multiple of 16: "
              "HLA's token blocks straddle ranks", flush=True)
    env = C.environment(device)
    env.update(world=world, backend=dist.get_backend(),
               nccl=".".join(map(str, torch.cuda.nccl.version())) if device.type == "cuda"
               else None, NCCL_NVLS_ENABLE=os.environ.get("NCCL_NVLS_ENABLE"))
    base = None
    if rank == 0:
        base = C.result_base(args.out, "dist", device, "tiny" if args.tiny else "")
    records = []
    for engine in args.engines.split(","):
        for backend in args.backends.split(","):
            if rank == 0:
                C.log(f"== {engine} / {backend}")
            try:
                rec = run_pair(engine, backend, args, rank, world, device)
            except Exception as e:  # noqa: BLE001 - record it, go on with the next pair
                rec = {"engine": engine, "backend": backend, "rank": rank,
                       "error": f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"}
                print(f"[rank {rank}] {engine}/{backend} failed: {e}", flush=True)
            gathered = [None] * world
            dist.all_gather_object(gathered, rec)
            records += gathered
            if rank == 0:
                for r in gathered:
                    if "error" not in r:
                        C.log(f"   rank {r['rank']}: {r['step_ms']:.1f} ms/step, "
                              + (f"{r['peak_alloc_gib']:.2f} GiB"
                                 if "peak_alloc_gib" in r else f"RSS {r['peak_rss_gib']:.2f} GiB")
                              + (f", hot {r['hot_sites_rewritten']}/{r['hot_sites_total']} sites"
                                 if "hot_sites_total" in r else ""))
                data = {"suite": "dist", "env": env, "args": vars(args), "records": records}
                C.write_json(base + ".json", data)
                C.write_text(base + ".md", summarize(records, env, args))
    if rank == 0:
        print(open(base + ".md").read())
        print(f"wrote {base}.json and {base}.md")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
