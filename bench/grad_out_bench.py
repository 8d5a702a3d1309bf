"""One kernel pair for both operands of g_y (grad_out.grad_out_quant) vs the separate pair.

What it measures, per shape (L, O) of g_y (bf16 by default) and per HQ scaling (per token,
per tensor), HLA rank 8:

* bit-equality of ``grad_out_quant`` with ``hadamard.hq_act_quant`` + ``hla.hla_quant``
  (HQ levels and scale, the L' defined columns of the transposed HLA levels, HLA scale);
* the median time (``triton.testing.do_bench``; L2 flushed before every call) of the
  separate pair (and of each half), of the combined pair, and of ``torch.empty_like(g)
  .copy_(g)`` in the same run;
* the effective bandwidth of both: (bytes of g read once + bytes written) / time, and its
  fraction of the copy's bandwidth (2 x bytes of g / copy time). Reading g once is the
  floor the combined kernel aims at; it actually reads g twice (once per phase, the second
  time partly from L2), the separate pair three (per-token HQ) or four times.

Nothing is written unless ``--out`` (a .json path, or .md for the table). Exit status 1
when a shape is not bit-equal (timings are still printed), 2 without CUDA.

    python bench/grad_out_bench.py                      # the default shapes, about a minute
    python bench/grad_out_bench.py --shapes 12608x3072 --per-token 1 --out results/x.json
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DEFAULT_SHAPES = "12608x768,12608x2304,12608x3072,8192x4096,8192x11008,8192x12288"


def parse_shapes(text: str) -> list[tuple[int, int]]:
    shapes = []
    for item in text.replace(";", ",").split(","):
        item = item.strip()
        if item:
            L, O = item.lower().split("x")
            shapes.append((int(L), int(O)))
    return shapes


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=DEFAULT_SHAPES,
                   help="comma list of LxO (tokens x out-features of g_y); default: %(default)s")
    p.add_argument("--per-token", default="1,0",
                   help="HQ scalings to run: 1 per token, 0 per tensor (default: %(default)s)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--rank", type=int, default=8, help="HLA rank (default: %(default)s)")
    p.add_argument("--select", default="1d", choices=["1d", "2d"])
    p.add_argument("--hq-bits", type=int, default=4)
    p.add_argument("--hla-bits", type=int, default=8)
    p.add_argument("--fp8", action="store_true", help="HQ levels stored as e4m3")
    p.add_argument("--warmup", type=int, default=25, help="do_bench warm-up, ms")
    p.add_argument("--rep", type=int, default=100, help="do_bench repetition time, ms")
    p.add_argument("--cuda-graph", action="store_true",
                   help="time with triton.testing.do_bench_cudagraph (no launch overhead)")
    p.add_argument("--tile", default=None,
                   help="override the combined kernel's tile: BT,BC,WARPS,HR (HOT_GRAD_OUT_TILE)")
    p.add_argument("--no-check", action="store_true", help="skip the bit-equality check")
    p.add_argument("--out", default=None, help="write results here (.json, or .md table)")
    p.add_argument("--device", default="cuda",
                   help="cuda (default); cpu only as a smoke test of this script under "
                        "TRITON_INTERPRET=1 with tiny --shapes (wall-clock timer, no meaning)")
    return p.parse_args(argv)


def _bits(t: torch.Tensor) -> torch.Tensor:
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.contiguous().view(ints[t.element_size()])


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


def written_bytes(L: int, O: int, rank: int, per_token: bool) -> int:
    """Bytes the two operands hold: HQ levels (L, O_pad) + scale, HLA levels O x L' + scale."""
    O_pad = -(-O // 16) * 16
    l_red = -(-L // 16) * rank
    return L * O_pad + (4 * L if per_token else 4) + O * l_red + 4


def main(argv=None) -> int:
    a = parse_args(argv)
    dev = torch.device(a.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("grad_out_bench: needs a CUDA device (none found)", file=sys.stderr)
        return 2
    if dev.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        print("grad_out_bench: --device cpu needs TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    if a.tile:
        os.environ["HOT_GRAD_OUT_TILE"] = a.tile
    import triton
    import triton.testing

    from hotcompile.kernels import grad_out, hadamard, hla

    dtype = getattr(torch, a.dtype)
    bench = triton.testing.do_bench_cudagraph if a.cuda_graph else triton.testing.do_bench

    def time_ms(fn) -> float:
        if dev.type == "cpu":        # smoke test only
            import time
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
            return sorted(times)[1]
        if a.cuda_graph:
            fn()                     # compile outside the capture
            torch.cuda.synchronize()
            return float(bench(fn, rep=a.rep, return_mode="median"))
        return float(bench(fn, warmup=a.warmup, rep=a.rep, return_mode="median"))

    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"cpu ({platform.machine()})"
    env = {"device": name, "torch": torch.__version__,
           "triton": triton.__version__, "python": platform.python_version(),
           "date": _dt.datetime.now().isoformat(timespec="seconds"),
           "timer": ("wall clock (cpu smoke test)" if dev.type == "cpu" else
                     "do_bench_cudagraph" if a.cuda_graph else "do_bench"), "dtype": a.dtype,
           "rank": a.rank, "select": a.select, "hq_bits": a.hq_bits, "hla_bits": a.hla_bits,
           "fp8": a.fp8, "tile_override": a.tile}
    print(f"# {env['device']}, torch {env['torch']}, triton {env['triton']}, {env['timer']} "
          f"median, g {a.dtype}, HQ {a.hq_bits}-bit{' e4m3' if a.fp8 else ''}, "
          f"HLA rank {a.rank} {a.select} {a.hla_bits}-bit")
    hq_seed = torch.tensor(1234, dtype=torch.int64, device=dev)
    hla_seed = torch.tensor(5678, dtype=torch.int64, device=dev)
    rows, failures = [], 0
    header = ("| L | O | HQ scale | tile BT,BC,W,HR | MB min | copy ms | copy TB/s | hq ms | "
              "hla ms | separate ms | combined ms | speed-up | sep TB/s (% copy) | "
              "comb TB/s (% copy) | bit-equal |")
    print(header)
    print("|" + "---|" * header.count(" | ") + "---|")
    for L, O in parse_shapes(a.shapes):
        for per_token in (bool(int(v)) for v in a.per_token.split(",") if v.strip()):
            row = {"L": L, "O": O, "per_token": per_token}
            try:
                torch.manual_seed(L + O)
                g = (torch.randn(L, O, device=dev) * 3).to(dtype)
                O_pad = -(-O // 16) * 16
                row["tile"] = list(grad_out.tile_shape(O_pad, dev.type == "cpu"))

                def separate():
                    hadamard.hq_act_quant(g, a.hq_bits, per_token, hq_seed, a.fp8)
                    hla.hla_quant(g, a.rank, a.select, a.hla_bits, stochastic=True,
                                  seed=hla_seed, transposed=True, pad_to=16)

                def combined():
                    grad_out.grad_out_quant(g, a.hq_bits, per_token, hq_seed, a.rank, a.select,
                                            a.hla_bits, hla_seed, fp8=a.fp8)

                if not a.no_check:
                    out = grad_out.grad_out_quant(g, a.hq_bits, per_token, hq_seed, a.rank,
                                                  a.select, a.hla_bits, hla_seed, fp8=a.fp8)
                    hq_q, hq_s = hadamard.hq_act_quant(g, a.hq_bits, per_token, hq_seed, a.fp8)
                    hla_q, hla_s = hla.hla_quant(g, a.rank, a.select, a.hla_bits,
                                                 stochastic=True, seed=hla_seed,
                                                 transposed=True, pad_to=16)
                    l_red = -(-L // 16) * a.rank
                    checks = {"hq_levels": _same(out[0], hq_q), "hq_scale": _same(out[1], hq_s),
                              "hla_levels": _same(out[2][:, :l_red], hla_q[:, :l_red]),
                              "hla_scale": _same(out[3], hla_s)}
                    row["bit_equal"] = all(checks.values())
                    if not row["bit_equal"]:
                        row["mismatch"] = [k for k, ok in checks.items() if not ok]
                        failures += 1
                    del out, hq_q, hq_s, hla_q, hla_s
                g_bytes = g.numel() * g.element_size()
                min_bytes = g_bytes + written_bytes(L, O, a.rank, per_token)
                copy_ms = time_ms(lambda: torch.empty_like(g).copy_(g))
                hq_ms = time_ms(lambda: hadamard.hq_act_quant(g, a.hq_bits, per_token, hq_seed,
                                                              a.fp8))
                hla_ms = time_ms(lambda: hla.hla_quant(g, a.rank, a.select, a.hla_bits,
                                                       stochastic=True, seed=hla_seed,
                                                       transposed=True, pad_to=16))
                sep_ms = time_ms(separate)
                comb_ms = time_ms(combined)
                copy_bw = 2 * g_bytes / copy_ms * 1e-9          # TB/s (bytes / ms * 1e3 / 1e12)
                sep_bw = min_bytes / sep_ms * 1e-9
                comb_bw = min_bytes / comb_ms * 1e-9
                row.update(min_bytes=min_bytes, copy_ms=copy_ms, copy_tbps=copy_bw, hq_ms=hq_ms,
                           hla_ms=hla_ms, separate_ms=sep_ms, combined_ms=comb_ms,
                           speedup=sep_ms / comb_ms, separate_tbps=sep_bw,
                           combined_tbps=comb_bw, separate_frac_copy=sep_bw / copy_bw,
                           combined_frac_copy=comb_bw / copy_bw)
                del g
            except torch.cuda.OutOfMemoryError as exc:        # report and go on
                row["error"] = f"out of memory: {str(exc)[:120]}"
            except Exception as exc:  # noqa: BLE001 - one shape failing must not hide the rest
                row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                failures += 1
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            rows.append(row)
            print(format_row(row), flush=True)
    if a.out:
        write(a.out, env, rows, header)
        print(f"# wrote {a.out}")
    if failures:
        print(f"# {failures} shape(s) NOT bit-equal or failed", file=sys.stderr)
    return 1 if failures else 0


def format_row(r: dict) -> str:
    scale = "token" if r["per_token"] else "tensor"
    if "error" in r:
        return f"| {r['L']} | {r['O']} | {scale} | | | | | | | | | | | | {r['error']} |"
    eq = {True: "yes", False: "NO: " + ",".join(r.get("mismatch", [])), None: "unchecked"}[
        r.get("bit_equal")]
    return (f"| {r['L']} | {r['O']} | {scale} | {','.join(map(str, r['tile']))} | "
            f"{r['min_bytes'] / 1e6:.0f} | {r['copy_ms']:.4f} | {r['copy_tbps']:.2f} | "
            f"{r['hq_ms']:.4f} | {r['hla_ms']:.4f} | {r['separate_ms']:.4f} | "
            f"{r['combined_ms']:.4f} | {r['speedup']:.2f}x | "
            f"{r['separate_tbps']:.2f} ({100 * r['separate_frac_copy']:.0f}%) | "
            f"{r['combined_tbps']:.2f} ({100 * r['combined_frac_copy']:.0f}%) | {eq} |")


def write(path: str, env: dict, rows: list, header: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if path.endswith(".md"):
        lines = [f"# grad_out_bench: {env['device']}, {env['date']}", "",
                 "```", json.dumps(env), "```", "", header,
                 "|" + "---|" * header.count(" | ") + "---|"]
        lines += [format_row(r) for r in rows]
        text = "\n".join(lines) + "\n"
    else:
        text = json.dumps({"environment": env, "rows": rows}, indent=1) + "\n"
    with open(path, "w") as f:
        f.write(text)


if __name__ == "__main__":
    sys.exit(main())
