"""HQ g per token (as the site runs it: e4m3 levels, row maxima) under Triton register caps
(``maxnreg``): bytes against the uncapped kernel, ms from CUDA-graph replays
(``layers.bench_graph``), at Llama's and ViT-B's widths and the 32000-way head.
``--kernel hla_g``: g's HLA operand instead (stochastic e4m3, K-major, on its token-block
bound computed beforehand), at Llama's and ViT-B's widths.

Why: Nsight Compute found the kernel latency-bound at 25% occupancy, which its 121
registers cap (bench/NOTES_kernels.md, thirty-fourth stop). A cap would allow more warps.
Result on an H200 (``results/maxnreg_hq_2026-11-29_h200.json``): no cap is clearly faster.
At 4096 and 3072 every cap is within 3% of none. At 11008 and 32000, caps of 96 and below
are slower, 1.38x and 1.45x at 64 (spills).

    python bench/maxnreg_hq.py --out $OUT    # <out>/maxnreg_hq_<date>_<device>.json
    python bench/maxnreg_hq.py --kernel hla_g --out $OUT    # <out>/maxnreg_hla_g_<date>_..

Fifty-third stop (``maxnreg_hla_g_2026-12-01..``): see docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402
from kernel_ab import mismatch  # noqa: E402
from layers import bench_graph  # noqa: E402
from hotcompile.kernels import hadamard as H, hla as HL  # noqa: E402

SHAPES = {"hq_g": ((8192, 4096), (8192, 11008), (12608, 3072), (8192, 32000)),
          "hla_g": ((8192, 4096), (8192, 11008), (12608, 3072))}
CAPS = {"hq_g": (None, 128, 96, 80, 72, 64), "hla_g": (None, 72, 64, 56)}


def capped(r):
    """``launch`` with Triton's ``maxnreg`` set to r (None: no cap)."""
    def go(kernel, grid, *a, **m):
        return kernel[grid](*a, **m, **({"maxnreg": r} if r else {}))
    return go


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    p.add_argument("--kernel", choices=sorted(SHAPES), default="hq_g")
    a = p.parse_args(argv)
    seed = torch.tensor([7], device="cuda", dtype=torch.int64)
    mod = H if a.kernel == "hq_g" else HL
    real, rows = mod.launch, []
    try:
        for L, O in SHAPES[a.kernel]:
            gen = torch.Generator(device="cuda").manual_seed(0)
            xs = [torch.randn(L, O, device="cuda", generator=gen, dtype=torch.bfloat16)
                  for _ in range(3)]
            bound = {id(x): HL.token_block_bound_bits(x) for x in xs}

            def run(g):
                if a.kernel == "hq_g":
                    return H.hq_act_quant(g, 4, True, seed, fp8=True, row_max=True)
                return HL.hla_quant(g, 16, "1d", 8, amax=bound[id(g)], stochastic=True,
                                    seed=seed, seed_add=1, transposed=True, pad_to=16,
                                    e4m3=True, scale_mul=1 / 16)
            mod.launch = capped(None)
            ref = [t.clone() for t in run(xs[0])]
            res = {"kernel": a.kernel, "L": L, "O": O}
            for r in CAPS[a.kernel]:
                mod.launch = capped(r)
                try:
                    ok = mismatch(run(xs[0]), ref) == 0.0
                    res[str(r)] = (round(bench_graph(run, [(x,) for x in xs]), 4), ok)
                except Exception as e:  # noqa: BLE001  (a cap that does not compile)
                    res[str(r)] = f"failed: {type(e).__name__}: {str(e)[:100]}"
            mod.launch = capped(None)
            res["None again"] = round(bench_graph(run, [(x,) for x in xs]), 4)
            rows.append(res)
            print(json.dumps(res), flush=True)
    finally:
        mod.launch = real
    name = "maxnreg_hq" if a.kernel == "hq_g" else f"maxnreg_{a.kernel}"
    C.write_json(C.result_base(a.out, name, torch.device("cuda")) + ".json", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
