"""A/B of HOT's transform kernels: the working tree against a git revision, side by side.

Why: a kernel rewrite is worth keeping only if it is bit-identical to what it replaces and
faster on the device, measured in one process against the same inputs. This script loads
``hotcompile/kernels`` as it was at ``--rev`` into a private package next to the working
tree's, checks that both produce the same bytes (levels and scales) at each shape, and times
each from CUDA-graph replays (rotating inputs larger than L2), with tile variants of the new W
kernel (``HOT_HQ_W_TILE``) and a device copy of the same bytes (the bandwidth floor the
issue's 80% target is against).

    python bench/kernel_ab.py --rev HEAD --out bench/results

Kernels (the defaults of a site's backward on an H100): ``hla_g`` (g's HLA operand:
stochastic e4m3, transposed, its bound from g's row maxima computed outside the timing, as
the site's HQ kernel writes them; ``g_pair``, g's HQ and HLA operands with a bound scale, is in
git history: commit 6d1b2cf), ``abc_x`` (the forward's compressed input: e4m3 row-major;
also written K-major directly, against row-major + ``transpose_padded``), ``hq_w`` (W's HQ
operand: e4m3), ``weight_cast`` (W's owned copy and maxima), ``weight_operands`` (HQ's W
and the FP8 forward's W from one read of the copy), ``weight_group`` (a Llama layer's seven
weights through both: one launch per weight against the slotted kernels' one for all), ``hq_g`` / ``hq_g_sweep`` (g's per-token HQ operand at forced tiles:
Llama's and ViT's widths, or every width the models have), ``other_paths`` (the
stochastic kernels off Hopper's default: int8 HLA operand, grad_out pair, per-tensor HQ).
Old and new need not be bit-identical (a numerics change): the mismatch column says how
far apart they are.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import json
import os
import shutil
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench.common import device_name, git_commit, stamp, write_json, write_text  # noqa: E402
from layers import bench_graph  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (label, L tokens, C channels) of g (hla_g), x (abc_x) or (O, I) of W (hq_w)
G_SHAPES = (("llama q/k/v/o/down g", 8192, 4096), ("llama gate/up g", 8192, 11008),
            ("vit fc1 g", 12608, 3072))
X_SHAPES = (("llama x (d)", 8192, 4096), ("llama x (ffn)", 8192, 11008),
            ("vit x", 12608, 768))
W_SHAPES = (("llama q (4096x4096)", 4096, 4096), ("llama up (11008x4096)", 11008, 4096),
            ("llama down (4096x11008)", 4096, 11008))


def load_rev(rev: str):
    """hotcompile/kernels at ``rev`` (a git revision, or a directory holding those files:
    the device machines get no .git) as a package ``hot_rev_kernels``; relative imports
    inside it resolve within the copy."""
    d = tempfile.mkdtemp(prefix="kernels_rev_")
    pkg = os.path.join(d, "hot_rev_kernels")
    if os.path.isdir(rev):
        shutil.copytree(rev, pkg)
    else:
        os.makedirs(pkg)
        names = subprocess.run(["git", "ls-tree", "--name-only", f"{rev}:hotcompile/kernels"],
                               cwd=ROOT, capture_output=True, text=True,
                               check=True).stdout.split()
        for n in names:
            if n.endswith(".py"):
                src = subprocess.run(["git", "show", f"{rev}:hotcompile/kernels/{n}"], cwd=ROOT,
                                     capture_output=True, text=True, check=True).stdout
                with open(os.path.join(pkg, n), "w") as f:
                    f.write(src)
    sys.path.insert(0, d)
    return importlib.import_module("hot_rev_kernels")


@contextlib.contextmanager
def env(**kv):
    old = {k: os.environ.get(k) for k in kv}
    for k, v in kv.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = str(v)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def time_ms(fn, inputs, reps: int = 20) -> float:
    """GPU ms of one ``fn(x)``, from a CUDA graph replaying it over every input (rotating
    inputs larger than L2; ``layers.bench_graph``). A graph keeps the host's allocations and
    launches out of the figure: each call timed alone from Python would include them
    whenever the GPU waits on the host."""
    return bench_graph(fn, [(x,) for x in inputs], reps)


def copy_ms(nbytes: int, reps: int = 30) -> float:
    """A device copy moving ``nbytes`` in total (half read, half written)."""
    n = max(1, nbytes // 4)
    srcs = [torch.empty(n, dtype=torch.int16, device="cuda").random_() for _ in range(3)]
    dst = torch.empty(n, dtype=torch.int16, device="cuda")
    return time_ms(lambda s: dst.copy_(s), srcs, reps)


def mismatch(a, b) -> float:
    """Fraction of differing bytes over two (levels, scale) results (0.0: bit-identical;
    1.0 when shapes or dtypes differ)."""
    diff = total = 0
    for x, y in zip(a, b):
        if x.shape != y.shape or x.dtype != y.dtype:
            return 1.0
        xb, yb = (t.contiguous().reshape(-1).view(torch.uint8) for t in (x, y))
        diff += int((xb != yb).sum())
        total += xb.numel()
    return diff / max(total, 1)


def inputs_of(shape, n=3, scale=1.0):
    gen = torch.Generator(device="cuda").manual_seed(0)
    return [torch.randn(*shape, device="cuda", generator=gen, dtype=torch.bfloat16) * scale
            for _ in range(n)]


HLA_G_TPP = (2, 4, 8)    # the tiles-a-program settings bench_hla_g sweeps (``--tpp``)


def bench_hla_g(old, new, rows):
    """g's HLA operand as the site writes it (stochastic e4m3, K-major), old against new,
    and the new kernel's tile at each number of channels per thread (``HOT_HLA_CPT``).
    "kernel alone": the transform + quantize kernel without the bound's small kernel
    (``token_block_bound_bits``, ~3.6 us at 8192 tokens on an H200), which a site launches
    before it and "old" / "new" include (fifty-third stop).
    (The seventh stop's variants, row-major, nearest and int8 levels, are in git history.)"""
    seed = torch.tensor([7], device="cuda", dtype=torch.int64)
    row_max = {}    # id(g) -> g's row maxima, which a site's HQ kernel writes as it reads g
    bound = {}      # id(g) -> its token-block bound, for the HLA kernel timed alone

    def run(mod, alone=False, **over):
        kw = dict(stochastic=True, seed=seed, seed_add=1, transposed=True, pad_to=16, e4m3=True,
                  scale_mul=1 / 16)
        kw.update(over)
        if alone:   # the transform + quantize kernel without the bound's small kernel
            return lambda g: mod.hla.hla_quant(g, 16, "1d", 8, amax=bound[id(g)], **kw)
        # the bound from the row maxima, as in a site (its block-sum kernel, or two small
        # reductions before it), not from a reduction over all of g, which the site does not run
        if hasattr(mod.hla, "token_block_bound_bits"):
            return lambda g: mod.hla.hla_quant(g, 16, "1d", 8, amax=mod.hla.token_block_bound_bits(
                g, row_max=row_max[id(g)]), **kw)
        if "row_max" in inspect.signature(mod.hla.hla_quant).parameters:
            return lambda g: mod.hla.hla_quant(g, 16, "1d", 8, row_max=row_max[id(g)], **kw)
        return lambda g: mod.hla.hla_quant(g, 16, "1d", 8, **kw)
    for label, L, C in G_SHAPES:
        xs = inputs_of((L, C))
        row_max.update({id(x): torch.linalg.vector_norm(x, float("inf"), dim=1,
                                                        dtype=torch.float32) for x in xs})
        nbytes = 2 * L * C + L * C
        ok = mismatch(run(old)(xs[0]), run(new)(xs[0]))
        floor = copy_ms(nbytes)
        res = {"old": time_ms(run(old), xs), "new": time_ms(run(new), xs)}
        bound.update({id(x): new.hla.token_block_bound_bits(x, row_max=row_max[id(x)])
                      for x in xs})
        res["old, kernel alone"] = time_ms(run(old, alone=True), xs)
        res["new, kernel alone"] = time_ms(run(new, alone=True), xs)
        for bt in (2, 4):      # token blocks per program (32-byte runs per channel at 2)
            with env(HOT_HLA_BT=str(bt)):
                res[f"new BT={bt}"] = time_ms(run(new), xs)
        with env(HOT_HLA_PAIRS="0"):   # 2-channel vectors a thread, not word pairs
            res["new CPT=2"] = time_ms(run(new), xs)
        for tpp in HLA_G_TPP:     # tiles a program: its prologue paid once for them
            with env(HOT_HLA_TPP=str(tpp)):
                res[f"new TPP={tpp}"] = time_ms(run(new), xs)
                res[f"new TPP={tpp}, kernel alone"] = time_ms(run(new, alone=True), xs)
                res[f"new TPP={tpp} mismatch"] = mismatch(run(old)(xs[0]), run(new)(xs[0]))
        res["old (again)"] = time_ms(run(old), xs)     # the spread between like timings
        res["new (again)"] = time_ms(run(new), xs)
        res["new, kernel alone (again)"] = time_ms(run(new, alone=True), xs)
        rows.append(dict(kernel="hla_g", shape=label, L=L, C=C, mismatch_vs_old=ok, copy_ms=floor,
                         **res))
        print(json.dumps(rows[-1]), flush=True)


HQ_TILES = {   # HOT_HQ_TOKEN_FORCE variants per width: BC, BR, warps, CHUNKS (held in
    # registers; 0: two sweeps). The first of each is token_tile's pick (forty-second stop);
    # the two-sweep variants were the rule before it.
    768: ("1024,2,4,1", "256,8,4,3", "256,4,4,3", "512,4,4,2", "1024,4,8,1"),
    2304: ("512,2,4,5", "512,4,4,5", "512,4,4,0", "1024,2,4,3", "256,8,4,0"),
    3072: ("1024,2,4,3", "1024,1,4,3", "1024,4,8,3", "1024,2,4,0", "4096,1,8,1", "512,4,4,0"),
    4096: ("4096,1,4,1", "4096,1,8,1", "2048,1,4,2", "1024,2,4,4", "1024,4,4,0", "2048,2,8,0"),
    11008: ("4096,1,8,3", "4096,1,4,3", "2048,1,4,6", "2048,1,8,6", "4096,1,4,0", "1024,2,4,0"),
    12288: ("4096,1,8,3", "4096,1,4,3", "2048,1,4,6", "4096,1,4,0"),
    16384: ("4096,1,8,4", "4096,1,4,4", "4096,1,4,0", "2048,1,4,0"),
}


def _hq_g_rows(old, new, rows, kernel, shapes, tiles):
    """g's per-token HQ operand (4-bit levels in e4m3), old against new, and the new
    kernel at forced tiles (``HOT_HQ_TOKEN_FORCE``: columns per chunk, rows per program,
    warps, chunks held); ``tiles(C)`` lists them."""
    seed = torch.tensor([7], device="cuda", dtype=torch.int64)

    def run(mod):
        return lambda g: mod.hadamard.hq_act_quant(g, 4, True, seed, fp8=True)
    for label, L, C in shapes:
        xs = inputs_of((L, C))
        ref = run(old)(xs[0])
        res = {"old": time_ms(run(old), xs), "new": time_ms(run(new), xs)}
        for tile in tiles(C):
            with env(HOT_HQ_TOKEN_FORCE=tile):
                try:
                    out = run(new)(xs[0])
                    res[f"new tile={tile}"] = time_ms(run(new), xs)
                    res[f"new tile={tile} mismatch"] = mismatch(out, ref)
                except Exception as e:  # noqa: BLE001  (a tile that does not compile)
                    res[f"new tile={tile}"] = f"failed: {type(e).__name__}: {str(e)[:120]}"
        res["old (again)"] = time_ms(run(old), xs)
        rows.append(dict(kernel=kernel, shape=label, L=L, C=C,
                         mismatch_vs_old=mismatch(run(new)(xs[0]), ref),
                         copy_ms=copy_ms(3 * L * C), **res))
        print(json.dumps(rows[-1]), flush=True)


def bench_hq_g(old, new, rows):
    """At the G_SHAPES, with a few tiles per width."""
    _hq_g_rows(old, new, rows, "hq_g", G_SHAPES, lambda C: HQ_TILES.get(C, ()))


def bench_hq_g_sweep(old, new, rows):
    """Every row width of the models (8192 tokens) at its tiles: which rule to keep
    (``hadamard.token_tile``)."""
    _hq_g_rows(old, new, rows, "hq_g_sweep", [(f"8192 x {C}", 8192, C) for C in HQ_TILES],
               lambda C: HQ_TILES[C])


def bench_abc(old, new, rows):
    def run(mod, transposed=False):
        return lambda x: mod.hla.hla_quant(x, 16, "1d", 8, stochastic=False, e4m3=True,
                                           transposed=transposed, pad_to=16)
    for label, L, C in X_SHAPES:
        xs = inputs_of((L, C))
        nbytes = 2 * L * C + L * C
        ok = mismatch(run(old)(xs[0]), run(new)(xs[0]))
        q_row, s_row = run(new)(xs[0])
        q_t, s_t = run(new, True)(xs[0])
        k_major = new.fused._k_major(q_row)
        ok_t = mismatch((k_major, s_row), (q_t, s_t))
        ok_kt = mismatch(run(old, True)(xs[0]), (q_t, s_t))
        res = {"old written K-major": time_ms(run(old, True), xs),
               "new written K-major": time_ms(run(new, True), xs),
               "old": time_ms(run(old), xs),
               "new": time_ms(run(new), xs)}
        for bt in (1, 4):         # token blocks per program of the channel-major tile
            with env(HOT_HLA_BT=str(bt)):
                res[f"new written K-major BT={bt}"] = time_ms(run(new, True), xs)
        with env(HOT_HLA_PAIRS="0"):   # 2-channel vectors a thread, not word pairs
            res["new written K-major CPT=2"] = time_ms(run(new, True), xs)
        # the kernel alone: in a site max |x| is a reduction fused into x's producer
        bound = {id(x): new.hadamard.input_amax_bits(x) for x in xs}
        alone = lambda x: new.hla.hla_quant(x, 16, "1d", 8, stochastic=False, e4m3=True,
                                            transposed=True, pad_to=16, amax=bound[id(x)])
        res["new written K-major, kernel alone"] = time_ms(alone, xs)
        with env(HOT_HLA_PAIRS="0"):
            res["new written K-major CPT=2, kernel alone"] = time_ms(alone, xs)
        for tpp in (2, 4, 8):
            with env(HOT_HLA_TPP=str(tpp)):
                res[f"new written K-major TPP={tpp}, kernel alone"] = time_ms(alone, xs)
                res[f"new TPP={tpp} mismatch"] = mismatch(run(old, True)(xs[0]), alone(xs[0]))
        res["max |x| alone"] = time_ms(new.hadamard.input_amax_bits, xs)
        res["old written K-major (again)"] = time_ms(run(old, True), xs)
        res["new written K-major (again)"] = time_ms(run(new, True), xs)
        rows.append(dict(kernel="abc_x", shape=label, L=L, C=C, mismatch_vs_old=ok,
                         kmajor_mismatch_vs_old=ok_kt, kmajor_mismatch_vs_transpose=ok_t,
                         copy_ms=copy_ms(nbytes), **res))
        print(json.dumps(rows[-1]), flush=True)


def bench_hq_w(old, new, rows):
    def run(mod):
        return lambda w: mod.hadamard.hq_weight_quant(w, 8, e4m3=True, scale_mul=1 / 16)
    for label, O, I in W_SHAPES:
        ws = inputs_of((O, I), scale=0.02)
        nbytes = 2 * O * I + O * I
        ok = mismatch(run(old)(ws[0]), run(new)(ws[0]))
        res = {"old": time_ms(run(old), ws)}
        for tile in ("32,256,8", "64,256,8", "128,64,4", "64,128,4", "16,256,4"):
            with env(HOT_HQ_W_TILE=tile):
                try:
                    out = run(new)(ws[0])
                    res[f"new tile={tile}"] = time_ms(run(new), ws)
                    res[f"new tile={tile} mismatch"] = mismatch(out, run(old)(ws[0]))
                except Exception as e:  # noqa: BLE001  (a tile that does not compile)
                    res[f"new tile={tile}"] = f"failed: {type(e).__name__}: {str(e)[:120]}"
        rows.append(dict(kernel="hq_w", shape=label, O=O, I=I, mismatch_vs_old=ok,
                         copy_ms=copy_ms(nbytes), **res))
        print(json.dumps(rows[-1]), flush=True)


WCAST_TILES = ("64,64,128,4", "32,32,256,4", "128,128,64,4", "64,64,64,4", "128,64,128,4",
               "64,32,128,4", "128,128,128,8", "256,256,32,4", "64,64,128,2", "32,32,128,4")


def bench_weight_cast(old, new, rows):
    """The forward's copy of an fp32 W with its column maxima (``hadamard.weight_cast``)
    against the torch cast alone (what Inductor's cast kernel does at ~copy bandwidth) and
    the cast followed by the column maxima as a torch reduction; tiles of the new kernel,
    and the default tile with the row maxima too (the row-wise FP8 forward's W scale)."""
    inf = float("inf")
    for label, O, I in W_SHAPES:
        ps = [torch.randn(O, I, device="cuda") * 0.02 for _ in range(3)]
        res = {"torch cast": time_ms(lambda p: p.to(torch.bfloat16), ps),
               "torch cast + column max": time_ms(lambda p: torch.linalg.vector_norm(
                   p.to(torch.bfloat16), inf, dim=0, dtype=torch.float32), ps)}
        ref = new.reference.weight_cast(ps[0], torch.bfloat16, True)
        for tile in WCAST_TILES + ("default + row maxima",):
            row_max = tile.startswith("default")
            with env(**({} if row_max else {"HOT_WCAST_TILE": tile})):
                try:
                    out = _casts(new, ps[:1], row_max)[0]
                    res[f"new tile={tile} ok"] = all(torch.equal(a, b) for a, b in zip(
                        out, ref if row_max else ref[:2]))
                    res[f"new tile={tile}"] = time_ms(
                        lambda p: _casts(new, [p], row_max)[0], ps)
                except Exception as e:  # noqa: BLE001  (a tile that does not compile)
                    res[f"new tile={tile}"] = f"failed: {type(e).__name__}: {str(e)[:120]}"
        rows.append(dict(kernel="weight_cast", shape=label, O=O, I=I,
                         copy_ms=copy_ms(6 * O * I), **res))
        print(json.dumps(rows[-1]), flush=True)


def _casts(mod, ps, row_max):
    """Each fp32 parameter's owned copy and maxima, by ``mod``'s kernels: one launch per
    ``WEIGHT_SLOTS`` (``fused.weight_casts``), or one each where ``mod`` predates it."""
    if hasattr(mod.fused, "weight_casts"):
        return mod.fused.weight_casts(ps, torch.bfloat16, row_max)
    return [mod.hadamard.weight_cast(p, torch.bfloat16, row_max) for p in ps]


def _operands(mod, calls, forward, hq=True):
    """``fused.weight_operands`` of each (w, col_max, fwd_max) by ``mod``'s kernels: one
    launch per ``WEIGHT_SLOTS`` copies, or one each where ``mod`` predates it."""
    if "calls" in inspect.signature(mod.fused.weight_operands).parameters:
        return mod.fused.weight_operands(calls, forward, hq)
    return [mod.fused.weight_operands(*c, forward, hq) for c in calls]


def bench_weight_operands(old, new, rows):
    """W's two forward operands from the owned copy (``fused.weight_operands``: HQ's e4m3 W
    and the FP8 forward's W in one W kernel) against what they replace: the W kernel alone
    plus the forward's cast as Inductor compiles ``fp8_forward.weight_operand`` (one
    pointwise read of the copy), both timed in one CUDA graph; old = ``--rev``'s W kernel."""
    from hotcompile.kernels import fp8_forward as F8
    for label, O, I in W_SHAPES:
        ws = inputs_of((O, I), scale=0.02)
        maxima = {id(w): new.reference.weight_cast(w.float(), torch.bfloat16, True)[1:]
                  for w in ws}
        res = {}
        for forward in ("fp8_rowwise", "fp8"):
            rowwise = forward == "fp8_rowwise"
            cast = torch.compile(lambda w, b: F8.weight_operand(w.t(), rowwise, max_bits=b),
                                 fullgraph=True)

            def before(w, cast=cast, rowwise=rowwise):
                m, r = maxima[id(w)]
                return (*_operands(old, [(w, m, None)], "bf16")[0][:2],
                        *cast(w, r if rowwise else m))

            def after(w, forward=forward, rowwise=rowwise):
                m, r = maxima[id(w)]
                return _operands(new, [(w, m, r if rowwise else m)], forward)[0]
            res[f"{forward} mismatch"] = mismatch(after(ws[0]), before(ws[0]))
            res[f"{forward} W kernel + Inductor cast"] = time_ms(before, ws)
            res[f"{forward} weight_operands"] = time_ms(after, ws)
        res["W kernel alone (old)"] = time_ms(
            lambda w: _operands(old, [(w, maxima[id(w)][0], None)], "bf16")[0][:2], ws)
        worst = max(v for k, v in res.items() if k.endswith("mismatch"))
        rows.append(dict(kernel="weight_operands", shape=label, O=O, I=I, mismatch_vs_old=worst,
                         copy_ms=copy_ms(4 * O * I), **res))
        print(json.dumps(rows[-1]), flush=True)


LLAMA_LAYER = ((4096, 4096),) * 4 + ((11008, 4096),) * 2 + ((4096, 11008),)


def bench_weight_group(old, new, rows):
    """A Llama d4096 layer's seven weights through the forward's two W kernels as a spliced
    step runs them (the row-wise FP8 forward): old = ``--rev``, one launch per weight each
    (before the slotted kernels: 14 launches); new = one launch of each for all seven.
    Both timed from one CUDA graph per call; the outputs must be bit-equal (NaN aside:
    none here)."""
    sets = [[torch.randn(O, I, device="cuda") * 0.02 for O, I in LLAMA_LAYER] for _ in range(2)]

    def step(mod):
        def run(ps):
            casts = _casts(mod, ps, True)
            return [t for c in casts for t in c] + \
                [t for o in _operands(mod, [(w, m, r) for w, m, r in casts], "fp8_rowwise")
                 for t in o]
        return run
    worst = mismatch(step(new)(sets[0]), step(old)(sets[0]))
    n = sum(O * I for O, I in LLAMA_LAYER)
    # bytes: p (4) -> copy (2) in the cast; copy (2) -> HQ W (1) + forward W (1) in the operands
    for what, nbytes, fn in (("casts + operands", 10 * n, step),
                             ("casts", 6 * n, lambda m: lambda ps: _casts(m, ps, True))):
        res = {f"{what} {name}": time_ms(fn(mod), sets) for name, mod in (("old", old),
                                                                          ("new", new))}
        rows.append(dict(kernel="weight_group", shape=f"llama d4096 layer (7 weights), {what}",
                         O=0, I=0, mismatch_vs_old=worst, copy_ms=copy_ms(nbytes), **res))
        print(json.dumps(rows[-1]), flush=True)


def bench_other_paths(old, new, rows):
    """The stochastic paths off Hopper's default, old against new: g's HLA operand in int8
    levels (GPUs without FP8), the grad_out pair at rank 8 (int8 saved activations) and
    per-tensor HQ (``gx_scale="tensor"`` / LQS)."""
    seed = torch.full((1,), 7, dtype=torch.int64, device="cuda")
    for label, L, C in G_SHAPES:
        gs = inputs_of((L, C))
        res = {}
        for name, mod in (("old", old), ("new", new)):
            res[f"hla_g int8 {name}"] = time_ms(lambda g, m=mod: m.hla.hla_quant(
                g, 16, "1d", 8, stochastic=True, seed=seed, seed_add=1, transposed=True,
                pad_to=16), gs)
            res[f"grad_out rank 8 {name}"] = time_ms(lambda g, m=mod: m.grad_out.grad_out_quant(
                g, 4, True, seed, 8, "1d", 8, seed, True, hla_seed_add=1), gs)
            res[f"hq_g per tensor {name}"] = time_ms(lambda g, m=mod: m.hadamard.hq_act_quant(
                g, 4, False, seed, fp8=True), gs)
        hla = lambda m: m.hla.hla_quant(gs[0], 16, "1d", 8, stochastic=True, seed=seed,  # noqa: E731
                                        seed_add=1, transposed=True, pad_to=16)
        rows.append(dict(kernel="other_paths", shape=label, L=L, C=C,
                         mismatch_vs_old=mismatch(hla(old), hla(new)),
                         copy_ms=copy_ms(3 * L * C), **res))
        print(json.dumps(rows[-1]), flush=True)


def markdown(rows, meta) -> str:
    out = [f"Device **{meta['device']}**, {meta['when']}, torch {meta['torch']}, new = working "
           f"tree (git {meta['git']}), old = {meta['rev']}. Median ms of CUDA events over "
           "rotating inputs; '% copy' = a device copy of the same bytes over the kernel time.",
           ""]
    for r in rows:
        times = {k: v for k, v in r.items() if isinstance(v, float) and k != "copy_ms"
                 and "mismatch" not in k}
        diff = (f"bytes differing from old: {r['mismatch_vs_old']:.2e}"
                if "mismatch_vs_old" in r else "no old kernel: against torch; bit-equal to "
                "the reference at every tile: " + str(all(v for k, v in r.items()
                                                          if k.endswith(" ok"))))
        out.append(f"- **{r['kernel']} {r['shape']}** ({diff}"
                   + (f"; K-major vs old K-major: {r['kmajor_mismatch_vs_old']:.2e}"
                      if "kmajor_mismatch_vs_old" in r else "")
                   + (f"; K-major written vs transposed row-major: "
                      f"{r['kmajor_mismatch_vs_transpose']:.2e}"
                      if "kmajor_mismatch_vs_transpose" in r else "")
                   + f"; copy {r['copy_ms']:.4f} ms)")
        for k, v in times.items():
            out.append(f"  - {k}: {v:.4f} ms ({100 * r['copy_ms'] / v:.0f}% copy)")
        for k, v in r.items():
            if isinstance(v, str) and v.startswith("failed"):
                out.append(f"  - {k}: {v}")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rev", default="HEAD", help="git revision or directory of the old kernels")
    p.add_argument("--kernels", default="hla_g,abc_x,hq_w")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    p.add_argument("--tpp", default="2,4,8", help="hla_g: the HOT_HLA_TPP values swept")
    a = p.parse_args(argv)
    global HLA_G_TPP
    HLA_G_TPP = tuple(int(t) for t in a.tpp.split(","))
    old, new = load_rev(a.rev), importlib.import_module("hotcompile.kernels")
    for pkg in ("hot_rev_kernels", "hotcompile.kernels"):     # the submodules used below
        for mod in ("fused", "hla", "hadamard", "grad_out", "reference"):
            importlib.import_module(f"{pkg}.{mod}")
    rows: list = []
    for k in a.kernels.split(","):
        {"hla_g": bench_hla_g, "abc_x": bench_abc, "hq_w": bench_hq_w,
         "weight_cast": bench_weight_cast, "weight_operands": bench_weight_operands,
         "weight_group": bench_weight_group,
         "hq_g": bench_hq_g, "hq_g_sweep": bench_hq_g_sweep,
         "other_paths": bench_other_paths}[k](old, new, rows)
    git = git_commit() or os.environ.get("HOT_GIT", "?")
    meta = dict(device=device_name(torch.device("cuda")), when=stamp(), torch=torch.__version__,
                git=git, rev=a.rev)
    os.makedirs(a.out, exist_ok=True)
    base = os.path.join(a.out, f"kernel_ab_{meta['when'].replace(':', '')}")
    write_json(base + ".json", dict(meta=meta, rows=rows))
    write_text(base + ".md", markdown(rows, meta))
    print(markdown(rows, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
