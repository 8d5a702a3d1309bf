"""Native stacks of a benchmark process and its children, through py-spy, summed per thread.

    python bench/native_profile.py --py-spy PY_SPY --out /tmp/r -- python bench/train.py ...
    python bench/first_step.py --native PY_SPY ...      # each cold / warm invocation

Why: ``bench/sampler.py`` reads Python stacks only. The thirty-second stop's cold HOT first
step spent 5.8 s more than Inductor's in the autograd engine, of which 0.74 s had a Python
frame on any thread (docs/BENCHMARKS.md): the rest is native time, on the engine's device
thread or in a library, that only a native sampler can name. py-spy (``record --native
--threads --idle --subprocesses``, not a dependency: a wheel carried to the device, see the
README) samples every thread of the process and of its children. ``summarize`` turns its
raw output into, per process and thread with at least ``min_share`` of the samples, the
seconds in each innermost frame, and in each innermost frame that is not a C library's
wait (libc, libpthread), which names what a native wait is for.
"""
from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
from typing import Dict, List, Tuple

RATE = 100                                    # samples per second
_WAITS = ("(libc.so", "(libpthread.so", "(ld-linux")


def record_command(py_spy: str, raw_out: str, cmd: List[str], rate: int = RATE) -> List[str]:
    """``cmd`` run under py-spy, its raw stacks (every thread, idle ones too, children
    included) written to ``raw_out``."""
    return [py_spy, "record", "--native", "--threads", "--idle", "--subprocesses",
            "-r", str(rate), "-f", "raw", "-o", raw_out, "--"] + list(cmd)


def parse(raw: str) -> Dict[Tuple[str, str], collections.Counter]:
    """py-spy's raw lines (``process P:"cmd";...;thread (T): name;root;...;leaf N``) as
    {(innermost process, thread): Counter of stacks (root first) -> samples}."""
    out: Dict[Tuple[str, str], collections.Counter] = collections.defaultdict(
        collections.Counter)
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        parts = stack.split(";")
        proc = "-"
        i = 0
        while i < len(parts) and parts[i].startswith("process "):
            proc = parts[i]
            i += 1
        thread = parts[i] if i < len(parts) else "-"
        out[(proc, thread)][tuple(parts[i + 1:])] += int(count)
    return out


def summarize(raw: str, rate: int = RATE, top: int = 15, min_share: float = 0.01) -> str:
    """Per process and thread: samples, innermost frames and innermost frames that are not a
    C library's, as seconds (see the module docstring)."""
    threads = parse(raw)
    total = sum(sum(c.values()) for c in threads.values()) or 1
    lines = [f"{total} samples at {rate} Hz ({total / rate:.2f} s over all threads)", ""]
    ranked = sorted(threads.items(), key=lambda kv: -sum(kv[1].values()))
    for (proc, thread), stacks in ranked:
        n = sum(stacks.values())
        if n / total < min_share:
            continue
        leaf, own = collections.Counter(), collections.Counter()
        for stack, k in stacks.items():
            leaf[stack[-1] if stack else "-"] += k
            mine = [f for f in stack if not any(w in f for w in _WAITS)]
            own[mine[-1] if mine else "-"] += k
        lines += [f"## {proc[:160]} / {thread}: {n / rate:.2f} s", "", "innermost (s)"]
        lines += [f"{k / rate:10.2f}  {name}" for name, k in leaf.most_common(top)]
        lines += ["", "innermost that is not a C library's wait (s)"]
        lines += [f"{k / rate:10.2f}  {name}" for name, k in own.most_common(top)]
        lines.append("")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--py-spy", required=True, help="the py-spy executable")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--name", default="native_profile")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- the command to profile")
    args = p.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        p.error("give the command to profile after --")
    os.makedirs(args.out, exist_ok=True)
    raw = os.path.join(args.out, args.name + "_raw.txt")
    rc = subprocess.run(record_command(args.py_spy, raw, cmd)).returncode
    with open(raw) as f:
        text = summarize(f.read())
    with open(os.path.join(args.out, args.name + ".txt"), "w") as f:
        f.write(text)
    print(text[:4000])
    return rc


if __name__ == "__main__":
    sys.exit(main())
