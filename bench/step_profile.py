"""Where one training step's time goes: torch.profiler over a few steps, per mode.

Why a separate script: bench/train.py answers "how fast"; this answers "why". For each
(model, mode) it compiles the step exactly as train.py does, warms up, then profiles
``--steps`` steps and reports, per step:

* wall time (host) and GPU busy time (sum of kernel durations): a wall far above the busy
  time means the step is launch/host bound, not kernel bound;
* kernel launches per step;
* device time by category: HOT's own kernels (HQ, HLA, GEMM, transposes, seed draws),
  other GEMMs (cuBLAS/CUTLASS), attention, Inductor's fused Triton kernels, the rest;
* host time spent inside the ``hot::`` custom ops;
* the top kernels by device time.

    python bench/step_profile.py --models vit_b16_bs64 --modes inductor,hot [--compile-mode reduce-overhead]

Writes ``{out}/profile_{stamp}_{device}[_{tag}].md`` and ``.json`` (and a chrome trace per
run with ``--trace``).
"""
from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402
import train as T   # noqa: E402

HOT_KERNELS = {
    "_hq_token_kernel": "hot: HQ quantize g (per token)",
    "_hq_tensor_kernel": "hot: HQ quantize g (per tensor)",
    "_hq_weight_kernel": "hot: HQ quantize W",
    "_hla_kernel": "hot: HLA project+quantize",
    "_scaled_mm_kernel": "hot: int8/fp8 GEMM",
    "_transpose_kernel": "hot: transpose x~",
    "_combined_kernel": "hot: combined g_y pass",
    "_grad_out_kernel": "hot: combined g_y pass",
    "_block_bound_kernel": "hot: g's HLA bound",
    "_weight_cast_kernel": "hot: W cast + column maxima",
    "_weight_operands_kernel": "hot: W operands (HQ W + FP8 forward W)",
}


def category(name: str) -> str:
    """A coarse bucket for a kernel name."""
    for key, label in HOT_KERNELS.items():
        if key in name:
            return label
    low = name.lower()
    if "philox" in low or "distribution" in low or "random" in low:
        return "rng (seed draws)"
    if any(k in low for k in ("flash", "fmha", "attention", "sdpa", "cudnn")):
        return "attention"
    if any(k in low for k in ("gemm", "sm90", "cutlass", "nvjet", "xmma", "cublas", "_mm_",
                              "s16816", "wgmma")):
        return "GEMM (cuBLAS/CUTLASS)"
    if low.startswith("triton_"):
        return "Inductor fused Triton"
    if "multi_tensor" in low or "adam" in low:
        return "optimizer"
    if "memcpy" in low or "memset" in low or "copy" in low or "fill" in low:
        return "copies/fills"
    return "other"


def _device_events(prof):
    out = []
    for e in prof.events():
        dt = getattr(e, "device_type", None)
        if dt is not None and dt == torch.autograd.DeviceType.CUDA:
            out.append(e)
    return out


def profile_one(model: str, mode: str, opts: dict) -> dict:
    run = T.setup_run(model, mode, opts)     # the very set-up bench/train.py times
    device, be, desc = run.device, run.be, C.MODE_INFO[C.split_mode(mode)[0]][2]
    for i in range(opts.get("warmup", 6)):
        run.step(i)
    C.sync(device)
    n = opts.get("steps", 3)
    walls = []
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(n):
            t = time.perf_counter()
            run.step(0)
            C.sync(device)
            walls.append((time.perf_counter() - t) * 1e3)
    kern = _device_events(prof)
    by_cat = collections.Counter()
    by_name = collections.Counter()
    calls = collections.Counter()
    for e in kern:
        d = e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
        by_cat[category(e.name)] += d
        by_name[e.name] += d
        calls[e.name] += 1
    host = collections.Counter()
    host_calls = collections.Counter()
    for e in prof.events():
        if e.name.startswith("hot::"):
            host[e.name] += e.cpu_time_total
            host_calls[e.name] += 1
    busy = sum(by_cat.values()) / 1e3 / n
    rec = {
        "model": model, "mode": mode, "description": desc,
        "compile_mode": opts.get("compile_mode") or "default",
        "wall_ms_per_step": statistics.median(walls), "gpu_busy_ms_per_step": busy,
        "launches_per_step": len(kern) / n,
        "by_category_ms": {k: v / 1e3 / n for k, v in by_cat.most_common()},
        "top_kernels": [{"name": k[:110], "ms_per_step": v / 1e3 / n, "calls_per_step": calls[k] / n}
                        for k, v in by_name.most_common(opts.get("top", 25))],
        "hot_op_host_ms_per_step": {k: v / 1e3 / n for k, v in host.items()},
        "hot_op_calls_per_step": {k: c / n for k, c in host_calls.items()},
    }
    rec.update(C.hot_summary(be))
    if opts.get("trace"):
        path = os.path.join(opts["out"], f"trace_{model}_{C.file_part(mode)}.json")
        prof.export_chrome_trace(path)
        rec["trace"] = path
    return rec


