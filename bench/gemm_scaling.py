"""cuBLAS FP8 GEMM speed by scaling granularity, at HOT's own backward shapes.

Why: a per-tensor scale (HLA's g and x operands, the W operand) needs the global amax of
its tensor before the first level can be written, so every such operand costs a second
pass over its input (phase 1: amax, phase 2: quantize), plus a zeroed workspace. Scales
per block of 128 along the reduction axis (cuBLAS 12.9+ on sm_90: ``1x128`` per row and
``128x128`` tiles) are local to a tile a kernel already holds, so every operand could be
written in one pass. Whether that pays depends on what the block-scaled GEMM costs
against the tensor-wise and row-wise ones; this script measures it, checking each result
against the dequantized operands (random power-of-two scales, so a misread scale layout
shows as a large error, not a silent pass).

    python bench/gemm_scaling.py [--shapes llama,vit] [--reps 30]

Writes bench/results/gemm_scaling_<time>_<device>.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

E4M3 = torch.float8_e4m3fn

# (name, M, K, N): g_x = g~ (L x O) @ W~ (O x I): M=L, K=O, N=I;
# g_W = g~_L^T (O x L') @ x~ (L' x I): M=O, K=L', N=I (L' = L at rank 16, L/2 at rank 8)
SHAPES = {
    "llama": [("g_x attn 4096->4096", 8192, 4096, 4096),
              ("g_x gate/up 4096->11008", 8192, 11008, 4096),
              ("g_x down 11008->4096", 8192, 4096, 11008),
              ("g_W attn r16", 4096, 8192, 4096),
              ("g_W gate/up r16", 11008, 8192, 4096),
              ("g_W down r16", 4096, 8192, 11008),
              ("g_W gate/up r8", 11008, 4096, 4096)],
    "vit": [("g_x qkv 768->2304", 12608, 2304, 768),
            ("g_x proj 768->768", 12608, 768, 768),
            ("g_x fc1 768->3072", 12608, 3072, 768),
            ("g_x fc2 3072->768", 12608, 768, 3072),
            ("g_W qkv r16", 2304, 13312, 768),
            ("g_W fc1 r16", 3072, 13312, 768),
            ("g_W fc2 r16", 768, 13312, 3072)],
}


def _pow2_scales(*shape, device):
    """Random powers of two in [1/8, 8]: exact to multiply, and a transposed or shifted
    scale layout changes the product by factors up to 64."""
    return torch.exp2(torch.randint(-3, 4, shape, device=device).float())


def _blocks(n: int) -> int:
    return -(-n // 128)


def variants(M: int, K: int, N: int, device):
    """{name: (callable, reference fp32 result)} for one shape; operands are e4m3 values
    of N(0, 1) data, the reference the fp64 product of the dequantized operands."""
    a8 = torch.randn(M, K, device=device).to(E4M3)
    b8 = torch.randn(N, K, device=device).to(E4M3)          # B given K-major: (N, K)
    a, b = a8.double(), b8.double()
    kb = _blocks(K)
    out = {}
    ab16 = (a8.to(torch.bfloat16), b8.to(torch.bfloat16))
    out["bf16"] = (lambda: ab16[0] @ ab16[1].t(), (a @ b.t()))
    st_a, st_b = torch.tensor(0.5, device=device), torch.tensor(2.0, device=device)
    out["fp8 tensorwise"] = (lambda: torch._scaled_mm(a8, b8.t(), st_a, st_b,
                                                      out_dtype=torch.bfloat16),
                             (a @ b.t()))
    sr_a, sr_b = _pow2_scales(M, 1, device=device), _pow2_scales(1, N, device=device)
    out["fp8 rowwise"] = (lambda: torch._scaled_mm(a8, b8.t(), sr_a, sr_b,
                                                   out_dtype=torch.bfloat16),
                          (a * sr_a.double()) @ (b * sr_b.double().t()).t())
    # block scales through torch.nn.functional.scaled_mm (the legacy _scaled_mm infers the
    # recipe from the scale shapes and rejects 1x128 x 1x128 on torch 2.11):
    # 1x128 (A): (M, K/128), strides (1, M); 1x128 (B): (N, K/128), strides (1, N);
    # 128x128 (B): (round_up(K/128, 4), N/128), strides (1, round_up(K/128, 4))
    F = torch.nn.functional
    if not hasattr(F, "scaled_mm"):
        return out
    st = F.ScalingType if hasattr(F, "ScalingType") else F._ScalingType
    sa = _pow2_scales(kb, M, device=device).t()
    sb = _pow2_scales(kb, N, device=device).t()
    a_deq = a * sa.double().repeat_interleave(128, 1)[:, :K]
    b_deq = b * sb.double().repeat_interleave(128, 1)[:, :K]
    out["fp8 1x128 x 1x128"] = (
        lambda: F.scaled_mm(a8, b8.t(), sa, st.BlockWise1x128, sb, st.BlockWise1x128,
                            output_dtype=torch.bfloat16),
        a_deq @ b_deq.t())
    kb4 = -(-kb // 4) * 4
    sbt = _pow2_scales(_blocks(N), kb4, device=device).t()       # (kb4, N/128), strides (1, kb4)
    b_tile = sbt.double()[:kb].t().repeat_interleave(128, 0)[:N].repeat_interleave(128, 1)[:, :K]
    out["fp8 1x128 x 128x128"] = (
        lambda: F.scaled_mm(a8, b8.t(), sa, st.BlockWise1x128, sbt, st.BlockWise128x128,
                            output_dtype=torch.bfloat16),
        a_deq @ (b * b_tile).t())
    return out


def _time(fn, reps: int) -> float:
    """Median ms of ``reps`` back-to-back launches, each between two device events."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        fn()
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1))
    return statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="llama,vit")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    a = p.parse_args(argv)
    dev = torch.device("cuda")
    name = torch.cuda.get_device_name()
    rows = []
    for group in a.shapes.split(","):
        for label, M, K, N in SHAPES[group]:
            torch.manual_seed(0)
            vs = variants(M, K, N, dev)
            # side by side: every variant timed in turn, twice, the better median kept
            res = {}
            for rnd in range(2):
                for v, (fn, ref) in vs.items():
                    try:
                        t = _time(fn, a.reps)
                    except Exception as e:   # an unsupported scaling: say so, keep going
                        res[v] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"}
                        continue
                    if rnd == 0:
                        err = ((fn().double() - ref).norm() / ref.norm()).item()
                        res[v] = {"ms": t, "rel_err": err}
                    else:
                        res[v]["ms"] = min(res[v]["ms"], t)
            flops = 2 * M * K * N
            for v, r in res.items():
                if "ms" in r:
                    r["tflops"] = flops / r["ms"] / 1e9
                    r["vs_bf16"] = res["bf16"]["ms"] / r["ms"]
            rows.append({"shape": label, "M": M, "K": K, "N": N, "results": res})
            print(label, {v: (round(r["ms"], 4), round(r["rel_err"], 5)) if "ms" in r else r
                          for v, r in res.items()}, flush=True)
    stamp = time.strftime("%Y-%m-%dT%H%M%S")
    tag = name.lower().replace("nvidia ", "").replace(" ", "-")
    os.makedirs(a.out, exist_ok=True)
    base = os.path.join(a.out, f"gemm_scaling_{stamp}_{tag}")
    meta = {"device": name, "torch": torch.__version__,
            "cublas": torch.backends.cuda.preferred_blas_library().name
            if hasattr(torch.backends.cuda, "preferred_blas_library") else "?",
            "cuda": torch.version.cuda, "time": stamp, "reps": a.reps}
    with open(base + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    names = list(rows[0]["results"])
    lines = [f"# FP8 GEMM by scaling granularity: {name}", "",
             f"torch {torch.__version__}, CUDA {torch.version.cuda}, {stamp}; median of "
             f"{a.reps} events per variant, better of two rounds; rel. error against the "
             "fp64 product of the dequantized operands; ratio = bf16 ms / variant ms.", "",
             "| shape | M | K | N | " + " | ".join(names) + " |",
             "|---|---|---|---|" + "---|" * len(names)]
    for r in rows:
        cells = []
        for v in names:
            x = r["results"][v]
            cells.append(f"{x['ms']:.4f} ms {x['vs_bf16']:.2f}x (err {x['rel_err']:.1e})"
                         if "ms" in x else f"n/a: {x['error'][:60]}")
        lines.append(f"| {r['shape']} | {r['M']} | {r['K']} | {r['N']} | " + " | ".join(cells) + " |")
    with open(base + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
