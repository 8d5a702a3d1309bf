"""What a row-wise e4m3 copy costs when Inductor fuses it into the kernel that produces the
tensor: LayerNorm and GELU (what makes ViT-B's linear inputs) and GELU's backward (what
makes fc1's g), each alone and with HOT's cast (``kernels.fp8_forward.e4m3_cast``, the
FP8 forward's own aten ops).

    python bench/producer_casts.py --out $OUT                  # ViT-B/16 bs64's shapes
    python bench/producer_casts.py --persistent 4096 --code $OUT/code --out $OUT
    python bench/producer_casts.py --device cpu --rows 256 --out /tmp/r

Why: issue 12 asks ViT-B for 1.10x Inductor. On the H200 the FP8 GEMMs save 2.3 ms of its
step, but torchao's Inductor-fused casts cost about 6.5 ms more than the kernels they joined
(forty-sixth stop, docs/BENCHMARKS.md), where their bytes would take ~0.5 ms at copy speed.
Whether a cast in its producer can run near copy speed decides whether that target needs
kernels of HOT's own or only a better-shaped graph. Each variant is compiled by Inductor in
default mode and timed from CUDA-graph replays (``triton.testing.do_bench_cudagraph``: no
launch overhead), beside a device copy of the same bytes. The cast beside the bf16 output
is compared with the eager twin on that output (``check_cast``; the cast alone has no
output to compare on): equal bit for bit since the cast's reciprocal is exact
(``fp8_forward.scale_reciprocal``); the first H200 run, with Inductor's approximate fp32
reciprocal, found LayerNorm's levels differing (forty-sixth stop).
Results: ``<out>/producer_casts_<date>_<device>[_tag].{json,md}``.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import common as C  # noqa: E402
from hotcompile.kernels.fp8_forward import e4m3_cast  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def _ln(x, w, b):
    return F.layer_norm(x, (x.shape[-1],), w, b, 1e-6)


def _gelu_bwd(g, h):
    return torch.ops.aten.gelu_backward.default(g, h)


# name: (producer, the shape's width key, how many bf16 inputs it reads)
PRODUCERS = {
    "layernorm": (_ln, "d", 1),
    "gelu": (lambda h: F.gelu(h), "mlp", 1),
    "gelu_backward": (_gelu_bwd, "mlp", 2),
}


def variants(producer):
    """The compiled functions of one producer: alone; with the cast beside its bf16 output
    (a later reader still needs it: the saved input of a bf16 g_W, a residual); with the
    cast alone (the producer's only reader is the FP8 GEMM)."""
    def alone(*a):
        return producer(*a)

    def with_cast(*a):
        y = producer(*a)
        q, s = e4m3_cast(y, rowwise=True)
        return y, q, s

    def cast_only(*a):
        return e4m3_cast(producer(*a), rowwise=True)
    return {"alone": alone, "with_cast": with_cast, "cast_only": cast_only}


@contextlib.contextmanager
def persistent_reductions(up_to: int):
    """Compiles in this context make a row reduction of up to ``up_to`` elements (an inner
    one: rows along the last axis) persistent, one block holding the whole row, where
    Inductor's own heuristic (``InductorChoices.should_use_persistent_reduction``) stops at
    1024 and loops over the row instead, which reads the producer's inputs (and recomputes
    it) once for the maxima and once for the cast. Inductor's FX graph cache is off here:
    its key does not cover the choices handler."""
    from torch._inductor.choices import InductorChoices
    from torch._inductor.runtime.hints import ReductionHint
    from torch._inductor.virtualized import V

    class Persistent(InductorChoices):
        @staticmethod
        def should_use_persistent_reduction(features, cooperative_reduction):
            if (features.get_reduction_hint() == ReductionHint.INNER
                    and V.graph.sizevars.statically_known_leq(features.reduction_numel, up_to)):
                return True
            return InductorChoices.should_use_persistent_reduction(features,
                                                                   cooperative_reduction)

    with V.set_choices_handler(Persistent()), \
            torch._inductor.config.patch(fx_graph_cache=False):
        yield


# ------------------------------------------- one pass: HOT's GELU kernel, a backward prototype
try:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import libdevice

    from hotcompile.kernels import producer_cast
    from hotcompile.kernels.hadamard import abs_bits, round_to_bf16
except ImportError:          # the CPU smoke runs without triton's GPU parts
    triton = None

if triton is not None:
    @triton.jit
    def _gelu_backward_chunk(x_ptr, g_ptr, y_ptr, rows, i: tl.constexpr, R, W, BC: tl.constexpr,
                             INTERPRET: tl.constexpr):
        """Chunk i of a row set: GELU's backward with g in fp32 in the op order Inductor
        compiles ``gelu_backward`` in, with the libdevice functions its code calls (the
        interpreter has none: numpy's there), rounded to bf16, stored."""
        cols = i * BC + tl.arange(0, BC)
        mask = (rows < R)[:, None] & (cols < W)[None, :]
        offs = rows.to(tl.int64)[:, None] * W + cols[None, :]
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if INTERPRET:
            erf, e = tl.erf(x * 0.7071067811865476), tl.exp(x * x * -0.5)
        else:
            erf, e = libdevice.erf(x * 0.7071067811865476), libdevice.exp(x * x * -0.5)
        y = g * ((erf + 1.0) * 0.5 + x * (e * 0.3989422804014327))
        if INTERPRET:       # its fp32 -> bf16 cast truncates
            y = round_to_bf16(y).to(tl.bfloat16)
        else:
            y = y.to(tl.bfloat16)
        tl.store(y_ptr + offs, y, mask=mask)
        return y.to(tl.float32)

    @triton.jit
    def _gelu_backward_cast_kernel(x_ptr, g_ptr, y_ptr, q_ptr, s_ptr, R, W, BR: tl.constexpr,
                                   BC: tl.constexpr, CHUNKS: tl.constexpr,
                                   INTERPRET: tl.constexpr):
        """BR rows a program, each CHUNKS chunks of BC columns held in registers: GELU's
        backward (bf16), then its row-wise e4m3 copy and scale from the held values
        (``producer_cast.cast_held_rows``, as HOT's forward GELU kernel): one read of the
        inputs, one write of each output."""
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        amax = tl.zeros((BR, BC), dtype=tl.int32)
        held = ()
        for i in tl.static_range(CHUNKS):
            y = _gelu_backward_chunk(x_ptr, g_ptr, y_ptr, rows, i, R, W, BC, INTERPRET)
            amax = tl.maximum(amax, abs_bits(y))
            held = held + (y,)
        producer_cast.cast_held_rows(held, amax, rows, R, W, q_ptr, s_ptr, BC, CHUNKS, INTERPRET)


ONE_PASS_TILES = ((1, 4), (2, 8), (4, 8))     # the backward prototype's (rows a program, warps)


def one_pass_variants(name: str) -> list:
    """[(variant label, fn(*args) -> (y, q, s))]: for "gelu" (args (h,)) HOT's own kernel
    (``producer_cast.gelu_e4m3``, as the graph launches it); for "gelu_backward" (args
    (g, h)) the prototype above at each of ``ONE_PASS_TILES`` (not wired into HOT: a
    measurement of what one pass reaches)."""
    if name == "gelu":
        return [("one_pass[hot::gelu_e4m3]", lambda h: producer_cast.gelu_e4m3(h)[:3])]

    def backward(br: int, warps: int, bc: int = 1024):
        def run(g, x):
            R, W = x.shape
            y = torch.empty_like(x)
            q = torch.empty(R, W, dtype=torch.float8_e4m3fn, device=x.device)
            s = torch.empty(R, dtype=torch.float32, device=x.device)
            _gelu_backward_cast_kernel[(triton.cdiv(R, br),)](
                x, g, y, q, s, R, W, br, bc, triton.cdiv(W, bc),
                os.environ.get("TRITON_INTERPRET") == "1", num_warps=warps)
            return y, q, s
        return run
    return [(f"one_pass[{br}x{warps}]", backward(br, warps)) for br, warps in ONE_PASS_TILES]


def check_one_pass(fn, args, alone) -> dict:
    """The one-pass kernel's levels and scales against the eager twin on its own bf16
    output, and that output against Inductor's compiled producer (``alone``)."""
    y, q, s = fn(*args)
    q_ref, s_ref = e4m3_cast(y, rowwise=True)
    differ = q.view(torch.uint8) != q_ref.view(torch.uint8)
    return {"scales_equal": bool(torch.equal(s, s_ref.reshape(-1))),
            "levels_differ": float(differ.float().mean()),
            "y_differs_from_inductor": float((y.view(torch.int16)
                                              != alone(*args).view(torch.int16)).float().mean())}


def bytes_moved(rows: int, width: int, reads: int, variant: str) -> int:
    """The variant's minimal bytes: its bf16 inputs read once, what it returns written once."""
    out = {"alone": 2, "with_cast": 3, "cast_only": 1}[variant]
    return rows * width * (2 * reads + out) + (0 if variant == "alone" else rows * 4)


def timer(device: torch.device, reps: int):
    """ms of one call of fn: CUDA-graph replays on a GPU, the median wall time on a CPU."""
    if device.type == "cuda":
        import triton.testing
        return lambda fn: triton.testing.do_bench_cudagraph(fn, rep=reps)

    def wall(fn):
        ts = []
        for _ in range(5):
            t = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t) * 1e3)
        return statistics.median(ts)
    return wall


