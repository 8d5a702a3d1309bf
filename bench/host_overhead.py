"""Host (CPU) cost of one call of each HOT op and of its parts, on tiny tensors.

Why: a compiled step runs the ``hot::`` ops from Inductor's Python wrapper, one call per
linear layer and pass; when the host takes longer to issue a layer's kernels than the
GPU takes to run them, the step is host bound (bench/step_profile.py shows it as wall
time far above GPU busy time). On tiny tensors the GPU finishes each kernel in a few
microseconds, so the wall time of N back-to-back calls divided by N is the host cost.

    python bench/host_overhead.py [--n 200] [--cprofile]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def host_us(fn, n: int) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    host = time.perf_counter() - t
    torch.cuda.synchronize()
    return host / n * 1e6


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=200)
    p.add_argument("--L", type=int, default=256)
    p.add_argument("--O", type=int, default=256)
    p.add_argument("--I", type=int, default=256)
    p.add_argument("--cprofile", action="store_true")
    a = p.parse_args(argv)
    import triton
    import triton.language as tl

    from hotcompile.kernels import fused, gemm, hadamard, hla, ops
    from hotcompile.runtime.lqs import TABLE

    dev = torch.device("cuda")
    L, O, I = a.L, a.O, a.I
    g = torch.randn(L, O, device=dev, dtype=torch.bfloat16)
    w = torch.randn(O, I, device=dev, dtype=torch.bfloat16)
    x = torch.randn(L, I, device=dev, dtype=torch.bfloat16)
    seed = ops.draw_seed(dev)
    xq, xs = fused.abc_compress(x, 8)
    qg, sg = hadamard.hq_act_quant(g, 4, True, seed)
    qw, sw = hadamard.hq_weight_quant(w, 4)
    TABLE.set("site", True)

    @triton.jit
    def _noop(x_ptr, n, B: tl.constexpr):
        i = tl.arange(0, B)
        tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n), mask=i < n)

    buf = torch.zeros(16, device=dev)

    @torch.library.custom_op("hotbench::noop", mutates_args=())
    def noop(t: torch.Tensor, k: int, s: str) -> torch.Tensor:
        return t.new_empty(t.shape)

    @noop.register_fake
    def _(t, k, s):
        return t.new_empty(t.shape)

    cases = {
        "triton launch, trivial kernel": lambda: _noop[(1,)](buf, 16, B=16),
        "custom_op dispatch, empty body": lambda: torch.ops.hotbench.noop(buf, 1, "a"),
        "torch.empty": lambda: torch.empty((L, O), device=dev),
        "torch.randint (draw_seed)": lambda: ops.draw_seed(dev),
        "LQS lookup": lambda: TABLE.per_token("site", g, 4, 16),
        "gx_format": lambda: gemm.gx_format(g, I, 4, 8, True),
        "hq_weight_quant (2 launches)": lambda: hadamard.hq_weight_quant(w, 4),
        "hq_act_quant token (1 launch)": lambda: hadamard.hq_act_quant(g, 4, True, seed),
        "hq_act_quant tensor (2 launches)": lambda: hadamard.hq_act_quant(g, 4, False, seed),
        "hla_quant (2 launches)": lambda: hla.hla_quant(x, 8, "1d", 8, stochastic=False),
        "transpose_padded": lambda: gemm.transpose_padded(xq, 16),
        "scaled_mm": lambda: gemm.scaled_mm(qg, qw, sg, sw, 1 / 16, torch.bfloat16),
        "fused.hq_grad_input": lambda: fused.hq_grad_input(g, w, 4, True, seed),
        "fused.abc_compress": lambda: fused.abc_compress(x, 8),
        "fused.hla_grad_weight": lambda: fused.hla_grad_weight(g, xq, xs, 8, seed=seed),
        "hot::hq_grad_input": lambda: torch.ops.hot.hq_grad_input(g, w, 4, 4, 16, "lqs", "site", "auto"),
        "hot::abc_compress": lambda: torch.ops.hot.abc_compress(x, 8, 8, 16, 0, False, "auto"),
        "hot::hla_grad_weight": lambda: torch.ops.hot.hla_grad_weight(g, xq, xs, 8, 8, 16, 0, False, "", "auto"),
        "fused.linear_backward": lambda: fused.linear_backward(g, w, xq, xs, 8, 4, 8, 8, True, seed),
        "hot::linear_backward": lambda: torch.ops.hot.linear_backward(
            g, xq, xs, 8, 8, 16, 0, False, "", "auto", w, 4, 8, "lqs", "site"),
    }
    print(f"host microseconds per call (L={L}, O={O}, I={I}, n={a.n}, "
          f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__})")
    for name, fn in cases.items():
        print(f"  {name:40s} {host_us(fn, a.n):8.1f}")
    if a.cprofile:
        for name in ("hot::hq_grad_input", "hot::hla_grad_weight", "hot::linear_backward"):
            pr = cProfile.Profile()
            fn = cases[name]
            pr.enable()
            for _ in range(a.n):
                fn()
            pr.disable()
            torch.cuda.synchronize()
            s = io.StringIO()
            pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
            print(f"--- cProfile {name}, {a.n} calls, by own time")
            print(s.getvalue()[:6000])


if __name__ == "__main__":
    main()
