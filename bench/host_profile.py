"""Where a compiled training step spends its host (CPU) time, mode beside mode.

Why: in default compile mode a step whose host work takes as long as its GPU work is
host-bound, and then every microsecond of Python per step is a microsecond of step time.
``bench/train.py`` reports host ms per step; this script says where it goes: the median
host time of one step started on an idle device, and a cProfile of such steps with the
functions that take the most time of their own, so two modes of one model can be compared
function by function (e.g. Triton's Python launcher against Inductor's static launcher).

    python bench/host_profile.py --model vit_b16_bs64 --modes inductor,hot [--steps 20]

Results: ``<out>/host_profile_<date>_<device>[_tag].md``.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import common as C  # noqa: E402


def profile_steps(run, n: int, top: int) -> str:
    """cProfile of ``n`` steps (each started on an idle device): the ``top`` functions by
    own time, then by cumulative time, per step."""
    prof = cProfile.Profile()
    for i in range(n):
        C.sync(run.device)
        prof.enable()
        run.step(i)
        prof.disable()
    C.sync(run.device)
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return out.getvalue()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="vit_b16_bs64")
    p.add_argument("--modes", default="inductor,hot")
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--steps", type=int, default=20, help="timed host steps per mode")
    p.add_argument("--profile-steps", type=int, default=5)
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--device", help="cuda / cpu (default: cuda when available)")
    p.add_argument("--out", help="output folder (default bench/results)")
    p.add_argument("--tag", default="")
    args = p.parse_args(argv)
    import train as T
    device = C.pick_device(args.device)
    out = os.path.abspath(args.out or os.path.join(HERE, "results"))
    os.makedirs(out, exist_ok=True)
    C.reset_compile_state()
    modes = C.mode_list(args.modes)
    runs = {}
    for mode in reversed(modes):     # the base last, as bench/interleaved.py does
        run = T.setup_run(args.model, mode, {"device": args.device} if args.device else {})
        for i in range(args.warmup + 1):
            run.step(i)
        C.sync(device)
        runs[mode] = run
    lines = [f"# Host time of one step: {args.model}, {C.device_name(device)}", "",
             "| mode | host ms/step (median) | min | max |", "|---|---|---|---|"]
    profiles = []
    for mode in modes:
        ts = T.host_step_times(runs[mode], args.steps)
        lines.append(f"| {mode} | {statistics.median(ts):.2f} | {min(ts):.2f} | {max(ts):.2f} |")
        profiles += ["", f"## {mode}: cProfile of {args.profile_steps} steps", "", "```",
                     profile_steps(runs[mode], args.profile_steps, args.top), "```"]
    text = "\n".join(lines + profiles) + "\n"
    C.write_text(C.result_base(out, "host_profile", device, args.tag) + ".md", text)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
