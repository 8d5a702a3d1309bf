"""Registers, spills and shared-memory instructions of HOT's Triton kernels for sm_90,
compiled offline: no GPU needed.

Why: a memory-bound kernel that spills registers to local memory moves far more bytes than
its tensors, and the H100 timings alone do not say why a kernel sits at 30% of copy
bandwidth. Triton compiles for a target without a device, and its wheel carries ``ptxas``,
whose ``-v`` report gives the registers per thread and the spill stores. This script
compiles each kernel with the tile its launcher picks for a shape and prints that report,
so a kernel change can be checked for spills on a CPU machine before any device time.

Caveat: launches specialise every integer argument that happens to be divisible by 16
(``tt.divisibility``); this marks pointers, strides, leading dimensions, ``O_pad`` and ``K``
(multiples of 16 in HOT's buffers) and the sizes ``L``, ``O``, ``C`` and ``S`` where the
shape's own are (at the default shapes all are): left unmarked, a mask on ``cols < O``
splits the per-token kernel's 16-byte loads into 2-byte ones (32 instead of 4 a thread),
which no launch at these shapes compiles. Counts can still differ from a launched binary.
A spill here is a strong hint, not a measurement of speed.

    python bench/kernel_regs.py                        # Llama d4096 and ViT-B shapes
    python bench/kernel_regs.py --shapes 8192x4096x14336 --rank 8

Measured with triton 3.6.0 (2026-11-23): at rank 8 nothing spills; at the default rank 16
the phase-2 HLA kernel and the one-pass grad_out pair hit the 255-register cap and spill
(132 and 216 bytes per thread), which fits their H100 timings (HLA at 11-33% of copy
bandwidth; the pair slower than the two separate kernels at rank 16 only).
"""
from __future__ import annotations

import argparse
import collections
import inspect
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

DEFAULT_SHAPES = "8192x4096x4096,8192x4096x14336,8192x14336x4096,12608x768x3072"


def _ptxas() -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


def signature(kernel, pointers: dict, constexprs: dict) -> dict:
    """Triton signature of ``kernel``: pointer dtypes from ``pointers``, ``alpha`` fp32,
    every other runtime argument i32, the compile-time ones "constexpr"."""
    sig = {}
    for name in inspect.signature(kernel.fn).parameters:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in pointers:
            sig[name] = pointers[name]
        else:
            sig[name] = "fp32" if name in ("alpha", "scale_mul") else "i32"
    return sig


def report(kernel, pointers: dict, constexprs: dict, warps: int, stages: int = 3,
           sizes16: tuple = ()) -> dict:
    """Compile for sm_90a and read ptxas -v: registers per thread, spill stores (bytes).
    ``sizes16``: the size arguments (``L``, ``O``, ...) whose values at this shape are
    multiples of 16, which a launch specialises as such."""
    names = list(inspect.signature(kernel.fn).parameters)
    # what a launch specialises: pointers are 16-byte aligned (torch allocations), leading
    # dimensions and strides of HOT's operands are multiples of 16 (padded buffers)
    aligned = [i for i, n in enumerate(names) if n not in constexprs and
               (n in pointers or n.startswith(("ld", "stride")) or n in ("O_pad", "K")
                or n in sizes16)]
    src = ASTSource(fn=kernel, signature=signature(kernel, pointers, constexprs),
                    constexprs=constexprs,
                    attrs={(i,): [["tt.divisibility", 16]] for i in aligned})
    ck = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                        options={"num_warps": warps, "num_stages": stages})
    with tempfile.TemporaryDirectory() as d:
        ptx = os.path.join(d, "k.ptx")
        with open(ptx, "w") as f:
            f.write(ck.asm["ptx"])
        out = subprocess.run([_ptxas(), "-arch=sm_90a", "-v", ptx, "-o", os.path.join(d, "k.o")],
                             capture_output=True, text=True)
    text = out.stdout + out.stderr
    regs = re.findall(r"Used (\d+) registers", text)
    spills = re.findall(r"(\d+) bytes spill stores", text)
    return {"registers": int(regs[-1]) if regs else None,
            "spill_bytes": int(spills[-1]) if spills else None,
            "shared": ck.metadata.shared,
            "smem_ops": shared_memory_ops(ck.asm["cubin"])}


def sass_opcodes(cubin: bytes):
    """Opcode counts of a kernel's SASS (``nvdisasm`` of its cubin), each instruction counted
    where it appears in the code (a loop body or a branch counts once); None: no
    ``nvdisasm`` in this triton wheel."""
    tool = os.path.join(os.path.dirname(_ptxas()), "nvdisasm")
    if not os.path.exists(tool):
        return None
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        sass = subprocess.run([tool, "-c", path], capture_output=True, text=True).stdout
    return collections.Counter(re.findall(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)",
                                          sass, re.M))


