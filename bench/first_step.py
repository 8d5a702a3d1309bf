"""Issue 11 item 5 in one command: the first step of a cold process and of the next ones on
the same cache, HOT against Inductor, and what each warm process still had to compile.

    python bench/first_step.py --out $OUT [--sample]                   # Llama d4096, H100
    python bench/first_step.py --models tiny_gpt --device cpu --out /tmp/r --warm 1

Each phase runs ``bench/train.py`` once per mode, each mode on a cache folder of its own
below ``--cache-dir``: the cold phase fills the empty folders, each warm one reads them. Why
one folder per mode: a cold compile must not find kernels another backend compiled before
it (Inductor's own kernels in HOT's graph can have the same source as in Inductor's), so
neither backend's cold figure depends on which ran first. Why the files
each warm process adds are listed: a warm first step can be slow for a reason no phase
timer names. The thirtieth stop found HOT's first warm process at 1.70x Inductor's because
it compiled four Triton kernels that the cold one had not left in the cache (Inductor's
dynamic RBLOCK scaling; docs/BENCHMARKS.md); the second warm process was at 1.13x, so a
measurement that skipped the first warm process looked fine.

Before the cold phase a priming process (``--prime``, on by default) runs the model's step
once compiled by Inductor, on a cache folder of its own. Why: the first compiled process on
a machine pays costs that no Inductor or Triton cache holds and the next process does not
pay again: cuDNN's attention set-up at its first call (kept on disk across processes, most
likely in the CUDA driver's JIT cache, ``~/.nv/ComputeCache``). The thirty-second stop
sampled it at 4.3-5.7 s of the first compiled process's first step against 0.3-0.6 s in the
next one's; an eager step of the same model did not prime it (presumably another variant),
and over the thirty-first and thirty-second stops whichever backend ran first paid it, so
one cold ratio read 1.33x and another 1.56x. Results:
``<out>/first_step_<date>_<device>[_tag].{json,md}``.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common as C  # noqa: E402
import native_profile as NP  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
COMPILED = (".cubin", ".so", ".hsaco")     # what a process compiled: Triton / C++ binaries


def new_files(folder: str, since: float) -> Dict[str, List[str]]:
    """The binaries written below ``folder`` after ``since``, by kernel name (file stem)."""
    out: Dict[str, List[str]] = {}
    for root, _, files in os.walk(folder):
        for f in files:
            p = os.path.join(root, f)
            if f.endswith(COMPILED) and os.path.getmtime(p) > since:
                out.setdefault(os.path.splitext(f)[1], []).append(os.path.splitext(f)[0])
    return {k: sorted(v) for k, v in out.items()}


def run_phase(args, phase: str, cache: str, scratch: str, modes: str) -> dict:
    """One train.py invocation of ``modes``: its runs' first steps and the binaries it added."""
    out = os.path.join(scratch, phase)
    cmd = [sys.executable, os.path.join(HERE, "train.py"), "--models", args.models,
           "--modes", modes, "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--cache-dir", cache, "--timeout-s", str(args.timeout_s), "--out", out]
    if args.device:
        cmd += ["--device", args.device]
    if args.sample and phase != "prime":   # train.py's stack sampler over each first step
        cmd += ["--profile-first", args.sample_base + f"_{phase}"]
    native = None
    if args.native and phase != "prime":   # py-spy's native stacks of the whole invocation
        native = f"{args.native_base}_{phase}_{C.file_part(modes)}"
        cmd = NP.record_command(args.native, native + "_raw.txt", cmd, rate=args.native_rate)
    since = time.time()
    time.sleep(0.01)                   # mtimes of files written from here on are later
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=args.timeout_s * len(C.mode_list(modes)) + 120)
    if native and os.path.exists(native + "_raw.txt"):
        with open(native + "_raw.txt") as f:
            C.write_text(native + ".txt", NP.summarize(f.read(), rate=args.native_rate))
    files = sorted(glob.glob(os.path.join(out, "train_*.json")))
    runs = []
    if files:
        with open(files[-1]) as f:
            runs = json.load(f)["runs"]
    ph = {"phase": phase, "new_binaries": new_files(cache, since),
          "runs": [{k: r.get(k) for k in ("model", "mode", "status", "first_step_s",
                                          "step_ms", "first_step_phases")} for r in runs]}
    if proc.returncode != 0:
        if not (native and profiler_lost(proc.returncode, ph["runs"], modes)):
            raise RuntimeError(f"{phase}: train.py exited {proc.returncode}\n"
                               f"{proc.stdout[-3000:]}")
        # the timings stand (train.py wrote them, every run ok); the native profile is lost
        ph["native_exit"] = proc.returncode
        print(f"{phase} {modes}: the invocation under py-spy exited {proc.returncode} after "
              f"train.py wrote its results: timings kept, native profile "
              f"{'written' if os.path.exists(native + '_raw.txt') else 'lost'}", flush=True)
    return ph


