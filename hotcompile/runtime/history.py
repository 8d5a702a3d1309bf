"""Scale history: the persistent words behind delayed scaling (``reference.delayed_e4m3_scale``).

Why a registry and an address: a delayed scale needs state that outlives one run of the
compiled graph (last step's amax), is written by kernels Inductor launches, survives CUDA-
graph replays and works after an FX/AOT cache hit in a new process. A tensor the graph
mutates would be functionalised (the kernels would write a copy, and the copy-back of a
non-input is dropped); a constant would bake an address into a cache entry. So each graph
holds one ``hot::scale_history`` node: at run time it returns, as a fresh 1-element int64
tensor, the address of this process's int32 block for the graph's key (allocated on
first use, zeroed: "no history", so the first call quantizes with the true amax). The
kernels load the address and read and write their slot through it; Triton's mutation
analysis does not follow a loaded pointer, so the graph stays functional and nothing is
copied. Any content of the words gives correct results: a missing, stale or foreign
history only costs the re-quantizing launch (``delayed_e4m3_scale``'s rule).

Slots: ``reference.HISTORY_WORDS`` int32 words per operand (last amax bits, calls,
re-quantizations). ``stats()`` reads the counters (a device sync): how often each graph's
operands had to re-quantize.
"""
from __future__ import annotations

import threading
import zlib
from typing import Dict, Iterable, Optional, Tuple

import torch

from ..kernels import reference as ref

WORDS = ref.HISTORY_WORDS
_LOCK = threading.Lock()
_BLOCKS: Dict[Tuple[str, int, int], torch.Tensor] = {}
_BY_ADDRESS: Dict[Tuple[str, int], torch.Tensor] = {}
_RETIRED: list = []     # blocks ``reset`` forgot: a captured CUDA graph may still write them


def graph_key(names: Iterable[str]) -> int:
    """A key stable across processes (cache hits reuse it) for the sites of one graph."""
    return zlib.crc32("|".join(names).encode()) & 0x7FFFFFFF


def block(device: torch.device, key: int, slots: int) -> torch.Tensor:
    """The int32 (slots * WORDS) block of graph ``key`` on ``device``, zeroed when created.

    Never from a CUDA graph's memory pool: a graph's first run is eager, but cudagraph
    trees route that warm-up's allocations on the current stream to the graph's private
    pool (which then reports a live tensor it does not own, H100 2026-11-26). So a CUDA
    block is allocated and zeroed by a short-lived thread on its own stream, which
    allocate from the ordinary pool, once per process; inside a capture itself no
    allocation is allowed at all."""
    device = torch.device(device)
    k = (str(device), int(key), int(slots))
    with _LOCK:
        t = _BLOCKS.get(k)
        if t is None:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("hot::scale_history: first use inside a CUDA-graph capture; "
                                   "run the compiled step once before capturing it")
            t = _allocate(device, max(1, int(slots)) * WORDS)
            _BLOCKS[k] = t
            _BY_ADDRESS[(str(device), t.data_ptr())] = t
        return t


def _allocate(device: torch.device, n: int) -> torch.Tensor:
    if device.type != "cuda":
        return torch.zeros((n,), dtype=torch.int32, device=device)
    out = []

    def make():     # another thread, another stream: cudagraph trees route this thread's
        with torch.cuda.device(device):     # (torch 2.13) or this stream's allocations
            side = torch.cuda.Stream(device)
            with torch.cuda.stream(side):
                out.append(torch.zeros((n,), dtype=torch.int32, device=device))
            side.synchronize()  # zeroed before any kernel of the caller's stream reads it
    worker = threading.Thread(target=make)
    worker.start()
    worker.join()
    if not out:
        raise RuntimeError("hot::scale_history: could not allocate the history block")
    return out[0]


def slot_of(history) -> Optional[torch.Tensor]:
    """(address tensor, slot) -> that slot's words as an int32 tensor view (the reference
    twin's way in), or None for None. Reads the address (a device sync on CUDA)."""
    if history is None:
        return None
    addr, slot = history
    t = _BY_ADDRESS.get((str(addr.device), int(addr.reshape(-1)[0].item())))
    if t is None:
        raise KeyError("hot::scale_history: address of no block of this process")
    return t.narrow(0, int(slot) * WORDS, WORDS)


def stats() -> Dict[Tuple[str, int], list]:
    """(device, key) -> per slot (calls, re-quantizations)."""
    out = {}
    with _LOCK:
        items = list(_BLOCKS.items())
    for (dev, key, _), t in items:
        w = t.view(-1, WORDS).cpu()
        out[(dev, key)] = [(int(r[1]), int(r[2])) for r in w]
    return out


def reset() -> None:
    """Forget every block (tests): graphs allocate anew on their next run. The old blocks
    stay allocated: a CUDA graph that captured one keeps its address."""
    with _LOCK:
        _RETIRED.extend(_BLOCKS.values())
        _BLOCKS.clear()
        _BY_ADDRESS.clear()