def check_cast(fn, args, producer) -> dict:
    """The compiled cast beside the bf16 output against the eager twin on that output: the
    fraction of levels that differ, and of those how many equal the cast of the producer
    computed in fp32 and never rounded to bf16 (the value the cast would see if Inductor
    fused it past the bf16 rounding that ``e4m3_cast`` pins it to)."""
    y, q, s = fn(*args)
    q_ref, s_ref = e4m3_cast(y, rowwise=True)
    differ = q.view(torch.uint8) != q_ref.view(torch.uint8)
    q32, _ = e4m3_cast(producer(*[a.float() for a in args]), rowwise=True)
    as_fp32 = (q.view(torch.uint8) == q32.view(torch.uint8)) & differ
    return {"scales_equal": bool(torch.equal(s.reshape(-1), s_ref.reshape(-1))),
            "levels_differ": float(differ.float().mean()),
            "differing_as_unrounded_fp32": float(as_fp32.sum()) / max(1, int(differ.sum()))}


def measure(device: torch.device, rows: int, widths: dict, reps: int,
            persistent: int = 0, code_dir: str | None = None) -> list:
    """Every producer and variant; with ``persistent`` (a row width), the cast variants
    once more, compiled with row reductions up to that width persistent (variant names
    ``+persistent``); with ``code_dir``, each one's Inductor output code written there."""
    gen = torch.Generator(device=device).manual_seed(0)
    time_of = timer(device, reps)
    results = []
    copies: dict = {}

    def record(name, vname, width, ms, nbytes, check):
        if nbytes not in copies:        # a copy of the same bytes, timed once per size
            src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
            dst = torch.empty_like(src)
            copies[nbytes] = time_of(lambda: dst.copy_(src))   # reads and writes nbytes
        results.append({"producer": name, "variant": vname, "rows": rows, "width": width,
                        "ms": ms, "bytes": nbytes, "copy_ms": copies[nbytes],
                        "of_copy": copies[nbytes] / ms, **check})

    for name, (producer, key, reads) in PRODUCERS.items():
        width = widths[key]
        args = [torch.randn(rows, width, generator=gen, device=device).bfloat16()
                for _ in range(reads)]
        if name == "layernorm":
            args += [torch.randn(width, generator=gen, device=device).bfloat16(),
                     torch.randn(width, generator=gen, device=device).bfloat16()]
        runs = [(v, fn, contextlib.nullcontext) for v, fn in variants(producer).items()]
        if persistent:
            runs += [(v + "+persistent", fn, lambda: persistent_reductions(persistent))
                     for v, fn in variants(producer).items() if v != "alone"]
        compiled_alone = None
        for vname, fn, context in runs:
            compiled = torch.compile(fn, fullgraph=True)
            if vname == "alone":
                compiled_alone = compiled
            with context():
                if code_dir:
                    from torch._inductor.utils import run_and_get_code
                    _, code = run_and_get_code(compiled, *args)
                    os.makedirs(code_dir, exist_ok=True)
                    C.write_text(os.path.join(code_dir, f"{name}_{vname.replace('+', '_')}.py"),
                                 "\n\n".join(code))
                for _ in range(3):        # compiles (and settles its first calls) untimed
                    compiled(*args)
            check = check_cast(compiled, args, producer) if vname.startswith("with_cast") else {}
            C.sync(device)
            ms = time_of(lambda: compiled(*args))
            record(name, vname, width, ms, bytes_moved(rows, width, reads, vname.split("+")[0]),
                   check)
        if device.type == "cuda" and name in ("gelu", "gelu_backward") and triton is not None:
            for label, fn in one_pass_variants(name):
                check = check_one_pass(fn, args, compiled_alone)
                C.sync(device)
                ms = time_of(lambda: fn(*args))
                record(name, label, width, ms, bytes_moved(rows, width, reads, "with_cast"),
                       check)
    for r in results:
        base = next(a for a in results if a["producer"] == r["producer"]
                    and a["variant"] == "alone")
        r["over_alone_ms"] = r["ms"] - base["ms"]
    return results


