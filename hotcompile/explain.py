"""``explain(model, *inputs)``: compile once with a recording backend and return its report.

Why a fresh compile: the report is made by the joint-graph pass, which runs at compile
time. Only the forward is run (that compiles forward *and* backward); no gradient is
accumulated, and the global RNG state is restored so calling explain() changes nothing
about the user's run.
"""
from __future__ import annotations

from typing import Optional

import torch

from .entry import HotBackend
from .config import HOTConfig
from .debug.report import Report


def explain(model: torch.nn.Module, *example_inputs, config: Optional[HOTConfig] = None,
            **example_kwargs) -> Report:
    """Report what ``backend="hot"`` (with ``config``) does to each linear layer of ``model``."""
    model = getattr(model, "_orig_mod", model)      # an already compiled model: explain the original
    be = HotBackend(config)
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        with torch.enable_grad():
            compiled = torch.compile(model, backend=be)
            compiled(*example_inputs, **example_kwargs)
    finally:
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
    return be.report
