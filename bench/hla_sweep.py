"""HLA kernel variants at Llama d4096 / ViT-B shapes, timed by CUDA-graph replay against a
copy of the same bytes (the issue's 80%-of-copy measure).

Why: the phase-2 HLA kernel (quantize + transposed store) sat at the 255-register cap
(bench/kernel_regs.py) and ran 3x slower than phase 1 (ncu, 2026-11-24: 226 vs 72 us at
8192 x 11008, 12% occupancy). This times the knobs the launcher reads per call: the
coefficient chunk quantized at a time (HOT_HLA_CHUNK) and a register cap (HOT_HLA_MAXNREG),
for g (stochastic, transposed) and x (nearest, the ABC buffer), int8 and e4m3.

    python bench/hla_sweep.py --out $OUT
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import layers as LY  # noqa: E402

from hotcompile.kernels import hla as HL  # noqa: E402

SHAPES = {"llama_mlp_g": (8192, 11008), "llama_attn_g": (8192, 4096), "vit_fc1_g": (12608, 3072),
          "vit_x": (12608, 768)}
VARIANTS = [("16", ""), ("8", ""), ("4", ""), ("8", "128"), ("8", "168"), ("16", "168")]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=".")
    p.add_argument("--rank", type=int, default=16)
    a = p.parse_args()
    seed = torch.tensor(3, device="cuda")
    copies, rows = {}, []
    for name, (L, C) in SHAPES.items():
        n = LY.n_sets_for(2 * L * C)
        sets = [(torch.randn(L, C, device="cuda", dtype=torch.bfloat16),) for _ in range(n)]
        lr = -(-L // 16) * a.rank
        nbytes = 2 * L * C + lr * C
        c = LY.copy_ms(nbytes // 2, copies)
        for fmt in ("e4m3", "int8"):
            for stochastic in (True, False):
                for ch, nreg in VARIANTS:
                    fn = lambda x, st=stochastic, f=fmt: HL.hla_quant(
                        x, a.rank, "1d", 8, stochastic=st, seed=seed, transposed=True, pad_to=16,
                        e4m3=f == "e4m3")
                    fn = LY._with_env("HOT_HLA_CHUNK", ch, fn)
                    if nreg:
                        fn = LY._with_env("HOT_HLA_MAXNREG", nreg, fn)
                    try:
                        ms = LY.bench_graph(fn, sets)
                    except Exception as e:  # noqa: BLE001
                        rows.append(dict(shape=name, fmt=fmt, stochastic=stochastic, chunk=ch,
                                         maxnreg=nreg, error=str(e)[:200]))
                        continue
                    rows.append(dict(shape=name, L=L, C=C, fmt=fmt, stochastic=stochastic,
                                     chunk=ch, maxnreg=nreg, ms=ms, pct_of_copy=100 * c / ms))
                    print(f"{name:14s} {fmt} sr={int(stochastic)} ch={ch:>2s} nreg={nreg or '-':>4s}"
                          f" {ms * 1e3:8.1f} us {100 * c / ms:5.1f}% of copy", flush=True)
        del sets
        torch.cuda.empty_cache()
    with open(os.path.join(a.out, "hla_sweep.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), rank=a.rank, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
