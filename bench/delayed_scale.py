"""Delayed vs dynamic scaling of the g_W path's e4m3 operands (``HOTConfig.gw_scaling``).

Why: the dynamic per-tensor scale costs a max pass over the operand before the pass that
quantizes it; the delayed scale (``reference.delayed_e4m3_scale``) quantizes in one pass
with the last call's amax and re-quantizes only when that would clamp or be over 2x loose.
This times, per shape, from CUDA-graph replays over rotating inputs larger than L2: the
dynamic kernels, the delayed ones in steady state (history primed, same distribution: the
counters say how many replays re-quantized), the delayed ones forced to re-quantize (the
first step's cost: the slot zeroed before each call), and a device copy of the same
bytes. It checks that a first delayed call is bit-identical to the dynamic one.

    python bench/delayed_scale.py --out bench/results
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench.common import device_name, stamp, write_json, write_text  # noqa: E402
from layers import bench_graph  # noqa: E402

from hotcompile.kernels import hla, reference as ref  # noqa: E402

G_SHAPES = (("llama g (O=4096)", 8192, 4096), ("llama g (O=11008)", 8192, 11008),
            ("vit fc1 g", 12608, 3072))
X_SHAPES = (("llama x (4096)", 8192, 4096), ("llama x (11008)", 8192, 11008),
            ("vit x", 12608, 768))


def _sets(L, C, n=4):
    return [((torch.randn(L, C, device="cuda") * 1e-3).bfloat16(),) for _ in range(n)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    p.add_argument("--reps", type=int, default=30)
    args = p.parse_args()
    block = torch.zeros((2 * ref.HISTORY_WORDS,), dtype=torch.int32, device="cuda")
    addr = torch.full((1,), block.data_ptr(), dtype=torch.int64, device="cuda")
    seed = torch.tensor([7], device="cuda")
    rows = []
    for side, shapes in (("g", G_SHAPES), ("x", X_SHAPES)):
        g_side = side == "g"
        kw = dict(stochastic=g_side, seed=seed if g_side else 0, seed_add=1 if g_side else 0,
                  transposed=True, pad_to=16, e4m3=True, scale_mul=1 / 16 if g_side else 1.0)
        for label, L, C in shapes:
            sets = _sets(L, C)
            dyn = lambda t: hla.hla_quant(t, 16, "1d", 8, **kw)                     # noqa: E731
            dly = lambda t: hla.hla_quant(t, 16, "1d", 8, history=(addr, 1), **kw)   # noqa: E731

            def first(t):
                block.zero_()
                return dly(t)
            block.zero_()
            a, b = dyn(sets[0][0]), dly(sets[0][0])
            same = torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)) and \
                torch.equal(a[1], b[1])
            res = {"dynamic_ms": bench_graph(dyn, sets, args.reps)}
            before = block[ref.HISTORY_WORDS + 1:ref.HISTORY_WORDS + 3].tolist()
            res["delayed_ms"] = bench_graph(dly, sets, args.reps)
            after = block[ref.HISTORY_WORDS + 1:ref.HISTORY_WORDS + 3].tolist()
            res["requantized"] = [after[1] - before[1], after[0] - before[0]]
            res["delayed_first_ms"] = bench_graph(first, sets, args.reps)
            src = torch.empty(L * C * 3 // 2, dtype=torch.uint8, device="cuda")
            dst = torch.empty_like(src)
            res["copy_ms"] = bench_graph(lambda s: dst.copy_(s), [(src,)], args.reps)
            res.update(kernel=f"hla_{side}", shape=label, L=L, C=C, first_call_bit_identical=same,
                       speedup=res["dynamic_ms"] / res["delayed_ms"])
            rows.append(res)
            print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in res.items()},
                  flush=True)
    name = device_name(torch.device("cuda"))
    meta = {"device": name, "rows": rows}
    path = os.path.join(args.out, f"delayed_scale_{stamp()}")
    write_json(path + ".json", meta)
    lines = [f"# Delayed vs dynamic e4m3 scale ({name})", "",
             "| kernel | shape | dynamic ms | delayed ms | speedup | re-quantized / calls "
             "| delayed, forced re-quantize ms | copy ms | first call = dynamic |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['kernel']} | {r['shape']} | {r['dynamic_ms']:.4f} | "
                     f"{r['delayed_ms']:.4f} | {r['speedup']:.2f}x | {r['requantized'][0]} / "
                     f"{r['requantized'][1]} | {r['delayed_first_ms']:.4f} | {r['copy_ms']:.4f} "
                     f"| {r['first_call_bit_identical']} |")
    write_text(path + ".md", "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
