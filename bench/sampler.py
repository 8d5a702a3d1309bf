"""Where a first step's (compile's) host time goes: a wall-clock stack sampler.

Why not cProfile: on the H100 machine's Python 3.12 it put 2.9 s of a warm first step in
``torch.library.Library.define``, which timing the calls directly showed to cost 5 ms in
all; its caller graph there was broken too. A sampler reading the main thread's stack
every few milliseconds attributes wall time, subprocess waits and imports included,
without instrumenting a single call.

``StackSampler`` is a context manager; ``report()`` gives the functions seen on the most
samples (inclusive: counted once per sample wherever they are on the stack), the most
frequent innermost frames, and the same with the caller's line that is running each one
(and for torch's op-call frames, the op), each as seconds of wall time. Why the line: the
thirty-first stop's cold first steps spent 1.6-7.6 s in one innermost frame,
``torch/_ops.py(__call__)``, called from the compiled code of both backends, and the report
could not say which op or where. While the main thread waits in
the autograd engine, the busy threads are sampled with it: a compiled backward compiles
on the first call, on the engine's device thread.

Each sample is weighted by the wall time since the one before it, not counted as one. Why:
the sampler is a Python thread and needs the GIL to read the stacks, so while the main
thread holds it (native code that keeps the GIL, a busy loop) samples come late, and while
it waits with the GIL released they come on time. Counted equally, a cold Llama first step
got 6.8 ms per sample on average against a 2 ms interval (fortieth stop), and the waits in
the autograd engine read 8.5 s above the timed phases that cover them. Weighted, a stack
that kept the sampler out for 50 ms gets the 50 ms.

While the main thread is in the autograd engine, every other thread's innermost frame is
also kept with its thread's name, idle ones included (``engine_threads``): a frame parked in
a wait is dropped from the other tables as idle, but the engine's device thread waiting on a
compile future is exactly what a first backward can spend its time on.
"""
from __future__ import annotations

import collections
import os
import sys
import threading
import time


class StackSampler:
    def __init__(self, interval_s: float = 0.002, depth: int = 80):
        self.interval_s, self.depth = interval_s, depth
        # seconds of wall time per name (each sample weighted by the time since the last)
        self.inclusive = collections.Counter()
        self.leaf = collections.Counter()
        self.sites = collections.Counter()
        self.engine_threads = collections.Counter()
        self.samples = 0
        self.seconds = 0.0
        self._target = threading.main_thread().ident
        self._stop = threading.Event()
        self._thread = None
        self._t0 = self._t1 = 0.0

    def __enter__(self):
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._run, daemon=True, name="stack-sampler")
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self._t1 = time.perf_counter()
        return False

    def _run(self) -> None:
        me = threading.get_ident()
        last = time.perf_counter()
        while not self._stop.wait(self.interval_s):
            frames = sys._current_frames()
            now = time.perf_counter()
            dt, last = now - last, now
            main = frames.get(self._target)
            if main is None:
                continue
            tops = [main]
            stacks = [self._names(main)]
            # the main thread blocked in the autograd engine: a compiled backward's first
            # call (its compile) runs on the engine's device thread; sample that thread too
            if stacks[0][0].endswith("(_engine_run_backward)"):
                names = {t.ident: t.name for t in threading.enumerate()}
                for t, f in frames.items():
                    if t in (me, self._target):
                        continue
                    idle, stack = _idle(f), self._names(f)
                    self.engine_threads[f"{names.get(t, 'native thread')}: "
                                        f"{stack[0]}{_op(f)} <- {_line(f.f_back)}"
                                        f"{' (idle)' if idle else ''}"] += dt
                    if not idle:
                        tops.append(f)
                        stacks.append(stack)
            self.samples += 1
            self.seconds += dt
            for top, names in zip(tops, stacks):
                self.leaf[names[0]] += dt
                self.sites[f"{names[0]}{_op(top)} <- {_line(top.f_back)}"] += dt
            for n in {n for names in stacks for n in names}:
                self.inclusive[n] += dt

    def _names(self, f) -> list:
        names = []
        while f is not None and len(names) < self.depth:
            code = f.f_code
            names.append(f"{_short(code.co_filename)}:{code.co_firstlineno}({code.co_name})")
            f = f.f_back
        return names

    def report(self, top: int = 150) -> str:
        wall = self._t1 - self._t0
        lines = [f"{self.samples} samples over {wall:.2f} s ({self.seconds:.2f} s sampled, "
                 f"{wall / max(self.samples, 1) * 1e3:.2f} ms apart on average; each "
                 f"weighted by the time since the last)", "", "inclusive (s)  function"]
        lines += [f"{v:12.3f}  {name}" for name, v in self.inclusive.most_common(top)]
        lines += ["", "innermost (s)  function"]
        lines += [f"{v:12.3f}  {name}" for name, v in self.leaf.most_common(top // 2)]
        lines += ["", "innermost (s)  function [op] <- the caller's running line"]
        lines += [f"{v:12.3f}  {name}" for name, v in self.sites.most_common(top // 2)]
        if self.engine_threads:
            lines += ["", "while the main thread is in the autograd engine, every other thread "
                      "(s)  thread: innermost [op] <- the caller's running line"]
            lines += [f"{v:12.3f}  {name}"
                      for name, v in self.engine_threads.most_common(top // 2)]
        return "\n".join(lines) + "\n"


def _line(frame) -> str:
    """``file:line (function)`` of the line a frame is running."""
    if frame is None:
        return "-"
    return f"{_short(frame.f_code.co_filename)}:{frame.f_lineno}({frame.f_code.co_name})"


def _op(frame) -> str:
    """`` [aten.mm.default]`` for a frame of torch's op call (``torch/_ops.py``), else ""."""
    code = frame.f_code
    if code.co_name != "__call__" or not code.co_filename.endswith(
            os.path.join("torch", "_ops.py")):
        return ""
    try:
        return f" [{frame.f_locals.get('self')}]"
    except Exception:  # noqa: BLE001 - another thread's frame: best effort
        return ""


def _idle(frame) -> bool:
    """A thread parked in a lock or queue wait (thread pools between tasks)."""
    name = frame.f_code.co_name
    return frame.f_code.co_filename.endswith(("threading.py", "queue.py")) or name in (
        "wait", "get", "_wait_for_tstate_lock", "select", "poll")


def _short(path: str) -> str:
    """A path from its package root on: site-packages/torch/x.py -> torch/x.py."""
    for marker in ("site-packages" + os.sep, "dist-packages" + os.sep):
        if marker in path:
            return path.split(marker, 1)[1]
    return os.path.relpath(path) if os.path.isabs(path) and path.startswith(os.getcwd()) \
        else path
