"""hotcompile: HOT (Hadamard-based Optimized Training) as a torch.compile backend.

    model = torch.compile(model, backend="hot")                     # default config
    model = torch.compile(model, backend=hotcompile.backend(cfg))   # your config
    print(hotcompile.explain(model, *example_inputs))               # what gets rewritten, and why not
"""
from .entry import HotBackend, backend
from .config import HOTConfig
from .debug.report import Report, SiteRecord
from .explain import explain
from .runtime.lqs import TABLE as lqs_table

__all__ = ["HOTConfig", "HotBackend", "backend", "explain", "Report", "SiteRecord", "lqs_table"]
__version__ = "0.1.0"
