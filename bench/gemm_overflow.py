"""INT8 GEMM (gemm.scaled_mm) on long K: the int32 overflow guard's correctness and cost.

Why: the INT8 kernel sums K products of 8-bit levels in int32, which wraps once
K * 127**2 >= 2**31 (K ~ 133k), a K the HLA g_W GEMM reaches on long token axes. Past
``gemm.int8_k_chunk()`` the kernel sums K in chunks and carries each chunk's high bits
into a second int32 tile (gemm.py module doc). This script, on one CUDA device:

(a) checks a worst case at K = 140,000 against float64: rows and columns of all +127 (and
    -127) levels, whose exact sums (2.26e9) wrap in plain int32; the check is the relative
    error (must be < 1e-6) and, stronger, bit-equality with fp32(exact sum) - also for
    ``reference.int_matmul`` (torch._int_mm, now chunked);
(b) times ``scaled_mm`` on random int8 levels (row- and column-vector fp32 scales, bf16
    output, as the HOT backward calls it) at M x K x N = 3072x6304x768, 3072x12608x768,
    28672x8192x4096 (plain int32 loop) and 768x140000x768 (the chunked loop), plus
    768x130880x768 (a K just below the chunk, unchunked: its per-K rate against the
    140k row is the cost of the guard; both have K % 128 = 64, the masked-tail loop) and a bf16 torch.matmul of each shape for context.
    Times are ``triton.testing.do_bench`` medians with the shape's tile (``gemm.tile_config``).

Output: a markdown table on stdout; with ``--out DIR`` also
``DIR/gemm_overflow_<date>_<device>.json`` (and ``.md``). Exit status 1 when a check
fails (timings still run), 2 without CUDA.

    python bench/gemm_overflow.py --out bench/results
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import re
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LONG_K = 140_000
SHAPES = [  # (M, K, N, what)
    (3072, 6304, 768, "ViT-B fc1 g_W r8"),
    (3072, 12608, 768, "ViT-B fc1 g_W r16"),
    (28672, 8192, 4096, "Llama gate/up g_W r16"),
    (768, 130_880, 768, "unchunked, K % 128 as 140k"),
    (768, LONG_K, 768, "long token axis (chunked)"),
]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="folder for the JSON (and .md) result")
    p.add_argument("--warmup", type=int, default=25, help="do_bench warm-up, ms")
    p.add_argument("--rep", type=int, default=100, help="do_bench repetition time, ms")
    p.add_argument("--no-bf16", action="store_true", help="skip the bf16 torch.matmul timings")
    return p.parse_args(argv)


def _levels(rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(-127, 128, (rows, cols), device="cuda", dtype=torch.int8, generator=gen)


def _wrapped(x: float) -> int:
    """What a plain int32 accumulator would have held: x modulo 2**32, signed."""
    return (int(x) + 2**31) % 2**32 - 2**31


def check_worst_case(G, R) -> dict:
    """(a): K = 140,000 (and a ragged 140,037) with all-+127 / -127 rows and columns."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    res = {"cases": [], "ok": True}
    for K in (LONG_K, LONG_K + 37):
        M, N = 512, 384
        a, b = _levels(M, K, gen), _levels(N, K, gen)
        a[:8] = 127
        a[8:12] = -127
        b[:8] = 127
        b[8:16] = -127
        exact = a.double() @ b.double().t()
        one = torch.ones(M, device="cuda")
        sixteen = torch.full((N,), 16.0, device="cuda")
        acc = G.scaled_mm(a, b, one, sixteen, 1 / 16, torch.float32)       # fp32(sum) * 1
        rs = torch.rand(M, device="cuda", generator=gen) + 0.5
        cs = torch.rand(N, device="cuda", generator=gen) + 0.5
        out = G.scaled_mm(a, b, rs, cs, 1 / 16, torch.float32)
        ref64 = exact * rs.double()[:, None] * (cs.double()[None, :] / 16)
        rel = float(((out.double() - ref64).abs() / ref64.abs().clamp_min(1e-300))[:12, :16].max())
        rel_all = float((out.double() - ref64).abs().max() / ref64.abs().max())
        case = {
            "M": M, "K": K, "N": N,
            "chunk": G._k_chunk(K, None, None, False),
            "exact_max": float(exact.abs().max()),
            "plain_int32_would_give": _wrapped(float(exact[0, 0])),
            "kernel_gives": float(acc[0, 0]),
            "acc_bit_equal_fp32_exact": bool(torch.equal(acc, exact.float())),
            "scaled_rel_err_worst_block": rel,
            "scaled_rel_err_max_over_max": rel_all,
        }
        case["ok"] = case["acc_bit_equal_fp32_exact"] and rel < 1e-6 and rel_all < 1e-6
        if K % 8 == 0:                                  # torch._int_mm path of the reference
            ref_acc = R.int_matmul(a[:64].contiguous(), b[:16].t())
            case["reference_int_matmul_bit_equal"] = bool(
                torch.equal(ref_acc, exact[:64, :16].float()))
            case["ok"] = case["ok"] and case["reference_int_matmul_bit_equal"]
        res["cases"].append(case)
        res["ok"] = res["ok"] and case["ok"]
        del a, b, exact
    return res