def markdown(recs, env) -> str:
    lines = [f"# Step profile: {env['device']}", "",
             f"torch {env.get('torch')}, {env.get('date', '')}. Per step, median wall time of the "
             f"profiled steps (profiler on: slightly above train.py's figures); GPU busy = sum of "
             f"kernel durations.", ""]
    rows = [[r["model"], r["mode"], r["compile_mode"], C.fmt(r["wall_ms_per_step"]),
             C.fmt(r["gpu_busy_ms_per_step"]), C.fmt(r["launches_per_step"], 0),
             C.fmt(sum(r["hot_op_host_ms_per_step"].values()))] for r in recs]
    lines.append(C.md_table(["model", "mode", "compile mode", "wall ms", "GPU busy ms",
                             "launches", "host ms in hot:: ops"], rows))
    for r in recs:
        lines += ["", f"## {r['model']} / {r['mode']} ({r['compile_mode']})", "",
                  C.md_table(["category", "ms/step"],
                             [[k, C.fmt(v, 3)] for k, v in r["by_category_ms"].items()]), "",
                  C.md_table(["kernel", "ms/step", "calls/step"],
                             [[t["name"].replace("|", "/"), C.fmt(t["ms_per_step"], 3),
                               C.fmt(t["calls_per_step"], 0)] for t in r["top_kernels"]])]
        if r["hot_op_host_ms_per_step"]:
            lines += ["", C.md_table(["hot op", "host ms/step", "calls/step"],
                                     [[k, C.fmt(v, 3), C.fmt(r["hot_op_calls_per_step"][k], 0)]
                                      for k, v in r["hot_op_host_ms_per_step"].items()])]
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="vit_b16_bs64")
    p.add_argument("--modes", default="inductor,hot")
    p.add_argument("--compile-mode")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=6)
    p.add_argument("--hot", nargs="*", help="HOTConfig overrides, key=value")
    p.add_argument("--device")
    p.add_argument("--out", default=C.RESULTS_DIR)
    p.add_argument("--tag", default="")
    p.add_argument("--trace", action="store_true")
    p.add_argument("--top", type=int, default=25)
    a = p.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    opts = dict(compile_mode=a.compile_mode, steps=a.steps, warmup=a.warmup, device=a.device,
                hot=C.parse_overrides(a.hot), out=a.out, trace=a.trace, top=a.top)
    device = C.pick_device(a.device)
    recs = []
    for model in a.models.split(","):
        for mode in C.mode_list(a.modes):
            t = time.perf_counter()
            try:
                rec = profile_one(model, mode, opts)
            except Exception as e:  # noqa: BLE001 - one failing mode must not lose the others
                import traceback
                C.log(f"profile {model}/{mode}: {type(e).__name__}: {e}\n"
                      + "".join(traceback.format_exc()[-3000:]))
                continue
            finally:
                C.reset_compile_state()
            recs.append(rec)
            C.log(f"profile {model}/{mode}: wall {rec['wall_ms_per_step']:.2f} ms, GPU busy "
                  f"{rec['gpu_busy_ms_per_step']:.2f} ms, {rec['launches_per_step']:.0f} launches "
                  f"({time.perf_counter() - t:.0f} s)")
    env = C.environment(device)
    base = C.result_base(a.out, "profile", device, a.tag)
    C.write_json(base + ".json", {"environment": env, "runs": recs})
    C.write_text(base + ".md", markdown(recs, env))
    print(markdown(recs, env))
    return recs


if __name__ == "__main__":
    main()
