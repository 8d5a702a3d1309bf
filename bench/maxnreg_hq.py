"""HQ g per token (as the site runs it: e4m3 levels, row maxima) under Triton register caps
(``maxnreg``): bytes against the uncapped kernel, ms from CUDA-graph replays
(``layers.bench_graph``), at Llama's and ViT-B's widths and the 32000-way head.

Why: Nsight Compute found the kernel latency-bound at 25% occupancy, which its 121
registers cap (bench/NOTES_kernels.md, thirty-fourth stop). A cap would allow more warps.
Result on an H200 (``results/maxnreg_hq_2026-11-29_h200.json``): no cap is clearly faster.
At 4096 and 3072 every cap is within 3% of none. At 11008 and 32000, caps of 96 and below
are slower, 1.38x and 1.45x at 64 (spills).

    python bench/maxnreg_hq.py          # writes $OUT (default /tmp)/maxnreg_hq_<date>_<device>.json
"""
import json, os, sys, time
import torch
sys.path.insert(0, os.path.join(os.getcwd(), "bench"))
from layers import bench_graph
from hotcompile.kernels import hadamard as H

def capped(r):
    def go(kernel, grid, *a, **m):
        if r:
            m["maxnreg"] = r
        return kernel[grid](*a, **m)
    return go

seed = torch.tensor([7], device="cuda", dtype=torch.int64)
rows = []
for L, O in ((8192, 4096), (8192, 11008), (12608, 3072), (8192, 32000)):
    gen = torch.Generator(device="cuda").manual_seed(0)
    xs = [torch.randn(L, O, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(3)]
    run = lambda g: H.hq_act_quant(g, 4, True, seed, fp8=True, row_max=True)
    H.launch = capped(None)
    ref = [t.clone() for t in run(xs[0])]
    res = {"L": L, "O": O}
    for r in (None, 128, 96, 80, 72, 64):
        H.launch = capped(r)
        try:
            out = run(xs[0])
            same = all(torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                                   b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)
                       for a, b in zip(out, ref))
            res[str(r)] = (round(bench_graph(run, [(x,) for x in xs]), 4), same)
        except Exception as e:  # noqa: BLE001
            res[str(r)] = f"failed: {type(e).__name__}: {str(e)[:100]}"
    H.launch = capped(None)
    res["None again"] = round(bench_graph(run, [(x,) for x in xs]), 4)
    rows.append(res)
    print(json.dumps(res), flush=True)
name = f"maxnreg_hq_{time.strftime('%Y-%m-%d')}_{torch.cuda.get_device_name().split()[-1].lower()}.json"
with open(os.path.join(os.environ.get("OUT", "/tmp"), name), "w") as f:
    json.dump(rows, f, indent=1)
