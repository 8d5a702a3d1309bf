"""``explain(model, *inputs)``: compile once with a recording backend and return its report.

Why a fresh compile: the report is made by the joint-graph pass, which runs at compile
time. Only the forward is run (that compiles forward *and* backward); no gradient is
accumulated. explain() changes nothing about the user's run: the global RNG states
(dropout draws) and every buffer (BatchNorm running statistics, ``num_batches_tracked``)
are restored, parameters are only read, and it compiles with grad enabled even when called
under ``torch.no_grad()`` or ``torch.inference_mode()`` (otherwise every layer would look
frozen).
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
    be = HotBackend(config, root=model)
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    with torch.inference_mode(False), torch.no_grad():
        buffers = [(b, b.detach().clone()) for b in model.buffers()]
    # a model.compile()d module would run its own compiled code inside ours: not this backend's
    own_compiled = getattr(model, "_compiled_call_impl", None)
    if own_compiled is not None:
        model._compiled_call_impl = None
    try:
        with torch.inference_mode(False), torch.enable_grad():
            compiled = torch.compile(model, backend=be)
            compiled(*example_inputs, **example_kwargs)
    finally:
        if own_compiled is not None:
            model._compiled_call_impl = own_compiled
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
    return be.report
