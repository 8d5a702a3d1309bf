"""Layer-wise quantizer selection (LQS): a runtime table, not a graph constant.

Why a table: the HQ op in the compiled graph carries only its site key; it asks this
table at run time whether to scale the transformed gradient per token or per tensor.
Changing a choice (calibration finishing, re-calibration, loading a JSON file) therefore
never recompiles anything.

Rule (HOT paper): on real gradients, e_tok = ||g - Q_tok(g)||, e_ten = ||g - Q_ten(g)||
(quantization at the path's bit width, measured on the Hadamard-transformed gradient that
is actually quantized, with the op's own stochastic rounding: scoring with round-to-nearest,
as the authors' code does, favours per-tensor on outlier-token gradients where the op's
stochastic per-tensor levels are 2-2.5x worse); choose per-token iff e_tok < ratio * e_ten.

Keys: one entry per (backend instance, compiled graph, site), so two models in one
process, or one model compiled twice with different configs, never share a choice.
Blocks that Dynamo serves from one compiled graph (per-block compile) share that graph's
entry: its choice is pooled over all of them. ``lqs_file`` stores choices by the site's
name within its graph and is written by distributed rank 0 only. Unlike the authors'
code (one batch before training) the errors are accumulated over the first
``calibration_steps`` backward passes of the real compiled run, optionally re-measured
every ``recalibrate_every`` steps, and can be saved/loaded as JSON.
"""
from __future__ import annotations

import dataclasses
import json
import os
import threading
from typing import Dict, Optional

import torch

from ..kernels import reference as ref


@dataclasses.dataclass
class SiteChoice:
    """LQS state of one linear site."""

    per_token: Optional[bool] = None        # None: not decided yet
    err_token: float = 0.0                  # accumulated squared errors of the window
    err_tensor: float = 0.0
    steps: int = 0                          # backward passes seen
    window: int = 0                         # passes measured in the current window
    calibration_steps: int = 3
    ratio: float = 0.5
    recalibrate_every: int = 0
    source: str = "default"                 # "calibrated", "file", "forced"

    @property
    def choice(self) -> str:
        return {None: "calibrating", True: "token", False: "tensor"}[self.per_token]

    def errors(self) -> tuple[float, float]:
        """RMS-normalised errors of the last measured window (token, tensor)."""
        n = max(self.window, 1)
        return (self.err_token / n) ** 0.5, (self.err_tensor / n) ** 0.5


def quantization_errors(g: torch.Tensor, bits: int, block: int, seed=None) -> tuple[float, float]:
    """Squared relative errors of per-token and per-tensor quantization of H-transformed g,
    with the op's stochastic rounding (same Philox bits for both candidates)."""
    gh = ref.block_fwht(ref.pad_cols(g.detach().float(), block), block)
    norm = gh.square().sum().clamp_min(1e-30)
    if seed is None:
        seed = int(torch.randint(0, 2 ** 62, (), device="cpu"))
    out = []
    for per_row in (True, False):
        q, s = ref.quantize(gh, bits, per_row=per_row, stochastic=True, seed=seed)
        out.append(float((gh - ref.dequantize(q, s)).square().sum() / norm))
    return out[0], out[1]


def _is_rank0() -> bool:
    dist = torch.distributed
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def capturing(g: torch.Tensor) -> bool:
    """Whether g's stream is being captured into a CUDA graph."""
    return g.is_cuda and torch.cuda.is_current_stream_capturing()


