"""Modes of one model stepping in turn in one process: a speed ratio the host's drift cannot bias.

    python bench/interleaved.py --model vit_b16_bs64 --modes inductor,hot --out $OUT
    python bench/interleaved.py --model tiny_gpt --modes inductor,hot --device cpu --rounds 3
    python bench/interleaved.py --model vit_b16_bs64 --modes "hot@reduce-overhead,hot"

Why: ViT-B/16 bs64's step is host-bound, and its runs fall in two clusters (~22.0 ms and
24-27 ms) by run, not by mode: the thirty-first stop's `inductor,hot,inductor,hot` runs read
24.96 / 22.15 / 22.10 / 25.45 ms, so one pair of runs said 1.127x and the pooled steps 0.950x
(docs/BENCHMARKS.md). Here every mode is compiled once in this process (each its own copy
of the model, the same seed, its own optimizer; a mode listed twice is an error), then each
round steps every mode once, the order reversed every other round, each step between CUDA
events as ``train.py`` times it (no synchronisation between steps, as in training). Rounds
are paired: the ratio of round r is the base mode's step over the other mode's step of that
round, so a slow spell of the host lands on both. Reported per mode: the median and fastest
step, and against the first mode (the base) the median of the paired ratios and the ratio
of medians. Peak memory is not: every mode's model lives in the process (``train.py``
measures it alone).

A mode may name its own compile mode after an ``@`` (``hot@reduce-overhead``; the others
take ``--compile-mode``): the default-vs-reduce-overhead gap of one backend (issue 11's
item 2), measured paired, where separate processes differ by their host's noise (the
forty-fifth stop: 3-4 ms a step on ViT-B between two processes of one machine).
Results: ``<out>/interleaved_<date>_<device>[_tag].{json,md}``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import common as C  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def split_compile_mode(mode: str, fallback):
    """``"hot[rank=8]@reduce-overhead"`` -> ("hot[rank=8]", "reduce-overhead"); without an
    ``@`` the mode keeps ``fallback`` (``--compile-mode``, None for default)."""
    name, at, cmode = mode.rpartition("@")
    if not at:
        return mode, fallback
    if cmode not in COMPILE_MODES:
        raise SystemExit(f"{mode}: unknown compile mode {cmode!r} after '@' "
                         f"(one of {', '.join(COMPILE_MODES)})")
    if not C.MODE_INFO[C.split_mode(name)[0]][0]:
        raise SystemExit(f"{mode}: {name} is not compiled, so it takes no compile mode")
    return name, None if cmode == "default" else cmode


def timed_step(run, i: int):
    """One training step of ``run`` (step index i): on CUDA the device events around it
    (read once every round is over), on a CPU its wall time in ms."""
    if run.device.type == "cuda":
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        run.step(i, ev)
        return ev
    t = time.perf_counter()
    run.step(i)
    return (time.perf_counter() - t) * 1e3


def interleave(runs: List, rounds: int) -> List[List[float]]:
    """``rounds`` rounds of one step per run, the order reversed every other round: each
    run's step times in ms, round by round."""
    times = [[] for _ in runs]
    for r in range(rounds):
        order = list(range(len(runs)))
        if r % 2:
            order.reverse()
        for k in order:
            times[k].append(timed_step(runs[k], r))
    if runs and runs[0].device.type == "cuda":
        torch.cuda.synchronize(runs[0].device)
        times = [[a.elapsed_time(c) for a, _, c in ts] for ts in times]
    return times


def summarize(modes: List[str], times: List[List[float]]) -> List[dict]:
    """Per mode: median / fastest step and, against the first mode, the paired ratios."""
    base = times[0]
    rows = []
    for mode, ts in zip(modes, times):
        paired = [b / t for b, t in zip(base, ts)]
        rows.append({"mode": mode, "step_ms": statistics.median(ts), "step_ms_min": min(ts),
                     "step_ms_each": [round(v, 3) for v in ts],
                     "paired_ratio_median": statistics.median(paired),
                     "paired_ratios": [round(v, 4) for v in paired],
                     "ratio_of_medians": statistics.median(base) / statistics.median(ts),
                     "rounds_faster": sum(p > 1 for p in paired)})
    return rows


