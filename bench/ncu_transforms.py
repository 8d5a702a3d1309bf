"""Run each HOT transform kernel once at a Llama d4096 shape, for Nsight Compute.

Why: bench/layers.py says how long the transforms take against the copy-bandwidth floor;
this says why (memory vs issue bound, stalls, occupancy). The calls are the ones a site
makes on a GPU with FP8 tensor cores (e4m3 operands, K-major HLA buffers); ``--int8``
runs the INT8 path of other GPUs instead. Each round launches 6 HOT kernels (HQ g, W,
g's HLA operand in 2 phases, ABC in 2), e.g.

    ncu --clock-control none --kernel-name regex:'_hla|_hq_' --launch-skip 6 --launch-count 6 \
        --section SpeedOfLight --section WarpStateStats --section Occupancy \
        python bench/ncu_transforms.py --tokens 8192 --out-features 11008 --in-features 4096
"""
from __future__ import annotations

import argparse

import torch

from hotcompile.kernels import hadamard, hla


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--out-features", type=int, default=11008)
    p.add_argument("--in-features", type=int, default=4096)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--int8", action="store_true", help="the INT8 path (GPUs without FP8)")
    a = p.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    g = torch.randn(a.tokens, a.out_features, device=dev, generator=gen, dtype=torch.bfloat16)
    x = torch.randn(a.tokens, a.in_features, device=dev, generator=gen, dtype=torch.bfloat16)
    w = torch.randn(a.out_features, a.in_features, device=dev, generator=gen,
                    dtype=torch.bfloat16) * 0.02
    seed = torch.tensor(7, device=dev)
    e4m3 = not a.int8
    for _ in range(2):          # the first round compiles; profile with --launch-skip
        hadamard.hq_act_quant(g, 4, True, seed, fp8=True)
        hadamard.hq_weight_quant(w, 8, fp8=True, e4m3=e4m3, scale_mul=1 / 16)
        hla.hla_quant(g, a.rank, "1d", 8, stochastic=True, seed=seed, seed_add=1,
                      transposed=True, pad_to=16, e4m3=e4m3)
        hla.hla_quant(x, a.rank, "1d", 8, stochastic=False, transposed=True, pad_to=16,
                      e4m3=e4m3)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