class LQSTable:
    """Map of runtime key -> SiteChoice, consulted by hot::hq_grad_input.

    Runtime keys are ``"<backend>/<graph>/<site>"`` (see ``runtime_key``); files store the
    site part only, so a restarted run (new backend ids) reuses them."""

    def __init__(self):
        self.sites: Dict[str, SiteChoice] = {}
        self.files: Dict[str, str] = {}        # runtime key -> JSON file to save into
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ setup
    def register(self, site: str, calibration_steps=3, ratio=0.5, recalibrate_every=0,
                 lqs_file: Optional[str] = None, forced: Optional[str] = None) -> SiteChoice:
        with self._lock:
            c = self.sites.get(site)
            if c is None:
                c = self.sites[site] = SiteChoice()
            c.calibration_steps, c.ratio = calibration_steps, ratio
            c.recalibrate_every = recalibrate_every
            if forced is not None:
                c.per_token, c.source = forced == "token", "forced"
            if lqs_file:
                self.files[site] = lqs_file
        if lqs_file and forced is None and os.path.exists(lqs_file):
            self.load(lqs_file, only=[site])
        return c

    def keys_of(self, site: str) -> list:
        """Runtime keys of a site given by runtime key or by name (every graph holding it)."""
        return [k for k in self.sites if k == site or file_key(k) == site]

    def by_name(self, site: str) -> SiteChoice:
        """The entry of a site named as in the report (the first graph holding it)."""
        keys = self.keys_of(site)
        if not keys:
            raise KeyError(site)
        return self.sites[keys[0]]

    def set(self, site: str, per_token: bool) -> None:
        """Force a site's choice by hand, by runtime key or by name (takes effect at the
        next backward, no recompile)."""
        for key in self.keys_of(site) or [site]:
            c = self.sites.setdefault(key, SiteChoice())
            c.per_token, c.source = per_token, "forced"

    def recalibrate(self, site: Optional[str] = None) -> None:
        """Start a new calibration window now (one site by key or name, or all)."""
        wanted = None if site is None else set(self.keys_of(site))
        for key, c in self.sites.items():
            if wanted is None or key in wanted:
                if c.source != "forced":
                    c.per_token, c.window, c.err_token, c.err_tensor = None, 0, 0.0, 0.0

    # ------------------------------------------------------------------ runtime
    def calibrating(self, site: str) -> bool:
        """Whether the site's choice is still open (unknown sites calibrate first)."""
        c = self.sites.get(site)
        return c is None or c.per_token is None

    def per_token(self, site: str, g: torch.Tensor, bits: int, block: int) -> bool:
        """Decide (and while calibrating, measure) the scaling of this backward's g."""
        c = self.sites.get(site)
        if c is None:
            c = self.register(site)
        c.steps += 1
        if (c.recalibrate_every and c.source != "forced" and c.steps > 1
                and (c.steps - 1) % c.recalibrate_every == 0):
            c.per_token, c.window, c.err_token, c.err_tensor = None, 0, 0.0, 0.0
        if c.per_token is not None:
            return c.per_token
        if capturing(g):
            # CUDA-graph capture (mode="reduce-overhead"): measuring would read the errors
            # back to the host, which capture forbids, and the captured graph freezes the
            # branch anyway. Decide now from the windows measured in the eager warm-up.
            if c.window:
                self._decide(site, c)
                return c.per_token
            return True
        e_tok, e_ten = quantization_errors(g, bits, block)
        c.err_token += e_tok
        c.err_tensor += e_ten
        c.window += 1
        if c.window >= c.calibration_steps:
            self._decide(site, c)
        return True   # per-token while calibrating: never worse than per-tensor at 4 bits

    def _decide(self, site: str, c: SiteChoice) -> None:
        e_tok, e_ten = c.errors()
        c.per_token = e_tok < c.ratio * e_ten
        c.source = "calibrated"
        if site in self.files and _is_rank0():
            self.save(self.files[site])

    # ------------------------------------------------------------------ persistence
    def to_json(self) -> dict:
        out = {}
        for k, c in self.sites.items():
            if c.per_token is None:
                continue
            e_tok, e_ten = c.errors()
            out[file_key(k)] = {"choice": c.choice, "err_token": e_tok, "err_tensor": e_ten,
                      "source": c.source}
        return out

    def save(self, path: str) -> None:
        existing = {}
        if os.path.exists(path):
            with open(path) as f:
                existing = json.load(f)
        existing.update(self.to_json())
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(existing, f, indent=1, sort_keys=True)
        os.replace(tmp, path)

    def load(self, path: str, only=None) -> int:
        with open(path) as f:
            data = json.load(f)
        n = 0
        wanted = None if only is None else {file_key(k): k for k in only}
        for k, rec in data.items():
            if wanted is not None:
                if k not in wanted:
                    continue
                k = wanted[k]
            if rec.get("choice") not in ("token", "tensor"):
                raise ValueError(f"{path}: site {k!r} has invalid choice {rec.get('choice')!r}")
            c = self.sites.setdefault(k, SiteChoice())
            c.per_token, c.source = rec["choice"] == "token", "file"
            c.window = 1
            c.err_token = float(rec.get("err_token", 0.0)) ** 2
            c.err_tensor = float(rec.get("err_tensor", 0.0)) ** 2
            n += 1
        return n

    def clear(self) -> None:
        self.sites.clear()
        self.files.clear()


def runtime_key(backend_id: int, graph_index: int, site_key: str) -> str:
    """The key of one site of one compiled graph of one backend instance."""
    return f"{backend_id}/{graph_index}/{site_key}"


def file_key(key: str) -> str:
    """The part of a runtime key stored in files: the site's name within its graph."""
    return key.split("/", 2)[-1]


TABLE = LQSTable()
