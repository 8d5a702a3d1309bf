"""The FP8 forward per layer (``HOTConfig(forward="fp8")``): bf16 GEMM vs casts + FP8 GEMM.

Why: the forward cost gate (``passes/cost.py``, ``predict_forward``) needs three lines
measured on the device: the FP8 GEMM, the cast of x and the cast of W, each as
``fixed + slope * work``. Each variant is compiled by Inductor exactly as the pass emits
it (``kernels.fp8_forward``, static shapes, as in a training graph), timed as GPU time (CUDA
graph replays over two input sets: the cost gate compares GPU times) and, for the whole
forward both ways, also as calls with their host gaps (triton's do_bench), and checked
against the eager reference twin. Prints the fitted lines in
the cost table's format.

    python bench/forward_layers.py [--out DIR] [--tag T]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import common as C  # noqa: E402
from layers import LAYERS, bench, bench_graph  # noqa: E402
from fit_cost import fit  # noqa: E402

from hotcompile.kernels import fp8_forward as F8  # noqa: E402
from hotcompile.passes.cost import H100, work  # noqa: E402

# the Llama d4096 bench model's own shapes (4 x 2048 tokens; MLP 11008)
EXTRA = [("Llama d4096", "qkv", 8192, 4096, 12288), ("Llama d4096", "o", 8192, 4096, 4096),
         ("Llama d4096", "gate_up", 8192, 4096, 22016), ("Llama d4096", "down", 8192, 11008, 4096)]


def _fns():
    """Freshly compiled functions (one set per shape: static kernels, no recompile limit)."""
    torch._dynamo.reset()

    def bf16(x, w):
        return x @ w.t()

    def fp8(x, w):
        return F8.fp8_linear(x, w.t())

    def fp8_row(x, w):
        return F8.fp8_linear(x, w.t(), rowwise=True)

    def cast_x(x, w):
        return F8.e4m3_cast(x, contiguous=True)

    def cast_w(x, w):
        return F8.weight_operand(w.t())

    def cast_x_row(x, w):
        return F8.e4m3_cast(x, rowwise=True, contiguous=True)

    return {f.__name__: torch.compile(f, dynamic=False)
            for f in (bf16, fp8, fp8_row, cast_x, cast_w, cast_x_row)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    p.add_argument("--tag", default="")
    args = p.parse_args()
    dev = torch.device("cuda")
    rows = []
    layers = [l for l in LAYERS if l[0] == "ViT-B/16 bs64" or l[1] == "fc1"] + EXTRA
    for group, name, L, I, O in [l for l in layers if l[0] != "GPT d=2048"]:
        sets = [(torch.randn(L, I, device=dev, dtype=torch.bfloat16),
                 torch.randn(O, I, device=dev, dtype=torch.bfloat16) / I ** 0.5)
                for _ in range(2)]
        x, w = sets[0]
        fns = _fns()
        got, want = fns["fp8"](x, w), F8.fp8_linear(x, w.t())
        err_ref = ((got.float() - want.float()).norm() / want.float().norm()).item()
        exact = x.float() @ w.float().t()
        err_exact = ((got.float() - exact).norm() / exact.norm()).item()
        xq, sx = F8.e4m3_cast(x, contiguous=True)
        wq, sw = F8.weight_operand(w.t())
        gemm = lambda a, b, ops=(xq, sx, wq, sw): F8.scaled_linear(  # noqa: E731
            *ops, None, torch.bfloat16)
        t = {k: bench_graph(f, sets) for k, f in fns.items()}           # GPU time only
        t["gemm_fp8"] = bench_graph(gemm, sets)
        xr, sxr = F8.e4m3_cast(x, rowwise=True, contiguous=True)
        wr, swr = F8.weight_operand(w.t(), rowwise=True)
        t["gemm_fp8_row"] = bench_graph(lambda a, b, ops=(xr, sxr, wr, swr): F8.scaled_linear(
            *ops, None, torch.bfloat16), sets)
        t["calls_bf16"] = bench(fns["bf16"], sets)                        # with host gaps
        t["calls_fp8"] = bench(fns["fp8"], sets)
        rows.append(dict(group=group, name=name, L=L, I=I, O=O, ms=t, err_vs_reference=err_ref,
                         err_vs_exact=err_exact))
        print(f"{group:<14} {name:<8} bf16 {t['bf16']:.3f}  fp8 {t['fp8']:.3f} "
              f"({t['bf16'] / t['fp8']:.2f}x)  gemm {t['gemm_fp8']:.3f}  cast x {t['cast_x']:.3f}"
              f"  cast w {t['cast_w']:.3f}  row: fp8 {t['fp8_row']:.3f} gemm {t['gemm_fp8_row']:.3f}"
              f" cast x {t['cast_x_row']:.3f}  calls bf16/fp8 {t['calls_bf16']:.3f}/{t['calls_fp8']:.3f}"
              f"  err vs ref {err_ref:.1e}  vs exact {err_exact:.3f}",
              flush=True)
        del sets, x, w, xq, wq, xr, wr, got, want, exact
        torch.cuda.empty_cache()
    lines = {}
    for k, col in (("fwd_fp8", "gemm_fp8"), ("fwd_bf16", "bf16"), ("fwd_cast_x", "cast_x"),
                   ("fwd_cast_w", "cast_w")):
        lines[k] = fit([(work(k, r["L"], r["I"], r["O"], 16, 16), r["ms"][col]) for r in rows])
        print(f'    "{k}": ({lines[k][0]:.4f}, {lines[k][1]:.4e}),   # table: {H100.kernels[k]}')
    dev_name = C.device_name(dev)
    base = C.result_base(args.out, "forward_layers", dev, args.tag)
    C.write_json(base + ".json", dict(kind="forward_layers", env=C.environment(dev), rows=rows,
                                      fitted=lines))
    text = [f"# FP8 forward per layer: {dev_name}", "",
            f"torch {torch.__version__}, git {C.git_commit()}, {C.stamp()}. GPU ms (median of "
            "CUDA-graph replays) of Inductor-compiled functions, bf16 operands; fp8 = casts + "
            "GEMM as the pass emits them; calls = the same two as plain calls (host gaps "
            "included).", "",
            "| layer | L | I | O | bf16 | fp8 | speed-up | FP8 GEMM | cast x | cast W | "
            "row-wise fp8 / GEMM / cast x | calls bf16 / fp8 | err vs twin | err vs exact |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        t = r["ms"]
        text.append(f"| {r['group']} {r['name']} | {r['L']} | {r['I']} | {r['O']} | "
                    f"{t['bf16']:.3f} | {t['fp8']:.3f} | {t['bf16'] / t['fp8']:.2f}x | "
                    f"{t['gemm_fp8']:.3f} | {t['cast_x']:.3f} | {t['cast_w']:.3f} | "
                    f"{t['fp8_row']:.3f} / {t['gemm_fp8_row']:.3f} / {t['cast_x_row']:.3f} | "
                    f"{t['calls_bf16']:.3f} / {t['calls_fp8']:.3f} | {r['err_vs_reference']:.1e} | {r['err_vs_exact']:.4f} |")
    text += ["", "Fitted lines (fixed ms, ms per unit of work):", ""]
    text += [f"- `{k}`: ({v[0]:.4f}, {v[1]:.4e})" for k, v in lines.items()]
    C.write_text(base + ".md", "\n".join(text) + "\n")
    print("wrote", base + ".md")


if __name__ == "__main__":
    main()
