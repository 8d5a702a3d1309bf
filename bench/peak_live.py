"""What is alive at a training step's peak of allocated memory, grouped by where it was made.

Why: ``saved_tensors.py`` names what the forward keeps for backward, but the peak is that
plus whatever the step allocates on top at its worst moment (a backward's transient
buffers, gradients, the optimizer's). Knowing which of those is alive at the peak says what
to free earlier or not make at all. CUDA only: it reads the caching allocator's event trace
(``torch.cuda.memory._record_memory_history``) of one step, replays it to find the moment
``memory_allocated`` was highest, and groups the blocks alive then by the first frame outside
torch's own code: a line of Inductor's generated code (``buf12 = empty_strided_cuda(...)``,
shown with its text), a line of hotcompile's kernels, or a model line. Blocks allocated
before the step (parameters, AdamW's state, the batch) are one row, "before the step".
"""
from __future__ import annotations

import linecache
import os
from typing import Callable, Dict, List, Optional, Tuple

import torch

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


def _phase(frames: List[dict]) -> str:
    """forward / backward / optimizer, from the names on the allocation's stack."""
    names = {f.get("name", "") for f in frames}
    files = " ".join(f.get("filename", "") for f in frames)
    if "step" in names and "optim" in files:
        return "optimizer"
    if "backward" in names or "_engine_run_backward" in names or "run_backward" in names:
        return "backward"
    return "forward"


def _origin(frames: List[dict]) -> str:
    """The first frame outside torch's package (innermost first), with its source text."""
    for f in frames:
        path = f.get("filename", "")
        if not path.endswith(".py") or path.startswith(_TORCH_DIR):
            continue                                     # C++ frames, torch's own Python
        text = linecache.getline(path, int(f.get("line", 0))).strip()
        where = f"{os.path.basename(path)}:{f.get('line')} {f.get('name', '')}"
        return f"{where}: {text[:90]}" if text else where
    return "torch internals"


def peak_breakdown(trace: List[dict], before: int) -> Tuple[int, Dict[Tuple[str, str], int]]:
    """(peak bytes, {(phase, origin): bytes alive at the peak}) of one allocator trace.

    ``before``: bytes allocated when recording started (their blocks have no alloc event;
    a free of one lowers the count and leaves the live set alone). Counts change on
    ``alloc`` and ``free_completed``, as ``torch.cuda.memory_allocated`` does."""
    cur, peak, at = before, before, -1
    for i, ev in enumerate(trace):
        if ev["action"] == "alloc":
            cur += ev["size"]
        elif ev["action"] == "free_completed":
            cur -= ev["size"]
        if cur > peak:
            peak, at = cur, i
    live: Dict[int, dict] = {}
    freed_before = 0
    for ev in trace[:at + 1]:
        if ev["action"] == "alloc":
            live[ev["addr"]] = ev
        elif ev["action"] == "free_completed":
            if live.pop(ev["addr"], None) is None:
                freed_before += ev["size"]
    groups: Dict[Tuple[str, str], int] = {}
    if before - freed_before:
        groups[("-", "before the step (parameters, optimizer state, batch)")] = \
            before - freed_before
    for ev in live.values():
        frames = ev.get("frames") or []
        key = (_phase(frames), _origin(frames))
        groups[key] = groups.get(key, 0) + ev["size"]
    return peak, groups


def record_step(step: Callable[[], None], device: torch.device,
                max_entries: int = 1_000_000) -> Tuple[int, Dict[Tuple[str, str], int]]:
    """Run ``step`` once with the allocator's history on; ``peak_breakdown`` of it."""
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.memory._record_memory_history(stacks="python", max_entries=max_entries)
    try:
        step()
        torch.cuda.synchronize(device)
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    trace = snap["device_traces"][device.index if device.index is not None else
                                  torch.cuda.current_device()]
    return peak_breakdown(trace, before)


def table(groups: Dict[Tuple[str, str], int], peak: int, top: int = 15,
          fmt: Optional[Callable[[int], str]] = None) -> List[str]:
    """Markdown rows, largest first; what is past ``top`` is summed in one row."""
    fmt = fmt or (lambda b: f"{b / 2**20:.1f} MiB")
    items = sorted(groups.items(), key=lambda kv: -kv[1])
    rows = ["| phase | allocated at | alive at the peak | share |", "|---|---|---|---|"]
    for (phase, origin), b in items[:top]:
        rows.append(f"| {phase} | `{origin.replace('|', '/')}` | {fmt(b)} | "
                    f"{100 * b / peak:.1f}% |")
    rest = sum(b for _, b in items[top:])
    if rest:
        rows.append(f"| | {len(items) - top} more places | {fmt(rest)} | {100 * rest / peak:.1f}% |")
    return rows
