"""HQ g per token (as the site runs it: e4m3 levels, row maxima) under Triton register caps
(``maxnreg``): bytes against the uncapped kernel, ms from CUDA-graph replays
(``layers.bench_graph``), at Llama's and ViT-B's widths and the 32000-way head.

Why: Nsight Compute found the kernel latency-bound at 25% occupancy, which its 121
registers cap (bench/NOTES_kernels.md, thirty-fourth stop). A cap would allow more warps.
Result on an H200 (``results/maxnreg_hq_2026-11-29_h200.json``): no cap is clearly faster.
At 4096 and 3072 every cap is within 3% of none. At 11008 and 32000, caps of 96 and below
are slower, 1.38x and 1.45x at 64 (spills).

    python bench/maxnreg_hq.py --out $OUT    # <out>/maxnreg_hq_<date>_<device>.json
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
from hotcompile.kernels import hadamard as H  # noqa: E402

SHAPES = ((8192, 4096), (8192, 11008), (12608, 3072), (8192, 32000))
CAPS = (None, 128, 96, 80, 72, 64)


def capped(r):
    """``launch`` with Triton's ``maxnreg`` set to r (None: no cap)."""
    def go(kernel, grid, *a, **m):
        return kernel[grid](*a, **m, **({"maxnreg": r} if r else {}))
    return go


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    a = p.parse_args(argv)
    seed = torch.tensor([7], device="cuda", dtype=torch.int64)
    real, rows = H.launch, []
    try:
        for L, O in SHAPES:
            gen = torch.Generator(device="cuda").manual_seed(0)
            xs = [torch.randn(L, O, device="cuda", generator=gen, dtype=torch.bfloat16)
                  for _ in range(3)]

            def run(g):
                return H.hq_act_quant(g, 4, True, seed, fp8=True, row_max=True)
            H.launch = capped(None)
            ref = [t.clone() for t in run(xs[0])]
            res = {"L": L, "O": O}
            for r in CAPS:
                H.launch = capped(r)
                try:
                    ok = mismatch(run(xs[0]), ref) == 0.0
                    res[str(r)] = (round(bench_graph(run, [(x,) for x in xs]), 4), ok)
                except Exception as e:  # noqa: BLE001  (a cap that does not compile)
                    res[str(r)] = f"failed: {type(e).__name__}: {str(e)[:100]}"
            H.launch = capped(None)
            res["None again"] = round(bench_graph(run, [(x,) for x in xs]), 4)
            rows.append(res)
            print(json.dumps(res), flush=True)
    finally:
        H.launch = real
    C.write_json(C.result_base(a.out, "maxnreg_hq", torch.device("cuda")) + ".json", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
