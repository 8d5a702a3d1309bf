"""Fit the cost gate's per-kernel model (hotcompile/passes/cost.py) to a bench/layers.py run.

Every kernel of a HOT site and each bf16 GEMM is modelled as ``t = fixed + work / rate``:
``work`` is the bytes a transform kernel reads and writes, or the FLOPs of a GEMM. One
(fixed, rate) pair per kernel, least squares over the run's shapes (non-negative fixed
cost). Prints the table to paste into cost.py and the model's error per layer against the
measured CUDA-graph replays (no launch overhead) of the whole backward.

    python bench/fit_cost.py bench/results/layers_<date>_h100-80gb-hbm3.json
"""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hotcompile.passes.cost import H100, KERNELS, CostModel, site_kernels, work  # noqa: E402


def fit(points):
    """Least-squares (fixed_ms, ms per unit) of t = fixed + x * slope, fixed >= 0."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(t for _, t in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (t - my) for x, t in points) / sxx
    fixed = my - slope * mx
    if fixed < 0:     # through the origin
        fixed, slope = 0.0, sum(x * t for x, t in points) / sum(x * x for x, _ in points)
    return fixed, slope


def _abc_ms(t: dict) -> float:
    """ABC's GPU time: its CUDA-graph replay where the run has one (layers.py since the
    ninth stop), else the eager timing (host included: an over-estimate at small shapes)."""
    return t.get("abc_graph", t["abc"])


def fit_table(path: str):
    """(per-kernel table, fixed-cost factor, the run's layer rows, g_W GEMM key) fitted on
    the bench/layers.py result at ``path``: what cost.py's table must equal."""
    res = json.load(open(path))
    rows = res["layers"]
    table = {}
    for k in KERNELS:
        pts = []
        for r in rows:
            ms = (r["kernels"].get(k, {}) or {}).get("ms") if k not in r["gemm_ms"] else r["gemm_ms"][k]
            if ms is not None:
                pts.append((work(k, r["L"], r["I"], r["O"], 16, 16), ms))
        table[k] = fit(pts) if len(pts) >= 2 else H100.kernels[k]   # not timed in this run
    # per-kernel timings carry a launch gap each that CUDA-graph replays of the whole
    # backward do not: scale the HOT kernels' fixed costs by one factor fitted on those
    hot_k = [k for k in KERNELS if "bf16" not in k and not k.startswith("fwd_")]
    # what hot_sep_graph replays at rank 16 (+ abc), on the run's g_x and g_W paths
    gw_gemm = {r.get("gemm_format_hla", "int8") for r in rows}
    if len(gw_gemm) != 1:
        raise SystemExit(f"mixed g_W formats in one run: {gw_gemm}")
    gw_gemm = "hla_cublas" if gw_gemm.pop() == "e4m3" else "hla_int8"
    unit = site_kernels(True, True, 16, "hq_cublas", gw_gemm)
    def parts(r):
        """(fixed, variable) modelled ms of the layer's HOT backward, and the measured one:
        the separate-ops replay runs exactly the rank-16 kernel list (hot_tok_graph did too
        before 2026-11-23; in that day's 21:49 run it used the one-pass grad_out pair)."""
        fixed = sum(table[k][0] for k in unit)
        var = sum(table[k][1] * work(k, r["L"], r["I"], r["O"], 16, 16) for k in unit)
        t = r["times_ms"]
        return fixed, var, t.get("hot_sep_graph", t["hot_tok_graph"]) + _abc_ms(t)
    layers = [parts(r) for r in rows]
    lam = max(0.0, sum(f * (m - v) for f, v, m in layers) / sum(f * f for f, _, _ in layers))
    # ... but never so small that a layer's HOT time is under-estimated by more than 10%:
    # the gate must err towards exact (a wrongly rewritten site makes the model slower)
    lam = max([lam] + [(0.9 * m - v) / f + 1e-3 for f, v, m in layers])
    table = {k: ((c * lam, s) if k in hot_k else (c, s)) for k, (c, s) in table.items()}
    return table, lam, rows, gw_gemm


def main(path: str) -> None:
    table, lam, rows, gw_gemm = fit_table(path)
    print(f"fixed costs scaled by {lam:.3f} (fitted on whole-backward replays, raised until "
          f"no layer's HOT time is under-estimated by more than 10%)")
    model = CostModel(name=os.path.basename(path), kernels=table,
                      host_hot_ms=H100.host_hot_ms, host_exact_ms=H100.host_exact_ms)
    print("kernels = {")
    for k, (c, s) in table.items():
        print(f'    "{k}": ({c:.4f}, {s:.4e}),')
    print("}")
    print(f"\n{'layer':<20} {'exact meas':>10} {'model':>7} {'hot meas':>9} {'model':>7}")
    for r in rows:
        e, h = model.gpu_ms(r["L"], r["I"], r["O"], 16, 16, gw_gemm=gw_gemm)
        t = r["times_ms"]
        print(f"{r['group'] + ' ' + r['name']:<20} {t['bf16_graph']:>10.3f} {e:>7.3f} "
              f"{t.get('hot_sep_graph', t['hot_tok_graph']) + _abc_ms(t):>9.3f} {h:>7.3f}")


if __name__ == "__main__":
    main(sys.argv[1])
