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
has generated code with it (a constexpr added at the end of the parameters since then
compiles at its default, or at ``--set``'s value). ``--instructions`` also reads each binary: SASS instructions
(all paths, the rare IEEE branch included), registers, layout conversions in the TTGIR,
barriers and shared-memory instructions, and the commonest opcodes; ``--set NAME=VALUE``
compiles another value of a constexpr (``--set CHUNKS=3 --warps 8``, a tile the code did not
launch). The stochastic kernels are bound by instruction issue or by latency, not by bytes:
this is how the forty-second stop found the layout conversion in the HLA tile and counted
what each rewrite saved before timing it (docs/BENCHMARKS.md).

    python bench/kernel_compile.py CODE.py --current --only _hla --instructions

Measured on the H200 machine's CPU (fortieth stop, one core each, Llama d4096's output code):
0.09 s (`_block_bound_kernel`) to 2.45 s (an `_hla_kernel` variant), 11 kernels 12.6 s in all.
"""
from __future__ import annotations

import argparse
import ast
import collections
import gzip
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import time
from typing import Iterator, Tuple

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_regs import _ptxas, sass_opcodes  # noqa: E402

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


# constexprs renamed since the checked-in output codes were generated: kernel -> {old name:
# (new name, the new value of an old one)}. The per-token kernel's ONE_TILE (the row is one
# tile, held) became CHUNKS (how many chunks are held; 0: two sweeps) at the 42nd stop.
RENAMED = {"_hq_token_kernel": {"ONE_TILE": ("CHUNKS", int)}}


def _renamed(name: str, meta: dict) -> dict:
    """``meta`` with the constexprs ``RENAMED`` lists under their new names and values (the
    signature's order kept: the hints are keyed by position)."""
    renames = RENAMED.get(name, {})
    if not any(k in meta["signature"] for k in renames):
        return meta
    signature = {renames.get(k, (k,))[0]: v for k, v in meta["signature"].items()}
    constants = {(renames[k][0] if k in renames else k): (renames[k][1](v) if k in renames else v)
                 for k, v in meta["constants"].items()}
    return dict(meta, signature=signature, constants=constants)


def with_new_constexprs(name: str, fn, meta: dict) -> dict:
    """The code's launch metadata for this tree's kernel ``fn``: its parameters must be the
    code's, in order (the hints, ``attrs``, are keyed by position: a reordered kernel would
    get them on the wrong arguments without an error), after the renames of ``RENAMED``,
    plus any trailing constexprs added since the code was generated, which compile at their
    defaults (``--set`` another value)."""
    meta = _renamed(name, meta)
    code, tree = list(meta["signature"]), list(fn.arg_names)
    added = fn.params[len(code):]
    if tree[:len(code)] != code or not all(p.is_constexpr and p.has_default for p in added):
        raise SystemExit(f"{name}: this tree's parameters differ from the code's "
                         f"({tree} vs {code})")
    if not added:
        return meta
    meta = dict(meta, signature=dict(meta["signature"]), constants=dict(meta["constants"]))
    for p in added:
        meta["signature"][p.name] = "constexpr"
        meta["constants"][p.name] = p.default
    return meta


def compile_one(fn, configs, meta, arch: int = 90, overrides=None, warps=None):
    """(seconds, compiled kernel): the kernel compiled as its worker would (first config,
    else Triton's defaults: 4 warps, 3 stages), for ``sm_<arch>``; ``overrides`` replace
    the constexprs the kernel has, ``warps`` the config's warps."""
    config = configs[0] if configs else {}
    constants = dict(meta["constants"])
    constants.update({k: v for k, v in (overrides or {}).items() if k in constants})
    src = ASTSource(fn=fn, signature=dict(meta["signature"]), constexprs=constants,
                    attrs=meta["configs"][0] if meta.get("configs") else {})
    t0 = time.perf_counter()
    k = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                       options={"num_warps": warps or config.get("num_warps", 4),
                                "num_stages": config.get("num_stages", 3)})
    return time.perf_counter() - t0, k


def instructions(k) -> dict:
    """What a compiled kernel's binary holds: SASS instruction count and the commonest
    opcodes (``kernel_regs.sass_opcodes``), registers a thread (``cuobjdump -res-usage``:
    the cubin itself, no second assembly), layout conversions in the TTGIR, barriers and
    shared-memory loads and stores."""
    ops = sass_opcodes(k.asm["cubin"]) or collections.Counter()
    tool = os.path.join(os.path.dirname(_ptxas()), "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        res = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    regs = re.search(r"REG:(\d+)", res)
    return dict(instructions=sum(ops.values()), registers=int(regs.group(1)) if regs else None,
                conversions=k.asm["ttgir"].count("ttg.convert_layout"), barriers=ops["BAR"],
                shared=ops["STS"] + ops["LDS"] + ops["LDSM"], top=ops.most_common(8))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("code", help="Inductor output code (.py or .py.gz)")
    p.add_argument("--only", default="", help="kernel name prefix")
    p.add_argument("--current", action="store_true",
                   help="compile the working tree's kernels with the code's launch metadata")
    p.add_argument("--instructions", action="store_true",
                   help="also report each binary's instructions, registers, conversions")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="another value of a constexpr (an int), for every kernel compiled")
    p.add_argument("--warps", type=int, help="warps instead of the code's")
    a = p.parse_args(argv)
    overrides = {}
    for kv in a.set:
        name, _, value = kv.partition("=")
        try:
            overrides[name] = int(value)
        except ValueError:
            raise SystemExit(f"--set {kv}: expected NAME=INTEGER") from None
    # every compile from scratch: a cached kernel would read as free
    os.environ["TRITON_ALWAYS_COMPILE"] = "1"
    opener = gzip.open if a.code.endswith(".gz") else open
    with opener(a.code, "rt") as f:
        code = f.read()
    total, rows = 0.0, 0
    print(f"triton {triton.__version__}, sm_90, one kernel at a time"
          + (", this tree's kernels" if a.current else ""))
    unused = set(overrides)      # --set names no compiled kernel has
    for var, name, source in definitions(code, a.only):
        fn, configs, meta = load(var, name, source)
        if a.current:
            fn = current(name)
            meta = with_new_constexprs(name, fn, meta)
        unused -= set(meta["constants"])
        s, k = compile_one(fn, configs, meta, overrides=overrides, warps=a.warps)
        total, rows = total + s, rows + 1
        print(f"{var:<32}{s:8.2f} s", flush=True)
        if a.instructions:
            r = instructions(k)
            print(f"    {r['instructions']} instructions, {r['registers']} registers, "
                  f"{r['conversions']} layout conversions, {r['barriers']} barriers, "
                  f"{r['shared']} shared-memory loads/stores; "
                  + " ".join(f"{op} {n}" for op, n in r["top"]), flush=True)
    print(f"{rows} kernels, {total:.2f} s")
    if unused:
        raise SystemExit(f"--set {', '.join(sorted(unused))}: not a constexpr of any kernel "
                         "compiled")
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