def time_shapes(G, args) -> list[dict]:
    from triton.testing import do_bench
    gen = torch.Generator(device="cuda").manual_seed(1)
    rows = []
    for M, K, N, what in SHAPES:
        a, b = _levels(M, K, gen), _levels(N, K, gen)
        rs = torch.rand(M, device="cuda", generator=gen) + 0.5
        cs = torch.rand(N, device="cuda", generator=gen) + 0.5
        fn = lambda: G.scaled_mm(a, b, rs, cs, 1 / 16, torch.bfloat16)
        fn()                                              # compile outside timing
        torch.cuda.synchronize()
        chunk = G._k_chunk(K, None, None, False)
        cfg = G.tile_config(M, N, K, torch.cuda.get_device_properties(0).multi_processor_count)
        ms = do_bench(fn, warmup=args.warmup, rep=args.rep, return_mode="median")
        flops = 2.0 * M * N * K
        row = {"M": M, "K": K, "N": N, "what": what, "chunked": chunk is not None,
               "k_chunk": chunk, "us": ms * 1e3, "tflops": flops / (ms * 1e-3) / 1e12,
               "config": str(cfg) if cfg is not None else None}
        if not args.no_bf16:
            af = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=gen)
            bf = torch.randn(K, N, device="cuda", dtype=torch.bfloat16, generator=gen)
            ms_bf = do_bench(lambda: af @ bf, warmup=args.warmup, rep=args.rep,
                             return_mode="median")
            row["bf16_us"] = ms_bf * 1e3
            row["speedup_vs_bf16"] = ms_bf / ms
            del af, bf
        rows.append(row)
        print(f"  {M}x{K}x{N}: {row['us']:.1f} us, {row['tflops']:.0f} TFLOP/s"
              f"{' (chunked)' if row['chunked'] else ''}", flush=True)
        del a, b
    torch.cuda.empty_cache()
    return rows


def markdown(result: dict) -> str:
    lines = [f"### INT8 scaled_mm on long K — {result['device']} ({result['date']})", "",
             "Worst case (a): " + ("**OK**" if result["check"]["ok"] else "**FAILED**"), "",
             "| K | chunk | plain int32 would give | kernel | fp32(exact) bit-equal | "
             "rel err (worst block) | reference.int_matmul bit-equal |",
             "|---|---|---|---|---|---|---|"]
    for c in result["check"]["cases"]:
        lines.append(f"| {c['K']} | {c['chunk']} | {c['plain_int32_would_give']:,} | "
                     f"{c['kernel_gives']:.6g} | {c['acc_bit_equal_fp32_exact']} | "
                     f"{c['scaled_rel_err_worst_block']:.2e} | "
                     f"{c.get('reference_int_matmul_bit_equal', 'n/a (K % 8)')} |")
    lines += ["", "Timings (b): `triton.testing.do_bench` medians, int8 levels, fp32 row/col "
              "scales, bf16 out.", "",
              "| M×K×N | what | loop | µs | TFLOP/s | bf16 matmul µs | × bf16 | tile |",
              "|---|---|---|---|---|---|---|---|"]
    for r in result["timings"]:
        loop = f"chunked ({r['k_chunk']})" if r["chunked"] else "plain"
        bf = f"{r['bf16_us']:.1f}" if "bf16_us" in r else "-"
        sp = f"{r['speedup_vs_bf16']:.2f}" if "speedup_vs_bf16" in r else "-"
        cfg = re.sub(r"\s+", " ", r["config"] or "-").replace("|", "/")
        lines.append(f"| {r['M']}×{r['K']}×{r['N']} | {r['what']} | {loop} | {r['us']:.1f} | "
                     f"{r['tflops']:.0f} | {bf} | {sp} | {cfg} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("gemm_overflow.py: needs a CUDA device (it times compiled Triton kernels; the "
              "CPU interpreter checks live in tests/test_gemm_overflow.py)", file=sys.stderr)
        return 2
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("gemm_overflow.py: unset TRITON_INTERPRET (timings of the interpreter mean "
              "nothing)", file=sys.stderr)
        return 2
    from hotcompile.kernels import gemm as G, reference as R
    if os.environ.get("HOT_GEMM_K_CHUNK"):
        print("note: ignoring HOT_GEMM_K_CHUNK (this script times the launcher's own chunk)")
    G.K_CHUNK_OVERRIDE = None
    dev = torch.cuda.get_device_name()
    date = _dt.datetime.now().strftime("%Y-%m-%dT%H%M%S")
    result = {"script": "bench/gemm_overflow.py", "device": dev, "date": date,
              "torch": torch.__version__, "python": platform.python_version(),
              "int8_k_chunk_default": G.int8_k_chunk(), "int8_k_chunk_127": G.int8_k_chunk(127)}
    try:
        import triton
        result["triton"] = triton.__version__
    except Exception:  # noqa: BLE001 - version is informative only
        pass
    print(f"device: {dev}; default chunk {G.int8_k_chunk()} (8-bit levels: "
          f"{G.int8_k_chunk(127)})", flush=True)
    print("(a) worst case at K ~ 140k ...", flush=True)
    result["check"] = check_worst_case(G, R)
    print("(b) timings ...", flush=True)
    result["timings"] = time_shapes(G, args)
    long = {r["K"]: r for r in result["timings"] if r["M"] == 768}
    if LONG_K in long and 130_880 in long:     # per-K time: chunked vs the longest plain run
        per_k = lambda r: r["us"] / r["K"]
        result["chunked_overhead"] = per_k(long[LONG_K]) / per_k(long[130_880]) - 1
    md = markdown(result)
    if "chunked_overhead" in result:
        md += (f"\nChunked vs plain loop, time per K element at M=N=768: "
               f"{100 * result['chunked_overhead']:+.1f}%\n")
    print()
    print(md)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        slug = re.sub(r"[^a-z0-9]+", "-", re.sub(r"^nvidia\s+", "", dev.lower())).strip("-")
        base = os.path.join(args.out, f"gemm_overflow_{date}_{slug}")
        with open(base + ".json", "w") as f:
            json.dump(result, f, indent=2)
        with open(base + ".md", "w") as f:
            f.write(md)
        print(f"wrote {base}.json and .md")
    return 0 if result["check"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