def shared_memory_ops(cubin: bytes) -> int:
    """Shared-memory loads and stores (STS, LDS, LDSM) in a kernel's SASS (``sass_opcodes``).
    Why: a tile moved between register layouts through shared memory (a
    ``ttg.convert_layout`` Triton could not lower to register moves) costs a store, a
    barrier and a load per tile, which a memory-bound kernel pays on every tile: g's HLA
    operand has 16 STS and 16 LDSM for its two branches (bench/NOTES_kernels.md,
    thirty-seventh stop); a cross-warp reduction (a row's max over 4 warps) takes a few.
    None: no ``nvdisasm`` in this triton wheel."""
    ops = sass_opcodes(cubin)
    return None if ops is None else ops["STS"] + ops["LDS"] + ops["LDSM"]


def kernels_for(L: int, I: int, O: int, rank: int):
    """(name, kernel, pointer dtypes, constexprs, warps) of one linear site's kernels, with
    the tiles their launchers pick at this shape (bf16 activations, defaults)."""
    from hotcompile.kernels import gemm, grad_out, hadamard as H, hla
    o_pad = -(-O // 16) * 16
    rows = []
    bc, chunks, br, warps = H.token_tile(o_pad, False)
    for plain in (False, True):     # HQ levels, or g's plain e4m3 copy (exact_gx_gemm)
        rows.append((f"hq g per token{' plain e4m3' if plain else ''}", H._hq_token_kernel,
                     {"g_ptr": "*bf16", "q_ptr": "*fp8e4nv" if plain else "*i8",
                      "s_ptr": "*fp32", "seed_ptr": "*i64", "m_ptr": "*fp32", "z_ptr": "*i32"},
                     dict(BR=br, BC=bc, CHUNKS=chunks, Q=448 if plain else 7, FP8=plain,
                          INTERPRET=False, ROW_MAX=True, PLAIN=plain), warps))
    rows.append(("hla g bound", hla._block_bound_kernel, {"m_ptr": "*fp32", "out_ptr": "*i32"},
                 dict(BB=64), 4))
    # the slotted W kernels with one weight, and with all 8 slots (their selects live)
    for n, row_max in ((1, False), (1, True), (8, True)):
        ptrs = {}
        for k in range(n):
            ptrs.update({f"p{k}": "*fp32", f"w{k}": "*bf16", f"c{k}": "*i32",
                         f"r{k}": "*i32" if row_max else "*fp32"})
        rows.append((f"W cast{' + row maxima' if row_max else ''}{f' x{n}' if n > 1 else ''}",
                     H._weight_cast_kernel, ptrs,
                     dict(zip(("ROWS", "BO", "BI"), H.cast_tile(False)[:3]), N=n, BF16=True,
                          ROW_MAX=row_max), H.cast_tile(False)[3]))
    bc, _ = H.column_tile(o_pad, max_tile=512)
    wbi, wbo, wwarps = H.weight_tile(o_pad, False)
    for phase in (1, 2):
        rows.append((f"hq g per tensor p{phase}", H._hq_tensor_kernel,
                     {"g_ptr": "*bf16", "q_ptr": "*i8", "s_ptr": "*fp32", "amax_ptr": "*i32",
                      "seed_ptr": "*i64"},
                     dict(PHASE=phase, BR=max(1, 4096 // bc), BC=bc, Q=7, FP8=False,
                          INTERPRET=False), 8))
        # W levels (INT8 GEMM) or scaled e4m3 (cuBLAS FP8); W bf16, or the fp32 parameter
        # rounded to bf16 as it is read (recompute_operands)
        for e4m3, param in ((False, False), (True, False), (True, True)):
            w_type = "*fp32" if param else "*bf16"
            rows.append((f"hq W{' e4m3' if e4m3 else ''}{' fp32->bf16' if param else ''}"
                         f" p{phase}", H._hq_weight_kernel,
                         {"w_ptr": w_type, "q_ptr": "*fp8e4nv" if e4m3 else "*i8",
                          "s_ptr": "*fp32", "amax_ptr": "*i32"},
                         dict(PHASE=phase, BI=wbi, BO=wbo,
                              Q=448 if e4m3 else 127, FP8=False, E4M3=e4m3, INTERPRET=False,
                              ROUND=H.tl.bfloat16 if param else None, ROTATE=True),
                         wwarps))
    # the forward's W operands (weight_operands: HQ's e4m3 W and the row-wise FP8 forward's
    # W from one read), one weight in the slotted kernel
    ebi, ebo, ewarps = H.weight_tile(o_pad, False, True)
    for n in (1, 8):
        ptrs = {}
        for k in range(n):
            ptrs.update({f"w{k}": "*bf16", f"q{k}": "*fp8e4nv", f"s{k}": "*fp32", f"a{k}": "*i32",
                         f"f{k}": "*fp8e4nv", f"fs{k}": "*fp32", f"fm{k}": "*i32"})
        rows.append((f"W operands e4m3 + FP8 forward W{f' x{n}' if n > 1 else ''}",
                     H._weight_operands_kernel, ptrs,
                     dict(N=n, BI=ebi, BO=ebo, Q=28, INTERPRET=False, FWD=2, ROTATE=True),
                     ewarps))
    for what, C, stochastic in (("hla g", O, True), ("abc x", I, False)):
        for e4m3 in (False, True):     # int8 levels (INT8 GEMM) or scaled e4m3 (cuBLAS FP8)
            rp = hla._pow2_at_least(rank)
            # the tile hla_quant launches (word pairs where they apply)
            bt, bcc, warps, cpt, step, pairs = hla.tile_plan(
                C, rp, stochastic=stochastic, e4m3=e4m3, transposed=stochastic or e4m3)
            ptrs = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv" if e4m3 else "*i8", "s_ptr": "*fp32",
                    "amax_ptr": "*i32", "seed_ptr": "*i64"}
            bound = e4m3 and not stochastic     # the saved x's bound scale: phase 2 alone
            for phase in (2,) if bound else (1, 2):
                rows.append((f"{what}{' e4m3' if e4m3 else ''} p{phase}", hla._hla_kernel, ptrs,
                             dict(PHASE=phase, BT=bt, BC=bcc, RP=hla._pow2_at_least(rank),
                                  RANK=rank, KEPT=hla._packed_rows(rank, "1d"),
                                  Q=(28 if bound else 448) if e4m3 else 127,
                                  STOCHASTIC=stochastic, TRANSPOSED=stochastic or e4m3,
                                  INTERPRET=False, E4M3=e4m3, CPT=cpt, FLAT=True,
                                  EVEN_C=C % bcc == 0, BOUND=bound, STEP=step, PAIRS=pairs,
                                  ROW_STRIDE=C if pairs else 0),
                             warps))
    bt, bcc, warps, hr = grad_out.tile_shape(o_pad, False)
    for phase in (1, 2):
        rows.append((f"grad_out p{phase}", grad_out._grad_out_kernel,
                     {"g_ptr": "*bf16", "hq_ptr": "*i8", "hq_s_ptr": "*fp32", "hla_ptr": "*i8",
                      "hla_s_ptr": "*fp32", "amax_ptr": "*i32", "hq_seed_ptr": "*i64",
                      "hla_seed_ptr": "*i64"},
                     dict(PHASE=phase, PER_TOKEN=True, BT=bt, BC=bcc, HR=hr,
                          RP=hla._pow2_at_least(rank), RANK=rank,
                          KEPT=hla._packed_rows(rank, "1d"), HQ_Q=7, HLA_Q=127, FP8=False,
                          INTERPRET=False), warps))
    sms = 132
    for what, M, N, K in (("gemm g_x", L, I, o_pad), ("gemm g_W", O, I, -(-L // 16) * rank)):
        name = gemm.tile_config(M, N, K, sms)
        bm, bn, bk, warps, stages, _ = gemm.CONFIGS[name]
        rows.append((f"{what} ({name})", gemm._scaled_mm_kernel,
                     {"a_ptr": "*i8", "bt_ptr": "*i8", "out_ptr": "*bf16", "rs_ptr": "*fp32",
                      "cs_ptr": "*fp32"},
                     dict(ROW_VEC=True, COL_VEC=True, FP8=False, EXACT_ACC=False,
                          EVEN_K=K % bk == 0, BM=bm, BN=bn, BK=bk, GROUP_M=8, CHUNKED=False,
                          K_CHUNK=0), (warps, stages)))
    return rows


def site_reports(L: int, I: int, O: int, rank: int):
    """[(kernel name, report)] for one site's kernels at this shape."""
    out = []
    for name, kernel, ptrs, const, warps in kernels_for(L, I, O, rank):
        w, st = warps if isinstance(warps, tuple) else (warps, 3)
        # the g side's sizes are (L, O), the x side's (L, I): C and S are the HLA kernel's
        c = I if name.startswith("abc") else O
        # the slotted W kernels: each slot's W (O, I) and row stride I (the same shape)
        slot = tuple((f"{a}{k}", v) for k in range(8) for a, v in (("O", O), ("I", I), ("sp", I)))
        sizes16 = tuple(n for n, v in (("L", L), ("O", O), ("C", c), ("S", L)) + slot
                        if v % 16 == 0)
        out.append((name, report(kernel, ptrs, const, w, st, sizes16)))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma list of LxIxO")
    p.add_argument("--rank", type=int, default=16)
    a = p.parse_args(argv)
    print(f"sm_90a, triton {triton.__version__}, HLA rank {a.rank}")
    print(f"{'shape L x I -> O':<22}{'kernel':<28}{'regs':>6}{'spill B':>9}{'smem B':>8}"
          f"{'smem ops':>9}")
    worst = 0
    for item in a.shapes.split(","):
        L, I, O = (int(v) for v in item.lower().split("x"))
        for name, r in site_reports(L, I, O, a.rank):
            worst = max(worst, r["spill_bytes"] or 0)
            print(f"{item:<22}{name:<28}{r['registers']!s:>6}{r['spill_bytes']!s:>9}"
                  f"{r['shared']:>8}{r['smem_ops']!s:>9}", flush=True)
    print(f"largest spill: {worst} bytes per thread")
    return 0


if __name__ == "__main__":
    sys.exit(main())