def _sites(r: dict) -> str:
    """HOT's sites rewritten of those found ("-" for a mode that is not HOT's), and how many
    more take the FP8 forward alone (their backward exact)."""
    if r.get("hot_sites_total") is None:
        return "-"
    alone = r.get("hot_forward_fp8_only")
    return (f"{r.get('hot_sites_rewritten', 0)}/{r['hot_sites_total']}"
            + (f" (+{alone} FP8 forward alone)" if alone else ""))


def table(model: str, rows: List[dict]) -> str:
    """Why the sites and the first step in the table: which decisions a ratio is of, and
    what a user waits for (every mode compiles in this one process, on one cache: not the
    cold-start figure, ``bench/first_step.py`` is)."""
    base = rows[0]["mode"]
    return C.md_table(
        ["model", "mode", "median ms", "fastest ms", f"paired ratio vs {base} (median)",
         "ratio of medians", "rounds faster than the base", "sites", "first step s"],
        [[model, r["mode"], C.fmt(r["step_ms"]), C.fmt(r["step_ms_min"]),
          C.fmt(r["paired_ratio_median"], 3) + "x", C.fmt(r["ratio_of_medians"], 3) + "x",
          f"{r['rounds_faster']}/{len(r['paired_ratios'])}", _sites(r),
          C.fmt(r.get("first_step_s"), 1)]
         for r in rows])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="vit_b16_bs64")
    p.add_argument("--modes", default="inductor,hot", help="the first is the base")
    p.add_argument("--warmup", type=int, default=8, help="untimed steps per mode")
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--device", help="cuda / cpu (default: cuda when available)")
    p.add_argument("--compile-mode", help="torch.compile mode (default: default)")
    p.add_argument("--out", help="output folder (default bench/results)")
    p.add_argument("--tag", default="")
    args = p.parse_args(argv)
    import train as T
    modes = C.mode_list(args.modes)
    if len(modes) < 2 or len(set(modes)) != len(modes):
        p.error("--modes needs at least two different modes: the base and one to compare")
    out = os.path.abspath(args.out or os.path.join(HERE, "results"))
    os.makedirs(out, exist_ok=True)
    device = C.pick_device(args.device)
    opts = {"device": args.device} if args.device else {}
    # (name, compile mode) per mode, parsed once: a bad '@' fails before anything compiles
    parsed = {mode: split_compile_mode(mode, args.compile_mode) for mode in modes}
    C.reset_compile_state()
    # compiled one after the other, the base last, and kept alive together. Why the base
    # last: the first backend called starts Inductor's compile workers, and HOT's start them
    # launching its kernels statically (inductor_settings.start_compile_workers), as they
    # are in a process of HOT's own; Inductor's graphs compile the same either way
    # Each mode must compile graphs of its own (Dynamo keys its cache on the code object,
    # shared by the copies, and guards on the backend): counted, and an error if not.
    runs, first, graphs = {}, {}, {}
    for mode in reversed(modes):
        name, cmode = parsed[mode]
        run = T.setup_run(args.model, name, {**opts, **({"compile_mode": cmode} if cmode else {})})
        before, _ = T._counters()
        t = time.perf_counter()
        run.step(0)
        C.sync(device)
        first[mode] = time.perf_counter() - t
        graphs[mode] = T._counters()[0] - before
        compiled = C.MODE_INFO[C.split_mode(name)[0]][0]
        if compiled and not graphs[mode]:
            raise SystemExit(f"{mode}: its first step compiled no graph (it ran another "
                             "mode's compiled code): the comparison would be void")
        for i in range(args.warmup):
            run.step(i + 1)
        C.sync(device)
        runs[mode] = run
    rows = summarize(modes, interleave([runs[m] for m in modes], args.rounds))
    for row in rows:
        name, cmode = parsed[row["mode"]]
        if C.MODE_INFO[C.split_mode(name)[0]][0]:
            row["compile_mode"] = cmode or "default"
        row["first_step_s"] = first[row["mode"]]
        row["graphs_compiled"] = graphs[row["mode"]]
        row.update({k: v for k, v in C.hot_summary(runs[row["mode"]].be).items()
                    if k in ("hot_sites_rewritten", "hot_sites_total", "hot_forward_fp8_only")})
    base = C.result_base(out, "interleaved", device, args.tag)
    C.write_json(base + ".json", {"env": C.environment(device), "options": vars(args),
                                  "model": args.model, "rows": rows})
    text = "\n".join([f"# Modes stepping in turn: {C.device_name(device)}", "",
                      table(args.model, rows), ""])
    C.write_text(base + ".md", text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
