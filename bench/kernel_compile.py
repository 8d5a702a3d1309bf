"""How long each HOT kernel of a compiled graph takes to compile, one after another, offline.

Why: a cold first compile waits on its slowest kernel compiles. Inductor compiles its own
kernels while it generates the graph's code, but (torch 2.11, 2.13) a user-defined kernel,
every HOT kernel spliced into a graph, only when the compiled module loads
(``inductor_settings.early_kernel_compiles`` now starts them earlier). This script reads
Inductor's output code (``TORCH_LOGS=output_code``, ``bench/launch_counts.py --keep-code``,
or the fixtures in ``tests/data``), takes each HOT kernel's definition as the compile worker
would get it (its source, signature, constexprs and divisibility hints from ``triton_meta``,
its warps and stages from its config), and compiles it for sm_90 with Triton's cache off, so
a kernel change can be priced in compile time on a CPU machine.

    python bench/kernel_compile.py tests/data/output_code_llama_d4096_hot_backward_h200.py.gz
    python bench/kernel_compile.py CODE.py --only _hla
    python bench/kernel_compile.py CODE.py --current     # this tree's kernels, same launches

``--current`` compiles the working tree's kernel of each name (``hotcompile.kernels``) with
the output code's signature, constexprs and hints, so a kernel edit is priced before any GPU
has generated code with it.

Measured on the H200 machine's CPU (fortieth stop, one core each, Llama d4096's output code):
0.09 s (`_block_bound_kernel`) to 2.45 s (an `_hla_kernel` variant), 11 kernels 12.6 s in all.
"""
from __future__ import annotations

import argparse
import ast
import gzip
import importlib.util
import os
import re
import sys
import tempfile
import time
from typing import Iterator, Tuple

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

# the kernels HOT splices (every other user kernel and Inductor's own are left out)
HOT_PREFIXES = ("_hla", "_hq", "_weight", "_block", "_grad_out", "_scaled_mm", "_transpose")


def definitions(code: str, only: str = "") -> Iterator[Tuple[str, str, str]]:
    """``(variable, kernel name, module source)`` of each HOT kernel the output code defines."""
    pattern = r"^(\w+) = async_compile\.triton\('(\w+)', '''(.*?)''', device_str"
    for m in re.finditer(pattern, code, re.S | re.M):
        var, name, source = m.groups()
        if name.startswith(HOT_PREFIXES) and name.startswith(only or name):
            # the module's string literal, as Python reads it when the module loads
            yield var, name, ast.literal_eval("'''" + source + "'''")


def load(var: str, name: str, source: str):
    """The kernel's JITFunction and its ``user_autotune`` arguments, from its module source."""
    import torch._inductor.runtime.triton_heuristics as heuristics
    seen = {}

    def user_autotune(configs, triton_meta, filename=None, inductor_meta=None,
                      custom_kernel=False):
        seen.update(configs=configs, meta=triton_meta)
        return lambda fn: fn

    real = heuristics.user_autotune
    heuristics.user_autotune = user_autotune
    try:
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, f"{var}.py")
            with open(path, "w") as f:
                f.write(source)
            spec = importlib.util.spec_from_file_location(var, path)
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
    finally:
        heuristics.user_autotune = real
    return getattr(mod, name), seen["configs"], seen["meta"]


def current(name: str):
    """The working tree's JITFunction named ``name`` (``hotcompile.kernels``)."""
    from hotcompile.kernels import fused, gemm, grad_out, hadamard, hla
    for mod in (hadamard, hla, grad_out, fused, gemm):
        fn = getattr(mod, name, None)
        if fn is not None:
            return fn
    raise LookupError(f"no kernel {name} in hotcompile.kernels")


def compile_one(fn, configs, meta, arch: int = 90) -> float:
    """Seconds to compile the kernel as its worker would (first config, else Triton's
    defaults: 4 warps, 3 stages), for ``sm_<arch>``."""
    config = configs[0] if configs else {}
    src = ASTSource(fn=fn, signature=dict(meta["signature"]), constexprs=meta["constants"],
                    attrs=meta["configs"][0] if meta.get("configs") else {})
    t0 = time.perf_counter()
    triton.compile(src, target=GPUTarget("cuda", arch, 32),
                   options={"num_warps": config.get("num_warps", 4),
                            "num_stages": config.get("num_stages", 3)})
    return time.perf_counter() - t0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("code", help="Inductor output code (.py or .py.gz)")
    p.add_argument("--only", default="", help="kernel name prefix")
    p.add_argument("--current", action="store_true",
                   help="compile the working tree's kernels with the code's launch metadata")
    a = p.parse_args(argv)
    # every compile from scratch: a cached kernel would read as free
    os.environ["TRITON_ALWAYS_COMPILE"] = "1"
    opener = gzip.open if a.code.endswith(".gz") else open
    with opener(a.code, "rt") as f:
        code = f.read()
    total, rows = 0.0, 0
    print(f"triton {triton.__version__}, sm_90, one kernel at a time"
          + (", this tree's kernels" if a.current else ""))
    for var, name, source in definitions(code, a.only):
        fn, configs, meta = load(var, name, source)
        if a.current:
            fn = current(name)
            # the hints (``attrs``) are keyed by parameter position: a reordered kernel
            # would get them on the wrong arguments without an error
            if list(fn.arg_names) != list(meta["signature"]):
                raise SystemExit(f"{name}: this tree's parameters differ from the code's "
                                 f"({list(fn.arg_names)} vs {list(meta['signature'])})")
        s = compile_one(fn, configs, meta)
        total, rows = total + s, rows + 1
        print(f"{var:<32}{s:8.2f} s", flush=True)
    print(f"{rows} kernels, {total:.2f} s")
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
