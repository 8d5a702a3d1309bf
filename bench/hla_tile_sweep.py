"""Tile sweep of the channel-major HLA kernels: g's stochastic e4m3 operand and ABC's saved x.

Why: the channel-major tile (``hla._tile_shape``: CPT channels per thread, BT token blocks
per program) was chosen before the 8-bit uniforms and the saved x's one-launch bound scale;
this re-times every (``HOT_HLA_CPT``, ``HOT_HLA_BT``) pair in (1, 2, 4)^2, and for g's side
programs of 2 and 4 32-byte runs taken one run per step (``HOT_HLA_STEP``, ``hla._stepped_blocks``),
and checks each bit for bit against the default tile (levels follow the element, not the
tile). The registers of every compiled variant are listed (they set the programs per SM). CUDA-graph
replays over rotating inputs (``layers.bench_graph``). The x side includes its max|x| as an
eager torch reduction (in a compiled graph Inductor fuses it with x's producer).

    python bench/hla_tile_sweep.py --out bench/results [--rank 8]
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench.common import stamp  # noqa: E402
from layers import bench_graph  # noqa: E402

from hotcompile.kernels import hla  # noqa: E402

SHAPES = {"g": ((8192, 4096), (8192, 11008), (12608, 3072), (12608, 768)),
          "x": ((8192, 4096), (8192, 11008), (12608, 768), (12608, 3072))}
KNOBS = ("HOT_HLA_CPT", "HOT_HLA_BT", "HOT_HLA_STEP")


def _set(cpt=None, bt=None, step=None) -> None:
    for k, v in zip(KNOBS, (cpt, bt, step)):
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = str(v)


def sweep(side: str, L: int, C: int, reps: int, rank: int = 16) -> dict:
    g_side = side == "g"
    seed = torch.tensor([7], device="cuda")
    kw = dict(stochastic=g_side, seed=seed if g_side else 0, seed_add=1 if g_side else 0,
              transposed=True, pad_to=16, e4m3=True, scale_mul=1 / 16 if g_side else 1.0)
    sets = [((torch.randn(L, C, device="cuda") * 1e-3).bfloat16(),) for _ in range(4)]

    def run(t):
        return hla.hla_quant(t, rank, "1d", 8, **kw)
    _set()
    ref = run(sets[0][0])
    res = {"side": side, "L": L, "C": C, "rank": rank, "default": bench_graph(run, sets, reps)}
    run_blocks = max(1, 32 // rank)      # blocks per 32-byte run of a channel
    tiles = [(cpt, bt, None) for cpt, bt in itertools.product((1, 2, 4), (1, 2, 4))]
    if g_side:
        tiles += [(cpt, None, f"{n * run_blocks},{run_blocks}") for cpt in (1, 2) for n in (2, 4)]
    for cpt, bt, step in tiles:
        _set(cpt, bt, step)
        name = f"cpt{cpt}_bt{bt}" if step is None else f"cpt{cpt}_step{step.replace(',', '_')}"
        try:
            out = run(sets[0][0])
            same = torch.equal(out[0].view(torch.uint8), ref[0].view(torch.uint8)) and \
                torch.equal(out[1], ref[1])
            res[name] = [bench_graph(run, sets, reps), same]
        except Exception as e:  # noqa: BLE001 - a tile that does not compile is a result
            res[name] = f"{type(e).__name__}: {str(e)[:80]}"
    _set()
    res["default_again"] = bench_graph(run, sets, reps)
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--rank", type=int, default=16)
    args = p.parse_args()
    rows = []
    for side, shapes in SHAPES.items():
        for L, C in shapes:
            rows.append(sweep(side, L, C, args.reps, args.rank))
            print(json.dumps(rows[-1]), flush=True)
    regs = sorted({f"{ck.n_regs} registers, {ck.n_spills} spills: {key}"
                   for caches in hla._hla_kernel.device_caches.values()
                   for key, ck in caches[0].items()})
    with open(os.path.join(args.out, f"hla_tile_sweep_{stamp()}_r{args.rank}.json"), "w") as f:
        json.dump({"rows": rows, "registers": regs}, f, indent=1)


if __name__ == "__main__":
    main()