def profiler_lost(returncode: int, runs: List[dict], modes: str) -> bool:
    """Whether a failed invocation under py-spy only lost its profile: killed by a signal
    (py-spy 0.4.3 died with SIGSEGV on an H200 machine, 33rd stop) after train.py had written
    an ``ok`` result for every mode it was given."""
    return (returncode < 0 and len(runs) == len(C.mode_list(modes))
            and all(r.get("status") == "ok" for r in runs))


def per_mode_caches(args, phase: str, cache: str, scratch: str, reverse: bool = False) -> dict:
    """A phase with each mode in its own train.py invocation on ``cache/<mode>``: its runs
    in the order of ``--modes`` (reversed with ``reverse``), and the binaries all of them
    added."""
    merged: dict = {"phase": phase, "new_binaries": {}, "runs": []}
    modes = C.mode_list(args.modes)
    for mode in (modes[::-1] if reverse else modes):
        folder = os.path.join(cache, C.file_part(mode))
        ph = run_phase(args, phase, folder, os.path.join(scratch, C.file_part(mode)), modes=mode)
        merged["runs"] += ph["runs"]
        if "native_exit" in ph:
            merged["native_exit"] = ph["native_exit"]
        for ext, names in ph["new_binaries"].items():
            merged["new_binaries"][ext] = sorted(merged["new_binaries"].get(ext, []) + names)
    return merged


def table(phases: List[dict]) -> str:
    rows = []
    for ph in phases:
        if ph["phase"] == "prime":
            continue
        base = {r["model"]: r["first_step_s"] for r in ph["runs"] if r["mode"] == "inductor"}
        compiled = sum(len(v) for v in ph["new_binaries"].values())
        for r in ph["runs"]:
            b, t = base.get(r["model"]), r["first_step_s"]
            ratio = f"{t / b:.2f}x" if b and t and r["mode"] != "inductor" else "-"
            rows.append([ph["phase"], r["model"], r["mode"], C.fmt(t), ratio,
                         C.fmt(r.get("step_ms")), compiled])
    return C.md_table(["phase", "model", "mode", "first step s", "vs inductor", "ms/step",
                       "binaries the phase compiled (all its modes)"], rows)


def cold_medians(phases: List[dict]) -> List[str]:
    """With several cold phases: each mode's median cold first step against Inductor's, and
    the spread of the per-phase ratios. Why: on one H200 and one tree, two cold pairs read
    1.34x and 2.10x (fortieth stop); one pair is not a measurement of the first compile."""
    colds = [ph for ph in phases if ph["phase"].startswith("cold") and ph["phase"] != "cold"]
    if len(colds) < 2:
        return []
    out = []
    by = {}
    for ph in colds:
        for r in ph["runs"]:
            if r.get("first_step_s"):
                by.setdefault((r["model"], r["mode"]), {})[ph["phase"]] = r["first_step_s"]
    for (model, mode), got in sorted(by.items()):
        base = by.get((model, "inductor"), {})
        both = [p for p in got if p in base]         # phases where both modes have a time
        if mode == "inductor" or not both:
            continue
        ratios = sorted(got[p] / base[p] for p in both)
        med = statistics.median(got[p] for p in both)
        med_base = statistics.median(base[p] for p in both)
        out.append(f"- cold, {len(both)} phases, {model} {mode}: median {med:.2f} s against "
                   f"Inductor's {med_base:.2f} s: **{med / med_base:.2f}x**; per phase "
                   + ", ".join(f"{r:.2f}x" for r in ratios))
    return out + [""] if out else []


