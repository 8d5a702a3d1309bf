"""``rank="auto"``: the HLA rank of each site, chosen from measured g_W fidelity.

Why measured: HLA keeps the low-pass Hadamard coefficients of each block of 16
neighbouring tokens. Where neighbouring tokens are alike (image patches) a few
coefficients carry almost all of g_W; where they are not (bytes of text) the low-pass
rows drop most of it (byte-level GPT: r=8 val loss +94..192%). No fixed rank is right
for both, and the model can tell us: a graph runs every auto site at full rank; after
``rank_calibration_start`` steps (gradients at initialisation are nearly constant over
tokens and would pick r=1..2 even for text) it opens a window of ``rank_calibration_steps``
backward passes that measure, on the real g_y and x of the step, the relative error of
every rank r against full rank:

    P_j = g~_j^T x~_j  (the contribution of coefficient j, in sequency order)
    err(r) = || sum_{j >= r} P_j ||_F / || sum_j P_j ||_F

(16 GEMMs that together cost one full-rank g_W GEMM, in fp32, on the device, no host
sync). The accumulated squared errors are read once, when the backend's graph wrapper
decides (after the window), summed over distributed ranks so every rank decides alike,
and each ABC group (sites sharing one compressed x) gets the smallest rank within
``rank_tolerance``. The graph is then compiled once more with those ranks; nothing is
measured afterwards.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Optional

import torch

from ..kernels import reference as ref
from .lqs import capturing


@dataclasses.dataclass
class RankState:
    """Measurements of one ABC group (its sites share the compressed x, hence one rank)."""

    block: int = 16
    acc: Optional[torch.Tensor] = None     # (block + 2,): sum err^2 of rank 1..block, ||full||^2, count
    active: bool = False                   # the measuring window is open
    h: Optional[torch.Tensor] = None       # Hadamard rows in sequency order, on the device
    errors: Dict[int, float] = dataclasses.field(default_factory=dict)
    chosen: Optional[int] = None


STATES: Dict[str, RankState] = {}


def register(key: str, block: int) -> RankState:
    st = STATES.get(key)
    if st is None:
        st = STATES[key] = RankState(block=block)
    return st


def prepare(keys: List[str], device: torch.device) -> None:
    """Allocate the accumulators of these groups. Called by the graph wrapper at its first
    call, outside any CUDA-graph capture: the accumulator lives outside capture pools, and
    a graph captured before the window opens already holds the measuring kernels, whose
    replays keep writing into the same memory."""
    for key in keys:
        st = STATES[key]
        if st.acc is None or st.acc.device != device:
            st.acc = torch.zeros(st.block + 2, dtype=torch.float64, device=device)
            # built here: a host-to-device copy is illegal inside a capture
            st.h = ref.hla_matrix(st.block, "1d", st.block, device=device)


def open_window(keys: List[str]) -> None:
    """Count measurements from the next backward on (what replays added before is zeroed)."""
    for key in keys:
        STATES[key].acc.zero_()
        STATES[key].active = True


def measure(key: str, g: torch.Tensor, xq: torch.Tensor, x_scale: torch.Tensor, block: int,
            seq_len: int, seq_first: bool) -> None:
    """Accumulate err(r)^2 for r = 1..block of this backward's g_W (xq: full-rank levels)."""
    st = register(key, block)
    if st.chosen is not None or st.acc is None:
        return
    # Outside the window the measurement is skipped, except while a CUDA graph is captured:
    # replays run the captured kernels every step, and the window's opening zeroes what
    # they accumulated before it.
    if not (st.active or capturing(g)):
        return
    with torch.no_grad():
        gb = ref.sequence_blocks(g.float(), block, seq_len, seq_first)        # (nb, 16, O)
        gt = torch.einsum("rk,bkc->brc", st.h, gb)     # (nb, 16, O), sequency order
        xt = ref.dequantize(xq, x_scale.float()).reshape(gt.shape[0], block, -1)
        full = gt.reshape(-1, gt.shape[2]).t() @ xt.reshape(-1, xt.shape[2])
        part = torch.zeros_like(full)
        errs = []
        for j in range(block):
            part += gt[:, j].t() @ xt[:, j]
            errs.append((full - part).square().sum())
        st.acc[:block] += torch.stack(errs).double()
        st.acc[block] += full.square().sum().double()
        st.acc[block + 1] += 1


def decide(keys: List[str], tolerance: float, steps: int) -> Optional[Dict[str, int]]:
    """The chosen rank of every group in ``keys``, or None while a window is incomplete.

    One host sync; under ``torch.distributed`` the sums are all-reduced first, so every
    rank decides the same (all ranks call this at the same step of the same graph)."""
    states = [STATES.get(k) for k in keys]
    if any(st is None or st.acc is None or not st.active for st in states):
        return None
    acc = torch.stack([st.acc for st in states])
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        acc = acc.clone()
        dist.all_reduce(acc)
        acc = acc / dist.get_world_size()
    acc = acc.cpu()
    if float(acc[:, -1].min()) < steps:
        return None
    out = {}
    for key, st, row in zip(keys, states, acc):
        norm = float(row[st.block])
        st.errors = {r: (math.sqrt(max(float(row[r - 1]), 0.0) / norm) if norm > 0 else 0.0)
                     for r in range(1, st.block + 1)}
        st.chosen = min(r for r, e in st.errors.items() if e <= tolerance or r == st.block)
        st.active = False
        out[key] = st.chosen
    return out


def clear() -> None:
    STATES.clear()
