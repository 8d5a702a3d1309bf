"""What one compiled graph launches, read from Inductor's output code.

Why from the output code: it is what runs. Issue 11 counts, per rewritten site, HOT's
kernels in the forward and the launches in the backward; which graph a kernel lands in is
the partitioner's decision (HQ W runs in the forward, o_proj's ABC in the backward on
Llama: docs/BENCHMARKS.md, thirty-second stop), so neither the pass nor the report can say
it. ``run_and_get_code`` or ``TORCH_LOGS=output_code`` gives the code; ``launches(code)``
counts what its ``call`` runs:

- Triton launches (``name.run(...)``), by kernel: HOT's (the package's ``*_kernel``
  functions, named as the code's ``async_compile.triton('name', ...)`` defines them) apart
  from Inductor's own;
- C++ kernels of a CPU graph (``cpp_fused_*(...)``), as Inductor's;
- extern kernels (``extern_kernels.mm``, ``extern_kernels._scaled_mm``: cuBLAS) and op
  calls (``torch.ops.aten._scaled_dot_product_cudnn_attention``, ``torch.ops.hot.*``), by name.

Comments and the kernels' source strings are skipped (both mention ops and ``.run``).
"""
from __future__ import annotations

import functools
import re
from collections import Counter
from typing import Dict

_DEFINE = re.compile(r"^(\w+) = async_compile\.\w+\('(\w+)'")
_TRITON = re.compile(r"\b(\w+)\.run\(")
_CPP = re.compile(r"\b(cpp_fused_\w+)\(")
_EXTERN = re.compile(r"\bextern_kernels\.(\w+)\(")
_OP = re.compile(r"\btorch\.ops\.(\w+)\.(\w+)(?:\.\w+)?\(")
_QUOTES = ("'''", '"""')


@functools.lru_cache(maxsize=1)
def hot_kernel_names() -> frozenset:
    """The package's Triton kernels: every ``@triton.jit`` function of ``hotcompile.kernels``
    named ``*_kernel`` (the helpers they call are inlined into them)."""
    import importlib
    import pkgutil

    from triton.runtime.jit import JITFunction

    from .. import kernels
    names = set()
    for info in pkgutil.iter_modules(kernels.__path__):
        mod = importlib.import_module(f"{kernels.__name__}.{info.name}")
        names.update(n for n, v in vars(mod).items()
                     if isinstance(v, JITFunction) and n.endswith("_kernel"))
    return frozenset(names)


def _code_lines(code: str):
    """The code's lines outside triple-quoted strings and comments."""
    inside = None
    for line in code.splitlines():
        if inside:
            if inside in line:
                inside = None
            continue
        opened = [q for q in _QUOTES if line.count(q) % 2 == 1]
        if opened:
            inside = opened[0]
        stripped = line.strip()
        if stripped and not stripped.startswith("#"):
            yield line.split(" #")[0]


def launches(code: str) -> Dict:
    """Counts of what ``code`` (one graph's output code) launches:
    ``{"hot": {kernel: n}, "inductor": n, "extern": {name: n}, "ops": {"ns.op": n}}``."""
    hot = hot_kernel_names()
    defined: Dict[str, str] = {}
    counts = {"hot": Counter(), "inductor": 0, "extern": Counter(), "ops": Counter()}
    for line in _code_lines(code):
        m = _DEFINE.match(line)
        if m:
            defined[m.group(1)] = m.group(2)
            continue
        for var in _TRITON.findall(line):
            name = defined.get(var, var)
            if name in hot:
                counts["hot"][name] += 1
            else:
                counts["inductor"] += 1
        counts["inductor"] += len(_CPP.findall(line))
        counts["extern"].update(_EXTERN.findall(line))
        counts["ops"].update(f"{ns}.{op}" for ns, op in _OP.findall(line))
    return {k: dict(v) if isinstance(v, Counter) else v for k, v in counts.items()}


def site_op_calls(counts: Dict) -> int:
    """``hot::`` op calls in ``launches``' counts but the graph's one seed draw: the sites
    whose kernels run behind ops (a CPU graph, ``splice=False``, a run-time choice) rather
    than spliced into the graph."""
    return sum(n for op, n in counts["ops"].items()
               if op.startswith("hot.") and op != "hot.draw_seeds")
