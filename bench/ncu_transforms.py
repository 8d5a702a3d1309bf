"""Run each HOT transform kernel once at a Llama d4096 shape, for Nsight Compute.

Why: bench/layers.py says how long the transforms take against the copy-bandwidth floor;
this says why (memory vs issue bound, stalls, occupancy), e.g.

    ncu --clock-control none --kernel-name regex:'_hla|_hq_|_transpose' \
        --section SpeedOfLight --section WarpStateStats --section Occupancy \
        python bench/ncu_transforms.py --tokens 8192 --out-features 11008 --in-features 4096
"""
from __future__ import annotations

import argparse

import torch

from hotcompile.kernels import gemm, hadamard, hla


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--out-features", type=int, default=11008)
    p.add_argument("--in-features", type=int, default=4096)
    p.add_argument("--rank", type=int, default=16)
    a = p.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    g = torch.randn(a.tokens, a.out_features, device=dev, generator=gen, dtype=torch.bfloat16)
    x = torch.randn(a.tokens, a.in_features, device=dev, generator=gen, dtype=torch.bfloat16)
    w = torch.randn(a.out_features, a.in_features, device=dev, generator=gen,
                    dtype=torch.bfloat16) * 0.02
    seed = torch.tensor(7, device=dev)
    for _ in range(2):          # the first round compiles; profile with --launch-skip
        hadamard.hq_act_quant(g, 4, True, seed, fp8=True)
        hadamard.hq_weight_quant(w, 8, e4m3=True, scale_mul=1 / 16)
        hla.hla_quant(g, a.rank, "1d", 8, stochastic=True, seed=seed, seed_add=1,
                      transposed=True, pad_to=16)
        xt, _ = hla.hla_quant(x, a.rank, "1d", 8, stochastic=False)
        gemm.transpose_padded(xt, 16)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