def table(results: list) -> str:
    def check(r):
        if "levels_differ" not in r:
            return "-"
        if "y_differs_from_inductor" in r:
            return (f"scales {'equal' if r['scales_equal'] else 'DIFFER'}, levels differ "
                    f"{100 * r['levels_differ']:.3g}%; bf16 output differs from Inductor's "
                    f"in {100 * r['y_differs_from_inductor']:.3g}%")
        return (f"scales {'equal' if r['scales_equal'] else 'DIFFER'}, levels differ "
                f"{100 * r['levels_differ']:.3g}% ({100 * r['differing_as_unrounded_fp32']:.0f}% "
                "of those as from the unrounded fp32)")
    return C.md_table(
        ["producer", "variant", "rows x width", "ms", "+ms over alone", "MB", "% of copy",
         "compiled cast vs eager twin"],
        [[r["producer"], r["variant"], f"{r['rows']} x {r['width']}", C.fmt(r["ms"], 4),
          C.fmt(r["over_alone_ms"], 4), C.fmt(r["bytes"] / 1e6, 1),
          C.fmt(100 * r["of_copy"], 0) + "%", check(r)] for r in results])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=64 * 197, help="tokens (ViT-B/16 bs64)")
    p.add_argument("--d", type=int, default=768)
    p.add_argument("--mlp", type=int, default=3072)
    p.add_argument("--reps", type=int, default=200, help="ms of replays a timing (GPU)")
    p.add_argument("--persistent", type=int, default=0, metavar="WIDTH",
                   help="also compile the casts with row reductions up to WIDTH persistent")
    p.add_argument("--code", help="write each variant's Inductor output code to this folder")
    p.add_argument("--device", help="cuda / cpu (default: cuda when available)")
    p.add_argument("--out", help="output folder (default bench/results)")
    p.add_argument("--tag", default="")
    args = p.parse_args(argv)
    device = C.pick_device(args.device)
    C.configure_cpu_compile(device)
    out = os.path.abspath(args.out or os.path.join(HERE, "results"))
    os.makedirs(out, exist_ok=True)
    results = measure(device, args.rows, {"d": args.d, "mlp": args.mlp}, args.reps,
                      args.persistent, args.code)
    base = C.result_base(out, "producer_casts", device, args.tag)
    C.write_json(base + ".json", {"env": C.environment(device), "options": vars(args),
                                  "results": results})
    text = "\n".join([f"# Row-wise e4m3 casts fused into their producers: "
                      f"{C.device_name(device)}", "", table(results), ""])
    C.write_text(base + ".md", text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