def compiled_lines(phases: List[dict]) -> List[str]:
    """What each phase compiled: the cold one by count (with its C modules, Triton's
    launchers among them: the thirty-first stop found six, 4.5 s of HOT's cold first step),
    each warm one by kernel name (a warm process should compile nothing)."""
    phases = [ph for ph in phases if ph["phase"] != "prime"]
    if not phases:          # a partial result: only the priming process ran
        return []
    cold = phases[0]["new_binaries"]
    modules = sorted(set(cold.get(".so", ())))       # on a CPU, every kernel is a `.so`
    lines = ["- cold compiled " + (", ".join(f"{len(v)} `{k}`" for k, v in sorted(cold.items()))
                                   or "nothing")
             + (f" (`.so`: {', '.join(modules)})" if 0 < len(modules) <= 8 else "")]
    for ph in phases[1:]:
        if ph["phase"].startswith("cold"):      # another cold phase: by count, as the first
            lines.append(f"- {ph['phase']} compiled " + (", ".join(
                f"{len(v)} `{k}`" for k, v in sorted(ph["new_binaries"].items())) or "nothing"))
            continue
        for ext, names in ph["new_binaries"].items():
            lines.append(f"- {ph['phase']} compiled {len(names)} `{ext}`: "
                         + ", ".join(f"`{n}`" for n in names[:12])
                         + (" ..." if len(names) > 12 else ""))
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="llama_d4096")
    p.add_argument("--modes", default="inductor,hot")
    p.add_argument("--warm", type=int, default=2, help="warm processes after the cold one")
    p.add_argument("--cold", type=int, default=1,
                   help="cold phases, each on empty cache folders of its own, every other "
                        "one in the reverse order of --modes; the table adds their medians")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--device", help="cuda / cpu (default: cuda when available)")
    p.add_argument("--cache-dir", help="an empty folder (default: a new temporary one)")
    p.add_argument("--timeout-s", type=float, default=190.0, help="per mode and phase")
    p.add_argument("--out", help="output folder (default bench/results)")
    p.add_argument("--tag", default="")
    p.add_argument("--native", metavar="PY_SPY",
                   help="a py-spy executable: record each cold and warm invocation's native "
                        "stacks, every thread and child process (bench/native_profile.py): "
                        "<out>/first_step_native_<date>_<device>[_tag]_<phase>_<mode>.txt")
    p.add_argument("--native-rate", type=int, default=25,
                   help="py-spy's samples per second (at 100 Hz it fell 6 s behind sampling a "
                        "cold Llama compile's ~20 processes on an H200 machine)")
    p.add_argument("--prime", action=argparse.BooleanOptionalAction, default=True,
                   help="first run the model's Inductor step once in a process of its own, "
                        "on a cache folder of its own (--no-prime: measure a fresh "
                        "machine's first compiled process as it is)")
    p.add_argument("--sample", action="store_true",
                   help="sample each first step's stacks (bench/sampler.py): "
                        "<out>/first_step_sample_<date>_<device>[_tag]_<phase>_<model>_<mode>.txt")
    args = p.parse_args(argv)
    if args.cold < 1:
        p.error("--cold must be at least 1 (the warm phases read the last cold one's caches)")
    args.out_dir = os.path.abspath(args.out or os.path.join(HERE, "results"))
    os.makedirs(args.out_dir, exist_ok=True)
    if args.cache_dir and os.path.exists(args.cache_dir) and os.listdir(args.cache_dir):
        p.error(f"--cache-dir {args.cache_dir} is not empty: the first phase must be cold")
    device = C.pick_device(args.device)
    base = C.result_base(args.out_dir, "first_step", device, args.tag)
    args.sample_base = os.path.join(args.out_dir, "first_step_sample" + os.path.basename(base)[
        len("first_step"):])
    args.native_base = args.sample_base.replace("first_step_sample", "first_step_native")
    scratch = tempfile.mkdtemp(prefix="first_step_")
    cache = args.cache_dir or os.path.join(scratch, "cache")
    phases = []
    if args.prime:
        phases.append(run_phase(args, "prime", os.path.join(scratch, "prime_cache"), scratch,
                                modes="inductor"))
        write_results(base, device, args, phases, complete=False)
    colds = ["cold"] if args.cold == 1 else [f"cold{i}" for i in range(1, args.cold + 1)]
    names = colds + [f"warm{i}" for i in range(1, args.warm + 1)]
    for i, phase in enumerate(names):
        # each cold phase on empty folders of its own (the warm phases read the last one's);
        # every other one in the reverse order of the modes, so a drift of the machine
        # over the call does not favour the mode that always runs first
        folder = os.path.join(scratch, f"cache_{phase}") if i < len(colds) - 1 else cache
        phases.append(per_mode_caches(args, phase, folder, scratch,
                                      reverse=i < len(colds) and i % 2 == 1))
        write_results(base, device, args, phases, complete=phase == names[-1])
    with open(base + ".md") as f:
        print(f.read(), end="")
    return 0


def write_results(base: str, device, args, phases: List[dict], complete: bool) -> None:
    """The JSON and table of the phases run so far, rewritten after each phase.

    Why after each one: a run cut short (a device call's time limit, a phase that fails)
    still leaves the phases it finished. A partial result says so (``complete`` false in the
    JSON, a line in the table)."""
    C.write_json(base + ".json", {"env": C.environment(device), "options": vars(args),
                                  "phases": phases, "complete": complete})
    lines = [f"# First step, cold then warm: {C.device_name(device)}", "", table(phases), ""]
    if not complete:
        lines += [f"- partial: the run stopped after the {phases[-1]['phase']} phase", ""]
    if args.prime and phases[0]["runs"]:
        first = phases[0]["runs"][0].get("first_step_s")
        lines += [f"- primed: one Inductor step in a process and cache folder of its own first "
                  f"({C.fmt(first)} s), so neither backend pays the machine's first-process "
                  "costs", ""]
    lines += cold_medians(phases)
    lines += compiled_lines(phases)
    lines += [f"- {ph['phase']}: an invocation under py-spy exited {ph['native_exit']} after "
              "train.py wrote its results (timings kept; its native profile may be missing)"
              for ph in phases if "native_exit" in ph]
    C.write_text(base + ".md", "\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
